-- Pepsi schema, version 10: containment (SPEC §4 "Containment", amended 2026-12-03).
--
-- - Every function of the schema resolves names through pg_catalog alone
--   (`SET search_path = pg_catalog, pg_temp`), not only the SECURITY DEFINER ones: an
--   operator or function another role planted in a schema on the caller's path (the
--   `public` schema of PostgreSQL 14 and older, where everyone may create) is never
--   called. pepsi-setup revokes CREATE on `public` from PUBLIC as well, and every
--   program session sets the same search_path.
-- - The grants of the group roles are rows of pepsi.role_grants, which
--   pepsi.setup_roles() applies on every pepsi-setup run: a later schema file that adds
--   a function a role calls inserts its grant there, once.
-- - pepsi_worker writes only rows in flight: row-level security lets its UPDATE and
--   DELETE reach only `running` rows (its column privileges already keep it from the
--   claim token and the hop count), and workqueue_split no longer runs without the
--   claim guard.
-- - workqueue_inject is held to clean input and, for injecting roles, to the entry
--   stages the dispatcher writes into pepsi.inject_stages from `[pepsi] INJECT_STAGES`.

-- The stages an injecting role (pepsi_inject) may inject into: `[pepsi] INJECT_STAGES`,
-- by default the stages of the graph no stage routes to. Written whole by
-- pepsi.set_inject_stages, by the dispatcher at start and at every reload, by
-- pepsi-setup and by pepsi-queue config set|unset.
CREATE TABLE pepsi.inject_stages (
    stage text PRIMARY KEY
);

COMMENT ON TABLE pepsi.inject_stages IS
    'The stages a member of pepsi_inject may inject into ([pepsi] INJECT_STAGES, by default '
    'the entry stages of the stage graph). Written by pepsi.set_inject_stages.';
COMMENT ON COLUMN pepsi.inject_stages.stage IS 'A stage (the NAME of a [stage-NAME] section).';
COMMENT ON INDEX pepsi.inject_stages_pkey IS 'One row per stage.';

-- Replaces the list of entry stages; returns whether it changed. One round trip, and no
-- write at all when the list is the same (the usual case at a reload).
CREATE FUNCTION pepsi.set_inject_stages(p_stages text[]) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    m integer;
BEGIN
    DELETE FROM pepsi.inject_stages s WHERE s.stage <> ALL (coalesce(p_stages, '{}'));
    GET DIAGNOSTICS n = ROW_COUNT;
    INSERT INTO pepsi.inject_stages (stage)
    SELECT DISTINCT x FROM unnest(coalesce(p_stages, '{}')) x WHERE x IS NOT NULL
    ON CONFLICT (stage) DO NOTHING;
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m > 0;
END $$;

COMMENT ON FUNCTION pepsi.set_inject_stages(text[]) IS
    'Replaces pepsi.inject_stages with p_stages (the [pepsi] INJECT_STAGES of the current '
    'stage graph); returns whether anything changed. SECURITY DEFINER: the dispatcher and '
    'pepsi-queue may write this list and nothing else of it.';

-- Why an address is not an RFC 5321 mailbox (RFC 6531 for UTF-8), or NULL when it is
-- one. The same rules as the programs' own check (src/mailbox.rs):
--   Local-part "@" Domain, at most 256 octets in all;
--   Local-part: a Dot-string (atoms of letters, digits, !#$%&'*+-/=?^_`{|}~ or non-ASCII
--     characters, joined by single dots) or a Quoted-string ("…" of printable ASCII but
--     " and \, or non-ASCII, with \ before a printable ASCII character as a quoted pair);
--   Domain: labels of 1 to 63 octets of letters, digits, hyphens or non-ASCII
--     characters, neither starting nor ending with a hyphen, joined by dots; or an
--     address literal [d.d.d.d] (each 0 to 255) or [IPv6: hex digits, ':' and '.'];
--   nowhere a control character (C0, DEL, C1), a bidirectional or invisible formatting
--   character (U+061C, U+200B–U+200F, U+202A–U+202E, U+2060–U+2064, U+2066–U+2069,
--   U+FEFF, U+FFF9–U+FFFB) or a line or paragraph separator (U+2028, U+2029).
CREATE FUNCTION pepsi.mailbox_problem(p_address text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_local text;
    v_domain text;
    v_label text;
    v_at integer;
BEGIN
    IF p_address IS NULL OR p_address = '' THEN
        RETURN 'is empty';
    END IF;
    IF octet_length(p_address) > 256 THEN
        RETURN 'is longer than 256 octets';
    END IF;
    IF p_address ~ '[\x01-\x1f\x7f\u0080-\u009f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\u2028\u2029\ufeff\ufff9-\ufffb]' THEN
        RETURN 'contains a control, formatting or line-separator character';
    END IF;
    IF strpos(p_address, '@') = 0 THEN
        RETURN 'has no "@" and domain';
    END IF;
    -- The domain follows the last '@' (a quoted local part may hold '@' too).
    v_at := length(p_address) - strpos(reverse(p_address), '@') + 1;
    v_local := substr(p_address, 1, v_at - 1);
    v_domain := substr(p_address, v_at + 1);
    IF v_local = '' THEN
        RETURN 'has an empty local part';
    END IF;
    IF v_local !~ '^[A-Za-z0-9!#$%&''*+/=?^_`{|}~\u0080-\U0010ffff-]+(\.[A-Za-z0-9!#$%&''*+/=?^_`{|}~\u0080-\U0010ffff-]+)*$'
       AND v_local !~ '^"([\x20\x21\x23-\x5b\x5d-\x7e\u0080-\U0010ffff]|\\[\x20-\x7e])*"$' THEN
        RETURN 'has a local part that is neither a dot-string nor a quoted string';
    END IF;
    IF v_domain = '' THEN
        RETURN 'has an empty domain';
    END IF;
    IF left(v_domain, 1) = '[' THEN
        IF v_domain ~ '^\[[0-9]{1,3}(\.[0-9]{1,3}){3}\]$' THEN
            IF EXISTS (SELECT 1 FROM regexp_split_to_table(btrim(v_domain, '[]'), '\.') o
                        WHERE o::integer > 255) THEN
                RETURN 'has an IPv4 address literal out of range';
            END IF;
            RETURN NULL;
        END IF;
        IF v_domain ~ '^\[IPv6:[0-9A-Fa-f:.]+\]$' THEN
            RETURN NULL;
        END IF;
        RETURN 'has an address literal that is neither [d.d.d.d] nor [IPv6:…]';
    END IF;
    FOREACH v_label IN ARRAY string_to_array(v_domain, '.') LOOP
        IF v_label = '' OR octet_length(v_label) > 63
           OR v_label !~ '^[A-Za-z0-9\u0080-\U0010ffff]([A-Za-z0-9\u0080-\U0010ffff-]*[A-Za-z0-9\u0080-\U0010ffff])?$' THEN
            RETURN 'has a domain that is not dot-separated labels of letters, digits and hyphens';
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

COMMENT ON FUNCTION pepsi.mailbox_problem(text) IS
    'Why p_address is not an RFC 5321 (RFC 6531) mailbox, or NULL when it is one: '
    'local-part@domain within 256 octets, no control, bidirectional, invisible formatting '
    'or line-separator character. workqueue_inject and workqueue_bounce check with it.';

-- The state keys the system writes and acts on. An injecting role may not set them: a
-- future dsn_created would never expire, strikes or failure_class would be believed,
-- local_origin would choose whose per-address settings apply.
CREATE FUNCTION pepsi.reserved_state_keys() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN ARRAY['last_error', 'strikes', 'strike_stage', 'temporary_failures', 'temporary_stage',
             'failure_class', 'failed_stage', 'local_origin', 'dsn_created', 'dsn_of',
             'dsn_status', 'dsn_diagnostic', 'held_at', 'held_from', 'unwritten',
             'deferrals'];

COMMENT ON FUNCTION pepsi.reserved_state_keys() IS
    'The keys of workqueue.state that Pepsi itself writes and acts on; a member of '
    'pepsi_inject may not set them through workqueue_inject.';

-- Whether the session's login role may inject anywhere with any state: the schema's
-- owner, a superuser, or a member of pepsi_admin. Inside a SECURITY DEFINER function
-- current_user is the owner, so the caller is session_user.
CREATE FUNCTION pepsi.injects_freely() RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
RETURN coalesce((SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = session_user),
                false)
    OR pg_catalog.pg_has_role(session_user,
                              (SELECT n.nspowner FROM pg_catalog.pg_namespace n
                                WHERE n.nspname = 'pepsi'), 'MEMBER')
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                WHERE r.rolname = 'pepsi_admin'
                  AND pg_catalog.pg_has_role(session_user, r.oid, 'MEMBER'));

COMMENT ON FUNCTION pepsi.injects_freely() IS
    'Whether the session''s login role is the schema owner, a superuser or a member of '
    'pepsi_admin, and so may inject into any stage with any state.';

-- Inserts one message (and its body) as pending and wakes the dispatcher. The envelope
-- must be clean for every caller: the sender a mailbox or '' (the null sender), at
-- least one recipient, each a mailbox. A caller other than the owner, a superuser or a
-- member of pepsi_admin (an MTA as pepsi_inject) may inject only into a stage of
-- pepsi.inject_stages and without the reserved state keys. Nothing is written when a
-- check fails.
CREATE OR REPLACE FUNCTION pepsi.workqueue_inject(
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
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_body_id bigint;
    v_id bigint;
    v_problem text;
    v_rcpt text;
    v_keys text[];
BEGIN
    IF p_stage IS NULL OR p_stage = '' THEN
        RAISE EXCEPTION 'workqueue_inject: the stage is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_mail_from IS NULL THEN
        RAISE EXCEPTION 'workqueue_inject: the sender is NULL (the null sender is '''')'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_mail_from <> '' THEN
        v_problem := pepsi.mailbox_problem(p_mail_from);
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION 'workqueue_inject: the sender %', v_problem
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    IF coalesce(cardinality(p_rcpt_to), 0) = 0 THEN
        RAISE EXCEPTION 'workqueue_inject: no recipient'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_rcpt IN ARRAY p_rcpt_to LOOP
        v_problem := pepsi.mailbox_problem(v_rcpt);
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION 'workqueue_inject: a recipient %', v_problem
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF p_state IS NOT NULL AND jsonb_typeof(p_state) <> 'object' THEN
        RAISE EXCEPTION 'workqueue_inject: the state is not a JSON object'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pepsi.injects_freely() THEN
        IF NOT EXISTS (SELECT 1 FROM pepsi.inject_stages s WHERE s.stage = p_stage) THEN
            RAISE EXCEPTION 'workqueue_inject: stage % is not one of [pepsi] INJECT_STAGES',
                    quote_literal(p_stage)
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'An injecting role may inject only into the entry stages '
                             '(pepsi.inject_stages).';
        END IF;
        SELECT array_agg(k ORDER BY k) INTO v_keys
          FROM jsonb_object_keys(coalesce(p_state, '{}')) k
         WHERE k = ANY (pepsi.reserved_state_keys());
        IF v_keys IS NOT NULL THEN
            RAISE EXCEPTION 'workqueue_inject: state key(s) % are reserved to Pepsi',
                    array_to_string(v_keys, ', ')
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
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

-- workqueue_split with its guard no longer optional: the row must be running at
-- p_claimed_stage under claim token p_claim (a worker's split of a row it holds).
-- Otherwise exactly as in schema 2.
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

-- workqueue_bounce, now addressing the notification only to the original's own sender,
-- which must be a mailbox: a worker can report on the row it holds, to whoever sent it,
-- and to nobody else. Otherwise exactly as in schema 5.
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
    v_sender text;
    v_problem text;
BEGIN
    SELECT w.mail_from INTO v_sender FROM pepsi.workqueue w
     WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_claimed_stage
       AND w.claim = p_claim
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_rcpt_to IS DISTINCT FROM v_sender THEN
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
    RETURN v_id;
END $$;

-- Row-level security on the queue: the policies are made per group role by
-- pepsi.setup_roles() (a policy names a role, and the roles may come after this file).
-- The owner (and so every SECURITY DEFINER function) is not subject to them; a role
-- with no policy sees and changes no row.
ALTER TABLE pepsi.workqueue ENABLE ROW LEVEL SECURITY;

-- The privileges of the group roles, one row each: what pepsi.setup_roles() grants on
-- every run after revoking everything (so that a privilege a later release no longer
-- lists goes). A schema file that adds an object a role uses adds its row here.
CREATE TABLE pepsi.role_grants (
    role text NOT NULL
        CHECK (role IN ('pepsi_dispatch', 'pepsi_worker', 'pepsi_admin', 'pepsi_inject')),
    privilege text NOT NULL
        CHECK (privilege ~ '^(SELECT|INSERT|UPDATE|DELETE|EXECUTE|USAGE)( \([a-z_]+(, [a-z_]+)*\))?$'),
    object text NOT NULL
        CHECK (object ~ '^(TABLE|SEQUENCE|FUNCTION) pepsi\.[a-z_]+(\([a-z0-9_., \[\]]*\))?$'),
    PRIMARY KEY (role, privilege, object)
);

COMMENT ON TABLE pepsi.role_grants IS
    'The privileges pepsi.setup_roles() grants each group role on every pepsi-setup run '
    '(after revoking all): one row per privilege and object.';
COMMENT ON COLUMN pepsi.role_grants.role IS
    'The group role: pepsi_dispatch, pepsi_worker, pepsi_admin or pepsi_inject.';
COMMENT ON COLUMN pepsi.role_grants.privilege IS
    'The privilege as GRANT takes it, with its columns where it has some: SELECT, '
    'UPDATE (status, timeout), EXECUTE, USAGE.';
COMMENT ON COLUMN pepsi.role_grants.object IS
    'The object as GRANT takes it: TABLE, SEQUENCE or FUNCTION and its schema-qualified '
    'name (a function with its argument types).';
COMMENT ON INDEX pepsi.role_grants_pkey IS 'One row per role, privilege and object.';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    -- The dispatcher: the claim's, the resets' and the retry writes' columns; no
    -- envelope, header block or body (it never processes message content).
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.schema_version'),
    ('pepsi_dispatch', 'SELECT (workqueue_id, stage, status, timeout, state, sender_key, claim, hops, hop_stage)',
     'TABLE pepsi.workqueue'),
    ('pepsi_dispatch', 'UPDATE (status, timeout, state, claim, hops, hop_stage)', 'TABLE pepsi.workqueue'),
    ('pepsi_dispatch', 'USAGE', 'SEQUENCE pepsi.workqueue_claim_seq'),
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.stage_stats'),
    ('pepsi_dispatch', 'INSERT', 'TABLE pepsi.stage_stats'),
    ('pepsi_dispatch', 'UPDATE', 'TABLE pepsi.stage_stats'),
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.dispatch_stats'),
    ('pepsi_dispatch', 'UPDATE', 'TABLE pepsi.dispatch_stats'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_strike(bigint, text, text, text, bigint)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_body_gc(integer)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.terminate_worker_sessions(text[])'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.config_override_rows()'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.set_inject_stages(text[])'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.address_domain(text)'),
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.sender_key(text, inet, text, text[])'),
    -- Stage workers: read rows, bodies, settings and the overlay; write the outcome
    -- columns of rows in flight (row-level security: running rows only) and delete
    -- finished ones; split and bounce through their functions.
    ('pepsi_worker', 'SELECT', 'TABLE pepsi.schema_version'),
    ('pepsi_worker', 'SELECT', 'TABLE pepsi.workqueue'),
    ('pepsi_worker', 'SELECT', 'TABLE pepsi.workqueue_body'),
    ('pepsi_worker', 'SELECT', 'TABLE pepsi.settings'),
    ('pepsi_worker', 'UPDATE (stage, status, timeout, state, mail_from, rcpt_to, header_from, subject)',
     'TABLE pepsi.workqueue'),
    ('pepsi_worker', 'DELETE', 'TABLE pepsi.workqueue'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_split(bigint, jsonb, text, text, jsonb, boolean, bigint)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.workqueue_bounce(bigint, text, bigint, text, text, text, text, bytea, bytea)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.config_override_rows()'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.lifetime_start(jsonb, timestamptz)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.address_domain(text)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.sender_key(text, inet, text, text[])'),
    -- pepsi-queue and the failure bouncer: read everything, repair through the
    -- functions, write the overlay and the settings.
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.schema_version'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.workqueue'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.workqueue_body'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.stage_stats'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.dispatch_stats'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.inject_stages'),
    ('pepsi_admin', 'UPDATE (stage, status, timeout, state, hops, hop_stage)', 'TABLE pepsi.workqueue'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.workqueue'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.config_override'),
    ('pepsi_admin', 'INSERT', 'TABLE pepsi.config_override'),
    ('pepsi_admin', 'UPDATE', 'TABLE pepsi.config_override'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.config_override'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.settings'),
    ('pepsi_admin', 'INSERT', 'TABLE pepsi.settings'),
    ('pepsi_admin', 'UPDATE', 'TABLE pepsi.settings'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.settings'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text, text, jsonb)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_resume(bigint[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_resume(text, pepsi.workqueue_status)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_resume_each(bigint[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_hold(bigint[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_release(bigint[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_delete(bigint[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_requeue(bigint[], text)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_bounce_failed(text, pepsi.workqueue_status[], integer)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.config_override_rows()'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.set_inject_stages(text[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.resumed_state(jsonb)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.lifetime_start(jsonb, timestamptz)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.address_domain(text)'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.sender_key(text, inet, text, text[])'),
    -- Whatever hands mail over: the one function, the schema check every program runs
    -- and the overlay (the stage check of pepsi-queue inject).
    ('pepsi_inject', 'SELECT', 'TABLE pepsi.schema_version'),
    ('pepsi_inject', 'EXECUTE', 'FUNCTION pepsi.workqueue_inject(text, text, text[], bytea, bytea, text, inet, text, text, jsonb)'),
    ('pepsi_inject', 'EXECUTE', 'FUNCTION pepsi.config_override_rows()');

-- Creates the group roles this session may create, and grants each existing one
-- exactly the privileges pepsi.role_grants lists for it on this database's objects
-- (revoking everything first, so a privilege a later release no longer grants goes),
-- with its row-level security policy on the queue. Revokes EXECUTE on every function
-- of the schema from PUBLIC. Idempotent, safe while other databases of the cluster
-- run it at the same moment, and called by pepsi-setup on every run. Runs with the
-- caller's rights: roles are created only when the caller is a superuser or has
-- CREATEROLE; otherwise a missing role is reported and its grants are skipped. Returns
-- one row per group role: its name and 'created', 'present' or 'missing'.
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
    -- row but changes or deletes only rows in flight, and leaves them in a status a
    -- worker writes (never held or timeout).
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
        CREATE POLICY workqueue_worker_write ON pepsi.workqueue FOR UPDATE TO pepsi_worker
            USING (status = 'running')
            WITH CHECK (status IN ('running', 'pending', 'paused', 'failed'));
        CREATE POLICY workqueue_worker_finish ON pepsi.workqueue FOR DELETE TO pepsi_worker
            USING (status = 'running');
    END IF;
END $$;

COMMENT ON FUNCTION pepsi.setup_roles() IS
    'Run by pepsi-setup on every run: creates the group roles pepsi_dispatch, pepsi_worker, '
    'pepsi_admin and pepsi_inject when the caller may create roles, grants each existing '
    'one exactly the privileges pepsi.role_grants lists on this database, makes the queue''s '
    'row-level security policies, and revokes EXECUTE on the schema''s functions from '
    'PUBLIC. Returns each role with created, present or missing.';

-- Whether PUBLIC may create objects in the schema `public` of this database (the
-- default of PostgreSQL 14 and older); false when there is no such schema. pepsi-setup
-- revokes it, and says so, when it may.
CREATE FUNCTION pepsi.public_schema_open() RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
RETURN EXISTS (
    SELECT 1 FROM pg_catalog.pg_namespace n,
                  pg_catalog.aclexplode(coalesce(n.nspacl,
                                                 pg_catalog.acldefault('n', n.nspowner))) a
     WHERE n.nspname = 'public' AND a.grantee = 0 AND a.privilege_type = 'CREATE');

COMMENT ON FUNCTION pepsi.public_schema_open() IS
    'Whether PUBLIC may create objects in the schema public of this database; pepsi-setup '
    'revokes that when it may.';

-- Every function of the schema, those of earlier files included, resolves names
-- through pg_catalog alone, whoever calls it and whatever the caller's search_path.
-- (Functions of later files declare it themselves; a test checks every one.)
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'pepsi'::regnamespace
                AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp', f);
    END LOOP;
END $$;
