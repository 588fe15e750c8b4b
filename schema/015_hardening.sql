-- Pepsi schema, version 15: the lower findings of a review as an attacker would make
-- it (SPEC §4 "Containment").
--
-- 1. The dispatcher's role reads no message data. Its claim's looped failure and its
--    strikes were its only writes of a row's state, and for them it could read the
--    state of every row (the DSN parameters, each recipient's outcome, the errors).
--    Both now run as the owner (the strike only for the two kinds a dispatcher
--    strikes), and the role keeps the columns its claims and guarded writes name.
-- 2. A fairness key is at most 200 characters: a longer one (an authenticated login of
--    kilobytes) is cut and given the MD5 of the whole, so two logins that share a
--    beginning stay two senders. A key beyond what a B-tree entry holds made the
--    message impossible to insert: the ingress deferred it for ever.
-- 3. A row's state is at most 1 MiB when it is inserted: an injector cannot make a
--    worker load a hundred megabytes with one message.

ALTER FUNCTION pepsi.workqueue_take(int8[], int4) SECURITY DEFINER;

CREATE OR REPLACE FUNCTION pepsi.workqueue_strike(p_id bigint, p_stage text, p_kind text,
                                                  p_error text, p_claim bigint)
RETURNS TABLE (strikes integer, status pepsi.workqueue_status, due timestamptz)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH cur AS (
        SELECT w.workqueue_id,
               CASE WHEN w.state ->> 'strike_stage' = p_stage
                     AND jsonb_typeof(w.state -> 'strikes') = 'number'
                    THEN least(greatest(floor((w.state ->> 'strikes')::numeric), 0), 2)::integer + 1
                    ELSE 1 END AS n
          FROM pepsi.workqueue w
         WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_stage
           AND w.claim = p_claim AND p_kind IN ('crashed', 'timed-out')
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
       AND w.claim = p_claim
    RETURNING cur.n, w.status, w.timeout
$$;

DELETE FROM pepsi.role_grants
 WHERE role = 'pepsi_dispatch' AND object = 'TABLE pepsi.workqueue';
INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_dispatch', 'SELECT (workqueue_id, stage, status, timeout, sender_key, claim)',
     'TABLE pepsi.workqueue'),
    ('pepsi_dispatch', 'UPDATE (status, timeout)', 'TABLE pepsi.workqueue');

-- The fairness key, as in schema 8, at most 200 characters.
CREATE OR REPLACE FUNCTION pepsi.sender_key(auth_user text, client_ip inet, mail_from text,
                                            rcpt_to text[])
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_key text;
BEGIN
    v_key := CASE
        WHEN nullif(auth_user, '') IS NOT NULL
            THEN 'user:' || pg_catalog.lower(auth_user)
        -- An IPv4 client seen by a dual-stack listener (::ffff:a.b.c.d) is that IPv4 peer.
        WHEN client_ip <<= inet '::ffff:0.0.0.0/96'
            THEN 'ip:' || pg_catalog.host(inet '0.0.0.0' + (client_ip - inet '::ffff:0.0.0.0'))
        WHEN client_ip IS NOT NULL AND pg_catalog.family(client_ip) = 6
            THEN 'ip:' || pg_catalog.text(pg_catalog.network(pg_catalog.set_masklen(client_ip, 64)))
        WHEN client_ip IS NOT NULL THEN 'ip:' || pg_catalog.host(client_ip)
        WHEN mail_from = '' THEN 'null:' || coalesce(pepsi.address_domain(rcpt_to[1]), '')
        ELSE 'from:' || pepsi.address_domain(mail_from)
    END;
    IF pg_catalog.length(v_key) > 200 THEN
        v_key := pg_catalog.left(v_key, 160) || '~' || pg_catalog.md5(v_key);
    END IF;
    RETURN v_key;
END $$;

-- Refuses a row whose state is larger than 1 MiB (checked when a row is inserted: by
-- an injection, a split or a notification).
CREATE FUNCTION pepsi.workqueue_state_limit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'the state of a message is larger than 1 MiB (% bytes)',
            pg_column_size(NEW.state)
        USING ERRCODE = 'invalid_parameter_value';
END $$;

COMMENT ON FUNCTION pepsi.workqueue_state_limit() IS
    'Refuses the insert of a workqueue row whose state is larger than 1 MiB.';

CREATE TRIGGER workqueue_state_limit BEFORE INSERT ON pepsi.workqueue
    FOR EACH ROW WHEN (pg_column_size(NEW.state) > 1048576)
    EXECUTE FUNCTION pepsi.workqueue_state_limit();

COMMENT ON TRIGGER workqueue_state_limit ON pepsi.workqueue IS
    'A message''s state is at most 1 MiB when it is queued.';
