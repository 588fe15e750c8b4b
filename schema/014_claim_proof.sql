-- Pepsi schema, version 14: a worker's write proves the claim it was handed (SPEC §4
-- "Containment", §6 "Claim tokens", amended 2026-12-04).
--
-- Before, row-level security let a worker change any row that was `running`, and the
-- claim tokens were readable and drawn from one sequence: a compromised worker could
-- read the token of a row another stage was running and rewrite it. Now:
--
-- 1. Every row a claim takes gets a token of its own from the server's strong random
--    source (60 random bits of gen_random_uuid()), not one number per claim drawn from
--    a sequence: a token says nothing about another row's.
-- 2. pepsi_worker reads every column of the queue but the claim token, and changes no
--    row itself. The dispatcher hands each worker its ids with their tokens (the
--    protocol's `ID TOKEN` line); a worker writes an outcome only through the
--    functions below, which take the token and write a row only while it is running
--    at the stage it was claimed at under that token — one round trip per batch, as
--    before (SPEC §12.2). workqueue_split and workqueue_bounce took the token already.
-- 3. What row-level security and the column privileges held a worker's writes to, the
--    functions hold them to: the statuses a worker writes (running, pending, paused,
--    failed), never the token, the hops or the arrival; and an envelope a stage
--    rewrote is clean, as an injected one must be (a sender that is a mailbox or '',
--    at least one recipient, each a mailbox), so no stage can hand the next one an
--    address with a line break in it.

-- The token of one claimed row: 60 random bits (a version-4 UUID's first 64 bits, of
-- which 4 are its version), from pg_strong_random.
CREATE FUNCTION pepsi.claim_token() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN ('x' || substr(replace(gen_random_uuid()::text, '-', ''), 1, 16))::bit(64)::bigint;

COMMENT ON FUNCTION pepsi.claim_token() IS
    'A claim token for one claimed row: 60 random bits from the server''s strong random '
    'source, so that no token tells another.';

-- The claim of the rows a pick locked, as in schema 13, with a token per row.
CREATE OR REPLACE FUNCTION pepsi.workqueue_take(p_ids int8[], p_max_hops int4)
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
               claim = pepsi.claim_token(),
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
    'pending one of p_ids set running (or failed looped past p_max_hops) under a new '
    'claim token of its own (pepsi.claim_token). Returns the rows claimed.';

-- Why a worker may not write this envelope, or NULL when it may: the checks of
-- workqueue_inject.
CREATE FUNCTION pepsi.envelope_problem(p_mail_from text, p_rcpt_to text[]) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_problem text;
    v_rcpt text;
BEGIN
    IF p_mail_from IS NULL THEN
        RETURN 'the sender is NULL (the null sender is '''')';
    END IF;
    IF p_mail_from <> '' THEN
        v_problem := pepsi.mailbox_problem(p_mail_from);
        IF v_problem IS NOT NULL THEN
            RETURN 'the sender ' || v_problem;
        END IF;
    END IF;
    IF coalesce(cardinality(p_rcpt_to), 0) = 0 THEN
        RETURN 'no recipient';
    END IF;
    FOREACH v_rcpt IN ARRAY p_rcpt_to LOOP
        v_problem := pepsi.mailbox_problem(v_rcpt);
        IF v_problem IS NOT NULL THEN
            RETURN 'a recipient ' || v_problem;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

COMMENT ON FUNCTION pepsi.envelope_problem(text, text[]) IS
    'Why an envelope is not one a stage may write (a sender that is a mailbox or '''', at '
    'least one recipient, each a mailbox), or NULL when it is.';

-- A worker's outcome writes for a batch (SPEC §12.3), one call. p_rows: a JSON array
-- of objects {id, claimed, claim, stage, status, delay_ms, state, and, when a stage
-- rewrote them (rewritten: true), mail_from, rcpt_to, header_from, subject}. A row is
-- written only while it is running at the stage it was claimed at ("claimed") under
-- the token the dispatcher handed with it ("claim"). Returns the ids written; a row
-- the guard does not match is left alone. A status other than running, pending, paused
-- or failed, an empty stage, a state that is not an object or an unclean rewritten
-- envelope fails the whole call (nothing is written).
CREATE FUNCTION pepsi.workqueue_write(p_rows jsonb) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_row record;
    v_problem text;
    v_rewritten boolean := false;
BEGIN
    IF jsonb_typeof(p_rows) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'workqueue_write: the rows are not a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_row IN SELECT * FROM jsonb_to_recordset(p_rows) AS x(id bigint, stage text,
                  status text, state jsonb, rewritten boolean, mail_from text,
                  rcpt_to text[]) LOOP
        IF v_row.status IS NULL OR v_row.status NOT IN ('running', 'pending', 'paused', 'failed') THEN
            RAISE EXCEPTION 'workqueue_write(%): a stage may not set the status %', v_row.id,
                    quote_nullable(v_row.status)
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        IF v_row.stage IS NULL OR v_row.stage = '' THEN
            RAISE EXCEPTION 'workqueue_write(%): the stage is empty', v_row.id
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_typeof(v_row.state) IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION 'workqueue_write(%): the state is not a JSON object', v_row.id
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF v_row.rewritten THEN
            v_rewritten := true;
            v_problem := pepsi.envelope_problem(v_row.mail_from, v_row.rcpt_to);
            IF v_problem IS NOT NULL THEN
                RAISE EXCEPTION 'workqueue_write(%): %', v_row.id, v_problem
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
    END LOOP;
    IF v_rewritten THEN
        RETURN QUERY
        UPDATE pepsi.workqueue q
           SET stage = r.stage,
               status = r.status::pepsi.workqueue_status,
               timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                              ELSE now() + r.delay_ms * interval '1 millisecond' END,
               state = r.state - 'unwritten',
               mail_from = CASE WHEN r.rewritten THEN r.mail_from ELSE q.mail_from END,
               rcpt_to = CASE WHEN r.rewritten THEN r.rcpt_to ELSE q.rcpt_to END,
               header_from = CASE WHEN r.rewritten THEN r.header_from ELSE q.header_from END,
               subject = CASE WHEN r.rewritten THEN r.subject ELSE q.subject END
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb, rewritten boolean,
               mail_from text, rcpt_to text[], header_from text, subject text)
         WHERE q.workqueue_id = r.id AND q.status = 'running' AND q.stage = r.claimed
           AND q.claim = r.claim
        RETURNING q.workqueue_id;
    ELSE
        -- Naming no column sender_key is computed from, the UPDATE leaves the stored
        -- generated column as it is instead of computing it again for every row.
        RETURN QUERY
        UPDATE pepsi.workqueue q
           SET stage = r.stage,
               status = r.status::pepsi.workqueue_status,
               timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                              ELSE now() + r.delay_ms * interval '1 millisecond' END,
               state = r.state - 'unwritten'
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb)
         WHERE q.workqueue_id = r.id AND q.status = 'running' AND q.stage = r.claimed
           AND q.claim = r.claim
        RETURNING q.workqueue_id;
    END IF;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_write(jsonb) IS
    'A stage worker''s outcome writes for a batch: each row of p_rows written only while '
    'it is running at its claimed stage under the claim token the dispatcher handed with '
    'it; statuses running, pending, paused or failed; a rewritten envelope must be clean. '
    'Returns the ids written.';

-- A worker's finished messages, one call: deleted while running at the stage they were
-- claimed at under their tokens. p_ids, p_stages and p_claims go together. Returns the
-- ids deleted (the body goes with the last row that shares it, by the release trigger).
CREATE FUNCTION pepsi.workqueue_finish(p_ids int8[], p_stages text[], p_claims int8[])
RETURNS SETOF bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM pepsi.workqueue q
     USING unnest(p_ids, p_stages, p_claims) AS r(id, claimed, claim)
     WHERE q.workqueue_id = r.id AND q.status = 'running' AND q.stage = r.claimed
       AND q.claim = r.claim
    RETURNING q.workqueue_id
$$;

COMMENT ON FUNCTION pepsi.workqueue_finish(int8[], text[], int8[]) IS
    'A stage worker''s finished messages: each deleted while running at its claimed stage '
    'under its claim token. Returns the ids deleted.';

-- Fails a claimed row without rewriting its state: the failure keys are merged into the
-- stored state (a row the worker cannot load or read loses nothing). Guarded like
-- workqueue_write. Returns the id, or NULL when the guard did not match.
CREATE FUNCTION pepsi.workqueue_fail_in_place(p_id bigint, p_stage text, p_claim bigint,
                                              p_class text, p_error text)
RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE pepsi.workqueue
       SET status = 'failed', timeout = NULL,
           state = state || jsonb_build_object('failure_class', p_class,
                                               'failed_stage', p_stage, 'last_error', p_error)
     WHERE workqueue_id = p_id AND status = 'running' AND stage = p_stage AND claim = p_claim
    RETURNING workqueue_id
$$;

COMMENT ON FUNCTION pepsi.workqueue_fail_in_place(bigint, text, bigint, text, text) IS
    'Fails a claimed row with failure_class p_class and last_error p_error merged into its '
    'stored state, while it is running at p_stage under claim token p_claim.';

-- The last resort of a worker that cannot write a row's outcome for a non-connection
-- reason, as the statement of schema 12 was: state.unwritten counts the attempts; the
-- attempt that brings it to p_fail_at fails the row (unwritable), every earlier one
-- pauses it with the error for 1, 2, 4 … minutes, up to an hour. Guarded like
-- workqueue_write. Returns the new status, the pause in minutes (NULL when it failed)
-- and the attempt count, or no row when the guard did not match.
CREATE FUNCTION pepsi.workqueue_unwritten(p_id bigint, p_stage text, p_error text,
                                          p_claim bigint, p_fail_at int4)
RETURNS TABLE (status text, pause_minutes bigint, attempts bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH cur AS (
        SELECT w.workqueue_id,
               CASE WHEN jsonb_typeof(w.state -> 'unwritten') = 'number'
                    THEN least(greatest(floor((w.state ->> 'unwritten')::numeric), 0),
                               1000)::int
                    ELSE 0 END + 1 AS n
          FROM pepsi.workqueue w
         WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_stage
           AND w.claim = p_claim
    )
    UPDATE pepsi.workqueue w
       SET status = CASE WHEN cur.n >= p_fail_at THEN 'failed'::pepsi.workqueue_status
                         ELSE 'paused'::pepsi.workqueue_status END,
           timeout = CASE WHEN cur.n >= p_fail_at THEN NULL
                          ELSE now() + make_interval(mins =>
                                   least(60, power(2, least(cur.n - 1, 6)))::int) END,
           state = w.state
                   || jsonb_build_object('last_error', p_error, 'unwritten', cur.n)
                   || CASE WHEN cur.n >= p_fail_at
                           THEN jsonb_build_object('failure_class', 'unwritable',
                                                   'failed_stage', p_stage)
                           ELSE '{}'::jsonb END
      FROM cur
     WHERE w.workqueue_id = cur.workqueue_id AND w.status = 'running' AND w.stage = p_stage
       AND w.claim = p_claim
    RETURNING w.status::text,
              CASE WHEN cur.n < p_fail_at THEN least(60, power(2, least(cur.n - 1, 6)))::int8 END,
              cur.n::int8
$$;

COMMENT ON FUNCTION pepsi.workqueue_unwritten(bigint, text, text, bigint, int4) IS
    'A stage worker''s last resort for an outcome the database refuses: pauses the row '
    '(1, 2, 4 … 60 minutes) or, at attempt p_fail_at, fails it unwritable; while it is '
    'running at p_stage under claim token p_claim.';

-- The worker's privileges: every column of the queue but the claim token, no UPDATE or
-- DELETE of its own (row-level security's write policies go with them, in
-- pepsi.setup_roles), the write functions.
DELETE FROM pepsi.role_grants
 WHERE role = 'pepsi_worker' AND object = 'TABLE pepsi.workqueue';
DELETE FROM pepsi.role_grants
 WHERE role = 'pepsi_dispatch' AND object = 'SEQUENCE pepsi.workqueue_claim_seq';
DROP SEQUENCE pepsi.workqueue_claim_seq;

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_worker', 'SELECT (workqueue_id, stage, status, timeout, arrived, mail_from, rcpt_to, auth_user, client_ip, header_from, subject, headers, body_id, state, sender_key, hops, hop_stage)',
     'TABLE pepsi.workqueue'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_write(jsonb)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_finish(int8[], text[], int8[])'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_fail_in_place(bigint, text, bigint, text, text)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_unwritten(bigint, text, text, bigint, int4)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.claim_token()');

-- pepsi.setup_roles, as in schema 10, with the worker's row-level security reduced to
-- reading: it changes rows only through the functions above (which run as the owner).
CREATE OR REPLACE FUNCTION pepsi.setup_roles()
RETURNS TABLE (role text, status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_may_create boolean;
    v_role text;
    v_status text;
    v_present text[] := '{}';
    g record;
BEGIN
    SELECT r.rolsuper OR r.rolcreaterole INTO v_may_create
      FROM pg_catalog.pg_roles r WHERE r.rolname = current_user;
    FOREACH v_role IN ARRAY ARRAY['pepsi_dispatch', 'pepsi_worker', 'pepsi_admin', 'pepsi_inject']
    LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = v_role) THEN
            v_status := 'present';
        ELSIF NOT v_may_create THEN
            v_status := 'missing';
        ELSE
            -- Another database's pepsi-setup may create the same role at the same
            -- moment: the loser of that race waits for the winner's commit, then
            -- finds the name taken, which is just as good.
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
                v_status := 'created';
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                v_status := 'present';
            END;
        END IF;
        IF v_status <> 'missing' THEN
            v_present := v_present || v_role;
        END IF;
        role := v_role;
        status := v_status;
        RETURN NEXT;
    END LOOP;

    -- Nobody but the owner and the roles below may call a function of the schema
    -- (PostgreSQL grants EXECUTE to PUBLIC by default). Every run, so that the
    -- functions of later schema files are covered too (a per-schema default privilege
    -- cannot take away the global default).
    REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM PUBLIC;

    FOREACH v_role IN ARRAY v_present LOOP
        EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM %I', v_role);
        EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM %I', v_role);
        EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM %I', v_role);
        -- USAGE only: no Pepsi role but the owner creates objects in the schema every
        -- session resolves the queue's names through.
        EXECUTE format('REVOKE ALL ON SCHEMA pepsi FROM %I', v_role);
        EXECUTE format('GRANT USAGE ON SCHEMA pepsi TO %I', v_role);
        -- The rows are the owner's and checked on insert (role_grants' CHECK
        -- constraints): a privilege list and an object name, never a value.
        FOR g IN SELECT rg.privilege, rg.object FROM pepsi.role_grants rg
                  WHERE rg.role = v_role ORDER BY rg.object, rg.privilege LOOP
            EXECUTE format('GRANT %s ON %s TO %I', g.privilege, g.object, v_role);
        END LOOP;
    END LOOP;

    -- The queue's row-level security policies, one set per existing role. The
    -- dispatcher and the administrators see and change every row; a worker sees every
    -- row and changes none directly (its writes go through the functions that take
    -- the claim token).
    DROP POLICY IF EXISTS workqueue_dispatch ON pepsi.workqueue;
    DROP POLICY IF EXISTS workqueue_admin ON pepsi.workqueue;
    DROP POLICY IF EXISTS workqueue_worker_read ON pepsi.workqueue;
    DROP POLICY IF EXISTS workqueue_worker_write ON pepsi.workqueue;
    DROP POLICY IF EXISTS workqueue_worker_finish ON pepsi.workqueue;
    IF 'pepsi_dispatch' = ANY (v_present) THEN
        CREATE POLICY workqueue_dispatch ON pepsi.workqueue TO pepsi_dispatch
            USING (true) WITH CHECK (true);
    END IF;
    IF 'pepsi_admin' = ANY (v_present) THEN
        CREATE POLICY workqueue_admin ON pepsi.workqueue TO pepsi_admin
            USING (true) WITH CHECK (true);
    END IF;
    IF 'pepsi_worker' = ANY (v_present) THEN
        CREATE POLICY workqueue_worker_read ON pepsi.workqueue FOR SELECT TO pepsi_worker
            USING (true);
    END IF;
END $$;
