//! One message's pass (§12.5, §12.6): the claimed stage, then every successor that
//! may be fused into the same pass, each configured with the message's per-address
//! overrides; the per-address rows no stage lets a correspondent set, dropped with a
//! warning before anything else reads them; the lazy per-address split before a stage
//! whose recipients diverge; the cache of configured stages; and which programs are
//! this very binary.
//!
//! Owns the [`Runner`]: the stage graph this worker read at start, its stage
//! [`Registry`] and the caches above. Called by `batch.rs` for every loaded, running
//! row ([`Runner::run_chain`]) and by `runtime.rs` at start (the graph, the registry,
//! the sections fusion reaches). The pass decides the outcome and records it in a
//! [`Plan`]; the only database write here is the split (through `writes.rs`, guarded by
//! stage and claim token), which must happen before the stage runs. The terminal write
//! is `writes.rs`'s, the error handling `errors.rs`'s; this file reads no stdin and
//! writes no status line.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use postgres::types::Type;

use serde_json::{Value, json};

use super::errors::handle_error;
use super::maillog::About;
use super::message::Message;
use super::outcome::{Outcome, StageError};
use super::plan::{Plan, Write, update_row};
use super::recipients;
use super::record::{self, Event, Handed};
use super::registry::Registry;
use super::settings::{self, Group};
use super::stage::{Configured, Context, Load, Stage};
use super::writes::split_row;
use crate::config::graph::{MAX_FUSION_DEPTH, may_be_fused_into};
use crate::config::raw::join_errors;
use crate::config::{Config, StageGraph, StageSection};
use crate::db::pool::PgConn;
use crate::db::{self, sql};
use crate::escape::Visible;

/// Configured stages cached per (stage, per-address overrides), cleared beyond this.
const CONFIGURED_CACHE: usize = 1024;
/// Ignored per-address rows remembered as warned about, forgotten beyond this (a row
/// then warns once more).
const IGNORED_REMEMBERED: usize = 10_000;

/// How long into a batch its chains may still go on into a stage that needs what the
/// batch did not load (a body, for a stage that sends the message on): the batch's
/// answers go out together, so a slow destination must not hold its first message's
/// answer near the dispatcher's `MAX_RUNTIME`. A later row of a slow batch advances
/// as an ordinary hop, to that stage's own workers (§12.6).
const LATE_LOAD_BUDGET: Duration = Duration::from_secs(2);

/// A stage configured for one effective section.
#[derive(Clone)]
struct Ready {
    section: Rc<StageSection>,
    body: Rc<dyn Configured>,
}

/// Runs messages through their chains of stages: everything a pass needs that outlives
/// one message.
pub(super) struct Runner {
    /// The loaded configuration (`[pepsi]`: fusion on or off, the stages' context).
    config: Config,
    /// The stage graph with the `pepsi.config_override` overlay, read at start.
    graph: StageGraph,
    /// The stages this program implements: which ones it can run, and fuse.
    registry: Registry,
    /// This binary, canonical, to tell which successors can run in this process.
    exe: Option<PathBuf>,
    /// Per program: does it resolve to this very binary?
    same_binary: HashMap<String, bool>,
    /// Stages configured per (stage, per-address overrides).
    configured: HashMap<(String, String), Result<Ready, String>>,
    /// The `pepsi.settings` rows (address, stage, key) already warned about as
    /// ignored, so a busy address warns once per worker process.
    ignored_settings: HashSet<(String, String, String)>,
    /// Stages this process could not prepare to run ([`Stage::start`]): never fused.
    unfusable: HashSet<String>,
    /// When the batch being run began ([`Runner::begin_batch`]).
    batch_started: Instant,
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

impl Runner {
    /// A runner for a checked configuration and its stage graph, running the stages of
    /// `registry`.
    pub(super) fn new(config: Config, graph: StageGraph, registry: Registry) -> Runner {
        Runner {
            config,
            graph,
            registry,
            exe: std::env::current_exe()
                .ok()
                .and_then(|p| std::fs::canonicalize(p).ok()),
            same_binary: HashMap::new(),
            configured: HashMap::new(),
            ignored_settings: HashSet::new(),
            unfusable: HashSet::new(),
            batch_started: Instant::now(),
        }
    }

    /// A batch begins: its chains go on into stages that need more than it loaded only
    /// for [`LATE_LOAD_BUDGET`] from now.
    pub(super) fn begin_batch(&mut self) {
        self.batch_started = Instant::now();
    }

    /// Never fuses into `stage` (it could not be prepared in this process).
    pub(super) fn not_fusable(&mut self, stage: &str) {
        self.unfusable.insert(stage.to_string());
    }

    /// The loaded configuration.
    pub(super) fn config(&self) -> &Config {
        &self.config
    }

    /// The stage graph read at start.
    pub(super) fn graph(&self) -> &StageGraph {
        &self.graph
    }

    /// What the stages of this program counted in this process that their message
    /// outcomes do not show ([`Stage::summary`]), one line each.
    pub(super) fn summaries(&self) -> Vec<String> {
        self.registry
            .stages()
            .iter()
            .filter_map(|s| s.summary())
            .collect()
    }

    /// The stage a section's `PROGRAM` names in this program's registry.
    pub(super) fn stage_of(&self, program: &str) -> Option<&'static dyn Stage> {
        self.registry.for_program(program)
    }

    /// The stage a successor's program names, if that program is this very binary
    /// (only then can it run in this process).
    fn fusable_builtin(&mut self, program: &str) -> Option<&'static dyn Stage> {
        let builtin = self.registry.for_program(program)?;
        let exe = self.exe.clone()?;
        let same = *self
            .same_binary
            .entry(program.to_string())
            .or_insert_with(|| resolve(program).as_deref() == Some(Path::new(&exe)));
        same.then_some(builtin)
    }

    /// The stages reachable from `from` through references that this worker may fuse
    /// into (fusion on, a stage of this very binary, `FUSION` on, no `COMMAND`), with
    /// their stages.
    pub(super) fn fusable_successors(
        &mut self,
        from: &[StageSection],
    ) -> Vec<(StageSection, &'static dyn Stage)> {
        let mut out = Vec::new();
        if !self.config.pepsi.allow_fusion {
            return out;
        }
        let mut seen: BTreeSet<String> = from.iter().map(|s| s.name.clone()).collect();
        let mut todo: Vec<String> = from
            .iter()
            .flat_map(|s| s.references().map(|(_, target)| target.to_string()))
            .collect();
        while let Some(name) = todo.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let Some(section) = self.graph.get(&name).cloned() else {
                continue;
            };
            let Some(builtin) = self.fusable_builtin(&section.program) else {
                continue;
            };
            if !fuses_into(&section, builtin) {
                continue;
            }
            todo.extend(section.references().map(|(_, t)| t.to_string()));
            out.push((section, builtin));
        }
        out
    }

    /// Drops the message's per-address rows that their stage does not let a
    /// correspondent override (§4 "Least privilege"), before they can apply or
    /// split the message. Each dropped row is a warning naming it, once per worker
    /// process (rows are judged by the stage graph this worker read at start).
    pub(super) fn drop_refused_settings(&mut self, message: &mut Message) {
        let graph = &self.graph;
        let registry = self.registry;
        let warned = &mut self.ignored_settings;
        message.settings.retain(|row| {
            let program = graph.get(&row.stage).map(|s| s.program.as_str());
            if settings::applies(registry, &row.key, program) {
                return true;
            }
            if warned.len() >= IGNORED_REMEMBERED {
                warned.clear();
            }
            if warned.insert((row.address.clone(), row.stage.clone(), row.key.clone())) {
                if let Some(refused) = settings::refusal(registry, row, program) {
                    log::warn!("{refused} (message {}; warned once per worker)", message.id);
                }
            }
            false
        });
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

    /// Runs the claimed stage and any fused successors on one message.
    pub(super) fn run_chain(
        &mut self,
        conn: &mut PgConn,
        mut message: Message,
        mut loaded: Load,
    ) -> Plan {
        let claimed = message.claimed_stage.clone();
        let mut plan = Plan::for_message(&message);
        let mut stage = claimed.clone();
        let mut depth = 0;
        // Time spent loading what a fused stage needed, counted as that stage's.
        let mut late_load = Duration::ZERO;
        loop {
            let base = self.graph.get(&stage).cloned();
            let builtin = base
                .as_ref()
                .and_then(|s| self.registry.for_program(&s.program));
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
                handle_error(
                    &mut plan,
                    message,
                    &stage,
                    base.as_ref(),
                    StageError::host(why),
                );
                return plan;
            };
            // A row split by a per-recipient outcome carries its verdict: it takes its
            // outcome from there and never runs the stage for those recipients again.
            let recorded = if depth == 0 {
                recipients::take_recorded(&mut message, &stage)
            } else {
                None
            };
            if let Some(outcomes) = recorded {
                log::info!(
                    "{stage}: message {}: outcome per recipient as recorded at its split",
                    message.id
                );
                plan.report.push((stage.clone(), 0));
                let section = base.clone();
                let result = recipients::settle(conn, &mut message, &mut plan, &stage, outcomes);
                let Some(result) = result else {
                    return plan;
                };
                self.conclude(&mut plan, message, &stage, section.as_ref(), result);
                return plan;
            }
            let mut groups = settings::groups(&message, &stage);
            if groups.len() > 1 {
                // Only the claimed stage splits: fusion refuses a divergent successor.
                match split_recipients(conn, &mut message, &groups) {
                    Ok(true) => groups.truncate(1),
                    Ok(false) => return plan,
                    Err(e) => {
                        handle_error(&mut plan, message, &stage, base.as_ref(), e);
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
                    handle_error(&mut plan, message, &stage, base.as_ref(), e);
                    return plan;
                }
            };
            let started = Instant::now();
            let mut cx = Context {
                section: &ready.section,
                client: conn,
                pepsi: &self.config.pepsi,
                counted: Vec::new(),
            };
            let result = ready.body.run(&mut message, &mut cx);
            plan.count(&stage, &cx.counted);
            let spent = started.elapsed() + std::mem::take(&mut late_load);
            plan.report.push((stage.clone(), spent.as_micros() as u64));
            let result = match result {
                Ok(Outcome::Recipients(outcomes)) => {
                    match recipients::settle(conn, &mut message, &mut plan, &stage, outcomes) {
                        Some(result) => result,
                        None => return plan,
                    }
                }
                other => other,
            };
            if let Ok(Outcome::Advance(next)) = &result {
                let load_started = Instant::now();
                let fuse = match self.can_fuse(next, &message, depth, loaded) {
                    Some(needs) if needs > loaded => {
                        late_content(conn, &mut message).then_some(needs)
                    }
                    Some(_) => Some(loaded),
                    None => None,
                };
                if let Some(now_loaded) = fuse {
                    loaded = now_loaded;
                    late_load = load_started.elapsed();
                    // What this stage handed on is recorded here, at this stage; the
                    // next one's outcome is its own.
                    if let Some(handed) = plan.handed.take() {
                        plan.about = About::of(&message);
                        plan.records.extend(record::records(
                            &message,
                            &stage,
                            Event::Delivered,
                            Some(&handed),
                            None,
                            "2.0.0",
                            plan.timing,
                        ));
                    }
                    stage = next.clone();
                    depth += 1;
                    continue;
                }
            }
            self.conclude(&mut plan, message, &stage, Some(&ready.section), result);
            return plan;
        }
    }

    /// Records a stage's final outcome (or error) of this pass in the plan, guarded by
    /// the plan's claimed stage.
    fn conclude(
        &self,
        plan: &mut Plan,
        message: Message,
        stage: &str,
        section: Option<&StageSection>,
        result: Result<Outcome, StageError>,
    ) {
        let claimed = plan.claimed.clone();
        // What the records' lines say of the message, made only for an outcome that
        // records (an error's are made by `handle_error`): not for every hop.
        let records = match &result {
            Ok(Outcome::Finish | Outcome::Pause(_)) => true,
            Ok(Outcome::Advance(_)) => plan.handed.is_some(),
            _ => false,
        };
        if records {
            plan.about = About::of(&message);
        }
        let delivers = section
            .and_then(|s| self.registry.for_program(&s.program))
            .is_none_or(|b| b.delivers());
        match result {
            Ok(Outcome::Advance(next)) => {
                if plan.handed.is_some() {
                    plan.records.extend(record::records(
                        &message,
                        stage,
                        Event::Delivered,
                        plan.handed.as_ref(),
                        None,
                        "2.0.0",
                        plan.timing,
                    ));
                }
                plan.write = Write::Update(update_row(&message, &claimed, &next, "pending", None));
            }
            Ok(Outcome::Finish) => {
                let event = if plan.handed.is_some() || delivers {
                    Event::Delivered
                } else {
                    Event::Discarded
                };
                // A stage that delivers itself (`exec`) is its own relay, as Postfix's
                // pipe(8) names its transport.
                let own = Handed {
                    relay: Some(stage.to_string()),
                    replies: Default::default(),
                };
                let (handed, reason) = match (&plan.handed, event) {
                    (Some(h), _) => (Some(h), None),
                    (None, Event::Delivered) => (Some(&own), Some(format!("delivered by {stage}"))),
                    (None, _) => (None, Some(format!("discarded by {stage}"))),
                };
                plan.records.extend(record::records(
                    &message,
                    stage,
                    event,
                    handed,
                    reason.as_deref(),
                    "2.0.0",
                    plan.timing,
                ));
                plan.write = Write::Delete;
            }
            Ok(Outcome::Pause(delay)) => {
                let reason = format!("delivery paused by {stage} for {}s", delay.as_secs());
                plan.records.extend(record::records(
                    &message,
                    stage,
                    Event::Deferred,
                    plan.handed.as_ref(),
                    Some(&reason),
                    "4.0.0",
                    plan.timing,
                ));
                plan.write =
                    Write::Update(update_row(&message, &claimed, stage, "paused", Some(delay)));
            }
            Ok(Outcome::Split { groups, stage: to }) => {
                plan.write = Write::Split {
                    groups: json!(groups),
                    stage: to,
                    state: Value::Object(message.state.clone()).to_string(),
                };
            }
            Ok(Outcome::Bounce(notification)) => plan.write = Write::Bounce(notification),
            Ok(Outcome::Recipients(_)) => {
                unreachable!("recipients::settle turns a per-recipient outcome into one outcome")
            }
            Err(e) => handle_error(plan, message, stage, section, e),
        }
    }

    /// May `next` run in this pass (§12.6)? Then what it loads: when that is more
    /// than the pass has, the caller loads the rest by the row's id (the amendment of
    /// §12.6), which this allows only within the batch's [`LATE_LOAD_BUDGET`].
    fn can_fuse(
        &mut self,
        next: &str,
        message: &Message,
        depth: usize,
        loaded: Load,
    ) -> Option<Load> {
        if !self.config.pepsi.allow_fusion
            || depth + 1 >= MAX_FUSION_DEPTH
            || self.unfusable.contains(next)
        {
            return None;
        }
        let section = self.graph.get(next).cloned()?;
        let builtin = self.fusable_builtin(&section.program)?;
        if !fuses_into(&section, builtin) {
            return None;
        }
        let needs = builtin.loads();
        if needs > loaded && self.batch_started.elapsed() >= LATE_LOAD_BUDGET {
            return None;
        }
        // A later per-address split must clone from a row that carries the rewrite.
        if message.rewritten() && message.rcpt_to().len() > 1 {
            return None;
        }
        let groups = settings::groups(message, next);
        if groups.len() != 1 {
            return None;
        }
        match self.ready(next, builtin, &groups[0]) {
            Ok(ready) if ready.body.fusion_gate(message) => Some(needs),
            _ => None,
        }
    }
}

/// Loads the header block and body of a row whose pass goes on into a stage that needs
/// them: one read, no write. False when it cannot be had (the row was taken away, or
/// the read failed: the connection's trouble then meets the chain's write too): the
/// chain ends with an ordinary hop.
fn late_content(conn: &mut PgConn, message: &mut Message) -> bool {
    match read_content(conn, message) {
        Ok(read) => read,
        Err(e) => {
            log::warn!(
                "{}: message {}: cannot load its content: {}; not fused",
                Visible(&message.claimed_stage),
                message.id,
                db::describe(&e)
            );
            false
        }
    }
}

/// Reads the header block and body of a running row into its message
/// ([`sql::LOAD_CONTENT`], guarded by the claimed stage), after any header fields this
/// pass prepended. `Ok(false)`: the row is no longer running there.
pub(super) fn read_content(
    conn: &mut PgConn,
    message: &mut Message,
) -> Result<bool, postgres::Error> {
    let (id, stage) = (message.id, message.claimed_stage.clone());
    let rows = db::retry_transient(|| {
        conn.query_prepared(sql::LOAD_CONTENT, &[Type::INT8, Type::TEXT], &[&id, &stage])
    })?;
    let Some(row) = rows.first() else {
        return Ok(false);
    };
    message.set_late_content(row.try_get(0)?, row.try_get(1)?);
    Ok(true)
}

/// Splits the row by per-address settings, guarded by the claimed stage and the claim
/// token; `Ok(false)` when the row was taken away.
fn split_recipients(
    conn: &mut PgConn,
    message: &mut Message,
    groups: &[Group],
) -> Result<bool, StageError> {
    let json_groups = json!(groups.iter().map(|g| &g.recipients).collect::<Vec<_>>()).to_string();
    let new = split_row(
        conn,
        message.id,
        &json_groups,
        &message.claimed_stage,
        message.claim,
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

/// Does `section`, a stage of this binary, let a predecessor's pass fuse into it? Its
/// `FUSION` (else the program's default) says so, and never a stage that runs a
/// `COMMAND`: that command runs only through its own stage's keeper (§4
/// "Containment"; the graph refuses `FUSION = yes` on such a stage, this holds even
/// without it).
fn fuses_into(section: &StageSection, builtin: &dyn Stage) -> bool {
    may_be_fused_into(section) && section.fusion.unwrap_or(builtin.fusion_default())
}
