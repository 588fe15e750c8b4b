//! The statements of `pepsi-settings` on `pepsi.settings` (§12.5, §20): reading the
//! per-address settings, and writing them in the one transaction that checked them.
//! Named constants like [`super::sql`]'s; run by `queue::settings` only. The workers
//! read the table through the load query of [`super::sql`], and `check` through its
//! own two statements there.
//!
//! A write never sends a notification: the workers read an address's settings with
//! every message they load, so a committed change applies from the next message on,
//! and the dispatcher keeps nothing of the table.

/// First statement of every writing transaction: writers of `pepsi.settings` wait for
/// each other, so each checks the rows the other's change left (two changes of one
/// address at one stage, each valid alone, cannot together break the section); readers
/// (the workers' loads) are not blocked. No parameters.
pub const LOCK_SETTINGS: &str = "LOCK TABLE pepsi.settings IN SHARE ROW EXCLUSIVE MODE";

/// Second statement of every writing transaction: the overlay stays as read until the
/// change commits, so the stage sections the change was checked against are the ones
/// the workers will lay it over. Waits for a `config set|unset` in progress and makes
/// the next one wait; readers are not blocked. No parameters.
pub const HOLD_CONFIG_OVERRIDE: &str = "LOCK TABLE pepsi.config_override IN SHARE MODE";

/// The settings, ordered by address, stage and key. $1 an address (text, lower-case)
/// or NULL for every address; $2 a stage (text) or NULL for every stage. Returns
/// (address, stage, key, value). Reads only.
pub const READ_SETTINGS: &str = "SELECT s.address, s.stage, s.key, s.value FROM pepsi.settings s \
     WHERE ($1::text IS NULL OR s.address = $1::text) \
       AND ($2::text IS NULL OR s.stage = $2::text) \
     ORDER BY s.address, s.stage, s.key";

/// The settings of some addresses at some stages: $1 addresses (text[]) and $2 stages
/// (text[]), pairwise, each pair once. Returns (address, stage, key, value). Reads
/// only.
pub const READ_SETTINGS_OF: &str = "SELECT s.address, s.stage, s.key, s.value FROM pepsi.settings s \
     JOIN unnest($1::text[], $2::text[]) AS g(address, stage) \
       ON g.address = s.address AND g.stage = s.stage \
     ORDER BY s.address, s.stage, s.key";

/// Writes settings, each new one added and each existing one's value replaced: $1
/// addresses (text[], lower-case), $2 stages, $3 keys, $4 values (text[] each),
/// pairwise, each (address, stage, key) once. Locks the rows it writes.
pub const WRITE_SETTINGS: &str = "INSERT INTO pepsi.settings (address, stage, key, value) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) \
     ON CONFLICT (address, stage, key) DO UPDATE SET value = EXCLUDED.value";

/// Removes settings: $1 addresses (text[]), $2 stages, $3 keys (text[] each),
/// pairwise. Returns nothing; locks the rows it removes.
pub const DELETE_SETTINGS: &str = "DELETE FROM pepsi.settings s \
     USING unnest($1::text[], $2::text[], $3::text[]) AS d(address, stage, key) \
     WHERE s.address = d.address AND s.stage = d.stage AND s.key = d.key";
