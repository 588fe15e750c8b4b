-- Pepsi schema, version 16: a worker's batch writes find their rows by their ids
-- (§6 "Floors and held snapshots", §12.3).
--
-- workqueue_write and workqueue_finish joined the batch's rows to the queue on the id
-- alone. With statistics taken while the queue was nearly empty (a queue that keeps
-- up is), the planner estimated one running row and chose to read every entry of the
-- primary key and filter them (a hash join over a full index scan, or a nested loop
-- with the full scan outside): cheap while the table is small, but a snapshot held
-- open elsewhere keeps every version of every row in that index, so each write read
-- them all, longer with every second of the hold, and the workers fell behind the
-- input. The ids are now also a condition on the primary key itself
-- (workqueue_id = ANY (ids)), which every plan applies as an index condition: a write
-- reads the entries of its own rows, whatever the statistics say; and neither
-- function may read the table whole (enable_seqscan off, as the claim has it). The
-- write keeps one generic plan (plan_cache_mode): a custom plan per call, which the
-- array of ids would otherwise make it choose, costs more planning than it saves.
-- Nothing else changes: the same guard, the same results, the same grants.

CREATE OR REPLACE FUNCTION pepsi.workqueue_write(p_rows jsonb) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_row record;
    v_problem text;
    v_rewritten boolean := false;
    v_ids bigint[];
BEGIN
    IF jsonb_typeof(p_rows) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'workqueue_write: the rows are not a JSON array'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_row IN SELECT * FROM jsonb_to_recordset(p_rows) AS x(id bigint, stage text,
                  status text, state jsonb, rewritten boolean, mail_from text,
                  rcpt_to text[]) LOOP
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
        IF v_row.rewritten THEN
            v_rewritten := true;
            v_problem := pepsi.envelope_problem(v_row.mail_from, v_row.rcpt_to);
            IF v_problem IS NOT NULL THEN
                RAISE EXCEPTION 'workqueue_write(%): %', v_row.id, v_problem
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
    END LOOP;
    -- Built once: appending in the loop would copy the array for every row.
    v_ids := ARRAY(SELECT x.id FROM jsonb_to_recordset(p_rows) AS x(id bigint));
    IF v_rewritten THEN
        RETURN QUERY
        UPDATE pepsi.workqueue q
           SET stage = r.stage,
               status = r.status::pepsi.workqueue_status,
               timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                              ELSE now() + r.delay_ms * interval '1 millisecond' END,
               state = r.state - 'unwritten',
               mail_from = CASE WHEN r.rewritten THEN r.mail_from ELSE q.mail_from END,
               rcpt_to = CASE WHEN r.rewritten THEN r.rcpt_to ELSE q.rcpt_to END,
               header_from = CASE WHEN r.rewritten THEN r.header_from ELSE q.header_from END,
               subject = CASE WHEN r.rewritten THEN r.subject ELSE q.subject END
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb, rewritten boolean,
               mail_from text, rcpt_to text[], header_from text, subject text)
         WHERE q.workqueue_id = ANY (v_ids) AND q.workqueue_id = r.id
           AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
        RETURNING q.workqueue_id;
    ELSE
        -- Naming no column sender_key is computed from, the UPDATE leaves the stored
        -- generated column as it is instead of computing it again for every row.
        RETURN QUERY
        UPDATE pepsi.workqueue q
           SET stage = r.stage,
               status = r.status::pepsi.workqueue_status,
               timeout = CASE WHEN r.delay_ms IS NULL THEN NULL
                              ELSE now() + r.delay_ms * interval '1 millisecond' END,
               state = r.state - 'unwritten'
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb)
         WHERE q.workqueue_id = ANY (v_ids) AND q.workqueue_id = r.id
           AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
        RETURNING q.workqueue_id;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION pepsi.workqueue_finish(p_ids int8[], p_stages text[], p_claims int8[])
RETURNS SETOF bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off AS $$
    DELETE FROM pepsi.workqueue q
     USING unnest(p_ids, p_stages, p_claims) AS r(id, claimed, claim)
     WHERE q.workqueue_id = ANY (p_ids) AND q.workqueue_id = r.id
       AND q.status = 'running' AND q.stage = r.claimed AND q.claim = r.claim
    RETURNING q.workqueue_id
$$;
