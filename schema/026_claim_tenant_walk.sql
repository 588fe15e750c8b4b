-- Pepsi schema, version 26: the fair claim costs what it did before tenants when each
-- tenant waits with one sender.
--
-- Schema 25 walked the window's tenants (a probe per tenant), then each tenant's
-- senders (at least one more probe per tenant, to learn that no second sender waits),
-- and read the stage's 513 oldest rows into three arrays, each sorted by id on its
-- own. With tenants of one sender each (the default tenants of plain senders) a claim
-- cost about 0.7 ms more than schema 24's. Now:
-- - The tenants' walk goes over the pending index's (tenant, sender) pairs: the entry
--   after a tenant's first sender is either the next tenant's first sender, or that
--   tenant's second sender, which marks the tenant as one of several senders and is
--   followed by one probe to the next tenant. A tenant of one sender costs one probe,
--   as a sender did in schema 24.
-- - The senders' walk runs only for tenants so marked or with a cursor of their own;
--   when the window has none, each tenant's first sender is its walk.
-- - The set reads aggregate their rows in the order their subquery reads them (by id),
--   without a sort per array, and the sweep's position in the set is looked up only
--   when the claim did not walk.
-- - The rates' allowances are looked up only at a stage with a rate.
-- What the function claims and answers is as in schema 25.
--
-- Named tenants. pepsi.tenant_of, which the insert trigger calls for every row, turned
-- every pattern of pepsi.tenants into a LIKE pattern and counted its literal characters
-- at every call: with 100 patterns an insert cost about 0.3 ms more. The table now keeps
-- both as generated columns, in an index in the order of preference, so the lookup reads
-- the patterns most literal first and stops at the first that matches. And
-- pepsi.tenants_rekey looks each waiting sender key up once, not twice per queue row.
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
    p_sweeps int8[] DEFAULT NULL,
    p_lead_w float8[] DEFAULT NULL,
    p_tlead_stage text[] DEFAULT NULL,
    p_tlead_tenant text[] DEFAULT NULL,
    p_tlead_us float8[] DEFAULT NULL,
    p_tlead_w float8[] DEFAULT NULL,
    p_tcur_stage text[] DEFAULT NULL,
    p_tcur_tenant text[] DEFAULT NULL,
    p_tcur_sender text[] DEFAULT NULL,
    p_allow_default int4[] DEFAULT NULL,
    p_allow_stage text[] DEFAULT NULL,
    p_allow_tenant text[] DEFAULT NULL,
    p_allow_n int4[] DEFAULT NULL
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 due float8, looped boolean, window_end text, next_floor bigint,
                 next_sweep bigint, tenant_key text)
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
    v_tenants text[];
    v_tcurs text[];
    v_tfirst text[];
    v_several boolean[];
    v_budget int4;
    v_walk_i int4[];
    v_walk_n int4[];
    v_walk_keys text[];
    v_ws_tenants text[];
    v_ws_keys text[];
    v_tc_stage text[] := '{}';
    v_tc_tenant text[] := '{}';
    v_tc_end text[] := '{}';
    v_t1 text;
    v_t2 text;
    v_s1 text;
    v_s2 text;
    v_window_end text;
    v_head bigint[];
    v_set_ids bigint[];
    v_set_keys text[];
    v_set_tenants text[];
    v_cand_ids bigint[];
    v_cand_keys text[];
    v_cand_tis int4[];
    v_ws_tis int4[];
    v_tl_lead float8[];
    v_tl_w float8[];
    v_tl_least float8;
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
    v_limited boolean;
    v_single boolean;
    v_tl_allow int4[];
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
       OR coalesce(cardinality(p_lead_w), cardinality(p_lead_stage), 0)
          <> coalesce(cardinality(p_lead_stage), 0)
       OR coalesce(cardinality(p_tlead_tenant), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tlead_us), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tlead_w), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tcur_tenant), 0) <> coalesce(cardinality(p_tcur_stage), 0)
       OR coalesce(cardinality(p_tcur_sender), 0) <> coalesce(cardinality(p_tcur_stage), 0)
       OR coalesce(cardinality(p_allow_default), v_n) <> v_n
       OR coalesce(cardinality(p_allow_tenant), 0) <> coalesce(cardinality(p_allow_stage), 0)
       OR coalesce(cardinality(p_allow_n), 0) <> coalesce(cardinality(p_allow_stage), 0)
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

        -- Rates (§7): a stage where some tenant may start fewer rows than the cap is
        -- claimed through the ranking alone, which holds each tenant of the window to
        -- its allowance: no FIFO slots, no row taken whole or by the one-sender path.
        v_limited := p_allow_default[i] IS NOT NULL
                     OR (SELECT bool_or(a.stage = v_stage)
                           FROM unnest(p_allow_stage) AS a(stage));
        v_limited := coalesce(v_limited, false);
        IF v_limited THEN
            v_fifo := 0;
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
        v_set_tenants := NULL;
        v_part := 0;
        -- One sender waiting (schema 24): the stage's first and last sender keys in the
        -- sender index are one. Then the fair order is the oldest rows' order, and the
        -- claim takes them from the head, up to the cap, as the oldest-first claim
        -- does: no set to read, no window, no ranking. Not from a sweep, nor while the
        -- walk is paused (the first probe starts below the floor, as the walk's do).
        v_one := false;
        IF v_sw IS NULL AND coalesce(p_walk[i], true) AND NOT v_limited
           AND cardinality(v_head) > least(v_cap, 64) THEN
            SELECT q.tenant_key, q.sender_key INTO v_t1, v_s1 FROM pepsi.workqueue q
             WHERE q.stage = v_stage AND q.status = 'pending'
             ORDER BY q.tenant_key, q.sender_key LIMIT 1;
            SELECT q.tenant_key, q.sender_key INTO v_t2, v_s2 FROM pepsi.workqueue q
             WHERE q.stage = v_stage AND q.status = 'pending'
             ORDER BY q.tenant_key DESC, q.sender_key DESC LIMIT 1;
            v_one := v_t1 IS NOT DISTINCT FROM v_t2 AND v_s1 IS NOT DISTINCT FROM v_s2;
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
            -- all: they are every pending row of the stage from the floor. Each set
            -- read aggregates its rows in the order its subquery gives them (by id; a
            -- subquery with a LIMIT is not merged into the aggregate's query), so the
            -- arrays are filled in one pass without a sort of their own.
            SELECT coalesce(array_agg(x.workqueue_id), '{}'),
                   coalesce(array_agg(x.sender_key), '{}'),
                   coalesce(array_agg(x.tenant_key), '{}')
              INTO v_set_ids, v_set_keys, v_set_tenants
              FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= v_sw
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
            v_part := cardinality(v_set_ids);
            IF v_part < 513 THEN
                SELECT v_set_ids || coalesce(array_agg(x.workqueue_id), '{}'),
                       v_set_keys || coalesce(array_agg(x.sender_key), '{}'),
                       v_set_tenants || coalesce(array_agg(x.tenant_key), '{}')
                  INTO v_set_ids, v_set_keys, v_set_tenants
                  FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                         WHERE q.stage >= v_stage AND q.stage <= v_stage
                           AND q.status = 'pending'
                           AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                           AND q.workqueue_id < v_sw
                         ORDER BY q.stage, q.workqueue_id LIMIT 513 - v_part) x;
            END IF;
        ELSIF cardinality(v_head) > least(v_cap, 64) OR v_limited THEN
            SELECT array_agg(x.workqueue_id),
                   array_agg(x.sender_key),
                   array_agg(x.tenant_key)
              INTO v_set_ids, v_set_keys, v_set_tenants
              FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
        END IF;
        IF v_one OR (v_sw IS NULL AND cardinality(v_head) <= least(v_cap, 64)
                     AND NOT v_limited) THEN
            v_order := v_head;
            v_ends := v_ends || NULL::text;
        ELSIF v_sw IS NOT NULL AND cardinality(v_set_ids) <= least(v_cap, 64)
              AND NOT v_limited THEN
            v_order := v_set_ids;
            v_ends := v_ends || NULL::text;
        ELSE
            IF cardinality(v_set_ids) <= 512 OR NOT coalesce(p_walk[i], true) THEN
                -- 1–3 from the stage's pending rows themselves, when there are no more
                -- than 512 of them from the floor (read in id order, with their senders
                -- and tenants): they are every pending row of the stage, so the tenants
                -- among them, in key order from just after the cursor and wrapping
                -- round, are the window the loose index scan would find; every sender of
                -- those tenants among them is walked, and a sender's oldest rows among
                -- them are its candidates. The walk cannot start at the floor; this read
                -- does. When p_walk pauses the stage's walk (the dispatcher found it
                -- slow: a held snapshot keeps every dead entry it probes), the same from
                -- its 513 oldest rows however many wait: a sender with none among them
                -- waits for the next claim that walks.
                WITH keys AS (
                    SELECT DISTINCT k.key FROM unnest(v_set_tenants) AS k(key)
                ), ring AS (
                    SELECT k.key, row_number() OVER (
                               ORDER BY (v_cursor IS NOT NULL AND k.key <= v_cursor), k.key) AS n
                      FROM keys k
                )
                SELECT ARRAY(SELECT r.key FROM ring r WHERE r.n <= 64 ORDER BY r.n),
                       (SELECT r.key FROM ring r WHERE r.n = 64 AND EXISTS (
                            SELECT 1 FROM ring x WHERE x.n = 65))
                  INTO v_tenants, v_window_end;
                -- Each sender's candidates: its oldest rows among them.
                SELECT coalesce(array_agg(r.id ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.key ORDER BY r.id), '{}'),
                       coalesce(array_agg(array_position(v_tenants, r.tenant) ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.k ORDER BY r.id), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks
                  FROM (SELECT s.id, s.key, s.tenant,
                               row_number() OVER (PARTITION BY s.tenant, s.key ORDER BY s.id) AS k
                          FROM unnest(v_set_ids, v_set_keys, v_set_tenants) AS s(id, key, tenant)) r
                 WHERE r.k <= v_cap AND r.tenant = ANY (v_tenants);
                v_single := (SELECT count(DISTINCT c.key) FROM unnest(v_cand_keys) AS c(key))
                            = (SELECT count(DISTINCT c.ti) FROM unnest(v_cand_tis) AS c(ti));
                -- The oldest: the set's first rows, or from a sweep, the head (read from
                -- the floor for just these slots).
                IF v_sw IS NULL THEN
                    v_oldest := v_set_ids[1 : v_fifo];
                ELSE
                    v_oldest := v_head;
                END IF;
            ELSE
                -- 1. The window of tenants, as schema 4's of senders, walked over the
                -- index's (tenant, sender) pairs. From a tenant's first sender the next
                -- entry is either the next tenant's first sender (so a tenant waiting
                -- with one sender costs one probe, as a sender did before tenants) or
                -- the same tenant's second sender: then the tenant is marked as one of
                -- several senders, for step 2, and one more probe skips to the next
                -- tenant. The probes cannot start at the floor (each is a range on the
                -- tenant), so a tenant whose rows at the stage are all claimed still
                -- costs its dead entries here; step 0 leaves this walk to stages with
                -- more waiting rows than the cap. The wrap's probe runs only when the
                -- others find nothing. The walk's last row is the 65th tenant or a row
                -- marked done; either carries the mark of the tenant before it.
                WITH RECURSIVE walk(key, first, n, wrapped, several, done) AS (
                    SELECT v_cursor, NULL::text, 0, false, false, false
                  UNION ALL
                    SELECT CASE WHEN g.go THEN f.key END, CASE WHEN g.go THEN f.first END,
                           w.n + 1, f.wrapped, coalesce(a.key = w.key, false), NOT g.go
                      FROM walk w
                      LEFT JOIN LATERAL (
                          SELECT q.tenant_key AS key, q.sender_key AS first
                            FROM pepsi.workqueue q
                           WHERE w.first IS NOT NULL
                             AND q.stage = v_stage AND q.status = 'pending'
                             AND (q.tenant_key, q.sender_key) > (w.key, w.first)
                           ORDER BY q.tenant_key, q.sender_key LIMIT 1
                      ) a ON true
                      LEFT JOIN LATERAL (
                          SELECT q.tenant_key AS key, q.sender_key AS first
                            FROM pepsi.workqueue q
                           WHERE (w.first IS NULL OR a.key = w.key)
                             AND q.stage = v_stage AND q.status = 'pending'
                             AND q.tenant_key > w.key
                           ORDER BY q.tenant_key, q.sender_key LIMIT 1
                      ) c ON true
                     CROSS JOIN LATERAL (
                          SELECT CASE WHEN a.key <> w.key THEN a.key ELSE c.key END AS key,
                                 CASE WHEN a.key <> w.key THEN a.first ELSE c.first END AS first
                          OFFSET 0
                      ) x
                      LEFT JOIN LATERAL (
                          SELECT q.tenant_key AS key, q.sender_key AS first
                            FROM pepsi.workqueue q
                           WHERE x.key IS NULL AND NOT w.wrapped
                             AND q.stage = v_stage AND q.status = 'pending'
                           ORDER BY q.tenant_key, q.sender_key LIMIT 1
                      ) b ON true
                     CROSS JOIN LATERAL (
                          SELECT coalesce(x.key, b.key) AS key,
                                 CASE WHEN x.key IS NOT NULL THEN x.first ELSE b.first END
                                     AS first,
                                 w.wrapped OR x.key IS NULL AS wrapped
                          OFFSET 0
                      ) f
                     CROSS JOIN LATERAL (
                          SELECT f.key IS NOT NULL
                                 AND (NOT f.wrapped OR v_cursor IS NULL OR f.key <= v_cursor)
                                 AS go
                      ) g
                     WHERE w.n < 65 AND NOT w.done
                )
                SELECT coalesce(array_agg(w.key ORDER BY w.n)
                                    FILTER (WHERE w.n BETWEEN 1 AND 64 AND NOT w.done), '{}'),
                       coalesce(array_agg(w.first ORDER BY w.n)
                                    FILTER (WHERE w.n BETWEEN 1 AND 64 AND NOT w.done), '{}'),
                       coalesce(array_agg(w.several ORDER BY w.n)
                                    FILTER (WHERE w.n BETWEEN 2 AND 65), '{}'),
                       CASE WHEN bool_or(w.n = 65 AND NOT w.done)
                            THEN max(w.key) FILTER (WHERE w.n = 64) END
                  INTO v_tenants, v_tfirst, v_several, v_window_end
                  FROM walk w;
                -- 2. Each tenant's senders: a walk of its senders from its own cursor
                -- (p_tcur_*), wrapping round, at most v_budget of them; one more probe
                -- tells whether more wait. One recursive statement for all the tenants:
                -- a row (i, key, n) is the n-th sender of the i-th tenant, n = 0 the
                -- start at its cursor; a tenant without one starts at its first sender
                -- (n = 1, from step 1), and only a tenant step 1 marked, or one with a
                -- cursor, is probed further; a probe runs only while n is within the
                -- budget. When no tenant of the window is either (each waits with one
                -- sender: the common case), its first senders are the walk.
                v_budget := greatest(1, 64 / greatest(cardinality(v_tenants), 1));
                IF v_stage = ANY (p_tcur_stage) THEN
                    v_tcurs := ARRAY(
                        SELECT (SELECT min(c.sender)
                                  FROM unnest(p_tcur_stage, p_tcur_tenant, p_tcur_sender)
                                       AS c(stage, tenant, sender)
                                 WHERE c.stage = v_stage AND c.tenant = t.key)
                          FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n) ORDER BY t.n);
                ELSE
                    v_tcurs := '{}';
                END IF;
                IF NOT (true = ANY (v_several)) AND NOT EXISTS (
                       SELECT 1 FROM unnest(v_tcurs) AS c(sender) WHERE c.sender IS NOT NULL)
                THEN
                    v_ws_tenants := v_tenants;
                    v_ws_keys := v_tfirst;
                    v_ws_tis := ARRAY(SELECT generate_series(1, cardinality(v_tenants)));
                ELSE
                    WITH RECURSIVE walk(i, key, n, wrapped) AS (
                        SELECT 1, coalesce(v_tcurs[1], v_tfirst[1]),
                               CASE WHEN v_tcurs[1] IS NULL THEN 1 ELSE 0 END, v_tcurs[1] IS NULL
                         WHERE cardinality(v_tenants) > 0
                      UNION ALL
                        SELECT CASE WHEN g.go THEN w.i ELSE w.i + 1 END,
                               CASE WHEN g.go THEN nx.key
                                    ELSE coalesce(v_tcurs[w.i + 1], v_tfirst[w.i + 1]) END,
                               CASE WHEN g.go THEN w.n + 1
                                    WHEN v_tcurs[w.i + 1] IS NULL THEN 1 ELSE 0 END,
                               CASE WHEN g.go THEN nx.wrapped ELSE v_tcurs[w.i + 1] IS NULL END
                          FROM walk w
                         CROSS JOIN LATERAL (
                             SELECT CASE WHEN w.n <= v_budget
                                              AND (v_several[w.i] OR v_tcurs[w.i] IS NOT NULL)
                                         THEN (
                                        SELECT q.sender_key FROM pepsi.workqueue q
                                         WHERE q.stage = v_stage AND q.status = 'pending'
                                           AND q.tenant_key = v_tenants[w.i]
                                           AND q.sender_key > w.key
                                         ORDER BY q.tenant_key, q.sender_key LIMIT 1) END AS key
                             OFFSET 0
                         ) a
                         CROSS JOIN LATERAL (
                             SELECT coalesce(a.key, CASE WHEN w.n <= v_budget
                                                              AND NOT w.wrapped THEN (
                                        SELECT q.sender_key FROM pepsi.workqueue q
                                         WHERE q.stage = v_stage AND q.status = 'pending'
                                           AND q.tenant_key = v_tenants[w.i]
                                         ORDER BY q.tenant_key, q.sender_key LIMIT 1) END) AS key,
                                    w.wrapped OR a.key IS NULL AS wrapped
                             OFFSET 0
                         ) nx
                         CROSS JOIN LATERAL (
                             SELECT w.n <= v_budget AND nx.key IS NOT NULL
                                    AND (NOT nx.wrapped OR v_tcurs[w.i] IS NULL
                                         OR nx.key <= v_tcurs[w.i]) AS go
                         ) g
                         WHERE g.go OR w.i < cardinality(v_tenants)
                    )
                    SELECT coalesce(array_agg(w.i ORDER BY w.i, w.n), '{}'),
                           coalesce(array_agg(w.n ORDER BY w.i, w.n), '{}'),
                           coalesce(array_agg(w.key ORDER BY w.i, w.n), '{}')
                      INTO v_walk_i, v_walk_n, v_walk_keys
                      FROM walk w WHERE w.n >= 1;
                    SELECT coalesce(array_agg(v_tenants[x.i] ORDER BY x.i, x.n), '{}'),
                           coalesce(array_agg(x.key ORDER BY x.i, x.n), '{}'),
                           coalesce(array_agg(x.i ORDER BY x.i, x.n), '{}')
                      INTO v_ws_tenants, v_ws_keys, v_ws_tis
                      FROM unnest(v_walk_i, v_walk_n, v_walk_keys) AS x(i, n, key)
                     WHERE x.n <= v_budget;
                    -- Where each tenant's walk ended: its budget-th sender when one more
                    -- waits (the next claim starts after it), else NULL when it had a
                    -- cursor (start over). Tenants with neither are left out.
                    SELECT v_tc_stage || coalesce(array_agg(v_stage ORDER BY t.n), '{}'),
                           v_tc_tenant || coalesce(array_agg(t.key ORDER BY t.n), '{}'),
                           v_tc_end || coalesce(array_agg(e.key ORDER BY t.n), '{}')
                      INTO v_tc_stage, v_tc_tenant, v_tc_end
                      FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n)
                      LEFT JOIN LATERAL (
                          SELECT x.key FROM unnest(v_walk_i, v_walk_n, v_walk_keys) AS x(i, n, key)
                           WHERE x.i = t.n AND x.n = v_budget
                             AND EXISTS (SELECT 1 FROM unnest(v_walk_i, v_walk_n) AS y(i, n)
                                          WHERE y.i = t.n AND y.n = v_budget + 1)
                      ) e ON true
                     WHERE e.key IS NOT NULL OR v_tcurs[t.n] IS NOT NULL;
                END IF;
                -- 3. As in schema 4; each sender's candidates and the fifo start
                -- at the floor (the sender's range is inclusive, so the scan starts
                -- at (stage, tenant, sender, floor)).
                SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(s.key), '{}'),
                       coalesce(array_agg(s.ti), '{}'), coalesce(array_agg(c.k), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks
                  FROM unnest(v_ws_tenants, v_ws_keys, v_ws_tis) AS s(tenant, key, ti)
                 CROSS JOIN LATERAL unnest(ARRAY(
                     SELECT q.workqueue_id FROM pepsi.workqueue q
                      WHERE q.stage = v_stage AND q.status = 'pending'
                        AND q.tenant_key = s.tenant
                        AND q.sender_key >= s.key AND q.sender_key <= s.key
                        AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                      ORDER BY q.tenant_key, q.sender_key, q.workqueue_id LIMIT v_cap
                 )) WITH ORDINALITY AS c(id, k);
                v_single := cardinality(v_ws_keys) = cardinality(v_tenants);
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

            -- 4. The order: the oldest first, then the candidates. Within a tenant, by
            -- its sender's lead + k × the average / the sender's weight (the k-th
            -- oldest of its sender), which numbers them j = 0, 1, … in the tenant;
            -- across tenants by the tenant's lead + j × the average / its weight. A
            -- tenant or sender without a known lead is level with the least-served
            -- known one (of the tenants; of its tenant's senders), 0 when none is.
            -- Joins of the candidates with small sets are left to hashing or avoided:
            -- a candidate names its tenant by its place in v_tenants, whose known leads
            -- and weights are read into arrays in that order first, and each level's
            -- least known lead is an aggregate or a window over the candidates.
            SELECT array_agg(k.us ORDER BY t.n),
                   array_agg(CASE WHEN k.w >= 0.01 AND k.w <= 100 THEN k.w ELSE 1 END
                             ORDER BY t.n),
                   min(k.us),
                   array_agg(CASE WHEN v_limited THEN greatest(coalesce(
                       (SELECT min(a.n)
                          FROM unnest(p_allow_stage, p_allow_tenant, p_allow_n)
                               AS a(stage, tenant, n)
                         WHERE a.stage = v_stage AND a.tenant = t.key),
                       p_allow_default[i], v_cap), 0) ELSE v_cap END ORDER BY t.n)
              INTO v_tl_lead, v_tl_w, v_tl_least, v_tl_allow
              FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n)
              LEFT JOIN (
                  SELECT l.tenant, min(l.us) AS us, min(l.w) AS w
                    FROM unnest(p_tlead_stage, p_tlead_tenant, p_tlead_us, p_tlead_w)
                         AS l(stage, tenant, us, w)
                   WHERE l.stage = v_stage AND l.us IS NOT NULL
                   GROUP BY l.tenant
              ) k ON k.tenant = t.key;
            IF v_single THEN
                -- One sender per tenant of the window (the common case): within a
                -- tenant the order is its sender's, the k-th oldest row is its j-th,
                -- and the senders' leads and weights change nothing.
                SELECT ARRAY(SELECT o.id FROM unnest(v_oldest) AS o(id) ORDER BY o.id)
                       || ARRAY(SELECT c.id
                                  FROM unnest(v_cand_ids, v_cand_tis, v_cand_ks) AS c(id, ti, k)
                                 WHERE c.id <> ALL (v_oldest)
                                   AND c.k <= least(v_cap, v_tl_allow[c.ti])
                                 ORDER BY coalesce(v_tl_lead[c.ti], v_tl_least - v_avg / 2, 0)
                                          + (c.k - 1) * v_avg / v_tl_w[c.ti], c.id)
                  INTO v_order;
            ELSE
                WITH known AS (
                    SELECT l.sender, min(l.us) AS us, min(l.w) AS w
                      FROM unnest(p_lead_stage, p_lead_sender, p_lead_us, p_lead_w)
                           AS l(stage, sender, us, w)
                     WHERE l.stage = v_stage AND l.us IS NOT NULL
                     GROUP BY l.sender
                ), cands AS (
                    SELECT c.id, c.ti, c.k, k.us,
                           CASE WHEN k.w >= 0.01 AND k.w <= 100 THEN k.w ELSE 1 END AS w
                      FROM unnest(v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks)
                           AS c(id, key, ti, k)
                      LEFT JOIN known k ON k.sender = c.key
                     WHERE c.id <> ALL (v_oldest)
                ), ranked AS (
                    SELECT c.id, c.ti,
                           row_number() OVER (
                               PARTITION BY c.ti
                               ORDER BY coalesce(c.us, c.least - v_avg / 2, 0)
                                        + (c.k - 1) * v_avg / c.w, c.id) AS j
                      FROM (SELECT c.*, min(c.us) OVER (PARTITION BY c.ti) AS least
                              FROM cands c) c
                )
                SELECT ARRAY(SELECT o.id FROM unnest(v_oldest) AS o(id) ORDER BY o.id)
                       || ARRAY(SELECT r.id
                                  FROM ranked r
                                 WHERE r.j <= least(v_cap, v_tl_allow[r.ti])
                                 ORDER BY coalesce(v_tl_lead[r.ti], v_tl_least - v_avg / 2, 0)
                                          + (r.j - 1) * v_avg / v_tl_w[r.ti], r.id)
                  INTO v_order;
            END IF;
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
        ELSIF cardinality(v_set_ids) > 512 AND coalesce(p_walk[i], true) THEN
            v_sweep_next := v_sweep_next || v_sw;
        ELSE
            v_set_pos := (SELECT max(s.n) FROM unnest(v_set_ids) WITH ORDINALITY AS s(id, n)
                           WHERE s.id = ANY (v_got));
            v_sweep_next := v_sweep_next || CASE
                WHEN v_set_pos IS NULL THEN v_sw ELSE v_set_ids[v_set_pos] + 1 END;
        END IF;
    END LOOP;

    -- The claimed rows with their tenants, a row per stage, a row per tenant whose
    -- senders' walk ended early or had a cursor.
    RETURN QUERY
    WITH claimed AS (SELECT * FROM pepsi.workqueue_take(v_locked, p_max_hops))
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, v_due, c.looped, NULL::text,
           NULL::bigint, NULL::bigint, c.tenant_key
      FROM claimed c
    UNION ALL
    SELECT NULL::bigint, e.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           e.window_end, e.next_floor, e.next_sweep, NULL::text
      FROM unnest(p_stages, v_ends, v_next, v_sweep_next)
           AS e(stage, window_end, next_floor, next_sweep)
    UNION ALL
    SELECT NULL::bigint, t.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           t.window_end, NULL::bigint, NULL::bigint, t.tenant
      FROM unnest(v_tc_stage, v_tc_tenant, v_tc_end) AS t(stage, tenant, window_end)
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::bigint, v_due, NULL::boolean,
           NULL::text, NULL::bigint, NULL::bigint, NULL::text
     WHERE v_n = 0;
END $$;


-- Named tenants, matched without a function call per pattern (see the head of this file).
ALTER TABLE pepsi.tenants
    ADD COLUMN like_pattern text GENERATED ALWAYS AS (pepsi.pattern_like(pattern)) STORED,
    ADD COLUMN literal int4
        GENERATED ALWAYS AS (pg_catalog.length(pg_catalog.replace(pattern, '*', ''))) STORED;

COMMENT ON COLUMN pepsi.tenants.like_pattern IS
    'The pattern as LIKE reads it (pepsi.pattern_like), kept for the insert trigger''s lookup.';
COMMENT ON COLUMN pepsi.tenants.literal IS
    'How many characters of the pattern are not *: the more, the more the pattern wins.';

CREATE INDEX tenants_preference_idx
    ON pepsi.tenants (literal DESC, pattern) INCLUDE (like_pattern, tenant);

COMMENT ON INDEX pepsi.tenants_preference_idx IS
    'The patterns in the order in which the first that matches a sender key wins.';

CREATE OR REPLACE FUNCTION pepsi.tenant_of(p_sender_key text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_tenant text;
    v_rule text;
BEGIN
    -- One statement per row inserted (this runs in the insert trigger): the named
    -- tenant, if any (the patterns read most literal first, up to the first that
    -- matches), and the rule.
    SELECT (SELECT 'tenant:' || t.tenant
              FROM pepsi.tenants t
             WHERE p_sender_key LIKE t.like_pattern
             ORDER BY t.literal DESC, t.pattern
             LIMIT 1),
           (SELECT r.rule FROM pepsi.tenant_rule r)
      INTO v_tenant, v_rule;
    IF v_tenant IS NOT NULL THEN
        RETURN v_tenant;
    END IF;
    IF v_rule = 'sender' THEN
        RETURN coalesce(p_sender_key, '');
    END IF;
    RETURN pepsi.tenant_default(p_sender_key);
END $$;

-- Each sender key waiting in the queue is looked up once.
CREATE OR REPLACE FUNCTION pepsi.tenants_rekey()
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
    v_null bigint;
BEGIN
    UPDATE pepsi.workqueue q SET tenant_key = k.tenant
      FROM (SELECT d.sender_key, pepsi.tenant_of(d.sender_key) AS tenant
              FROM (SELECT DISTINCT w.sender_key FROM pepsi.workqueue w
                     WHERE w.sender_key IS NOT NULL) d) k
     WHERE q.sender_key = k.sender_key AND q.tenant_key IS DISTINCT FROM k.tenant;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    -- A row without a sender key (none is made today) is keyed as schema 25 keyed it.
    UPDATE pepsi.workqueue q SET tenant_key = pepsi.tenant_of(NULL)
     WHERE q.sender_key IS NULL AND q.tenant_key IS DISTINCT FROM pepsi.tenant_of(NULL);
    GET DIAGNOSTICS v_null = ROW_COUNT;
    RETURN v_n + v_null;
END $$;
