-- Pepsi schema, version 22: what became of each message — its trail through the
-- stages, and a delivery history kept for [pepsi] HISTORY_RETENTION (pepsi-queue
-- trace; doc/operating.md "Following a message").
--
-- The queue's rows gain three columns:
-- - trail: the stages a row passed, appended by the write that moves it on: a line
--   "STAGE US AT" per stage a worker ran (its time in microseconds, and the epoch
--   milliseconds when the pass ended); no extra statement, it rides on the write the
--   hop makes anyway, and text is appended without parsing what is there;
-- - origin: the id of the message a row was split from (NULL: the row is the
--   original), so the parts of a message are found together;
-- - message_id: the Message-ID of the header block, computed by the database from
--   the stored header block whenever it is written (a stored generated column, so no
--   writer can set it and no injecting program needs to know of it).
--
-- pepsi.history holds one row per recipient outcome (delivered, deferred, bounced,
-- expired, discarded), one per split-off part (split) and one per delivery status
-- notification made (returned), written by the function that writes the outcome, in
-- its statement: the stage's own round trip, nothing more. It is partitioned by day
-- (UTC); pepsi.history_maintain, run by the dispatcher at start and every hour, makes
-- the next days' partitions and drops whole days past the retention. Rows that come
-- when no partition is ready land in pepsi.history_default and are deleted there by
-- age. Workers write it only through the outcome functions; admins read it.

-- The Message-ID of a header block: the first Message-ID field's <…> (folded or
-- not), of printable ASCII without '<', '>' and '\', at most 250 characters; NULL
-- when there is none. Reads the first 64 KiB only; never fails (NUL and bytes beyond
-- ASCII are seen as \ooo escapes, whose backslash no Message-ID may hold). The field is found by
-- position and only a short slice goes through the regular expression: computed for
-- every message queued, it must cost little (a few microseconds).
CREATE FUNCTION pepsi.header_message_id(p_headers bytea) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE STRICT SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_text text := E'\n' || pg_catalog.encode(pg_catalog.substring(p_headers, 1, 65536), 'escape');
    v_at integer;
    v_id text;
BEGIN
    v_at := pg_catalog.strpos(pg_catalog.lower(v_text), E'\nmessage-id:');
    IF v_at = 0 THEN
        RETURN NULL;
    END IF;
    v_id := pg_catalog.substring(pg_catalog.substr(v_text, v_at + 12, 400),
                                 '^[ \t]*(?:\r?\n[ \t]+)?(<[]!-;=?-[^-~]+>)');
    RETURN CASE WHEN pg_catalog.length(v_id) <= 252 THEN v_id END;
END $$;

COMMENT ON FUNCTION pepsi.header_message_id(bytea) IS
    'The Message-ID (with its angle brackets) of a header block, or NULL: the first '
    'Message-ID field''s value, printable ASCII, at most 250 characters.';

ALTER TABLE pepsi.workqueue
    ADD COLUMN trail text,
    ADD COLUMN origin bigint,
    ADD COLUMN message_id text GENERATED ALWAYS AS (pepsi.header_message_id(headers)) STORED;

COMMENT ON COLUMN pepsi.workqueue.trail IS
    'The stages this message passed, oldest first: a line "STAGE US AT" each (the '
    'worker''s time there in microseconds, the epoch milliseconds the pass ended), '
    'appended by the write that moves it on; NULL before its first stage.';
COMMENT ON COLUMN pepsi.workqueue.origin IS
    'The id of the message this row was split from; NULL for the original.';
COMMENT ON COLUMN pepsi.workqueue.message_id IS
    'The header block''s Message-ID (pepsi.header_message_id), computed by the database.';

CREATE TABLE pepsi.history (
    at timestamptz NOT NULL DEFAULT now(),
    workqueue_id bigint NOT NULL,
    origin bigint NOT NULL,
    event text NOT NULL
        CHECK (event IN ('delivered', 'deferred', 'bounced', 'expired', 'discarded',
                         'split', 'returned')),
    stage text NOT NULL,
    mail_from text NOT NULL,
    recipient text,
    message_id text,
    relay text,
    reply text,
    remote_id text,
    dsn text,
    arrived timestamptz,
    queued_ms bigint,
    stage_ms bigint,
    trail text,
    detail jsonb
) PARTITION BY RANGE (at);

COMMENT ON TABLE pepsi.history IS
    'What became of each message, one row per recipient outcome, split-off part and '
    'notification made, kept for [pepsi] HISTORY_RETENTION; partitioned by day (UTC). '
    'Written only by the outcome functions; read by pepsi-queue trace.';
COMMENT ON COLUMN pepsi.history.at IS 'When the outcome was written (its transaction''s time).';
COMMENT ON COLUMN pepsi.history.workqueue_id IS 'The row the outcome was written for.';
COMMENT ON COLUMN pepsi.history.origin IS
    'The message''s original id (the row''s own id unless it was split from another).';
COMMENT ON COLUMN pepsi.history.event IS
    'delivered, deferred, bounced (failed for good), expired (retried past its lifetime), '
    'discarded, split (this row was split off; detail names the row and recipients), '
    'returned (a delivery status notification was made; detail names it).';
COMMENT ON COLUMN pepsi.history.stage IS 'The stage that decided the outcome.';
COMMENT ON COLUMN pepsi.history.mail_from IS 'The envelope sender; '''' is the null sender.';
COMMENT ON COLUMN pepsi.history.recipient IS
    'The recipient the outcome is for (for returned: the sender notified; NULL for split).';
COMMENT ON COLUMN pepsi.history.message_id IS 'The message''s Message-ID, if it has one.';
COMMENT ON COLUMN pepsi.history.relay IS
    'Where the stage handed the message: host[address]:port, or the stage''s own name.';
COMMENT ON COLUMN pepsi.history.reply IS
    'The downstream reply or the reason (at most 2000 characters, as received).';
COMMENT ON COLUMN pepsi.history.remote_id IS
    'The next hop''s queue id, when its reply named one ("queued as X", "id=X").';
COMMENT ON COLUMN pepsi.history.dsn IS 'The enhanced status code (2.0.0, 4.4.1, 5.1.1, …).';
COMMENT ON COLUMN pepsi.history.arrived IS 'When the message arrived.';
COMMENT ON COLUMN pepsi.history.queued_ms IS
    'Milliseconds the message waited at the stage before this pass began.';
COMMENT ON COLUMN pepsi.history.stage_ms IS 'Milliseconds this pass took in the stage.';
COMMENT ON COLUMN pepsi.history.trail IS
    'At an outcome other than a deferral: the stages the row passed (its trail, the '
    'pass that decided included).';
COMMENT ON COLUMN pepsi.history.detail IS
    'More, as JSON: the split''s original row, stage and recipients; the notification''s '
    'id and the recipients it reports.';

CREATE INDEX history_workqueue_id ON pepsi.history (workqueue_id) WHERE event = 'split';
CREATE INDEX history_origin ON pepsi.history (origin);
CREATE INDEX history_message_id ON pepsi.history (message_id) WHERE message_id IS NOT NULL;
CREATE INDEX history_remote_id ON pepsi.history (remote_id) WHERE remote_id IS NOT NULL;
COMMENT ON INDEX pepsi.history_workqueue_id IS
    'pepsi-queue trace ID of a part split off (the original''s id is its origin).';
COMMENT ON INDEX pepsi.history_origin IS 'All parts of a message, for pepsi-queue trace.';
COMMENT ON INDEX pepsi.history_message_id IS 'pepsi-queue trace --message-id.';
COMMENT ON INDEX pepsi.history_remote_id IS 'pepsi-queue trace --remote-id.';

CREATE TABLE pepsi.history_default PARTITION OF pepsi.history DEFAULT;
COMMENT ON TABLE pepsi.history_default IS
    'History rows of days that had no partition yet; pepsi.history_maintain deletes them '
    'by age.';

-- workqueue_write, as in schema 17, and: each element may carry "trail" (text
-- appended to the row's trail) and "log" (records of the outcome, written to
-- pepsi.history in the same statement).
CREATE OR REPLACE FUNCTION pepsi.workqueue_write(p_rows jsonb) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_row record;
    v_problem text;
    v_rewritten boolean := false;
    v_logged boolean := false;
    v_ids bigint[];
BEGIN
    IF jsonb_typeof(p_rows) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'workqueue_write: the rows are not a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_row IN SELECT * FROM jsonb_to_recordset(p_rows) AS x(id bigint, stage text,
                  status text, state jsonb, rewritten boolean, mail_from text,
                  rcpt_to text[], prepend_headers text, log jsonb) LOOP
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
        IF v_row.log IS NOT NULL THEN
            IF jsonb_typeof(v_row.log) <> 'array' THEN
                RAISE EXCEPTION 'workqueue_write(%): the log is not a JSON array', v_row.id
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            v_logged := true;
        END IF;
        IF v_row.rewritten THEN
            v_rewritten := true;
            v_problem := pepsi.envelope_problem(v_row.mail_from, v_row.rcpt_to);
            IF v_problem IS NOT NULL THEN
                RAISE EXCEPTION 'workqueue_write(%): %', v_row.id, v_problem
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            v_problem := pepsi.header_fields_problem(v_row.prepend_headers);
            IF v_problem IS NOT NULL THEN
                RAISE EXCEPTION 'workqueue_write(%): the header fields to prepend %', v_row.id,
                        v_problem
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
        ELSIF v_row.prepend_headers IS NOT NULL THEN
            RAISE EXCEPTION 'workqueue_write(%): header fields to prepend on a row not rewritten',
                    v_row.id
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    -- Built once: appending in the loop would copy the array for every row.
    v_ids := ARRAY(SELECT x.id FROM jsonb_to_recordset(p_rows) AS x(id bigint));
    IF v_rewritten OR v_logged THEN
        RETURN QUERY
        WITH r AS MATERIALIZED (
            SELECT * FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text,
                   claim bigint, stage text, status text, delay_ms bigint, state jsonb,
                   rewritten boolean, mail_from text, rcpt_to text[], header_from text,
                   subject text, prepend_headers text, trail text, log jsonb)
        ), w AS (
            UPDATE pepsi.workqueue q
               SET stage = r.stage,
                   status = r.status::pepsi.workqueue_status,
                   timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                                  ELSE now() + r.delay_ms * interval '1 millisecond' END,
                   state = r.state - 'unwritten',
                   trail = CASE WHEN r.trail IS NULL THEN q.trail
                                ELSE coalesce(q.trail, '') || r.trail END,
                   mail_from = CASE WHEN r.rewritten THEN r.mail_from ELSE q.mail_from END,
                   rcpt_to = CASE WHEN r.rewritten THEN r.rcpt_to ELSE q.rcpt_to END,
                   header_from = CASE WHEN r.rewritten THEN r.header_from ELSE q.header_from END,
                   subject = CASE WHEN r.rewritten THEN r.subject ELSE q.subject END,
                   headers = CASE WHEN r.rewritten AND r.prepend_headers IS NOT NULL
                                  THEN decode(r.prepend_headers, 'base64') || coalesce(q.headers, ''::bytea)
                                  ELSE q.headers END
              FROM r
             WHERE q.workqueue_id = ANY (v_ids) AND q.workqueue_id = r.id
               AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
            RETURNING q.workqueue_id, coalesce(q.origin, q.workqueue_id) AS origin, q.mail_from,
                      q.message_id, q.arrived, q.trail
        ), h AS (
            INSERT INTO pepsi.history (at, workqueue_id, origin, event, stage, mail_from,
                   recipient, message_id, relay, reply, remote_id, dsn, arrived, queued_ms,
                   stage_ms, trail)
            SELECT now(), w.workqueue_id, w.origin, l.event, left(l.stage, 200),
                   w.mail_from, left(l.rcpt, 1000), w.message_id, left(l.relay, 300),
                   left(l.reply, 2000), left(l.remote_id, 200), left(l.dsn, 20), w.arrived,
                   l.queued_ms, l.stage_ms,
                   CASE WHEN l.event <> 'deferred' THEN w.trail END
              FROM w JOIN r ON r.id = w.workqueue_id,
                   jsonb_to_recordset(CASE WHEN jsonb_typeof(r.log) = 'array' THEN r.log
                                           ELSE '[]'::jsonb END)
                   AS l(event text, stage text, rcpt text, relay text, reply text,
                        remote_id text, dsn text, queued_ms bigint, stage_ms bigint)
             WHERE r.log IS NOT NULL
        )
        SELECT w.workqueue_id FROM w;
    ELSE
        -- Naming no column sender_key or message_id is computed from, the UPDATE leaves
        -- the stored generated columns as they are instead of computing them again.
        RETURN QUERY
        UPDATE pepsi.workqueue q
           SET stage = r.stage,
               status = r.status::pepsi.workqueue_status,
               timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                              ELSE now() + r.delay_ms * interval '1 millisecond' END,
               state = r.state - 'unwritten',
               trail = CASE WHEN r.trail IS NULL THEN q.trail
                            ELSE coalesce(q.trail, '') || r.trail END
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb, trail text)
         WHERE q.workqueue_id = ANY (v_ids) AND q.workqueue_id = r.id
           AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
        RETURNING q.workqueue_id;
    END IF;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_write(jsonb) IS
    'A stage worker''s outcome writes for a batch: each row of p_rows written only while '
    'it is running at its claimed stage under the claim token the dispatcher handed with '
    'it; statuses running, pending, paused or failed; a rewritten envelope must be clean; '
    'a rewritten row may carry prepend_headers (base64 header fields put before the '
    'stored header block, checked by pepsi.header_fields_problem); "trail" (text) is '
    'appended to the row''s trail and "log" written to pepsi.history. Returns the ids '
    'written.';

-- A worker's finished messages: deleted, guarded as workqueue_write, each with its
-- records written to pepsi.history in the same statement. Replaces workqueue_finish.
CREATE FUNCTION pepsi.workqueue_done(p_rows jsonb) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_ids bigint[];
BEGIN
    IF jsonb_typeof(p_rows) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'workqueue_done: the rows are not a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_ids := ARRAY(SELECT x.id FROM jsonb_to_recordset(p_rows) AS x(id bigint));
    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT * FROM jsonb_to_recordset(p_rows)
               AS r(id bigint, claimed text, claim bigint, trail text, log jsonb)
    ), d AS (
        DELETE FROM pepsi.workqueue q
         USING r
         WHERE q.workqueue_id = ANY (v_ids) AND q.workqueue_id = r.id
           AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
        RETURNING q.workqueue_id, coalesce(q.origin, q.workqueue_id) AS origin, q.mail_from,
                  q.message_id, q.arrived, coalesce(q.trail, '') || coalesce(r.trail, '') AS trail
    ), h AS (
        INSERT INTO pepsi.history (at, workqueue_id, origin, event, stage, mail_from,
               recipient, message_id, relay, reply, remote_id, dsn, arrived, queued_ms,
               stage_ms, trail)
        SELECT now(), d.workqueue_id, d.origin, l.event, left(l.stage, 200),
               d.mail_from, left(l.rcpt, 1000), d.message_id, left(l.relay, 300),
               left(l.reply, 2000), left(l.remote_id, 200), left(l.dsn, 20), d.arrived,
               l.queued_ms, l.stage_ms, d.trail
          FROM d JOIN r ON r.id = d.workqueue_id,
               jsonb_to_recordset(CASE WHEN jsonb_typeof(r.log) = 'array' THEN r.log
                                       ELSE '[]'::jsonb END)
               AS l(event text, stage text, rcpt text, relay text, reply text,
                    remote_id text, dsn text, queued_ms bigint, stage_ms bigint)
         WHERE r.log IS NOT NULL
    )
    SELECT d.workqueue_id FROM d;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_done(jsonb) IS
    'A stage worker''s finished messages: each element {id, claimed, claim, trail, log} '
    'deleted while it is running at its claimed stage under that claim token, its log '
    'records written to pepsi.history with the trail. Returns the ids deleted.';

-- workqueue_split, as in schema 10, and: the clones carry their original's id
-- (origin) and its trail, and each clone gets a history row (split).
CREATE OR REPLACE FUNCTION pepsi.workqueue_split(
    p_id bigint,
    p_groups jsonb,
    p_claimed_stage text DEFAULT NULL,
    p_stage text DEFAULT NULL,
    p_state jsonb DEFAULT NULL,
    p_release boolean DEFAULT false,
    p_claim bigint DEFAULT NULL
) RETURNS bigint[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r pepsi.workqueue%ROWTYPE;
    v_first text[];
    v_all text[];
    v_group jsonb;
    v_new bigint;
    v_ids bigint[] := '{}';
    i integer;
BEGIN
    IF p_claimed_stage IS NULL OR p_claim IS NULL THEN
        RAISE EXCEPTION 'workqueue_split(%): the claimed stage and the claim token are required', p_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(p_groups) IS DISTINCT FROM 'array' OR jsonb_array_length(p_groups) < 1 THEN
        RAISE EXCEPTION 'workqueue_split(%): groups must be a non-empty JSON array', p_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO r FROM pepsi.workqueue WHERE workqueue_id = p_id FOR UPDATE;
    IF NOT FOUND OR r.status <> 'running' OR r.stage <> p_claimed_stage OR r.claim <> p_claim THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(a ORDER BY a) INTO v_all
      FROM jsonb_array_elements(p_groups) g, jsonb_array_elements_text(g) a;
    IF v_all IS DISTINCT FROM (SELECT array_agg(a ORDER BY a) FROM unnest(r.rcpt_to) a) THEN
        RAISE EXCEPTION 'workqueue_split(%): the groups are not exactly the row''s recipients', p_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 0 .. jsonb_array_length(p_groups) - 1 LOOP
        v_group := p_groups -> i;
        IF jsonb_typeof(v_group) IS DISTINCT FROM 'array' OR jsonb_array_length(v_group) < 1 THEN
            RAISE EXCEPTION 'workqueue_split(%): group % is empty or not an array', p_id, i + 1
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF i = 0 THEN
            v_first := ARRAY(SELECT jsonb_array_elements_text(v_group));
            CONTINUE;
        END IF;
        -- The clones are new, unclaimed rows (claim 0).
        INSERT INTO pepsi.workqueue
            (stage, status, arrived, mail_from, rcpt_to, auth_user, client_ip, header_from,
             subject, headers, body_id, state, trail, origin)
        VALUES
            (coalesce(p_stage, r.stage), 'pending', r.arrived, r.mail_from,
             ARRAY(SELECT jsonb_array_elements_text(v_group)), r.auth_user, r.client_ip,
             r.header_from, r.subject, r.headers, r.body_id, coalesce(p_state, r.state),
             r.trail, coalesce(r.origin, r.workqueue_id))
        RETURNING workqueue_id INTO v_new;
        v_ids := v_ids || v_new;
        INSERT INTO pepsi.history (workqueue_id, origin, event, stage, mail_from, message_id,
                                   arrived, detail)
        VALUES (v_new, coalesce(r.origin, r.workqueue_id), 'split', r.stage, r.mail_from,
                r.message_id, r.arrived,
                jsonb_build_object('from', p_id, 'to_stage', coalesce(p_stage, r.stage),
                                   'recipients', v_group));
    END LOOP;
    UPDATE pepsi.workqueue
       SET rcpt_to = v_first,
           stage = coalesce(p_stage, stage),
           state = coalesce(p_state, state),
           status = CASE WHEN p_release THEN 'pending'::pepsi.workqueue_status ELSE status END
     WHERE workqueue_id = p_id;
    RETURN v_ids;
END $$;

-- workqueue_bounce, as in schema 10, and: a history row (returned) naming the
-- notification, with the original's trail.
CREATE OR REPLACE FUNCTION pepsi.workqueue_bounce(
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
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_body_id bigint;
    v_id bigint;
    r pepsi.workqueue%ROWTYPE;
    v_problem text;
BEGIN
    SELECT * INTO r FROM pepsi.workqueue w
     WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_claimed_stage
       AND w.claim = p_claim
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_rcpt_to IS DISTINCT FROM r.mail_from THEN
        RAISE EXCEPTION 'workqueue_bounce(%): a notification goes to the message''s sender only', p_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_problem := pepsi.mailbox_problem(p_rcpt_to);
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'workqueue_bounce(%): the sender %', p_id, v_problem
            USING ERRCODE = 'invalid_parameter_value';
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
    INSERT INTO pepsi.history (workqueue_id, origin, event, stage, mail_from, recipient,
                               message_id, arrived, trail, detail)
    VALUES (p_id, coalesce(r.origin, r.workqueue_id), 'returned', p_claimed_stage, r.mail_from,
            p_rcpt_to, r.message_id, r.arrived, r.trail,
            jsonb_build_object('notification', v_id, 'failed', to_jsonb(r.rcpt_to)));
    RETURN v_id;
END $$;

-- The history's upkeep: partitions for today and the next two days (UTC), whole days
-- older than p_days dropped, and rows of the default partition older than p_days
-- deleted. One caller at a time; the DDL waits at most a second for its locks (a
-- partition is made two days ahead, so a busy hour only delays it to the next run).
-- Returns the number of partitions dropped.
CREATE FUNCTION pepsi.history_maintain(p_days integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET lock_timeout = '1s' AS $$
DECLARE
    v_today date := (now() AT TIME ZONE 'UTC')::date;
    v_day date;
    v_name text;
    v_from timestamptz;
    v_dropped integer := 0;
    v_part record;
BEGIN
    IF p_days IS NULL OR p_days < 1 OR p_days > 3660 THEN
        RAISE EXCEPTION 'history_maintain: the retention % is not 1 to 3660 days',
                coalesce(p_days::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pg_try_advisory_xact_lock(1885696104, 1) THEN
        RETURN 0;
    END IF;
    FOR i IN 0 .. 2 LOOP
        v_day := v_today + i;
        v_name := 'history_' || to_char(v_day, 'YYYYMMDD');
        v_from := v_day::timestamp AT TIME ZONE 'UTC';
        CONTINUE WHEN to_regclass('pepsi.' || v_name) IS NOT NULL;
        -- Rows of that day already in the default partition: that day stays there.
        CONTINUE WHEN EXISTS (SELECT 1 FROM pepsi.history_default h
                               WHERE h.at >= v_from AND h.at < v_from + interval '1 day');
        EXECUTE format('CREATE TABLE pepsi.%I PARTITION OF pepsi.history '
                       'FOR VALUES FROM (%L) TO (%L)', v_name, v_from,
                       v_from + interval '1 day');
        EXECUTE format('COMMENT ON TABLE pepsi.%I IS %L', v_name,
                       'The delivery history of ' || to_char(v_day, 'YYYY-MM-DD') || ' (UTC).');
    END LOOP;
    FOR v_part IN
        SELECT c.relname::text AS name
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'pepsi.history'::regclass
           AND c.relname ~ '^history_[0-9]{8}$'
    LOOP
        v_day := to_date(substr(v_part.name, 9), 'YYYYMMDD');
        IF (v_day + 1)::timestamp AT TIME ZONE 'UTC' <= now() - make_interval(days => p_days) THEN
            EXECUTE format('DROP TABLE pepsi.%I', v_part.name);
            v_dropped := v_dropped + 1;
        END IF;
    END LOOP;
    DELETE FROM pepsi.history_default h WHERE h.at < now() - make_interval(days => p_days);
    RETURN v_dropped;
END $$;

COMMENT ON FUNCTION pepsi.history_maintain(integer) IS
    'The delivery history''s upkeep ([pepsi] HISTORY_RETENTION in days): partitions for '
    'today and the next two days (UTC), days older than the retention dropped, old rows of '
    'the default partition deleted. Returns the partitions dropped. Run by the dispatcher.';

-- Today's partition and the next two days' from the start, so the first outcomes do
-- not wait in the default partition for the dispatcher's first upkeep.
SELECT pepsi.history_maintain(7);

DROP FUNCTION pepsi.workqueue_finish(int8[], text[], int8[]);
DELETE FROM pepsi.role_grants
 WHERE object = 'FUNCTION pepsi.workqueue_finish(int8[], text[], int8[])'
    OR (role = 'pepsi_worker' AND object = 'TABLE pepsi.workqueue');

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_worker', 'SELECT (workqueue_id, stage, status, timeout, arrived, mail_from, rcpt_to, auth_user, client_ip, header_from, subject, headers, body_id, state, sender_key, hops, hop_stage, trail, origin, message_id)',
     'TABLE pepsi.workqueue'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_done(jsonb)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.history_maintain(integer)'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.history');
