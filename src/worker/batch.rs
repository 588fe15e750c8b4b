//! The serve loop and one batch (SPEC §5, §12.2, §12.3): read a batch of ids from stdin
//! (greedy for metadata-only stages, one at a time otherwise), load their rows with one
//! SELECT, turn every running row into a [`Message`] and its chain into a [`Plan`],
//! commit the plans, and answer one status line per id, in input order.
//!
//! Called by `startup.rs` once `ready` is out. It owns the batch's connection and the
//! per-stage timings of the REPORT; it reads the claim token with each row and hands it
//! on, but writes nothing itself (`writes.rs` does) and decides no outcome (`chain.rs`
//! and `errors.rs` do). A row it cannot use is never a crash of the worker.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::time::{Duration, Instant};

use postgres::types::Type;
use serde_json::{Map, Value};

use super::errors::status_for;
use super::input::IdReader;
use super::runtime::Worker;
use super::settings;
use super::writes::Plan;
use super::{Load, Message, StageError};
use crate::db::pool::PgConn;
use crate::db::{self, ErrorKind, sql};
use crate::exit::{self, Failure};
use crate::protocol;

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
    /// The claim token, the last of the columns both loads share.
    pub const CLAIM: usize = 13;
    /// `LOAD_FULL` only.
    pub const HEADERS: usize = 14;
    /// `LOAD_FULL` only.
    pub const BODY: usize = 15;
}

impl Worker {
    /// Answers batches of ids until stdin ends.
    pub(super) fn serve(&mut self, mut input: IdReader) -> Result<(), Failure> {
        let max = if self.own.loads() == Load::Metadata {
            self.batch_max
        } else {
            1
        };
        let stdout = std::io::stdout();
        loop {
            let ids = match input.next_batch(max) {
                Ok(Some(ids)) => ids,
                Ok(None) => return Ok(()),
                Err(e) => return Err(Failure::new(exit::EX_SOFTWARE, e.to_string())),
            };
            let plans = self.process(&ids);
            let mut out = stdout.lock();
            for plan in &plans {
                writeln!(
                    out,
                    "{}",
                    protocol::format_status(plan.answer, &plan.report)
                )
                .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))?;
            }
            out.flush()
                .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))?;
        }
    }

    /// One batch: load, run every chain, commit; one plan per id, in input order.
    fn process(&mut self, ids: &[i64]) -> Vec<Plan> {
        let started = Instant::now();
        let mut conn = match self.pool.get() {
            Ok(c) => c,
            Err(e) => {
                log::warn!(
                    "cannot get a database connection for messages {ids:?}: {}",
                    e.message
                );
                let answer = status_for(e.kind);
                return ids
                    .iter()
                    .map(|&id| Plan::answer_only(id, answer))
                    .collect();
            }
        };
        let (query, loaded) = match self.own.loads() {
            Load::Metadata => (sql::LOAD_METADATA, Load::Metadata),
            Load::Full => (sql::LOAD_FULL, Load::Full),
        };
        let id_list: Vec<i64> = ids.to_vec();
        let load = |conn: &mut PgConn| {
            db::retry_transient(|| conn.query_typed(query, &[(&id_list, Type::INT8_ARRAY)]))
        };
        let rows = match load(&mut conn) {
            Ok(rows) => rows,
            // A pooled connection that died while idle (a database restart) is noticed
            // only now, before anything was done: one fresh connection, then 74.
            Err(e) if db::classify(&e) == ErrorKind::Connection => {
                log::debug!(
                    "pooled connection was dead ({}); reconnecting",
                    db::describe(&e)
                );
                drop(conn);
                conn = match self.pool.get() {
                    Ok(c) => c,
                    Err(e) => {
                        log::warn!("cannot reconnect for messages {ids:?}: {}", e.message);
                        let answer = status_for(e.kind);
                        return ids
                            .iter()
                            .map(|&id| Plan::answer_only(id, answer))
                            .collect();
                    }
                };
                match load(&mut conn) {
                    Ok(rows) => rows,
                    Err(e) => return load_failed(ids, &e),
                }
            }
            Err(e) => return load_failed(ids, &e),
        };
        let mut by_id: HashMap<i64, postgres::Row> =
            rows.into_iter().map(|r| (r.get(col::ID), r)).collect();
        let load_share = per_message(started.elapsed(), ids.len());
        let mut plans = Vec::with_capacity(ids.len());
        let mut seen = HashSet::new();
        for &id in ids {
            let row = if seen.insert(id) {
                by_id.remove(&id)
            } else {
                None
            };
            let plan = match row {
                None => {
                    log::warn!(
                        "message {id} does not exist (or was handed out twice); nothing to do"
                    );
                    Plan::answer_only(id, protocol::STATUS_OK)
                }
                Some(row) => self.plan_row(&mut conn, id, &row, loaded),
            };
            plans.push(plan);
        }
        for plan in &mut plans {
            if let Some(first) = plan.report.first_mut() {
                first.1 += load_share;
            }
        }
        let write_started = Instant::now();
        self.commit(&mut conn, &mut plans);
        let write_share = per_message(write_started.elapsed(), plans.len());
        for plan in &mut plans {
            if let Some(last) = plan.report.last_mut() {
                last.1 += write_share;
            }
        }
        plans
    }

    /// The plan for one loaded row: its chain when it is running and readable.
    fn plan_row(&mut self, conn: &mut PgConn, id: i64, row: &postgres::Row, loaded: Load) -> Plan {
        let status: String = row.get(col::STATUS);
        if status != "running" {
            let stage: String = row.get(col::STAGE);
            log::warn!("{stage}: message {id} is {status}, not running; left alone");
            return Plan::answer_only(id, protocol::STATUS_OK);
        }
        match message_from_row(row, loaded) {
            Ok(message) => self.run_chain(conn, message, loaded),
            Err(why) => self.unreadable(id, row, why),
        }
    }

    /// A running row that cannot be read into a message is that message's permanent
    /// error, written with whatever of its state is readable, under the claim token read
    /// with it. Without a readable token no write is safe: the row is left as it is.
    fn unreadable(&mut self, id: i64, row: &postgres::Row, why: String) -> Plan {
        let stage: String = row.get(col::STAGE);
        let claim = match row.try_get::<_, i64>(col::CLAIM) {
            Ok(claim) => claim,
            Err(e) => {
                log::warn!(
                    "{stage}: message {id} cannot be read ({why}), nor can its claim token ({e}); \
                     nothing written, the row is left running"
                );
                return Plan::answer_only(id, protocol::STATUS_OK);
            }
        };
        let mut message = Message::new(
            id,
            stage.clone(),
            String::new(),
            Vec::new(),
            None,
            None,
            readable_state(row),
            String::new(),
        );
        message.claim = claim;
        let mut plan = Plan::for_message(&message);
        let section = self.graph.get(&stage).cloned();
        self.handle_error(
            &mut plan,
            message,
            &stage,
            section.as_ref(),
            StageError::permanent(why),
        );
        plan
    }
}

/// Loading failed. Nothing was committed, and without the rows the worker does not know
/// their stages and tokens to guard a write with, so every id is answered 74 (75 for
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

/// The row's state, when it is readable: kept when the row itself is not usable.
fn readable_state(row: &postgres::Row) -> Map<String, Value> {
    row.try_get::<_, String>(col::STATE)
        .ok()
        .and_then(|text| match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(map)) => Some(map),
            _ => None,
        })
        .unwrap_or_default()
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
    message.claim = column(row, col::CLAIM)?;
    message.auth_user = column(row, col::AUTH_USER)?;
    message.client_ip = column(row, col::CLIENT_IP)?;
    message.lifetime_age = Duration::from_secs_f64(column::<f64>(row, col::LIFETIME_AGE)?.max(0.0));
    message.settings = settings::parse(column::<Option<String>>(row, col::SETTINGS)?.as_deref());
    if loaded == Load::Full {
        message.headers = column(row, col::HEADERS)?;
        message.body = column(row, col::BODY)?;
    }
    Ok(message)
}
