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
