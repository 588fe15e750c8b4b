//! The two claim statements (§6, §7), as named constants: the oldest-first claim
//! and the fair claim, each one call of its function (schemas 13 and 18) with its parameters,
//! re-exported by [`super::sql`] where every other statement lives. Only the
//! coordinator runs them, on its one session; the tests and benchmarks call them too.
//!
//! Both functions carry their planner settings (no sequential or bitmap scan of the
//! queue, no JIT), so their plans use the pending indexes whatever the table's
//! statistics say, and both take per stage a floor: the lowest id the pick reads, so
//! that a snapshot held open elsewhere, which keeps the entries of claimed rows in the
//! pending indexes, does not make every claim walk them (`dispatch/floors.rs` keeps
//! the floors).

/// The batched oldest-first claim (§6): `pepsi.workqueue_claim_oldest` (schema 13) for
/// every stage with free capacity at once, up to its own capacity. $1 stages (text[]),
/// $2 capacities (int4[]), $3 MAX_HOPS (int4), $4 each stage's floor (int8[], NULL
/// elements or a NULL array: none). Returns (id, stage, sender key, token, seconds
/// until the earliest paused row is due or NULL, looped) per row, with a row of NULLs
/// but the due time when nothing was claimed.
///
/// - The pick is driven by the partial pending index from (stage, floor), so its cost
///   stops at the cap, and the dead entries below the floor are never read. The stage
///   is matched as a range of one value and the rows ordered by (stage, id): an
///   equality would let the planner drop the stage from the order and walk the primary
///   key in id order, filtering. Only the `(stage, workqueue_id)` pending index gives
///   this order.
/// - The one claimer is the only pending → running writer; still, the pick locks its
///   rows with SKIP LOCKED, so a row another session has locked (an operator's
///   `SELECT … FOR UPDATE`, a repair command in a long transaction) is left for a later
///   claim instead of stalling the claims of every stage behind `lock_timeout`.
/// - The update fetches the picked rows by primary key, joined as an unnested array,
///   with the status tested as text so the partial indexes do not apply; the test still
///   re-checks a row changed concurrently.
/// - Every claimed row is stamped with one fresh claim token for the whole call (an
///   InitPlan: one `nextval` per claim that takes rows).
/// - It counts the row's hops (§6 "Hops") and fails a row whose hops pass MAX_HOPS
///   with `failure_class` `looped` instead of running it.
/// - The due time is a difference of epochs, so a paused row stored with an infinite
///   `timeout` gives an infinite number, not an error.
/// - The function runs with `enable_seqscan`, `enable_bitmapscan` and `jit` off: its
///   cached plans stay on the indexes after an autovacuum truncated the table and an
///   ANALYZE saw it empty.
///
/// A stage's next floor is just past the highest id claimed there (every pending row
/// between the floor and it was claimed, but for rows locked elsewhere).
pub const CLAIM_OLDEST: &str = "SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, c.due, c.looped \
       FROM pepsi.workqueue_claim_oldest($1::text[], $2::int4[], $4::int8[], $3::int4) c";

/// The batched fair claim (§7), one round trip: `pepsi.workqueue_claim_fair` (schema
/// 25, between tenants first, then their senders) for every stage with free capacity
/// at once. $1 stages (text[]), $2 capacities
/// (int4[], never exceeded), $3 of each capacity the slots for the stage's oldest rows
/// whoever sent them (int4[]), $4 each stage's average worker time per message in µs
/// (float8[]), $5 each stage's sender cursor (text[], NULL elements: from the first
/// sender), $6 $7 $8 the known leads in µs as parallel arrays of stage (text[]),
/// sender key (text[]) and lead (float8[]), $9 MAX_HOPS (int4), $10 each stage's
/// floor (int8[], NULL elements or a NULL array: none), $11 whether each stage may walk
/// its senders (bool[], NULL elements or a NULL array: yes), $12 each stage's sweep
/// (int8[], schema 18; NULL elements or a NULL array: none, the set read from the
/// floor), $13 each known sender's weight (float8[], parallel to $6–$8), $14–$17 the
/// known tenant leads as parallel arrays of stage (text[]), tenant (text[]), lead in µs
/// and weight (float8[] each), $18–$20 where each tenant's walk of its senders starts:
/// stage, tenant and sender (text[] each), $21 per stage the most rows a tenant not
/// listed in $22–$24 may take (int4[], NULL elements or a NULL array: no limit), $22–$24
/// per stage and tenant the rows it may take now (a rate's allowance: stage text[],
/// tenant text[], rows int4[]; a stage with any limit gives no FIFO slots and goes
/// through the ranking, which stops each tenant at its allowance). $5 is now each
/// stage's tenant cursor.
/// Returns (0 id, 1 stage, 2 sender key, 3 token, 4 seconds until the earliest paused
/// row is due or NULL, 5 looped, 6 window end, 7 next floor, 8 next sweep, 9 tenant):
/// one row per claimed row with its tenant (6–8 NULL); one row per stage of $1 with a
/// NULL id and tenant, its window end — the last tenant considered when its window of
/// 64 tenants was full, to pass as its next cursor; NULL when the window reached every
/// waiting tenant, so the cursor starts over (a stage asked with no capacity returns
/// its cursor unmoved) — its next floor (NULL: the claim read no row there) and its
/// next sweep (NULL: none, the stage's rows fitted without a set read); and one row per
/// tenant whose walk of its senders stopped short (window end: its next cursor) or
/// started at a cursor and went round (window end NULL). The due time is on every row;
/// with no stage asked the one row holds only it.
///
/// It keeps every property of [`CLAIM_OLDEST`]:
/// - Pending-index-only access, whatever the backlog: the senders waiting at a stage
///   are enumerated by loose index scans over the `(stage, tenant_key, sender_key,
///   workqueue_id)` pending index (one probe per tenant, at most 64 tenants, the window
///   rotating from one claim to the next; within each tenant one probe per sender, at
///   most 64 / tenants of them from the tenant's cursor), each sender's candidates are its capacity of oldest
///   rows from the floor in the same index, and the FIFO reserve reads the stage's
///   oldest rows from the floor in the `(stage, workqueue_id)` pending index. A stage
///   whose rows from the floor fit its capacity and a window (65 entries read) has them
///   all claimed without the senders' walk; one with no more than 512 has its senders
///   and their candidates found among them (513 entries read), and so does one whose
///   walk $11 pauses, whatever its backlog: then a sender with no row among the
///   stage's 513 oldest from the floor waits for a claim that walks. The reads stop at (senders × capacity)
///   candidates plus the FIFO rows plus one probe per sender: a sender's deep backlog
///   is never walked, nor, but by the senders' probes, the entries below the floor.
///   The lock and the update fetch the picked rows by primary key with the status
///   tested as text, so no partial index applies there. The function's statements are
///   PL/pgSQL static SQL with the planner settings of [`CLAIM_OLDEST`]; the fair claim
///   suite checks every nested plan's rows and buffers over a million-row backlog,
///   before and after ANALYZE, and after the table was emptied, vacuumed and analyzed.
/// - SKIP LOCKED: the picked rows are locked `FOR NO KEY UPDATE SKIP LOCKED`,
///   re-checked pending at their stage; a row another session holds is left for a
///   later claim and the next candidate in line (of those read) takes its slot.
/// - One claim token per statement, hops and the looped failure, and the due time as
///   in [`CLAIM_OLDEST`].
///
/// Per stage, the pick: the $3 oldest rows first, then the candidates: within a
/// tenant by `sender lead + k × average / sender weight` (the k-th oldest row of its
/// sender, k from 0), numbered j from 0; across tenants by `tenant lead + j × average /
/// tenant weight`; ties by lower id; rows already taken skipped. A lead is the known
/// one or, without one, level with the least-served: the least known lead among the
/// tenants considered (among its tenant's senders), 0 when none has one (§7 "keeping
/// quiet buys no later priority").
///
/// The next floor: the lowest id the claim read from the floor in id order (at most
/// 65) and did not claim, or just past the highest when it claimed them all.
///
/// The sweep (schema 18): given one, the 513 rows the window and candidates come from
/// are read from it, then (when fewer wait there) from the floor up to it; the oldest
/// rows' slots are read from the floor alone, and the next sweep is just past the last
/// row of those 513, in that order, that the claim took. The dispatcher passes sweeps
/// only while a snapshot holds the horizon (`dispatch/floors.rs`).
pub const CLAIM_FAIR: &str = "SELECT f.workqueue_id, f.stage, f.sender_key, f.claim, f.due, f.looped, \
            f.window_end, f.next_floor, f.next_sweep, f.tenant_key \
       FROM pepsi.workqueue_claim_fair($1::text[], $2::int4[], $3::int4[], $4::float8[], \
                 $5::text[], $6::text[], $7::text[], $8::float8[], $9::int4, $10::int8[], \
                 $11::bool[], $12::int8[], $13::float8[], $14::text[], $15::text[], \
                 $16::float8[], $17::float8[], $18::text[], $19::text[], $20::text[], \
                 $21::int4[], $22::text[], $23::text[], $24::int4[]) f";
