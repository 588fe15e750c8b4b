//! The dispatcher's own database session (§6 start-up, "Outage"): connecting it with
//! its settings, the session-level advisory lock that makes this the only dispatcher of
//! the database, naming the holder when another has it, terminating the sessions of
//! killed or orphaned workers, and the start-up steps in order — riding out a database
//! that is away for as long as it takes.
//!
//! Called by `run` (the module's root) at start; the coordinator thread owns the
//! session once the loop runs, and uses these functions to take the session and the
//! lock back after a loss; shutdown uses [`reset_alone`] when the coordinator died. No
//! state of its own, none of the loop's.

use std::time::{Duration, Instant};

use crate::db::Client;
use postgres::types::Type;

use crate::config::graph::OverrideRow;
use crate::config::{Config, DbRole};
use crate::db::reconnect::Reconnect;
use crate::db::{self, ConnectError, ErrorKind, schema, sql};
use crate::durability::SynchronousCommit;
use crate::exit::Failure;
use crate::logging::Every;
use crate::protocol;

/// How long the lock is tried while another session holds it.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
/// How often the lock is tried within that time.
pub const LOCK_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between attempts while the database is away (the first ten
/// seconds of an outage are tried every 250 ms, [`Reconnect`]).
pub const OUTAGE_MAX: Duration = Duration::from_secs(30);

/// Where and how the dispatcher's session connects.
#[derive(Clone, Debug)]
pub struct Target {
    /// `[pepsi-postgres] DISPATCH_CONNECTION` or `CONNECTION`.
    pub conninfo: String,
    /// `[pepsi-dispatch] SYNCHRONOUS_COMMIT`.
    pub durability: SynchronousCommit,
}

impl Target {
    /// The dispatcher's, from its configuration.
    pub fn of(config: &Config) -> Target {
        Target {
            conninfo: config.postgres.connection_for(DbRole::Dispatch).to_string(),
            durability: config.dispatch.synchronous_commit,
        }
    }
}
/// How often the start-up reset is tried when a row lock holds it up.
const RESET_ATTEMPTS: u32 = 10;

/// The session's settings. By default (`[pepsi-dispatch] SYNCHRONOUS_COMMIT = off`)
/// its writes commit without waiting for the WAL flush, like the workers' (§12.1): a
/// claim, requeue or strike lost with a database crash leaves its rows `running` or
/// `pending`, and the reset at the next lock re-take or start puts them back; a claim
/// is on every hop's path, and a flush there would add a disk sync to every hop's
/// latency. Its lock and statement timeouts bound how long one row can stall the
/// serial queue writes.
pub fn connect(target: &Target) -> Result<Client, ConnectError> {
    let mut config =
        db::connection_config(&target.conninfo, "pepsi-dispatch").map_err(|e| ConnectError {
            kind: ErrorKind::Other,
            message: format!(
                "[pepsi-postgres] DISPATCH_CONNECTION (or CONNECTION): {}",
                db::describe(&e)
            ),
        })?;
    db::append_options(&mut config, target.durability.option());
    db::append_options(&mut config, sql::COORDINATOR_TIMEOUTS_OPTION);
    db::open(&config)
}

/// Tries the lock once.
pub fn try_lock(client: &mut Client) -> Result<bool, postgres::Error> {
    Ok(client
        .query_typed_one(
            sql::TRY_DISPATCH_LOCK,
            &[(&sql::DISPATCH_LOCK_KEY, Type::INT8)],
        )?
        .get(0))
}

/// Tries the lock for up to [`LOCK_WAIT`].
fn take_lock(client: &mut Client) -> Result<bool, postgres::Error> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        if try_lock(client)? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(LOCK_RETRY);
    }
}

/// The session's own server process id, or `None` when it cannot be read.
pub fn backend_pid(client: &mut Client) -> Option<i32> {
    client
        .query_typed_one(sql::BACKEND_PID, &[])
        .ok()
        .map(|r| r.get(0))
}

/// The pid of the session that holds the dispatcher lock, when one does.
pub fn holder_pid(client: &mut Client) -> Option<i32> {
    client
        .query_typed_opt(
            sql::DISPATCH_LOCK_HOLDER,
            &[(&sql::DISPATCH_LOCK_KEY, Type::INT8)],
        )
        .ok()
        .flatten()
        .map(|r| r.get(0))
}

/// Terminates `pid`, a session of this dispatcher the watchdog abandoned, when it
/// still exists; whether it was signalled.
pub fn terminate_own(client: &mut Client, pid: i32) -> bool {
    client
        .query_typed_one(sql::TERMINATE_OWN_SESSION, &[(&pid, Type::INT4)])
        .is_ok_and(|r| r.get(0))
}

/// Who holds the dispatcher lock, in words ("pid 4242 (role pepsi) on host mx1,
/// application_name "pepsi-dispatch", connected since …"), when it can be found. The
/// host and the start of a session of another role are hidden from this one unless it
/// is a member of that role or of `pg_read_all_stats`; the message then says so.
pub fn lock_holder(client: &mut Client) -> String {
    let row = client.query_typed_opt(
        sql::DISPATCH_LOCK_HOLDER,
        &[(&sql::DISPATCH_LOCK_KEY, Type::INT8)],
    );
    match row {
        Ok(Some(r)) => {
            let pid: i32 = r.get(0);
            let role: Option<String> = r.get(1);
            let role = role.unwrap_or_else(|| "?".into());
            let application: Option<String> = r.get(2);
            let application = application.unwrap_or_default();
            match (r.get::<_, Option<String>>(3), r.get::<_, Option<String>>(4)) {
                (Some(from), Some(since)) => format!(
                    "pid {pid} (role {role}) on {from}, application_name {application:?}, connected since {since}"
                ),
                _ => format!(
                    "pid {pid} (role {role}), application_name {application:?} (its host and start time are visible only to members of role {role} or of pg_read_all_stats)"
                ),
            }
        }
        Ok(None) => "a session that has just released it".into(),
        Err(e) => format!("a session that cannot be named ({})", db::describe(&e)),
    }
}

/// The refusal when another dispatcher keeps the lock.
pub fn held_elsewhere(client: &mut Client) -> Failure {
    Failure::general(format!(
        "another pepsi-dispatch holds the dispatcher lock of this database (advisory lock {}): {}; it did not release it within {}s, refusing to run",
        sql::DISPATCH_LOCK_KEY,
        lock_holder(client),
        LOCK_WAIT.as_secs()
    ))
}

/// How many worker sessions a termination ended, and how many it was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terminated {
    /// Sessions terminated.
    pub terminated: i64,
    /// Sessions the owner of `pepsi.terminate_worker_sessions` may not signal.
    pub refused: i64,
}

impl Terminated {
    /// The warning for refused sessions, when there were any: they end with their
    /// statement, and the claim token keeps a stale write from landing, but the
    /// administrator should know the rights are missing.
    pub fn warn_refused(&self) {
        if self.refused > 0 {
            log::warn!(
                "{} worker sessions could not be terminated: the owner of pepsi.terminate_worker_sessions may not signal them (make it a member of pg_signal_backend or of the workers' login roles; see doc/roles-and-containment.md, \"Database roles\")",
                self.refused
            );
        }
    }
}

/// Terminates the worker sessions matching these `LIKE` patterns.
pub fn terminate(client: &mut Client, patterns: &[String]) -> Result<Terminated, postgres::Error> {
    let row = client.query_typed_one(
        sql::TERMINATE_WORKER_SESSIONS,
        &[(&patterns, Type::TEXT_ARRAY)],
    )?;
    Ok(Terminated {
        terminated: row.get(0),
        refused: row.get(1),
    })
}

/// Why one attempt at taking the session failed.
pub enum Refused {
    /// The database is away (or refused for overload): wait and try again.
    Away(String),
    /// Something that waiting does not fix: stop with this failure.
    Fatal(Failure),
}

impl Refused {
    fn from_db(what: &str, e: &postgres::Error) -> Refused {
        match db::classify(e) {
            ErrorKind::Connection | ErrorKind::Overload => {
                Refused::Away(format!("{what}: {}", db::describe(e)))
            }
            _ => Refused::Fatal(Failure::general(format!("{what}: {}", db::describe(e)))),
        }
    }

    fn from_connect(e: ConnectError) -> Refused {
        match e.kind {
            ErrorKind::Connection | ErrorKind::Overload => Refused::Away(e.message),
            _ => Refused::Fatal(Failure::general(e.message)),
        }
    }
}

/// Connects and checks the schema: a mismatch is fatal (exit 78), an unreachable
/// database is not.
pub fn connect_checked(target: &Target) -> Result<Client, Refused> {
    let mut client = connect(target).map_err(Refused::from_connect)?;
    match schema::check(&mut client) {
        Ok(()) => Ok(client),
        Err(schema::SchemaError::Mismatch(m)) => {
            Err(Refused::Fatal(Failure::config(m.to_string())))
        }
        Err(schema::SchemaError::Db(e)) => Err(Refused::from_db("cannot check the schema", &e)),
    }
}

/// The start-up steps of §6, once: connect, check the schema, take the lock (for about
/// ten seconds), terminate the sessions earlier workers left, reset their orphaned
/// running rows, release paused rows stored without a retry time, read the overlay.
fn start_once(target: &Target) -> Result<(Client, Vec<OverrideRow>), Refused> {
    let mut client = connect_checked(target)?;
    let locked = take_lock(&mut client)
        .map_err(|e| Refused::from_db("cannot take the dispatcher lock", &e))?;
    if !locked {
        return Err(Refused::Fatal(held_elsewhere(&mut client)));
    }
    // Statements the previous dispatcher's workers left running would hold locks on
    // the rows about to be reset.
    let all = [protocol::ANY_WORKER_SESSION.to_string()];
    match terminate(&mut client, &all) {
        Ok(t) => {
            if t.terminated > 0 {
                log::warn!(
                    "terminated {} database sessions left by earlier workers",
                    t.terminated
                );
            }
            t.warn_refused();
        }
        Err(e) if db::classify(&e) == ErrorKind::Connection => {
            return Err(Refused::from_db(
                "cannot terminate earlier workers' sessions",
                &e,
            ));
        }
        Err(e) => log::warn!(
            "cannot terminate the sessions of earlier workers: {}",
            db::describe(&e)
        ),
    }
    let mut attempt = 0;
    let reset = loop {
        attempt += 1;
        match db::retry_transient(|| client.execute_typed(sql::RESET_RUNNING, &[])) {
            Ok(n) => break n,
            // A row lock held elsewhere: the lock timeout ended the wait; try again.
            Err(e) if attempt < RESET_ATTEMPTS && db::classify(&e) == ErrorKind::Other => {
                log::warn!(
                    "cannot reset orphaned rows yet ({}); retrying",
                    db::describe(&e)
                );
                std::thread::sleep(LOCK_RETRY);
            }
            Err(e) => return Err(Refused::from_db("cannot reset orphaned rows", &e)),
        }
    };
    if reset > 0 {
        log::warn!("reset {reset} running rows left by a previous dispatcher to pending");
    }
    match client.execute_typed(sql::RELEASE_UNTIMED_PAUSED, &[]) {
        Ok(0) => {}
        Ok(n) => log::warn!("{n} paused rows had no retry time; they are due now"),
        Err(e) => return Err(Refused::from_db("cannot release paused rows", &e)),
    }
    let overlay = db::read_overlay(&mut client)
        .map_err(|e| Refused::from_db("cannot read pepsi.config_override", &e))?;
    Ok((client, overlay))
}

/// Start-up: the steps of [`start_once`], again and again while the database is away
/// (every 250 ms for ten seconds, then waits doubling up to [`OUTAGE_MAX`]; one log
/// line a minute at most). `wait` sleeps for up to the given time and returns true
/// when a shutdown was asked for meanwhile; then `Ok(None)`.
pub fn start(
    target: &Target,
    mut wait: impl FnMut(Duration) -> bool,
) -> Result<Option<(Client, Vec<OverrideRow>)>, Failure> {
    let mut waits = Reconnect::new(OUTAGE_MAX);
    let mut said = Every::minute();
    loop {
        match start_once(target) {
            Ok(session) => return Ok(Some(session)),
            Err(Refused::Fatal(failure)) => return Err(failure),
            Err(Refused::Away(why)) => {
                if said.due() {
                    log::warn!(
                        "the database is not available ({why}); waiting for it, trying again every {}s at most (said once a minute)",
                        OUTAGE_MAX.as_secs()
                    );
                }
                if wait(waits.after_failure()) {
                    return Ok(None);
                }
            }
        }
    }
}

/// The shutdown reset without the coordinator (its thread died, and its connection and
/// the lock with it): takes the lock on a connection of its own, then puts every
/// running row back to pending. Refuses when another dispatcher took the lock
/// meanwhile: the rows are then that one's. Returns how many rows it reset.
pub fn reset_alone(target: &Target) -> Result<u64, String> {
    let mut client = connect(target).map_err(|e| e.message)?;
    if !take_lock(&mut client).map_err(|e| db::describe(&e))? {
        return Err(format!(
            "another dispatcher holds the lock now ({})",
            lock_holder(&mut client)
        ));
    }
    db::retry_transient(|| client.execute_typed(sql::RESET_RUNNING, &[]))
        .map_err(|e| db::describe(&e))
}
