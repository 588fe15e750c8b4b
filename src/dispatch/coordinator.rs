//! The coordinator thread: owns the claiming connection and, on it, the session-level
//! advisory lock that makes this the only dispatcher of the database. It performs every
//! queue write of the dispatcher, serially, in the order the loop asks: claims, the
//! paused-row flip, requeues, strikes, deferrals and the shutdown reset.
//!
//! If its connection breaks, the lock is gone with it: it tells the loop (which stops
//! claiming at once), reconnects and re-takes the lock within ten seconds, or reports a
//! fatal error. Queue writes run through the transient-error retry helper.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use postgres::Client;
use postgres::types::Type;

use super::events::{ClaimedRow, Event, EventSender};
use crate::db::{self, ErrorKind, schema, sql};
use crate::exit::Failure;

/// How long the lock may be retried at start-up and after a lost connection.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
/// How often the lock is retried within that time.
const LOCK_RETRY: Duration = Duration::from_millis(500);
/// How long a deferral (§8.4) is retried when the dispatcher cannot write it either.
const DEFER_RETRY: Duration = Duration::from_secs(30);

/// Why a row gets a strike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrikeKind {
    /// Its worker crashed (or spoke garbage) while it was at the front.
    Crashed,
    /// It was unanswered for MAX_RUNTIME at the front of its worker's queue.
    TimedOut,
}

impl StrikeKind {
    /// The `failure_class` a third strike records.
    pub fn class(self) -> &'static str {
        match self {
            StrikeKind::Crashed => "crashed",
            StrikeKind::TimedOut => "timed-out",
        }
    }
}

/// A request to the coordinator.
#[derive(Debug)]
pub enum Command {
    /// Claim up to these capacities, per stage.
    Claim(Vec<(String, i32)>),
    /// Flip due paused rows to pending.
    FlipPaused,
    /// Put claimed rows back to pending: (id, claimed stage).
    Requeue(Vec<(i64, String)>),
    /// Record a strike.
    Strike {
        /// The row.
        id: i64,
        /// Its claimed stage.
        stage: String,
        /// Why.
        kind: StrikeKind,
        /// The reason for `state.last_error`.
        error: String,
    },
    /// Pause a row for 30 seconds (its worker lost the database).
    Defer {
        /// The row.
        id: i64,
        /// Its claimed stage.
        stage: String,
    },
    /// Shutdown: reset every running row to pending, then stop.
    Reset,
}

/// Connects, checks the schema, takes the lock (retrying for about ten seconds) and
/// resets orphaned running rows. The start-up steps of §6, in order.
pub fn start(conninfo: &str) -> Result<Client, Failure> {
    let mut client = db::connect(conninfo, "pepsi-dispatch").map_err(|e| {
        Failure::general(format!(
            "cannot connect to the database: {}",
            db::describe(&e)
        ))
    })?;
    match schema::check(&mut client) {
        Ok(()) => {}
        Err(schema::SchemaError::Mismatch(m)) => return Err(Failure::config(m.to_string())),
        Err(e) => return Err(Failure::general(e.to_string())),
    }
    if !take_lock(&mut client).map_err(|e| {
        Failure::general(format!(
            "cannot take the dispatcher lock: {}",
            db::describe(&e)
        ))
    })? {
        return Err(Failure::general(format!(
            "another pepsi-dispatch holds the dispatcher lock of this database (advisory lock {}) and did not release it within {}s; refusing to run",
            sql::DISPATCH_LOCK_KEY,
            LOCK_WAIT.as_secs()
        )));
    }
    let reset = client.execute(sql::RESET_RUNNING, &[]).map_err(|e| {
        Failure::general(format!("cannot reset orphaned rows: {}", db::describe(&e)))
    })?;
    if reset > 0 {
        log::warn!("reset {reset} running rows left by a previous dispatcher to pending");
    }
    Ok(client)
}

/// Tries the lock for up to [`LOCK_WAIT`].
fn take_lock(client: &mut Client) -> Result<bool, postgres::Error> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        let got: bool = client
            .query_one(sql::TRY_DISPATCH_LOCK, &[&sql::DISPATCH_LOCK_KEY])?
            .get(0);
        if got {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(LOCK_RETRY);
    }
}

/// Starts the coordinator thread with an already locked client.
pub fn spawn(
    client: Client,
    conninfo: String,
    commands: Receiver<Command>,
    events: EventSender,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("coordinator".into())
        .spawn(move || {
            Coordinator {
                client: Some(client),
                conninfo,
                events,
                deferred: Vec::new(),
            }
            .run(&commands)
        })
        .map(|_| ())
}

struct Coordinator {
    client: Option<Client>,
    conninfo: String,
    events: EventSender,
    /// Deferrals that could not be written yet, with their give-up time.
    deferred: Vec<(i64, String, Instant)>,
}

/// The outcome of one command against the database.
enum Outcome {
    Done,
    /// The connection broke: retry the command after reconnecting.
    Reconnect,
}

impl Coordinator {
    fn run(mut self, commands: &Receiver<Command>) {
        loop {
            let command = match commands.recv_timeout(Duration::from_secs(1)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            self.retry_deferred();
            let Some(command) = command else { continue };
            let shutdown = matches!(command, Command::Reset);
            loop {
                if self.client.is_none() && !self.reconnect() {
                    return;
                }
                match self.execute(&command) {
                    Outcome::Done => break,
                    Outcome::Reconnect => {
                        self.client = None;
                        if shutdown || matches!(command, Command::Claim(_)) {
                            // A claim is asked again by the loop once the lock is back;
                            // a failed shutdown reset leaves the rows for the next start.
                            break;
                        }
                    }
                }
            }
            if shutdown {
                return;
            }
        }
    }

    /// Reconnects and re-takes the lock within [`LOCK_WAIT`]; false when it could not
    /// (the loop has been told to shut down).
    fn reconnect(&mut self) -> bool {
        self.events.send(Event::LockLost);
        let deadline = Instant::now() + LOCK_WAIT;
        let mut last = String::new();
        while Instant::now() < deadline {
            match db::connect(&self.conninfo, "pepsi-dispatch") {
                Ok(mut client) => {
                    match client.query_one(sql::TRY_DISPATCH_LOCK, &[&sql::DISPATCH_LOCK_KEY]) {
                        Ok(row) if row.get::<_, bool>(0) => {
                            log::warn!(
                                "database connection re-established; the dispatcher lock is held again"
                            );
                            self.client = Some(client);
                            self.events.send(Event::LockRegained);
                            return true;
                        }
                        Ok(_) => last = "another dispatcher holds the lock".into(),
                        Err(e) => last = db::describe(&e),
                    }
                }
                Err(e) => last = db::describe(&e),
            }
            std::thread::sleep(LOCK_RETRY);
        }
        self.events.send(Event::Fatal(Failure::general(format!(
            "lost the database connection and with it the dispatcher lock, and could not take it again within {}s ({last}); shutting down",
            LOCK_WAIT.as_secs()
        ))));
        false
    }

    fn execute(&mut self, command: &Command) -> Outcome {
        let client = self.client.as_mut().expect("connected");
        let result = match command {
            Command::Claim(asked) => claim(client, asked).map(|event| {
                self.events.send(event);
            }),
            Command::FlipPaused => db::retry_transient(|| client.query_one(sql::FLIP_PAUSED, &[])).map(|row| {
                let count: i64 = row.get(0);
                if count > 0 {
                    log::debug!("{count} paused rows are due: back to pending");
                }
                self.events.send(Event::Flipped {
                    count,
                    next_paused: row.get(1),
                });
            }),
            Command::Requeue(rows) => {
                let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                let stages: Vec<String> = rows.iter().map(|r| r.1.clone()).collect();
                db::retry_transient(|| {
                    client.query_typed(sql::REQUEUE, &[(&ids, Type::INT8_ARRAY), (&stages, Type::TEXT_ARRAY)])
                })
                .map(|done| {
                    if done.len() < rows.len() {
                        log::warn!(
                            "{} of {} rows to requeue were no longer running at their stage; left as they are",
                            rows.len() - done.len(),
                            rows.len()
                        );
                    }
                })
            }
            Command::Strike { id, stage, kind, error } => {
                db::retry_transient(|| client.query_opt(sql::STRIKE, &[id, stage, &kind.class(), error])).map(|row| {
                    match row {
                        None => log::warn!("{stage}: message {id} was no longer running there; no strike recorded"),
                        Some(row) => {
                            let strikes: i32 = row.get(0);
                            let status: String = row.get(1);
                            if status == "paused" {
                                log::warn!(
                                    "{stage}: message {id}: strike {strikes} ({}): {error}; retry in {} min",
                                    kind.class(),
                                    strikes
                                );
                                if let Some(due) = row.get::<_, Option<f64>>(2) {
                                    self.events.send(Event::Paused(due));
                                }
                            } else {
                                log::warn!(
                                    "{stage}: message {id}: strike {strikes} ({}): {error}; now {status}",
                                    kind.class()
                                );
                            }
                        }
                    }
                })
            }
            Command::Defer { id, stage } => match defer(client, *id, stage) {
                Ok(()) => Ok(()),
                Err(e) => {
                    if db::classify(&e) == ErrorKind::Connection {
                        self.deferred.push((*id, stage.clone(), Instant::now() + DEFER_RETRY));
                    }
                    Err(e)
                }
            },
            Command::Reset => {
                let result = db::retry_transient(|| client.execute(sql::RESET_RUNNING, &[]));
                self.events.send(Event::ResetDone(result.as_ref().map(|n| *n).map_err(db::describe)));
                result.map(|_| ())
            }
        };
        match result {
            Ok(()) => Outcome::Done,
            Err(e) => {
                let kind = db::classify(&e);
                if let Command::Claim(asked) = command {
                    self.events.send(Event::ClaimFailed {
                        asked: asked.clone(),
                    });
                }
                match kind {
                    ErrorKind::Connection => {
                        log::warn!(
                            "coordinator: database connection lost: {}",
                            db::describe(&e)
                        );
                        if matches!(command, Command::Defer { .. }) {
                            // Kept in `deferred` for its half minute; not retried here.
                            self.client = None;
                            return Outcome::Done;
                        }
                        Outcome::Reconnect
                    }
                    _ => {
                        log::error!("coordinator: {command:?} failed: {}", db::describe(&e));
                        Outcome::Done
                    }
                }
            }
        }
    }

    /// Retries deferrals that could not be written, for about half a minute each.
    fn retry_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        if self.client.is_none() && !self.reconnect() {
            return;
        }
        let now = Instant::now();
        let mut keep = Vec::new();
        for (id, stage, give_up) in std::mem::take(&mut self.deferred) {
            let client = match self.client.as_mut() {
                Some(c) => c,
                None => {
                    keep.push((id, stage, give_up));
                    continue;
                }
            };
            match defer(client, id, &stage) {
                Ok(()) => {}
                Err(e) if db::classify(&e) == ErrorKind::Connection && now < give_up => {
                    self.client = None;
                    keep.push((id, stage, give_up));
                }
                Err(e) => log::warn!(
                    "{stage}: message {id}: cannot pause it ({}); it stays running until the next start resets it",
                    db::describe(&e)
                ),
            }
        }
        self.deferred = keep;
    }
}

fn defer(client: &mut Client, id: i64, stage: &str) -> Result<(), postgres::Error> {
    match db::retry_transient(|| client.query_opt(sql::DEFER, &[&id, &stage]))? {
        Some(_) => {
            log::warn!(
                "{stage}: message {id}: its worker lost the database connection; deferred for 30s"
            );
            Ok(())
        }
        None => {
            log::warn!("{stage}: message {id} was no longer running there; not deferred");
            Ok(())
        }
    }
}

fn claim(client: &mut Client, asked: &[(String, i32)]) -> Result<Event, postgres::Error> {
    let stages: Vec<String> = asked.iter().map(|a| a.0.clone()).collect();
    let caps: Vec<i32> = asked.iter().map(|a| a.1).collect();
    let rows = db::retry_transient(|| {
        client.query_typed(
            sql::CLAIM_OLDEST,
            &[(&stages, Type::TEXT_ARRAY), (&caps, Type::INT4_ARRAY)],
        )
    })?;
    let next_paused = rows.first().and_then(|r| r.get::<_, Option<f64>>(3));
    let rows = rows
        .iter()
        .filter_map(|r| {
            Some(ClaimedRow {
                id: r.get::<_, Option<i64>>(0)?,
                stage: r.get(1),
                sender_key: r.get::<_, Option<String>>(2).unwrap_or_default(),
            })
        })
        .collect();
    Ok(Event::Claimed {
        rows,
        asked: asked.to_vec(),
        next_paused,
    })
}
