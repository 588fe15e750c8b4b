//! The statements of `pepsi-settings` on `pepsi.settings` (§12.5, §20): reading the
//! per-address settings, and writing them in the one transaction that checked them.
//! Named constants like [`super::sql`]'s; run by `queue::settings` only. The workers
//! read the table through the load query of [`super::sql`], and `check` through its
//! own two statements there.
//!
//! A write of a setting never sends a notification: the workers read an address's
//! settings with every message they load, so a committed change applies from the next
//! message on, and the dispatcher keeps nothing of the table. The fair-share weights
//! and the tenants (§7) have statements of their own at the end; their tables'
//! triggers notify the dispatcher and set the queue rows' tenants again. So does
//! `pepsi-setup`'s writing of `[pepsi] TENANT_KEY`.

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

/// The least and the greatest fair-share weight, as the CHECK of
/// `pepsi.fair_weights.weight` (schema 25) says; the dispatcher clamps to them too.
pub const WEIGHT_MIN: f64 = 0.01;
pub const WEIGHT_MAX: f64 = 100.0;

/// The fair-share weights and rates (`pepsi.fair_weights`, schema 25), by pattern.
/// Returns (pattern, weight, rate in messages a second or NULL, changed as text). Reads
/// only.
pub const READ_WEIGHTS: &str = "SELECT w.pattern, w.weight, w.rate, w.changed::text \
       FROM pepsi.fair_weights w ORDER BY w.pattern";

/// Sets a pattern's weight: $1 pattern (text), $2 weight (float8); the table's CHECKs
/// refuse what `pepsi-settings` let through by mistake. Its trigger notifies the
/// dispatcher, which reads the weights again.
pub const SET_WEIGHT: &str = "INSERT INTO pepsi.fair_weights (pattern, weight) VALUES ($1::text, $2::float8) \
     ON CONFLICT (pattern) DO UPDATE SET weight = EXCLUDED.weight, changed = now()";

/// Sets a pattern's weight back to 1: $1 pattern (text). Returns the row, if any;
/// [`DROP_PLAIN_WEIGHT`] then removes it when it sets nothing else.
pub const UNSET_WEIGHT: &str = "UPDATE pepsi.fair_weights w SET weight = 1, changed = now() \
      WHERE w.pattern = $1::text RETURNING w.pattern";

/// Sets a pattern's rate: $1 pattern (text), $2 messages a second (float8).
pub const SET_RATE: &str = "INSERT INTO pepsi.fair_weights (pattern, rate) VALUES ($1::text, $2::float8) \
     ON CONFLICT (pattern) DO UPDATE SET rate = EXCLUDED.rate, changed = now()";

/// Removes a pattern's rate: $1 pattern (text). Returns the row, if it had one;
/// [`DROP_PLAIN_WEIGHT`] then removes it when it sets nothing else.
pub const UNSET_RATE: &str = "UPDATE pepsi.fair_weights w SET rate = NULL, changed = now() \
      WHERE w.pattern = $1::text AND w.rate IS NOT NULL RETURNING w.pattern";

/// Removes a pattern's row when it sets nothing: weight 1 and no rate. $1 pattern.
pub const DROP_PLAIN_WEIGHT: &str = "DELETE FROM pepsi.fair_weights w \
      WHERE w.pattern = $1::text AND w.weight = 1 AND w.rate IS NULL";

/// The tenants named by pattern (`pepsi.tenants`, schema 25), by pattern. Returns
/// (pattern, tenant, changed as text). Reads only.
pub const READ_TENANTS: &str =
    "SELECT t.pattern, t.tenant, t.changed::text FROM pepsi.tenants t ORDER BY t.pattern";

/// Names the tenant of a sender-key pattern: $1 pattern (text), $2 tenant (text). The
/// table's trigger sets every queue row's tenant again in the same transaction.
pub const SET_TENANT: &str = "INSERT INTO pepsi.tenants (pattern, tenant) VALUES ($1::text, $2::text) \
     ON CONFLICT (pattern) DO UPDATE SET tenant = EXCLUDED.tenant, changed = now()";

/// Removes a pattern's tenant: $1 pattern (text). Returns the row removed, if any.
pub const UNSET_TENANT: &str =
    "DELETE FROM pepsi.tenants t WHERE t.pattern = $1::text RETURNING t.pattern";

/// `pepsi-setup`: writes `[pepsi] TENANT_KEY` and keys the queue again when it changed.
/// $1 the rule (text: default or sender). Returns the rows re-keyed (int8), -1 when the
/// rule was already that.
pub const SET_TENANT_RULE: &str = "SELECT pepsi.set_tenant_rule($1::text)";

/// The tenant a sender key belongs to now: $1 sender key (text). Returns one row.
pub const TENANT_OF: &str = "SELECT pepsi.tenant_of($1::text)";
