//! Worker start (SPEC §12.1, §5 steps 1 and 5): load the configuration, open the small
//! pool whose sessions carry the worker's name, check the schema and the worker's own
//! stage section (SPEC §4 "Strictness": one bad section stops only its own stage), print
//! `ready`, then hand stdin to the serve loop.
//!
//! Called by `stages::main` through `runtime::run`. Every failure here becomes a
//! [`Failure`] with its exit status (78 for a schema or configuration mismatch, 74/75
//! for an unreachable or overloaded database); this file must not touch the queue and
//! decides nothing about messages.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::time::Duration;

use super::Stage;
use super::input::IdReader;
use super::runtime::{Worker, builtin_by_name};
use crate::cli::Globals;
use crate::config::raw::join_errors;
use crate::config::{Config, DbRole, StageSection};
use crate::db::pool::{CheckoutError, Pool};
use crate::db::{self, ErrorKind, schema, sql};
use crate::exit::{self, Failure};
use crate::protocol;

/// Connections in a worker's pool: one serves the loop; a stage may borrow another.
const POOL_SIZE: u32 = 2;
/// How long a worker waits for a connection before answering 74/75.
const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// The stage (`[stage-NAME]` section) the dispatcher started this worker for
/// (`PEPSI_WORKER_STAGE`); `None` when started without one (by hand, by a test).
fn started_for() -> Option<String> {
    std::env::var(protocol::WORKER_STAGE_ENV)
        .ok()
        .filter(|s| !s.is_empty())
}

/// The `application_name` of this worker's sessions: the name the dispatcher gave it
/// in `PGAPPNAME`, by which it terminates them when it kills this worker; started by
/// hand, `pepsi-worker:PID:STAGE`, where STAGE is the section named in
/// `PEPSI_WORKER_STAGE`, or the built-in's own name without one.
fn session_name(own: &dyn Stage, stage: Option<&str>) -> String {
    protocol::own_session_name(stage.unwrap_or(own.name()))
}

/// Runs a worker for the built-in stage `own` until stdin ends.
pub fn run(globals: &Globals, own: &'static dyn Stage) -> Result<(), Failure> {
    let config = Config::load(globals.config.as_deref()).map_err(|errors| {
        Failure::config(format!(
            "configuration error, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    let stage = started_for();
    let name = session_name(own, stage.as_deref());
    let mut pg = db::connection_config(config.postgres.connection_for(DbRole::Worker), &name)
        .map_err(|e| {
            Failure::config(format!("{}: {e}", config.postgres.key_for(DbRole::Worker)))
        })?;
    // Set after parsing so it wins over an application_name in CONNECTION: the
    // dispatcher terminates a killed worker's sessions by this name (§8.2).
    pg.application_name(&name);
    if !config.postgres.worker_synchronous_commit {
        // Group commit across concurrent workers; a lost advance is re-run (§12.1).
        db::append_options(&mut pg, sql::ASYNC_COMMIT_OPTION);
    }
    let pool = Pool::new(pg, POOL_SIZE, CHECKOUT_TIMEOUT);
    let mut conn = pool.get().map_err(|CheckoutError { kind, message }| {
        startup_failure(kind, format!("database: {message}"))
    })?;
    match schema::check(&mut **conn) {
        Ok(()) => {}
        Err(schema::SchemaError::Mismatch(m)) => {
            return Err(Failure::config(format!("refusing to run: {m}")));
        }
        Err(schema::SchemaError::Db(e)) => return Err(db_startup_failure(&e)),
    }
    let overlay = db::read_overlay(&mut **conn).map_err(|e| db_startup_failure(&e))?;
    drop(conn);
    // Refused overlay rows are left out as the dispatcher leaves them out; it logs them
    // (at start and at every reload), so every worker start need not.
    let graph = config.graph(&overlay).map_err(|errors| {
        Failure::config(format!(
            "the stage graph is invalid, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    if config.pepsi.share_telemetry {
        log::debug!("[pepsi] SHARE_TELEMETRY is on");
    }
    let mut worker = Worker::new(config, graph, pool, own);
    for (section, builtin) in worker.check_sections(stage.as_deref())? {
        builtin.start(&worker.config, &section).map_err(|e| {
            Failure::config(format!(
                "[stage-{}] cannot be run, refusing to run: {e}",
                section.name
            ))
        })?;
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}", protocol::READY)
        .and_then(|()| out.flush())
        .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))?;
    drop(out);
    worker.serve(IdReader::stdin(), stage.as_deref().unwrap_or(own.name()))
}

impl Worker {
    /// Checks the worker's own sections (§12.1, §4 "Strictness"), all problems at once:
    /// the section of the stage it was started for, or, started without one, every
    /// section whose `PROGRAM` is this built-in. Never the whole file: one bad section
    /// stops only its own stage. The sections it may fuse into are checked too, but a
    /// bad one only stops fusion into it (`can_fuse` refuses a successor whose
    /// configuration fails), so it is a warning. Returns the own sections with the
    /// built-in each runs as.
    fn check_sections(
        &mut self,
        started_for: Option<&str>,
    ) -> Result<Vec<(StageSection, &'static dyn Stage)>, Failure> {
        let own: Vec<StageSection> = match started_for {
            Some(name) => match self.graph.get(name) {
                Some(section) => vec![section.clone()],
                None => {
                    return Err(Failure::config(format!(
                        "started for stage {name:?} ({}), which has no [stage-{name}] section; refusing to run",
                        protocol::WORKER_STAGE_ENV
                    )));
                }
            },
            None => self
                .graph
                .stages()
                .filter(|s| {
                    builtin_by_name(&s.program).is_some_and(|b| b.name() == self.own.name())
                })
                .cloned()
                .collect(),
        };
        let mut problems = Vec::new();
        let mut checked = Vec::new();
        for section in &own {
            // The claimed stage runs as the built-in its PROGRAM names; a program that is
            // not a built-in (a wrapper the stage was started through) is this one.
            let builtin = builtin_by_name(&section.program).unwrap_or(self.own);
            match builtin.configure(section) {
                Ok(_) => checked.push((section.clone(), builtin)),
                Err(e) => problems.push(e.to_string()),
            }
        }
        if !problems.is_empty() {
            return Err(Failure::config(format!(
                "invalid stage configuration, refusing to run:\n{}",
                problems.join("\n")
            )));
        }
        for (section, builtin) in self.fusable_successors(&own) {
            if let Err(e) = builtin.configure(&section) {
                log::warn!(
                    "{e}; messages will not be fused into stage {}",
                    section.name
                );
            }
        }
        Ok(checked)
    }

    /// The stages reachable from `from` through references that this worker may fuse
    /// into (fusion on, a built-in of this very binary, `FUSION` on), with their
    /// built-ins.
    fn fusable_successors(
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
            if !section.fusion.unwrap_or(builtin.fusion_default()) {
                continue;
            }
            todo.extend(section.references().map(|(_, t)| t.to_string()));
            out.push((section, builtin));
        }
        out
    }
}
