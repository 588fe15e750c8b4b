//! The statements on relay-to-internet's destinations (§22, schema 21): the workers'
//! connection slots and failure counts through their functions, and `pepsi-queue
//! destinations`' listing and lifting. Named constants like [`super::sql`]'s; run by
//! `stages::internet::destinations` (the workers) and `queue::destinations`.

/// Takes a connection slot of a destination unless it is suspended (a session-level
/// advisory lock, held until [`DESTINATION_CLOSE`] or the session's end). $1 the
/// destination, $2 `DESTINATION_CONCURRENCY`, $3 the slot to try first. One row: the
/// slot (NULL: none free, or suspended), the suspension's end, the failures counted.
pub const DESTINATION_OPEN: &str =
    "SELECT slot, suspended_until, failures FROM pepsi.destination_open($1, $2, $3)";

/// Takes a slot of a destination for a kept connection and, when it got one, gives
/// back the slot the connection held for another. $1 that other destination, $2 its
/// slot, $3 the destination, $4 `DESTINATION_CONCURRENCY`, $5 the slot to try first.
/// One row, as [`DESTINATION_OPEN`]'s.
pub const DESTINATION_MOVE: &str =
    "SELECT slot, suspended_until, failures FROM pepsi.destination_move($1, $2, $3, $4, $5)";

/// Gives a slot back. $1 the destination, $2 the slot.
pub const DESTINATION_CLOSE: &str = "SELECT pepsi.destination_close($1, $2)";

/// Counts a failed connection and suspends the destination at `DEAD_AFTER`. $1 the
/// destination, $2 the failure, $3 `DEAD_AFTER`, $4 `DEAD_TIME` in seconds (float8).
/// The suspension's end, or NULL.
pub const DESTINATION_FAILED: &str = "SELECT pepsi.destination_failed($1, $2, $3, \
     make_interval(secs => $4::float8))";

/// A connection succeeded after failures: the destination's row goes. $1 the
/// destination.
pub const DESTINATION_SUCCEEDED: &str = "SELECT pepsi.destination_succeeded($1)";

/// The destinations in trouble, suspended first, then by name. No parameters. Each:
/// destination, failures, suspended_until (NULL or past: not suspended), seconds
/// suspended still (0 when not), reason, updated.
pub const LIST_DESTINATIONS: &str = "SELECT destination, failures, suspended_until, \
     greatest(extract(epoch FROM suspended_until - now()), 0)::float8, reason, updated \
     FROM pepsi.destinations \
     ORDER BY (suspended_until > now()) IS TRUE DESC, destination";

/// Lifts a destination's suspension and forgets its failures. $1 the destination.
/// Returns the row deleted, if any (its destination).
pub const LIFT_DESTINATION: &str =
    "DELETE FROM pepsi.destinations WHERE destination = $1 RETURNING destination";
