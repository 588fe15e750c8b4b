//! The worker runtime: start-up, the read–process–answer loop, fusion, the error model
//! and the writes (SPEC §5, §12).
//!
//! Per batch of ids: one SELECT loads the rows with their per-address settings; each
//! row runs its chain of stages in this process (the claimed stage, then any fused
//! successors); then one UPDATE writes every update-shaped outcome and one DELETE every
//! finished message, each guarded by `status = 'running' AND stage = <claimed stage>`;
//! then one status line per id, in input order. Stages that load headers and body get
//! batches of one.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use postgres::types::Type;
use serde_json::{Map, Value, json};

use super::input::IdReader;
use super::settings::{self, Group};
use super::{Context, ErrorClass, Load, Message, Outcome, Stage, StageError};
use crate::cli::Globals;
use crate::config::graph::MAX_FUSION_DEPTH;
use crate::config::raw::join_errors;
use crate::config::{Config, StageGraph, StageSection};
use crate::db::pool::{CheckoutError, PgConn, Pool};
use crate::db::{self, ErrorKind, schema, sql};
use crate::exit::{self, Failure};
use crate::protocol::{self, StageTime};
use crate::stages;

/// The prefix of a built-in stage's program name.
pub const PROGRAM_PREFIX: &str = "pepsi-stage-";

/// Connections in a worker's pool: one serves the loop; a stage may borrow another.
const POOL_SIZE: u32 = 2;
/// How long a worker waits for a connection before answering 74/75.
const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(10);
/// Host-error backoff: the first retry after this, doubling.
const BACKOFF_FIRST: Duration = Duration::from_secs(60);
/// Host-error backoff cap.
const BACKOFF_CAP: Duration = Duration::from_secs(3600);
/// Configured stages cached per (stage, per-address overrides), cleared beyond this.
const CONFIGURED_CACHE: usize = 1024;

/// The host-error retry delay after `failures` consecutive failures at a stage: 1, 2,
/// 4 … minutes, capped at an hour.
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (BACKOFF_FIRST * (1u32 << doublings)).min(BACKOFF_CAP)
}

fn startup_failure(kind: ErrorKind, message: String) -> Failure {
    match kind {
        ErrorKind::Connection => Failure::new(exit::EX_IOERR, message),
        ErrorKind::Overload => Failure::new(exit::EX_TEMPFAIL, message),
        _ => Failure::general(message),
    }
}

fn db_startup_failure(e: &postgres::Error) -> Failure {
    startup_failure(db::classify(e), format!("database: {}", db::describe(e)))
}

/// Runs a worker for the built-in stage `own` until stdin ends.
pub fn run(globals: &Globals, own: &'static dyn Stage) -> Result<(), Failure> {
    let config = Config::load(globals.config.as_deref()).map_err(|errors| {
        Failure::config(format!(
            "configuration error, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    let mut pg = db::connection_config(
        &config.postgres.connection,
        &format!("{PROGRAM_PREFIX}{}", own.name()),
    )
    .map_err(|e| Failure::config(format!("[pepsi-postgres] CONNECTION: {e}")))?;
    if !config.postgres.worker_synchronous_commit {
        // Group commit across concurrent workers; a lost advance is re-run (§12.1).
        db::append_options(&mut pg, sql::ASYNC_COMMIT_OPTION);
    }
    let pool = Pool::new(pg, POOL_SIZE, CHECKOUT_TIMEOUT);
    let mut conn = pool.get().map_err(|CheckoutError { kind, message }| {
        startup_failure(kind, format!("database: {message}"))
    })?;
    match schema::check(&mut *conn) {
        Ok(()) => {}
        Err(schema::SchemaError::Mismatch(m)) => {
            return Err(Failure::config(format!("refusing to run: {m}")));
        }
        Err(schema::SchemaError::Db(e)) => return Err(db_startup_failure(&e)),
    }
    let overlay = db::read_overlay(&mut *conn).map_err(|e| db_startup_failure(&e))?;
    drop(conn);
    let graph = StageGraph::build(&config.stage_sections, &overlay).map_err(|errors| {
        Failure::config(format!(
            "the stage graph is invalid, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    if config.pepsi.share_telemetry {
        log::debug!("[pepsi] SHARE_TELEMETRY is on");
    }
    let mut worker = Worker::new(config, graph, pool, own);
    worker.check_sections()?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}", protocol::READY)
        .and_then(|()| out.flush())
        .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))?;
    drop(out);
    worker.serve(IdReader::stdin())
}

/// What a batch entry writes.
enum Write {
    /// No write: the row was gone or taken away, or the database failed.
    Nothing,
    /// An update-shaped outcome (advance, pause, fail, redirect).
    Update(Value),
    /// Delete the row: the message is done.
    Delete,
    /// Split the row; every group continues at `stage`, pending.
    Split {
        groups: Value,
        stage: String,
        state: String,
    },
}

/// One id of a batch: what to write and what to answer.
struct Plan {
    id: i64,
    claimed: String,
    answer: u8,
    report: Vec<StageTime>,
    write: Write,
}

impl Plan {
    fn answer_only(id: i64, answer: u8) -> Plan {
        Plan {
            id,
            claimed: String::new(),
            answer,
            report: Vec::new(),
            write: Write::Nothing,
        }
    }
}

/// A stage configured for one effective section.
#[derive(Clone)]
struct Ready {
    section: Rc<StageSection>,
    body: Rc<dyn super::Configured>,
}

struct Worker {
    config: Config,
    graph: StageGraph,
    pool: Pool,
    own: &'static dyn Stage,
    exe: Option<PathBuf>,
    same_binary: HashMap<String, bool>,
    configured: HashMap<(String, String), Result<Ready, String>>,
    batch_max: usize,
}

/// The built-in named by a program (by its file name), whatever binary it resolves to.
fn builtin_by_name(program: &str) -> Option<&'static dyn Stage> {
    let name = program.rsplit('/').next().unwrap_or(program);
    stages::find(name.strip_prefix(PROGRAM_PREFIX)?)
}

/// Resolves a program as the dispatcher would: absolute, or looked up on `PATH`.
fn resolve(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return std::fs::canonicalize(program).ok();
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .and_then(|p| std::fs::canonicalize(p).ok())
}

impl Worker {
    fn new(config: Config, graph: StageGraph, pool: Pool, own: &'static dyn Stage) -> Worker {
        let batch_max = graph
            .stages()
            .filter(|s| builtin_by_name(&s.program).is_some_and(|b| b.name() == own.name()))
            .map(|s| s.queue_limit as usize)
            .max()
            .unwrap_or(1)
            .max(1);
        Worker {
            config,
            graph,
            pool,
            own,
            exe: std::env::current_exe()
                .ok()
                .and_then(|p| std::fs::canonicalize(p).ok()),
            same_binary: HashMap::new(),
            configured: HashMap::new(),
            batch_max,
        }
    }

    /// The built-in a successor's program names, if that program is this very binary
    /// (only then can it run in this process).
    fn fusable_builtin(&mut self, program: &str) -> Option<&'static dyn Stage> {
        let builtin = builtin_by_name(program)?;
        let exe = self.exe.clone()?;
        let same = *self
            .same_binary
            .entry(program.to_string())
            .or_insert_with(|| resolve(program).as_deref() == Some(Path::new(&exe)));
        same.then_some(builtin)
    }

    /// Checks every section this binary implements (§12.1); all problems at once.
    fn check_sections(&mut self) -> Result<(), Failure> {
        let mut problems = Vec::new();
        let sections: Vec<StageSection> = self.graph.stages().cloned().collect();
        for section in &sections {
            let Some(builtin) = builtin_by_name(&section.program) else {
                continue;
            };
            let ours = builtin.name() == self.own.name()
                || self.fusable_builtin(&section.program).is_some();
            if !ours {
                continue;
            }
            if let Err(e) = builtin.configure(section) {
                problems.push(e.to_string());
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Failure::config(format!(
                "invalid stage configuration, refusing to run:\n{}",
                problems.join("\n")
            )))
        }
    }

    /// The stage configured for `stage` with a group's overrides (cached).
    fn ready(
        &mut self,
        stage: &str,
        builtin: &'static dyn Stage,
        group: &Group,
    ) -> Result<Ready, String> {
        let key = (stage.to_string(), settings::cache_key(&group.overrides));
        if let Some(r) = self.configured.get(&key) {
            return r.clone();
        }
        let result = match self.graph.get(stage) {
            None => Err(format!("there is no [stage-{stage}] section")),
            Some(base) => {
                settings::apply(base, &group.overrides, &group.correspondent, &self.graph)
                    .map_err(|e| join_errors(&e))
                    .and_then(|section| {
                        builtin
                            .configure(&section)
                            .map(|body| Ready {
                                section: Rc::new(section),
                                body: Rc::from(body),
                            })
                            .map_err(|e| e.to_string())
                    })
            }
        };
        if self.configured.len() >= CONFIGURED_CACHE {
            self.configured.clear();
        }
        self.configured.insert(key, result.clone());
        result
    }

    fn serve(&mut self, mut input: IdReader) -> Result<(), Failure> {
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
                    Err(e) => return self.load_failed(ids, &e),
                }
            }
            Err(e) => return self.load_failed(ids, &e),
        };
        let mut by_id: HashMap<i64, postgres::Row> =
            rows.into_iter().map(|r| (r.get(0), r)).collect();
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
                Some(row) => {
                    let status: String = row.get(2);
                    if status != "running" {
                        let stage: String = row.get(1);
                        log::warn!("{stage}: message {id} is {status}, not running; left alone");
                        Plan::answer_only(id, protocol::STATUS_OK)
                    } else {
                        match message_from_row(&row, loaded) {
                            Ok(message) => self.run_chain(&mut conn, message, loaded),
                            Err(e) => {
                                let stage: String = row.get(1);
                                let mut plan = Plan {
                                    id,
                                    claimed: stage.clone(),
                                    answer: protocol::STATUS_OK,
                                    report: Vec::new(),
                                    write: Write::Nothing,
                                };
                                let message = Message::new(
                                    id,
                                    stage.clone(),
                                    String::new(),
                                    Vec::new(),
                                    None,
                                    None,
                                    readable_state(&row),
                                    String::new(),
                                );
                                let section = self.graph.get(&stage).cloned();
                                self.handle_error(
                                    &mut plan,
                                    message,
                                    &stage,
                                    section.as_ref(),
                                    StageError::permanent(e),
                                );
                                plan
                            }
                        }
                    }
                }
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

    /// Loading failed. Nothing was committed, and without the rows the worker does not
    /// know their stages to guard a write with, so every id is answered 74 (75 for
    /// overload) and the dispatcher defers it, guarded by the stage it claimed it at.
    fn load_failed(&self, ids: &[i64], err: &postgres::Error) -> Vec<Plan> {
        let answer = status_for(db::classify(err));
        log::warn!(
            "cannot load messages {ids:?}: {}; answering {answer}",
            db::describe(err)
        );
        ids.iter()
            .map(|&id| Plan::answer_only(id, answer))
            .collect()
    }

    /// Writing an outcome failed for a non-connection reason: pause the row at its
    /// claimed stage with the error, as a last resort, so it is retried.
    fn pause_unwritten(&self, conn: &mut PgConn, plan: &Plan, err: &postgres::Error) -> u8 {
        let error = db::storable(&format!("cannot write the outcome: {}", db::describe(err)));
        match conn.query_typed_opt(
            sql::PAUSE_UNWRITTEN,
            &[
                (&plan.id, Type::INT8),
                (&plan.claimed, Type::TEXT),
                (&error, Type::TEXT),
            ],
        ) {
            Ok(row) => {
                match row {
                    Some(row) => log::warn!(
                        "{}: message {}: {error}; paused for {} min",
                        plan.claimed,
                        plan.id,
                        row.get::<_, i64>(0)
                    ),
                    None => log::warn!(
                        "{}: message {}: {error}; it was no longer running there",
                        plan.claimed,
                        plan.id
                    ),
                }
                protocol::STATUS_OK
            }
            Err(e) => {
                log::warn!(
                    "{}: message {}: {error}; cannot pause it either: {}",
                    plan.claimed,
                    plan.id,
                    db::describe(&e)
                );
                status_for(db::classify(&e))
            }
        }
    }

    /// Runs the claimed stage and any fused successors on one message.
    fn run_chain(&mut self, conn: &mut PgConn, mut message: Message, loaded: Load) -> Plan {
        let claimed = message.claimed_stage.clone();
        let mut plan = Plan {
            id: message.id,
            claimed: claimed.clone(),
            answer: protocol::STATUS_OK,
            report: Vec::new(),
            write: Write::Nothing,
        };
        let mut stage = claimed.clone();
        let mut depth = 0;
        loop {
            let base = self.graph.get(&stage).cloned();
            let builtin = base.as_ref().and_then(|s| builtin_by_name(&s.program));
            let unusable = match (&base, builtin) {
                (None, _) => Some(format!("there is no [stage-{stage}] section")),
                (Some(s), None) => Some(format!(
                    "PROGRAM {} is not a built-in stage of this program",
                    s.program
                )),
                (Some(_), Some(b)) if b.loads() > loaded => Some(format!(
                    "stage {stage} needs the message body, which this program does not load"
                )),
                _ => None,
            };
            let (Some(builtin), None) = (builtin, unusable.clone()) else {
                let why = unusable.unwrap_or_default();
                self.handle_error(
                    &mut plan,
                    message,
                    &stage,
                    base.as_ref(),
                    StageError::host(why),
                );
                return plan;
            };
            let mut groups = settings::groups(&message, &stage);
            if groups.len() > 1 {
                // Only the claimed stage splits: fusion refuses a divergent successor.
                match self.split_recipients(conn, &mut message, &groups) {
                    Ok(true) => groups.truncate(1),
                    Ok(false) => return plan,
                    Err(e) => {
                        self.handle_error(&mut plan, message, &stage, base.as_ref(), e);
                        return plan;
                    }
                }
            }
            let ready = match self.ready(&stage, builtin, &groups[0]) {
                Ok(r) => r,
                Err(why) => {
                    let e = StageError::permanent(format!(
                        "the per-address settings of {} make [stage-{stage}] unusable: {why}",
                        groups[0].correspondent
                    ));
                    self.handle_error(&mut plan, message, &stage, base.as_ref(), e);
                    return plan;
                }
            };
            let started = Instant::now();
            let result = ready.body.run(
                &mut message,
                &mut Context {
                    section: &ready.section,
                    client: conn,
                },
            );
            plan.report
                .push((stage.clone(), started.elapsed().as_micros() as u64));
            match result {
                Ok(Outcome::Advance(next)) => {
                    if self.can_fuse(&next, &message, depth, loaded) {
                        stage = next;
                        depth += 1;
                        continue;
                    }
                    plan.write =
                        Write::Update(update_row(&message, &claimed, &next, "pending", None));
                }
                Ok(Outcome::Finish) => plan.write = Write::Delete,
                Ok(Outcome::Pause(delay)) => {
                    plan.write = Write::Update(update_row(
                        &message,
                        &claimed,
                        &stage,
                        "paused",
                        Some(delay),
                    ));
                }
                Ok(Outcome::Split { groups, stage: to }) => {
                    plan.write = Write::Split {
                        groups: json!(groups),
                        stage: to,
                        state: Value::Object(message.state.clone()).to_string(),
                    };
                }
                Err(e) => self.handle_error(&mut plan, message, &stage, Some(&ready.section), e),
            }
            return plan;
        }
    }

    /// Splits the row by per-address settings; `Ok(false)` when the row was taken away.
    fn split_recipients(
        &self,
        conn: &mut PgConn,
        message: &mut Message,
        groups: &[Group],
    ) -> Result<bool, StageError> {
        let json_groups =
            json!(groups.iter().map(|g| &g.recipients).collect::<Vec<_>>()).to_string();
        let new = split_row(
            conn,
            message.id,
            &json_groups,
            &message.claimed_stage,
            None,
            None,
            false,
        )
        .map_err(|e| StageError::from_db(&e))?;
        match new {
            None => {
                log::warn!(
                    "{}: message {} was taken away before its split",
                    message.claimed_stage,
                    message.id
                );
                Ok(false)
            }
            Some(new) => {
                log::info!(
                    "{}: message {} split by per-address settings into {} rows (new: {new:?})",
                    message.claimed_stage,
                    message.id,
                    new.len() + 1
                );
                message.keep_recipients(groups[0].recipients.clone());
                Ok(true)
            }
        }
    }

    /// May `next` run in this pass (§12.6)?
    fn can_fuse(&mut self, next: &str, message: &Message, depth: usize, loaded: Load) -> bool {
        if !self.config.pepsi.allow_fusion || depth + 1 >= MAX_FUSION_DEPTH {
            return false;
        }
        let Some(section) = self.graph.get(next).cloned() else {
            return false;
        };
        let Some(builtin) = self.fusable_builtin(&section.program) else {
            return false;
        };
        if !section.fusion.unwrap_or(builtin.fusion_default()) || builtin.loads() > loaded {
            return false;
        }
        // A later per-address split must clone from a row that carries the rewrite.
        if message.rewritten() && message.rcpt_to().len() > 1 {
            return false;
        }
        let groups = settings::groups(message, next);
        if groups.len() != 1 {
            return false;
        }
        match self.ready(next, builtin, &groups[0]) {
            Ok(ready) => ready.body.fusion_gate(message),
            Err(_) => false,
        }
    }

    /// The error model (§12.4), at the stage that failed; the chain up to it is
    /// committed by the same write (the row moves to that stage).
    fn handle_error(
        &mut self,
        plan: &mut Plan,
        mut message: Message,
        stage: &str,
        section: Option<&StageSection>,
        error: StageError,
    ) {
        let claimed = plan.claimed.clone();
        let id = message.id;
        match error.class {
            ErrorClass::Connection => {
                log::warn!("{stage}: message {id}: database connection lost: {error}");
                plan.answer = protocol::STATUS_IOERR;
            }
            ErrorClass::Overload => {
                log::warn!("{stage}: message {id}: database overloaded: {error}");
                plan.answer = protocol::STATUS_TEMPFAIL;
            }
            ErrorClass::Permanent => {
                log::warn!("{stage}: message {id}: permanent error, failing it: {error}");
                mark_failed(&mut message, stage, "permanent", &error.message);
                plan.write = Write::Update(update_row(&message, &claimed, stage, "failed", None));
                plan.answer = protocol::STATUS_PERMANENT;
            }
            ErrorClass::Host => {
                let max_lifetime =
                    section.map_or(Duration::from_secs(120 * 3600), |s| s.max_lifetime);
                if message.lifetime_age > max_lifetime {
                    mark_failed(&mut message, stage, "retries-exhausted", &error.message);
                    let bounce = section
                        .and_then(|s| s.bounce_stage.clone())
                        .filter(|_| !message.list_copy());
                    match bounce {
                        Some(bounce) => {
                            log::warn!(
                                "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), moving it to {bounce}: {error}",
                                max_lifetime.as_secs()
                            );
                            plan.write = Write::Update(update_row(
                                &message, &claimed, &bounce, "pending", None,
                            ));
                        }
                        None => {
                            log::warn!(
                                "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), failing it: {error}",
                                max_lifetime.as_secs()
                            );
                            plan.write = Write::Update(update_row(
                                &message, &claimed, stage, "failed", None,
                            ));
                            plan.answer = protocol::STATUS_EXHAUSTED;
                        }
                    }
                } else {
                    let same_stage =
                        message.state.get("temporary_stage").and_then(Value::as_str) == Some(stage);
                    let failures = if same_stage {
                        message
                            .state
                            .get("temporary_failures")
                            .and_then(Value::as_u64)
                            .unwrap_or(0) as u32
                            + 1
                    } else {
                        1
                    };
                    let delay = backoff(failures);
                    log::warn!(
                        "{stage}: message {id}: host error, retry {failures} in {} min: {error}",
                        delay.as_secs() / 60
                    );
                    message
                        .state
                        .insert("last_error".into(), json!(error.message));
                    message
                        .state
                        .insert("temporary_failures".into(), json!(failures));
                    message.state.insert("temporary_stage".into(), json!(stage));
                    plan.write =
                        Write::Update(update_row(&message, &claimed, stage, "paused", Some(delay)));
                }
            }
        }
    }

    /// Writes every plan's outcome: splits one by one, then one UPDATE and one DELETE.
    fn commit(&mut self, conn: &mut PgConn, plans: &mut [Plan]) {
        for plan in plans.iter_mut() {
            let Write::Split {
                groups,
                stage,
                state,
            } = &plan.write
            else {
                continue;
            };
            let (groups, stage, state) = (groups.to_string(), stage.clone(), state.clone());
            let result = split_row(
                conn,
                plan.id,
                &groups,
                &plan.claimed,
                Some(&stage),
                Some(&state),
                true,
            );
            match result {
                Ok(None) => {
                    log::warn!(
                        "{}: message {} was taken away; its split was not written",
                        plan.claimed,
                        plan.id
                    );
                }
                Ok(_) => {}
                Err(e) => self.write_failed(conn, std::slice::from_mut(plan), &e),
            }
        }
        let mut updates: Vec<&mut Plan> = plans
            .iter_mut()
            .filter(|p| matches!(p.write, Write::Update(_)))
            .collect();
        self.write_batch(conn, &mut updates, Shape::Update);
        let mut deletes: Vec<&mut Plan> = plans
            .iter_mut()
            .filter(|p| matches!(p.write, Write::Delete))
            .collect();
        self.write_batch(conn, &mut deletes, Shape::Delete);
    }

    fn write_batch(&mut self, conn: &mut PgConn, plans: &mut [&mut Plan], shape: Shape) {
        if plans.is_empty() {
            return;
        }
        match run_shape(conn, plans, shape) {
            Ok(written) => {
                for plan in plans.iter_mut() {
                    if !written.contains(&plan.id) {
                        log::warn!(
                            "{}: message {} was taken away while this worker held it; its outcome was not written",
                            plan.claimed,
                            plan.id
                        );
                        plan.answer = protocol::STATUS_OK;
                    }
                }
            }
            Err(e) if plans.len() > 1 && db::classify(&e) == ErrorKind::Other => {
                // One bad row must not hold up its batch: write them one at a time.
                log::warn!(
                    "batched write failed ({}); writing one message at a time",
                    db::describe(&e)
                );
                for plan in plans.iter_mut() {
                    self.write_batch(conn, std::slice::from_mut(plan), shape);
                }
            }
            Err(e) => {
                for plan in plans.iter_mut() {
                    self.write_failed(conn, std::slice::from_mut(&mut **plan), &e);
                }
            }
        }
    }

    /// A write failed: connection and overload errors are answered as such (nothing was
    /// committed); anything else pauses the row with the error as a last resort.
    fn write_failed(&mut self, conn: &mut PgConn, plans: &mut [Plan], err: &postgres::Error) {
        for plan in plans {
            plan.write = Write::Nothing;
            plan.answer = match db::classify(err) {
                ErrorKind::Connection => {
                    log::warn!(
                        "{}: message {}: database connection lost while writing: {}",
                        plan.claimed,
                        plan.id,
                        db::describe(err)
                    );
                    protocol::STATUS_IOERR
                }
                ErrorKind::Overload => protocol::STATUS_TEMPFAIL,
                _ => self.pause_unwritten(conn, plan, err),
            };
        }
    }
}

/// Calls `workqueue_split` (one round trip); `None` when the guard did not match.
fn split_row(
    conn: &mut PgConn,
    id: i64,
    groups: &str,
    claimed: &str,
    stage: Option<&str>,
    state: Option<&str>,
    release: bool,
) -> Result<Option<Vec<i64>>, postgres::Error> {
    let row = db::retry_transient(|| {
        conn.query_typed_one(
            sql::SPLIT,
            &[
                (&id, Type::INT8),
                (&groups, Type::TEXT),
                (&claimed, Type::TEXT),
                (&stage, Type::TEXT),
                (&state, Type::TEXT),
                (&release, Type::BOOL),
            ],
        )
    })?;
    Ok(row.get(0))
}

#[derive(Clone, Copy)]
enum Shape {
    Update,
    Delete,
}

fn run_shape(
    conn: &mut PgConn,
    plans: &[&mut Plan],
    shape: Shape,
) -> Result<HashSet<i64>, postgres::Error> {
    let rows = match shape {
        Shape::Update => {
            let payload = Value::Array(
                plans
                    .iter()
                    .filter_map(|p| match &p.write {
                        Write::Update(v) => Some(v.clone()),
                        _ => None,
                    })
                    .collect(),
            )
            .to_string();
            db::retry_transient(|| {
                conn.query_typed(sql::WRITE_OUTCOMES, &[(&payload, Type::TEXT)])
            })?
        }
        Shape::Delete => {
            let ids: Vec<i64> = plans.iter().map(|p| p.id).collect();
            let claimed: Vec<String> = plans.iter().map(|p| p.claimed.clone()).collect();
            db::retry_transient(|| {
                conn.query_typed(
                    sql::DELETE_FINISHED,
                    &[(&ids, Type::INT8_ARRAY), (&claimed, Type::TEXT_ARRAY)],
                )
            })?
        }
    };
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}

fn status_for(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Overload => protocol::STATUS_TEMPFAIL,
        _ => protocol::STATUS_IOERR,
    }
}

fn per_message(total: Duration, n: usize) -> u64 {
    (total.as_micros() as u64) / (n.max(1) as u64)
}

fn mark_failed(message: &mut Message, stage: &str, class: &str, error: &str) {
    message
        .state
        .insert("last_error".into(), json!(db::storable(error)));
    message.state.insert("failed_stage".into(), json!(stage));
    message.state.insert("failure_class".into(), json!(class));
}

/// One element of [`sql::WRITE_OUTCOMES`]'s recordset.
fn update_row(
    message: &Message,
    claimed: &str,
    stage: &str,
    status: &str,
    delay: Option<Duration>,
) -> Value {
    let mut row = json!({
        "id": message.id,
        "claimed": claimed,
        "stage": stage,
        "status": status,
        "delay_ms": delay.map(|d| d.as_millis() as u64),
        "state": Value::Object(message.state.clone()),
        "rewritten": message.rewritten(),
    });
    if message.rewritten() {
        row["mail_from"] = json!(message.mail_from());
        row["rcpt_to"] = json!(message.rcpt_to());
        row["header_from"] = json!(message.header_from());
        row["subject"] = json!(message.subject());
    }
    row
}

/// The row's state, when it is readable: kept when the row itself is not usable.
fn readable_state(row: &postgres::Row) -> Map<String, Value> {
    row.try_get::<_, String>(9)
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
    let state_text: String = column(row, 9)?;
    let state = match serde_json::from_str::<Value>(&state_text) {
        Ok(Value::Object(map)) => map,
        _ => return Err(format!("its state is not a JSON object: {state_text}")),
    };
    let mut message = Message::new(
        column(row, 0)?,
        column(row, 1)?,
        column(row, 3)?,
        column(row, 4)?,
        column(row, 7)?,
        column(row, 8)?,
        state,
        column::<Option<String>>(row, 10)?.unwrap_or_default(),
    );
    message.auth_user = column(row, 5)?;
    message.client_ip = column(row, 6)?;
    message.lifetime_age = Duration::from_secs_f64(column::<f64>(row, 11)?.max(0.0));
    message.settings = settings::parse(column::<Option<String>>(row, 12)?.as_deref());
    if loaded == Load::Full {
        message.headers = column(row, 13)?;
        message.body = column(row, 14)?;
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_a_minute_up_to_an_hour() {
        let mins: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs() / 60).collect();
        assert_eq!(mins, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(0), Duration::from_secs(60));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(3600));
    }
}
