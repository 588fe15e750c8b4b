//! The worker runtime's entry point (§5, §12.1): [`run`], which a stage program's
//! `main` calls with the [`Registry`] of the stages it implements and the one it was
//! started as. Worker start, then the serve loop: load the configuration, open the
//! small pool whose sessions carry the worker's name, check the schema and the worker's
//! own stage section (§4 "Strictness": one bad section stops only its own stage),
//! prepare each own stage, print `ready`, then hand stdin to the serve loop.
//!
//! Called by `src/bin/pepsi-stage.rs` (with the built-ins' registry) and by any other
//! stage program linking this library. Every failure here becomes a [`Failure`] with
//! its exit status (78 for a schema or configuration mismatch, 74/75 for an
//! unreachable or overloaded database); this file must not touch the queue, decides
//! nothing about messages, and never exits the process itself.
//!
//! The runtime is cut by concern, one file each (the map is in the `worker` module):
//! `batch.rs` the serve loop and one batch, `chain.rs` one message's chain of stages,
//! `errors.rs` the error model, `writes.rs` the guarded writes, `plan.rs` what a batch
//! entry writes and answers.
//!
//! Per batch of ids: one SELECT loads the rows with their per-address settings and the
//! claim token each was claimed under; each row runs its chain of stages in this process
//! (the claimed stage, then any fused successors); then one UPDATE writes every
//! update-shaped outcome and one DELETE every finished message, each guarded by
//! `status = 'running' AND stage = <claimed stage> AND claim = <token>`; then one status
//! line per id, in input order, a slow batch's early part committed and answered first
//! (§12.3).

use std::io::Write as _;
use std::time::Duration;

use super::batch::Server;
use super::chain::Runner;
use super::input::IdReader;
use super::stage::Stage;
use crate::cli::Globals;
use crate::config::raw::join_errors;
use crate::config::{Config, DbRole, StageGraph, StageSection};
use crate::db::pool::{CheckoutError, Pool};
use crate::db::{self, ErrorKind, schema};
use crate::durability::SynchronousCommit;
use crate::exit::{self, Failure};
use crate::protocol;

pub use super::errors::backoff;
pub use super::registry::{PROGRAM_PREFIX, Registry};

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
/// `PEPSI_WORKER_STAGE`, or the stage's own name without one.
fn session_name(own: &dyn Stage, stage: Option<&str>) -> String {
    protocol::own_session_name(stage.unwrap_or(own.name()))
}

/// The settings of this worker's sessions: the worker role's connection, named as the
/// dispatcher knows this worker. For the pool, and for a stage that keeps a session of
/// its own beside it (relay-to-internet's connection slots), which the dispatcher then
/// terminates with the others when it kills this worker.
pub fn session_settings(config: &Config, own: &dyn Stage) -> Result<postgres::Config, String> {
    let name = session_name(own, started_for().as_deref());
    let mut pg = db::connection_config(config.postgres.connection_for(DbRole::Worker), &name)
        .map_err(|e| format!("{}: {e}", config.postgres.key_for(DbRole::Worker)))?;
    // Set after parsing so it wins over an application_name in CONNECTION: the
    // dispatcher terminates a killed worker's sessions by this name (§8.2).
    pg.application_name(&name);
    Ok(pg)
}

/// The first thing a stage program does, before it reads anything (§4
/// "Containment"): it makes itself not dumpable, so that no other process of its
/// account — a sibling worker — can attach to it or take its descriptors (the launcher
/// starts it so from its exec when it switches accounts; this holds for a worker
/// started otherwise too); it re-arms its death signal, which a start under another
/// account clears, and exits at once when the dispatcher that started it is gone
/// already; and its handed configuration's descriptor closes at any exec of its own.
pub fn harden() {
    // SAFETY: prctl, getppid and fcntl with constant arguments.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0);
        let dispatcher = std::env::var(crate::launcher::DISPATCHER_PID_ENV)
            .ok()
            .and_then(|p| p.parse::<libc::pid_t>().ok());
        if let Some(dispatcher) = dispatcher {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != dispatcher {
                eprintln!("the dispatcher that started this worker is gone; exiting");
                libc::_exit(exit::EX_TEMPFAIL as i32);
            }
        }
        libc::fcntl(crate::launcher::CONFIG_FD, libc::F_SETFD, libc::FD_CLOEXEC);
    }
}

/// Runs a worker for the stage `own`, one of `registry` (the stages this program
/// implements, which it may fuse), until stdin ends.
pub fn run(globals: &Globals, registry: Registry, own: &'static dyn Stage) -> Result<(), Failure> {
    let config = Config::load(globals.config.as_deref()).map_err(|errors| {
        Failure::config(format!(
            "configuration error, refusing to run:\n{}",
            join_errors(&errors)
        ))
    })?;
    let stage = started_for();
    let mut pg = session_settings(&config, own).map_err(Failure::config)?;
    // The start-up session stays in the pool; it gets its `SYNCHRONOUS_COMMIT` once the
    // stages the worker runs are known, and so do the connections made after it.
    let pool = Pool::new(pg.clone(), POOL_SIZE, CHECKOUT_TIMEOUT);
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
    let batch_max = batch_max(&graph, registry, own);
    super::maillog::init(&config.pepsi);
    let mut runner = Runner::new(config, graph, registry);
    let (sections, successors, durability) = check_sections(&mut runner, own, stage.as_deref())?;
    // `off` (the default): group commit across concurrent workers, a lost outcome is
    // run again (§12.1); a stage with side effects outside the database may ask for
    // more, and a worker that may fuse into it commits at its level (§12.2).
    db::append_options(&mut pg, durability.option());
    pool.reconfigure(pg);
    conn.batch_execute(durability.set_statement())
        .map_err(|e| db_startup_failure(&e))?;
    drop(conn);
    for (section, stage) in sections {
        stage.start(runner.config(), &section).map_err(|e| {
            Failure::config(format!(
                "[stage-{}] cannot be run, refusing to run: {e}",
                section.name
            ))
        })?;
    }
    // A stage this worker may fuse into is prepared as well (its keys read); one that
    // cannot be is not fused into, and runs in its own workers, which say why.
    for (section, stage) in successors {
        if let Err(e) = stage.start(runner.config(), &section) {
            log::warn!(
                "[stage-{}] cannot be run in this worker: {e}; messages will not be fused into stage {}",
                section.name,
                section.name
            );
            runner.not_fusable(&section.name);
        }
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}", protocol::READY)
        .and_then(|()| out.flush())
        .map_err(|e| Failure::general(format!("cannot write to stdout: {e}")))?;
    drop(out);
    let mut server = Server::new(runner, pool, own.loads(), batch_max);
    server.serve(IdReader::stdin(), stage.as_deref().unwrap_or(own.name()))
}

/// The largest batch a metadata-only stage `own` takes: the greatest `QUEUE_LIMIT` of
/// the sections that run as it, at least 1.
fn batch_max(graph: &StageGraph, registry: Registry, own: &dyn Stage) -> usize {
    graph
        .stages()
        .filter(|s| {
            registry
                .for_program(&s.program)
                .is_some_and(|b| b.name() == own.name())
        })
        .map(|s| s.queue_limit as usize)
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Checks the worker's own sections (§12.1, §4 "Strictness"), all problems at once: the
/// section of the stage it was started for, or, started without one, every section
/// whose `PROGRAM` is the stage `own`. Never the whole file: one bad section stops only
/// its own stage. The sections it may fuse into are checked too, but a bad one only
/// stops fusion into it (`can_fuse` refuses a successor whose configuration fails), so
/// it is a warning. Returns the own sections with the stage each runs as, and the
/// strongest `synchronous_commit` level of the stages its commits record outcomes of
/// (its own and those it may fuse into), with the sections it may fuse into that
/// check.
fn check_sections(
    runner: &mut Runner,
    own: &'static dyn Stage,
    started_for: Option<&str>,
) -> Result<(Checked, Checked, SynchronousCommit), Failure> {
    let sections: Vec<StageSection> = match started_for {
        Some(name) => match runner.graph().get(name) {
            Some(section) => vec![section.clone()],
            None => {
                return Err(Failure::config(format!(
                    "started for stage {name:?} ({}), which has no [stage-{name}] section; refusing to run",
                    protocol::WORKER_STAGE_ENV
                )));
            }
        },
        None => runner
            .graph()
            .stages()
            .filter(|s| {
                runner
                    .stage_of(&s.program)
                    .is_some_and(|b| b.name() == own.name())
            })
            .cloned()
            .collect(),
    };
    let mut problems = Vec::new();
    let mut checked = Vec::new();
    for section in &sections {
        // The claimed stage runs as the stage its PROGRAM names; a program that is not
        // one of the registry's (a wrapper the stage was started through) is `own`.
        let stage = runner.stage_of(&section.program).unwrap_or(own);
        match stage.configure(section) {
            Ok(_) => checked.push((section.clone(), stage)),
            Err(e) => problems.push(e.to_string()),
        }
    }
    if !problems.is_empty() {
        return Err(Failure::config(format!(
            "invalid stage configuration, refusing to run:\n{}",
            problems.join("\n")
        )));
    }
    let postgres = &runner.config().postgres;
    let mut durability = sections
        .iter()
        .map(|s| postgres.stage_durability(s))
        .max()
        .unwrap_or(SynchronousCommit::Off);
    let mut successors = Vec::new();
    for (section, stage) in runner.fusable_successors(&sections) {
        match stage.configure(&section) {
            Ok(_) => {
                let level = runner.config().postgres.stage_durability(&section);
                durability = durability.max(level);
                successors.push((section, stage));
            }
            Err(e) => log::warn!(
                "{e}; messages will not be fused into stage {}",
                section.name
            ),
        }
    }
    Ok((checked, successors, durability))
}

/// A worker's own sections, each with the stage it runs as.
type Checked = Vec<(StageSection, &'static dyn Stage)>;
