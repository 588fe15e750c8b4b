-- Pepsi schema, version 19: pepsi-ingress counts the sessions that went on inside TLS
-- (SPEC §21: STARTTLS on its listeners).
--
-- pepsi.ingress_stats gains tls_sessions, added to by the same one-round-trip UPDATE
-- as the other counters (pepsi_inject already may UPDATE the table) and shown by
-- pepsi-queue metrics as pepsi_ingress_tls_sessions_total. Everything else is as in
-- schema 18.

ALTER TABLE pepsi.ingress_stats ADD COLUMN tls_sessions bigint NOT NULL DEFAULT 0;

COMMENT ON COLUMN pepsi.ingress_stats.tls_sessions IS
    'Sessions whose STARTTLS handshake completed (they went on inside TLS).';
