-- Pepsi schema, version 9: the fair claim skips its ranking where it cannot matter.
--
-- pepsi.workqueue_claim_fair (schema 4) gains a step 0: a stage with few pending rows
-- (no more than its cap and no more than 64) has them all claimed without the walk
-- over its senders and the ranking of their candidates, which together cost a few
-- tenths of a millisecond per stage and call, and ran for every stage asked: for every
-- empty stage of a quiet pipeline, in front of every message. Every other stage is
-- claimed exactly as before, and the result is the same set of rows, window end and
-- token in both cases.
CREATE OR REPLACE FUNCTION pepsi.workqueue_claim_fair(
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

        -- 0. A stage whose pending rows are no more than its cap and no more than a
        -- window's 64 senders could hold: steps 1 to 4 would consider every sender
        -- (the window then ends: NULL) and pick every row (each sender's rows fit its
        -- cap), so the rows are taken as they are, oldest first, through the pending
        -- index the fifo of step 4 reads, at most 65 entries. Only the order of a pick
        -- that takes every row is left out, and that changes no outcome.
        v_order := ARRAY(
            SELECT q.workqueue_id FROM pepsi.workqueue q
             WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
             ORDER BY q.stage, q.workqueue_id LIMIT least(v_cap, 64) + 1);
        IF cardinality(v_order) <= least(v_cap, 64) THEN
            v_ends := v_ends || NULL::text;
        ELSE
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
        END IF;

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
