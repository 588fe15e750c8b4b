-- Pepsi schema, version 23: the claim's own write made cheaper, with the same effect.
--
-- pepsi.workqueue_take (schemas 13 to 15), the UPDATE every claim ends with, was a SQL
-- function with its own settings: the server neither inlines such a function nor
-- keeps its plan, so every claim planned that UPDATE again (about 0.1 ms a claim), and
-- for every claimed row it called pepsi.claim_token(), which it cannot inline either
-- (about 4 µs a row, with its setting saved and restored around each call). It is now
-- PL/pgSQL, whose statement's plan a session keeps, and makes each row's token in
-- the UPDATE itself: the same 60 random bits from pg_strong_random (a version-4 UUID's
-- first 64 bits, 4 of them its version), resolved through pg_catalog as every function
-- of the schema resolves its names (under 2 µs a row). It still runs as the owner
-- (schema 15). pepsi.claim_token() stays, for whoever calls it.

CREATE OR REPLACE FUNCTION pepsi.workqueue_take(p_ids int8[], p_max_hops int4)
RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
               looped boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    UPDATE pepsi.workqueue q
           SET status = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                             THEN 'failed' ELSE 'running' END::pepsi.workqueue_status,
               hops = q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int,
               hop_stage = q.stage,
               claim = ('x' || pg_catalog.substr(pg_catalog.replace(
                           pg_catalog.gen_random_uuid()::text, '-', ''), 1, 16))::bit(64)::bigint,
               state = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                            THEN q.state || pg_catalog.jsonb_build_object(
                                'failure_class', 'looped', 'failed_stage', q.stage,
                                'last_error', 'looped: claimed at a changed stage more than MAX_HOPS ('
                                              || p_max_hops || ') times')
                            ELSE q.state END
     WHERE q.workqueue_id = ANY (p_ids) AND q.status::text = 'pending'
    RETURNING q.workqueue_id, q.stage, q.sender_key, q.claim, q.status = 'failed';
END $$;

COMMENT ON FUNCTION pepsi.workqueue_take(int8[], int4) IS
    'The claim of rows a pick locked (pepsi.workqueue_claim_oldest and _fair): each '
    'pending one of p_ids set running (or failed looped past p_max_hops) under a new '
    'claim token of its own (60 random bits from pg_strong_random, made in this '
    'statement as pepsi.claim_token makes one). Returns the rows claimed.';
