-- Pepsi schema, version 17: a stage may add header fields at the top of a message's
-- header block (SPEC §18: `dkim-sign` prepends its signatures; the body, shared
-- between the rows of a split, is never rewritten).
--
-- A worker's batch write (workqueue_write) takes, on a row a stage rewrote, the
-- field `prepend_headers`: base64 of the header fields to put before the stored header
-- block, in the same UPDATE and under the same guard as the rest of the outcome. Only
-- prepending is possible: a stage adds fields and cannot drop or change the ones the
-- message came with (its trace fields, its From:). What it adds must be header fields
-- (pepsi.header_fields_problem): no empty line, which would end the header block early
-- and make the rest of it body, no NUL, a field name first and a line end last; a
-- write that breaks this fails as a whole, as an unclean envelope does. Everything
-- else is as in schema 16.

-- Why these bytes (base64) are not header fields to prepend, or NULL when they are (or
-- when there are none): valid base64 of at most 64 KiB, ending with LF, without an
-- empty line (LF LF or LF CR LF) or a NUL, and starting with a field name (printable
-- ASCII but the colon, up to a colon on the first line).
CREATE FUNCTION pepsi.header_fields_problem(p_fields text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_bytes bytea;
    v_colon int4;
    v_byte int4;
BEGIN
    IF p_fields IS NULL THEN
        RETURN NULL;
    END IF;
    BEGIN
        v_bytes := decode(p_fields, 'base64');
    EXCEPTION WHEN invalid_parameter_value OR data_exception THEN
        RETURN 'are not base64';
    END;
    IF length(v_bytes) = 0 THEN
        RETURN 'are empty';
    END IF;
    IF length(v_bytes) > 65536 THEN
        RETURN 'are longer than 64 KiB';
    END IF;
    IF get_byte(v_bytes, length(v_bytes) - 1) <> 10 THEN
        RETURN 'do not end with a line end';
    END IF;
    IF position('\x0a0a'::bytea IN v_bytes) > 0 OR position('\x0a0d0a'::bytea IN v_bytes) > 0 THEN
        RETURN 'hold an empty line';
    END IF;
    IF position('\x00'::bytea IN v_bytes) > 0 THEN
        RETURN 'hold a NUL';
    END IF;
    v_colon := position('\x3a'::bytea IN v_bytes);
    IF v_colon < 2 OR v_colon > position('\x0a'::bytea IN v_bytes) THEN
        RETURN 'do not start with a field name';
    END IF;
    FOR i IN 0 .. v_colon - 2 LOOP
        v_byte := get_byte(v_bytes, i);
        IF v_byte < 33 OR v_byte > 126 THEN
            RETURN 'do not start with a field name';
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

COMMENT ON FUNCTION pepsi.header_fields_problem(text) IS
    'Why p_fields (base64) are not header fields a stage may prepend to a header block '
    '(not base64, empty, longer than 64 KiB, not ending with a line end, holding an empty '
    'line or a NUL, not starting with a field name), or NULL when they are or when '
    'p_fields is NULL.';

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
                  rcpt_to text[], prepend_headers text) LOOP
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
               subject = CASE WHEN r.rewritten THEN r.subject ELSE q.subject END,
               headers = CASE WHEN r.rewritten AND r.prepend_headers IS NOT NULL
                              THEN decode(r.prepend_headers, 'base64') || coalesce(q.headers, ''::bytea)
                              ELSE q.headers END
          FROM jsonb_to_recordset(p_rows) AS r(id bigint, claimed text, claim bigint,
               stage text, status text, delay_ms bigint, state jsonb, rewritten boolean,
               mail_from text, rcpt_to text[], header_from text, subject text,
               prepend_headers text)
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

COMMENT ON FUNCTION pepsi.workqueue_write(jsonb) IS
    'A stage worker''s outcome writes for a batch: each row of p_rows written only while '
    'it is running at its claimed stage under the claim token the dispatcher handed with '
    'it; statuses running, pending, paused or failed; a rewritten envelope must be clean; '
    'a rewritten row may carry prepend_headers (base64 header fields put before the '
    'stored header block, checked by pepsi.header_fields_problem). Returns the ids written.';
