//! The poll loop: owns every worker process, the stage table and all pool state.
//!
//! Each turn, in a fixed order: poll → drain the signal sockets and set flags → drain
//! the event channel (coordinator, listener, thread pool) → child I/O, reading until
//! `WouldBlock` → the timers that are due (one deadline list, [`super::timers`], also
//! gave the poll its timeout) → one policy step that assigns claimed ids to workers
//! (starting workers as needed) and claims when a wake-up asked for it. Handlers record
//! facts; the policy step decides. Nothing here returns early on an error: only
//! shutdown leaves the loop.
//!
//! The handlers live by concern: [`super::claims`] (claims, the paused clock, lock loss
//! and reconcile), [`super::workers`] (worker I/O, answers, deaths, assignment),
//! [`super::reload`] (hot reload), [`super::shutdown`]. This file is the loop, its event
//! dispatch and its timers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use mio::{Events, Poll, Token};

use super::background::Job;
use super::claim::Claim;
use super::claims::DEFER_GRACE;
use super::claims::{ClaimGate, PausedClock};
use super::coordinator::Command;
use super::events::Event;
use super::ledger::Ledger;
use super::pool::StagePool;
use super::process::WorkerProc;
use super::reload::ReloadState;
use super::signals::{self, Signals};
use super::timers::{self, Clocks, Due, StageClock, WorkerClock};
use super::verdict::End;
use super::worker_view::Phase;
use crate::config::{Config, DispatchOptions, StageGraph};
use crate::db::sql;
use crate::escape::Visible;
use crate::exit::{self, Failure};
use crate::keeper::master::Master;
use crate::privilege::Account;

/// Token of the shutdown-signal socket.
pub const SHUTDOWN_TOKEN: Token = Token(0);
/// Token of the reload-signal socket.
pub const RELOAD_TOKEN: Token = Token(1);
/// Token of the waker other threads use.
pub const WAKER_TOKEN: Token = Token(2);
/// Child pipe tokens start here and are never reused.
const FIRST_CHILD_TOKEN: usize = 16;

/// Why the loop ended.
pub(super) enum Stop {
    /// SIGINT / SIGTERM: exit 0.
    Signal,
    /// A failure that decides the exit status.
    Fail(Failure),
}

/// The loop and everything it owns.
pub struct Dispatcher {
    pub(super) poll: Poll,
    pub(super) signals: Signals,
    pub(super) events: Receiver<Event>,
    pub(super) coordinator: Sender<Command>,
    /// The coordinator thread died: shutdown resets the rows itself.
    pub(super) coordinator_dead: bool,
    jobs: Sender<Job>,
    pub(super) stopping: Arc<AtomicBool>,
    pub(super) account_env: Vec<(&'static str, String)>,
    /// The keeper master, when the dispatcher was started as root: keepers for the
    /// workers of stages that run a command.
    pub(super) master: Option<Master>,
    pub(super) config: Config,
    pub(super) graph: StageGraph,
    pub(super) opts: DispatchOptions,
    pub(super) stages: BTreeMap<String, StagePool>,
    pub(super) workers: HashMap<u64, WorkerProc>,
    pub(super) tokens: HashMap<Token, u64>,
    next_token: usize,
    pub(super) next_serial: u64,
    /// Drawn at random at start: with a worker's serial it names the worker's database
    /// sessions (`protocol::dispatched_session_name`).
    pub(super) session_tag: u32,
    pub(super) gate: ClaimGate,
    pub(super) paused: PausedClock,
    pub(super) ledger: Ledger,
    /// Ids read by a worker that died with several ids read: each runs alone next time,
    /// so the culprit ends up alone at the front of its worker's queue.
    pub(super) suspects: HashSet<i64>,
    pub(super) reload: ReloadState,
    /// Claims deferred for 74 (their worker lost the database), oldest first, with when:
    /// resumed early once the dispatcher's own session works (§8.4 "Early resume").
    pub(super) deferred: Vec<(Claim, Instant)>,
    pub(super) last_throttle: Option<Instant>,
    pub(super) flush_in_flight: bool,
    last_flush: Instant,
    next_stats_tick: Instant,
    pub(super) active_since_gc: bool,
    was_busy: bool,
    unknown_checked: Instant,
    pub(super) stop: Option<Stop>,
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
    /// The service account the dispatcher switched to, for the workers' environment.
    pub account: Option<Account>,
    /// The keeper master started before the switch, when started as root.
    pub master: Option<Master>,
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
        let stages = parts
            .graph
            .stages()
            .map(|s| (s.name.clone(), StagePool::new(s.clone())))
            .collect();
        Ok(Dispatcher {
            poll: parts.poll,
            signals: parts.signals,
            events: parts.events,
            coordinator: parts.coordinator,
            coordinator_dead: false,
            jobs: parts.jobs,
            stopping: parts.stopping,
            account_env: parts.account.map(|a| a.env()).unwrap_or_default(),
            master: parts.master,
            next_stats_tick: now + opts.stats_interval,
            ledger: Ledger::for_options(&opts),
            config: parts.config,
            graph: parts.graph,
            opts,
            stages,
            workers: HashMap::new(),
            tokens: HashMap::new(),
            next_token: FIRST_CHILD_TOKEN,
            next_serial: 1,
            session_tag: session_tag(),
            gate: ClaimGate::new(now),
            paused: PausedClock::default(),
            suspects: HashSet::new(),
            reload: ReloadState::default(),
            deferred: Vec::new(),
            last_throttle: None,
            flush_in_flight: false,
            last_flush: now,
            active_since_gc: true,
            was_busy: false,
            // The first count runs at the first turn.
            unknown_checked: now.checked_sub(timers::UNKNOWN_STAGE_GAP).unwrap_or(now),
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
                    SHUTDOWN_TOKEN => {
                        if signals::drain(&mut self.signals.shutdown) && self.stop.is_none() {
                            log::info!("shutdown requested by signal");
                            self.stop = Some(Stop::Signal);
                        }
                    }
                    RELOAD_TOKEN => {
                        if signals::drain(&mut self.signals.reload) {
                            log::info!("SIGHUP: reloading the stage configuration");
                            self.reload.want = true;
                        }
                    }
                    WAKER_TOKEN => {}
                    token => {
                        if let Some(&serial) = self.tokens.get(&token) {
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
        self.shutdown()
    }

    /// Two fresh pipe tokens for a new worker.
    pub(super) fn next_tokens(&mut self) -> (Token, Token) {
        let tokens = (Token(self.next_token), Token(self.next_token + 1));
        self.next_token += 2;
        tokens
    }

    /// Hands a job to the thread pool (whose channel lives as long as the loop).
    pub(super) fn send_job(&self, job: Job) {
        let _ = self.jobs.send(job);
    }

    pub(super) fn send(&self, command: Command) {
        if self.coordinator.send(command).is_err() {
            log::error!("the coordinator thread is gone");
        }
    }

    // ---- events from other threads -------------------------------------------------

    pub(super) fn on_event(&mut self, event: Event) {
        match event {
            Event::Claimed {
                claims,
                asked,
                next_paused,
                windows,
            } => self.on_claimed(claims, &asked, next_paused, &windows),
            Event::ClaimFailed { asked } => self.on_claim_failed(&asked),
            Event::Flipped { count, next_paused } => self.on_flipped(count, next_paused),
            Event::FlipFailed => self.on_flip_failed(),
            Event::Paused(due) => self.paused.learn(Some(due), Instant::now()),
            Event::BodyGcDone { more } => self.active_since_gc |= more,
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
                    self.gate.want = true;
                }
            }
            Event::Notify(channel) => match channel.as_str() {
                sql::CHANNEL_WORKQUEUE => self.gate.want = true,
                sql::CHANNEL_CONFIG_CHANGED => self.reload.want = true,
                sql::CHANNEL_TELEMETRY_CHANGED => {
                    log::info!("telemetry setting changed: retiring every worker");
                    self.retire_all();
                }
                other => log::debug!("ignoring a notification on {other}"),
            },
            // Notifications sent while the session was away are lost: catch up with a
            // claim, and re-read the configuration in case it changed meanwhile.
            Event::ListenerUp => {
                self.gate.want = true;
                self.reload.want = true;
            }
            Event::ListenerLost => self.send(Command::Check),
            Event::Overlay(result) => self.on_overlay(result),
            Event::Flushed(result) => {
                self.flush_in_flight = false;
                if let Err((e, deltas)) = result {
                    log::warn!(
                        "statistics flush failed ({e}); keeping the counts for the next one"
                    );
                    self.ledger.deltas.merge(&deltas);
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
        let workers = self
            .workers
            .values()
            .map(|w| WorkerClock {
                serial: w.serial,
                starting: w.phase == Phase::Starting,
                started: w.started,
                front_since: w.queue.front().and_then(|s| s.head_since),
                idle_since: (w.phase == Phase::Ready && w.queue.is_empty()).then_some(w.idle_since),
                closing_since: w.closing_since,
            })
            .collect();
        let stages = self
            .stages
            .iter()
            .filter(|(_, s)| {
                s.cooldown_until.is_some() || s.throttle.is_some() || s.overload_until.is_some()
            })
            .map(|(name, s)| StageClock {
                name: name.clone(),
                cooldown: s.cooldown_until,
                throttle: s.throttle.map(|t| t.1),
                overload: s.overload_until,
            })
            .collect();
        let idle_flush = (self.was_busy && !self.busy() && !self.flush_in_flight)
            .then(|| self.last_flush + timers::IDLE_FLUSH_GAP);
        Clocks {
            now,
            max_runtime: self.opts.max_runtime,
            idle_timeout: self.opts.worker_idle_timeout,
            poll_interval: self.opts.poll_interval,
            workers,
            stages,
            can_claim: self.gate.open(),
            want_claim: self.gate.want,
            last_claim: self.gate.last,
            claim_retry: self.gate.retry_at,
            paused_due: self.paused.deadline(self.gate.lock_held),
            reload_retry: self.reload.retry_at,
            deferred_resume: self.deferred.first().map(|d| d.1 + DEFER_GRACE),
            stats_tick: self.next_stats_tick,
            idle_flush,
            unknown_checked: self.unknown_checked,
        }
    }

    fn on_due(&mut self, due: Due, now: Instant) {
        match due {
            Due::Hang(serial) => self.worker_gone(serial, End::Hang),
            Due::StartTimeout(serial) => self.worker_gone(serial, End::StartTimeout),
            Due::StuckClosing(serial) => {
                if let Some(w) = self.workers.get(&serial) {
                    log::warn!(
                        "{}: worker {serial} (pid {}) did not exit within {}s of its end of input; killing it",
                        w.stage,
                        w.pid,
                        timers::CLOSE_GRACE.as_secs()
                    );
                }
                self.worker_gone(serial, End::Crash("it did not exit at end of input".into()));
            }
            Due::Idle(serial) => {
                if let Some(w) = self.workers.get_mut(&serial) {
                    log::debug!("{}: stopping idle worker {serial} (pid {})", w.stage, w.pid);
                    w.close_stdin(self.poll.registry());
                }
            }
            Due::CooldownEnd(stage) => {
                if let Some(s) = self.stages.get_mut(&stage) {
                    s.cooldown_until = None;
                }
                self.gate.want = true;
            }
            Due::ThrottleEnd(stage) => {
                if let Some(s) = self.stages.get_mut(&stage) {
                    log::info!(
                        "{stage}: the overload throttle window passed; PARALLELISM back to {}",
                        s.section.parallelism
                    );
                    s.throttle = None;
                }
                self.gate.want = true;
            }
            Due::OverloadEnd(stage) => {
                if let Some(s) = self.stages.get_mut(&stage) {
                    s.overload_until = None;
                }
                self.gate.want = true;
            }
            Due::DeferredResume => self.resume_deferred(now),
            Due::Claim => {}
            Due::Heartbeat => self.gate.want = true,
            Due::ClaimRetry => {
                self.gate.retry_at = None;
                self.gate.want = true;
            }
            Due::PausedDue => self.flip_paused(),
            Due::ReloadRetry => {
                self.reload.retry_at = None;
                self.reload.want = true;
            }
            Due::StatsTick => {
                self.next_stats_tick = now + self.opts.stats_interval;
                self.flush_stats();
                if std::mem::take(&mut self.active_since_gc) {
                    let _ = self.jobs.send(Job::BodyGc);
                }
            }
            Due::IdleFlush => {
                self.was_busy = false;
                self.flush_stats();
            }
            Due::UnknownStages => {
                self.unknown_checked = now;
                let known: Vec<String> = self.stages.keys().cloned().collect();
                let _ = self.jobs.send(Job::UnknownStages(known));
            }
        }
    }

    fn busy(&self) -> bool {
        self.gate.in_flight
            || self.workers.values().any(|w| !w.queue.is_empty())
            || self.stages.values().any(|s| !s.queue.is_empty())
    }

    pub(super) fn flush_stats(&mut self) {
        if self.ledger.deltas.is_empty() || self.flush_in_flight {
            return;
        }
        self.flush_in_flight = true;
        self.last_flush = Instant::now();
        let deltas = std::mem::take(&mut self.ledger.deltas);
        let _ = self.jobs.send(Job::Flush(Box::new(deltas)));
    }

    // ---- policy --------------------------------------------------------------------

    fn policy(&mut self) {
        if self.stop.is_some() {
            return;
        }
        if self.reload.want && !self.reload.in_flight {
            self.reload.want = false;
            self.reload.in_flight = true;
            let _ = self.jobs.send(Job::ReadOverlay);
        }
        self.assign();
        self.claim();
        // A finished burst's numbers show at once (§10): remember that it was busy.
        self.was_busy |= self.busy();
    }
}

/// A random tag for this dispatcher's workers' session names. The standard library
/// seeds every `RandomState` from the operating system's random source; hashing the
/// pid with one gives 32 bits nobody else's dispatcher is likely to draw.
fn session_tag() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id()) as u32
}
