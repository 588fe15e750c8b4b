-- Pepsi schema, version 11: pepsi-ingress (SPEC §16), the persistent LMTP/SMTP front end.
--
-- It queues mail with pepsi.workqueue_inject, many messages of concurrent sessions in
-- one statement and one commit (group commit), as a member of pepsi_inject; it needs
-- no new function. What it adds is its counters, kept like the dispatcher's (SPEC §10):
-- in memory, written as deltas every few seconds, one row for the whole system.

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

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_inject', 'SELECT', 'TABLE pepsi.ingress_stats'),
    ('pepsi_inject', 'UPDATE', 'TABLE pepsi.ingress_stats'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.ingress_stats');
