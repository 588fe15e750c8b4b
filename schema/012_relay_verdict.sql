-- Pepsi schema, version 12: the relay stage (SPEC §17).
--
-- A per-recipient outcome that splits a row leaves the whole verdict on every row of
-- the split (state.recipient_outcomes), and the worker acts on it instead of running
-- the stage again: it says which recipients are done, deferred or failed, with their
-- delivery status and diagnostic. It is reserved like the failure keys, so an
-- injecting role can neither drop a message unsent nor make Pepsi report a failure
-- of its choosing.
--
-- A resume, release or requeue starts a message afresh: it also forgets the verdict and
-- the delivery status a stage left when the message failed, so that a later failure
-- reports its own status, not the old one.

CREATE OR REPLACE FUNCTION pepsi.reserved_state_keys() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN ARRAY['last_error', 'strikes', 'strike_stage', 'temporary_failures', 'temporary_stage',
             'failure_class', 'failed_stage', 'local_origin', 'dsn_created', 'dsn_of',
             'dsn_status', 'dsn_diagnostic', 'held_at', 'held_from', 'unwritten',
             'deferrals', 'recipient_outcomes'];

COMMENT ON FUNCTION pepsi.reserved_state_keys() IS
    'The keys of workqueue.state that Pepsi itself writes and acts on; a member of '
    'pepsi_inject may not set them through workqueue_inject.';

CREATE OR REPLACE FUNCTION pepsi.resumed_state(s jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN s - 'strikes' - 'strike_stage' - 'failure_class' - 'failed_stage'
         - 'temporary_failures' - 'temporary_stage' - 'unwritten' - 'held_at' - 'held_from'
         - 'dsn_status' - 'dsn_diagnostic' - 'recipient_outcomes';

COMMENT ON FUNCTION pepsi.resumed_state(jsonb) IS
    'A state without the keys a resume, release or requeue clears (strikes, retry '
    'counters, failure class and stage, hold keys, the delivery status and diagnostic '
    'a stage left, a per-recipient verdict); last_error stays as history.';
