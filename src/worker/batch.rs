//! The serve loop and one batch (§5, §12.2, §12.3): read a batch of ids from stdin
//! (greedy), load their rows with one SELECT (the content of a full load within a
//! budget, the rest in its turn), turn every running row into a [`Message`] and its
//! chain into a [`Plan`], commit the plans (a slow batch every 500 ms as it goes), and
//! answer one status line per id, in input order.
//!
//! Owns the [`Server`]: the worker's pool, the chain [`Runner`] and the batch size.
//! Called by `runtime.rs` once `ready` is out. It owns the batch's connection and the
//! per-stage timings of the REPORT; it takes each row's claim token from its assignment
//! line (the stage's role cannot read it) and hands it on, but writes nothing itself (`writes.rs` does) and decides no outcome (`chain.rs`
//! and `errors.rs` do). A row it cannot use is never a crash of the worker, and never
//! its batch's problem: when the batch's SELECT is refused, the ids are loaded one at a
//! time, and a row that cannot be loaded at all is failed alone (`unreadable`), at the
//! stage read by a SELECT of nothing but its stage and status.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::time::{Duration, Instant};

use postgres::types::Type;
use serde_json::Value;

use super::chain::{Runner, read_content};
use super::errors::{PERMANENT, status_for};
use super::input::IdReader;
use super::message::Message;
use super::plan::{Plan, Write};
use super::settings;
use super::stage::Load;
use super::tally::BatchTally;
use super::writes::commit;
use crate::db::pool::{PgConn, Pool};
use crate::db::{self, ErrorKind, sql};
use crate::escape::Visible;
use crate::exit::{self, Failure};
use crate::protocol::{self, Assignment};

/// The columns of [`sql::LOAD_METADATA`] and [`sql::LOAD_FULL`], by position.
mod col {
    pub const ID: usize = 0;
    pub const STAGE: usize = 1;
    pub const STATUS: usize = 2;
    pub const MAIL_FROM: usize = 3;
    pub const RCPT_TO: usize = 4;
    pub const AUTH_USER: usize = 5;
    pub const CLIENT_IP: usize = 6;
    pub const HEADER_FROM: usize = 7;
    pub const SUBJECT: usize = 8;
    pub const STATE: usize = 9;
    pub const SENDER_KEY: usize = 10;
    /// Seconds since `arrived`, or since `state.dsn_created` for a DSN.
    pub const LIFETIME_AGE: usize = 11;
    /// The per-address settings of the correspondents, as JSON text.
    pub const SETTINGS: usize = 12;
    /// The header block's Message-ID.
    pub const MESSAGE_ID: usize = 13;
    /// `arrived`, as epoch seconds.
    pub const ARRIVED: usize = 14;
    /// The trail's end (its last word: when the last pass ended, in epoch
    /// milliseconds); NULL before the first pass.
    pub const ENTERED: usize = 15;
    /// `LOAD_FULL` only: NULL past the batch's content budget.
    pub const HEADERS: usize = 16;
    /// `LOAD_FULL` only: NULL past the batch's content budget.
    pub const BODY: usize = 17;
    /// `LOAD_FULL` only: whether the row's header block and body came with it.
    pub const CONTENT: usize = 18;
}

/// The header blocks and bodies a batch's load brings at most together (the first
/// row's always come): a later row's are read when its turn comes
/// ([`super::chain::read_content`]), so a worker holds about this much content at once
/// however large the messages and `QUEUE_LIMIT`.
const BATCH_CONTENT_BYTES: i64 = 4 << 20;

/// A batch commits what it has run and answers those ids whenever this long passed
/// since its start or its last commit, before it goes on: an outcome is never held
/// back behind a slow message of its batch for longer, which is also the most a
/// worker that dies mid-batch takes back (§12.3).
const COMMIT_EVERY: Duration = Duration::from_millis(500);

/// Where a batch's early answers go: the serve loop writes them out.
type Emit<'a> = dyn FnMut(&[Plan]) -> Result<(), Failure> + 'a;

/// The serve loop's state: what a batch is loaded with and handed to.
pub(super) struct Server {
    /// Runs each loaded message's chain.
    runner: Runner,
    /// The worker's connections (one serves the loop; a stage may borrow another).
    pool: Pool,
    /// What the stage this process was started as loads: the load query.
    loads: Load,
    /// The largest batch it takes (its greatest `QUEUE_LIMIT`).
    batch_max: usize,
}

impl Server {
    /// A serve loop for a stage that loads `loads`, taking batches of up to `batch_max`
    /// ids.
    pub(super) fn new(runner: Runner, pool: Pool, loads: Load, batch_max: usize) -> Server {
        Server {
            runner,
            pool,
            loads,
            batch_max,
        }
    }

    /// Answers batches of ids until stdin ends, then logs the batch sizes under `label`
    /// (the stage it was started for).
    pub(super) fn serve(&mut self, mut input: IdReader, label: &str) -> Result<(), Failure> {
        let max = self.batch_max;
        let stdout = std::io::stdout();
        let mut tally = BatchTally::default();
        loop {
            let batch = match input.next_batch(max) {
                Ok(Some(batch)) => batch,
                Ok(None) => {
                    if tally.batches() > 0 {
                        log::info!("{label}: input ended after {tally}");
                    }
                    for summary in self.runner.summaries() {
                        log::info!("{label}: {summary}");
                    }
                    return Ok(());
                }
                Err(e) => return Err(Failure::new(exit::EX_SOFTWARE, e.to_string())),
            };
            tally.add(batch.len());
            let mut emit = |plans: &[Plan]| answer(&stdout, plans);
            let plans = self.process(&batch, &mut emit)?;
            answer(&stdout, &plans)?;
        }
    }

    /// One batch: load, run every chain, commit; one plan per id, in input order. The
    /// plans of what was committed before the end ([`COMMIT_EVERY`]) go to `emit`; the
    /// rest are returned.
    fn process(&mut self, batch: &[Assignment], emit: &mut Emit) -> Result<Vec<Plan>, Failure> {
        let started = Instant::now();
        self.runner.begin_batch();
        let ids: Vec<i64> = batch.iter().map(|a| a.id).collect();
        let ids = ids.as_slice();
        let mut conn = match self.pool.get() {
            Ok(c) => c,
            Err(e) => {
                log::warn!(
                    "cannot get a database connection for messages {ids:?}: {}",
                    e.message
                );
                let answer = status_for(e.kind);
                return Ok(ids
                    .iter()
                    .map(|&id| Plan::answer_only(id, answer))
                    .collect());
            }
        };
        let loaded = self.loads;
        // Ids answered without a row: those whose load failed when loaded one by one.
        let mut settled: HashMap<i64, Plan> = HashMap::new();
        let rows = match load_rows(&mut conn, loaded, ids) {
            Ok(rows) => rows,
            // A pooled connection that died while idle (a database restart) is noticed
            // only now, before anything was done: one fresh connection, then 74.
            Err(e) if db::classify(&e) == ErrorKind::Connection => {
                log::debug!(
                    "pooled connection was dead ({}); reconnecting",
                    db::describe(&e)
                );
                drop(conn);
                self.pool.forget_connections();
                conn = match self.pool.get() {
                    Ok(c) => c,
                    Err(e) => {
                        log::warn!("cannot reconnect for messages {ids:?}: {}", e.message);
                        let answer = status_for(e.kind);
                        return Ok(ids
                            .iter()
                            .map(|&id| Plan::answer_only(id, answer))
                            .collect());
                    }
                };
                match load_rows(&mut conn, loaded, ids) {
                    Ok(rows) => rows,
                    Err(e) if db::classify(&e) == ErrorKind::Other => {
                        load_one_by_one(&mut conn, loaded, batch, &e, &mut settled)
                    }
                    Err(e) => return Ok(load_failed(ids, &e)),
                }
            }
            // Refused for a reason of its own (a value of one row the statement cannot
            // handle): the same for every later try, so one row must not hold up the
            // batch forever.
            Err(e) if db::classify(&e) == ErrorKind::Other => {
                load_one_by_one(&mut conn, loaded, batch, &e, &mut settled)
            }
            Err(e) => return Ok(load_failed(ids, &e)),
        };
        let mut by_id: HashMap<i64, postgres::Row> =
            rows.into_iter().map(|r| (r.get(col::ID), r)).collect();
        let load_share = per_message(started.elapsed(), ids.len());
        let mut plans = Vec::with_capacity(ids.len());
        let mut seen = HashSet::new();
        let mut since = started;
        for (n, &assignment) in batch.iter().enumerate() {
            let id = assignment.id;
            let row = if seen.insert(id) {
                by_id.remove(&id)
            } else {
                None
            };
            let mut plan = if let Some(plan) = settled.remove(&id) {
                plan
            } else {
                match row {
                    None => {
                        log::warn!(
                            "message {id} does not exist (or was handed out twice); nothing to do"
                        );
                        Plan::answer_only(id, protocol::STATUS_OK)
                    }
                    Some(row) => self.plan_row(&mut conn, assignment, &row, loaded),
                }
            };
            if let Some(first) = plan.report.first_mut() {
                first.1 += load_share;
            }
            plans.push(plan);
            let rest = &batch[n + 1..];
            if rest.is_empty() || since.elapsed() < COMMIT_EVERY {
                continue;
            }
            // A slow batch: what is done is committed and answered now.
            self.commit(&mut conn, &mut plans);
            emit(&plans)?;
            plans.clear();
            since = Instant::now();
            if conn.is_closed() {
                // Nothing was done for the rest: the dispatcher defers them.
                log::warn!("the database connection was lost; answering 74 for the batch's rest");
                return Ok(rest
                    .iter()
                    .map(|a| Plan::answer_only(a.id, protocol::STATUS_IOERR))
                    .collect());
            }
        }
        self.commit(&mut conn, &mut plans);
        Ok(plans)
    }

    /// Commits plans of the batch and adds the write's time, shared evenly, to each
    /// one's last stage.
    fn commit(&mut self, conn: &mut PgConn, plans: &mut [Plan]) {
        let write_started = Instant::now();
        commit(conn, plans);
        if conn.is_closed() {
            // The session is gone, and the pool's other connections went to the same
            // server: none is tried again for the next batch.
            self.pool.forget_connections();
        }
        let write_share = per_message(write_started.elapsed(), plans.len());
        for plan in plans.iter_mut() {
            if let Some(last) = plan.report.last_mut() {
                last.1 += write_share;
            }
        }
    }

    /// The plan for one loaded row: its chain when it is running and readable.
    fn plan_row(
        &mut self,
        conn: &mut PgConn,
        assignment: Assignment,
        row: &postgres::Row,
        loaded: Load,
    ) -> Plan {
        let id = assignment.id;
        let status: String = row.get(col::STATUS);
        if status != "running" {
            // The row's stage, as any writer of the queue left it.
            let stage: String = row.get(col::STAGE);
            let stage = Visible(&stage);
            log::warn!("{stage}: message {id} is {status}, not running; left alone");
            return Plan::answer_only(id, protocol::STATUS_OK);
        }
        match message_from_row(row, loaded) {
            Ok(mut message) => {
                message.claim = assignment.token;
                if loaded == Load::Full && !row.try_get(col::CONTENT).unwrap_or(true) {
                    // Past the batch's content budget: read now, in its turn.
                    match read_content(conn, &mut message) {
                        Ok(true) => {}
                        Ok(false) => {
                            log::warn!(
                                "{}: message {id} is no longer running there; left alone",
                                Visible(&message.claimed_stage)
                            );
                            return Plan::answer_only(id, protocol::STATUS_OK);
                        }
                        Err(e) if db::classify(&e) == ErrorKind::Other => {
                            let why = format!("cannot load its content: {}", db::describe(&e));
                            return unreadable(assignment, row, why);
                        }
                        Err(e) => {
                            let answer = status_for(db::classify(&e));
                            log::warn!(
                                "message {id}: cannot load its content: {}; answering {answer}",
                                db::describe(&e)
                            );
                            return Plan::answer_only(id, answer);
                        }
                    }
                }
                self.runner.drop_refused_settings(&mut message);
                self.runner.run_chain(conn, message, loaded)
            }
            Err(why) => unreadable(assignment, row, why),
        }
    }
}

/// Writes the answers of these plans, one status line each, in one write (atomic on a
/// pipe up to PIPE_BUF): the dispatcher sees their capacity free at once and claims it
/// in one go, instead of a row or two per line as a line-buffered stdout would hand
/// them over.
fn answer(stdout: &std::io::Stdout, plans: &[Plan]) -> Result<(), Failure> {
    if plans.is_empty() {
        return Ok(());
    }
    let mut answers = String::new();
    for plan in plans {
        answers.push_str(&protocol::format_status(
            plan.answer,
            &plan.report,
            &plan.events,
        ));
        answers.push('\n');
    }
    let mut out = stdout.lock();
    out.write_all(answers.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))
}

/// A running row that cannot be read into a message is that message's permanent
/// error. The worker does not hold the row's whole state (it may be what cannot be
/// read), so the failure keys are merged into the stored state server-side, under
/// the claim token of its assignment; a stored state is never replaced by a smaller
/// one.
fn unreadable(assignment: Assignment, row: &postgres::Row, why: String) -> Plan {
    let id = assignment.id;
    let stage: String = row.get(col::STAGE);
    log::warn!(
        "{}: message {id}: permanent error, failing it: {}",
        Visible(&stage),
        Visible(&why)
    );
    failing_plan(assignment, stage, PERMANENT, why)
}

/// A plan that fails a running row in place (see [`Write::Fail`]) and answers that it
/// failed.
fn failing_plan(assignment: Assignment, stage: String, class: &'static str, error: String) -> Plan {
    let mut plan = Plan::answer_only(assignment.id, protocol::STATUS_PERMANENT);
    plan.claimed = stage;
    plan.claim = assignment.token;
    plan.write = Write::Fail { class, error };
    plan
}

/// Runs [`sql::LOAD_METADATA`] or [`sql::LOAD_FULL`] (within [`BATCH_CONTENT_BYTES`])
/// for these ids, re-running it on a serialization failure or deadlock.
fn load_rows(
    conn: &mut PgConn,
    loaded: Load,
    ids: &[i64],
) -> Result<Vec<postgres::Row>, postgres::Error> {
    let ids = ids.to_vec();
    db::retry_transient(|| match loaded {
        Load::Metadata => conn.query_prepared(sql::LOAD_METADATA, &[Type::INT8_ARRAY], &[&ids]),
        Load::Full => conn.query_prepared(
            sql::LOAD_FULL,
            &[Type::INT8_ARRAY, Type::INT8],
            &[&ids, &BATCH_CONTENT_BYTES],
        ),
    })
}

/// The batch's load was refused for a non-connection reason (`err`): loads its ids one
/// at a time, so that only a row that cannot be loaded is affected. Returns the rows
/// that loaded; every other id gets its plan in `settled`.
fn load_one_by_one(
    conn: &mut PgConn,
    loaded: Load,
    batch: &[Assignment],
    err: &postgres::Error,
    settled: &mut HashMap<i64, Plan>,
) -> Vec<postgres::Row> {
    let mut unique = HashSet::new();
    let batch: Vec<Assignment> = batch
        .iter()
        .copied()
        .filter(|a| unique.insert(a.id))
        .collect();
    let ids: Vec<i64> = batch.iter().map(|a| a.id).collect();
    if ids.len() > 1 {
        log::warn!(
            "cannot load messages {ids:?} together: {}; loading them one at a time",
            db::describe(err)
        );
    }
    let mut rows = Vec::with_capacity(ids.len());
    for &assignment in &batch {
        let id = assignment.id;
        // A batch of one has been tried already.
        let single;
        let err = if ids.len() == 1 {
            err
        } else {
            match load_rows(conn, loaded, &[id]) {
                Ok(row) => {
                    rows.extend(row);
                    continue;
                }
                Err(e) => {
                    single = e;
                    &single
                }
            }
        };
        settled.insert(id, unloadable(conn, assignment, err));
    }
    rows
}

/// The plan for a row whose load failed with `err`. A failure of the connection (or
/// overload) is answered as such; any other is the row's own: when it is running, it
/// fails alone with `failure_class` `unreadable`, at the stage read by
/// [`sql::LOAD_CLAIM`] (which reads nothing of the row's content) under the claim
/// token of its assignment.
fn unloadable(conn: &mut PgConn, assignment: Assignment, err: &postgres::Error) -> Plan {
    let id = assignment.id;
    let kind = db::classify(err);
    if kind != ErrorKind::Other {
        let answer = status_for(kind);
        log::warn!(
            "cannot load message {id}: {}; answering {answer}",
            db::describe(err)
        );
        return Plan::answer_only(id, answer);
    }
    let why = format!("cannot load the message: {}", db::describe(err));
    let claim = db::retry_transient(|| conn.query_typed_opt(sql::LOAD_CLAIM, &[(&id, Type::INT8)]));
    match claim {
        Ok(None) => {
            log::warn!("message {id} does not exist; nothing to do");
            Plan::answer_only(id, protocol::STATUS_OK)
        }
        Ok(Some(row)) => {
            let stage: String = row.get(0);
            let status: String = row.get(1);
            if status != "running" {
                log::warn!(
                    "{}: message {id} is {status}, not running; left alone ({})",
                    Visible(&stage),
                    Visible(&why)
                );
                return Plan::answer_only(id, protocol::STATUS_OK);
            }
            log::warn!(
                "{}: message {id}: {}; failing it as unreadable",
                Visible(&stage),
                Visible(&why)
            );
            failing_plan(assignment, stage, "unreadable", why)
        }
        Err(e) => {
            let answer = status_for(db::classify(&e));
            log::warn!(
                "message {id}: {}; nor can its stage be read: {}; answering {answer}",
                Visible(&why),
                db::describe(&e)
            );
            Plan::answer_only(id, answer)
        }
    }
}

/// Loading failed. Nothing was committed, and without the rows the worker does not know
/// their stages to guard a write with, so every id is answered 74 (75 for
/// overload) and the dispatcher defers it, guarded by the claim it made.
fn load_failed(ids: &[i64], err: &postgres::Error) -> Vec<Plan> {
    let answer = status_for(db::classify(err));
    log::warn!(
        "cannot load messages {ids:?}: {}; answering {answer}",
        db::describe(err)
    );
    ids.iter()
        .map(|&id| Plan::answer_only(id, answer))
        .collect()
}

/// A batch's shared time, split evenly over its messages, in microseconds.
fn per_message(total: Duration, n: usize) -> u64 {
    (total.as_micros() as u64) / (n.max(1) as u64)
}

/// How long a message has lived, from the seconds [`sql::LOAD_METADATA`] computes
/// (a difference of epochs, so any stored time gives a number, never an error).
/// `Duration::from_secs_f64` panics on what such a difference can be, so: an age below
/// zero (a clock ahead, an arrival in the future) is no age; an age that is not a
/// finite number (an infinite arrival or creation time) cannot be known and counts as
/// spent, so that a host error's retries end instead of running hourly forever; an age
/// beyond what a `Duration` holds is the largest.
fn lifetime_age(secs: f64) -> Duration {
    if !secs.is_finite() {
        return Duration::MAX;
    }
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX)
}

/// When the trail's last pass ended, in epoch seconds, from the trail's end (`… US
/// AT\n`, AT in epoch milliseconds); `None` for no trail or one that does not end so.
fn trail_end(end: Option<String>) -> Option<f64> {
    let at = end?.split_whitespace().last()?.parse::<u64>().ok()?;
    Some(at as f64 / 1000.0)
}

/// A time given as epoch seconds; `None` for none or one the system cannot hold.
fn epoch(seconds: Option<f64>) -> Option<std::time::SystemTime> {
    let s = seconds.filter(|s| s.is_finite())?;
    let since = Duration::try_from_secs_f64(s.abs()).ok()?;
    if s >= 0.0 {
        std::time::UNIX_EPOCH.checked_add(since)
    } else {
        std::time::UNIX_EPOCH.checked_sub(since)
    }
}

/// Builds a message from a row of [`sql::LOAD_METADATA`] / [`sql::LOAD_FULL`].
/// A row the table's constraints allow but a stage cannot work with (a NULL in
/// `rcpt_to`, say) is that message's permanent error, not a crash of the worker.
fn message_from_row(row: &postgres::Row, loaded: Load) -> Result<Message, String> {
    fn column<'a, T: postgres::types::FromSql<'a>>(
        row: &'a postgres::Row,
        index: usize,
    ) -> Result<T, String> {
        row.try_get(index).map_err(|e| {
            let name = row.columns().get(index).map_or("?", |c| c.name());
            format!("its column {name} cannot be read: {e}")
        })
    }
    let state_text: String = column(row, col::STATE)?;
    let state = match serde_json::from_str::<Value>(&state_text) {
        Ok(Value::Object(map)) => map,
        _ => return Err(format!("its state is not a JSON object: {state_text}")),
    };
    let mut message = Message::new(
        column(row, col::ID)?,
        column(row, col::STAGE)?,
        column(row, col::MAIL_FROM)?,
        column(row, col::RCPT_TO)?,
        column(row, col::HEADER_FROM)?,
        column(row, col::SUBJECT)?,
        state,
        column::<Option<String>>(row, col::SENDER_KEY)?.unwrap_or_default(),
    );
    message.auth_user = column(row, col::AUTH_USER)?;
    message.client_ip = column(row, col::CLIENT_IP)?;
    // NULL cannot come from the load; were it to, it is an age that cannot be known.
    message.lifetime_age =
        lifetime_age(column::<Option<f64>>(row, col::LIFETIME_AGE)?.unwrap_or(f64::NAN));
    message.settings = settings::parse(column::<Option<String>>(row, col::SETTINGS)?.as_deref());
    message.message_id = column(row, col::MESSAGE_ID)?;
    message.arrived = epoch(column(row, col::ARRIVED)?);
    message.entered = epoch(trail_end(column(row, col::ENTERED)?)).or(message.arrived);
    if loaded == Load::Full {
        // Past the batch's content budget both are NULL; plan_row reads them then.
        message.set_content(column(row, col::HEADERS)?, column(row, col::BODY)?);
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trails_end_gives_when_the_last_pass_ended_and_garbage_gives_none() {
        assert_eq!(
            trail_end(Some("s 12 1733377200123\n".into())),
            Some(1_733_377_200.123)
        );
        assert_eq!(
            trail_end(Some("0 1733377200000\n".into())),
            Some(1_733_377_200.0)
        );
        assert_eq!(trail_end(None), None);
        assert_eq!(trail_end(Some("x y z\n".into())), None);
        assert_eq!(trail_end(Some(String::new())), None);
        assert_eq!(trail_end(Some("s 1 -5\n".into())), None);
    }

    #[test]
    fn any_lifetime_age_converts_without_a_panic() {
        assert_eq!(lifetime_age(90.5), Duration::from_millis(90_500));
        assert_eq!(lifetime_age(0.0), Duration::ZERO);
        assert_eq!(lifetime_age(-0.0), Duration::ZERO);
        assert_eq!(
            lifetime_age(-3600.0),
            Duration::ZERO,
            "arrived in the future"
        );
        assert_eq!(
            lifetime_age(f64::INFINITY),
            Duration::MAX,
            "arrived -infinity"
        );
        assert_eq!(
            lifetime_age(f64::NEG_INFINITY),
            Duration::MAX,
            "arrived infinity"
        );
        assert_eq!(lifetime_age(f64::NAN), Duration::MAX);
        assert_eq!(lifetime_age(1e300), Duration::MAX, "beyond a Duration");
        assert_eq!(lifetime_age(f64::MIN), Duration::ZERO);
    }
}
