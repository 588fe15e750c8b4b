-- Pepsi schema, version 24: the fair claim's generic plans read no more than its
-- window, and a stage where one sender waits is claimed as the oldest-first claim
-- claims it.
--
-- Plans. pepsi.workqueue_claim_fair (schemas 13 and 18) is PL/pgSQL, and PL/pgSQL
-- switches a statement to a generic plan, made without the parameters' values, after
-- five calls in a session when that plan looks no dearer. One of its statements, the
-- read of a stage's 513 oldest pending rows from the floor (`q.stage >= v_stage AND
-- q.stage <= v_stage … ORDER BY q.stage, q.workqueue_id LIMIT 513`), then went wrong:
-- without the stage's value the planner guessed a handful of rows, read them from the
-- covering (stage, sender_key, workqueue_id) index and sorted them (a top-N or an
-- incremental sort), and what it read was every pending row of the stage. From the
-- sixth claim of the dispatcher's session on, a claim cost time in proportion to the
-- stage's backlog: 1.5 ms with 1,000 rows waiting became 20 ms with 100,000. A million
-- rows happened to give statistics that kept the right plan. The function now plans
-- with enable_sort and enable_incremental_sort off (beside the settings it had): a
-- plan that sorts what an index scan gives costs more than any that reads the pending
-- index in its order, so the read stops at 513 entries under either kind of plan. A
-- sort a statement cannot do without (the ranking of the candidates) is made all the
-- same. This keeps the cached plans: forcing a custom plan per call (plan_cache_mode)
-- flattened the cost too, but planning every statement at every claim cost about 1 ms
-- more per call. The other claim, pepsi.workqueue_claim_oldest, reads no more than its
-- capacity under its generic plans (16 rows of 100,000 at the eighth call).
--
-- One sender. When the stage's first and last waiting sender keys are the same (two
-- probes of the sender index), the fair order is the order of age, and the function
-- takes the stage's oldest rows from the floor up to the cap, skipping the read of 513
-- rows, the window and the ranking: what the full pick would take. Claims of 8 from
-- 10,000 rows of one sender, the claimed rows deleted between them, cost 1.5 times the
-- oldest-first claim's instead of 7 times. A bulk sender's backlog at a delivery stage
-- is the case. Not from a sweep, nor while the senders' walk is paused. Everything else
-- is as in schema 18.

CREATE OR REPLACE FUNCTION pepsi.workqueue_claim_fair(
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
    p_walk boolean[] DEFAULT NULL,
    p_sweeps int8[] DEFAULT NULL
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 due float8, looped boolean, window_end text, next_floor bigint,
                 next_sweep bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET enable_sort = off
SET enable_incremental_sort = off
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
    v_sw int8;
    v_part int4;
    v_floor_part bigint[];
    v_set_pos int4;
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
    v_sweep_next int8[] := '{}';
    v_one boolean;
    i int4;
BEGIN
    IF coalesce(cardinality(p_caps), 0) <> v_n OR coalesce(cardinality(p_fifo), 0) <> v_n
       OR coalesce(cardinality(p_avg_us), 0) <> v_n OR coalesce(cardinality(p_cursor), 0) <> v_n
       OR coalesce(cardinality(p_floors), v_n) <> v_n
       OR coalesce(cardinality(p_walk), v_n) <> v_n
       OR coalesce(cardinality(p_sweeps), v_n) <> v_n
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
        -- A sweep at or below the floor is none: the set is read from the floor.
        v_sw := CASE WHEN p_sweeps[i] > coalesce(v_lo, -9223372036854775808)
                     THEN p_sweeps[i] END;
        IF v_cap = 0 OR v_stage IS NULL THEN
            v_ends := v_ends || v_cursor;
            v_next := v_next || v_lo;
            v_sweep_next := v_sweep_next || v_sw;
            CONTINUE;
        END IF;

        IF v_sw IS NULL THEN
            -- 0. As in schema 9, from the floor: the stage's oldest pending rows, at
            -- most 65 entries past the floor; all of them when they fit the cap and a
            -- window.
            v_head := ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                   AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                 ORDER BY q.stage, q.workqueue_id LIMIT least(v_cap, 64) + 1);
        ELSE
            -- 0. From a sweep, only the oldest rows' slots are read from the floor: the
            -- rows the sweep passed over lie there, among the entries of every row
            -- claimed above them, and the set read below tells whether all fit.
            v_head := ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                   AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                 ORDER BY q.stage, q.workqueue_id LIMIT v_fifo);
        END IF;
        v_set_ids := NULL;
        v_set_keys := NULL;
        v_part := 0;
        -- One sender waiting (schema 24): the stage's first and last sender keys in the
        -- sender index are one. Then the fair order is the oldest rows' order, and the
        -- claim takes them from the head, up to the cap, as the oldest-first claim
        -- does: no set to read, no window, no ranking. Not from a sweep, nor while the
        -- walk is paused (the first probe starts below the floor, as the walk's do).
        v_one := false;
        IF v_sw IS NULL AND coalesce(p_walk[i], true)
           AND cardinality(v_head) > least(v_cap, 64) THEN
            v_one := (SELECT q.sender_key FROM pepsi.workqueue q
                       WHERE q.stage = v_stage AND q.status = 'pending'
                       ORDER BY q.sender_key LIMIT 1)
                     IS NOT DISTINCT FROM
                     (SELECT q.sender_key FROM pepsi.workqueue q
                       WHERE q.stage = v_stage AND q.status = 'pending'
                       ORDER BY q.sender_key DESC LIMIT 1);
            IF v_one AND v_cap > 64 THEN
                v_head := ARRAY(
                    SELECT q.workqueue_id FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT v_cap + 1);
            END IF;
        END IF;
        IF v_one THEN
            NULL;
        ELSIF v_sw IS NOT NULL THEN
            -- The set read from the sweep (see the head of this file): the stage's 513
            -- oldest rows from it, and when fewer wait there, after them the oldest
            -- from the floor up to the sweep (the sweep wraps round). In that order, so
            -- that a position in the set is a place in the sweep. Fewer than 513 in
            -- all: they are every pending row of the stage from the floor.
            SELECT coalesce(array_agg(x.workqueue_id ORDER BY x.workqueue_id), '{}'),
                   coalesce(array_agg(x.sender_key ORDER BY x.workqueue_id), '{}')
              INTO v_set_ids, v_set_keys
              FROM (SELECT q.workqueue_id, q.sender_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= v_sw
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
            v_part := cardinality(v_set_ids);
            IF v_part < 513 THEN
                SELECT v_set_ids || coalesce(array_agg(x.workqueue_id ORDER BY x.workqueue_id), '{}'),
                       v_set_keys || coalesce(array_agg(x.sender_key ORDER BY x.workqueue_id), '{}')
                  INTO v_set_ids, v_set_keys
                  FROM (SELECT q.workqueue_id, q.sender_key FROM pepsi.workqueue q
                         WHERE q.stage >= v_stage AND q.stage <= v_stage
                           AND q.status = 'pending'
                           AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                           AND q.workqueue_id < v_sw
                         ORDER BY q.stage, q.workqueue_id LIMIT 513 - v_part) x;
            END IF;
        ELSIF cardinality(v_head) > least(v_cap, 64) THEN
            SELECT array_agg(x.workqueue_id ORDER BY x.workqueue_id),
                   array_agg(x.sender_key ORDER BY x.workqueue_id)
              INTO v_set_ids, v_set_keys
              FROM (SELECT q.workqueue_id, q.sender_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
        END IF;
        IF v_one OR (v_sw IS NULL AND cardinality(v_head) <= least(v_cap, 64)) THEN
            v_order := v_head;
            v_ends := v_ends || NULL::text;
        ELSIF v_sw IS NOT NULL AND cardinality(v_set_ids) <= least(v_cap, 64) THEN
            v_order := v_set_ids;
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
                -- The oldest: the set's first rows, or from a sweep, the head (read from
                -- the floor for just these slots).
                IF v_sw IS NULL THEN
                    v_oldest := v_set_ids[1 : v_fifo];
                ELSE
                    v_oldest := v_head;
                END IF;
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
                IF v_sw IS NULL THEN
                    v_oldest := ARRAY(
                        SELECT q.workqueue_id FROM pepsi.workqueue q
                         WHERE q.stage >= v_stage AND q.stage <= v_stage
                           AND q.status = 'pending'
                           AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                         ORDER BY q.stage, q.workqueue_id LIMIT v_fifo);
                ELSE
                    v_oldest := v_head;
                END IF;
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
        -- claimed, just past the highest; when it read none, where it started. From a
        -- sweep, the set's rows read from the floor after the wrap (all of the set
        -- when it holds fewer than 513: every pending row from the floor) were read
        -- in id order too, and the higher of the two holds.
        v_floor_part := CASE WHEN cardinality(v_set_ids) < 513 THEN v_set_ids
                             ELSE v_set_ids[v_part + 1 :] END;
        v_next := v_next || greatest(
            coalesce(
                (SELECT min(h.id) FROM unnest(v_head) AS h(id) WHERE h.id <> ALL (v_got)),
                (SELECT max(h.id) + 1 FROM unnest(v_head) AS h(id)),
                v_lo),
            CASE WHEN v_sw IS NOT NULL THEN coalesce(
                (SELECT min(w.id) FROM unnest(v_floor_part) AS w(id) WHERE w.id <> ALL (v_got)),
                (SELECT max(w.id) + 1 FROM unnest(v_floor_part) AS w(id))) END);
        -- The next sweep: just past the last row of the set, in its order, that was
        -- claimed now (the set's rows before it that were left wait for the oldest
        -- rows' slots or the sweep's next round); the sweep unmoved when nothing of
        -- the set was claimed or the senders were walked; none when the stage had no
        -- set or all of it fitted.
        IF v_set_ids IS NULL OR cardinality(v_set_ids) <= least(v_cap, 64) THEN
            v_sweep_next := v_sweep_next || NULL::int8;
        ELSE
            v_set_pos := (SELECT max(s.n) FROM unnest(v_set_ids) WITH ORDINALITY AS s(id, n)
                           WHERE s.id = ANY (v_got));
            v_sweep_next := v_sweep_next || CASE
                WHEN v_set_pos IS NULL OR (cardinality(v_set_ids) > 512
                                           AND coalesce(p_walk[i], true))
                THEN v_sw
                ELSE v_set_ids[v_set_pos] + 1 END;
        END IF;
    END LOOP;

    RETURN QUERY
    WITH claimed AS (SELECT * FROM pepsi.workqueue_take(v_locked, p_max_hops))
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, v_due, c.looped, NULL::text,
           NULL::bigint, NULL::bigint
      FROM claimed c
    UNION ALL
    SELECT NULL::bigint, e.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           e.window_end, e.next_floor, e.next_sweep
      FROM unnest(p_stages, v_ends, v_next, v_sweep_next)
           AS e(stage, window_end, next_floor, next_sweep)
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::bigint, v_due, NULL::boolean,
           NULL::text, NULL::bigint, NULL::bigint
     WHERE v_n = 0;
END $$;

