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

/// `pepsi-setup`'s last step, every run: the group roles and their privileges (schema
/// 7). No parameters. Returns (role, status: created, present or missing) per group
/// role.
pub const SETUP_ROLES: &str = "SELECT r.role, r.status FROM pepsi.setup_roles() r";

/// Whether PUBLIC may create in the database's `public` schema (schema 10). No
/// parameters. Returns one boolean.
pub const PUBLIC_SCHEMA_OPEN: &str = "SELECT pepsi.public_schema_open()";

/// Takes PUBLIC's right to create in the `public` schema (§4 "Containment"). No
/// parameters. Without the right to (another role owns the schema) the server only
/// warns; [`PUBLIC_SCHEMA_OPEN`] tells.
pub const CLOSE_PUBLIC_SCHEMA: &str = "REVOKE CREATE ON SCHEMA public FROM PUBLIC";

/// Replaces the stages an injecting role may inject into (`[pepsi] INJECT_STAGES`,
/// schema 10). $1 the stages (text[]). Returns whether the list changed; writes
/// nothing when it did not.
pub const SET_INJECT_STAGES: &str = "SELECT pepsi.set_inject_stages($1::text[])";

/// The schemas a Pepsi session resolves names through — `pepsi`, `pg_catalog`, and
/// those of the default `search_path` (`public`, and the session user's own) that a
/// session of a foreign worker or of `psql` would use — in which a role other than the
/// schema's owner and the superusers may create objects: each (schema, role). The
/// roles judged are $1 (text[]: the group roles) and the session's own. Reads only.
pub const CREATABLE_SCHEMAS: &str = "SELECT n.nspname::text, r.rolname::text \
       FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r \
      WHERE (r.rolname = ANY ($1::text[]) OR r.rolname = session_user) \
        AND (n.nspname IN ('pepsi', 'pg_catalog', 'public') OR n.nspname = session_user) \
        AND NOT r.rolsuper \
        AND r.oid <> (SELECT p.nspowner FROM pg_catalog.pg_namespace p WHERE p.nspname = 'pepsi') \
        AND pg_catalog.has_schema_privilege(r.oid, n.oid, 'CREATE') \
      ORDER BY 1, 2";

/// Serialises concurrent `pepsi-setup` runs until commit. $1 the key (int8).
pub const SETUP_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// The configuration overlay, through `pepsi.config_override_rows()` (schema 7): roles
/// without access to the table (workers, injectors) read it too. No parameters.
pub const READ_CONFIG_OVERRIDE: &str =
    "SELECT o.section, o.key, o.value FROM pepsi.config_override_rows() o ORDER BY 1, 2";

/// The fair-share weights and rates (`pepsi.fair_weights`, schema 25): (pattern,
/// weight, rate in messages a second or NULL), read by the dispatcher at start and at
/// every reload. No parameters.
pub const READ_FAIR_WEIGHTS: &str =
    "SELECT w.pattern, w.weight, w.rate FROM pepsi.fair_weights w ORDER BY w.pattern";

/// What each tenant got at each stage over the last minute (`pepsi.tenant_shares`,
/// schema 25), replacing the table's rows: $1 stages, $2 tenants (text[]), $3 worker
/// µs, $4 messages, $5 µs throttled (int8[]), $6 weights (float8[]), parallel. Rows of
/// tenants not given are deleted. The dispatcher's thread pool, at statistics ticks.
pub const WRITE_TENANT_SHARES: &str = "WITH up AS ( \
         INSERT INTO pepsi.tenant_shares AS t \
             (stage, tenant, worker_us, messages, throttled_us, weight) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], \
                              $6::float8[]) \
         ON CONFLICT (stage, tenant) DO UPDATE SET worker_us = EXCLUDED.worker_us, \
             messages = EXCLUDED.messages, throttled_us = EXCLUDED.throttled_us, \
             weight = EXCLUDED.weight, updated = now()) \
     DELETE FROM pepsi.tenant_shares t \
      WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS u(stage, tenant) \
                         WHERE u.stage = t.stage AND u.tenant = t.tenant)";

/// The per-address settings outside the allowed (stage, key) pairs, for
/// `pepsi-dispatch check`: $1 stages (text[]) and $2 keys (text[]), pairwise the keys
/// each stage section lets a per-address setting override. Rows of stages without a
/// section come back whole; the caller judges every row returned. Reads only.
pub const READ_UNLISTED_SETTINGS: &str = "SELECT s.address, s.stage, s.key FROM pepsi.settings s \
     WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS a(stage, key) \
                        WHERE a.stage = s.stage AND a.key = s.key) \
     ORDER BY s.stage, s.key, s.address";

/// The per-address settings inside the allowed (stage, key) pairs (the rows workers
/// apply), for `pepsi-dispatch check`: parameters as [`READ_UNLISTED_SETTINGS`].
/// Returns (address, stage, key, value), grouped by stage and address. Reads only.
pub const READ_LISTED_SETTINGS: &str = "SELECT s.address, s.stage, s.key, s.value FROM pepsi.settings s \
     JOIN unnest($1::text[], $2::text[]) AS a(stage, key) ON a.stage = s.stage AND a.key = s.key \
     ORDER BY s.stage, s.address, s.key";

/// The columns a worker loads for every row (see [`LOAD_METADATA`]). `$1` is the id
/// array. Never the claim token, which the worker's role may not read: the dispatcher
/// hands it with the id (§6 "Claim tokens"). The settings subquery fetches the per-address overrides of the correspondents (the
/// sender of a local message, else the recipients) for all stages, so fused stages have
/// theirs too; it runs only when there are settings at all (an `EXISTS` the server
/// evaluates once per statement), so a system without them does not look up every
/// recipient of every row. The lifetime age is a difference of epochs in float8, never
/// an interval: `now() - 'infinity'` is an error, which failed the load of the whole batch, while
/// the epoch of an infinite timestamp is an infinite float the worker clamps. A
/// `dsn_created` that is not a finite time falls back to the arrival. Then the
/// Message-ID, the arrival in epoch seconds and the end of the trail (whose last word is
/// when the row came to its stage, in epoch milliseconds: schema 22).
macro_rules! load_columns {
    () => {
        "q.workqueue_id, q.stage, q.status::text, q.mail_from, q.rcpt_to, q.auth_user, \
         host(q.client_ip), q.header_from, q.subject, q.state::text, q.sender_key, \
         extract(epoch FROM now())::float8 \
           - extract(epoch FROM CASE WHEN q.state ? 'dsn_created' \
                                      AND isfinite(pepsi.lifetime_start(q.state, q.arrived)) \
                                     THEN pepsi.lifetime_start(q.state, q.arrived) \
                                     ELSE q.arrived END)::float8, \
         CASE WHEN EXISTS (SELECT FROM pepsi.settings) THEN \
         (SELECT jsonb_agg(jsonb_build_array(s.address, s.stage, s.key, s.value)) \
            FROM pepsi.settings s \
           WHERE s.address = ANY (CASE WHEN q.state -> 'local_origin' = 'true'::jsonb \
                                       THEN ARRAY[lower(q.mail_from)] \
                                       ELSE ARRAY(SELECT lower(r) FROM unnest(q.rcpt_to) r) END))::text END, \
         q.message_id, extract(epoch FROM q.arrived)::float8, right(q.trail, 24)"
    };
}

/// Loads rows for a metadata-only stage, with their settings. $1 ids (int8[]).
/// Reads only; the rows are the worker's while they are `running`.
pub const LOAD_METADATA: &str = concat!(
    "SELECT ",
    load_columns!(),
    " FROM pepsi.workqueue q WHERE q.workqueue_id = ANY ($1)"
);

/// Loads rows with their header block and body, within a budget. $1 ids (int8[]), $2
/// bytes (int8): in the order of $1, a row's header block and body come while the
/// rows before it brought fewer bytes than $2 (the first row's always); a later row's
/// are NULL, and its last column false, to be read in its turn ([`LOAD_CONTENT`]).
/// The sizes are the stored lengths, read without reading the values.
pub const LOAD_FULL: &str = concat!(
    "SELECT ",
    load_columns!(),
    ", CASE WHEN q.before < $2 THEN q.headers END, CASE WHEN q.before < $2 THEN q.body END, \
       q.before < $2 \
     FROM (SELECT w.workqueue_id, w.stage, w.status, w.mail_from, w.rcpt_to, w.auth_user, \
                  w.client_ip, w.header_from, w.subject, w.state, w.sender_key, w.arrived, \
                  w.message_id, w.trail, w.headers, b.body, \
                  coalesce(sum(coalesce(octet_length(w.headers), 0) \
                               + coalesce(octet_length(b.body), 0)) OVER ( \
                      ORDER BY array_position($1, w.workqueue_id) \
                      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before \
             FROM pepsi.workqueue w \
             LEFT JOIN pepsi.workqueue_body b ON b.body_id = w.body_id \
            WHERE w.workqueue_id = ANY ($1)) q"
);

/// The header block and body of one row a fused chain goes on with into a stage that
/// needs them (§12.6 amended): $1 the id, $2 the stage it was claimed at. Reads only;
/// no row when it is no longer running at that stage (taken away: the chain ends
/// there, and its write finds nothing either).
pub const LOAD_CONTENT: &str = "SELECT q.headers, b.body FROM pepsi.workqueue q \
     LEFT JOIN pepsi.workqueue_body b ON b.body_id = q.body_id \
     WHERE q.workqueue_id = $1 AND q.status = 'running' AND q.stage = $2";

/// A worker's outcome writes for a batch, one round trip (§12.3), through
/// `pepsi.workqueue_write`. $1 a JSON array of objects {id, claimed, claim, stage,
/// status, delay_ms, state, trail (appended to the row's), log (records for
/// `pepsi.history`, schema 22), and, when a stage rewrote them (`rewritten`: true),
/// mail_from, rcpt_to, header_from, subject and, when it added header fields, base64
/// prepend_headers}. Guarded: only rows still `running` at
/// the stage they were claimed at, under the claim token the dispatcher handed with
/// them, are written (§12.2, §6). Returns the written ids.
pub const WRITE_OUTCOMES: &str = "SELECT w FROM pepsi.workqueue_write($1::text::jsonb) w";

/// A worker's finished messages, one round trip, through `pepsi.workqueue_done`
/// (schema 22). $1 a JSON array of objects {id, claimed, claim, trail, log}: the rows
/// deleted, guarded like [`WRITE_OUTCOMES`], each with its records written to
/// `pepsi.history` in the same statement. Returns the deleted ids.
pub const DELETE_FINISHED: &str = "SELECT f FROM pepsi.workqueue_done($1::text::jsonb) f";

/// The delivery history's upkeep (schema 22), on the dispatcher's thread pool at start
/// and every hour: partitions for the next days made, days past $1 (int4, the
/// retention in days) dropped. Returns the partitions dropped (int4).
pub const HISTORY_MAINTAIN: &str = "SELECT pepsi.history_maintain($1)";

/// Splits a claimed row's recipients (§12.5), one round trip. $1 id (int8), $2 groups
/// (JSON text), $3 the claimed stage (guard), $4 the stage the groups continue at or
/// NULL for the same, $5 the state for all rows or NULL to keep, $6 whether the kept
/// row is released to pending, $7 the claim token (guard). Returns the new ids, NULL
/// when the guard did not match.
pub const SPLIT: &str =
    "SELECT pepsi.workqueue_split($1, $2::text::jsonb, $3, $4, $5::text::jsonb, $6, $7)";

/// The bounce stage's finish (§13.2), one round trip: the delivery status notification
/// as a new pending row, the original deleted. $1 the original's id (int8), $2 its
/// claimed stage (text, guard), $3 its claim token (int8, guard), $4 the stage the DSN
/// goes to (text), $5 its one recipient, the original sender (text), $6 its `From:`
/// (text), $7 its `Subject:` (text), $8 its header block (bytea), $9 its body (bytea).
/// Returns the DSN's id, NULL when the guard did not match.
pub const BOUNCE: &str = "SELECT pepsi.workqueue_bounce($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// The failure bouncer's move (§13.1), one round trip: up to $3 (int4) rows whose
/// status is one of $2 (text[]: failed, timeout) and whose stage is not $1 (text) go to
/// $1 as pending, with one NOTIFY on `workqueue` when any moved. Locks the rows it
/// picks; a row another caller moved meanwhile is skipped. Returns (id, the stage and
/// status it had) per moved row.
pub const BOUNCE_FAILED: &str = "SELECT b.workqueue_id, b.stage, b.status::text \
     FROM pepsi.workqueue_bounce_failed($1, $2::text[]::pepsi.workqueue_status[], $3) b";

/// LISTEN for the failure bouncer: rows turning failed or timeout.
pub const LISTEN_BOUNCER: &str = "LISTEN workqueue_failed";

/// The failure bouncer session's bounds: a failed row locked elsewhere (an operator's
/// open transaction) or a runaway call holds a move up for a few seconds at most; the
/// call then fails and is tried again a few seconds later, and a SIGTERM is never kept
/// waiting behind it for long. Another bouncer's lock on a row lasts one short call.
pub const BOUNCER_TIMEOUTS_OPTION: &str = "-c lock_timeout=5s -c statement_timeout=30s";

/// The startup option of sessions whose commits need not wait for the WAL flush
/// (workers unless `WORKER_SYNCHRONOUS_COMMIT = yes`, the dispatcher's coordinator).
pub const ASYNC_COMMIT_OPTION: &str = "-c synchronous_commit=off";

/// The stage and status of one row, read without any of its content: for a row whose
/// load fails, so that it can still be failed at its claimed stage under the token the
/// dispatcher handed with it. $1 id (int8). Returns (stage, status), or no row when it
/// is gone. Reads only.
pub const LOAD_CLAIM: &str = "SELECT stage, status::text FROM pepsi.workqueue \
     WHERE workqueue_id = $1";

/// Fails a claimed row without rewriting its state, through
/// `pepsi.workqueue_fail_in_place`: the failure keys are merged into the stored state
/// server-side, so a row the worker cannot load or read loses nothing (§12.4). $1 id
/// (int8), $2 claimed stage (text, also `failed_stage`), $3 claim token (int8), $4
/// `failure_class` (text), $5 `last_error` (text); guarded. Returns the id, or NULL
/// when the guard did not match.
pub const FAIL_IN_PLACE: &str =
    "SELECT pepsi.workqueue_fail_in_place($1::int8, $2::text, $3::int8, $4::text, $5::text)";

/// Last resort when a worker cannot write a row's outcome for a non-connection
/// reason, through `pepsi.workqueue_unwritten`: `state.unwritten` counts the attempts
/// (a value that is not a number counts as none, a huge one as many); the attempt that
/// brings it to $5 fails the row with `failure_class` `unwritable` (and
/// `failed_stage`), every earlier one pauses it with the error, for 1 minute the first
/// time and twice as long each time after, up to an hour, so a stage whose outcome
/// never fits does not repeat its side effects every minute, nor forever. The state is
/// merged server-side, never replaced. $1 id (int8), $2 claimed stage (text), $3 the
/// error (text), $4 the claim token (int8), $5 the attempt that fails the row (int4);
/// guarded. Returns (the new status as text, the pause in minutes or NULL when it
/// failed, the attempt count), or no row when the guard did not match.
pub const PAUSE_OR_FAIL_UNWRITTEN: &str = "SELECT u.status, u.pause_minutes, u.attempts \
     FROM pepsi.workqueue_unwritten($1::int8, $2::text, $3::text, $4::int8, $5::int4) u";

/// The coordinator session's bounds (§8.2 "Bounded waits"): a row lock held elsewhere
/// (an operator's `SELECT … FOR UPDATE`, a killed worker's statement still running) or
/// a runaway statement stalls the serial queue writes, and with them every stage's
/// claims, for a few seconds at most; the write then fails and joins the retry list.
pub const COORDINATOR_TIMEOUTS_OPTION: &str = "-c lock_timeout=2s -c statement_timeout=10s";

/// Terminates the database sessions of workers the dispatcher killed, or of every
/// worker at start (orphans of a previous dispatcher), through
/// `pepsi.terminate_worker_sessions` (schema 7, SECURITY DEFINER: the dispatcher's role
/// need not be allowed to signal the workers' backends itself): sessions of this
/// database named `pepsi-worker:…` whose `application_name` matches one of $1 (text[],
/// `LIKE` patterns built by `protocol::session_pattern`), waiting up to a second
/// for each to end. Returns (terminated, refused: sessions the function's owner may not
/// signal), int8 each.
pub const TERMINATE_WORKER_SESSIONS: &str =
    "SELECT t.terminated, t.refused FROM pepsi.terminate_worker_sessions($1::text[]) t";

/// The dispatcher's LISTEN session: new work, configuration and telemetry changes.
pub const LISTEN_DISPATCHER: &str =
    "LISTEN workqueue; LISTEN config_changed; LISTEN telemetry_changed";

/// The advisory lock key that makes one dispatcher per database (session lock).
pub const DISPATCH_LOCK_KEY: i64 = 0x7065_7073_6944_7370; // "pepsiDsp"

/// Tries the dispatcher's session-level advisory lock. $1 the key (int8).
pub const TRY_DISPATCH_LOCK: &str = "SELECT pg_try_advisory_lock($1)";

/// Who holds the dispatcher lock: (0 pid int4, 1 its role text, 2 application_name
/// text, 3 where from text, 4 connected since text), or no row. $1 the key (int8),
/// split as PostgreSQL stores an int8 advisory lock key (high and low 32 bits,
/// `objsubid` 1). The pid, the role and the application name are visible to every
/// role; where from and since when only to the holder's own role, its members and
/// `pg_read_all_stats` (NULL otherwise: the holder may be another dispatcher role).
pub const DISPATCH_LOCK_HOLDER: &str = "SELECT a.pid, a.usename::text, a.application_name, \
            CASE WHEN a.backend_start IS NOT NULL \
                 THEN coalesce('host ' || coalesce(a.client_hostname, host(a.client_addr)), \
                               'a local socket') END, \
            a.backend_start::text \
       FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
        AND l.classid = (($1::int8 >> 32) & 4294967295)::oid \
        AND l.objid = ($1::int8 & 4294967295)::oid \
      LIMIT 1";

/// The session's own backend process id. No parameters. Returns an int4.
pub const BACKEND_PID: &str = "SELECT pg_backend_pid()";

/// Terminates the server process of a session of this dispatcher that the watchdog
/// abandoned and that still holds the dispatcher lock (a server that answered again,
/// or a statement that ran on). $1 its pid (int4), when it is a session of this
/// database. Returns whether it was signalled.
pub const TERMINATE_OWN_SESSION: &str = "SELECT coalesce(bool_or(pg_terminate_backend(a.pid)), false) \
       FROM pg_stat_activity a \
      WHERE a.pid = $1 AND a.datname = current_database()";

/// Resets every running row to pending: orphans of a previous dispatcher at start-up,
/// this dispatcher's in-flight rows at shutdown (its workers are dead by then). No
/// parameters. Returns the count.
pub const RESET_RUNNING: &str =
    "UPDATE pepsi.workqueue SET status = 'pending' WHERE status = 'running'";

// The two claim statements live in `claim_sql.rs` (schema 13: functions with their
// floors and planner settings); every caller names them through this file.
pub use super::claim_sql::{CLAIM_FAIR, CLAIM_OLDEST};

/// Flips due paused rows to pending and returns how many, with the seconds until the
/// next paused row is due. A row due at infinity never is, and the difference of epochs
/// gives an infinite number for it rather than an error. No parameters.
pub const FLIP_PAUSED: &str = "WITH flipped AS ( \
         UPDATE pepsi.workqueue SET status = 'pending', timeout = NULL \
          WHERE status = 'paused' AND timeout <= now() RETURNING 1) \
     SELECT (SELECT count(*) FROM flipped)::int8, \
            (SELECT extract(epoch FROM min(timeout))::float8 - extract(epoch FROM now())::float8 \
               FROM pepsi.workqueue WHERE status = 'paused' AND timeout > now())";

/// At start-up: paused rows without a due time (stored before schema 3's check; no
/// paused row can be written so since) are due now. No parameters. Returns the count.
pub const RELEASE_UNTIMED_PAUSED: &str =
    "UPDATE pepsi.workqueue SET status = 'pending' WHERE status = 'paused' AND timeout IS NULL";

/// Resets running rows that are not in $1 (int8[], the ids this dispatcher holds):
/// after the lock was lost and taken again, a claim may have committed whose answer
/// never arrived. Returns the reset ids.
pub const RESET_RUNNING_EXCEPT: &str = "UPDATE pepsi.workqueue SET status = 'pending' \
     WHERE status = 'running' AND workqueue_id <> ALL ($1::int8[]) RETURNING workqueue_id";

/// Puts claimed rows back to pending (siblings of a crash, rows of a worker that never
/// became ready, a 75). $1 ids (int8[]), $2 their claimed stages (text[]), $3 their
/// claim tokens (int8[]); guarded. The ids are a condition on the primary key too, so
/// no plan reads the whole index (schema 16 says why).
pub const REQUEUE: &str = "UPDATE pepsi.workqueue q SET status = 'pending' \
     FROM unnest($1::int8[], $2::text[], $3::int8[]) AS r(id, stage, claim) \
     WHERE q.workqueue_id = ANY ($1::int8[]) AND q.workqueue_id = r.id \
       AND q.status = 'running' AND q.stage = r.stage AND q.claim = r.claim \
     RETURNING q.workqueue_id";

/// Records a strike (§8.2). $1 id, $2 stage, $3 'crashed' or 'timed-out', $4 the
/// reason, $5 the claim token. Returns (strikes, status, seconds until due or NULL when it failed) or no
/// row when the guard failed.
pub const STRIKE: &str = "SELECT s.strikes, s.status::text, extract(epoch FROM s.due - now())::float8 \
       FROM pepsi.workqueue_strike($1, $2, $3, $4, $5) s";

/// Defers a message whose worker lost its database connection (§8.4): paused for 30
/// seconds at the same stage. $1 id, $2 claimed stage, $3 claim token; guarded.
/// Returns the seconds until it is due.
pub const DEFER: &str = "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '30 seconds' \
     WHERE workqueue_id = $1 AND status = 'running' AND stage = $2 AND claim = $3 \
     RETURNING extract(epoch FROM timeout - now())::float8";

/// Resumes rows deferred for 74 early (§8.4): back to pending once the dispatcher's
/// own session works again. $1 ids (int8[]), $2 their claimed stages (text[]), $3 their
/// claim tokens (int8[]); only rows still paused under that claim. Returns their ids.
pub const RESUME_DEFERRED: &str = "UPDATE pepsi.workqueue q SET status = 'pending', timeout = NULL \
     FROM unnest($1::int8[], $2::text[], $3::int8[]) AS r(id, stage, claim) \
     WHERE q.workqueue_id = ANY ($1::int8[]) AND q.workqueue_id = r.id \
       AND q.status = 'paused' AND q.stage = r.stage AND q.claim = r.claim \
     RETURNING q.workqueue_id";

/// Adds statistics deltas, in one statement (one transaction; a data-modifying CTE
/// always runs to completion). $1 stages (text[]),
/// $2 passes, $3 fused passes, $4 failures, $5 crashes, $6 timeouts, $7 requeues,
/// $8 busy microseconds, $9 deferrals, $10 senders served (int8[] each), $11 stages
/// executed, $12 claims, $13 rows claimed, $14 worker starts (int8), $15 $16 $17 the
/// events stages counted as parallel arrays of stage (text[]), event (text[]) and
/// count (int8[]; `pepsi.stage_events`, schema 20). Only the dispatcher writes these
/// tables.
pub const FLUSH_STATS: &str = "WITH per_stage AS ( \
         INSERT INTO pepsi.stage_stats AS s \
             (stage, passes, fused_passes, failures, crashes, timeouts, requeues, busy_us, \
              deferrals, senders_served) \
         SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], \
                              $6::int8[], $7::int8[], $8::int8[], $9::int8[], $10::int8[]) \
         ON CONFLICT (stage) DO UPDATE SET \
             passes = s.passes + EXCLUDED.passes, \
             fused_passes = s.fused_passes + EXCLUDED.fused_passes, \
             failures = s.failures + EXCLUDED.failures, \
             crashes = s.crashes + EXCLUDED.crashes, \
             timeouts = s.timeouts + EXCLUDED.timeouts, \
             requeues = s.requeues + EXCLUDED.requeues, \
             busy_us = s.busy_us + EXCLUDED.busy_us, \
             deferrals = s.deferrals + EXCLUDED.deferrals, \
             senders_served = s.senders_served + EXCLUDED.senders_served, \
             updated = now()), \
     per_event AS ( \
         INSERT INTO pepsi.stage_events AS e (stage, event, count) \
         SELECT * FROM unnest($15::text[], $16::text[], $17::int8[]) \
         ON CONFLICT (stage, event) DO UPDATE SET \
             count = e.count + EXCLUDED.count, updated = now()) \
     UPDATE pepsi.dispatch_stats SET \
         stages_executed = stages_executed + $11, claims = claims + $12, \
         rows_claimed = rows_claimed + $13, worker_starts = worker_starts + $14, \
         updated = now()";

/// The body GC tick (§10). $1 the limit (int4).
pub const BODY_GC: &str = "SELECT pepsi.workqueue_body_gc($1)";

/// Pending rows at stages that are not in the stage table: a loose index scan over the
/// stages of the pending index, then a count for each unknown one. $1 the known stages
/// (text[]).
pub const UNKNOWN_STAGES: &str = "WITH RECURSIVE s AS ( \
         (SELECT stage FROM pepsi.workqueue WHERE status = 'pending' ORDER BY stage LIMIT 1) \
         UNION ALL \
         SELECT (SELECT q.stage FROM pepsi.workqueue q \
                  WHERE q.status = 'pending' AND q.stage > s.stage ORDER BY q.stage LIMIT 1) \
           FROM s WHERE s.stage IS NOT NULL) \
     SELECT s.stage, (SELECT count(*) FROM pepsi.workqueue q \
                       WHERE q.status = 'pending' AND q.stage = s.stage)::int8 \
       FROM s WHERE s.stage IS NOT NULL AND s.stage <> ALL ($1::text[])";

// `pepsi-queue` (§14). The repair statements are one stored-function call each:
// one round trip, one NOTIFY on `workqueue` when anything changed.

/// The bound of `pepsi-queue`'s session: a row locked elsewhere (a claim in progress,
/// an operator's open transaction) makes a repair command give up after ten seconds
/// (exit 75, nothing changed) instead of hanging.
pub const QUEUE_TIMEOUTS_OPTION: &str = "-c lock_timeout=10s";

/// Every value of the status type, in order. No parameters.
pub const QUEUE_STATUSES: &str =
    "SELECT s::text FROM unnest(enum_range(NULL::pepsi.workqueue_status)) AS s";

/// The queue's shape: rows by stage, status and age bucket. $1 the lower bounds of the
/// age buckets in seconds (float8[], ascending). Returns (stage, status as text,
/// bucket int4 — 0 below the first bound, i from the i-th bound on —, rows int8, the
/// oldest row's age in seconds float8). The age counts from `arrived` as a difference
/// of epochs, so a row stored with an infinite arrival gives an infinite age, not an
/// error. Reads the whole table (one sequential scan); locks nothing.
pub const QUEUE_SHAPE: &str = "SELECT q.stage, q.status::text, width_bucket(q.age, $1::float8[]), \
            count(*)::int8, max(q.age) \
       FROM (SELECT stage, status, \
                    extract(epoch FROM now())::float8 - extract(epoch FROM arrived)::float8 AS age \
               FROM pepsi.workqueue) q \
      GROUP BY 1, 2, 3 ORDER BY 1, 2, 3";

/// `pepsi-queue shape` (Postfix `qshape`): messages by a key and age bucket, the top
/// keys and the total, grouped and ranked by the server in one statement. $1 the key
/// (text): `recipient-domain` (each recipient's domain, the part after its last `@`,
/// lower-cased), `sender` (the sender's domain the same way, `MAILER-DAEMON` for the
/// null sender) or `stage`; $2 the upper bounds of the age buckets in minutes (float8[],
/// ascending); $3 stage and $4 status (text), each NULL for any; $5 the most keys
/// (int8). A message counts once per key it has (`count(DISTINCT id)`: once for a
/// domain however many of its recipients are there, and in each of its domains) and
/// once in the total. Returns (total bool, key text — NULL on the total —, bucket int4
/// — 0 below the first bound, i from the i-th bound on —, messages int8, the key's rank
/// int8 — by messages, then by key in byte order —, the number of keys int8), the
/// total first, then the keys ranked up to $5, each by bucket, buckets without
/// messages left out. The age counts from `arrived` as a difference of epochs (an
/// infinite arrival gives an infinite age, not an error). Reads the whole table (one
/// sequential scan); locks nothing.
pub const QUEUE_SHAPE_BY_KEY: &str = "WITH m AS ( \
        SELECT q.workqueue_id AS id, k.key, \
               width_bucket((extract(epoch FROM now())::float8 \
                             - extract(epoch FROM q.arrived)::float8) / 60, $2::float8[]) AS bucket \
          FROM pepsi.workqueue q \
         CROSS JOIN LATERAL ( \
               SELECT lower(split_part(r.address, '@', -1)) \
                 FROM unnest(q.rcpt_to) AS r(address) WHERE $1::text = 'recipient-domain' \
               UNION ALL \
               SELECT CASE WHEN q.mail_from = '' THEN 'MAILER-DAEMON' \
                           ELSE lower(split_part(q.mail_from, '@', -1)) END \
                WHERE $1::text = 'sender' \
               UNION ALL \
               SELECT q.stage WHERE $1::text = 'stage') AS k(key) \
         WHERE ($3::text IS NULL OR q.stage = $3::text) \
           AND ($4::text IS NULL OR q.status::text = $4::text)), \
     g AS ( \
        SELECT GROUPING(m.key) = 1 AS total, m.key, m.bucket, count(DISTINCT m.id)::int8 AS n \
          FROM m GROUP BY GROUPING SETS ((m.key, m.bucket), (m.bucket))), \
     t AS ( \
        SELECT g.*, sum(g.n) OVER (PARTITION BY g.total, g.key) AS key_n FROM g), \
     ranked AS ( \
        SELECT t.*, dense_rank() OVER (PARTITION BY t.total \
                                       ORDER BY t.key_n DESC, t.key COLLATE \"C\") AS rank \
          FROM t), \
     counted AS ( \
        SELECT ranked.*, max(ranked.rank) OVER (PARTITION BY ranked.total) AS keys FROM ranked) \
     SELECT c.total, c.key, c.bucket, c.n, c.rank::int8, c.keys::int8 \
       FROM counted c WHERE c.total OR c.rank <= $5::int8 \
      ORDER BY c.total DESC, c.rank, c.bucket";

/// How many tenants wait at each of some stages (§7 "Seen"): $1 stages (text[]), $2
/// the most counted (int4). A loose index scan of the pending tenant index per stage,
/// one probe per tenant. Returns (stage, tenants (int8)). Reads only.
pub const QUEUE_TENANTS_WAITING: &str = "SELECT s.stage, ( \
         WITH RECURSIVE t(key, n) AS ( \
             SELECT (SELECT q.tenant_key FROM pepsi.workqueue q \
                      WHERE q.stage = s.stage AND q.status = 'pending' \
                      ORDER BY q.tenant_key LIMIT 1), 1 \
           UNION ALL \
             SELECT (SELECT q.tenant_key FROM pepsi.workqueue q \
                      WHERE q.stage = s.stage AND q.status = 'pending' AND q.tenant_key > t.key \
                      ORDER BY q.tenant_key LIMIT 1), t.n + 1 \
               FROM t WHERE t.key IS NOT NULL AND t.n < $2::int4) \
         SELECT count(*) FROM t WHERE t.key IS NOT NULL) \
       FROM unnest($1::text[]) AS s(stage)";

/// What each tenant got at each stage over the last minute, as the dispatcher wrote it
/// within the last two minutes (`pepsi.tenant_shares`, schema 25), and whether it
/// waits there now. No parameters. Returns (stage, tenant, worker µs, messages, µs
/// throttled (int8), weight (float8), waiting (bool)), by stage and most worker time.
/// Reads only.
pub const QUEUE_TENANT_SHARES: &str = "SELECT t.stage, t.tenant, t.worker_us, t.messages, \
            t.throttled_us, t.weight, \
            EXISTS (SELECT 1 FROM pepsi.workqueue q WHERE q.stage = t.stage \
                       AND q.status = 'pending' AND q.tenant_key = t.tenant) \
       FROM pepsi.tenant_shares t WHERE t.updated > now() - interval '2 minutes' \
      ORDER BY t.stage, t.worker_us DESC, t.tenant";

/// The events stages counted (`pepsi.stage_events`, schema 20). No parameters.
/// Returns (stage, event, count (int8)), by stage and event.
pub const QUEUE_STAGE_EVENTS: &str =
    "SELECT stage, event, count FROM pepsi.stage_events ORDER BY stage, event";

/// The per-stage statistics. No parameters. Returns (stage, passes, fused passes,
/// failures, crashes, timeouts, requeues, busy µs, deferrals, senders served (int8
/// each), updated as epoch seconds float8, updated as ISO 8601 UTC text).
pub const QUEUE_STAGE_STATS: &str = "SELECT stage, passes, fused_passes, failures, crashes, timeouts, \
            requeues, busy_us, deferrals, senders_served, extract(epoch FROM updated)::float8, \
            to_char(updated AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
       FROM pepsi.stage_stats ORDER BY stage";

/// The dispatcher's statistics (one row). No parameters. Returns (stages executed,
/// claims, rows claimed, worker starts (int8 each), updated as epoch seconds float8,
/// updated as ISO 8601 UTC text, now as epoch seconds float8).
pub const QUEUE_DISPATCH_STATS: &str = "SELECT stages_executed, claims, rows_claimed, worker_starts, \
            extract(epoch FROM updated)::float8, \
            to_char(updated AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
            extract(epoch FROM now())::float8 \
       FROM pepsi.dispatch_stats";

/// `pepsi-ingress`'s counters (one row, `pepsi.ingress_stats`). No parameters.
/// Returns (sessions, accepted, recipients, deferred, refused, commits, tls_sessions
/// (int8 each), updated as epoch seconds float8). Locks nothing.
pub const QUEUE_INGRESS_STATS: &str = "SELECT sessions, accepted, recipients, deferred, refused, \
            commits, tls_sessions, extract(epoch FROM updated)::float8 \
       FROM pepsi.ingress_stats";

/// Is a dispatcher running: does a session hold the dispatcher's advisory lock (see
/// [`DISPATCH_LOCK_HOLDER`])? $1 the key (int8). Returns a boolean.
pub const DISPATCHER_RUNNING: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks l \
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
        AND l.classid = (($1::int8 >> 32) & 4294967295)::oid \
        AND l.objid = ($1::int8 & 4294967295)::oid)";

/// `pepsi-queue list`: rows oldest (lowest id) first, each filter NULL for any. $1
/// stage (text), $2 status (text), $3 sender key (text), $4 the most rows (int8).
/// Returns (id, stage, status text, age in seconds float8, mail_from, first recipient,
/// number of recipients int4, state.last_error text, sender key). Walks the primary key
/// and stops at the limit; locks nothing.
pub const QUEUE_LIST: &str = "SELECT workqueue_id, stage, status::text, \
            extract(epoch FROM now())::float8 - extract(epoch FROM arrived)::float8, \
            mail_from, rcpt_to[array_lower(rcpt_to, 1)], cardinality(rcpt_to), \
            state ->> 'last_error', sender_key \
       FROM pepsi.workqueue \
      WHERE ($1::text IS NULL OR stage = $1::text) \
        AND ($2::text IS NULL OR status::text = $2::text) \
        AND ($3::text IS NULL OR sender_key = $3::text) \
      ORDER BY workqueue_id LIMIT $4";

/// `pepsi-queue show`: one row with everything but its content, and the content only
/// when asked. $1 id (int8), $2 with the header block (bool), $3 with the body (bool).
/// Returns (0 id, 1 stage, 2 status, 3 timeout, 4 arrived (ISO 8601 UTC text), 5 age
/// in seconds float8, 6 mail_from, 7 rcpt_to, 8 auth_user, 9 client_ip text, 10
/// header_from, 11 subject, 12 state text, 13 sender_key, 14 claim, 15 hops int4, 16
/// hop_stage, 17 body_id, 18 header block size int8, 19 body size int8, 20 header block
/// bytea, 21 body bytea), or no row. Locks nothing.
pub const QUEUE_SHOW: &str = "SELECT q.workqueue_id, q.stage, q.status::text, \
            to_char(q.timeout AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
            to_char(q.arrived AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
            extract(epoch FROM now())::float8 - extract(epoch FROM q.arrived)::float8, \
            q.mail_from, q.rcpt_to, q.auth_user, host(q.client_ip), q.header_from, q.subject, \
            q.state::text, q.sender_key, q.claim, q.hops, q.hop_stage, q.body_id, \
            octet_length(q.headers)::int8, octet_length(b.body)::int8, \
            CASE WHEN $2::bool THEN q.headers END, CASE WHEN $3::bool THEN b.body END \
       FROM pepsi.workqueue q LEFT JOIN pepsi.workqueue_body b ON b.body_id = q.body_id \
      WHERE q.workqueue_id = $1";

/// `pepsi-queue inject`: `pepsi.workqueue_inject`, one round trip, one NOTIFY. $1
/// stage, $2 mail_from, $3 rcpt_to (text[]), $4 header block (bytea), $5 body (bytea),
/// $6 auth_user, $7 client IP (text, NULL for none), $8 header_from, $9 subject, $10
/// state (a JSON object as text). Returns the new id.
pub const INJECT: &str = "SELECT pepsi.workqueue_inject($1::text, $2::text, $3::text[], $4::bytea, \
            $5::bytea, $6::text, $7::text::inet, $8::text, $9::text, $10::text::jsonb)";

/// `pepsi-ingress`'s group commit (§16): many messages queued in one call of
/// `pepsi.workqueue_inject_many`, and so in one transaction with one folded `NOTIFY
/// workqueue`, each held to the checks of `pepsi.workqueue_inject` (one that fails them
/// fails the call). $1 the stage (text), then one array element per message: $2
/// senders (text[]), $3 recipients (text[], each a JSON array of addresses), $4 header
/// blocks (bytea[]), $5 bodies (bytea[]), $6 logins (text[], NULL none), $7 client
/// addresses (text[], NULL local), $8 `From:` (text[]), $9 subjects (text[]), $10
/// states (text[], JSON objects). Returns (1-based position in the arrays, new id) per
/// message. Writes only through the function.
pub const INJECT_MANY: &str = "SELECT m.n, m.workqueue_id \
       FROM pepsi.workqueue_inject_many($1::text, $2::text[], $3::text[]::jsonb[], \
            $4::bytea[], $5::bytea[], $6::text[], $7::text[]::inet[], $8::text[], \
            $9::text[], $10::text[]::jsonb[]) m";

/// `pepsi-ingress`'s counters, added to (one round trip). $1 sessions, $2 accepted,
/// $3 recipients, $4 deferred, $5 refused, $6 commits, $7 sessions that went on inside
/// TLS (all int8; schema 19).
pub const INGRESS_STATS_ADD: &str = "UPDATE pepsi.ingress_stats \
        SET sessions = sessions + $1, accepted = accepted + $2, recipients = recipients + $3, \
            deferred = deferred + $4, refused = refused + $5, commits = commits + $6, \
            tls_sessions = tls_sessions + $7, updated = now()";

/// `pepsi-ingress`'s session settings: every acceptance waits for the WAL flush (a
/// message answered 250 is never lost), and no statement or lock holds a batch of
/// sessions for long.
pub const INGRESS_SESSION_OPTION: &str =
    "-c synchronous_commit=on -c lock_timeout=5s -c statement_timeout=30s";

/// `pepsi-queue resume ID…`: `pepsi.workqueue_resume_each`. $1 ids (int8[]). Returns
/// per distinct id (id, status before as text or NULL when there is no such row,
/// changed).
pub const RESUME_EACH: &str = "SELECT r.workqueue_id, r.status::text, r.changed FROM pepsi.workqueue_resume_each($1::int8[]) r";

/// `pepsi-queue resume --stage/--status/--all`: `pepsi.workqueue_resume` by stage and
/// status. $1 stage (text, NULL any), $2 status (text, NULL any of paused, failed and
/// timeout). Returns how many rows changed (int4).
pub const RESUME_MATCHING: &str =
    "SELECT pepsi.workqueue_resume($1::text, $2::text::pepsi.workqueue_status)";

/// `pepsi-queue hold`: `pepsi.workqueue_hold`. $1 ids (int8[]). Returns as
/// [`RESUME_EACH`].
pub const HOLD: &str =
    "SELECT r.workqueue_id, r.status::text, r.changed FROM pepsi.workqueue_hold($1::int8[]) r";

/// `pepsi-queue release`: `pepsi.workqueue_release`. $1 ids (int8[]). Returns as
/// [`RESUME_EACH`].
pub const RELEASE: &str =
    "SELECT r.workqueue_id, r.status::text, r.changed FROM pepsi.workqueue_release($1::int8[]) r";

/// `pepsi-queue delete`: `pepsi.workqueue_delete`. $1 ids (int8[]). Returns as
/// [`RESUME_EACH`].
pub const DELETE_MESSAGES: &str =
    "SELECT r.workqueue_id, r.status::text, r.changed FROM pepsi.workqueue_delete($1::int8[]) r";

/// `pepsi-queue requeue`: `pepsi.workqueue_requeue`. $1 ids (int8[]), $2 the stage
/// (text). Returns as [`RESUME_EACH`].
pub const REQUEUE_TO: &str = "SELECT r.workqueue_id, r.status::text, r.changed \
       FROM pepsi.workqueue_requeue($1::int8[], $2::text) r";

/// `pepsi-queue config set|unset`, first statement of its transaction: writers of the
/// overlay wait for each other, so each checks the graph the other's change left (two
/// changes each valid alone cannot together break it); readers (the dispatcher's
/// reload) are not blocked. No parameters.
pub const LOCK_CONFIG_OVERRIDE: &str =
    "LOCK TABLE pepsi.config_override IN SHARE ROW EXCLUSIVE MODE";

/// `pepsi-queue config set`: writes one overlay row. $1 section, $2 key, $3 value.
pub const SET_CONFIG_OVERRIDE: &str = "INSERT INTO pepsi.config_override (section, key, value) \
     VALUES ($1, $2, $3) ON CONFLICT (section, key) DO UPDATE SET value = EXCLUDED.value";

/// `pepsi-queue config unset`: removes one overlay row. $1 section, $2 key.
pub const UNSET_CONFIG_OVERRIDE: &str =
    "DELETE FROM pepsi.config_override WHERE section = $1 AND key = $2";
