-- Pepsi schema, version 2: claim tokens (SPEC §6 "Claim tokens").
--
-- Every claim stamps the rows it takes with a fresh token; whoever writes the outcome
-- of that claim (the worker, or the dispatcher requeueing, striking or deferring it)
-- guards the write with `claim = <token>` as well as status and stage. A write left
-- over from an earlier claim of the same row at the same stage (a killed worker's
-- statement still executing on the server) then matches nothing.

-- One value per claim statement (not per row).
CREATE SEQUENCE pepsi.workqueue_claim_seq AS bigint;

-- 0 for rows never claimed. A constant default: adding the column rewrites nothing.
ALTER TABLE pepsi.workqueue ADD COLUMN claim bigint NOT NULL DEFAULT 0;

-- workqueue_split gains the claim guard p_claim (NULL: no token check, for callers
-- outside a claim).
DROP FUNCTION pepsi.workqueue_split(bigint, jsonb, text, text, jsonb, boolean);

CREATE FUNCTION pepsi.workqueue_split(
    p_id bigint,
    p_groups jsonb,
    p_claimed_stage text DEFAULT NULL,
    p_stage text DEFAULT NULL,
    p_state jsonb DEFAULT NULL,
    p_release boolean DEFAULT false,
    p_claim bigint DEFAULT NULL
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    r pepsi.workqueue%ROWTYPE;
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
    IF p_claim IS NOT NULL AND r.claim <> p_claim THEN
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

-- workqueue_strike gains the claim guard p_claim, and no longer depends on the stored
-- strike count being a well-formed integer: anything else counts as no strike yet.
DROP FUNCTION pepsi.workqueue_strike(bigint, text, text, text);

CREATE FUNCTION pepsi.workqueue_strike(p_id bigint, p_stage text, p_kind text, p_error text,
                                       p_claim bigint)
RETURNS TABLE (strikes integer, status pepsi.workqueue_status, due timestamptz)
LANGUAGE sql AS $$
    WITH cur AS (
        SELECT w.workqueue_id,
               CASE WHEN w.state ->> 'strike_stage' = p_stage
                     AND jsonb_typeof(w.state -> 'strikes') = 'number'
                    THEN least(greatest(floor((w.state ->> 'strikes')::numeric), 0), 2)::integer + 1
                    ELSE 1 END AS n
          FROM pepsi.workqueue w
         WHERE w.workqueue_id = p_id AND w.status = 'running' AND w.stage = p_stage
           AND w.claim = p_claim
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
