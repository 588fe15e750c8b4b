//! Every SQL statement the programs run, as named constants. Each lists its parameters
//! and, where it writes the queue, what it locks and why. No statement is ever built
//! from values; DDL lives in `schema/`.

/// LISTEN/NOTIFY channel: new work (inject, resume, bouncer, repair commands).
pub const CHANNEL_WORKQUEUE: &str = "workqueue";
/// LISTEN/NOTIFY channel: a row became failed or timeout.
pub const CHANNEL_WORKQUEUE_FAILED: &str = "workqueue_failed";
/// LISTEN/NOTIFY channel: `pepsi.config_override` changed.
pub const CHANNEL_CONFIG_CHANGED: &str = "config_changed";
/// LISTEN/NOTIFY channel: `[pepsi] SHARE_TELEMETRY` was rewritten.
pub const CHANNEL_TELEMETRY_CHANGED: &str = "telemetry_changed";

/// The installed schema version and digest. No parameters.
pub const READ_SCHEMA_VERSION: &str = "SELECT version, digest FROM pepsi.schema_version";

/// Does the schema_version table exist. No parameters.
pub const SCHEMA_VERSION_EXISTS: &str = "SELECT to_regclass('pepsi.schema_version') IS NOT NULL";

/// Records the installed version. $1 version (int4), $2 digest (text).
pub const WRITE_SCHEMA_VERSION: &str = "INSERT INTO pepsi.schema_version (one_row, version, digest) \
     VALUES (true, $1, $2) \
     ON CONFLICT (one_row) DO UPDATE SET version = EXCLUDED.version, digest = EXCLUDED.digest";

/// Serialises concurrent `pepsi-setup` runs until commit. $1 the key (int8).
pub const SETUP_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// The configuration overlay. No parameters.
pub const READ_CONFIG_OVERRIDE: &str =
    "SELECT section, key, value FROM pepsi.config_override ORDER BY section, key";

/// The columns a worker loads for every row (see [`LOAD_METADATA`]). `$1` is the id
/// array. The settings subquery fetches the per-address overrides of the
/// correspondents (the sender of a local message, else the recipients) for all stages,
/// so fused stages have theirs too.
macro_rules! load_columns {
    () => {
        "q.workqueue_id, q.stage, q.status::text, q.mail_from, q.rcpt_to, q.auth_user, \
         host(q.client_ip), q.header_from, q.subject, q.state::text, q.sender_key, \
         extract(epoch FROM now() - CASE WHEN q.state ? 'dsn_created' \
                                         THEN pepsi.lifetime_start(q.state, q.arrived) \
                                         ELSE q.arrived END)::float8, \
         (SELECT jsonb_agg(jsonb_build_array(s.address, s.stage, s.key, s.value)) \
            FROM pepsi.settings s \
           WHERE s.address = ANY (CASE WHEN q.state -> 'local_origin' = 'true'::jsonb \
                                       THEN ARRAY[lower(q.mail_from)] \
                                       ELSE ARRAY(SELECT lower(r) FROM unnest(q.rcpt_to) r) END))::text"
    };
}

/// Loads rows for a metadata-only stage, with their settings. $1 ids (int8[]).
/// Reads only; the rows are the worker's while they are `running`.
pub const LOAD_METADATA: &str = concat!(
    "SELECT ",
    load_columns!(),
    " FROM pepsi.workqueue q WHERE q.workqueue_id = ANY ($1)"
);

/// Loads rows with their header block and body. $1 ids (int8[]).
pub const LOAD_FULL: &str = concat!(
    "SELECT ",
    load_columns!(),
    ", q.headers, b.body FROM pepsi.workqueue q \
     LEFT JOIN pepsi.workqueue_body b ON b.body_id = q.body_id \
     WHERE q.workqueue_id = ANY ($1)"
);

/// A worker's outcome writes for a batch, one statement (§12.3). $1 a JSON array of
/// objects {id, claimed, stage, status, delay_ms, state, and, when a stage rewrote
/// them, mail_from, rcpt_to, header_from, subject}. Guarded: only rows still `running`
/// at the stage they were claimed at are written (§12.2). Returns the written ids.
pub const WRITE_OUTCOMES: &str = "UPDATE pepsi.workqueue q \
     SET stage = r.stage, \
         status = r.status::pepsi.workqueue_status, \
         timeout = CASE WHEN r.delay_ms IS NULL THEN NULL \
                        ELSE now() + r.delay_ms * interval '1 millisecond' END, \
         state = r.state, \
         mail_from = CASE WHEN r.rewritten THEN r.mail_from ELSE q.mail_from END, \
         rcpt_to = CASE WHEN r.rewritten THEN r.rcpt_to ELSE q.rcpt_to END, \
         header_from = CASE WHEN r.rewritten THEN r.header_from ELSE q.header_from END, \
         subject = CASE WHEN r.rewritten THEN r.subject ELSE q.subject END \
     FROM jsonb_to_recordset($1::text::jsonb) AS r(id bigint, claimed text, stage text, \
          status text, delay_ms bigint, state jsonb, rewritten boolean, mail_from text, \
          rcpt_to text[], header_from text, subject text) \
     WHERE q.workqueue_id = r.id AND q.status = 'running' AND q.stage = r.claimed \
     RETURNING q.workqueue_id";

/// A worker's finished messages, one statement. $1 ids (int8[]), $2 the stages they
/// were claimed at (text[]). Guarded like [`WRITE_OUTCOMES`]. Returns the deleted ids.
pub const DELETE_FINISHED: &str = "DELETE FROM pepsi.workqueue q \
     USING unnest($1::int8[], $2::text[]) AS r(id, claimed) \
     WHERE q.workqueue_id = r.id AND q.status = 'running' AND q.stage = r.claimed \
     RETURNING q.workqueue_id";

/// Splits a claimed row's recipients (§12.5), one round trip. $1 id (int8), $2 groups
/// (JSON text), $3 the claimed stage (guard), $4 the stage the groups continue at or
/// NULL for the same, $5 the state for all rows or NULL to keep, $6 whether the kept
/// row is released to pending. Returns the new ids, NULL when the guard did not match.
pub const SPLIT: &str =
    "SELECT pepsi.workqueue_split($1, $2::text::jsonb, $3, $4, $5::text::jsonb, $6)";

/// Last resort when a worker cannot load or write rows for a non-connection reason:
/// pause them for a minute with the error. $1 ids (int8[]), $2 the error (text).
/// Guarded by `running` only (the worker does not know their stages then; nobody else
/// writes a running row). Returns the paused ids.
pub const PAUSE_UNHANDLED: &str = "UPDATE pepsi.workqueue \
     SET status = 'paused', timeout = now() + interval '1 minute', \
         state = state || jsonb_build_object('last_error', $2::text) \
     WHERE workqueue_id = ANY ($1) AND status = 'running' \
     RETURNING workqueue_id";
