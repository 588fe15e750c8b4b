-- Pepsi schema, version 7: separate database roles (SPEC §4 "Least privilege").
--
-- Four NOLOGIN group roles, one per kind of program, each allowed what that program
-- does and nothing more:
--   pepsi_dispatch  the dispatcher: claims, requeues, strikes, deferrals, resets, the
--                   statistics, the overlay (read), LISTEN, the body GC, terminating
--                   worker sessions;
--   pepsi_worker    stage workers: reads rows, bodies, settings and the overlay, and
--                   writes outcomes (advance, finish, pause, fail, split, bounce);
--   pepsi_admin     pepsi-queue and pepsi-failure-bouncer: reads everything, repairs
--                   messages, writes the overlay and the per-address settings;
--   pepsi_inject    whatever hands mail over: pepsi.workqueue_inject only.
-- The role that runs pepsi-setup owns the schema and keeps every right, so one role
-- for everything remains possible (the simple setup). Login roles are made members of
-- the group roles by the administrator (README, "Database roles").
--
-- Roles are cluster-wide and privileges per database, so the roles and the grants are
-- not made here, in a file applied once, but by pepsi.setup_roles() below, which
-- pepsi-setup calls on every run: after an upgrade, and again once an administrator
-- has created the roles that pepsi-setup may not create itself.
--
-- Functions that let a role do what its privileges on the tables do not are SECURITY
-- DEFINER (they run as the schema's owner), each with a fixed search_path and only
-- schema-qualified names inside, so that no caller's objects are found first:
--   workqueue_inject         pepsi_inject has no privilege on any table: the function
--                            is its one way in, and it only ever adds a pending row
--                            (and its body) and wakes the dispatcher;
--   workqueue_split          pepsi_worker may not INSERT rows: the function only clones
--                            a row with a partition of the row's own recipients;
--   workqueue_bounce         pepsi_worker may not INSERT rows or bodies: the function
--                            adds exactly one null-sender notification for a row still
--                            running under the caller's claim, and deletes that row;
--   workqueue_body_release   the trigger of a row's deletion (a worker's finish, an
--                            operator's delete) deletes its body, and neither role may
--                            DELETE bodies directly;
--   workqueue_body_gc        pepsi_dispatch has no access to bodies (message content)
--                            at all: the function deletes only bodies no row uses;
--   terminate_worker_sessions  pepsi_dispatch may not signal other roles' backends:
--                            the function terminates only sessions of this database
--                            named pepsi-worker:…;
--   config_override_rows     pepsi_worker and pepsi_inject have no access to
--                            pepsi.config_override, yet a worker lays the overlay over
--                            the file at start and pepsi-queue inject checks the stage
--                            against it: the function reads it, and nothing else.

ALTER FUNCTION pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text, text,
                                      jsonb)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_split(bigint, jsonb, text, text, jsonb, boolean, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_bounce(bigint, text, bigint, text, text, text, text, bytea, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_body_release()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_body_gc(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- The overlay as rows (section, key, value), for every program.
CREATE FUNCTION pepsi.config_override_rows()
RETURNS TABLE (section text, key text, value text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT o.section, o.key, o.value FROM pepsi.config_override o
$$;

-- Terminates the database sessions of workers: sessions of this database, other than
-- the caller's, whose application_name starts with 'pepsi-worker:' and matches one of
-- p_patterns (LIKE patterns), waiting up to a second for each to end. A session the
-- owner of this function may not signal (a superuser's, or another role's when the
-- owner is neither a member of that role nor of pg_signal_backend) is counted as
-- refused and left alone. Returns how many were terminated and how many refused.
CREATE FUNCTION pepsi.terminate_worker_sessions(p_patterns text[])
RETURNS TABLE (terminated bigint, refused bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_pid integer;
    v_terminated bigint := 0;
    v_refused bigint := 0;
BEGIN
    FOR v_pid IN
        SELECT a.pid FROM pg_catalog.pg_stat_activity a
         WHERE a.datname = pg_catalog.current_database()
           AND a.pid <> pg_catalog.pg_backend_pid()
           AND a.application_name LIKE 'pepsi-worker:%'
           AND a.application_name LIKE ANY (p_patterns)
    LOOP
        BEGIN
            IF pg_catalog.pg_terminate_backend(v_pid, 1000) THEN
                v_terminated := v_terminated + 1;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            v_refused := v_refused + 1;
        END;
    END LOOP;
    terminated := v_terminated;
    refused := v_refused;
    RETURN NEXT;
END $$;

-- Creates the group roles this session may create and grants each existing one
-- exactly its privileges on this database's objects (revoking first, so a privilege a
-- later release no longer grants goes). Revokes EXECUTE on every function of the
-- schema from PUBLIC. Idempotent, safe while other databases of the cluster run it at
-- the same moment, and called by pepsi-setup on every run. Runs with the caller's
-- rights: roles are created only when the caller is a superuser or has CREATEROLE;
-- otherwise a missing role is reported and its grants are skipped. Returns one row per
-- group role: its name and 'created', 'present' or 'missing'.
CREATE FUNCTION pepsi.setup_roles()
RETURNS TABLE (role text, status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_may_create boolean;
    v_role text;
    v_status text;
    v_present text[] := '{}';
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
                CASE v_role
                    WHEN 'pepsi_dispatch' THEN CREATE ROLE pepsi_dispatch NOLOGIN;
                    WHEN 'pepsi_worker' THEN CREATE ROLE pepsi_worker NOLOGIN;
                    WHEN 'pepsi_admin' THEN CREATE ROLE pepsi_admin NOLOGIN;
                    WHEN 'pepsi_inject' THEN CREATE ROLE pepsi_inject NOLOGIN;
                END CASE;
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

    IF 'pepsi_dispatch' = ANY (v_present) THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM pepsi_dispatch;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM pepsi_dispatch;
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM pepsi_dispatch;
        GRANT USAGE ON SCHEMA pepsi TO pepsi_dispatch;
        GRANT SELECT ON pepsi.schema_version TO pepsi_dispatch;
        -- The claim's, the resets' and the retry writes' columns: no envelope, no
        -- header block, no body (the dispatcher never processes message content).
        GRANT SELECT (workqueue_id, stage, status, timeout, state, sender_key, claim, hops,
                      hop_stage),
              UPDATE (status, timeout, state, claim, hops, hop_stage)
           ON pepsi.workqueue TO pepsi_dispatch;
        GRANT USAGE ON SEQUENCE pepsi.workqueue_claim_seq TO pepsi_dispatch;
        GRANT SELECT, INSERT, UPDATE ON pepsi.stage_stats TO pepsi_dispatch;
        GRANT SELECT, UPDATE ON pepsi.dispatch_stats TO pepsi_dispatch;
        GRANT EXECUTE ON FUNCTION
            pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[],
                                       float8[], int4),
            pepsi.workqueue_strike(bigint, text, text, text, bigint),
            pepsi.workqueue_body_gc(integer),
            pepsi.terminate_worker_sessions(text[]),
            pepsi.config_override_rows(),
            pepsi.address_domain(text),
            pepsi.sender_key(text, inet, text, text[])
            TO pepsi_dispatch;
    END IF;

    IF 'pepsi_worker' = ANY (v_present) THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM pepsi_worker;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM pepsi_worker;
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM pepsi_worker;
        GRANT USAGE ON SCHEMA pepsi TO pepsi_worker;
        GRANT SELECT ON pepsi.schema_version, pepsi.workqueue, pepsi.workqueue_body,
                        pepsi.settings
           TO pepsi_worker;
        -- The columns of a stage's outcome (sql::WRITE_OUTCOMES, FAIL_IN_PLACE,
        -- PAUSE_OR_FAIL_UNWRITTEN); a finish deletes the row (DELETE_FINISHED).
        GRANT UPDATE (stage, status, timeout, state, mail_from, rcpt_to, header_from, subject),
              DELETE
           ON pepsi.workqueue TO pepsi_worker;
        GRANT EXECUTE ON FUNCTION
            pepsi.workqueue_split(bigint, jsonb, text, text, jsonb, boolean, bigint),
            pepsi.workqueue_bounce(bigint, text, bigint, text, text, text, text, bytea, bytea),
            pepsi.config_override_rows(),
            pepsi.lifetime_start(jsonb, timestamptz),
            pepsi.address_domain(text),
            pepsi.sender_key(text, inet, text, text[])
            TO pepsi_worker;
    END IF;

    IF 'pepsi_admin' = ANY (v_present) THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM pepsi_admin;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM pepsi_admin;
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM pepsi_admin;
        GRANT USAGE ON SCHEMA pepsi TO pepsi_admin;
        GRANT SELECT ON pepsi.schema_version, pepsi.workqueue, pepsi.workqueue_body,
                        pepsi.stage_stats, pepsi.dispatch_stats
           TO pepsi_admin;
        -- The repair functions' and the failure bouncer's columns.
        GRANT UPDATE (stage, status, timeout, state, hops, hop_stage), DELETE
           ON pepsi.workqueue TO pepsi_admin;
        GRANT SELECT, INSERT, UPDATE, DELETE ON pepsi.config_override, pepsi.settings
           TO pepsi_admin;
        GRANT EXECUTE ON FUNCTION
            pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text, text,
                                   jsonb),
            pepsi.workqueue_resume(bigint[]),
            pepsi.workqueue_resume(text, pepsi.workqueue_status),
            pepsi.workqueue_resume_each(bigint[]),
            pepsi.workqueue_hold(bigint[]),
            pepsi.workqueue_release(bigint[]),
            pepsi.workqueue_delete(bigint[]),
            pepsi.workqueue_requeue(bigint[], text),
            pepsi.workqueue_bounce_failed(text, pepsi.workqueue_status[], integer),
            pepsi.config_override_rows(),
            pepsi.resumed_state(jsonb),
            pepsi.lifetime_start(jsonb, timestamptz),
            pepsi.address_domain(text),
            pepsi.sender_key(text, inet, text, text[])
            TO pepsi_admin;
    END IF;

    IF 'pepsi_inject' = ANY (v_present) THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM pepsi_inject;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM pepsi_inject;
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pepsi FROM pepsi_inject;
        GRANT USAGE ON SCHEMA pepsi TO pepsi_inject;
        -- The schema check every program runs, and the stage check of pepsi-queue
        -- inject.
        GRANT SELECT ON pepsi.schema_version TO pepsi_inject;
        GRANT EXECUTE ON FUNCTION
            pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text, text,
                                   jsonb),
            pepsi.config_override_rows()
            TO pepsi_inject;
    END IF;
END $$;

COMMENT ON FUNCTION pepsi.config_override_rows() IS
    'The configuration overlay (pepsi.config_override) as rows, for every program: '
    'SECURITY DEFINER, so roles without access to the table (pepsi_worker, pepsi_inject) '
    'can read it and nothing else.';
COMMENT ON FUNCTION pepsi.terminate_worker_sessions(text[]) IS
    'The dispatcher''s termination of worker sessions: sessions of this database named '
    'pepsi-worker:… that match one of p_patterns (LIKE), waiting up to a second for each. '
    'SECURITY DEFINER: runs as the schema owner, so pepsi_dispatch needs no right to '
    'signal other backends. Returns how many were terminated and how many the owner may '
    'not signal (refused).';
COMMENT ON FUNCTION pepsi.setup_roles() IS
    'Run by pepsi-setup on every run: creates the group roles pepsi_dispatch, pepsi_worker, '
    'pepsi_admin and pepsi_inject when the caller may create roles, grants each existing '
    'one exactly its privileges on this database, and revokes EXECUTE on the schema''s '
    'functions from PUBLIC. Returns each role with created, present or missing.';
