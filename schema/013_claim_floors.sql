-- Pepsi schema, version 13: claims that a held snapshot does not slow, on plans that
-- stay (issue 25).
--
-- A snapshot held open (a nightly pg_dump, a forgotten psql) keeps vacuum from
-- removing the pending indexes' entries of rows that were claimed since, and keeps
-- index scans from marking them dead: every oldest-first pick walked that whole dead
-- prefix again, and the cost of a claim grew with the time the snapshot was held.
--
-- 1. Floors. Each claim takes, per stage, a lower bound on the ids it reads (p_floors:
--    NULL for none). The dispatcher remembers it per stage from the claims' answers
--    (no row below it is pending at the stage, save rows that came back there since,
--    which the dispatcher either lowers the floor for — its own claims ending, its
--    flips, resets and resumes — or catches with a claim without floors at least once
--    a second and per poll interval: a resume, requeue or injection by another
--    session). The pick starts at (stage, floor) in workqueue_pending_idx and the
--    sender's candidates at (stage, sender, floor) in workqueue_pending_sender_idx, so
--    neither walks the dead entries below the floor. The fair claim answers each
--    stage's next floor: the lowest id it read from the floor and did not claim, or
--    just past the highest it read when it claimed every one (NULL: it read none).
--    The fair claim's walk over the senders (a loose index scan, whose probes cannot
--    start at a floor) runs only for a stage with more than 512 pending rows from its
--    floor: up to 512, the claim reads them from the floor in id order with their
--    senders, and takes the window of senders and their candidates from them — the
--    same window and candidates, since they are every pending row of the stage.
--    For a deeper backlog the walk still reads every dead entry of the stage; while a
--    snapshot older than 10 s holds the horizon, after a claim that let a stage walk
--    took more than 5 ms, the dispatcher pauses that stage's walk (p_walk false) for
--    20 times as long (at least a second), and the claim takes the window from the
--    stage's 513 oldest rows from the floor instead.
-- 2. Stable plans. Both claims are functions with the planner settings attached:
--    no sequential scan and no bitmap scan of the queue, whatever its statistics say
--    (after an autovacuum truncated the small table, the claim's cached plans turned
--    to sequential scans and stayed there as the table grew, until the next
--    autoanalyze), and no JIT (a disabled path's cost would trip it). The due time of
--    the earliest paused row moves into them too, under the same settings.
--
-- pepsi.workqueue_claim_oldest replaces the oldest-first claim statement; the fair
-- claim gains p_floors and returns the due time and each stage's next floor; both
-- claim the rows their pick locked through pepsi.workqueue_take.
-- Everything else is as in schema 4 and 9: one claimer, SKIP LOCKED only in the pick,
-- one token per call, hops and the looped failure, the 64-sender window.

-- The claim of the rows a pick locked, shared by both claims and exactly as schema 4's:
-- one token (an InitPlan, drawn only when a row is claimed), the hop count, the looped
-- failure past p_max_hops. The rows are fetched by primary key (`= ANY` of the array:
-- an index condition, where a join with the unnested array was planned as a hash join
-- over the whole primary key for a burst the statistics had not seen), with the status
-- tested as text, so no partial index applies. Called inside the claims, under their
-- planner settings.
CREATE FUNCTION pepsi.workqueue_take(p_ids int8[], p_max_hops int4)
RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
               looped boolean)
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE pepsi.workqueue q
           SET status = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                             THEN 'failed' ELSE 'running' END::pepsi.workqueue_status,
               hops = q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int,
               hop_stage = q.stage,
               claim = (SELECT nextval('pepsi.workqueue_claim_seq')),
               state = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                            THEN q.state || jsonb_build_object(
                                'failure_class', 'looped', 'failed_stage', q.stage,
                                'last_error', 'looped: claimed at a changed stage more than MAX_HOPS ('
                                              || p_max_hops || ') times')
                            ELSE q.state END
     WHERE q.workqueue_id = ANY (p_ids) AND q.status::text = 'pending'
    RETURNING q.workqueue_id, q.stage, q.sender_key, q.claim, q.status = 'failed'
$$;

COMMENT ON FUNCTION pepsi.workqueue_take(int8[], int4) IS
    'The claim of rows a pick locked (pepsi.workqueue_claim_oldest and _fair): each '
    'pending one of p_ids set running (or failed looped past p_max_hops) under one new '
    'claim token. Returns the rows claimed.';

CREATE FUNCTION pepsi.workqueue_claim_oldest(
    p_stages text[],
    p_caps int4[],
    p_floors int8[],
    p_max_hops int4
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 due float8, looped boolean)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_n int4 := coalesce(cardinality(p_stages), 0);
    v_due float8;
    v_picked bigint[];
BEGIN
    IF coalesce(cardinality(p_caps), 0) <> v_n
       OR coalesce(cardinality(p_floors), v_n) <> v_n
    THEN
        RAISE EXCEPTION 'workqueue_claim_oldest: the per-stage arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The earliest paused row, as a difference of epochs: an infinite timeout gives an
    -- infinite number, not an error.
    SELECT extract(epoch FROM min(q.timeout))::float8 - extract(epoch FROM now())::float8
      INTO v_due
      FROM pepsi.workqueue q WHERE q.status = 'paused';
    -- The pick, per stage: the stage as a range of one value and the order (stage, id),
    -- which only workqueue_pending_idx gives (an equality would let the planner drop
    -- the stage from the order and walk the primary key); with the floor an inclusive
    -- bound on the id, the scan starts at (stage, floor).
    v_picked := ARRAY(
        SELECT p.workqueue_id
          FROM unnest(p_stages, p_caps, coalesce(p_floors, array_fill(NULL::int8, ARRAY[v_n])))
               AS w(stage, cap, lo)
         CROSS JOIN LATERAL (
             SELECT q.workqueue_id FROM pepsi.workqueue q
              WHERE q.stage >= w.stage AND q.stage <= w.stage AND q.status = 'pending'
                AND q.workqueue_id >= coalesce(w.lo, -9223372036854775808)
              ORDER BY q.stage, q.workqueue_id LIMIT w.cap
                FOR NO KEY UPDATE SKIP LOCKED) p
         WHERE w.cap > 0);
    -- The claim, exactly as schema 4's (pepsi.workqueue_take).
    RETURN QUERY
    WITH claimed AS (SELECT * FROM pepsi.workqueue_take(v_picked, p_max_hops))
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, v_due, c.looped FROM claimed c
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::bigint, v_due, NULL::boolean
     WHERE NOT EXISTS (SELECT 1 FROM claimed);
END $$;

COMMENT ON FUNCTION pepsi.workqueue_claim_oldest(text[], int4[], int8[], int4) IS
    'The oldest-first batched claim (SPEC §6): per stage, up to p_caps of its oldest '
    'pending rows with an id of at least p_floors (NULL: any), claimed as running (or '
    'failed looped past p_max_hops) under one claim token. Returns the claimed rows '
    'with the seconds until the earliest paused row is due, or one row with only that.';

DROP FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                         text[], float8[], int4);
DELETE FROM pepsi.role_grants
 WHERE object = 'FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4)';

CREATE FUNCTION pepsi.workqueue_claim_fair(
    p_stages text[],
    p_caps int4[],
    p_fifo int4[],
    p_avg_us float8[],
    p_cursor text[],
    p_lead_stage text[],
    p_lead_sender text[],
    p_lead_us float8[],
    p_max_hops int4,
    p_floors int8[],
    p_walk boolean[] DEFAULT NULL
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 due float8, looped boolean, window_end text, next_floor bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_n int4 := coalesce(cardinality(p_stages), 0);
    v_due float8;
    v_stage text;
    v_cap int4;
    v_fifo int4;
    v_avg float8;
    v_cursor text;
    v_lo int8;
    v_senders text[];
    v_window_end text;
    v_head bigint[];
    v_set_ids bigint[];
    v_set_keys text[];
    v_cand_ids bigint[];
    v_cand_keys text[];
    v_cand_ks int8[];
    v_oldest bigint[];
    v_order bigint[];
    v_try bigint[];
    v_got bigint[];
    v_pos int4;
    v_locked bigint[] := '{}';
    v_ends text[] := '{}';
    v_next int8[] := '{}';
    i int4;
BEGIN
    IF coalesce(cardinality(p_caps), 0) <> v_n OR coalesce(cardinality(p_fifo), 0) <> v_n
       OR coalesce(cardinality(p_avg_us), 0) <> v_n OR coalesce(cardinality(p_cursor), 0) <> v_n
       OR coalesce(cardinality(p_floors), v_n) <> v_n
       OR coalesce(cardinality(p_walk), v_n) <> v_n
    THEN
        RAISE EXCEPTION 'workqueue_claim_fair: the per-stage arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_lead_sender), 0) <> coalesce(cardinality(p_lead_stage), 0)
       OR coalesce(cardinality(p_lead_us), 0) <> coalesce(cardinality(p_lead_stage), 0)
    THEN
        RAISE EXCEPTION 'workqueue_claim_fair: the lead arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT count(DISTINCT s.s) <> count(*) FROM unnest(p_stages) AS s(s)) THEN
        RAISE EXCEPTION 'workqueue_claim_fair: a stage is named twice'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- The earliest paused row, as a difference of epochs (see workqueue_claim_oldest).
    SELECT extract(epoch FROM min(q.timeout))::float8 - extract(epoch FROM now())::float8
      INTO v_due
      FROM pepsi.workqueue q WHERE q.status = 'paused';

    FOR i IN 1 .. v_n LOOP
        v_stage := p_stages[i];
        v_cap := greatest(coalesce(p_caps[i], 0), 0);
        v_fifo := least(greatest(coalesce(p_fifo[i], 0), 0), v_cap);
        v_avg := CASE WHEN p_avg_us[i] > 0 THEN p_avg_us[i] ELSE 1 END;
        v_cursor := p_cursor[i];
        v_lo := p_floors[i];
        IF v_cap = 0 OR v_stage IS NULL THEN
            v_ends := v_ends || v_cursor;
            v_next := v_next || v_lo;
            CONTINUE;
        END IF;

        -- 0. As in schema 9, from the floor: the stage's oldest pending rows, at most
        -- 65 entries past the floor; all of them when they fit the cap and a window.
        v_head := ARRAY(
            SELECT q.workqueue_id FROM pepsi.workqueue q
             WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
               AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
             ORDER BY q.stage, q.workqueue_id LIMIT least(v_cap, 64) + 1);
        v_set_ids := NULL;
        v_set_keys := NULL;
        IF cardinality(v_head) > least(v_cap, 64) THEN
            SELECT array_agg(x.workqueue_id ORDER BY x.workqueue_id),
                   array_agg(x.sender_key ORDER BY x.workqueue_id)
              INTO v_set_ids, v_set_keys
              FROM (SELECT q.workqueue_id, q.sender_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
        END IF;
        IF cardinality(v_head) <= least(v_cap, 64) THEN
            v_order := v_head;
            v_ends := v_ends || NULL::text;
        ELSE
            IF cardinality(v_set_ids) <= 512 OR NOT coalesce(p_walk[i], true) THEN
                -- 1–3 from the stage's pending rows themselves, when there are no more
                -- than 512 of them from the floor (read in id order, with their senders):
                -- they are every pending row of the stage, so the senders among them, in
                -- key order from just after the cursor and wrapping round, are the window
                -- the loose index scan would find, and a sender's oldest rows among them
                -- its candidates. The walk cannot start at the floor; this read does.
                -- When p_walk pauses the stage's walk (the dispatcher found it slow: a
                -- held snapshot keeps every dead entry it probes), the same from its 513
                -- oldest rows however many wait: a sender with none among them waits for
                -- the next claim that walks.
                WITH keys AS (
                    SELECT DISTINCT k.key FROM unnest(v_set_keys) AS k(key)
                ), ring AS (
                    SELECT k.key, row_number() OVER (
                               ORDER BY (v_cursor IS NOT NULL AND k.key <= v_cursor), k.key) AS n
                      FROM keys k
                )
                SELECT ARRAY(SELECT r.key FROM ring r WHERE r.n <= 64 ORDER BY r.n),
                       (SELECT r.key FROM ring r WHERE r.n = 64 AND EXISTS (
                            SELECT 1 FROM ring x WHERE x.n = 65))
                  INTO v_senders, v_window_end;
                -- Each sender's candidates: its oldest rows among them.
                SELECT coalesce(array_agg(r.id ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.key ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.k ORDER BY r.id), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_ks
                  FROM (SELECT s.id, s.key,
                               row_number() OVER (PARTITION BY s.key ORDER BY s.id) AS k
                          FROM unnest(v_set_ids, v_set_keys) AS s(id, key)) r
                 WHERE r.k <= v_cap AND r.key = ANY (v_senders);
                v_oldest := v_set_ids[1 : v_fifo];
            ELSE
                -- 1. The window of senders, as in schema 4. The probes cannot start at the
                -- floor (each is a range on the sender), so a sender whose rows at the
                -- stage are all claimed still costs its dead entries here; step 0 leaves
                -- this walk to stages with more waiting rows than the cap.
                WITH RECURSIVE walk(key, n, wrapped) AS (
                    SELECT v_cursor, 0, false
                  UNION ALL
                    SELECT nx.key, w.n + 1, nx.wrapped
                      FROM walk w
                     CROSS JOIN LATERAL (
                         SELECT (SELECT q.sender_key FROM pepsi.workqueue q
                                  WHERE q.stage = v_stage AND q.status = 'pending'
                                    AND q.sender_key > w.key
                                  ORDER BY q.sender_key LIMIT 1) AS key
                         OFFSET 0
                     ) a
                     CROSS JOIN LATERAL (
                         SELECT coalesce(a.key, CASE WHEN NOT w.wrapped THEN (
                                    SELECT q.sender_key FROM pepsi.workqueue q
                                     WHERE q.stage = v_stage AND q.status = 'pending'
                                     ORDER BY q.sender_key LIMIT 1) END) AS key,
                                w.wrapped OR a.key IS NULL AS wrapped
                         OFFSET 0
                     ) nx
                     WHERE w.n < 65 AND nx.key IS NOT NULL
                       AND (NOT nx.wrapped OR v_cursor IS NULL OR nx.key <= v_cursor)
                )
                SELECT ARRAY(SELECT w.key FROM walk w WHERE w.n BETWEEN 1 AND 64 ORDER BY w.n),
                       (SELECT w.key FROM walk w WHERE w.n = 64 AND EXISTS (
                            SELECT 1 FROM walk x WHERE x.n = 65))
                  INTO v_senders, v_window_end;
                -- 2–3. As in schema 4; each sender's candidates and the fifo start
                -- at the floor (the sender's range is inclusive, so the scan starts
                -- at (stage, sender, floor)).
                SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(s.key), '{}'),
                       coalesce(array_agg(c.k), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_ks
                  FROM unnest(v_senders) AS s(key)
                 CROSS JOIN LATERAL unnest(ARRAY(
                     SELECT q.workqueue_id FROM pepsi.workqueue q
                      WHERE q.stage = v_stage AND q.status = 'pending'
                        AND q.sender_key >= s.key AND q.sender_key <= s.key
                        AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                      ORDER BY q.sender_key, q.workqueue_id LIMIT v_cap
                 )) WITH ORDINALITY AS c(id, k);
                v_oldest := ARRAY(
                    SELECT q.workqueue_id FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT v_fifo);
            END IF;
            v_ends := v_ends || v_window_end;

            -- 4. The order, as in schema 4: the oldest first, then the candidates by
            -- their sender's lead + k × the average (the k-th oldest of its sender).
            WITH known AS (
                SELECT l.sender, min(l.us) AS us
                  FROM unnest(p_lead_stage, p_lead_sender, p_lead_us) AS l(stage, sender, us)
                 WHERE l.stage = v_stage AND l.us IS NOT NULL
                 GROUP BY l.sender
            ), led AS (
                SELECT s.key, coalesce(k.us, min(k.us) OVER () - v_avg / 2, 0) AS lead
                  FROM unnest(v_senders) AS s(key)
                  LEFT JOIN known k ON k.sender = s.key
            )
            SELECT ARRAY(SELECT o.id FROM unnest(v_oldest) AS o(id) ORDER BY o.id)
                   || ARRAY(SELECT c.id
                              FROM unnest(v_cand_ids, v_cand_keys, v_cand_ks) AS c(id, key, k)
                              JOIN led ON led.key = c.key
                             WHERE c.id <> ALL (v_oldest)
                             ORDER BY led.lead + (c.k - 1) * v_avg, c.id)
              INTO v_order;
        END IF;

        -- 5. The lock, as in schema 4.
        v_got := '{}';
        v_pos := 0;
        WHILE cardinality(v_got) < v_cap AND v_pos < cardinality(v_order) LOOP
            v_try := v_order[v_pos + 1 : v_pos + v_cap - cardinality(v_got)];
            v_pos := v_pos + cardinality(v_try);
            v_got := v_got || ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.workqueue_id = ANY (v_try)
                   AND q.stage = v_stage AND q.status::text = 'pending'
                   FOR NO KEY UPDATE SKIP LOCKED);
        END LOOP;
        v_locked := v_locked || v_got;

        -- The next floor: every pending row of the stage from the floor up to the
        -- lowest row of step 0 not claimed was claimed now (step 0 read them in id
        -- order), so the next claim may start there; when step 0's rows were all
        -- claimed, just past the highest; when it read none, where it started.
        v_next := v_next || coalesce(
            (SELECT min(h.id) FROM unnest(v_head) AS h(id) WHERE h.id <> ALL (v_got)),
            (SELECT max(h.id) + 1 FROM unnest(v_head) AS h(id)),
            v_lo);
    END LOOP;

    RETURN QUERY
    WITH claimed AS (SELECT * FROM pepsi.workqueue_take(v_locked, p_max_hops))
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, v_due, c.looped, NULL::text,
           NULL::bigint
      FROM claimed c
    UNION ALL
    SELECT NULL::bigint, e.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           e.window_end, e.next_floor
      FROM unnest(p_stages, v_ends, v_next) AS e(stage, window_end, next_floor)
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::bigint, v_due, NULL::boolean,
           NULL::text, NULL::bigint
     WHERE v_n = 0;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                               text[], float8[], int4, int8[], boolean[]) IS
    'The fair batched claim (SPEC §7): per stage, up to p_caps of pending rows with an id '
    'of at least p_floors (NULL: any), the p_fifo oldest first, the rest by sender lead + '
    'k × p_avg_us over a window of at most 64 senders after p_cursor (found among the '
    'stage''s 513 oldest rows from the floor where p_walk is false); claimed as running '
    '(or failed looped past p_max_hops) under one claim token. Returns the claimed rows, '
    'then one row per stage with workqueue_id NULL, the window_end to use as the next '
    'cursor (NULL: start over) and the next floor; every row carries the seconds until '
    'the earliest paused row is due (with no stage asked, one row holds only that).';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_take(int8[], int4)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_claim_oldest(text[], int4[], int8[], int4)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4, int8[], boolean[])');
