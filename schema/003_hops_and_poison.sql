-- Pepsi schema, version 3: the loop limit (SPEC §6 "Hops"), rows that cannot poison
-- the clocks, and deferrals in the statistics.

-- How many times the row was claimed at a stage other than the stage of its previous
-- claim (retries at one stage do not count), and that stage. The claim fails a row
-- whose hops would pass [pepsi-dispatch] MAX_HOPS with failure_class 'looped'.
ALTER TABLE pepsi.workqueue
    ADD COLUMN hops integer NOT NULL DEFAULT 0,
    ADD COLUMN hop_stage text;

-- A paused row must say when it is due, and a finite time; every row a finite arrival.
-- NOT VALID: rows written before keep whatever they hold (the claim and the paused
-- clock cope with any stored value); every later write is checked.
ALTER TABLE pepsi.workqueue
    ADD CONSTRAINT workqueue_paused_timeout_check
        CHECK (status <> 'paused' OR (timeout IS NOT NULL AND isfinite(timeout))) NOT VALID,
    ADD CONSTRAINT workqueue_arrived_check CHECK (isfinite(arrived)) NOT VALID;

-- Deferrals (§8.4): messages whose worker lost the database, paused for a retry.
ALTER TABLE pepsi.stage_stats ADD COLUMN deferrals bigint NOT NULL DEFAULT 0;

-- A resumed row starts its loop count afresh: an operator who resumes a looped
-- message after fixing the graph means it.
CREATE OR REPLACE FUNCTION pepsi.workqueue_resume(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    UPDATE pepsi.workqueue
       SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(state),
           hops = 0, hop_stage = NULL
     WHERE workqueue_id = ANY (p_ids)
       AND status IN ('paused', 'failed', 'timeout');
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN n;
END $$;

CREATE OR REPLACE FUNCTION pepsi.workqueue_resume(p_stage text, p_status pepsi.workqueue_status)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    IF p_status IS NOT NULL AND p_status NOT IN ('paused', 'failed', 'timeout') THEN
        RAISE EXCEPTION 'workqueue_resume: status % cannot be resumed', p_status
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pepsi.workqueue
       SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(state),
           hops = 0, hop_stage = NULL
     WHERE (p_stage IS NULL OR stage = p_stage)
       AND status IN ('paused', 'failed', 'timeout')
       AND (p_status IS NULL OR status = p_status);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN n;
END $$;
