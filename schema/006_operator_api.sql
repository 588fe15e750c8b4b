-- Pepsi schema, version 6: the operator's repair functions behind `pepsi-queue`
-- (SPEC §14), the `held` status, and a comment on every object of the schema, so that
-- `\d+` and `\df+` in psql document the public SQL API.
--
-- `pepsi-setup` applies every missing file in one transaction, and a value added to an
-- enum inside a transaction cannot be used before that transaction commits. So nothing
-- in this file that PostgreSQL checks at creation uses 'held': the functions that do
-- are PL/pgSQL (their statements are planned when first called, after the commit), and
-- no index, constraint or SQL-language function mentions it.

-- A held row is set aside by an operator (`pepsi-queue hold`): the claims take only
-- 'pending', the paused clock only 'paused', the failure bouncer only 'failed' and
-- 'timeout', and the dispatcher's resets only 'running' rows, so nothing moves a held
-- row until `pepsi-queue release` (or requeue, or delete) does.
ALTER TYPE pepsi.workqueue_status ADD VALUE 'held';

-- A resumed, released or requeued row starts its stage afresh; the hold's own keys go
-- too.
CREATE OR REPLACE FUNCTION pepsi.resumed_state(s jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN s - 'strikes' - 'strike_stage' - 'failure_class' - 'failed_stage'
         - 'temporary_failures' - 'temporary_stage' - 'unwritten' - 'held_at' - 'held_from';

-- The repair functions share one shape. Each takes message ids and answers one row per
-- distinct id given (in id order): the id, the status the row had when the call found
-- it (NULL: no such row), and whether the call changed it. A row in a status the
-- function does not touch is answered unchanged, and a running row is never touched:
-- it belongs to a worker. The rows found are locked in id order before anything is
-- written (two callers at once cannot deadlock, and the status answered is the one the
-- write saw). When anything changed the function sends NOTIFY workqueue, once, however
-- many rows it changed: one call is one round trip and one wake-up of the dispatcher.

-- Resumes the given paused, failed or timeout rows as pending, like
-- workqueue_resume(bigint[]), answering for each id.
CREATE FUNCTION pepsi.workqueue_resume_each(p_ids bigint[])
RETURNS TABLE (workqueue_id bigint, status pepsi.workqueue_status, changed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_statuses pepsi.workqueue_status[];
    v_changed boolean[];
BEGIN
    WITH given AS (
        SELECT DISTINCT g.id FROM unnest(p_ids) AS g(id) WHERE g.id IS NOT NULL
    ), found AS MATERIALIZED (
        SELECT w.workqueue_id, w.status FROM pepsi.workqueue w
         WHERE w.workqueue_id IN (SELECT g.id FROM given g)
         ORDER BY w.workqueue_id
           FOR UPDATE
    ), done AS (
        UPDATE pepsi.workqueue w
           SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(w.state),
               hops = 0, hop_stage = NULL
          FROM found f
         WHERE w.workqueue_id = f.workqueue_id
           AND w.status IN ('paused', 'failed', 'timeout')
        RETURNING w.workqueue_id
    )
    SELECT array_agg(g.id ORDER BY g.id), array_agg(f.status ORDER BY g.id),
           array_agg(d.workqueue_id IS NOT NULL ORDER BY g.id)
      INTO v_ids, v_statuses, v_changed
      FROM given g
      LEFT JOIN found f ON f.workqueue_id = g.id
      LEFT JOIN done d ON d.workqueue_id = g.id;
    IF true = ANY (v_changed) THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_statuses, v_changed);
END $$;

-- Holds the given pending, paused, failed or timeout rows: status 'held', no retry
-- time, and state.held_at (when) and state.held_from (the status it had).
CREATE FUNCTION pepsi.workqueue_hold(p_ids bigint[])
RETURNS TABLE (workqueue_id bigint, status pepsi.workqueue_status, changed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_statuses pepsi.workqueue_status[];
    v_changed boolean[];
BEGIN
    WITH given AS (
        SELECT DISTINCT g.id FROM unnest(p_ids) AS g(id) WHERE g.id IS NOT NULL
    ), found AS MATERIALIZED (
        SELECT w.workqueue_id, w.status FROM pepsi.workqueue w
         WHERE w.workqueue_id IN (SELECT g.id FROM given g)
         ORDER BY w.workqueue_id
           FOR UPDATE
    ), done AS (
        UPDATE pepsi.workqueue w
           SET status = 'held', timeout = NULL,
               state = w.state || jsonb_build_object('held_at', now(), 'held_from', w.status)
          FROM found f
         WHERE w.workqueue_id = f.workqueue_id
           AND w.status IN ('pending', 'paused', 'failed', 'timeout')
        RETURNING w.workqueue_id
    )
    SELECT array_agg(g.id ORDER BY g.id), array_agg(f.status ORDER BY g.id),
           array_agg(d.workqueue_id IS NOT NULL ORDER BY g.id)
      INTO v_ids, v_statuses, v_changed
      FROM given g
      LEFT JOIN found f ON f.workqueue_id = g.id
      LEFT JOIN done d ON d.workqueue_id = g.id;
    IF true = ANY (v_changed) THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_statuses, v_changed);
END $$;

-- Releases the given held rows: pending at their stage, started afresh like a resume.
CREATE FUNCTION pepsi.workqueue_release(p_ids bigint[])
RETURNS TABLE (workqueue_id bigint, status pepsi.workqueue_status, changed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_statuses pepsi.workqueue_status[];
    v_changed boolean[];
BEGIN
    WITH given AS (
        SELECT DISTINCT g.id FROM unnest(p_ids) AS g(id) WHERE g.id IS NOT NULL
    ), found AS MATERIALIZED (
        SELECT w.workqueue_id, w.status FROM pepsi.workqueue w
         WHERE w.workqueue_id IN (SELECT g.id FROM given g)
         ORDER BY w.workqueue_id
           FOR UPDATE
    ), done AS (
        UPDATE pepsi.workqueue w
           SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(w.state),
               hops = 0, hop_stage = NULL
          FROM found f
         WHERE w.workqueue_id = f.workqueue_id AND w.status = 'held'
        RETURNING w.workqueue_id
    )
    SELECT array_agg(g.id ORDER BY g.id), array_agg(f.status ORDER BY g.id),
           array_agg(d.workqueue_id IS NOT NULL ORDER BY g.id)
      INTO v_ids, v_statuses, v_changed
      FROM given g
      LEFT JOIN found f ON f.workqueue_id = g.id
      LEFT JOIN done d ON d.workqueue_id = g.id;
    IF true = ANY (v_changed) THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_statuses, v_changed);
END $$;

-- Deletes the given rows that are not running; a body goes with the last row that
-- references it (the workqueue_body_release trigger).
CREATE FUNCTION pepsi.workqueue_delete(p_ids bigint[])
RETURNS TABLE (workqueue_id bigint, status pepsi.workqueue_status, changed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_statuses pepsi.workqueue_status[];
    v_changed boolean[];
BEGIN
    WITH given AS (
        SELECT DISTINCT g.id FROM unnest(p_ids) AS g(id) WHERE g.id IS NOT NULL
    ), found AS MATERIALIZED (
        SELECT w.workqueue_id, w.status FROM pepsi.workqueue w
         WHERE w.workqueue_id IN (SELECT g.id FROM given g)
         ORDER BY w.workqueue_id
           FOR UPDATE
    ), done AS (
        DELETE FROM pepsi.workqueue w
         USING found f
         WHERE w.workqueue_id = f.workqueue_id AND w.status <> 'running'
        RETURNING w.workqueue_id
    )
    SELECT array_agg(g.id ORDER BY g.id), array_agg(f.status ORDER BY g.id),
           array_agg(d.workqueue_id IS NOT NULL ORDER BY g.id)
      INTO v_ids, v_statuses, v_changed
      FROM given g
      LEFT JOIN found f ON f.workqueue_id = g.id
      LEFT JOIN done d ON d.workqueue_id = g.id;
    IF true = ANY (v_changed) THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_statuses, v_changed);
END $$;

-- Moves the given rows that are not running to stage p_stage as pending, started
-- afresh like a resume (a held row too: moving it is the operator's decision).
CREATE FUNCTION pepsi.workqueue_requeue(p_ids bigint[], p_stage text)
RETURNS TABLE (workqueue_id bigint, status pepsi.workqueue_status, changed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_statuses pepsi.workqueue_status[];
    v_changed boolean[];
BEGIN
    IF p_stage IS NULL OR p_stage = '' THEN
        RAISE EXCEPTION 'workqueue_requeue: the stage is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH given AS (
        SELECT DISTINCT g.id FROM unnest(p_ids) AS g(id) WHERE g.id IS NOT NULL
    ), found AS MATERIALIZED (
        SELECT w.workqueue_id, w.status FROM pepsi.workqueue w
         WHERE w.workqueue_id IN (SELECT g.id FROM given g)
         ORDER BY w.workqueue_id
           FOR UPDATE
    ), done AS (
        UPDATE pepsi.workqueue w
           SET stage = p_stage, status = 'pending', timeout = NULL,
               state = pepsi.resumed_state(w.state), hops = 0, hop_stage = NULL
          FROM found f
         WHERE w.workqueue_id = f.workqueue_id AND w.status <> 'running'
        RETURNING w.workqueue_id
    )
    SELECT array_agg(g.id ORDER BY g.id), array_agg(f.status ORDER BY g.id),
           array_agg(d.workqueue_id IS NOT NULL ORDER BY g.id)
      INTO v_ids, v_statuses, v_changed
      FROM given g
      LEFT JOIN found f ON f.workqueue_id = g.id
      LEFT JOIN done d ON d.workqueue_id = g.id;
    IF true = ANY (v_changed) THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_statuses, v_changed);
END $$;

-- The documentation of every object, files 001–006.

COMMENT ON SCHEMA pepsi IS
    'Pepsi mail system: the work queue (one row per message at a stage), its bodies, the '
    'stage configuration overlay, per-address settings, the dispatcher''s statistics, and '
    'the public SQL API (workqueue_inject, workqueue_resume, the repair functions).';

COMMENT ON TYPE pepsi.workqueue_status IS
    'Where a row stands at its stage: pending (waiting for a claim), running (claimed; its '
    'worker owns it), paused (retried at its timeout), failed and timeout (given up; the '
    'failure bouncer moves them to the bounce stage), held (set aside by an operator; '
    'nothing moves it until it is released).';

-- pepsi.workqueue
COMMENT ON TABLE pepsi.workqueue IS
    'The work queue: one row per message, or per recipient group of a message, sitting at '
    'a stage with a status. Insert with pepsi.workqueue_inject, never directly: it also '
    'stores the body and wakes the dispatcher.';
COMMENT ON COLUMN pepsi.workqueue.workqueue_id IS
    'The message id; claims take the oldest (lowest) ids first.';
COMMENT ON COLUMN pepsi.workqueue.stage IS
    'The stage the row is at: the [stage-NAME] section whose PROGRAM runs it. Rows at a '
    'stage without a section are never claimed.';
COMMENT ON COLUMN pepsi.workqueue.status IS
    'pending, running, paused, failed, timeout or held (see the type).';
COMMENT ON COLUMN pepsi.workqueue.timeout IS
    'For a paused row: when it is retried (a finite time, required). NULL otherwise.';
COMMENT ON COLUMN pepsi.workqueue.arrived IS
    'When the message arrived; MAX_LIFETIME counts from here (from state.dsn_created for a '
    'delivery status notification). Kept by splits and moves.';
COMMENT ON COLUMN pepsi.workqueue.mail_from IS
    'The envelope sender (SMTP MAIL FROM); the empty string is the null sender of a '
    'bounce or auto-reply.';
COMMENT ON COLUMN pepsi.workqueue.rcpt_to IS
    'The envelope recipients (SMTP RCPT TO): at least one, no NULL.';
COMMENT ON COLUMN pepsi.workqueue.auth_user IS
    'The authenticated submitter''s login, if any (first choice of sender_key).';
COMMENT ON COLUMN pepsi.workqueue.client_ip IS
    'The SMTP client''s address; NULL for mail generated locally.';
COMMENT ON COLUMN pepsi.workqueue.header_from IS
    'The address of the From: header field, extracted at injection (metadata for stages '
    'that do not load the header block).';
COMMENT ON COLUMN pepsi.workqueue.subject IS
    'The Subject: header field, RFC 2047 words decoded, extracted at injection.';
COMMENT ON COLUMN pepsi.workqueue.headers IS
    'The header block, as received, without the empty line that ends it. Loaded only by '
    'stages that need it.';
COMMENT ON COLUMN pepsi.workqueue.body_id IS
    'The body in pepsi.workqueue_body, shared by rows split or cloned from one message; '
    'released with the last row that references it.';
COMMENT ON COLUMN pepsi.workqueue.state IS
    'Per-message state, a JSON object. Set by injectors: dsn (RFC 3461 ret, envid and '
    'per-recipient notify/orcpt), local_origin (submitted locally: the sender is the '
    'correspondent), list_copy (a mailing-list copy, never bounced). Set by Pepsi: '
    'last_error, strikes, strike_stage, temporary_failures, temporary_stage, '
    'failure_class, failed_stage, dsn_created, dsn_of, held_at, held_from.';
COMMENT ON COLUMN pepsi.workqueue.sender_key IS
    'The fairness key, computed: user:LOGIN, else ip:ADDRESS (an IPv6 client by its /64), '
    'else null:DOMAIN of the first recipient for the null sender, else from:DOMAIN of the '
    'sender. See pepsi.sender_key.';
COMMENT ON COLUMN pepsi.workqueue.claim IS
    'The token of the row''s latest claim (0: never claimed); every write of a claim''s '
    'outcome is guarded by it.';
COMMENT ON COLUMN pepsi.workqueue.hops IS
    'Claims at a stage other than that of the previous claim; past [pepsi-dispatch] '
    'MAX_HOPS the claim fails the row as looped. A resume starts it afresh.';
COMMENT ON COLUMN pepsi.workqueue.hop_stage IS
    'The stage of the row''s previous claim (for counting hops).';

COMMENT ON INDEX pepsi.workqueue_pkey IS 'Message ids.';
COMMENT ON INDEX pepsi.workqueue_pending_idx IS
    'The oldest-first claim: pending rows per stage in id order.';
COMMENT ON INDEX pepsi.workqueue_pending_sender_idx IS
    'The fair claim: the senders waiting at a stage and each one''s oldest pending rows.';
COMMENT ON INDEX pepsi.workqueue_paused_idx IS
    'The paused-retry clock: the earliest due paused row first.';
COMMENT ON INDEX pepsi.workqueue_failed_idx IS
    'The failure bouncer''s sweep over failed and timeout rows.';
COMMENT ON INDEX pepsi.workqueue_body_id_idx IS
    'Whether any other row still references a body (the body release trigger).';
COMMENT ON SEQUENCE pepsi.workqueue_workqueue_id_seq IS
    'The identity of pepsi.workqueue.workqueue_id.';
COMMENT ON SEQUENCE pepsi.workqueue_claim_seq IS
    'Claim tokens: one value per claim statement that claims rows.';

COMMENT ON TRIGGER workqueue_body_release ON pepsi.workqueue IS
    'Deletes a row''s body once no other row references it.';
COMMENT ON TRIGGER workqueue_failed_notify_update ON pepsi.workqueue IS
    'NOTIFY workqueue_failed when a row becomes failed or timeout.';
COMMENT ON TRIGGER workqueue_failed_notify_insert ON pepsi.workqueue IS
    'NOTIFY workqueue_failed when a row is inserted failed or timeout.';

-- pepsi.workqueue_body
COMMENT ON TABLE pepsi.workqueue_body IS
    'Message bodies, shared by the rows split or cloned from one message.';
COMMENT ON COLUMN pepsi.workqueue_body.body_id IS 'The body''s id (pepsi.workqueue.body_id).';
COMMENT ON COLUMN pepsi.workqueue_body.body IS
    'The body: everything after the empty line that ends the header block, as received.';
COMMENT ON INDEX pepsi.workqueue_body_pkey IS 'Body ids.';
COMMENT ON SEQUENCE pepsi.workqueue_body_body_id_seq IS
    'The identity of pepsi.workqueue_body.body_id.';

-- pepsi.config_override
COMMENT ON TABLE pepsi.config_override IS
    'The configuration overlay over the [stage-*] sections of pepsi.conf: a row sets a '
    'key, an empty value unsets the file''s key. Written by pepsi-queue config set/unset, '
    'which checks the resulting stage graph first; every change notifies config_changed '
    'and the dispatcher reloads.';
COMMENT ON COLUMN pepsi.config_override.section IS 'The section, e.g. stage-relay.';
COMMENT ON COLUMN pepsi.config_override.key IS 'The key, upper case, e.g. PARALLELISM.';
COMMENT ON COLUMN pepsi.config_override.value IS
    'The value as in the file; empty unsets the file''s key.';
COMMENT ON INDEX pepsi.config_override_pkey IS 'One value per section and key.';
COMMENT ON TRIGGER config_override_notify ON pepsi.config_override IS
    'NOTIFY config_changed after every statement that changes the overlay.';

-- pepsi.settings
COMMENT ON TABLE pepsi.settings IS
    'Per-address overrides of [stage-NAME] options, applied for a message''s '
    'correspondents (SPEC §12.5): the sender of a local_origin message, else its '
    'recipients.';
COMMENT ON COLUMN pepsi.settings.address IS 'The address, lower case.';
COMMENT ON COLUMN pepsi.settings.stage IS 'The stage (section name without stage-).';
COMMENT ON COLUMN pepsi.settings.key IS 'The option; only keys the stage declares overridable.';
COMMENT ON COLUMN pepsi.settings.value IS 'The value, as in the file.';
COMMENT ON INDEX pepsi.settings_pkey IS 'One value per address, stage and key.';

-- pepsi.stage_stats
COMMENT ON TABLE pepsi.stage_stats IS
    'Cumulative counters per stage since installation, written only by the dispatcher '
    '(best effort: unflushed deltas die with it).';
COMMENT ON COLUMN pepsi.stage_stats.stage IS 'The stage.';
COMMENT ON COLUMN pepsi.stage_stats.passes IS
    'Messages run at the stage (one per message per pass, fused or not).';
COMMENT ON COLUMN pepsi.stage_stats.fused_passes IS
    'Of the passes, those run fused into a predecessor''s pass.';
COMMENT ON COLUMN pepsi.stage_stats.failures IS 'Passes whose worker failed the message.';
COMMENT ON COLUMN pepsi.stage_stats.crashes IS 'Workers that died holding a message.';
COMMENT ON COLUMN pepsi.stage_stats.timeouts IS
    'Messages whose worker was killed at MAX_RUNTIME.';
COMMENT ON COLUMN pepsi.stage_stats.requeues IS
    'Claimed messages put back to pending without a result (siblings of a crash, a '
    'worker that never became ready, overload).';
COMMENT ON COLUMN pepsi.stage_stats.busy_us IS
    'Worker time spent on messages, in microseconds.';
COMMENT ON COLUMN pepsi.stage_stats.updated IS 'When the dispatcher last added to the row.';
COMMENT ON COLUMN pepsi.stage_stats.deferrals IS
    'Messages paused because their worker lost the database (status 74).';
COMMENT ON COLUMN pepsi.stage_stats.senders_served IS
    'Distinct senders served, summed over the fair claims at the stage.';
COMMENT ON INDEX pepsi.stage_stats_pkey IS 'One row per stage.';

-- pepsi.dispatch_stats
COMMENT ON TABLE pepsi.dispatch_stats IS
    'Cumulative dispatcher counters, one row, written only by the dispatcher.';
COMMENT ON COLUMN pepsi.dispatch_stats.one_row IS 'Always true: the table has one row.';
COMMENT ON COLUMN pepsi.dispatch_stats.stages_executed IS
    'Worker passes (a fused chain counts once).';
COMMENT ON COLUMN pepsi.dispatch_stats.claims IS 'Claim statements that claimed rows.';
COMMENT ON COLUMN pepsi.dispatch_stats.rows_claimed IS 'Rows claimed.';
COMMENT ON COLUMN pepsi.dispatch_stats.worker_starts IS 'Worker processes started.';
COMMENT ON COLUMN pepsi.dispatch_stats.updated IS
    'When the dispatcher last flushed its counters (it flushes only when they changed).';
COMMENT ON INDEX pepsi.dispatch_stats_pkey IS 'The one row.';

-- pepsi.schema_version
COMMENT ON TABLE pepsi.schema_version IS
    'The installed schema, one row, written by pepsi-setup; every program checks it at '
    'start.';
COMMENT ON COLUMN pepsi.schema_version.one_row IS 'Always true: the table has one row.';
COMMENT ON COLUMN pepsi.schema_version.version IS 'The number of the last schema file applied.';
COMMENT ON COLUMN pepsi.schema_version.digest IS
    'SHA-256 over the names and bytes of the schema files up to that version.';
COMMENT ON INDEX pepsi.schema_version_pkey IS 'The one row.';

-- Functions
COMMENT ON FUNCTION pepsi.address_domain(text) IS
    'The domain of an address, lower case, without angle brackets or a trailing dot; an '
    'address without @ is its own domain.';
COMMENT ON FUNCTION pepsi.sender_key(text, inet, text, text[]) IS
    'The fairness key of a row (pepsi.workqueue.sender_key) from auth_user, client_ip, '
    'mail_from and rcpt_to.';
COMMENT ON FUNCTION pepsi.workqueue_body_release() IS
    'Trigger function: deletes the deleted row''s body when no other row references it.';
COMMENT ON FUNCTION pepsi.workqueue_failed_notify() IS
    'Trigger function: NOTIFY workqueue_failed (the failure bouncer listens).';
COMMENT ON FUNCTION pepsi.lifetime_start(jsonb, timestamptz) IS
    'When a message''s MAX_LIFETIME starts: state.dsn_created for a delivery status '
    'notification, else its arrival (also when dsn_created is malformed).';
COMMENT ON FUNCTION pepsi.workqueue_body_gc(integer) IS
    'Deletes up to p_limit bodies no row references (left by two concurrent deletes of '
    'the last sharers); returns how many. The dispatcher runs it every STATS_INTERVAL.';
COMMENT ON FUNCTION pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text,
                                           text, jsonb) IS
    'Injects one message as pending at stage p_stage and sends NOTIFY workqueue; returns '
    'its id. p_mail_from: envelope sender ('''' is the null sender); p_rcpt_to: envelope '
    'recipients (at least one); p_headers: the header block without its ending empty '
    'line; p_body: the body; optional p_auth_user, p_client_ip (fairness: the sender key), '
    'p_header_from (the From: address), p_subject (decoded), p_state (a JSON object: dsn, '
    'local_origin, list_copy). Notifications of one transaction are folded: a batch '
    'injected in one transaction wakes the dispatcher once.';
COMMENT ON FUNCTION pepsi.resumed_state(jsonb) IS
    'A state without the keys a resume, release or requeue clears (strikes, retry '
    'counters, failure class and stage, hold keys); last_error stays as history.';
COMMENT ON FUNCTION pepsi.workqueue_resume(bigint[]) IS
    'Resumes the given paused, failed or timeout rows as pending, started afresh; sends '
    'NOTIFY workqueue when any changed; returns how many changed.';
COMMENT ON FUNCTION pepsi.workqueue_resume(text, pepsi.workqueue_status) IS
    'Resumes the paused, failed or timeout rows at stage p_stage with status p_status '
    '(NULL: any of them) as pending; sends NOTIFY workqueue when any changed; returns how '
    'many changed.';
COMMENT ON FUNCTION pepsi.workqueue_split(bigint, jsonb, text, text, jsonb, boolean, bigint) IS
    'Splits a row''s recipients into groups (a JSON array of arrays): the first stays on '
    'the row, each other becomes a new pending row sharing the body. Optional guards and '
    'moves for a worker in a pass (p_claimed_stage, p_claim, p_stage, p_state, '
    'p_release). No NOTIFY. Returns the new ids, NULL when a guard did not match.';
COMMENT ON FUNCTION pepsi.workqueue_strike(bigint, text, text, text, bigint) IS
    'The dispatcher''s strike against a claimed row whose worker crashed on it or hung '
    '(p_kind crashed or timed-out): strikes 1 and 2 pause it 1 and 2 minutes, the third '
    'fails it. Guarded by stage and claim token.';
COMMENT ON FUNCTION pepsi.config_override_notify() IS
    'Trigger function: NOTIFY config_changed (the dispatcher reloads).';
COMMENT ON FUNCTION pepsi.workqueue_bounce_failed(text, pepsi.workqueue_status[], integer) IS
    'The failure bouncer''s move: up to p_limit failed or timeout rows (p_statuses) not at '
    'p_bounce_stage go there as pending, oldest first, with NOTIFY workqueue once when '
    'any moved. Returns each moved row''s id and its former stage and status.';
COMMENT ON FUNCTION pepsi.workqueue_bounce(bigint, text, bigint, text, text, text, text, bytea,
                                           bytea) IS
    'The bounce stage''s finish: inserts the delivery status notification (null sender, '
    'to p_rcpt_to) as a pending row at p_stage and deletes the original, guarded by its '
    'claimed stage and token. No NOTIFY. Returns the new id, NULL when the guard failed.';
COMMENT ON FUNCTION pepsi.workqueue_resume_each(bigint[]) IS
    'pepsi-queue resume: resumes the given paused, failed or timeout rows as pending, '
    'started afresh; NOTIFY workqueue once when any changed. Returns per distinct id its '
    'status before the call (NULL: no such row) and whether it changed.';
COMMENT ON FUNCTION pepsi.workqueue_hold(bigint[]) IS
    'pepsi-queue hold: sets the given pending, paused, failed or timeout rows held (never '
    'claimed, retried or bounced until released); NOTIFY workqueue once when any '
    'changed. Returns per distinct id its status before the call (NULL: no such row) and '
    'whether it changed.';
COMMENT ON FUNCTION pepsi.workqueue_release(bigint[]) IS
    'pepsi-queue release: the given held rows back to pending at their stage, started '
    'afresh; NOTIFY workqueue once when any changed. Returns per distinct id its status '
    'before the call (NULL: no such row) and whether it changed.';
COMMENT ON FUNCTION pepsi.workqueue_delete(bigint[]) IS
    'pepsi-queue delete: deletes the given rows that are not running (their bodies go '
    'with the last row that shares them); NOTIFY workqueue once when any was deleted. '
    'Returns per distinct id its status before the call (NULL: no such row) and whether '
    'it was deleted.';
COMMENT ON FUNCTION pepsi.workqueue_requeue(bigint[], text) IS
    'pepsi-queue requeue: moves the given rows that are not running to stage p_stage as '
    'pending, started afresh; NOTIFY workqueue once when any changed. Returns per '
    'distinct id its status before the call (NULL: no such row) and whether it changed.';
