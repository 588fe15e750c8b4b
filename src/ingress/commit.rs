//! The group commit of `pepsi-ingress` (§16): one thread owning the database
//! session, to which every session hands the messages it accepted and waits for the
//! answer. It takes whatever has arrived since its last commit, queues it all in one
//! statement (`sql::INJECT_MANY`: `pepsi.workqueue_inject_many`, the checks of
//! `workqueue_inject` made once and every row and body inserted by one statement;
//! prepared once per connection) in one transaction with synchronous commit, and
//! answers each message — queued with its id, deferred, or refused — only once that
//! commit has returned. So a burst of N messages of concurrent sessions costs one
//! commit and one `NOTIFY workqueue`, and no session's 250 ever precedes its message's
//! commit.
//!
//! The database away or refusing connections is a deferral (451) for every message
//! until a reconnect succeeds (tried every 250 ms for ten seconds, then doubling to 5 s); a message the
//! database refuses for itself (class 22, a value `workqueue_inject_many` rejects) is
//! found by committing the batch's messages one by one and is refused (554) alone. It
//! also writes the counters ([`super::counters`]) every few seconds.
//!
//! Called by `mod.rs` (spawn) and `session.rs` (commit); it knows nothing of sockets.

use std::net::IpAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::counters::Counters;
use crate::db::pool::Connection;
use crate::db::reconnect::Reconnect;
use crate::db::{self, ErrorKind, schema, sql};

/// The most messages in one commit.
const MAX_BATCH: usize = 500;
/// The most bytes of message data in one commit (a larger message commits alone). The
/// statement's parameters are one more copy of the batch while it is sent, growing by
/// doubling: this bounds that copy, so that many concurrent large messages cost about
/// their own size each, not three times it.
const MAX_BATCH_BYTES: usize = 16 << 20;
/// The longest wait before reconnecting (the first ten seconds of an outage are tried
/// every 250 ms, [`Reconnect`]).
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A message a session accepted, as it will be queued.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// The envelope sender; empty for the null sender.
    pub mail_from: String,
    /// The envelope recipients.
    pub rcpt_to: Vec<String>,
    /// The header block, up to its last line end.
    pub headers: Vec<u8>,
    /// The body.
    pub body: Vec<u8>,
    /// The client's login (from a trusted XFORWARD).
    pub auth_user: Option<String>,
    /// The client's address (from a trusted XFORWARD, else the peer's); `None` for a
    /// Unix socket's client.
    pub client_ip: Option<IpAddr>,
    /// The `From:` address.
    pub header_from: Option<String>,
    /// The `Subject:`.
    pub subject: Option<String>,
    /// The initial `state` (its `dsn`), a JSON object.
    pub state: serde_json::Value,
}

/// What became of a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Committed, with its id.
    Queued(i64),
    /// Not committed for now (the database away, refusing, or failing): 451.
    Deferred,
    /// Refused by the database for itself, with why: 554.
    Refused(String),
}

/// A message and where its outcome goes.
struct Job {
    message: Message,
    answer: Sender<Outcome>,
}

/// A handle the sessions commit through.
#[derive(Clone)]
pub struct Committer {
    jobs: Sender<Job>,
}

impl Committer {
    /// Queues `message` with the next commit and waits for its outcome.
    pub fn commit(&self, message: Message) -> Outcome {
        let (answer, outcome) = crossbeam_channel::bounded(1);
        if self.jobs.send(Job { message, answer }).is_err() {
            return Outcome::Deferred;
        }
        outcome.recv().unwrap_or(Outcome::Deferred)
    }
}

/// A committer whose messages go to `answer`, which says what became of each: for the
/// tests of a session's protocol, without a database.
#[cfg(test)]
pub(super) fn answered_by(
    answer: impl Fn(&Message) -> Outcome + Send + 'static,
) -> (Committer, std::sync::Arc<std::sync::Mutex<Vec<Message>>>) {
    let (jobs, rx) = crossbeam_channel::unbounded::<Job>();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    std::thread::spawn(move || {
        for job in rx {
            let outcome = answer(&job.message);
            kept.lock().unwrap().push(job.message);
            let _ = job.answer.send(outcome);
        }
    });
    (Committer { jobs }, seen)
}

/// The committer thread's state.
struct Thread {
    config: postgres::Config,
    stage: String,
    counters: Arc<Counters>,
    /// The session, with the insert prepared on it once (parsed and planned once per
    /// connection, not once per commit: a commit is then one round trip).
    client: Option<Connection>,
    /// Not before this is a connection tried again.
    retry_at: Instant,
    waits: Reconnect,
    /// When the last "unavailable" warning was logged (one a minute).
    warned: Option<Instant>,
}

/// Starts the committer for `stage` with a connection made from `config` (to which the
/// session settings are added). It ends, after a last write of the counters, when
/// every [`Committer`] is dropped.
pub fn spawn(
    mut config: postgres::Config,
    stage: String,
    counters: Arc<Counters>,
    stats_every: Duration,
) -> std::io::Result<(Committer, JoinHandle<()>)> {
    db::append_options(&mut config, sql::INGRESS_SESSION_OPTION);
    let (jobs, rx) = crossbeam_channel::unbounded::<Job>();
    let mut thread = Thread {
        config,
        stage,
        counters,
        client: None,
        retry_at: Instant::now(),
        waits: Reconnect::new(MAX_BACKOFF),
        warned: None,
    };
    let handle = std::thread::Builder::new()
        .name("committer".into())
        .spawn(move || thread.run(rx, stats_every))?;
    Ok((Committer { jobs }, handle))
}

impl Thread {
    fn run(&mut self, rx: Receiver<Job>, stats_every: Duration) {
        let mut next_flush = Instant::now() + stats_every;
        loop {
            let wait = next_flush.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(first) => {
                    let mut bytes = first.message.headers.len() + first.message.body.len();
                    let mut batch = vec![first];
                    // Everything that arrived while the last commit ran.
                    while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
                        match rx.try_recv() {
                            Ok(job) => {
                                bytes += job.message.headers.len() + job.message.body.len();
                                batch.push(job);
                            }
                            Err(_) => break,
                        }
                    }
                    self.commit(batch);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if Instant::now() >= next_flush {
                self.flush();
                next_flush = Instant::now() + stats_every;
            }
        }
        self.flush();
    }

    /// The session, (re)connected when it is time to try; `None` while the database is
    /// unavailable.
    fn client(&mut self) -> Option<&mut Connection> {
        if self.client.is_none() {
            if Instant::now() < self.retry_at {
                return None;
            }
            let connected = db::open(&self.config)
                .map_err(|e| e.message)
                .and_then(|mut c| match schema::check(&mut c) {
                    Ok(()) => Ok(c),
                    Err(e) => Err(e.to_string()),
                });
            match connected {
                Ok(c) => {
                    if self.warned.take().is_some() {
                        log::info!("the database is back: accepting mail again");
                    }
                    self.waits.reset();
                    self.client = Some(Connection::new(c));
                }
                Err(e) => {
                    self.unavailable(&e);
                    return None;
                }
            }
        }
        self.client.as_mut()
    }

    /// Notes the database unavailable: no connection until the backoff has passed, and
    /// a warning at most once a minute.
    fn unavailable(&mut self, why: &str) {
        self.client = None;
        self.retry_at = Instant::now() + self.waits.after_failure();
        if self
            .warned
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
        {
            log::warn!("the database is unavailable, deferring mail (451): {why}");
            self.warned = Some(Instant::now());
        }
    }

    /// Commits a batch and answers each of its messages.
    fn commit(&mut self, batch: Vec<Job>) {
        let messages: Vec<&Message> = batch.iter().map(|j| &j.message).collect();
        let outcomes = match self.insert(&messages) {
            Ok(ids) => ids.into_iter().map(Outcome::Queued).collect(),
            Err(None) => vec![Outcome::Deferred; batch.len()],
            Err(Some(e)) if batch.len() > 1 && db::classify(&e) == ErrorKind::Other => {
                // One message the database refuses fails the statement: find it by
                // committing each alone.
                messages
                    .iter()
                    .map(|m| match self.insert(std::slice::from_ref(m)) {
                        Ok(ids) => Outcome::Queued(ids[0]),
                        Err(None) => Outcome::Deferred,
                        Err(Some(e)) => self.failed(&e),
                    })
                    .collect()
            }
            Err(Some(e)) => vec![self.failed(&e); batch.len()],
        };
        for (job, outcome) in batch.into_iter().zip(outcomes) {
            let _ = job.answer.send(outcome);
        }
    }

    /// What a failed insert means for its message(s).
    fn failed(&mut self, e: &postgres::Error) -> Outcome {
        match db::classify(e) {
            ErrorKind::Connection | ErrorKind::Overload => {
                self.unavailable(&db::describe(e));
                Outcome::Deferred
            }
            ErrorKind::Transient => Outcome::Deferred,
            // A value workqueue_inject_many rejects is the message's own.
            ErrorKind::Other if e.code().is_some_and(|c| c.code().starts_with("22")) => {
                Outcome::Refused(db::describe(e))
            }
            // Anything else (privileges, a stage not among the entry stages) is the
            // configuration's: the message waits for it to be fixed.
            ErrorKind::Other => {
                log::error!(
                    "queueing a message failed, deferring it: {}",
                    db::describe(e)
                );
                Outcome::Deferred
            }
        }
    }

    /// Queues `messages` in one statement (one transaction, synchronous commit);
    /// returns their ids in order. `Err(None)`: no connection to try with (the
    /// database unavailable).
    fn insert(&mut self, messages: &[&Message]) -> Result<Vec<i64>, Option<postgres::Error>> {
        let stage = self.stage.clone();
        let counters = self.counters.clone();
        let Some(client) = self.client() else {
            return Err(None);
        };
        let col = |f: &dyn Fn(&Message) -> Option<String>| -> Vec<Option<String>> {
            messages.iter().map(|m| f(m)).collect()
        };
        let senders: Vec<&str> = messages.iter().map(|m| m.mail_from.as_str()).collect();
        let rcpts = col(&|m| Some(serde_json::json!(m.rcpt_to).to_string()));
        let headers: Vec<&[u8]> = messages.iter().map(|m| m.headers.as_slice()).collect();
        let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
        let logins = col(&|m| m.auth_user.clone());
        let clients = col(&|m| m.client_ip.map(|a| a.to_string()));
        let froms = col(&|m| m.header_from.clone());
        let subjects = col(&|m| m.subject.clone());
        let states = col(&|m| Some(m.state.to_string()));
        let rows = client.query_prepared(
            sql::INJECT_MANY,
            &[],
            &[
                &stage, &senders, &rcpts, &headers, &bodies, &logins, &clients, &froms, &subjects,
                &states,
            ],
        );
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                if db::classify(&e) == ErrorKind::Connection {
                    self.client = None;
                }
                return Err(Some(e));
            }
        };
        let mut ids = vec![0i64; messages.len()];
        for row in rows {
            let n: i64 = row.get(0);
            ids[n as usize - 1] = row.get(1);
        }
        Counters::bump(&counters.accepted, messages.len() as u64);
        Counters::bump(
            &counters.recipients,
            messages.iter().map(|m| m.rcpt_to.len() as u64).sum(),
        );
        Counters::bump(&counters.commits, 1);
        Ok(ids)
    }

    /// Writes the counters' deltas; on failure they wait for the next write.
    fn flush(&mut self) {
        let Some(deltas) = self.counters.take() else {
            return;
        };
        let counters = self.counters.clone();
        let Some(client) = self.client() else {
            counters.restore(deltas);
            return;
        };
        let params: Vec<&(dyn postgres::types::ToSql + Sync)> = deltas
            .iter()
            .map(|d| d as &(dyn postgres::types::ToSql + Sync))
            .collect();
        if let Err(e) = client.execute(sql::INGRESS_STATS_ADD, &params) {
            log::warn!("cannot write the ingress counters: {}", db::describe(&e));
            counters.restore(deltas);
            if db::classify(&e) == ErrorKind::Connection {
                self.client = None;
            }
        }
    }
}
