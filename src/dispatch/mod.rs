//! `pepsi-dispatch serve`: the one long-running process per system that claims pending
//! messages and hands their ids to elastic pools of worker processes (§6–§11).
//!
//! Threads, each owning its state and talking over crossbeam channels:
//! - the loop thread ([`event_loop`]) owns every mutable thing of the loop in one
//!   struct, `Dispatcher`, made of three owners changed only through their verbs:
//!   [`pools`] (the stage pools and the worker processes), [`claim_side`] (the claim
//!   gate, the paused clock, the rows deferred for 74 and the claim [`ledger`]) and
//!   [`housekeeping`] (the thread pool's chores). It polls the child pipes, the signal
//!   sockets ([`crate::signals`]) and a `mio::Waker`;
//! - the coordinator ([`coordinator`], its statements in [`statements`]) owns the
//!   claiming connection and the advisory lock ([`session`]) and performs every queue
//!   write, serially;
//! - the listener ([`listener`]) owns the LISTEN session;
//! - a small thread pool ([`background`]) flushes statistics ([`stats`]), runs the body
//!   GC and reads a reload's inputs (the overlay and the file).
//!
//! Other threads send [`events::Event`]s and wake the loop; the loop sends commands
//! and jobs. A helper thread that dies makes the loop shut down cleanly with exit 70.
//! Nothing here is async.
//!
//! The loop's files, by role:
//! - handlers, each an `impl Dispatcher` of one concern (the table in [`event_loop`]
//!   names every handler and its file): [`claims`], [`workers`], [`reload`],
//!   [`shutdown`];
//! - owners of the loop's state, with verbs: [`pools`], [`claim_side`],
//!   [`housekeeping`], [`ledger`];
//! - pure decisions: [`pool`] (capacity, picking a worker, cooldowns, the retire and
//!   throttle rules), [`verdict`] (a worker's end), [`timers`] (every deadline),
//!   [`scheduler`] and [`fair`] (which rows a claim takes), [`floors`] (where each
//!   stage's pick starts), [`reload`]'s plan;
//! - mechanism: [`process`] (one worker process);
//! - vocabulary shared by many, using none of them back: [`claim`] (the claim record),
//!   [`worker_view`] (a worker's phase and view), [`events`] (the loop's messages).
//!
//! Dependencies go one way: handlers use the loop and the owners; the loop uses the
//! owners; owners use the decisions, the mechanism and the vocabulary; no two files use
//! each other, directly or through a chain. `pepsi-dispatch check` is [`crate::check`].

pub mod background;
pub mod claim;
pub mod claim_side;
pub mod claims;
pub mod coordinator;
pub mod event_loop;
pub mod events;
pub mod fair;
pub mod floors;
pub mod horizon;
pub mod housekeeping;
pub mod ledger;
pub mod listener;
pub mod pool;
pub mod pools;
pub mod process;
pub mod rates;
pub mod reload;
pub mod scheduler;
pub mod session;
pub mod shares;
pub mod shutdown;
pub mod statements;
pub mod stats;
pub mod timers;
pub mod verdict;
pub mod weights;
pub mod worker_view;
pub mod workers;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::check;
use crate::cli::{Invocation, Program};
use crate::config::raw::join_errors;
use crate::config::{Config, DbRole};
use crate::db::{self, pool::Pool};
use crate::exit::Failure;
use crate::signals;

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-dispatch",
    synopsis: "serve | check [--overlay SECTION KEY VALUE]",
    about: "serve: runs the Pepsi dispatcher until SIGINT or SIGTERM: claims pending messages from pepsi.workqueue \
            and hands their ids to pools of stage workers. Exactly one per database. SIGHUP reloads the \
            stage configuration.\nExit status: 0 clean shutdown, 1 an error at start (configuration, database, \
            lock held by another dispatcher), 70 a helper thread died (after a clean shutdown), 78 an invalid \
            stage graph at a reload or a schema mismatch.\n\
            check: checks the configuration without starting anything (the file, pepsi.config_override, the \
            stage graph, every built-in stage's section, that each PROGRAM is executable by RUN_AS, that \
            [pepsi-failure-bouncer] BOUNCE_STAGE names a stage, overlay PROGRAM rows outside [pepsi] PROGRAM_PATH, \
            pepsi.settings rows the workers ignore, the schema) \
            and prints every problem. --overlay SECTION KEY VALUE (repeatable) checks it as if that overlay row \
            were written (an empty VALUE unsets the key), without writing it.\nExit status: 0 no errors \
            (warnings allowed), 78 errors, 64 a usage error.",
};

/// How long the thread pool waits for a connection.
const POOL_CHECKOUT: Duration = Duration::from_secs(10);

/// Runs `pepsi-dispatch serve`.
pub fn run(invocation: Invocation) -> Result<(), Failure> {
    invocation.expect_only(&PROGRAM, &["serve"])?;
    let config = Config::load_or_fail(invocation.globals.config.as_deref())?;
    // The launcher starts and kills the workers; started as root, it keeps root to run
    // them as WORKER_AS and exec commands as their stages' USER (§4
    // "Containment"). It must be forked now, while this process has one thread and,
    // when root, before it drops its privileges; nothing else keeps root.
    // SAFETY: geteuid has no preconditions.
    let workers = if unsafe { libc::geteuid() } == 0 {
        match crate::privilege::worker_account(&config.pepsi.run_as, &config.pepsi.worker_as) {
            Ok(Some(account)) => crate::launcher::Workers::As {
                account,
                real_gid: crate::launcher::overflow_gid(),
            },
            // RUN_AS = root keeps root for everything (its warning is drop_to's).
            Ok(None) => crate::launcher::Workers::AsLauncher,
            Err(e) => return Err(Failure::general(e)),
        }
    } else {
        crate::launcher::Workers::AsLauncher
    };
    let workers_as = match &workers {
        crate::launcher::Workers::As { account, .. } => Some(account.name.clone()),
        crate::launcher::Workers::AsLauncher => None,
    };
    let launcher = crate::launcher::Launcher::start(&config.path, workers)
        .map_err(|e| Failure::general(format!("cannot start the launcher: {e}")))?;
    crate::privilege::drop_to(&config.pepsi.run_as)?;
    // Reloads read the file as RUN_AS: a file only root can read would only fail later,
    // at the first reload.
    std::fs::File::open(&config.path).map_err(|e| {
        Failure::general(format!(
            "{}: cannot be read as RUN_AS {} ({e}); reloads read it as that account",
            config.path.display(),
            config.pepsi.run_as
        ))
    })?;
    // Before the wait for the database and the lock: a SIGHUP or SIGTERM now must not
    // kill the process half-started (a shutdown signal ends the wait; the loop acts on
    // a reload once it runs).
    let mut signals = signals::install()?;
    let target = session::Target::of(&config);
    let conninfo = target.conninfo.clone();
    let started = session::start(&target, |delay| {
        signals::wait_for(&mut signals.shutdown, delay)
    })?;
    let Some((client, overlay)) = started else {
        log::info!("shutdown requested by signal while waiting for the database");
        return Ok(());
    };
    let graph = config.graph(&overlay).map_err(|errors| {
        Failure::general(format!(
            "the stage graph is invalid:\n{}",
            join_errors(&errors)
        ))
    })?;
    check::at_start(&config, &overlay, &graph)?;
    let poll =
        mio::Poll::new().map_err(|e| Failure::general(format!("cannot create the poller: {e}")))?;
    let waker = Arc::new(
        mio::Waker::new(poll.registry(), event_loop::WAKER_TOKEN)
            .map_err(|e| Failure::general(format!("cannot create the waker: {e}")))?,
    );
    let (event_tx, event_rx) = crossbeam_channel::unbounded();
    let events = events::EventSender::new(event_tx, waker);
    let (command_tx, command_rx) = crossbeam_channel::unbounded();
    let thread_err = |e: std::io::Error| Failure::general(format!("cannot start a thread: {e}"));
    let stopping = Arc::new(AtomicBool::new(false));
    let pg = db::connection_config(&conninfo, "pepsi-dispatch").map_err(|e| {
        Failure::general(format!(
            "{}: {e}",
            config.postgres.key_for(DbRole::Dispatch)
        ))
    })?;
    let pool = Pool::new(pg, config.dispatch.db_pool_size, POOL_CHECKOUT);
    coordinator::spawn(coordinator::Parts {
        client,
        target,
        pool: pool.clone(),
        commands: command_rx,
        events: events.clone(),
        max_hops: config.dispatch.max_hops,
        stopping: stopping.clone(),
    })
    .map_err(thread_err)?;
    listener::spawn(conninfo.clone(), events.clone(), stopping.clone()).map_err(thread_err)?;
    let jobs = background::spawn(pool, events).map_err(thread_err)?;
    // A send to the pool's own channel, which lives as long as the loop: it cannot fail
    // while `jobs` is held.
    let _ = jobs.send(background::Job::InjectStages(config.inject_stages(&graph)));
    log::info!(
        "pepsi-dispatch {} serving {} stages: {}",
        env!("CARGO_PKG_VERSION"),
        graph.stages().count(),
        graph
            .stages()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let dispatcher = event_loop::Dispatcher::new(event_loop::Parts {
        poll,
        signals,
        events: event_rx,
        coordinator: command_tx,
        jobs,
        stopping,
        launcher,
        workers_as,
        config,
        graph,
    })?;
    dispatcher.run()
}
