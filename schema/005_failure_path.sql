-- Pepsi schema, version 5: the failure path (SPEC §13): the failure bouncer's move of
-- failed rows to the bounce stage, and the bounce stage's finish, which replaces a
-- failed message by its delivery status notification in one call.

-- Moves up to p_limit rows that are failed or timeout (those of p_statuses) and not
-- at p_bounce_stage to p_bounce_stage as pending, oldest first, and wakes the
-- dispatcher once if any moved. A row already at the bounce stage stays: a bounce that
-- fails there must not loop. The row keeps its state; the stage and class it failed
-- with are filled in where the failing writer left them out, so the bounce stage can
-- always say why. Its loop count starts afresh (a looped row must reach the bounce
-- stage too).
--
-- Two callers at once (the service and an operator's sweep) never move a row twice:
-- each locks the rows it picks, and one that waited for another's lock re-reads the
-- row and drops it once it is pending. Returns each moved row's id and the stage and
-- status it had.
CREATE FUNCTION pepsi.workqueue_bounce_failed(
    p_bounce_stage text,
    p_statuses pepsi.workqueue_status[],
    p_limit integer
) RETURNS TABLE (workqueue_id bigint, stage text, status pepsi.workqueue_status)
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    IF p_bounce_stage IS NULL OR p_bounce_stage = '' THEN
        RAISE EXCEPTION 'workqueue_bounce_failed: the bounce stage is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_statuses) s WHERE s NOT IN ('failed', 'timeout')) THEN
        RAISE EXCEPTION 'workqueue_bounce_failed: only failed and timeout rows are bounced'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH picked AS (
        SELECT w.workqueue_id, w.stage, w.status
          FROM pepsi.workqueue w
         WHERE w.status = ANY (p_statuses) AND w.stage <> p_bounce_stage
         ORDER BY w.workqueue_id
         LIMIT p_limit
           FOR UPDATE
    )
    UPDATE pepsi.workqueue w
       SET stage = p_bounce_stage,
           status = 'pending',
           timeout = NULL,
           hops = 0,
           hop_stage = NULL,
           state = w.state
                   || jsonb_build_object(
                          'failed_stage', coalesce(w.state ->> 'failed_stage', p.stage),
                          'failure_class',
                          coalesce(w.state ->> 'failure_class',
                                   CASE WHEN p.status = 'timeout' THEN 'timed-out'
                                        ELSE 'permanent' END))
      FROM picked p
     WHERE w.workqueue_id = p.workqueue_id
       AND w.status = ANY (p_statuses) AND w.stage <> p_bounce_stage
    RETURNING w.workqueue_id, p.stage, p.status;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        -- Once per call, however many rows it moved.
        PERFORM pg_notify('workqueue', '');
    END IF;
END $$;

-- The bounce stage's finish (SPEC §13.2): inserts the delivery status notification
-- for the running row p_id as a new pending row at p_stage — null sender, addressed
-- to p_rcpt_to, its own header block and body, state.dsn_created now and
-- state.dsn_of the original's id — and deletes the original, in one call. Guarded like
-- every worker write: the original must still be running at p_claimed_stage under
-- claim token p_claim, else nothing is written and NULL is returned. No NOTIFY: the
-- worker's own report brings the dispatcher to its next claim. Returns the new id.
CREATE FUNCTION pepsi.workqueue_bounce(
    p_id bigint,
    p_claimed_stage text,
    p_claim bigint,
    p_stage text,
    p_rcpt_to text,
    p_header_from text,
    p_subject text,
    p_headers bytea,
    p_body bytea
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_body_id bigint;
    v_id bigint;
BEGIN
    PERFORM 1 FROM pepsi.workqueue w
      WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_claimed_stage
        AND w.claim = p_claim
        FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_body IS NOT NULL THEN
        INSERT INTO pepsi.workqueue_body (body) VALUES (p_body) RETURNING body_id INTO v_body_id;
    END IF;
    INSERT INTO pepsi.workqueue
        (stage, status, mail_from, rcpt_to, header_from, subject, headers, body_id, state)
    VALUES
        (p_stage, 'pending', '', ARRAY[p_rcpt_to], p_header_from, p_subject, p_headers,
         v_body_id, jsonb_build_object('dsn_created', now(), 'dsn_of', p_id))
    RETURNING workqueue_id INTO v_id;
    DELETE FROM pepsi.workqueue w WHERE w.workqueue_id = p_id;
    RETURN v_id;
END $$;
