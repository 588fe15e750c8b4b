//! The loop's worker handlers (§5, §8): a worker's pipes becoming writable or readable,
//! its status lines read into the claim ledger, its end judged by the
//! [`verdict`](super::verdict) and carried out — the strike, the requeues, the
//! suspects, the cooldown — and the 75 throttle; plus the policy step's assignment of
//! claimed ids to workers, starting workers as needed.
//!
//! Called by the loop ([`super::event_loop`]: readiness, worker timers, the policy
//! step) and by shutdown. These handlers record facts and carry out decisions; the
//! decisions are the pure functions of [`super::pool`] and [`super::verdict`]. The
//! workers and stages are changed only through the verbs of their owner
//! ([`super::pools`]), the claims' accounts only through the claim side's
//! ([`super::claim_side`]); a process is started here ([`WorkerProc::spawn`]) and
//! otherwise handled only through [`super::process`].

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::coordinator::Command;
use super::event_loop::Dispatcher;
use super::ledger::vet_report;
use super::pool::{self, Cooldown, Pick};
use super::process::{self, Launch, Slot, WorkerProc, describe_exit};
use super::verdict::{self, Death, End, Held, Verdict};
use super::worker_view::Phase;
use crate::exit::{self, Failure};
use crate::launcher::SpawnError;
use crate::protocol;

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl Dispatcher {
    // ---- I/O ------------------------------------------------------------------------

    /// Writes what the worker's stdin takes.
    pub(super) fn write_to(&mut self, serial: u64) {
        let Some(flushed) = self.pools.flush(serial) else {
            return;
        };
        self.note_started(serial);
        if let Err(e) = flushed {
            if let Some(w) = self.pools.worker(serial) {
                log::warn!(
                    "{}: worker {serial} (pid {}): cannot write ids: {e}",
                    w.stage,
                    w.pid
                );
            }
            // Its answers (and its exit) may already wait on stdout: read them first.
            self.read_from(serial);
            self.worker_gone(serial, End::Crash(format!("its stdin failed: {e}")));
        }
    }

    /// Reads every complete line the worker wrote, then acts on its end if it ended.
    pub(super) fn read_from(&mut self, serial: u64) {
        let Some(read) = self.pools.read(serial) else {
            return;
        };
        for line in read.lines {
            if !self.pools.has_worker(serial) {
                return;
            }
            self.on_line(serial, &line);
        }
        if read.overlong && self.pools.has_worker(serial) {
            self.worker_gone(serial, End::Garbage("an overlong line".into()));
        } else if read.eof && self.pools.has_worker(serial) {
            self.worker_gone(serial, End::Eof);
        }
    }

    /// Claims that reached the head of a worker's queue start their clocks.
    fn note_started(&mut self, serial: u64) {
        for claim in self.pools.take_started(serial) {
            self.claim_side.ledger().started(&claim);
        }
    }

    fn on_line(&mut self, serial: u64, line: &str) {
        if self.pools.is_starting(serial) {
            if line != protocol::READY {
                let what = format!("{:?} instead of ready", truncate(line));
                self.worker_gone(serial, End::Garbage(what));
                return;
            }
            self.pools.ready(serial, self.poll.registry());
            self.write_to(serial);
            return;
        }
        let parsed = match protocol::parse_status(line) {
            Ok(p) => p,
            Err(e) => {
                self.worker_gone(serial, End::Garbage(e));
                return;
            }
        };
        let Some(slot) = self.pools.answered(serial, self.poll.registry()) else {
            let what = format!("an answer {:?} to no message", truncate(line));
            self.worker_gone(serial, End::Garbage(what));
            return;
        };
        self.note_started(serial);
        let stage = slot.claim.stage.clone();
        // Nothing committed (74) or an overload (75): claim as after any change.
        let settled = !matches!(
            parsed.status,
            protocol::STATUS_IOERR | protocol::STATUS_TEMPFAIL
        );
        self.on_answer(serial, slot, parsed);
        if !settled || self.pools.refill_due(&stage, Instant::now()) {
            self.claim_side.want();
        }
    }

    /// One status line for the claim at the front.
    fn on_answer(&mut self, serial: u64, slot: Slot, parsed: protocol::StatusLine) {
        let took = slot.head_since.map_or(Duration::ZERO, |t| t.elapsed());
        let claim = slot.claim;
        self.pools.clear_suspect(claim.id);
        match parsed.status {
            // Nothing was committed: neither a pass nor the message's fault (§8.4). The
            // row is paused for 30 s, and resumed earlier, once the dispatcher's own
            // session works.
            protocol::STATUS_IOERR => {
                self.claim_side.defer(&claim, Instant::now());
                self.send(Command::Defer(claim));
            }
            protocol::STATUS_TEMPFAIL => {
                log::warn!(
                    "{}: message {}: the database refused its worker a connection (overload); back to pending",
                    claim.stage,
                    claim.id
                );
                let stage = claim.stage.clone();
                self.requeue(vec![claim]);
                self.overloaded(&stage);
            }
            status => {
                self.pools.answered_fine(&claim.stage);
                let max_us = u64::try_from(self.opts.max_runtime.as_micros()).unwrap_or(u64::MAX);
                let graph = &self.graph;
                let vetted = vet_report(
                    (&parsed.report, &parsed.events),
                    &claim.stage,
                    took,
                    max_us,
                    |name| graph.get(name).is_some(),
                );
                if let protocol::Report::Unreadable(why) = &parsed.report {
                    log::warn!(
                        "{}: message {}: unreadable REPORT from its worker ({why}); its statistics are lost, the outcome counts",
                        claim.stage,
                        claim.id
                    );
                }
                if !vetted.unknown.is_empty() || vetted.clamped || !vetted.refused_events.is_empty()
                {
                    if let Some(pid) = self.pools.first_report_warning(serial) {
                        log::warn!(
                            "{}: worker {serial} (pid {pid}) reports stages not in the configuration {:?}, more than MAX_RUNTIME, or events that are not counted {:?}; those figures are ignored or capped (said once per worker)",
                            claim.stage,
                            vetted.unknown,
                            vetted.refused_events
                        );
                    }
                }
                self.claim_side
                    .ledger()
                    .ran(&claim, took, &vetted, status != protocol::STATUS_OK);
                self.housekeeping.note_active();
            }
        }
    }

    // ---- deaths ---------------------------------------------------------------------

    /// A worker went away: judge what it means and carry it out.
    pub(super) fn worker_gone(&mut self, serial: u64, end: End) {
        let Some(w) = self.pools.worker(serial) else {
            return;
        };
        // A worker that closed its output after its input was closed and held nothing
        // simply finished; anything else may have left helpers or statements running.
        let clean = end == End::Eof && w.phase == Phase::Closing && w.queue.is_empty();
        let (was_ready, was_closing, answered) = (
            w.phase != Phase::Starting,
            w.phase == Phase::Closing,
            w.answered,
        );
        let delivered: Vec<bool> = w.queue.iter().map(|s| w.delivered(s)).collect();
        let Some((mut w, exit)) = self.pools.remove(serial, !clean, self.poll.registry()) else {
            return;
        };
        let (pid, stage) = (w.pid, std::mem::take(&mut w.stage));
        let session = std::mem::take(&mut w.session);
        let slots: Vec<Slot> = w.queue.drain(..).collect();
        if !clean {
            self.send(Command::TerminateSessions(vec![session]));
        }
        // Capacity was freed (or a retired worker's slot): claim again.
        self.claim_side.want();
        // A Ctrl-C reaches the whole process group at once: the signal is pending here
        // before a worker can die of it, so its byte is on the socket by now even when
        // the poll reported the worker's end first.
        if !self.stopping() && !slots.is_empty() {
            self.on_shutdown_signal();
        }
        let death = Death {
            pid,
            end,
            was_ready,
            was_closing,
            answered,
            exit_code: exit.and_then(|s| s.code()),
            exit_signal: exit.and_then(|s| s.signal()),
            exit_text: describe_exit(exit),
            held: slots
                .into_iter()
                .zip(delivered)
                .map(|(slot, delivered)| Held {
                    claim: slot.claim,
                    delivered,
                    head_since: slot.head_since,
                })
                .collect(),
            stopping: self.stopping(),
            max_runtime: self.opts.max_runtime,
            now: Instant::now(),
        };
        self.apply(&stage, serial, verdict::judge(death));
    }

    fn apply(&mut self, stage: &str, serial: u64, verdict: Verdict) {
        match verdict {
            Verdict::StartFailure {
                cause,
                back,
                cooldown,
            } => {
                let what = format!("worker {serial}: {cause}");
                self.start_failed(stage, &what, back, cooldown);
            }
            Verdict::Overload { back } => {
                log::warn!(
                    "{stage}: worker {serial} could not connect to the database (overload, exit 75); {} messages back to pending",
                    back.len()
                );
                self.requeue(back);
                self.overloaded(stage);
            }
            Verdict::Idle { log: Some(what) } => log::warn!("{stage}: {what}"),
            Verdict::Idle { log: None } => {}
            Verdict::Stopping { held } => {
                // A signal meant for the dispatcher may have reached its workers too.
                // Nobody is blamed; the shutdown reset puts the rows back.
                log::info!(
                    "{stage}: worker {serial} ended during shutdown; its {} messages go back with the reset",
                    held.len()
                );
                self.claim_side.ledger().dropped(&held);
            }
            Verdict::Unread { back } => {
                log::warn!(
                    "{stage}: worker {serial} ended; {} messages it never read back to pending",
                    back.len()
                );
                self.requeue(back);
            }
            Verdict::Suspects {
                reason,
                suspects,
                back,
            } => {
                log::warn!(
                    "{stage}: {reason} with {} messages delivered to it, any of which may be the cause; nobody is struck: each runs alone next ({:?}), {} never delivered back to pending",
                    suspects.len(),
                    suspects.iter().map(|c| c.id).collect::<Vec<_>>(),
                    back.len()
                );
                self.pools.add_suspects(&suspects);
                self.requeue(suspects);
                self.requeue(back);
            }
            Verdict::Strike {
                front,
                kind,
                reason,
                took,
                back,
            } => {
                log::warn!(
                    "{stage}: message {}: {reason}; {} pipelined messages back to pending",
                    front.id,
                    back.len()
                );
                self.pools.clear_suspect(front.id);
                self.claim_side.ledger().struck(&front, kind, took);
                self.send(Command::Strike {
                    claim: front,
                    kind,
                    error: reason,
                });
                self.requeue(back);
            }
        }
    }

    /// A worker died before `ready`, or its program could not start: its ids go back
    /// with every claim waiting for the stage, and the stage is held for a cooldown.
    fn start_failed(&mut self, stage: &str, what: &str, mut back: Vec<Claim>, cooldown: Cooldown) {
        let Some((delay, waiting)) = self.pools.cool_down(stage, cooldown, Instant::now()) else {
            self.requeue(back);
            return;
        };
        // Claimed ids waiting for a worker would wait out the cooldown as running.
        back.extend(waiting);
        log::warn!(
            "{stage}: {what}; {} messages back to pending, no worker started for {}s",
            back.len(),
            delay.as_secs()
        );
        self.requeue(back);
    }

    /// The database refused a worker of `stage` a connection for overload (§8.3): the
    /// stage backs off before claiming again, and the biggest stage is throttled.
    fn overloaded(&mut self, stage: &str) {
        if let Some(wait) = self.pools.back_off(stage, Instant::now()) {
            log::warn!(
                "{stage}: backing off for {} ms before claiming again (database overload)",
                wait.as_millis()
            );
        }
        if let Some(t) = self.pools.throttle_biggest(Instant::now()) {
            log::warn!(
                "database overload (a worker got too_many_connections or a pool timeout): stage {} runs the most workers ({}); its PARALLELISM is capped at {} for {} minutes. Remedy: raise PostgreSQL max_connections or lower PARALLELISM",
                t.stage,
                t.workers,
                t.cap,
                pool::THROTTLE_WINDOW.as_secs() / 60
            );
        }
    }

    // ---- assignment -----------------------------------------------------------------

    /// Hands claimed ids to workers as the pool decides, starting workers as needed,
    /// then writes every worker's new ids. Nothing is handed out without the lock: the
    /// claims wait for the re-take (they are held, so the reconcile keeps them).
    pub(super) fn assign(&mut self) {
        if !self.claim_side.lock_held() {
            return;
        }
        let now = Instant::now();
        for name in self.pools.stage_names() {
            loop {
                let serial = match self.pools.next_pick(&name, now) {
                    None | Some(Pick::Wait) => break,
                    Some(Pick::Worker(serial)) => serial,
                    Some(Pick::Start) => match self.start_worker(&name) {
                        Some(serial) => serial,
                        None => break,
                    },
                    Some(Pick::GiveBack) => {
                        // Nothing can run them during the cooldown.
                        let back = self.pools.take_waiting(&name);
                        self.requeue(back);
                        break;
                    }
                };
                self.pools.hand_front(&name, serial);
            }
        }
        for serial in self.pools.unwritten() {
            self.write_to(serial);
        }
    }

    fn start_worker(&mut self, stage: &str) -> Option<u64> {
        let (serial, tokens) = self.pools.new_ids();
        // Chosen before the fork, so that it can be handed to the worker in its
        // environment (see `protocol::dispatched_session_name`).
        let session = protocol::dispatched_session_name(self.session_tag, serial, stage);
        let section = self.pools.section(stage).expect("a stage with claims");
        let program = section.program.clone();
        let runs_command = section.section.get("COMMAND").is_some();
        // A stage that runs a command gets a keeper of the launcher's, which runs it as
        // the stage's USER (§4 "Containment"), when started as root; otherwise
        // the worker starts a keeper of its own.
        let launch = Launch {
            program: &program,
            handoff: &self.handoff,
            keeper: runs_command,
        };
        match WorkerProc::spawn(
            serial,
            stage,
            &session,
            &launch,
            &self.launcher,
            self.poll.registry(),
            tokens,
        ) {
            Ok(w) => {
                log::debug!(
                    "{stage}: started worker {serial} (pid {}, database sessions {session:?}): {program}",
                    w.pid
                );
                self.claim_side.ledger().worker_started();
                self.pools.insert(w);
                Some(serial)
            }
            Err(SpawnError::Failed { message, child }) => {
                if let Some(pid) = child {
                    // The child that could not exec is ours to reap.
                    process::reap_failed_start(pid);
                    self.launcher.done(pid);
                }
                let what = format!("cannot start PROGRAM {program}: {message}");
                self.start_failed(stage, &what, Vec::new(), Cooldown::Growing);
                None
            }
            Err(SpawnError::Lost(e)) => {
                // The launcher is gone, and with it every worker start: a restart
                // makes a new one.
                self.fail(Failure::new(exit::EX_SOFTWARE, e));
                None
            }
        }
    }
}
