//! The statements that name who holds the database's oldest snapshot (the MVCC horizon:
//! while it is held, VACUUM cannot remove the queue's dead rows and dead index entries,
//! and claims slow down), and which roles lack the membership that lets the dispatcher
//! and `pepsi-queue` see a holder's details. Named constants like [`super::sql`]'s; read by
//! [`super::horizon`] and `pepsi-setup`.
//!
//! What holds the horizon of an ordinary table of this database (PostgreSQL 14 and
//! later, `ComputeXidHorizons` in `procarray.c`): the snapshots and transaction ids of
//! the backends connected to this database, of the WAL senders that serve a physical
//! standby without a slot (they carry its `hot_standby_feedback`, have no database and
//! count for every database), the `xmin` of every replication slot (a slot's
//! `catalog_xmin` holds only the catalogs), and the prepared transactions of this
//! database. A session of another database holds only the shared catalogs there, not
//! the queue's tables — before PostgreSQL 14 it held every database's, so on those
//! servers the other databases' sessions are listed too. VACUUM's own processes are
//! ignored by the server and left out here (autovacuum workers: by their backend type,
//! and, for a role that may not see that, by their having no role).

/// Every snapshot, transaction and slot that holds this database's horizon back, the
/// oldest first (by transaction-id age, then by age in time), the reading session
/// excluded. No parameters; reads only (`pg_stat_activity`, `pg_replication_slots`,
/// `pg_prepared_xacts`). Returns per holder: kind (`session`, `standby`, `replication
/// slot`, `prepared transaction`), pid (int4, of the session, WAL sender or a slot's
/// active sender), name (application_name, slot name or GID), role, client address
/// (`local` for a Unix socket), state, database, age in seconds since its transaction
/// began or it was prepared (float8), age in transactions of its oldest xmin or xid
/// (int4), that xmin or xid as text (to tell one snapshot from the next), and whether
/// this role may see the session's details (superuser, the session's own role, or a
/// member of `pg_read_all_stats`). A role without that sees another role's session
/// with pid, role, application_name and xmin, but a NULL state, client, start time and
/// backend type: the row then carries no state, client or age in seconds.
pub const HORIZON_HOLDERS: &str = "WITH holders AS ( \
     SELECT CASE WHEN a.datid IS NULL THEN 'standby' ELSE 'session' END AS kind, \
            a.pid, a.application_name AS name, a.usename::text AS role, \
            CASE WHEN v.visible THEN coalesce(pg_catalog.host(a.client_addr), 'local') END AS client, \
            a.state, a.datname::text AS database, \
            pg_catalog.date_part('epoch', pg_catalog.statement_timestamp() - a.xact_start) AS age_seconds, \
            GREATEST(pg_catalog.age(a.backend_xmin), pg_catalog.age(a.backend_xid)) AS xid_age, \
            (CASE WHEN pg_catalog.age(a.backend_xid) >= coalesce(pg_catalog.age(a.backend_xmin), 0) \
                  THEN a.backend_xid ELSE a.backend_xmin END)::text AS xmin, \
            v.visible \
       FROM pg_catalog.pg_stat_activity a \
            CROSS JOIN LATERAL (SELECT coalesce(pg_catalog.pg_has_role(a.usesysid, 'USAGE'), false) \
                                       OR pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE') AS visible) v \
      WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL) \
        AND a.pid <> pg_catalog.pg_backend_pid() \
        AND a.backend_type IS DISTINCT FROM 'autovacuum worker' \
        AND (a.usesysid IS NOT NULL OR a.datid IS NULL) \
        AND (a.datname = pg_catalog.current_database() \
             OR (a.datid IS NULL AND coalesce(a.backend_type = 'walsender', true)) \
             OR pg_catalog.current_setting('server_version_num')::int4 < 140000) \
     UNION ALL \
     SELECT 'replication slot', s.active_pid, s.slot_name::text, NULL, NULL, \
            CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.database::text, \
            NULL, pg_catalog.age(s.xmin), s.xmin::text, true \
       FROM pg_catalog.pg_replication_slots s \
      WHERE s.xmin IS NOT NULL \
     UNION ALL \
     SELECT 'prepared transaction', NULL, p.gid, p.owner::text, NULL, 'prepared', p.database::text, \
            pg_catalog.date_part('epoch', pg_catalog.statement_timestamp() - p.prepared), \
            pg_catalog.age(p.transaction), p.transaction::text, true \
       FROM pg_catalog.pg_prepared_xacts p \
      WHERE p.database = pg_catalog.current_database() \
   ) \
   SELECT kind, pid, name, role, client, state, database, age_seconds::float8, xid_age, xmin, visible \
     FROM holders \
    ORDER BY xid_age DESC NULLS LAST, age_seconds DESC NULLS LAST, pid";

/// The roles that read the holders but may not see another role's session in full:
/// `pepsi_dispatch` and `pepsi_admin` where they exist, else (the one-role setup) the
/// session's own role — each unless a superuser or a member of `pg_read_all_stats`.
/// No parameters. Returns the role names. Reads only; `pepsi-setup` says what to grant
/// and grants nothing.
pub const LACKING_READ_ALL_STATS: &str = "SELECT r.rolname::text FROM pg_catalog.pg_roles r \
      WHERE (r.rolname IN ('pepsi_dispatch', 'pepsi_admin') \
             OR (r.rolname = current_user AND NOT EXISTS ( \
                   SELECT 1 FROM pg_catalog.pg_roles g \
                    WHERE g.rolname IN ('pepsi_dispatch', 'pepsi_admin')))) \
        AND NOT r.rolsuper \
        AND NOT pg_catalog.pg_has_role(r.oid, 'pg_read_all_stats', 'USAGE') \
      ORDER BY 1";
