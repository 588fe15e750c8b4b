//! The poll loop: owns every worker process, the stage table and all pool state.
//!
//! Each turn, in a fixed order: poll → drain the signal sockets and set flags → drain
//! the event channel (coordinator, listener, thread pool) → child I/O, reading until
//! `WouldBlock` → timers (MAX_RUNTIME kills, idle stops, cooldowns, throttles, due
//! paused rows, the heartbeat, statistics) → one policy step that assigns claimed ids
//! to workers (starting workers as needed) and claims when a wake-up asked for it.
//! Handlers record facts; the policy step decides. Nothing here returns early on an
//! error: only shutdown leaves the loop.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use mio::{Events, Poll, Token};

use super::background::Job;
use super::coordinator::{Command, StrikeKind};
use super::events::Event;
use super::process::{Launch, Phase, WorkerProc, describe_exit};
use super::scheduler::{self, ClaimPolicy};
use super::signals::{self, Signals};
use super::stats::Deltas;
use crate::config::raw::join_errors;
use crate::config::{Config, DispatchOptions, StageGraph, StageSection};
use crate::db::sql;
use crate::exit::{self, Failure};
use crate::protocol::{self, Report};

/// Token of the shutdown-signal socket.
pub const SHUTDOWN_TOKEN: Token = Token(0);
/// Token of the reload-signal socket.
pub const RELOAD_TOKEN: Token = Token(1);
/// Token of the waker other threads use.
pub const WAKER_TOKEN: Token = Token(2);
/// Child pipe tokens start here and are never reused.
const FIRST_CHILD_TOKEN: usize = 16;

/// Start-failure cooldown: the first, doubling up to the cap.
const COOLDOWN_FIRST: Duration = Duration::from_secs(2);
const COOLDOWN_CAP: Duration = Duration::from_secs(60);
/// A 75 halves the biggest stage's cap for this long.
const THROTTLE_WINDOW: Duration = Duration::from_secs(300);
/// The idle statistics flush happens at most this often.
const IDLE_FLUSH_GAP: Duration = Duration::from_secs(1);
/// Rows at unknown stages are reported at most this often.
const UNKNOWN_STAGE_GAP: Duration = Duration::from_secs(60);
/// A failed overlay read is retried after this.
const RELOAD_RETRY: Duration = Duration::from_secs(5);
/// How long a worker may take to exit after its stdout closed before it is killed.
const REAP_GRACE: Duration = Duration::from_millis(200);
/// A worker whose stdin was closed is killed if it has not exited after this.
const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Overload halvings closer together than this are one episode (a batch of 75s).
const THROTTLE_GAP: Duration = Duration::from_secs(1);
/// A failed paused-row flip is tried again after this.
const FLIP_RETRY: Duration = Duration::from_secs(1);
/// How soon a claim that failed is tried again.
const CLAIM_RETRY: Duration = Duration::from_secs(1);
/// Suspects remembered at most (they are only a hint).
const MAX_SUSPECTS: usize = 10_000;
/// How long shutdown waits for the coordinator's reset and the last flush.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(15);

/// One stage of the table.
struct StageState {
    section: StageSection,
    /// Claimed ids (with their sender keys) not yet handed to a worker.
    queue: VecDeque<(i64, String)>,
    /// Capacity asked in the claim in flight.
    reserved: usize,
    /// Its workers (including retiring ones), by serial.
    workers: Vec<u64>,
    /// No worker is started before this (after start failures).
    cooldown_until: Option<Instant>,
    cooldown_step: u32,
    /// A lowered PARALLELISM cap after a 75, and until when.
    throttle: Option<(u32, Instant)>,
    /// The stage left the configuration; it goes when its workers are gone.
    removed: bool,
}

impl StageState {
    fn new(section: StageSection) -> StageState {
        StageState {
            section,
            queue: VecDeque::new(),
            reserved: 0,
            workers: Vec::new(),
            cooldown_until: None,
            cooldown_step: 0,
            throttle: None,
            removed: false,
        }
    }

    fn cap(&self) -> u32 {
        match self.throttle {
            Some((cap, _)) => cap.min(self.section.parallelism),
            None => self.section.parallelism,
        }
    }

    fn cooling(&self, now: Instant) -> bool {
        self.cooldown_until.is_some_and(|t| t > now)
    }
}

/// Why the loop ended.
enum Stop {
    /// SIGINT / SIGTERM: exit 0.
    Signal,
    /// A failure that decides the exit status.
    Fail(Failure),
}

/// The loop and everything it owns.
pub struct Dispatcher {
    poll: Poll,
    signals: Signals,
    events: Receiver<Event>,
    coordinator: Sender<Command>,
    jobs: Sender<Job>,
    config: Config,
    graph: StageGraph,
    opts: DispatchOptions,
    stages: BTreeMap<String, StageState>,
    workers: HashMap<u64, WorkerProc>,
    tokens: HashMap<Token, u64>,
    next_token: usize,
    next_serial: u64,
    lock_held: bool,
    claim_in_flight: bool,
    want_claim: bool,
    last_claim: Instant,
    flip_in_flight: bool,
    next_paused: Option<Instant>,
    deltas: Deltas,
    flush_in_flight: bool,
    last_flush: Instant,
    next_stats_tick: Instant,
    active_since_gc: bool,
    was_busy: bool,
    want_reload: bool,
    reload_in_flight: bool,
    reload_retry_at: Option<Instant>,
    claim_retry_at: Option<Instant>,
    unknown_checked: Instant,
    last_throttle: Option<Instant>,
    policy: Box<dyn ClaimPolicy>,
    /// Siblings of a crash or hang in a batching worker: each runs alone next time,
    /// so the culprit ends up at the front of its worker's queue.
    suspects: HashSet<i64>,
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
        let policy = scheduler::from_options(&opts);
        let stages = parts
            .graph
            .stages()
            .map(|s| (s.name.clone(), StageState::new(s.clone())))
            .collect();
        Ok(Dispatcher {
            poll: parts.poll,
            signals: parts.signals,
            events: parts.events,
            coordinator: parts.coordinator,
            jobs: parts.jobs,
            next_stats_tick: now + opts.stats_interval,
            config: parts.config,
            graph: parts.graph,
            opts,
            stages,
            workers: HashMap::new(),
            tokens: HashMap::new(),
            next_token: FIRST_CHILD_TOKEN,
            next_serial: 1,
            lock_held: true,
            claim_in_flight: false,
            want_claim: true,
            last_claim: now,
            flip_in_flight: false,
            next_paused: None,
            deltas: Deltas::default(),
            flush_in_flight: false,
            last_flush: now,
            active_since_gc: true,
            was_busy: false,
            want_reload: false,
            reload_in_flight: false,
            reload_retry_at: None,
            claim_retry_at: None,
            // The first check runs at the first turn.
            unknown_checked: now.checked_sub(UNKNOWN_STAGE_GAP).unwrap_or(now),
            last_throttle: None,
            policy,
            suspects: HashSet::new(),
            stop: None,
        })
    }

    /// Runs until shutdown; then stops every worker, resets in-flight rows, flushes
    /// statistics and returns the exit decision.
    pub fn run(mut self) -> Result<(), Failure> {
        let mut events = Events::with_capacity(256);
        while self.stop.is_none() {
            let timeout = self
                .next_deadline()
                .map(|t| t.saturating_duration_since(Instant::now()));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    self.stop = Some(Stop::Fail(Failure::new(
                        exit::EX_SOFTWARE,
                        format!("poll failed: {e}"),
                    )));
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
                            self.want_reload = true;
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
            self.drain_events();
            for serial in writable {
                self.write_to(serial);
            }
            for serial in readable {
                self.read_from(serial);
            }
            self.timers();
            self.policy();
        }
        self.shutdown()
    }

    // ---- events from other threads -------------------------------------------------

    fn drain_events(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            self.on_event(event);
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Claimed {
                rows,
                asked,
                next_paused,
            } => {
                self.claim_in_flight = false;
                for (stage, _) in &asked {
                    if let Some(s) = self.stages.get_mut(stage) {
                        s.reserved = 0;
                    }
                }
                self.set_next_paused(next_paused);
                // Only claims that found work count: an idle dispatcher's heartbeat
                // claims must not make statistics to write (§10).
                if !rows.is_empty() {
                    self.deltas.claims += 1;
                    self.deltas.rows_claimed += rows.len() as i64;
                }
                let mut stray = Vec::new();
                for row in rows {
                    self.policy.claimed(&row.stage, &row.sender_key);
                    match self.stages.get_mut(&row.stage) {
                        Some(s) if !s.removed => s.queue.push_back((row.id, row.sender_key)),
                        _ => stray.push((row.id, row.stage, row.sender_key)),
                    }
                }
                self.requeue(stray);
            }
            Event::ClaimFailed { asked } => {
                self.claim_in_flight = false;
                for (stage, _) in &asked {
                    if let Some(s) = self.stages.get_mut(stage) {
                        s.reserved = 0;
                    }
                }
                // The wake-up that asked for it still stands.
                self.claim_retry_at = Some(Instant::now() + CLAIM_RETRY);
            }
            Event::Flipped { count, next_paused } => {
                self.flip_in_flight = false;
                self.next_paused = None;
                self.set_next_paused(next_paused);
                if count > 0 {
                    self.want_claim = true;
                }
            }
            Event::FlipFailed => {
                self.flip_in_flight = false;
                self.next_paused = Some(Instant::now() + FLIP_RETRY);
            }
            Event::Paused(due) => self.set_next_paused(Some(due)),
            Event::BodyGcDone { more } => {
                if more {
                    self.active_since_gc = true;
                }
            }
            Event::LockLost => {
                if self.lock_held {
                    log::warn!(
                        "the dispatcher lock was lost with the database connection; not claiming until it is back"
                    );
                }
                self.lock_held = false;
            }
            Event::LockRegained(generation) => {
                self.lock_held = true;
                self.want_claim = true;
                // A claim that committed while its answer was lost left rows running
                // that no worker holds: reset every running row not in flight here.
                let mut held: Vec<i64> = self
                    .workers
                    .values()
                    .flat_map(|w| w.queue.iter().map(|s| s.id))
                    .collect();
                held.extend(
                    self.stages
                        .values()
                        .flat_map(|s| s.queue.iter().map(|q| q.0)),
                );
                self.send(Command::Reconcile { held, generation });
            }
            Event::Fatal(failure) => {
                if self.stop.is_none() {
                    self.stop = Some(Stop::Fail(failure));
                }
            }
            Event::ResetDone(_) => {}
            Event::Notify(channel) => match channel.as_str() {
                sql::CHANNEL_WORKQUEUE => self.want_claim = true,
                sql::CHANNEL_CONFIG_CHANGED => self.want_reload = true,
                sql::CHANNEL_TELEMETRY_CHANGED => {
                    log::info!("telemetry setting changed: retiring every worker");
                    self.retire_all();
                }
                other => log::debug!("ignoring a notification on {other}"),
            },
            // Notifications sent while the session was away are lost: catch up with a
            // claim, and re-read the configuration in case it changed meanwhile.
            Event::ListenerUp => {
                self.want_claim = true;
                self.want_reload = true;
            }
            Event::ListenerLost => self.send(Command::Check),
            Event::Overlay(result) => {
                self.reload_in_flight = false;
                match result {
                    Ok(overlay) => self.apply_reload(&overlay),
                    Err(e) => {
                        log::warn!(
                            "cannot read pepsi.config_override ({e}); keeping the current stage graph and retrying the reload in {}s",
                            RELOAD_RETRY.as_secs()
                        );
                        self.reload_retry_at = Some(Instant::now() + RELOAD_RETRY);
                    }
                }
            }
            Event::Flushed(result) => {
                self.flush_in_flight = false;
                if let Err((e, deltas)) = result {
                    log::warn!(
                        "statistics flush failed ({e}); keeping the counts for the next one"
                    );
                    self.deltas.merge(&deltas);
                }
            }
            Event::UnknownStages(list) => {
                for (stage, count) in list {
                    log::warn!(
                        "{count} pending rows are at stage {stage:?}, which has no [stage-{stage}] section; they are not claimed"
                    );
                }
            }
        }
    }

    fn set_next_paused(&mut self, due_in: Option<f64>) {
        if let Some(secs) = due_in {
            let at = Instant::now() + Duration::from_secs_f64(secs.max(0.0));
            self.next_paused = Some(self.next_paused.map_or(at, |t| t.min(at)));
        }
    }

    // ---- child I/O -----------------------------------------------------------------

    fn write_to(&mut self, serial: u64) {
        let Some(w) = self.workers.get_mut(&serial) else {
            return;
        };
        if let Err(e) = w.flush() {
            log::warn!(
                "{}: worker {} (pid {}): cannot write ids: {e}",
                w.stage,
                serial,
                w.pid
            );
            // Its answers (and its exit) may already wait on stdout: read them first.
            self.read_from(serial);
            self.worker_gone(serial, Gone::Crash(format!("its stdin failed: {e}")));
        }
    }

    fn read_from(&mut self, serial: u64) {
        let Some(w) = self.workers.get_mut(&serial) else {
            return;
        };
        let read = w.read();
        for line in read.lines {
            if !self.workers.contains_key(&serial) {
                return;
            }
            self.on_line(serial, &line);
        }
        if read.overlong && self.workers.contains_key(&serial) {
            self.worker_gone(serial, Gone::Garbage("an overlong line".into()));
        } else if read.eof && self.workers.contains_key(&serial) {
            self.worker_gone(serial, Gone::Eof);
        }
    }

    fn on_line(&mut self, serial: u64, line: &str) {
        let w = self
            .workers
            .get_mut(&serial)
            .expect("checked by the caller");
        if w.phase == Phase::Starting {
            if line == protocol::READY {
                let stage = w.stage.clone();
                let max_messages = self
                    .stages
                    .get(&stage)
                    .map_or(u64::MAX, |s| s.section.max_messages);
                w.phase = if w.retire_on_ready || w.assigned_total >= max_messages {
                    Phase::Retiring
                } else {
                    Phase::Ready
                };
                log::debug!("{stage}: worker {serial} (pid {}) is ready", w.pid);
                if w.phase == Phase::Retiring && w.queue.is_empty() {
                    w.close_stdin(self.poll.registry());
                }
                self.write_to(serial);
            } else {
                self.worker_gone(
                    serial,
                    Gone::Garbage(format!("{:?} instead of ready", truncate(line))),
                );
            }
            return;
        }
        let parsed = match protocol::parse_status(line) {
            Ok(p) => p,
            Err(e) => {
                self.worker_gone(serial, Gone::Garbage(e));
                return;
            }
        };
        let Some(slot) = w.pop_front() else {
            self.worker_gone(
                serial,
                Gone::Garbage(format!("an answer {:?} to no message", truncate(line))),
            );
            return;
        };
        let stage = w.stage.clone();
        if w.answered == 1 {
            // It started and works: the stage's start failures are over.
            if let Some(s) = self.stages.get_mut(&stage) {
                s.cooldown_step = 0;
            }
        }
        let took = slot.head_since.map_or(Duration::ZERO, |t| t.elapsed());
        let retired = w.phase == Phase::Retiring;
        let drained = w.queue.is_empty();
        let id = slot.id;
        self.suspects.remove(&id);
        match parsed.status {
            // Nothing was committed: neither a pass nor the message's fault, and a
            // deferral is counted nowhere else (§8.4).
            protocol::STATUS_IOERR => {
                self.send(Command::Defer {
                    id,
                    stage: stage.clone(),
                });
            }
            protocol::STATUS_TEMPFAIL => {
                log::warn!(
                    "{stage}: message {id}: the database refused its worker a connection (overload); back to pending"
                );
                self.requeue(vec![(id, stage.clone(), slot.sender_key)]);
                self.throttle_biggest();
            }
            status => {
                self.policy.ran(&stage, &slot.sender_key, took);
                self.count_pass(&stage, id, &parsed.report, took.as_micros() as i64);
                if status != protocol::STATUS_OK {
                    self.deltas.stage(&stage).failures += 1;
                }
            }
        }
        if drained && retired {
            if let Some(w) = self.workers.get_mut(&serial) {
                w.close_stdin(self.poll.registry());
            }
        }
        self.want_claim = true;
    }

    fn count_pass(&mut self, stage: &str, id: i64, report: &Report, measured: i64) {
        self.deltas.stages_executed += 1;
        self.active_since_gc = true;
        match report {
            Report::Stages(list) if !list.is_empty() => {
                for (i, (name, us)) in list.iter().enumerate() {
                    let c = self.deltas.stage(name);
                    c.passes += 1;
                    c.busy_us += *us as i64;
                    if i > 0 {
                        c.fused_passes += 1;
                    }
                }
            }
            other => {
                if let Report::Unreadable(why) = other {
                    log::warn!(
                        "{stage}: message {id}: unreadable REPORT from its worker ({why}); its statistics are lost, the outcome counts"
                    );
                }
                let c = self.deltas.stage(stage);
                c.passes += 1;
                c.busy_us += measured;
            }
        }
    }

    // ---- worker deaths -------------------------------------------------------------

    fn worker_gone(&mut self, serial: u64, why: Gone) {
        let Some(mut w) = self.workers.remove(&serial) else {
            return;
        };
        self.tokens.remove(&w.out_token);
        self.tokens.remove(&w.in_token);
        if !matches!(why, Gone::Eof) {
            w.kill();
        }
        let status = w.reap(self.poll.registry(), REAP_GRACE);
        let stage = w.stage.clone();
        if let Some(s) = self.stages.get_mut(&stage) {
            s.workers.retain(|&x| x != serial);
            // A stage removed by a reload goes with its last worker.
            if s.removed && s.workers.is_empty() && s.queue.is_empty() {
                self.stages.remove(&stage);
            }
        }
        // Capacity was freed (or a retired worker's slot): claim again.
        self.want_claim = true;
        let slots: Vec<_> = w.queue.drain(..).collect();
        let delivered: HashSet<i64> = slots
            .iter()
            .filter(|s| w.delivered(s))
            .map(|s| s.id)
            .collect();
        let refused = w.answered == 0 && status.and_then(|s| s.code()) == Some(78);
        if w.phase == Phase::Starting || refused {
            // Failed at its own start: nobody is blamed (§8.1).
            let cause = match &why {
                Gone::Garbage(what) => format!("printed {what}"),
                Gone::StartTimeout => format!(
                    "was not ready within {}s and was killed",
                    self.opts.max_runtime.as_secs()
                ),
                _ if refused => {
                    "refused to run (exit 78: schema or configuration mismatch; its stderr says why)".into()
                }
                _ => describe_exit(status),
            };
            let before = if w.phase == Phase::Starting {
                "before it was ready"
            } else {
                "before answering anything"
            };
            let back: Vec<(i64, String, String)> = slots
                .into_iter()
                .map(|s| (s.id, stage.clone(), s.sender_key))
                .collect();
            self.start_failed(
                &stage,
                &format!("worker {serial} (pid {}) {cause} {before}", w.pid),
                back,
            );
            return;
        }
        let mut slots = slots.into_iter();
        let Some(front) = slots.next() else {
            if w.phase != Phase::Closing {
                log::warn!(
                    "{stage}: idle worker {serial} (pid {}) {}",
                    w.pid,
                    describe_exit(status)
                );
            }
            return;
        };
        let rest_slots: Vec<_> = slots.collect();
        // A Ctrl-C reaches the whole process group at once: the signal is pending here
        // before the worker can die of it, so its byte is on the socket by now even when
        // the poll reported the worker's end first.
        if self.stop.is_none() && signals::drain(&mut self.signals.shutdown) {
            log::info!("shutdown requested by signal");
            self.stop = Some(Stop::Signal);
        }
        if self.stop.is_some() {
            // Shutting down: a signal meant for the dispatcher may have reached its
            // workers too. Nobody is blamed; the shutdown reset puts the rows back.
            log::info!(
                "{stage}: worker {serial} (pid {}) {} during shutdown; its {} messages go back with the reset",
                w.pid,
                describe_exit(status),
                rest_slots.len() + 1
            );
            return;
        }
        let read_by_worker: Vec<i64> = rest_slots
            .iter()
            .filter(|s| delivered.contains(&s.id))
            .map(|s| s.id)
            .collect();
        let rest: Vec<(i64, String, String)> = rest_slots
            .into_iter()
            .map(|s| (s.id, stage.clone(), s.sender_key))
            .collect();
        if !delivered.contains(&front.id) {
            // It never reached the worker: not its fault.
            let mut back = vec![(front.id, stage.clone(), front.sender_key)];
            back.extend(rest);
            log::warn!(
                "{stage}: worker {serial} (pid {}) {}; {} messages it never read back to pending",
                w.pid,
                describe_exit(status),
                back.len()
            );
            self.requeue(back);
            return;
        }
        let (kind, reason) = match &why {
            Gone::Hang => (
                StrikeKind::TimedOut,
                format!(
                    "no answer within MAX_RUNTIME ({}s); worker pid {} killed",
                    self.opts.max_runtime.as_secs(),
                    w.pid
                ),
            ),
            Gone::Garbage(what) => (
                StrikeKind::Crashed,
                format!("worker pid {} sent {what} and was torn down", w.pid),
            ),
            Gone::Crash(what) => (
                StrikeKind::Crashed,
                format!("worker pid {} failed: {what}", w.pid),
            ),
            Gone::Eof | Gone::StartTimeout => (
                StrikeKind::Crashed,
                format!("worker pid {} {}", w.pid, describe_exit(status)),
            ),
        };
        log::warn!(
            "{stage}: message {}: {reason}; {} pipelined messages back to pending",
            front.id,
            rest.len()
        );
        let c = self.deltas.stage(&stage);
        match kind {
            StrikeKind::TimedOut => {
                c.timeouts += 1;
                self.policy.timed_out(&stage, &front.sender_key);
            }
            StrikeKind::Crashed => {
                c.crashes += 1;
                self.policy.ran(
                    &stage,
                    &front.sender_key,
                    front.head_since.map_or(Duration::ZERO, |t| t.elapsed()),
                );
            }
        }
        self.suspects.remove(&front.id);
        // A batching worker may have died on any of the ids it had read: run each of
        // them alone next time, so a poisoned one reaches the front and is blamed.
        if self.suspects.len() + read_by_worker.len() > MAX_SUSPECTS {
            self.suspects.clear();
        }
        self.suspects.extend(read_by_worker);
        self.send(Command::Strike {
            id: front.id,
            stage: stage.clone(),
            kind,
            error: reason,
        });
        self.requeue(rest);
    }

    /// A worker died before `ready`, or its program could not start: its ids go back,
    /// the stage is held for a growing cooldown.
    fn start_failed(&mut self, stage: &str, what: &str, mut back: Vec<(i64, String, String)>) {
        let now = Instant::now();
        let Some(s) = self.stages.get_mut(stage) else {
            self.requeue(back);
            return;
        };
        // Workers started together fail together: one cooldown step per episode.
        if !s.cooling(now) {
            s.cooldown_step += 1;
            let delay = (COOLDOWN_FIRST * (1u32 << (s.cooldown_step - 1).min(8))).min(COOLDOWN_CAP);
            s.cooldown_until = Some(now + delay);
        }
        let delay = s
            .cooldown_until
            .map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
        // Claimed ids waiting for a worker would wait out the cooldown as running.
        back.extend(
            s.queue
                .drain(..)
                .map(|(id, key)| (id, stage.to_string(), key)),
        );
        log::warn!(
            "{stage}: {what}; {} messages back to pending, no worker started for {}s",
            back.len(),
            delay.as_secs()
        );
        self.requeue(back);
    }

    /// Puts claimed rows back to pending: (id, claimed stage, sender key).
    fn requeue(&mut self, rows: Vec<(i64, String, String)>) {
        if rows.is_empty() {
            return;
        }
        for (_, stage, key) in &rows {
            self.deltas.stage(stage).requeues += 1;
            self.policy.requeued(stage, key);
        }
        self.send(Command::Requeue(
            rows.into_iter().map(|(id, stage, _)| (id, stage)).collect(),
        ));
    }

    /// Halves the PARALLELISM cap of the stage running the most workers (§8.3).
    fn throttle_biggest(&mut self) {
        let now = Instant::now();
        // The 75s of one worker batch are one overload episode.
        if self.last_throttle.is_some_and(|t| t + THROTTLE_GAP > now) {
            return;
        }
        self.last_throttle = Some(now);
        let Some((name, s)) = self
            .stages
            .iter_mut()
            .filter(|(_, s)| !s.workers.is_empty())
            .max_by_key(|(_, s)| s.workers.len())
        else {
            return;
        };
        let cap = (s.cap() / 2).max(1);
        s.throttle = Some((cap, now + THROTTLE_WINDOW));
        log::warn!(
            "database overload (a worker got too_many_connections or a pool timeout): stage {name} runs the most workers ({}); its PARALLELISM is capped at {cap} for {} minutes. Remedy: raise PostgreSQL max_connections or lower PARALLELISM",
            s.workers.len(),
            THROTTLE_WINDOW.as_secs() / 60
        );
    }

    // ---- timers --------------------------------------------------------------------

    fn timers(&mut self) {
        let now = Instant::now();
        let max_runtime = self.opts.max_runtime;
        let idle = self.opts.worker_idle_timeout;
        let mut hung = Vec::new();
        let mut slow_start = Vec::new();
        let mut stuck_closing = Vec::new();
        let mut idle_stop = Vec::new();
        for (&serial, w) in &self.workers {
            match w.phase {
                Phase::Starting if w.started + max_runtime <= now => slow_start.push(serial),
                Phase::Starting => {}
                _ if w.front_deadline(max_runtime).is_some_and(|d| d <= now) => hung.push(serial),
                Phase::Closing if w.closing_since.is_some_and(|t| t + CLOSE_GRACE <= now) => {
                    stuck_closing.push(serial)
                }
                Phase::Ready if w.queue.is_empty() && w.idle_since + idle <= now => {
                    idle_stop.push(serial)
                }
                _ => {}
            }
        }
        for serial in hung {
            self.worker_gone(serial, Gone::Hang);
        }
        for serial in slow_start {
            self.worker_gone(serial, Gone::StartTimeout);
        }
        for serial in stuck_closing {
            if let Some(w) = self.workers.get(&serial) {
                log::warn!(
                    "{}: worker {serial} (pid {}) did not exit within {}s of its end of input; killing it",
                    w.stage,
                    w.pid,
                    CLOSE_GRACE.as_secs()
                );
            }
            self.worker_gone(
                serial,
                Gone::Crash("it did not exit at end of input".into()),
            );
        }
        for serial in idle_stop {
            if let Some(w) = self.workers.get_mut(&serial) {
                log::debug!("{}: stopping idle worker {serial} (pid {})", w.stage, w.pid);
                w.close_stdin(self.poll.registry());
            }
        }
        for s in self.stages.values_mut() {
            if s.cooldown_until.is_some_and(|t| t <= now) {
                s.cooldown_until = None;
                self.want_claim = true;
            }
            if s.throttle.is_some_and(|(_, until)| until <= now) {
                log::info!(
                    "{}: the overload throttle window passed; PARALLELISM back to {}",
                    s.section.name,
                    s.section.parallelism
                );
                s.throttle = None;
                self.want_claim = true;
            }
        }
        if self.claim_retry_at.is_some_and(|t| t <= now) {
            self.claim_retry_at = None;
            self.want_claim = true;
        }
        if self.last_claim + self.opts.poll_interval <= now {
            self.want_claim = true;
        }
        if self.unknown_checked + UNKNOWN_STAGE_GAP <= now {
            self.unknown_checked = now;
            let known: Vec<String> = self.stages.keys().cloned().collect();
            let _ = self.jobs.send(Job::UnknownStages(known));
        }
        if self.next_paused.is_some_and(|t| t <= now) && !self.flip_in_flight && self.lock_held {
            self.flip_in_flight = true;
            self.next_paused = None;
            self.send(Command::FlipPaused);
        }
        if self.reload_retry_at.is_some_and(|t| t <= now) {
            self.reload_retry_at = None;
            self.want_reload = true;
        }
        if self.next_stats_tick <= now {
            self.next_stats_tick = now + self.opts.stats_interval;
            self.flush_stats();
            if self.active_since_gc {
                self.active_since_gc = false;
                let _ = self.jobs.send(Job::BodyGc);
            }
        }
        // The pipeline went idle: show a finished burst's numbers at once.
        if self.busy() {
            self.was_busy = true;
        } else if self.was_busy && !self.flush_in_flight && self.last_flush + IDLE_FLUSH_GAP <= now
        {
            self.was_busy = false;
            self.flush_stats();
        }
    }

    fn busy(&self) -> bool {
        self.claim_in_flight
            || self.workers.values().any(|w| !w.queue.is_empty())
            || self.stages.values().any(|s| !s.queue.is_empty())
    }

    fn flush_stats(&mut self) {
        if self.deltas.is_empty() || self.flush_in_flight {
            return;
        }
        self.flush_in_flight = true;
        self.last_flush = Instant::now();
        let deltas = std::mem::take(&mut self.deltas);
        let _ = self.jobs.send(Job::Flush(Box::new(deltas)));
    }

    /// The earliest time a timer needs the loop. Deadlines whose action is blocked
    /// (a claim or flip in flight, the lock lost) are left out, so the loop sleeps
    /// until the event that unblocks them instead of spinning.
    fn next_deadline(&self) -> Option<Instant> {
        let max_runtime = self.opts.max_runtime;
        let idle = self.opts.worker_idle_timeout;
        let can_claim = self.lock_held && !self.claim_in_flight;
        let mut times = vec![
            self.next_stats_tick,
            self.unknown_checked + UNKNOWN_STAGE_GAP,
        ];
        if can_claim {
            times.push(self.last_claim + self.opts.poll_interval);
            times.extend(self.claim_retry_at);
            if self.want_claim {
                times.push(Instant::now());
            }
        }
        if self.lock_held && !self.flip_in_flight {
            times.extend(self.next_paused);
        }
        times.extend(self.reload_retry_at);
        for w in self.workers.values() {
            match w.phase {
                Phase::Starting => times.push(w.started + max_runtime),
                _ => {
                    times.extend(w.front_deadline(max_runtime));
                    if w.phase == Phase::Ready && w.queue.is_empty() {
                        times.push(w.idle_since + idle);
                    }
                    if let Some(t) = w.closing_since {
                        times.push(t + CLOSE_GRACE);
                    }
                }
            }
        }
        for s in self.stages.values() {
            times.extend(s.cooldown_until);
            times.extend(s.throttle.map(|t| t.1));
        }
        if self.was_busy && !self.busy() && !self.flush_in_flight {
            times.push(self.last_flush + IDLE_FLUSH_GAP);
        }
        times.into_iter().min()
    }

    // ---- policy --------------------------------------------------------------------

    fn policy(&mut self) {
        if self.stop.is_some() {
            return;
        }
        if self.want_reload && !self.reload_in_flight {
            self.want_reload = false;
            self.reload_in_flight = true;
            let _ = self.jobs.send(Job::ReadOverlay);
        }
        self.assign();
        self.claim();
    }

    /// Hands claimed ids to workers, packing them onto as few as possible (ready ones
    /// first), starting a worker only when every existing one is full. A suspect of an
    /// earlier crash goes alone to an empty worker.
    fn assign(&mut self) {
        let now = Instant::now();
        let names: Vec<String> = self.stages.keys().cloned().collect();
        for name in names {
            loop {
                let s = &self.stages[&name];
                let Some((id, key)) = s.queue.front().cloned() else {
                    break;
                };
                let suspect = self.suspects.contains(&id);
                let limit = if suspect {
                    1
                } else {
                    s.section.queue_limit as usize
                };
                let max_messages = s.section.max_messages;
                let target = s
                    .workers
                    .iter()
                    .filter_map(|serial| self.workers.get(serial))
                    .filter(|w| {
                        matches!(w.phase, Phase::Starting | Phase::Ready)
                            && !w.retire_on_ready
                            && !w.isolated
                            && w.assigned_total < max_messages
                            && w.queue.len() < limit
                    })
                    .max_by_key(|w| {
                        (
                            w.phase == Phase::Ready,
                            w.queue.len(),
                            std::cmp::Reverse(w.serial),
                        )
                    })
                    .map(|w| w.serial);
                let serial = match target {
                    Some(serial) => serial,
                    None if !s.cooling(now) && (s.workers.len() as u32) < s.cap() => {
                        match self.start_worker(&name) {
                            Some(serial) => serial,
                            None => break,
                        }
                    }
                    None => {
                        if s.cooling(now) && s.workers.is_empty() {
                            // Nothing can run them during the cooldown.
                            let back: Vec<(i64, String, String)> = self
                                .stages
                                .get_mut(&name)
                                .expect("exists")
                                .queue
                                .drain(..)
                                .map(|(id, key)| (id, name.clone(), key))
                                .collect();
                            self.requeue(back);
                        }
                        break;
                    }
                };
                self.stages
                    .get_mut(&name)
                    .expect("exists")
                    .queue
                    .pop_front();
                let w = self.workers.get_mut(&serial).expect("exists");
                w.assign(id, key);
                w.isolated = suspect;
                if w.assigned_total >= max_messages && w.phase == Phase::Ready {
                    // Recycled once its pipeline drains (MAX_MESSAGES).
                    w.phase = Phase::Retiring;
                }
            }
        }
        let serials: Vec<u64> = self.workers.keys().copied().collect();
        for serial in serials {
            let needs_write = self
                .workers
                .get(&serial)
                .is_some_and(|w| w.phase != Phase::Starting && w.queue.iter().any(|s| !s.written));
            if needs_write {
                self.write_to(serial);
            }
        }
    }

    fn start_worker(&mut self, stage: &str) -> Option<u64> {
        let serial = self.next_serial;
        self.next_serial += 1;
        let (out_token, in_token) = (Token(self.next_token), Token(self.next_token + 1));
        self.next_token += 2;
        let program = self.stages[stage].section.program.clone();
        let launch = Launch {
            program: &program,
            config_file: self.opts.config_file.as_deref(),
            inherited_config: &self.config.path,
        };
        let spawned = WorkerProc::spawn(
            serial,
            stage,
            &launch,
            self.poll.registry(),
            (out_token, in_token),
        );
        match spawned {
            Ok(w) => {
                log::debug!(
                    "{stage}: started worker {serial} (pid {}): {program}",
                    w.pid
                );
                self.deltas.worker_starts += 1;
                self.tokens.insert(out_token, serial);
                self.tokens.insert(in_token, serial);
                self.workers.insert(serial, w);
                self.stages
                    .get_mut(stage)
                    .expect("exists")
                    .workers
                    .push(serial);
                Some(serial)
            }
            Err(e) => {
                self.start_failed(
                    stage,
                    &format!("cannot start PROGRAM {program}: {e}"),
                    Vec::new(),
                );
                None
            }
        }
    }

    /// Claims for every stage with free capacity, in one statement, when a wake-up
    /// asked for it and no claim is in flight.
    fn claim(&mut self) {
        if !self.want_claim || self.claim_in_flight || !self.lock_held {
            return;
        }
        let now = Instant::now();
        let heartbeat = self.last_claim + self.opts.poll_interval <= now;
        let mut asked = Vec::new();
        for (name, s) in &self.stages {
            if s.removed {
                continue;
            }
            let workers: Vec<&WorkerProc> = s
                .workers
                .iter()
                .filter_map(|x| self.workers.get(x))
                .collect();
            let retiring = workers
                .iter()
                .filter(|w| matches!(w.phase, Phase::Retiring | Phase::Closing))
                .count() as u32;
            let usable = if s.cooling(now) {
                workers.len() as u32 - retiring
            } else {
                s.cap().saturating_sub(retiring)
            };
            let in_flight: usize = workers
                .iter()
                .filter(|w| matches!(w.phase, Phase::Starting | Phase::Ready))
                .map(|w| w.queue.len())
                .sum::<usize>()
                + s.queue.len()
                + s.reserved;
            let capacity =
                (usable as usize * s.section.queue_limit as usize).saturating_sub(in_flight);
            if capacity > 0 {
                asked.push((name.clone(), capacity as i32));
            }
        }
        self.want_claim = false;
        if asked.is_empty() && !heartbeat {
            return;
        }
        for (name, cap) in &asked {
            self.stages.get_mut(name).expect("exists").reserved = *cap as usize;
        }
        self.claim_in_flight = true;
        self.claim_retry_at = None;
        self.last_claim = now;
        let request = self.policy.request(asked);
        self.send(Command::Claim(request));
    }

    // ---- reload --------------------------------------------------------------------

    fn apply_reload(&mut self, overlay: &[crate::config::graph::OverrideRow]) {
        // A file that cannot be read right now (replaced, briefly missing) is not a
        // broken configuration: keep the graph and try again, as for the overlay.
        if let Err(e) = std::fs::File::open(&self.config.path) {
            log::warn!(
                "cannot read {} ({e}); keeping the current stage graph and retrying the reload in {}s",
                self.config.path.display(),
                RELOAD_RETRY.as_secs()
            );
            self.reload_retry_at = Some(Instant::now() + RELOAD_RETRY);
            return;
        }
        let file = match Config::load(Some(&self.config.path)) {
            Ok(c) => c,
            Err(errors) => {
                self.stop = Some(Stop::Fail(Failure::config(format!(
                    "the reloaded configuration does not parse; shutting down:\n{}",
                    join_errors(&errors)
                ))));
                return;
            }
        };
        let graph = match StageGraph::build(&file.stage_sections, overlay) {
            Ok(g) => g,
            Err(errors) => {
                self.stop = Some(Stop::Fail(Failure::config(format!(
                    "the reloaded stage graph is invalid; shutting down:\n{}",
                    join_errors(&errors)
                ))));
                return;
            }
        };
        // What workers read at start: the stage graph and the file's [pepsi] and
        // [pepsi-postgres]. Nothing of it changed: keep the workers.
        if graph == self.graph
            && file.pepsi == self.config.pepsi
            && file.postgres == self.config.postgres
        {
            log::debug!("configuration re-read: unchanged");
            return;
        }
        log::info!(
            "stage configuration reloaded: {} stages; retiring every worker",
            graph.stages().count()
        );
        let mut back = Vec::new();
        for (name, s) in self.stages.iter_mut() {
            match graph.get(name) {
                Some(section) => {
                    s.section = section.clone();
                    s.removed = false;
                }
                None => {
                    s.removed = true;
                    back.extend(s.queue.drain(..).map(|(id, key)| (id, name.clone(), key)));
                }
            }
        }
        for section in graph.stages() {
            self.stages
                .entry(section.name.clone())
                .or_insert_with(|| StageState::new(section.clone()));
        }
        // [pepsi-dispatch] is not reloaded: the pool and timers were made from it.
        let dispatch = self.config.dispatch.clone();
        self.config = Config { dispatch, ..file };
        self.graph = graph;
        self.requeue(back);
        self.retire_all();
        self.stages
            .retain(|_, s| !(s.removed && s.workers.is_empty()));
        self.want_claim = true;
    }

    /// Retires every worker: idle ones at once, busy ones when their pipeline drains.
    fn retire_all(&mut self) {
        for w in self.workers.values_mut() {
            match w.phase {
                Phase::Closing => {}
                _ if w.queue.is_empty() => w.close_stdin(self.poll.registry()),
                _ => {
                    if w.phase == Phase::Ready {
                        w.phase = Phase::Retiring;
                    } else if w.phase == Phase::Starting {
                        // It gets the ids it holds, then no more.
                        w.retire_on_ready = true;
                    }
                }
            }
        }
    }

    // ---- shutdown ------------------------------------------------------------------

    fn send(&self, command: Command) {
        if self.coordinator.send(command).is_err() {
            log::error!("the coordinator thread is gone");
        }
    }

    fn shutdown(mut self) -> Result<(), Failure> {
        log::info!("shutting down: stopping {} workers", self.workers.len());
        let serials: Vec<u64> = self.workers.keys().copied().collect();
        // Answers already in the pipes are outcomes committed: count them before the
        // kill. (`stop` is still set: a death found here blames nobody.)
        for &serial in &serials {
            self.read_from(serial);
        }
        let stop = self.stop.take().unwrap_or(Stop::Signal);
        for serial in serials {
            if let Some(mut w) = self.workers.remove(&serial) {
                w.kill();
                w.reap(self.poll.registry(), REAP_GRACE);
            }
        }
        // Every running row is this dispatcher's (claimed, in flight, or from a claim
        // still in the coordinator's queue, which runs before this command).
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        if self.coordinator.send(Command::Reset).is_ok() {
            loop {
                match self.events.recv_deadline(deadline) {
                    Ok(Event::ResetDone(Ok(n))) => {
                        log::info!("{n} in-flight rows back to pending");
                        break;
                    }
                    Ok(Event::ResetDone(Err(e))) => {
                        log::warn!("cannot reset in-flight rows ({e}); the next start resets them");
                        break;
                    }
                    Ok(Event::Flushed(result)) => self.on_event(Event::Flushed(result)),
                    Ok(Event::Claimed { rows, .. }) if !rows.is_empty() => {
                        self.deltas.claims += 1;
                        self.deltas.rows_claimed += rows.len() as i64;
                    }
                    Ok(_) => {}
                    Err(_) => {
                        log::warn!(
                            "the in-flight rows were not reset in time; the next start resets them"
                        );
                        break;
                    }
                }
            }
        }
        // The last statistics: wait for a flush in flight, then write what is left.
        while self.flush_in_flight {
            match self.events.recv_deadline(deadline) {
                Ok(Event::Flushed(result)) => self.on_event(Event::Flushed(result)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        self.flush_stats();
        while self.flush_in_flight {
            match self.events.recv_deadline(deadline) {
                Ok(Event::Flushed(Ok(()))) => self.flush_in_flight = false,
                Ok(Event::Flushed(Err((e, _)))) => {
                    log::warn!("the last statistics flush failed: {e}");
                    self.flush_in_flight = false;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        match stop {
            Stop::Signal => {
                log::info!("stopped");
                Ok(())
            }
            Stop::Fail(f) => Err(f),
        }
    }
}

/// How a worker went away.
enum Gone {
    /// Its stdout closed.
    Eof,
    /// It said something unreadable.
    Garbage(String),
    /// Its front message ran past MAX_RUNTIME.
    Hang,
    /// It was not ready within MAX_RUNTIME.
    StartTimeout,
    /// Its pipe failed.
    Crash(String),
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
