-- Pepsi schema, version 11: pepsi-ingress (SPEC §16), the persistent LMTP/SMTP front end.
--
-- It queues the messages of concurrent sessions in one call and one commit (group
-- commit), as a member of pepsi_inject: pepsi.workqueue_inject_many, the checks of
-- pepsi.workqueue_inject made once per call and the rows inserted by one statement.
-- And its counters, kept like the dispatcher's (SPEC §10): in memory, written as deltas
-- every few seconds, one row for the whole system.

CREATE TABLE pepsi.ingress_stats (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    sessions bigint NOT NULL DEFAULT 0,
    accepted bigint NOT NULL DEFAULT 0,
    recipients bigint NOT NULL DEFAULT 0,
    deferred bigint NOT NULL DEFAULT 0,
    refused bigint NOT NULL DEFAULT 0,
    commits bigint NOT NULL DEFAULT 0,
    updated timestamptz NOT NULL DEFAULT now()
);
INSERT INTO pepsi.ingress_stats DEFAULT VALUES;

COMMENT ON TABLE pepsi.ingress_stats IS
    'Cumulative counters of pepsi-ingress, one row; written as deltas by pepsi-ingress only.';
COMMENT ON COLUMN pepsi.ingress_stats.one_row IS 'Always true: the table has one row.';
COMMENT ON COLUMN pepsi.ingress_stats.sessions IS 'LMTP and SMTP sessions served.';
COMMENT ON COLUMN pepsi.ingress_stats.accepted IS
    'Messages accepted: committed to the queue and answered 250.';
COMMENT ON COLUMN pepsi.ingress_stats.recipients IS 'Recipients of the accepted messages.';
COMMENT ON COLUMN pepsi.ingress_stats.deferred IS
    'Messages answered 4xx at the end of their data (the database away or refusing).';
COMMENT ON COLUMN pepsi.ingress_stats.refused IS
    'Messages answered 5xx at the end of their data (too large, no header block, refused by the database).';
COMMENT ON COLUMN pepsi.ingress_stats.commits IS
    'Transactions that queued accepted messages (several messages each under load).';
COMMENT ON COLUMN pepsi.ingress_stats.updated IS 'When the counters were last written.';
COMMENT ON INDEX pepsi.ingress_stats_pkey IS 'The one row.';

-- Queues many messages in one call: what pepsi-ingress's committer runs once per
-- commit. Every message is held to exactly the checks of pepsi.workqueue_inject (a
-- clean envelope for every caller; for a caller other than the owner, a superuser or
-- a member of pepsi_admin, the stage among pepsi.inject_stages and no reserved state
-- key), and one message that fails them fails the call: nothing is written. The
-- checks are made once for the stage and the caller, and the rows and bodies are
-- inserted by one statement each, so a message costs a fraction of a call of its
-- own. p_rcpt_to holds each message's recipients as a JSON array of strings; the
-- other arrays hold one element per message, like p_mail_from (their lengths must
-- agree). Returns each message's ordinal (from 1) and its new id; one NOTIFY
-- workqueue (folded with any other of the transaction).
CREATE FUNCTION pepsi.workqueue_inject_many(
    p_stage text,
    p_mail_from text[],
    p_rcpt_to jsonb[],
    p_headers bytea[],
    p_body bytea[],
    p_auth_user text[],
    p_client_ip inet[],
    p_header_from text[],
    p_subject text[],
    p_state jsonb[]
) RETURNS TABLE (n bigint, workqueue_id bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
-- Plans made once per session: the statements' shapes do not depend on how many
-- messages a call has, and a custom plan per call would double a lone message's cost.
SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    v_count integer := coalesce(cardinality(p_mail_from), 0);
    v_at bigint;
    v_problem text;
    v_keys text[];
BEGIN
    IF p_stage IS NULL OR p_stage = '' THEN
        RAISE EXCEPTION 'workqueue_inject_many: the stage is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- unnest pads a shorter array with NULLs: the lengths must agree.
    IF coalesce(array_ndims(p_mail_from), 1) <> 1
       OR coalesce(cardinality(p_rcpt_to), 0) <> v_count
       OR coalesce(cardinality(p_headers), 0) <> v_count
       OR coalesce(cardinality(p_body), 0) <> v_count
       OR coalesce(cardinality(p_auth_user), 0) <> v_count
       OR coalesce(cardinality(p_client_ip), 0) <> v_count
       OR coalesce(cardinality(p_header_from), 0) <> v_count
       OR coalesce(cardinality(p_subject), 0) <> v_count
       OR coalesce(cardinality(p_state), 0) <> v_count THEN
        RAISE EXCEPTION 'workqueue_inject_many: the arrays are not all one per message'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_count = 0 THEN
        RETURN;
    END IF;
    -- The first message whose envelope or state is not clean, and why.
    SELECT m.n, c.problem INTO v_at, v_problem
      FROM unnest(p_mail_from, p_rcpt_to, p_state) WITH ORDINALITY AS m(mail_from, rcpt, state, n),
           LATERAL (SELECT CASE
               WHEN m.mail_from IS NULL THEN 'the sender is NULL (the null sender is '''')'
               WHEN m.mail_from <> '' AND pepsi.mailbox_problem(m.mail_from) IS NOT NULL
                   THEN 'the sender ' || pepsi.mailbox_problem(m.mail_from)
               WHEN m.rcpt IS NULL OR jsonb_typeof(m.rcpt) <> 'array'
                    OR jsonb_array_length(m.rcpt) = 0 THEN 'no recipient'
               ELSE coalesce(
                   (SELECT 'a recipient ' || CASE WHEN r.a IS NULL THEN 'is not a string'
                                                   ELSE pepsi.mailbox_problem(r.a) END
                      FROM jsonb_array_elements(m.rcpt) e,
                           LATERAL (SELECT CASE WHEN jsonb_typeof(e) = 'string'
                                                THEN e #>> '{}' END AS a) r
                     WHERE r.a IS NULL OR pepsi.mailbox_problem(r.a) IS NOT NULL
                     LIMIT 1),
                   CASE WHEN m.state IS NOT NULL AND jsonb_typeof(m.state) <> 'object'
                        THEN 'the state is not a JSON object' END)
           END AS problem) c
     WHERE c.problem IS NOT NULL
     ORDER BY m.n
     LIMIT 1;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'workqueue_inject_many: message %: %', v_at, v_problem
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pepsi.injects_freely() THEN
        IF NOT EXISTS (SELECT 1 FROM pepsi.inject_stages s WHERE s.stage = p_stage) THEN
            RAISE EXCEPTION 'workqueue_inject_many: stage % is not one of [pepsi] INJECT_STAGES',
                    quote_literal(p_stage)
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'An injecting role may inject only into the entry stages '
                             '(pepsi.inject_stages).';
        END IF;
        SELECT array_agg(DISTINCT k ORDER BY k) INTO v_keys
          FROM unnest(p_state) s, jsonb_object_keys(coalesce(s, '{}')) k
         WHERE k = ANY (pepsi.reserved_state_keys());
        IF v_keys IS NOT NULL THEN
            RAISE EXCEPTION 'workqueue_inject_many: state key(s) % are reserved to Pepsi',
                    array_to_string(v_keys, ', ')
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    -- Each message's ids are drawn in its own row and inserted from it, so a row gets
    -- its own body whatever order the inserts run in.
    RETURN QUERY
    WITH m AS MATERIALIZED (
        SELECT u.*,
               CASE WHEN u.body IS NOT NULL
                    THEN nextval('pepsi.workqueue_body_body_id_seq'::regclass) END AS body_id,
               nextval('pepsi.workqueue_workqueue_id_seq'::regclass) AS id
          FROM unnest(p_mail_from, p_rcpt_to, p_headers, p_body, p_auth_user, p_client_ip,
                      p_header_from, p_subject, p_state)
               WITH ORDINALITY AS u(mail_from, rcpt, headers, body, auth_user, client_ip,
                                    header_from, subject, state, n)
    ), bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, body) OVERRIDING SYSTEM VALUE
        SELECT m.body_id, m.body FROM m WHERE m.body IS NOT NULL
    ), queued AS (
        INSERT INTO pepsi.workqueue
            (workqueue_id, stage, status, mail_from, rcpt_to, auth_user, client_ip,
             header_from, subject, headers, body_id, state)
        OVERRIDING SYSTEM VALUE
        SELECT m.id, p_stage, 'pending', m.mail_from,
               ARRAY(SELECT jsonb_array_elements_text(m.rcpt)), m.auth_user, m.client_ip,
               m.header_from, m.subject, m.headers, m.body_id, coalesce(m.state, '{}')
          FROM m
         ORDER BY m.n
    )
    SELECT m.n, m.id FROM m ORDER BY m.n;
    PERFORM pg_notify('workqueue', '');
END $$;

COMMENT ON FUNCTION pepsi.workqueue_inject_many(text, text[], jsonb[], bytea[], bytea[], text[], inet[], text[], text[], jsonb[]) IS
    'Queues many messages at p_stage in one call, each held to the checks of '
    'workqueue_inject; one message failing them fails the call, nothing written. '
    'p_rcpt_to: a JSON array of strings per message; the other arrays one element per '
    'message. Returns each message''s ordinal and id. pepsi-ingress''s commit.';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_inject', 'EXECUTE', 'FUNCTION pepsi.workqueue_inject_many(text, text[], jsonb[], bytea[], bytea[], text[], inet[], text[], text[], jsonb[])'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.workqueue_inject_many(text, text[], jsonb[], bytea[], bytea[], text[], inet[], text[], text[], jsonb[])'),
    ('pepsi_inject', 'SELECT', 'TABLE pepsi.ingress_stats'),
    ('pepsi_inject', 'UPDATE', 'TABLE pepsi.ingress_stats'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.ingress_stats');
