//! The poll loop: the one struct that owns every mutable thing of the loop thread
//! ([`Dispatcher`]), its turn, its event and timer dispatch, and its policy step.
//! Started by `run` (the module's root) and left only for shutdown.
//!
//! Each turn, in a fixed order: poll → drain the signal sockets and set flags → drain
//! the event channel (coordinator, listener, thread pool) → child I/O, reading until
//! `WouldBlock` → the timers that are due (one deadline list, [`super::timers`], also
//! gave the poll its timeout) → one policy step that starts a reload's reads when one
//! was asked for, assigns claimed ids to workers (starting workers as needed) and claims
//! when a wake-up asked for it. Handlers record facts; the policy step decides. Nothing
//! here returns early on an error: only shutdown leaves the loop.
//!
//! The state is three owners, each changed only through its verbs —
//! [`Pools`] (stages and workers), [`ClaimSide`] (gate, paused clock, deferred rows,
//! ledger) and [`Housekeeping`] (the thread pool's chores) — plus values the handlers
//! read and only this file writes (the configuration, through `Dispatcher::adopt`;
//! the stop, through `Dispatcher::fail` and `Dispatcher::on_shutdown_signal`).
//!
//! Every handler is an `impl Dispatcher` method; this file dispatches to each by name
//! and defines none of the others. Where each is defined:
//!
//! ```text
//! handler                    file           reached from
//! on_claimed                 claims.rs      on_event: Event::Claimed
//! on_claim_failed            claims.rs      on_event: Event::ClaimFailed
//! on_lock_lost               claims.rs      on_event: Event::LockLost
//! on_lock_regained           claims.rs      on_event: Event::LockRegained
//! on_paused_due              claims.rs      on_due: Due::PausedDue
//! on_deferred_due            claims.rs      on_due: Due::DeferredResume
//! claim                      claims.rs      policy (the claim step)
//! write_to, read_from        workers.rs     run (pipe readiness), shutdown
//! worker_gone                workers.rs     read_from, on_due: Hang, StartTimeout,
//!                                           StuckClosing
//! assign                     workers.rs     policy (the assignment step)
//! on_reload_read             reload.rs      on_event: Event::ReloadRead
//! shutdown                   shutdown.rs    run, after the last turn
//! on_event, on_due, policy,  event_loop.rs  run
//! on_shutdown_signal
//! send, requeue, flush_stats event_loop.rs  the handlers (helpers)
//! ```
//!
//! An event or timer that concerns one owner only (a flip answered, a pause learnt, a
//! GC run done, a flush ended, a cooldown over) calls that owner's verb right in the
//! dispatch.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use mio::{Events, Poll, Token};

use super::background::Job;
use super::claim::Claim;
use super::claim_side::ClaimSide;
use super::coordinator::Command;
use super::events::Event;
use super::horizon::Notice;
use super::housekeeping::Housekeeping;
use super::pools::Pools;
use super::process::Handoff;
use super::timers::{self, Clocks, Due};
use super::verdict::End;
use crate::config::{Config, DispatchOptions, StageGraph};
use crate::db::sql;
use crate::escape::Visible;
use crate::exit::{self, Failure};
use crate::launcher::Launcher;
use crate::signals::{self, Signals};

/// Token of the shutdown-signal socket.
pub const SHUTDOWN_TOKEN: Token = Token(0);
/// Token of the reload-signal socket.
pub const RELOAD_TOKEN: Token = Token(1);
/// Token of the waker other threads use.
pub const WAKER_TOKEN: Token = Token(2);

/// Why the loop ended.
enum Stop {
    /// SIGINT / SIGTERM: exit 0.
    Signal,
    /// A failure that decides the exit status.
    Fail(Failure),
}

/// The loop and everything it owns. The fields other files read are `pub(super)`;
/// those they change are owners ([`Pools`], [`ClaimSide`], [`Housekeeping`]) changed
/// only through their verbs, or written only here (`config` and `graph` by
/// `Self::adopt`, `stop` by `Self::fail` and `Self::on_shutdown_signal`).
pub struct Dispatcher {
    /// The poller; other files use only its registry.
    pub(super) poll: Poll,
    signals: Signals,
    events: Receiver<Event>,
    coordinator: Sender<Command>,
    /// The coordinator thread died: shutdown resets the rows itself.
    coordinator_dead: bool,
    stopping: Arc<AtomicBool>,
    /// The launcher, which starts and kills the workers (read only).
    pub(super) launcher: Rc<Launcher>,
    /// The configuration the workers are handed (replaced only by `Self::adopt`).
    pub(super) handoff: Handoff,
    /// The account the workers run as when it is one of their own (`[pepsi]
    /// WORKER_AS`, never reloaded).
    workers_as: Option<String>,
    /// The configuration (replaced only by `Self::adopt`).
    pub(super) config: Config,
    /// The stage graph (replaced only by `Self::adopt`).
    pub(super) graph: StageGraph,
    /// `[pepsi-dispatch]`, never reloaded (read only).
    pub(super) opts: DispatchOptions,
    /// Drawn at random at start: with a worker's serial it names the worker's database
    /// sessions (`protocol::dispatched_session_name`) (read only).
    pub(super) session_tag: u32,
    /// The stage pools and worker processes.
    pub(super) pools: Pools,
    /// The claim gate, the paused clock, the deferred rows and the claim ledger.
    pub(super) claim_side: ClaimSide,
    /// The thread pool's chores: statistics, body GC, unknown stages, reload reads.
    pub(super) housekeeping: Housekeeping,
    stop: Option<Stop>,
}

/// What [`Dispatcher::new`] needs.
pub struct Parts {
    /// The poller, with the waker registered at [`WAKER_TOKEN`].
    pub poll: Poll,
    /// The signal sockets.
    pub signals: Signals,
    /// Events from the other threads.
    pub events: Receiver<Event>,
    /// Commands to the coordinator.
    pub coordinator: Sender<Command>,
    /// Jobs for the thread pool.
    pub jobs: Sender<Job>,
    /// Set when the loop shuts down (the coordinator and the listener watch it).
    pub stopping: Arc<AtomicBool>,
    /// The launcher, started before the switch to RUN_AS.
    pub launcher: Launcher,
    /// The account the launcher runs the workers as, when it is one of their own.
    pub workers_as: Option<String>,
    /// The configuration read at start.
    pub config: Config,
    /// The stage graph at start.
    pub graph: StageGraph,
}

impl Dispatcher {
    /// Builds the loop; registers the signal sockets.
    pub fn new(mut parts: Parts) -> Result<Dispatcher, Failure> {
        let registry = parts.poll.registry();
        registry
            .register(
                &mut parts.signals.shutdown,
                SHUTDOWN_TOKEN,
                mio::Interest::READABLE,
            )
            .and_then(|()| {
                registry.register(
                    &mut parts.signals.reload,
                    RELOAD_TOKEN,
                    mio::Interest::READABLE,
                )
            })
            .map_err(|e| Failure::general(format!("cannot register the signal sockets: {e}")))?;
        let now = Instant::now();
        let opts = parts.config.dispatch.clone();
        let handoff = Handoff::of(
            &parts.config,
            opts.config_file.as_deref(),
            parts.workers_as.as_deref(),
        )
        .map_err(|e| Failure::general(format!("cannot make the workers' configuration: {e}")))?;
        let mut claim_side = ClaimSide::new(&opts, now);
        claim_side.routes(&parts.graph);
        Ok(Dispatcher {
            poll: parts.poll,
            signals: parts.signals,
            events: parts.events,
            coordinator: parts.coordinator,
            coordinator_dead: false,
            stopping: parts.stopping,
            launcher: Rc::new(parts.launcher),
            handoff,
            workers_as: parts.workers_as,
            pools: Pools::new(&parts.graph),
            claim_side,
            housekeeping: Housekeeping::new(
                parts.jobs,
                now,
                opts.stats_interval,
                opts.snapshot_warning,
            ),
            config: parts.config,
            graph: parts.graph,
            opts,
            session_tag: session_tag(),
            stop: None,
        })
    }

    /// Runs until shutdown; then stops every worker, resets in-flight rows, flushes
    /// statistics and returns the exit decision.
    pub fn run(mut self) -> Result<(), Failure> {
        let mut events = Events::with_capacity(256);
        while self.stop.is_none() {
            let timeout = timers::next_wake(&timers::deadlines(&self.clocks(Instant::now())))
                .map(|t| t.saturating_duration_since(Instant::now()));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    let failure = Failure::new(exit::EX_SOFTWARE, format!("poll failed: {e}"));
                    self.stop = Some(Stop::Fail(failure));
                }
                continue;
            }
            let mut readable = Vec::new();
            let mut writable = Vec::new();
            for event in events.iter() {
                match event.token() {
                    SHUTDOWN_TOKEN => self.on_shutdown_signal(),
                    RELOAD_TOKEN => {
                        if signals::drain(&mut self.signals.reload) {
                            log::info!("SIGHUP: reloading the stage configuration");
                            self.housekeeping.want_reload();
                        }
                    }
                    WAKER_TOKEN => {}
                    token => {
                        if let Some(serial) = self.pools.serial_of(token) {
                            if event.is_readable() || event.is_read_closed() || event.is_error() {
                                readable.push(serial);
                            }
                            if event.is_writable() {
                                writable.push(serial);
                            }
                        }
                    }
                }
            }
            while let Ok(event) = self.events.try_recv() {
                self.on_event(event);
            }
            for serial in writable {
                self.write_to(serial);
            }
            for serial in readable {
                self.read_from(serial);
            }
            let now = Instant::now();
            for due in timers::due(timers::deadlines(&self.clocks(now)), now) {
                self.on_due(due, now);
            }
            self.policy();
        }
        // A coordinator waiting out an outage gives up; so does the listener.
        self.stopping.store(true, Ordering::Relaxed);
        self.shutdown();
        match self.stop.take().unwrap_or(Stop::Signal) {
            Stop::Signal => {
                log::info!("stopped");
                Ok(())
            }
            Stop::Fail(f) => Err(f),
        }
    }

    // ---- the loop's own state, for the handler files -------------------------------

    /// Is the loop ending?
    pub(super) fn stopping(&self) -> bool {
        self.stop.is_some()
    }

    /// Ends the loop with this failure, whatever ended it before.
    pub(super) fn fail(&mut self, failure: Failure) {
        self.stop = Some(Stop::Fail(failure));
    }

    /// The shutdown-signal socket may hold a byte: a SIGINT or SIGTERM ends the loop
    /// (unless something ended it already).
    pub(super) fn on_shutdown_signal(&mut self) {
        if signals::drain(&mut self.signals.shutdown) && self.stop.is_none() {
            log::info!("shutdown requested by signal");
            self.stop = Some(Stop::Signal);
        }
    }

    /// Replaces the configuration and the stage graph (a reload).
    pub(super) fn adopt(&mut self, config: Config, graph: StageGraph) {
        // The next workers are handed the new file. Without memory for it, nothing
        // could be started consistently with the new graph.
        match Handoff::of(
            &config,
            self.opts.config_file.as_deref(),
            self.workers_as.as_deref(),
        ) {
            Ok(h) => self.handoff = h,
            Err(e) => self.fail(Failure::new(
                exit::EX_SOFTWARE,
                format!("cannot make the workers' configuration: {e}"),
            )),
        }
        self.claim_side.routes(&graph);
        self.config = config;
        self.graph = graph;
    }

    /// Sends a command to the coordinator.
    pub(super) fn send(&self, command: Command) {
        if self.coordinator.send(command).is_err() {
            log::error!("the coordinator thread is gone");
        }
    }

    /// Hands a command to the coordinator at shutdown: false when the coordinator
    /// thread is gone (died, or its channel closed).
    pub(super) fn coordinator_takes(&self, command: Command) -> bool {
        !self.coordinator_dead && self.coordinator.send(command).is_ok()
    }

    /// The next event from another thread, waiting until `deadline` (at shutdown).
    pub(super) fn next_event_before(&self, deadline: Instant) -> Result<Event, RecvTimeoutError> {
        self.events.recv_deadline(deadline)
    }

    /// Puts claims back to pending without their having run: settled in the ledger,
    /// then written by the coordinator.
    pub(super) fn requeue(&mut self, claims: Vec<Claim>) {
        if claims.is_empty() {
            return;
        }
        self.claim_side.ledger().requeued(&claims);
        self.send(Command::Requeue(claims));
    }

    /// Flushes the statistics (unless there are none or a flush is in flight).
    pub(super) fn flush_stats(&mut self) {
        self.housekeeping.flush(self.claim_side.ledger());
    }

    // ---- events from other threads -------------------------------------------------

    pub(super) fn on_event(&mut self, event: Event) {
        match event {
            Event::Claimed {
                claims,
                next_paused,
                windows,
                floors,
                sweeps,
                took,
            } => self.on_claimed(claims, next_paused, &windows, (&floors, &sweeps), took),
            Event::ClaimFailed => self.on_claim_failed(),
            Event::Flipped { count, next_paused } => {
                self.claim_side.flipped(count, next_paused, Instant::now())
            }
            Event::FlipFailed => self.claim_side.flip_failed(Instant::now()),
            Event::Paused(due) => self.claim_side.learn_paused(Some(due), Instant::now()),
            Event::BodyGcDone { more } => self.housekeeping.gc_done(more),
            Event::LockLost => self.on_lock_lost(),
            Event::LockRegained(generation) => self.on_lock_regained(generation),
            Event::Fatal(failure) => {
                if self.stop.is_none() {
                    self.stop = Some(Stop::Fail(failure));
                }
            }
            Event::ThreadDied { thread, why } => {
                log::error!("the {thread} thread died ({why}); shutting down");
                self.coordinator_dead |= thread == "coordinator";
                if !matches!(self.stop, Some(Stop::Fail(_))) {
                    self.stop = Some(Stop::Fail(Failure::new(
                        exit::EX_SOFTWARE,
                        format!(
                            "the {thread} thread died ({why}); stopped cleanly so that a service manager restarts the dispatcher"
                        ),
                    )));
                }
            }
            Event::ResetDone(_) => {}
            Event::Resumed(count) => {
                if count > 0 {
                    self.claim_side.want();
                }
            }
            Event::Notify(channel) => match channel.as_str() {
                sql::CHANNEL_WORKQUEUE => self.claim_side.notified(Instant::now()),
                sql::CHANNEL_CONFIG_CHANGED => self.housekeeping.want_reload(),
                sql::CHANNEL_TELEMETRY_CHANGED => {
                    log::info!("telemetry setting changed: retiring every worker");
                    self.pools.retire_all(self.poll.registry());
                }
                other => log::debug!("ignoring a notification on {other}"),
            },
            // Notifications sent while the session was away are lost: catch up with a
            // claim, and re-read the configuration in case it changed meanwhile.
            Event::ListenerUp => {
                self.claim_side.notified(Instant::now());
                self.housekeeping.want_reload();
            }
            Event::ListenerLost => self.send(Command::Check),
            Event::ReloadRead(input) => self.on_reload_read(*input),
            Event::Flushed(result) => {
                if let Err(e) = self.housekeeping.flushed(result, self.claim_side.ledger()) {
                    log::warn!(
                        "statistics flush failed ({e}); keeping the counts for the next one"
                    );
                }
            }
            // The lines name the holder with its text escaped (`db::horizon::describe`).
            Event::Horizon(Ok(holders)) => {
                match self.housekeeping.horizon_read(&holders, Instant::now()) {
                    Some(Notice::Held(line)) => log::warn!("{line}"),
                    Some(Notice::Ended(line)) => log::info!("{line}"),
                    None => {}
                }
                let oldest = self.housekeeping.oldest_snapshot();
                self.claim_side.oldest_snapshot(oldest);
            }
            Event::Horizon(Err(e)) => {
                if self.housekeeping.horizon_failed(Instant::now()) {
                    log::warn!("cannot read who holds the database's oldest snapshot: {e}");
                }
            }
            Event::UnknownStages(list) => {
                // These stage names come from rows, not from the configuration.
                for (stage, count) in list {
                    let stage = Visible(&stage);
                    log::warn!(
                        "{count} pending rows are at stage \"{stage}\", which has no [stage-{stage}] section; they are not claimed"
                    );
                }
            }
        }
    }

    // ---- timers --------------------------------------------------------------------

    /// A snapshot of every clock, for [`timers::deadlines`].
    fn clocks(&self, now: Instant) -> Clocks {
        Clocks {
            now,
            max_runtime: self.opts.max_runtime,
            idle_timeout: self.opts.worker_idle_timeout,
            poll_interval: self.opts.poll_interval,
            workers: self.pools.worker_clocks(),
            stages: self.pools.stage_clocks(),
            can_claim: self.claim_side.open(),
            want_claim: self.claim_side.wanted(),
            last_claim: self.claim_side.last_claim(),
            claim_retry: self.claim_side.retry_at(),
            paused_due: self.claim_side.paused_due(),
            reload_retry: self.housekeeping.reload_retry_at(),
            deferred_resume: self.claim_side.resume_at(),
            stats_tick: self.housekeeping.stats_tick_at(),
            idle_flush: self.housekeeping.idle_flush_at(|| self.busy()),
            unknown_checked: self.housekeeping.unknown_checked(),
            horizon_check: self.housekeeping.horizon_check_at(),
        }
    }

    fn on_due(&mut self, due: Due, now: Instant) {
        match due {
            Due::Hang(serial) => self.worker_gone(serial, End::Hang),
            Due::StartTimeout(serial) => self.worker_gone(serial, End::StartTimeout),
            Due::StuckClosing(serial) => {
                if let Some(w) = self.pools.worker(serial) {
                    log::warn!(
                        "{}: worker {serial} (pid {}) did not exit within {}s of its end of input; killing it",
                        w.stage,
                        w.pid,
                        timers::CLOSE_GRACE.as_secs()
                    );
                }
                self.worker_gone(serial, End::Crash("it did not exit at end of input".into()));
            }
            Due::Idle(serial) => self.pools.stop_idle(serial, self.poll.registry()),
            Due::CooldownEnd(stage) => {
                self.pools.end_cooldown(&stage);
                self.claim_side.want();
            }
            Due::ThrottleEnd(stage) => {
                self.pools.end_throttle(&stage);
                self.claim_side.want();
            }
            Due::OverloadEnd(stage) => {
                self.pools.end_overload(&stage);
                self.claim_side.want();
            }
            Due::DeferredResume => self.on_deferred_due(now),
            Due::Claim => {}
            Due::Heartbeat => self.claim_side.want(),
            Due::ClaimRetry => self.claim_side.retry_due(),
            Due::PausedDue => self.on_paused_due(),
            Due::ReloadRetry => self.housekeeping.reload_retry_due(),
            Due::StatsTick => {
                self.housekeeping.stats_tick(
                    now,
                    self.opts.stats_interval,
                    self.claim_side.ledger(),
                    self.config.pepsi.history_days,
                );
            }
            Due::IdleFlush => self.housekeeping.idle_flush(self.claim_side.ledger()),
            Due::UnknownStages => {
                let known = self.pools.stage_names();
                self.housekeeping.count_unknown(now, known);
            }
            Due::Horizon => self.housekeeping.check_horizon(now),
        }
    }

    fn busy(&self) -> bool {
        self.claim_side.in_flight() || self.pools.busy()
    }

    // ---- policy --------------------------------------------------------------------

    fn policy(&mut self) {
        if let Some(e) = self.launcher.lost() {
            if self.stop.is_none() {
                self.fail(Failure::new(exit::EX_SOFTWARE, e));
            }
        }
        if self.stop.is_some() {
            return;
        }
        self.housekeeping.start_reload(&self.config.path);
        self.assign();
        self.claim();
        // A finished burst's numbers show at once (§10): remember that it was busy.
        let busy = self.busy();
        self.housekeeping.note_busy(busy);
    }
}

/// A random tag for this dispatcher's workers' session names. The standard library
/// seeds every `RandomState` from the operating system's random source; hashing the
/// pid with one gives 32 bits nobody else's dispatcher is likely to draw.
fn session_tag() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id()) as u32
}
