-- Pepsi schema, version 4: the fair batched claim (SPEC §7).

-- How many distinct senders the fair claim served at a stage (the dispatcher adds its
-- deltas with the other counters).
ALTER TABLE pepsi.stage_stats ADD COLUMN senders_served bigint NOT NULL DEFAULT 0;

-- The fair claim: for every stage with free capacity, in one call, up to that capacity
-- of pending rows chosen by sender leads (SPEC §7), claimed exactly as the oldest-first
-- claim claims them. Per stage i:
--
-- 1. The senders considered: at most 64 distinct sender keys with pending rows at the
--    stage, in key order from just after p_cursor[i] (NULL: from the first), wrapping
--    round to the first key and stopping before passing the cursor again, so each is
--    considered at most once. A loose index scan over workqueue_pending_sender_idx:
--    one probe per sender, never a walk over one sender's backlog. When a 65th sender
--    exists, the 64th is the stage's window_end (the next call's cursor); else NULL.
-- 2. Each considered sender's lead: its known lead (the p_lead_* arrays, matched on
--    stage and sender) or, for a sender without one, level with the least-served: the
--    least known lead among the considered senders, 0 when none has one. Level, less
--    half a message: a tie would go to the lower id, which is the established
--    sender's, claim after claim (its lead and the newcomer's level rise together), so
--    a newcomer would never be served; half a message ahead, the two alternate.
-- 3. The candidates: each considered sender's p_caps[i] oldest pending rows at the
--    stage, the k-th (k = 0, 1, …) ranked lead + k × p_avg_us[i].
-- 4. The pick: first the stage's p_fifo[i] oldest pending rows whoever sent them, then
--    candidates by (rank, id), skipping rows already taken, up to p_caps[i] rows.
-- 5. The lock: the picked rows FOR NO KEY UPDATE SKIP LOCKED, re-checked pending at
--    the stage; a row another session holds is skipped and the next candidate in line
--    (of those read) takes its slot. Never more than p_caps[i] rows.
--
-- The per-stage arrays must be as long as p_stages and the lead arrays alike, and no
-- stage may be named twice (invalid_parameter_value). A NULL or negative cap counts as
-- 0, the fifo is clamped to [0, cap], and a NULL or non-positive average counts as
-- 1 µs; a NULL lead is no lead, and of two leads for one sender the lesser counts.
--
-- Then one UPDATE for every stage claims the locked rows as CLAIM_OLDEST does (the
-- hop count, 'looped' failure past p_max_hops, one claim token from
-- pepsi.workqueue_claim_seq for the whole call, drawn only when a row is claimed), and
-- the call returns the claimed rows (window_end NULL) and one row per stage with
-- workqueue_id NULL, the stage and its window_end. A stage asked with no capacity
-- considers no sender: its window_end is its cursor, unmoved.
--
-- The reads per stage stay bounded whatever the backlog: 65 probes (plus one to wrap),
-- at most (senders × cap) candidate index entries, the fifo rows, and the picked rows
-- by primary key. Each access has one plan that needs no sort, through one index:
-- - the probes order by sender_key after an equality on the stage: only
--   workqueue_pending_sender_idx gives that order, and each probe starts just after
--   the key before;
-- - the candidates match the stage by equality and the sender as a range of one value,
--   ordered by (sender_key, id): only the sender index gives that order (an equality
--   on the sender would reduce the order to the id, which workqueue_pending_idx or the
--   primary key could serve with a filter), and with the stage fixed the sender's
--   bounds end the scan at the sender's last entry (after a range on the stage they
--   would not: the scan would step over every later sender's entries, which the row
--   counts of EXPLAIN do not show);
-- - the fifo matches the stage as a range of one value and orders by (stage, id),
--   which only workqueue_pending_idx gives (see CLAIM_OLDEST in src/db/sql.rs);
-- - the lock and the update fetch by primary key and test the status as text, so no
--   partial index applies there.
-- PL/pgSQL plans its static statements generically after five calls of a session;
-- the plans above are the same either way (tests/suite/fair_sql.rs checks every
-- nested plan over a million-row backlog, before and after ANALYZE).
CREATE FUNCTION pepsi.workqueue_claim_fair(
    p_stages text[],
    p_caps int4[],
    p_fifo int4[],
    p_avg_us float8[],
    p_cursor text[],
    p_lead_stage text[],
    p_lead_sender text[],
    p_lead_us float8[],
    p_max_hops int4
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 looped boolean, window_end text)
LANGUAGE plpgsql AS $$
DECLARE
    v_n int4 := coalesce(cardinality(p_stages), 0);
    v_stage text;
    v_cap int4;
    v_fifo int4;
    v_avg float8;
    v_cursor text;
    v_senders text[];
    v_window_end text;
    v_order bigint[];
    v_try bigint[];
    v_got bigint[];
    v_pos int4;
    v_locked bigint[] := '{}';
    v_ends text[] := '{}';
    i int4;
BEGIN
    IF coalesce(cardinality(p_caps), 0) <> v_n OR coalesce(cardinality(p_fifo), 0) <> v_n
       OR coalesce(cardinality(p_avg_us), 0) <> v_n OR coalesce(cardinality(p_cursor), 0) <> v_n
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

    FOR i IN 1 .. v_n LOOP
        v_stage := p_stages[i];
        v_cap := greatest(coalesce(p_caps[i], 0), 0);
        v_fifo := least(greatest(coalesce(p_fifo[i], 0), 0), v_cap);
        -- A missing or non-positive average would make every row of a sender rank
        -- alike; one microsecond keeps the order of a sender's own rows.
        v_avg := CASE WHEN p_avg_us[i] > 0 THEN p_avg_us[i] ELSE 1 END;
        v_cursor := p_cursor[i];
        IF v_cap = 0 OR v_stage IS NULL THEN
            v_ends := v_ends || v_cursor;
            CONTINUE;
        END IF;

        -- 1. The window of senders: a loose index scan from just after the cursor,
        -- wrapping round once (a NULL key starts from the first sender). Step n finds
        -- the n-th sender; the 65th only tells that the window is full. OFFSET 0
        -- keeps each step's subqueries whole: pulled up, the probe would be copied
        -- into every expression that uses its result and run once for each.
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
        v_ends := v_ends || v_window_end;

        -- 2–4. Leads, candidates and the pick, in the order the rows should be taken:
        -- the fifo rows by id, then the other candidates by (rank, id). All of them are
        -- kept, so a locked row's slot goes to the next in line.
        WITH known AS (
            SELECT l.sender, min(l.us) AS us
              FROM unnest(p_lead_stage, p_lead_sender, p_lead_us) AS l(stage, sender, us)
             WHERE l.stage = v_stage AND l.us IS NOT NULL
             GROUP BY l.sender
        ), led AS (
            SELECT s.key, coalesce(k.us, min(k.us) OVER () - v_avg / 2, 0) AS lead
              FROM unnest(v_senders) AS s(key)
              LEFT JOIN known k ON k.sender = s.key
        ), candidate AS (
            SELECT c.id, led.lead + (c.k - 1) * v_avg AS rank
              FROM led CROSS JOIN LATERAL unnest(ARRAY(
                  SELECT q.workqueue_id FROM pepsi.workqueue q
                   WHERE q.stage = v_stage AND q.status = 'pending'
                     AND q.sender_key >= led.key AND q.sender_key <= led.key
                   ORDER BY q.sender_key, q.workqueue_id LIMIT v_cap
              )) WITH ORDINALITY AS c(id, k)
        ), oldest AS (
            SELECT o.id FROM unnest(ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                 ORDER BY q.stage, q.workqueue_id LIMIT v_fifo
            )) AS o(id)
        )
        SELECT ARRAY(SELECT o.id FROM oldest o ORDER BY o.id)
               || ARRAY(SELECT c.id FROM candidate c
                         WHERE c.id NOT IN (SELECT o.id FROM oldest o)
                         ORDER BY c.rank, c.id)
          INTO v_order;

        -- 5. Lock the first cap rows in line; what another session holds is skipped
        -- and the next rows in line are tried, until the cap is reached or no
        -- candidate is left.
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
    END LOOP;

    -- The claim itself, for every stage at once, exactly as CLAIM_OLDEST's update:
    -- one token (an InitPlan, so drawn only when a row is claimed), the hop count, and
    -- the looped failure past p_max_hops.
    RETURN QUERY
    WITH claimed AS (
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
          FROM unnest(v_locked) AS p(id)
         WHERE q.workqueue_id = p.id AND q.status::text = 'pending'
        RETURNING q.workqueue_id, q.stage, q.sender_key, q.claim, q.status = 'failed' AS looped
    )
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, c.looped, NULL::text FROM claimed c
    UNION ALL
    SELECT NULL::bigint, e.stage, NULL::text, NULL::bigint, NULL::boolean, e.window_end
      FROM unnest(p_stages, v_ends) AS e(stage, window_end);
END $$;

COMMENT ON FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                               text[], float8[], int4) IS
    'The fair batched claim (SPEC §7): per stage, up to p_caps of pending rows, the '
    'p_fifo oldest first, the rest by sender lead + k × p_avg_us over a window of at most '
    '64 senders after p_cursor; claimed as running (or failed looped past p_max_hops) '
    'under one claim token. Returns the claimed rows, then one row per stage with '
    'workqueue_id NULL and the window_end to use as the next cursor (NULL: start over).';
