-- Pepsi schema, version 20: what a stage counts of the messages it handles, beside
-- pepsi.stage_stats (SPEC §21: the relay counts its deliveries by how they were
-- protected — verified TLS, unverified TLS, clear text — and by TLS version).
--
-- A worker names its events on its status line (the REPORT, dispatch/workers.rs); the
-- dispatcher checks them (the stage in its graph, a short name of lower-case letters,
-- digits, dots and dashes, a bounded count, at most 64 names per stage in memory) and
-- adds them here with its other statistics, in the same statement. pepsi-queue metrics
-- shows them as pepsi_stage_events_total{stage,event}. Only the dispatcher writes.

CREATE TABLE pepsi.stage_events (
    stage text NOT NULL,
    event text NOT NULL,
    count bigint NOT NULL DEFAULT 0,
    updated timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stage, event)
);

COMMENT ON TABLE pepsi.stage_events IS
    'Events stages counted of their messages (the relay: tls-verified, tls-unverified, '
    'no-tls, tlsv1.2, tlsv1.3), cumulative; written only by the dispatcher.';

COMMENT ON INDEX pepsi.stage_events_pkey IS 'One count per stage and event.';
COMMENT ON COLUMN pepsi.stage_events.stage IS 'The stage that counted the event.';
COMMENT ON COLUMN pepsi.stage_events.event IS
    'The event''s name: lower-case letters, digits, dots and dashes, 1 to 32 bytes.';
COMMENT ON COLUMN pepsi.stage_events.count IS 'How often, since installation.';
COMMENT ON COLUMN pepsi.stage_events.updated IS 'When the dispatcher last added to it.';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.stage_events'),
    ('pepsi_dispatch', 'INSERT', 'TABLE pepsi.stage_events'),
    ('pepsi_dispatch', 'UPDATE', 'TABLE pepsi.stage_events'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.stage_events');
