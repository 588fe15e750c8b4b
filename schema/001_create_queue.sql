-- Pepsi schema, version 1: the work queue, its bodies, the configuration overlay,
-- per-address settings, statistics and the public SQL API.
--
-- Applied by `pepsi-setup schema` inside one transaction. Append-only once released:
-- a change is a new file.

CREATE SCHEMA pepsi;

CREATE TYPE pepsi.workqueue_status AS ENUM ('pending', 'running', 'paused', 'failed', 'timeout');

-- The domain part of an address, lower-cased, without angle brackets or a trailing
-- dot; an address without '@' is its own domain, so a bare local name still gives a
-- stable key.
CREATE FUNCTION pepsi.address_domain(address text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN rtrim(lower(CASE WHEN strpos(address, '@') > 0
                        THEN split_part(btrim(address, '<>'), '@', -1)
                        ELSE btrim(address, '<>') END), '.');

-- The fairness key of a row (SPEC §2): the authenticated user (lower-cased; an empty
-- login is none), else the SMTP peer (an IPv6 peer by its /64, an IPv4-mapped one as
-- the IPv4 peer), else for the null sender the first recipient's domain, else the
-- sender's domain.
CREATE FUNCTION pepsi.sender_key(auth_user text, client_ip inet, mail_from text, rcpt_to text[])
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN nullif(auth_user, '') IS NOT NULL THEN 'user:' || lower(auth_user)
    -- An IPv4 client seen by a dual-stack listener (::ffff:a.b.c.d) is that IPv4 peer.
    WHEN client_ip <<= inet '::ffff:0.0.0.0/96'
        THEN 'ip:' || host(inet '0.0.0.0' + (client_ip - inet '::ffff:0.0.0.0'))
    WHEN client_ip IS NOT NULL AND family(client_ip) = 6
        THEN 'ip:' || text(network(set_masklen(client_ip, 64)))
    WHEN client_ip IS NOT NULL THEN 'ip:' || host(client_ip)
    WHEN mail_from = '' THEN 'null:' || coalesce(pepsi.address_domain(rcpt_to[1]), '')
    ELSE 'from:' || pepsi.address_domain(mail_from)
END;

CREATE TABLE pepsi.workqueue_body (
    body_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    body bytea NOT NULL
);

CREATE TABLE pepsi.workqueue (
    workqueue_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stage text NOT NULL,
    status pepsi.workqueue_status NOT NULL DEFAULT 'pending',
    timeout timestamptz,
    arrived timestamptz NOT NULL DEFAULT now(),
    mail_from text NOT NULL,
    -- At least one recipient, a plain list, no NULL among them.
    rcpt_to text[] NOT NULL CONSTRAINT workqueue_rcpt_to_check
        CHECK (cardinality(rcpt_to) >= 1 AND array_ndims(rcpt_to) = 1
               AND array_position(rcpt_to, NULL) IS NULL),
    auth_user text,
    client_ip inet,
    header_from text,
    subject text,
    headers bytea,
    body_id bigint REFERENCES pepsi.workqueue_body (body_id),
    state jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(state) = 'object'),
    sender_key text GENERATED ALWAYS AS (pepsi.sender_key(auth_user, client_ip, mail_from, rcpt_to)) STORED
);

-- The claim's index: per stage, oldest first, pending rows only.
CREATE INDEX workqueue_pending_idx ON pepsi.workqueue (stage, workqueue_id)
    WHERE status = 'pending';
-- The fair claim's index: the senders waiting at a stage, and each one's oldest rows.
CREATE INDEX workqueue_pending_sender_idx ON pepsi.workqueue (stage, sender_key, workqueue_id)
    WHERE status = 'pending';
-- The paused-retry sweep: the earliest due row first.
CREATE INDEX workqueue_paused_idx ON pepsi.workqueue (timeout)
    WHERE status = 'paused';
-- The failure bouncer's sweep.
CREATE INDEX workqueue_failed_idx ON pepsi.workqueue (workqueue_id)
    WHERE status IN ('failed', 'timeout');
-- The body release trigger asks whether any other row still references a body.
CREATE INDEX workqueue_body_id_idx ON pepsi.workqueue (body_id);

-- Releases a body the moment the last row referencing it disappears. Two concurrent
-- deletes of the last two sharers can each see the other's row and leave the body;
-- pepsi.workqueue_body_gc collects those.
CREATE FUNCTION pepsi.workqueue_body_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.body_id IS NOT NULL THEN
        DELETE FROM pepsi.workqueue_body b
         WHERE b.body_id = OLD.body_id
           AND NOT EXISTS (SELECT 1 FROM pepsi.workqueue w WHERE w.body_id = OLD.body_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER workqueue_body_release
    AFTER DELETE ON pepsi.workqueue
    FOR EACH ROW WHEN (OLD.body_id IS NOT NULL)
    EXECUTE FUNCTION pepsi.workqueue_body_release();

-- Rows becoming failed or timeout are rare, so the commit-serialising cost of NOTIFY is
-- acceptable here; pepsi-failure-bouncer listens for it. Nothing notifies when a row
-- becomes pending (SPEC §2).
CREATE FUNCTION pepsi.workqueue_failed_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('workqueue_failed', '');
    RETURN NULL;
END $$;

CREATE TRIGGER workqueue_failed_notify_update
    AFTER UPDATE OF status ON pepsi.workqueue
    FOR EACH ROW
    WHEN (NEW.status IN ('failed', 'timeout') AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION pepsi.workqueue_failed_notify();

CREATE TRIGGER workqueue_failed_notify_insert
    AFTER INSERT ON pepsi.workqueue
    FOR EACH ROW
    WHEN (NEW.status IN ('failed', 'timeout'))
    EXECUTE FUNCTION pepsi.workqueue_failed_notify();

-- When a message's MAX_LIFETIME starts: state.dsn_created for a DSN, else arrival. A
-- malformed dsn_created falls back to arrival rather than failing the load of the row.
CREATE FUNCTION pepsi.lifetime_start(p_state jsonb, p_arrived timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce((p_state ->> 'dsn_created')::timestamptz, p_arrived);
EXCEPTION WHEN others THEN
    RETURN p_arrived;
END $$;

-- Deletes up to p_limit bodies no row references; returns how many it deleted.
CREATE FUNCTION pepsi.workqueue_body_gc(p_limit integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    WITH orphan AS MATERIALIZED (
        SELECT b.body_id FROM pepsi.workqueue_body b
         WHERE NOT EXISTS (SELECT 1 FROM pepsi.workqueue w WHERE w.body_id = b.body_id)
         LIMIT p_limit
    )
    DELETE FROM pepsi.workqueue_body b
     USING orphan o
     WHERE b.body_id = o.body_id
       AND NOT EXISTS (SELECT 1 FROM pepsi.workqueue w WHERE w.body_id = b.body_id);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Inserts one message (and its body) as pending and wakes the dispatcher.
CREATE FUNCTION pepsi.workqueue_inject(
    p_stage text,
    p_mail_from text,
    p_rcpt_to text[],
    p_headers bytea,
    p_body bytea,
    p_auth_user text DEFAULT NULL,
    p_client_ip inet DEFAULT NULL,
    p_header_from text DEFAULT NULL,
    p_subject text DEFAULT NULL,
    p_state jsonb DEFAULT '{}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_body_id bigint;
    v_id bigint;
BEGIN
    IF p_body IS NOT NULL THEN
        INSERT INTO pepsi.workqueue_body (body) VALUES (p_body) RETURNING body_id INTO v_body_id;
    END IF;
    INSERT INTO pepsi.workqueue
        (stage, status, mail_from, rcpt_to, auth_user, client_ip, header_from, subject,
         headers, body_id, state)
    VALUES
        (p_stage, 'pending', p_mail_from, p_rcpt_to, p_auth_user, p_client_ip, p_header_from,
         p_subject, p_headers, v_body_id, coalesce(p_state, '{}'))
    RETURNING workqueue_id INTO v_id;
    -- Identical notifications of one transaction are folded, so a burst injected in
    -- one transaction wakes the dispatcher once.
    PERFORM pg_notify('workqueue', '');
    RETURN v_id;
END $$;

-- The state keys a resume clears: the row starts its stage afresh, its retry backoff
-- included (`last_error` stays as history).
CREATE FUNCTION pepsi.resumed_state(s jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN s - 'strikes' - 'strike_stage' - 'failure_class' - 'failed_stage'
         - 'temporary_failures' - 'temporary_stage' - 'unwritten';

-- Flips the given paused, failed or timeout rows back to pending; returns how many.
CREATE FUNCTION pepsi.workqueue_resume(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    UPDATE pepsi.workqueue
       SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(state)
     WHERE workqueue_id = ANY (p_ids)
       AND status IN ('paused', 'failed', 'timeout');
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN n;
END $$;

-- Flips paused, failed or timeout rows back to pending by stage and/or status (NULL
-- matches any); returns how many.
CREATE FUNCTION pepsi.workqueue_resume(p_stage text, p_status pepsi.workqueue_status)
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
       SET status = 'pending', timeout = NULL, state = pepsi.resumed_state(state)
     WHERE (p_stage IS NULL OR stage = p_stage)
       AND status IN ('paused', 'failed', 'timeout')
       AND (p_status IS NULL OR status = p_status);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('workqueue', '');
    END IF;
    RETURN n;
END $$;

-- Splits a row's recipients into groups (a JSON array of arrays of addresses, which
-- together must be exactly the row's recipients). The first group stays on the row;
-- every other group becomes a new pending row sharing the body. No NOTIFY: the caller's
-- own report brings the dispatcher to its next claim.
--
-- Optional arguments, for a worker in the middle of a pass: p_claimed_stage guards the
-- write (the row must be running at that stage, else nothing happens and NULL is
-- returned); p_stage moves the row and places the clones at that stage (default: the
-- row's stage); p_state replaces the state of the row and the clones; p_release also
-- sets the kept row pending.
CREATE FUNCTION pepsi.workqueue_split(
    p_id bigint,
    p_groups jsonb,
    p_claimed_stage text DEFAULT NULL,
    p_stage text DEFAULT NULL,
    p_state jsonb DEFAULT NULL,
    p_release boolean DEFAULT false
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    r pepsi.workqueue%ROWTYPE;
    v_groups text[][];
    v_first text[];
    v_all text[];
    v_group jsonb;
    v_new bigint;
    v_ids bigint[] := '{}';
    i integer;
BEGIN
    IF jsonb_typeof(p_groups) IS DISTINCT FROM 'array' OR jsonb_array_length(p_groups) < 1 THEN
        RAISE EXCEPTION 'workqueue_split(%): groups must be a non-empty JSON array', p_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO r FROM pepsi.workqueue WHERE workqueue_id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_claimed_stage IS NOT NULL AND (r.status <> 'running' OR r.stage <> p_claimed_stage) THEN
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
        INSERT INTO pepsi.workqueue
            (stage, status, arrived, mail_from, rcpt_to, auth_user, client_ip, header_from,
             subject, headers, body_id, state)
        VALUES
            (coalesce(p_stage, r.stage), 'pending', r.arrived, r.mail_from,
             ARRAY(SELECT jsonb_array_elements_text(v_group)), r.auth_user, r.client_ip,
             r.header_from, r.subject, r.headers, r.body_id, coalesce(p_state, r.state))
        RETURNING workqueue_id INTO v_new;
        v_ids := v_ids || v_new;
    END LOOP;
    UPDATE pepsi.workqueue
       SET rcpt_to = v_first,
           stage = coalesce(p_stage, stage),
           state = coalesce(p_state, state),
           status = CASE WHEN p_release THEN 'pending'::pepsi.workqueue_status ELSE status END
     WHERE workqueue_id = p_id;
    RETURN v_ids;
END $$;

-- Records a strike against a claimed row (SPEC §8.2): its worker crashed on it
-- (p_kind 'crashed') or hung past MAX_RUNTIME ('timed-out'). Strikes count per stage.
-- Strikes 1 and 2 pause the row for 1 and 2 minutes; the third fails it ('failed' for a
-- crash, 'timeout' for a hang). Guarded: the row must still be running at p_stage.
-- Returns the strike count, the new status and the retry time (NULL when it failed),
-- or no row when the guard did not match.
CREATE FUNCTION pepsi.workqueue_strike(p_id bigint, p_stage text, p_kind text, p_error text)
RETURNS TABLE (strikes integer, status pepsi.workqueue_status, due timestamptz)
LANGUAGE sql AS $$
    WITH cur AS (
        SELECT w.workqueue_id,
               CASE WHEN w.state ->> 'strike_stage' = p_stage
                    THEN coalesce((w.state ->> 'strikes')::integer, 0) + 1
                    ELSE 1 END AS n
          FROM pepsi.workqueue w
         WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_stage
    )
    UPDATE pepsi.workqueue w
       SET status = CASE WHEN cur.n < 3 THEN 'paused'::pepsi.workqueue_status
                         WHEN p_kind = 'timed-out' THEN 'timeout'::pepsi.workqueue_status
                         ELSE 'failed'::pepsi.workqueue_status END,
           timeout = CASE WHEN cur.n < 3 THEN now() + cur.n * interval '1 minute' END,
           state = w.state
                   || jsonb_build_object('strikes', cur.n, 'strike_stage', p_stage,
                                         'last_error', p_error)
                   || CASE WHEN cur.n < 3 THEN '{}'::jsonb
                           ELSE jsonb_build_object('failure_class', p_kind,
                                                   'failed_stage', p_stage) END
      FROM cur
     WHERE w.workqueue_id = cur.workqueue_id AND w.status = 'running' AND w.stage = p_stage
    RETURNING cur.n, w.status, w.timeout
$$;

-- Configuration overlay over the [stage-*] sections of pepsi.conf. An empty value
-- unsets the file's key.
CREATE TABLE pepsi.config_override (
    section text NOT NULL,
    key text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (section, key)
);

CREATE FUNCTION pepsi.config_override_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('config_changed', '');
    RETURN NULL;
END $$;

CREATE TRIGGER config_override_notify
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON pepsi.config_override
    FOR EACH STATEMENT
    EXECUTE FUNCTION pepsi.config_override_notify();

-- Per-address overrides of [stage-NAME] options (SPEC §12.5).
CREATE TABLE pepsi.settings (
    address text NOT NULL CHECK (address = lower(address)),
    stage text NOT NULL,
    key text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (address, stage, key)
);

-- Cumulative per-stage counters, written only by the dispatcher (SPEC §10).
CREATE TABLE pepsi.stage_stats (
    stage text PRIMARY KEY,
    passes bigint NOT NULL DEFAULT 0,
    fused_passes bigint NOT NULL DEFAULT 0,
    failures bigint NOT NULL DEFAULT 0,
    crashes bigint NOT NULL DEFAULT 0,
    timeouts bigint NOT NULL DEFAULT 0,
    requeues bigint NOT NULL DEFAULT 0,
    busy_us bigint NOT NULL DEFAULT 0,
    updated timestamptz NOT NULL DEFAULT now()
);

-- Cumulative global counters, one row, written only by the dispatcher.
CREATE TABLE pepsi.dispatch_stats (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    stages_executed bigint NOT NULL DEFAULT 0,
    claims bigint NOT NULL DEFAULT 0,
    rows_claimed bigint NOT NULL DEFAULT 0,
    worker_starts bigint NOT NULL DEFAULT 0,
    updated timestamptz NOT NULL DEFAULT now()
);
INSERT INTO pepsi.dispatch_stats DEFAULT VALUES;

-- The installed schema: the number of the last applied file and the digest of the
-- files up to it; one row, written by pepsi-setup.
CREATE TABLE pepsi.schema_version (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    version integer NOT NULL,
    digest text NOT NULL
);
