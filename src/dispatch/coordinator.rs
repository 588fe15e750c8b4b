//! The coordinator thread: owns the claiming connection and, on it, the session-level
//! advisory lock that makes this the only dispatcher of the database. It performs every
//! queue write of the dispatcher, serially, in the order the loop asks: claims, the
//! paused-row flip, requeues, strikes, deferrals and the shutdown reset.
//!
//! If its connection breaks, the lock is gone with it: it tells the loop (which stops
//! claiming and kills every worker at once), then reconnects for as long as the
//! database is away (§6 "Outage") and re-takes the lock; only another dispatcher
//! keeping the lock for about ten seconds, or a schema that no longer matches, is
//! fatal. Every queue write is one statement sent in one round trip (`query_typed`: no
//! separate prepare; the claim, sent most often, is prepared once per session and then
//! neither parsed nor planned again), guarded by the claim's token, on a
//! session whose `lock_timeout` and `statement_timeout` bound every wait (§8.2). Queue
//! writes run through the transient-error retry helper; a write that fails otherwise
//! (a lock timeout included) is tried again with backoff, so no row is left running by
//! a passing error while the dispatcher lives.
//!
//! Started by `run` (the module's root); the loop's handlers send it [`Command`]s and it
//! answers with events. It reads and writes no state of the loop: everything it needs
//! comes in the command (a claim's request, the claims to write), and what a claim
//! asked of each stage stays with the loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::db::Client;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use postgres::types::Type;

use super::claim::{Claim, StrikeKind};
use super::events::{Event, EventSender};
use super::floors::Starts;
use super::scheduler::ClaimRequest;
use super::session::{self, LOCK_RETRY, LOCK_WAIT, OUTAGE_MAX, Refused, Target};
use super::statements;
use crate::db::pool::{Connection, Pool};
use crate::db::reconnect::Reconnect;
use crate::db::{self, ErrorKind, sql};
use crate::exit::Failure;
use crate::logging::Every;
use crate::protocol;

/// How many reconciles may fail in a row before the dispatcher gives up (claims wait
/// for one to succeed).
const RECONCILE_ATTEMPTS: u32 = 5;
/// How long a deferral (§8.4) is retried when the dispatcher cannot write it either.
const DEFER_RETRY: Duration = Duration::from_secs(30);
/// A failed write is retried after this, doubling up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// Test hook: the coordinator thread panics at this claim command (counted from 1), so
/// the tests can see the dispatcher shut down with exit 70 when a helper thread dies.
pub const FAULT_PANIC_ENV: &str = "PEPSI_FAULT_COORDINATOR_PANIC";

/// A request to the coordinator.
#[derive(Clone, Debug)]
pub enum Command {
    /// Claim as the policy asks, each stage's pick from its floor (`floors.rs`).
    Claim(ClaimRequest, Starts),
    /// Flip due paused rows to pending.
    FlipPaused,
    /// Put claimed rows back to pending.
    Requeue(Vec<Claim>),
    /// Record a strike.
    Strike {
        /// The claim.
        claim: Claim,
        /// Why.
        kind: StrikeKind,
        /// The reason for `state.last_error`.
        error: String,
    },
    /// Pause a row for 30 seconds (its worker lost the database).
    Defer(Claim),
    /// Put rows deferred earlier back to pending, now that the session works.
    Resume(Vec<Claim>),
    /// Terminate the database sessions of these killed workers (by the session names
    /// the dispatcher gave them), so a statement a killed worker left running holds no
    /// lock (§8.2).
    TerminateSessions(Vec<String>),
    /// Check the connection (and with it the lock) now: the LISTEN session was lost,
    /// so the database may have restarted while the coordinator was idle.
    Check,
    /// After the lock was lost and taken again: reset running rows this dispatcher
    /// does not hold (a claim that committed but whose answer was lost). Only the
    /// answer to the latest re-take counts; an older one is dropped.
    Reconcile { held: Vec<i64>, generation: u64 },
    /// Shutdown: reset every running row to pending, then stop.
    Reset,
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Claim(..) => "claim",
            Command::FlipPaused => "paused-row flip",
            Command::Requeue(_) => "requeue",
            Command::Strike { .. } => "strike",
            Command::Defer(_) => "deferral",
            Command::Resume(_) => "early resume",
            Command::TerminateSessions(_) => "worker session termination",
            Command::Check => "connection check",
            Command::Reconcile { .. } => "reconcile",
            Command::Reset => "shutdown reset",
        }
    }
}

/// What the coordinator thread is started with.
pub struct Parts {
    /// The locked session from start-up.
    pub client: Client,
    /// Where and how to reconnect.
    pub target: Target,
    /// The dispatcher's pool, whose connections are forgotten when the session is
    /// lost (they went to the same server).
    pub pool: Pool,
    /// Commands from the loop.
    pub commands: Receiver<Command>,
    /// Events to the loop.
    pub events: EventSender,
    /// `[pepsi-dispatch] MAX_HOPS`: claims fail rows whose hops pass it.
    pub max_hops: u32,
    /// Set by the loop when it shuts down: a reconnect gives up at once.
    pub stopping: Arc<AtomicBool>,
}

/// Starts the coordinator thread. A panic in it is reported to the loop, which shuts
/// down with exit 70. Whenever it ends without having run the shutdown reset it says
/// so ([`Event::ResetDone`] with an error), so a shutdown never waits for it in vain.
pub fn spawn(parts: Parts) -> std::io::Result<()> {
    let Parts {
        client,
        target,
        pool,
        commands,
        events,
        max_hops,
        stopping,
    } = parts;
    let fault_panic_at = std::env::var(FAULT_PANIC_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    super::events::spawn_watched("coordinator", events.clone(), move || {
        let last_words = events.clone();
        let mut client = client;
        let pid = session::backend_pid(&mut client);
        let reset = Coordinator {
            client: Some(Connection::new(client)),
            pid,
            lost_pid: None,
            target,
            pool,
            events,
            retries: Vec::new(),
            reconcile_due: false,
            reconcile_failures: 0,
            generation: 0,
            claims_seen: 0,
            fault_panic_at,
            max_hops: i32::try_from(max_hops).unwrap_or(i32::MAX),
            stopping,
        }
        .run(&commands);
        if !reset {
            last_words.send(Event::ResetDone(Err("the coordinator has stopped".into())));
        }
    })
}

/// A write that failed and is tried again.
struct Retry {
    command: Command,
    next: Instant,
    backoff: Duration,
    /// Deferrals give up after half a minute (the row stays running for the next
    /// start); other writes are retried as long as the dispatcher lives.
    give_up: Option<Instant>,
}

struct Coordinator {
    /// The locked session, with the claim statement prepared on it once used.
    client: Option<Connection>,
    /// Its server process id.
    pid: Option<i32>,
    /// The server process of the session lost last: when the watchdog abandoned it
    /// (its server did not answer), it may still hold the lock on a server that
    /// answers again, and is terminated rather than taken for another dispatcher.
    lost_pid: Option<i32>,
    target: Target,
    pool: Pool,
    events: EventSender,
    retries: Vec<Retry>,
    /// The lock was re-taken: claims wait for the loop's reconcile, or the reset of
    /// rows it does not hold would also reset rows this claim hands to workers.
    reconcile_due: bool,
    /// How often the lock was re-taken.
    generation: u64,
    /// Reconciles that failed in a row.
    reconcile_failures: u32,
    /// Claim commands received.
    claims_seen: u64,
    /// The claim command at which the test hook panics.
    fault_panic_at: Option<u64>,
    /// MAX_HOPS.
    max_hops: i32,
    /// The loop is shutting down.
    stopping: Arc<AtomicBool>,
}

impl Coordinator {
    /// Runs commands until the shutdown reset (true) or until it cannot go on (false).
    fn run(mut self, commands: &Receiver<Command>) -> bool {
        loop {
            let wait = self
                .retries
                .iter()
                .map(|r| r.next.saturating_duration_since(Instant::now()))
                .min()
                .unwrap_or(Duration::from_secs(1))
                .min(Duration::from_secs(1));
            match commands.recv_timeout(wait) {
                Ok(command) => {
                    let shutdown = matches!(command, Command::Reset);
                    if !self.handle(command) {
                        return false;
                    }
                    if shutdown {
                        return true;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
            if !self.run_retries() {
                return false;
            }
        }
    }

    /// Runs a command until it is done, answered as failed, or queued for a retry.
    /// False when the coordinator cannot go on (the loop was told).
    fn handle(&mut self, command: Command) -> bool {
        if let Command::Claim(..) = command {
            self.claims_seen += 1;
            if self.fault_panic_at == Some(self.claims_seen) {
                panic!(
                    "{FAULT_PANIC_ENV}: injected fault at claim {}",
                    self.claims_seen
                );
            }
        }
        loop {
            if self.client.is_none() && !self.reconnect() {
                if let Command::Reset = command {
                    self.events
                        .send(Event::ResetDone(Err("no database connection".into())));
                }
                return false;
            }
            match &command {
                Command::Claim(..) if self.reconcile_due => {
                    log::debug!("coordinator: no claim until the reconcile after the reconnect");
                    self.events.send(Event::ClaimFailed);
                    return true;
                }
                Command::Reconcile { generation, .. }
                    if !self.reconcile_due || *generation != self.generation =>
                {
                    log::debug!("coordinator: dropping a reconcile for an earlier reconnect");
                    return true;
                }
                Command::Reconcile { .. } => self.settle_retries(),
                _ => {}
            }
            if self.client.is_none() {
                continue;
            }
            let Err(e) = self.execute(&command) else {
                if matches!(command, Command::Reconcile { .. }) {
                    self.reconcile_due = false;
                    self.reconcile_failures = 0;
                }
                return true;
            };
            let connection = db::classify(&e) == ErrorKind::Connection;
            if connection {
                log::warn!(
                    "coordinator: database connection lost: {}",
                    db::describe(&e)
                );
                self.client = None;
            } else {
                log::error!(
                    "coordinator: {} failed: {}",
                    command.name(),
                    db::describe(&e)
                );
            }
            match command {
                // The loop asks again when it can.
                Command::Claim(..) => {
                    self.events.send(Event::ClaimFailed);
                    return true;
                }
                Command::FlipPaused => {
                    self.events.send(Event::FlipFailed);
                    return true;
                }
                Command::Reset => {
                    self.events.send(Event::ResetDone(Err(db::describe(&e))));
                    return true;
                }
                // Best effort: a session that cannot be terminated now ends with its
                // statement, and the claim token keeps its write from landing.
                Command::TerminateSessions(_) if !connection => return true,
                // Not kept for a retry: a reconcile must run before any claim and after
                // every other waiting write. A new session asks the loop for a new one.
                Command::Reconcile { .. } => {
                    self.reconcile_failures += 1;
                    if self.reconcile_failures >= RECONCILE_ATTEMPTS {
                        self.events.send(Event::Fatal(Failure::general(format!(
                            "cannot reset the rows of a lost claim after {RECONCILE_ATTEMPTS} attempts ({}); shutting down so the next start resets them",
                            db::describe(&e)
                        ))));
                        return false;
                    }
                    if !connection {
                        self.client = None;
                        std::thread::sleep(LOCK_RETRY);
                    }
                    continue;
                }
                // A broken connection: run it again on the new one.
                _ if connection => continue,
                other => {
                    let give_up =
                        matches!(other, Command::Defer(_)).then(|| Instant::now() + DEFER_RETRY);
                    self.retries.push(Retry {
                        command: other,
                        next: Instant::now() + RETRY_FIRST,
                        backoff: RETRY_FIRST,
                        give_up,
                    });
                    return true;
                }
            }
        }
    }

    /// Before a reconcile: tries every waiting write once, due or not, and drops those
    /// that fail. A write left for later could otherwise requeue or strike a row the
    /// reconcile resets and a later claim hands to a worker; the reconcile puts the rows
    /// of dropped writes back to pending.
    fn settle_retries(&mut self) {
        for retry in std::mem::take(&mut self.retries) {
            let result = match self.client {
                Some(_) => self.execute(&retry.command).map_err(|e| {
                    if db::classify(&e) == ErrorKind::Connection {
                        self.client = None;
                    }
                    db::describe(&e)
                }),
                None => Err("no database connection".to_string()),
            };
            if let Err(e) = result {
                log::warn!(
                    "coordinator: dropping {} ({e}); the reconcile resets its row",
                    retry.command.name()
                );
            }
        }
    }

    /// Runs the writes that failed before and are due again.
    fn run_retries(&mut self) -> bool {
        let now = Instant::now();
        let (due, later): (Vec<Retry>, Vec<Retry>) = std::mem::take(&mut self.retries)
            .into_iter()
            .partition(|r| r.next <= now);
        self.retries = later;
        for mut retry in due {
            if self.client.is_none() && !self.reconnect() {
                return false;
            }
            match self.execute(&retry.command) {
                Ok(()) => log::info!("coordinator: {} succeeded on a retry", retry.command.name()),
                Err(e) => {
                    if db::classify(&e) == ErrorKind::Connection {
                        self.client = None;
                    }
                    if retry.give_up.is_some_and(|t| t <= now) {
                        log::warn!(
                            "coordinator: giving up on {} ({}); the row stays running until the next start resets it",
                            retry.command.name(),
                            db::describe(&e)
                        );
                        continue;
                    }
                    log::warn!(
                        "coordinator: {} failed again: {}",
                        retry.command.name(),
                        db::describe(&e)
                    );
                    retry.backoff = (retry.backoff * 2).min(RETRY_MAX);
                    retry.next = now + retry.backoff;
                    self.retries.push(retry);
                }
            }
        }
        true
    }

    /// Reconnects and re-takes the lock, for as long as the database is away (every
    /// 250 ms for ten seconds, then waits doubling up to half a minute; one log line a
    /// minute at most). False when it cannot go on: the loop is shutting down, another
    /// dispatcher kept the lock for [`LOCK_WAIT`], or the schema no longer matches
    /// (the loop has been told).
    fn reconnect(&mut self) -> bool {
        self.events.send(Event::LockLost);
        self.pool.forget_connections();
        if let Some(pid) = self.pid.take() {
            self.lost_pid = Some(pid);
        }
        let mut waits = Reconnect::new(OUTAGE_MAX);
        let mut said = Every::minute();
        let mut held_elsewhere_since: Option<Instant> = None;
        loop {
            if self.stopping.load(Ordering::Relaxed) {
                return false;
            }
            let why = match session::connect_checked(&self.target) {
                Ok(mut client) => match session::try_lock(&mut client) {
                    Ok(true) => {
                        log::warn!(
                            "database connection re-established after {:.1}s; the dispatcher lock is held again",
                            waits.outage().as_secs_f64()
                        );
                        // Connections the pool made while the session was away may
                        // have gone to a server that is no longer the primary.
                        self.pool.forget_connections();
                        self.pid = session::backend_pid(&mut client);
                        self.lost_pid = None;
                        self.client = Some(Connection::new(client));
                        self.reconcile_due = true;
                        self.generation += 1;
                        self.events.send(Event::LockRegained(self.generation));
                        return true;
                    }
                    Ok(false) => {
                        // Our own lost session, still alive on the server: it goes, and
                        // the lock with it.
                        let holder = session::holder_pid(&mut client);
                        if let (Some(lost), Some(holder)) = (self.lost_pid, holder) {
                            if lost == holder {
                                if session::terminate_own(&mut client, lost) {
                                    log::warn!(
                                        "the dispatcher lock is still held by this dispatcher's lost session (server process {lost}); terminated it"
                                    );
                                }
                                held_elsewhere_since = None;
                                std::thread::sleep(LOCK_RETRY);
                                continue;
                            }
                        }
                        let since = *held_elsewhere_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= LOCK_WAIT {
                            self.events
                                .send(Event::Fatal(session::held_elsewhere(&mut client)));
                            return false;
                        }
                        std::thread::sleep(LOCK_RETRY);
                        continue;
                    }
                    Err(e) => db::describe(&e),
                },
                Err(Refused::Away(why)) => why,
                Err(Refused::Fatal(failure)) => {
                    self.events.send(Event::Fatal(failure));
                    return false;
                }
            };
            held_elsewhere_since = None;
            if said.due() {
                log::warn!(
                    "the database connection is lost ({why}); not claiming, trying again every {}s at most (said once a minute)",
                    OUTAGE_MAX.as_secs()
                );
            }
            self.sleep(waits.after_failure());
        }
    }

    /// Sleeps, waking early when the loop starts shutting down.
    fn sleep(&self, total: Duration) {
        let deadline = Instant::now() + total;
        while !self.stopping.load(Ordering::Relaxed) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }

    fn execute(&mut self, command: &Command) -> Result<(), postgres::Error> {
        let client = self.client.as_mut().expect("connected");
        match command {
            Command::Claim(request, starts) => {
                let event = statements::claim(client, request, starts, self.max_hops)?;
                self.events.send(event);
            }
            Command::FlipPaused => {
                let row = db::retry_transient(|| client.query_typed_one(sql::FLIP_PAUSED, &[]))?;
                let count: i64 = row.get(0);
                if count > 0 {
                    log::debug!("{count} paused rows are due: back to pending");
                }
                self.events.send(Event::Flipped {
                    count,
                    next_paused: row.get(1),
                });
            }
            Command::Requeue(claims) => {
                let done = statements::write_claims(client, sql::REQUEUE, claims)?;
                if done.len() < claims.len() {
                    log::warn!(
                        "{} of {} rows to requeue were no longer running under their claim; left as they are",
                        claims.len() - done.len(),
                        claims.len()
                    );
                }
            }
            Command::Strike { claim, kind, error } => {
                let (id, stage) = (claim.id, &claim.stage);
                let row = db::retry_transient(|| {
                    client.query_typed_opt(
                        sql::STRIKE,
                        &[
                            (&id, Type::INT8),
                            (stage, Type::TEXT),
                            (&kind.class(), Type::TEXT),
                            (error, Type::TEXT),
                            (&claim.token, Type::INT8),
                        ],
                    )
                })?;
                match row {
                    None => log::warn!(
                        "{stage}: message {id} was no longer running there under its claim; no strike recorded"
                    ),
                    Some(row) => {
                        let strikes: i32 = row.get(0);
                        let status: String = row.get(1);
                        match row.get::<_, Option<f64>>(2) {
                            Some(due) => {
                                log::warn!(
                                    "{stage}: message {id}: strike {strikes} ({}): {error}; retry in {} min",
                                    kind.class(),
                                    strikes
                                );
                                self.events.send(Event::Paused(due));
                            }
                            None => log::warn!(
                                "{stage}: message {id}: strike {strikes} ({}): {error}; now {status}",
                                kind.class()
                            ),
                        }
                    }
                }
            }
            Command::Defer(claim) => {
                let (id, stage) = (claim.id, &claim.stage);
                match db::retry_transient(|| {
                    client.query_typed_opt(
                        sql::DEFER,
                        &[
                            (&id, Type::INT8),
                            (stage, Type::TEXT),
                            (&claim.token, Type::INT8),
                        ],
                    )
                })? {
                    Some(row) => {
                        log::warn!(
                            "{stage}: message {id}: its worker lost the database connection; deferred for 30s"
                        );
                        self.events.send(Event::Paused(row.get(0)));
                    }
                    None => log::warn!(
                        "{stage}: message {id} was no longer running there under its claim; not deferred"
                    ),
                }
            }
            Command::Resume(claims) => {
                let done = statements::write_claims(client, sql::RESUME_DEFERRED, claims)?;
                if !done.is_empty() {
                    log::info!(
                        "{} messages deferred for a lost database connection back to pending early",
                        done.len()
                    );
                }
                self.events.send(Event::Resumed(done.len() as u64));
            }
            Command::TerminateSessions(names) => {
                let patterns: Vec<String> =
                    names.iter().map(|n| protocol::session_pattern(n)).collect();
                let t = session::terminate(client, &patterns)?;
                if t.terminated > 0 {
                    log::info!(
                        "terminated {} database sessions of killed workers {names:?}",
                        t.terminated
                    );
                }
                t.warn_refused();
            }
            Command::Check => {
                client.simple_query("")?;
            }
            Command::Reconcile { held, .. } => {
                let n = db::retry_transient(|| {
                    client.query_typed(sql::RESET_RUNNING_EXCEPT, &[(held, Type::INT8_ARRAY)])
                })?
                .len();
                if n > 0 {
                    log::warn!(
                        "{n} running rows this dispatcher does not hold (a claim whose answer was lost) back to pending"
                    );
                    self.events
                        .send(Event::Notify(sql::CHANNEL_WORKQUEUE.to_string()));
                }
            }
            Command::Reset => {
                let n = db::retry_transient(|| client.execute_typed(sql::RESET_RUNNING, &[]))?;
                self.events.send(Event::ResetDone(Ok(n)));
            }
        }
        Ok(())
    }
}
