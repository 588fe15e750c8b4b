//! `pepsi-ingress [GLOBAL] serve` (§16): the persistent front end that puts mail
//! into the queue, for an MTA's `content_filter` or transport (LMTP) or a client of its
//! own (SMTP).
//!
//! Threads, each owning its part: the main thread binds the listeners (as root, before
//! it switches to `[pepsi] RUN_AS`), starts the others and waits for SIGTERM/SIGINT; one
//! acceptor per listener ([`listen`]) hands each connection it admits ([`admission`]:
//! `MAX_SESSIONS`, `MAX_CLIENT_SESSIONS`, `TRUSTED_SESSIONS`) to a session thread
//! ([`session`]); the committer ([`commit`]) owns the database
//! session and commits what the sessions accepted in groups, synchronously, answering
//! each only after its commit; [`counters`] are written by it every few seconds.
//! [`params`] reads the commands' arguments and [`reply`] writes the replies. Nothing
//! here is async.
//!
//! On SIGTERM it stops accepting, ends every session at its next read (a message whose
//! data is complete still gets its commit and its reply; one still arriving gets none,
//! so its client sends it again), lets the committer finish, writes the counters and
//! exits 0. The database away never stops it: mail is answered 451 until it is back.

pub mod admission;
pub mod channel;
pub mod commit;
pub mod counters;
mod data;
pub mod listen;
pub mod params;
pub mod reply;
pub mod session;
mod starttls;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::cli::{Invocation, Program};
use crate::config::{Config, DbRole};
use crate::db::{self, schema};
use crate::exit::Failure;

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-ingress",
    synopsis: "serve",
    about: "serve: runs the Pepsi ingress until SIGINT or SIGTERM: accepts mail over LMTP and SMTP on \
            [pepsi-ingress] LISTEN and queues it at [pepsi-ingress] STAGE, committing the messages of \
            concurrent sessions together and answering each only after its commit.\n\
            Exit status: 0 clean shutdown, 1 an error at start (configuration, a listener that cannot \
            be bound), 78 the schema does not match or STAGE is no entry stage.",
};

/// How often the counters are written.
const STATS_EVERY: Duration = Duration::from_secs(10);
/// How long a shutdown waits for the sessions to end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Runs `pepsi-ingress serve`.
pub fn run(invocation: Invocation) -> Result<(), Failure> {
    invocation.expect_only(&PROGRAM, &["serve"])?;
    let config = Config::load_or_fail(invocation.globals.config.as_deref())?;
    let Some((stage, _)) = config.ingress.stage.clone() else {
        return Err(Failure::config(format!(
            "{}: [pepsi-ingress] STAGE is not set: the stage mail enters at",
            config.path.display()
        )));
    };
    // Bound while still root (a port below 1024, a socket in a root-owned directory).
    let listeners = listen::bind_all(&config.ingress.listen)?;
    crate::privilege::drop_to(&config.pepsi.run_as)?;
    let conninfo = config.postgres.connection_for(DbRole::Inject).to_string();
    let pg = db::connection_config(&conninfo, PROGRAM.name).map_err(|e| {
        Failure::general(format!("{}: {e}", config.postgres.key_for(DbRole::Inject)))
    })?;
    // Before anything that waits: a SIGHUP from `systemctl reload` meanwhile must not
    // end the process (its default action).
    let mut signals = crate::signals::install()?;
    check_at_start(&config, &pg, &stage)?;
    // Read as RUN_AS, as every reload reads them: a key only root may read fails now,
    // not at the first SIGHUP.
    let tls = Arc::new(RwLock::new(match &config.ingress.tls {
        Some((cert, key)) => Some(
            crate::tls::server_config(cert, key)
                .map_err(|e| Failure::config(format!("[pepsi-ingress] TLS_CERT, TLS_KEY: {e}")))?,
        ),
        None => None,
    }));
    let counters = Arc::new(counters::Counters::default());
    let (committer, committer_thread) =
        commit::spawn(pg, stage.clone(), counters.clone(), STATS_EVERY)
            .map_err(|e| Failure::general(format!("cannot start a thread: {e}")))?;
    let stopping = Arc::new(AtomicBool::new(false));
    let sessions = Arc::new(listen::Sessions::default());
    let admission = admission::Admission::new(admission::Limits::of(&config.ingress));
    let mut acceptors = Vec::new();
    for listener in listeners {
        log::info!("listening on {}", listener.spec);
        acceptors.push(
            listen::spawn_acceptor(
                listener,
                listen::Shared {
                    options: config.ingress.clone(),
                    hostname: config.pepsi.hostname.clone(),
                    committer: committer.clone(),
                    counters: counters.clone(),
                    stopping: stopping.clone(),
                    sessions: sessions.clone(),
                    admission: admission.clone(),
                    tls: tls.clone(),
                },
            )
            .map_err(|e| Failure::general(format!("cannot start a thread: {e}")))?,
        );
    }
    drop(committer);
    log::info!(
        "pepsi-ingress {} accepting mail for stage {stage}",
        env!("CARGO_PKG_VERSION")
    );
    loop {
        match crate::signals::wait_any(&mut signals, Duration::from_secs(3600)) {
            crate::signals::Arrived::Shutdown => break,
            crate::signals::Arrived::Reload => reload_tls(&config, &tls),
            crate::signals::Arrived::Nothing => {}
        }
    }
    log::info!("shutdown requested by signal");
    stopping.store(true, Ordering::SeqCst);
    for acceptor in acceptors {
        acceptor.stop();
    }
    // Sessions waiting for the client end now; one waiting for its commit ends after it.
    sessions.interrupt_all();
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while sessions.count() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if sessions.count() > 0 {
        // Their messages got no reply: their clients send them again.
        log::warn!(
            "{} sessions did not end within {}s; exiting without them",
            sessions.count(),
            SHUTDOWN_GRACE.as_secs()
        );
        return Ok(());
    }
    // The last session's handle on the committer went with it; the committer now
    // writes the counters and ends.
    if committer_thread.join().is_err() {
        log::error!("the committer thread panicked");
    }
    Ok(())
}

/// SIGHUP: reads `TLS_CERT` and `TLS_KEY` again (a renewed certificate); new sessions
/// use them, sessions in progress keep theirs. A file that does not read leaves the
/// old ones in use and says why. Nothing else of the configuration is read again.
fn reload_tls(config: &Config, tls: &RwLock<Option<Arc<rustls::ServerConfig>>>) {
    let Some((cert, key)) = &config.ingress.tls else {
        log::info!(
            "SIGHUP: no TLS_CERT to reload; pepsi-ingress reads the rest of its configuration when it starts"
        );
        return;
    };
    match crate::tls::server_config(cert, key) {
        Ok(new) => {
            *tls.write().unwrap_or_else(|p| p.into_inner()) = Some(new);
            log::info!(
                "SIGHUP: reloaded {} and {}; new sessions use them",
                cert.display(),
                key.display()
            );
        }
        Err(e) => log::error!("SIGHUP: cannot reload the certificate, keeping the old one: {e}"),
    }
}

/// The start-up checks that need the database, when it can be reached now: the schema
/// (a mismatch exits 78, like every program) and `STAGE`, which must be an entry stage
/// of the graph with its overlay (`[pepsi] INJECT_STAGES`). Unreachable: a warning, and
/// mail is deferred until it is back.
fn check_at_start(config: &Config, pg: &postgres::Config, stage: &str) -> Result<(), Failure> {
    let mut client = match db::open(pg) {
        Ok(c) => c,
        Err(e) => {
            log::warn!(
                "the database is unavailable at start, mail is deferred until it is back: {e}"
            );
            return Ok(());
        }
    };
    match schema::check(&mut client) {
        Ok(()) => {}
        Err(schema::SchemaError::Mismatch(m)) => return Err(Failure::config(m.to_string())),
        Err(schema::SchemaError::Db(e)) => {
            log::warn!("cannot check the schema at start: {}", db::describe(&e));
            return Ok(());
        }
    }
    let overlay = match db::read_overlay(&mut client) {
        Ok(rows) => rows,
        Err(e) => {
            log::warn!(
                "cannot read pepsi.config_override at start: {}",
                db::describe(&e)
            );
            return Ok(());
        }
    };
    let graph = config.graph(&overlay).map_err(|errors| {
        Failure::config(format!(
            "the stage graph is invalid:\n{}",
            crate::config::raw::join_errors(&errors)
        ))
    })?;
    if let Some(problem) = stage_problem(config, &graph, stage) {
        return Err(Failure::config(problem));
    }
    Ok(())
}

/// Why `stage` cannot be `[pepsi-ingress] STAGE` with this graph, if it cannot: it must
/// be a stage, and one of `[pepsi] INJECT_STAGES` (by default the stages no stage
/// routes to). `pepsi-dispatch check` asks the same.
pub fn stage_problem(
    config: &Config,
    graph: &crate::config::StageGraph,
    stage: &str,
) -> Option<String> {
    if !graph.contains(stage) {
        return Some(format!(
            "[pepsi-ingress] STAGE names stage {stage:?}, which has no [stage-{stage}] section"
        ));
    }
    let entries = config.inject_stages(graph);
    (!entries.iter().any(|s| s == stage)).then(|| {
        format!(
            "[pepsi-ingress] STAGE {stage:?} is not one of [pepsi] INJECT_STAGES ({}): \
             pepsi-ingress may inject only into an entry stage",
            if entries.is_empty() {
                "none".to_string()
            } else {
                entries.join(", ")
            }
        )
    })
}
