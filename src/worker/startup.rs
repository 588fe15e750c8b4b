//! Worker start (SPEC §12.1, §5 steps 1 and 5): load the configuration, open the small
//! pool whose sessions carry the worker's name, check the schema and every stage section
//! this binary implements, print `ready`, then hand stdin to the serve loop.
//!
//! Called by `stages::main` through `runtime::run`. Every failure here becomes a
//! [`Failure`] with its exit status (78 for a schema or configuration mismatch, 74/75
//! for an unreachable or overloaded database); this file must not touch the queue and
//! decides nothing about messages.

use std::io::Write as _;
use std::time::Duration;

use super::Stage;
use super::input::IdReader;
use super::runtime::{Worker, builtin_by_name};
use crate::cli::Globals;
use crate::config::raw::join_errors;
use crate::config::{Config, StageGraph, StageSection};
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

/// The `application_name` of this worker's sessions: `pepsi-worker:PID:STAGE`, where
/// STAGE is the section the dispatcher started it for (`PEPSI_WORKER_STAGE`), or the
/// built-in's own name when started without one (by hand, by a test).
fn session_name(own: &dyn Stage) -> String {
    let stage = std::env::var(protocol::WORKER_STAGE_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| own.name().to_string());
    protocol::worker_session_name(std::process::id(), &stage)
}

/// Runs a worker for the built-in stage `own` until stdin ends.
pub fn run(globals: &Globals, own: &'static dyn Stage) -> Result<(), Failure> {
    let config = Config::load(globals.config.as_deref()).map_err(|errors| {
        Failure::config(format!(
            "configuration error, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    let name = session_name(own);
    let mut pg = db::connection_config(&config.postgres.connection, &name)
        .map_err(|e| Failure::config(format!("[pepsi-postgres] CONNECTION: {e}")))?;
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

impl Worker {
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
}
