//! The loop's worker handlers (§5, §8): handing claimed ids to workers (starting them as
//! needed), reading their status lines into the claim ledger, and applying the
//! [`verdict`](super::verdict) on a worker's end — the strike, the requeues, the
//! suspects, the cooldown — plus the 75 throttle and retirements.
//!
//! These handlers record facts and carry out decisions; the decisions themselves are
//! the pure functions of [`super::pool`] and [`super::verdict`]. Processes are started,
//! written, read, killed and reaped only through [`super::process`].

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::coordinator::Command;
use super::event_loop::{Dispatcher, Stop};
use super::ledger::vet_report;
use super::pool::{self, Cooldown, Pick, StagePool};
use super::process::{Launch, Slot, WorkerProc, describe_exit};
use super::signals;
use super::verdict::{self, Death, End, Held, Verdict};
use super::worker_view::{Phase, WorkerView};
use crate::exit::{self, Failure};
use crate::protocol;

/// How long a worker may take to exit after its stdout closed before it is killed.
const REAP_GRACE: Duration = Duration::from_millis(200);
/// Overload halvings closer together than this are one episode (a batch of 75s).
const THROTTLE_GAP: Duration = Duration::from_secs(1);
/// Suspects remembered at most (they are only a hint).
const MAX_SUSPECTS: usize = 10_000;

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
        let Some(w) = self.workers.get_mut(&serial) else {
            return;
        };
        let flushed = w.flush();
        self.note_started(serial);
        if let Err(e) = flushed {
            log::warn!(
                "{}: worker {serial} (pid {}): cannot write ids: {e}",
                self.workers[&serial].stage,
                self.workers[&serial].pid
            );
            // Its answers (and its exit) may already wait on stdout: read them first.
            self.read_from(serial);
            self.worker_gone(serial, End::Crash(format!("its stdin failed: {e}")));
        }
    }

    /// Reads every complete line the worker wrote, then acts on its end if it ended.
    pub(super) fn read_from(&mut self, serial: u64) {
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
            self.worker_gone(serial, End::Garbage("an overlong line".into()));
        } else if read.eof && self.workers.contains_key(&serial) {
            self.worker_gone(serial, End::Eof);
        }
    }

    /// Claims that reached the head of a worker's queue start their clocks.
    fn note_started(&mut self, serial: u64) {
        if let Some(w) = self.workers.get_mut(&serial) {
            for claim in w.take_started() {
                self.ledger.started(&claim);
            }
        }
    }

    fn on_line(&mut self, serial: u64, line: &str) {
        let w = self
            .workers
            .get_mut(&serial)
            .expect("checked by the caller");
        if w.phase == Phase::Starting {
            if line != protocol::READY {
                let what = format!("{:?} instead of ready", truncate(line));
                self.worker_gone(serial, End::Garbage(what));
                return;
            }
            let max_messages = self
                .stages
                .get(&w.stage)
                .map_or(u64::MAX, |s| s.section.max_messages);
            w.phase = if w.retire_on_ready || w.assigned_total >= max_messages {
                Phase::Retiring
            } else {
                Phase::Ready
            };
            log::debug!("{}: worker {serial} (pid {}) is ready", w.stage, w.pid);
            if w.phase == Phase::Retiring && w.queue.is_empty() {
                w.close_stdin(self.poll.registry());
            }
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
        let Some(slot) = w.pop_front() else {
            let what = format!("an answer {:?} to no message", truncate(line));
            self.worker_gone(serial, End::Garbage(what));
            return;
        };
        let first_answer = w.answered == 1;
        if w.phase == Phase::Retiring && w.queue.is_empty() {
            w.close_stdin(self.poll.registry());
        }
        self.note_started(serial);
        if first_answer {
            // It started and works: the stage's start failures are over.
            if let Some(s) = self.stages.get_mut(&slot.claim.stage) {
                s.started_fine();
            }
        }
        self.on_answer(serial, slot, parsed);
        self.gate.want = true;
    }

    /// One status line for the claim at the front.
    fn on_answer(&mut self, serial: u64, slot: Slot, parsed: protocol::StatusLine) {
        let took = slot.head_since.map_or(Duration::ZERO, |t| t.elapsed());
        let claim = slot.claim;
        self.suspects.remove(&claim.id);
        match parsed.status {
            // Nothing was committed: neither a pass nor the message's fault (§8.4).
            protocol::STATUS_IOERR => self.defer(claim),
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
                if let Some(s) = self.stages.get_mut(&claim.stage) {
                    s.answered_fine();
                }
                let max_us = u64::try_from(self.opts.max_runtime.as_micros()).unwrap_or(u64::MAX);
                let graph = &self.graph;
                let vetted = vet_report(&parsed.report, &claim.stage, took, max_us, |name| {
                    graph.get(name).is_some()
                });
                if let protocol::Report::Unreadable(why) = &parsed.report {
                    log::warn!(
                        "{}: message {}: unreadable REPORT from its worker ({why}); its statistics are lost, the outcome counts",
                        claim.stage,
                        claim.id
                    );
                }
                let w = self.workers.get_mut(&serial).expect("it just answered");
                if (!vetted.unknown.is_empty() || vetted.clamped) && !w.report_warned {
                    w.report_warned = true;
                    log::warn!(
                        "{}: worker {serial} (pid {}) reports stages not in the configuration {:?} or more than MAX_RUNTIME; those figures are ignored or capped (said once per worker)",
                        claim.stage,
                        w.pid,
                        vetted.unknown
                    );
                }
                self.ledger
                    .ran(&claim, took, &vetted, status != protocol::STATUS_OK);
                self.active_since_gc = true;
            }
        }
    }

    // ---- deaths ---------------------------------------------------------------------

    /// Takes a worker out of the table; kills it (its whole session) when asked, and
    /// reaps it. Returns the process (with the slots it held) and its exit status.
    pub(super) fn remove_worker(
        &mut self,
        serial: u64,
        kill: bool,
    ) -> Option<(WorkerProc, Option<ExitStatus>)> {
        let mut w = self.workers.remove(&serial)?;
        self.tokens.remove(&w.out_token);
        self.tokens.remove(&w.in_token);
        if kill {
            w.kill();
        }
        let exit = w.reap(self.poll.registry(), REAP_GRACE);
        if let Some(s) = self.stages.get_mut(&w.stage) {
            s.workers.retain(|&x| x != serial);
            // A stage removed by a reload goes with its last worker.
            if s.removed && s.workers.is_empty() && s.queue.is_empty() {
                self.stages.remove(&w.stage);
            }
        }
        Some((w, exit))
    }

    /// A worker went away: judge what it means and carry it out.
    pub(super) fn worker_gone(&mut self, serial: u64, end: End) {
        let Some(w) = self.workers.get(&serial) else {
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
        let Some((mut w, exit)) = self.remove_worker(serial, !clean) else {
            return;
        };
        let (pid, stage) = (w.pid, std::mem::take(&mut w.stage));
        let session = std::mem::take(&mut w.session);
        let slots: Vec<Slot> = w.queue.drain(..).collect();
        if !clean {
            self.send(Command::TerminateSessions(vec![session]));
        }
        // Capacity was freed (or a retired worker's slot): claim again.
        self.gate.want = true;
        // A Ctrl-C reaches the whole process group at once: the signal is pending here
        // before a worker can die of it, so its byte is on the socket by now even when
        // the poll reported the worker's end first.
        if self.stop.is_none() && !slots.is_empty() && signals::drain(&mut self.signals.shutdown) {
            log::info!("shutdown requested by signal");
            self.stop = Some(super::event_loop::Stop::Signal);
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
            stopping: self.stop.is_some(),
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
                self.ledger.dropped(&held);
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
                if self.suspects.len() + suspects.len() > MAX_SUSPECTS {
                    self.suspects.clear();
                }
                self.suspects.extend(suspects.iter().map(|c| c.id));
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
                self.suspects.remove(&front.id);
                self.ledger.struck(&front, kind, took);
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
    pub(super) fn start_failed(
        &mut self,
        stage: &str,
        what: &str,
        mut back: Vec<Claim>,
        cooldown: Cooldown,
    ) {
        let Some(s) = self.stages.get_mut(stage) else {
            self.requeue(back);
            return;
        };
        let delay = s.cool_down(Instant::now(), cooldown);
        // Claimed ids waiting for a worker would wait out the cooldown as running.
        back.extend(s.queue.drain(..));
        log::warn!(
            "{stage}: {what}; {} messages back to pending, no worker started for {}s",
            back.len(),
            delay.as_secs()
        );
        self.requeue(back);
    }

    /// Puts claims back to pending without their having run.
    pub(super) fn requeue(&mut self, claims: Vec<Claim>) {
        if claims.is_empty() {
            return;
        }
        self.ledger.requeued(&claims);
        self.send(Command::Requeue(claims));
    }

    /// The database refused a worker of `stage` a connection for overload (§8.3): the
    /// stage backs off before claiming again, and the biggest stage is throttled.
    fn overloaded(&mut self, stage: &str) {
        if let Some(s) = self.stages.get_mut(stage) {
            let wait = s.back_off(Instant::now());
            log::warn!(
                "{stage}: backing off for {} ms before claiming again (database overload)",
                wait.as_millis()
            );
        }
        self.throttle_biggest();
    }

    /// Halves the PARALLELISM cap of the stage running the most workers (§8.3).
    fn throttle_biggest(&mut self) {
        let now = Instant::now();
        // The 75s of one worker batch are one overload episode.
        if self.last_throttle.is_some_and(|t| t + THROTTLE_GAP > now) {
            return;
        }
        self.last_throttle = Some(now);
        let Some(name) = pool::biggest(&self.stages) else {
            return;
        };
        let s = self.stages.get_mut(&name).expect("biggest exists");
        let cap = s.throttle(now);
        log::warn!(
            "database overload (a worker got too_many_connections or a pool timeout): stage {name} runs the most workers ({}); its PARALLELISM is capped at {cap} for {} minutes. Remedy: raise PostgreSQL max_connections or lower PARALLELISM",
            s.workers.len(),
            pool::THROTTLE_WINDOW.as_secs() / 60
        );
    }

    // ---- assignment -----------------------------------------------------------------

    /// What the pool decisions see of a stage's workers.
    pub(super) fn views(&self, stage: &StagePool) -> Vec<WorkerView> {
        stage
            .workers
            .iter()
            .filter_map(|serial| self.workers.get(serial))
            .map(|w| w.view())
            .collect()
    }

    /// Hands claimed ids to workers as the pool decides, starting workers as needed,
    /// then writes every worker's new ids. Nothing is handed out without the lock: the
    /// claims wait for the re-take (they are held, so the reconcile keeps them).
    pub(super) fn assign(&mut self) {
        if !self.gate.lock_held {
            return;
        }
        let now = Instant::now();
        let names: Vec<String> = self.stages.keys().cloned().collect();
        for name in names {
            loop {
                let s = &self.stages[&name];
                let Some(front) = s.queue.front() else {
                    break;
                };
                let suspect = self.suspects.contains(&front.id);
                let serial = match s.pick_worker(&self.views(s), suspect, now) {
                    Pick::Worker(serial) => serial,
                    Pick::Start => match self.start_worker(&name) {
                        Some(serial) => serial,
                        None => break,
                    },
                    Pick::Wait => break,
                    Pick::GiveBack => {
                        // Nothing can run them during the cooldown.
                        let back: Vec<Claim> = self
                            .stages
                            .get_mut(&name)
                            .expect("exists")
                            .queue
                            .drain(..)
                            .collect();
                        self.requeue(back);
                        break;
                    }
                };
                let claim = self
                    .stages
                    .get_mut(&name)
                    .expect("exists")
                    .queue
                    .pop_front()
                    .expect("the front was just seen");
                let max_messages = self.stages[&name].section.max_messages;
                let w = self.workers.get_mut(&serial).expect("picked");
                w.assign(claim);
                w.isolated = suspect;
                if w.assigned_total >= max_messages && w.phase == Phase::Ready {
                    // Recycled once its pipeline drains (MAX_MESSAGES).
                    w.phase = Phase::Retiring;
                }
            }
        }
        let unwritten: Vec<u64> = self
            .workers
            .values()
            .filter(|w| w.phase != Phase::Starting && w.queue.iter().any(|s| !s.written))
            .map(|w| w.serial)
            .collect();
        for serial in unwritten {
            self.write_to(serial);
        }
    }

    fn start_worker(&mut self, stage: &str) -> Option<u64> {
        let serial = self.next_serial;
        self.next_serial += 1;
        let tokens = self.next_tokens();
        // Chosen before the fork, so that it can be handed to the worker in its
        // environment (see `protocol::dispatched_session_name`).
        let session = protocol::dispatched_session_name(self.session_tag, serial, stage);
        let program = self.stages[stage].section.program.clone();
        // A stage that runs a command gets a keeper of the master's, which runs it as
        // the stage's USER (SPEC §4 "Containment"). Without the master (not started as
        // root) the worker starts a keeper of its own.
        let keeper = match &self.master {
            Some(master) if self.stages[stage].section.section.get("COMMAND").is_some() => {
                match master.keeper_for(stage) {
                    Ok(fd) => Some(fd),
                    Err(e) => {
                        // The master is gone, and with it every exec stage: a
                        // restart makes a new one.
                        self.stop = Some(Stop::Fail(Failure::new(
                            exit::EX_SOFTWARE,
                            format!("the keeper master (pid {}) is gone: {e}", master.pid()),
                        )));
                        return None;
                    }
                }
            }
            _ => None,
        };
        let launch = Launch {
            program: &program,
            config_file: self.opts.config_file.as_deref(),
            inherited_config: &self.config.path,
            env: &self.account_env,
            keeper,
        };
        match WorkerProc::spawn(
            serial,
            stage,
            &session,
            &launch,
            self.poll.registry(),
            tokens,
        ) {
            Ok(w) => {
                log::debug!(
                    "{stage}: started worker {serial} (pid {}, database sessions {session:?}): {program}",
                    w.pid
                );
                self.ledger.worker_started();
                self.tokens.insert(tokens.0, serial);
                self.tokens.insert(tokens.1, serial);
                self.workers.insert(serial, w);
                self.stages
                    .get_mut(stage)
                    .expect("exists")
                    .workers
                    .push(serial);
                Some(serial)
            }
            Err(e) => {
                let what = format!("cannot start PROGRAM {program}: {e}");
                self.start_failed(stage, &what, Vec::new(), Cooldown::Growing);
                None
            }
        }
    }

    /// Retires every worker: idle ones at once, busy ones when their pipeline drains.
    pub(super) fn retire_all(&mut self) {
        for w in self.workers.values_mut() {
            match w.phase {
                Phase::Closing => {}
                _ if w.queue.is_empty() => w.close_stdin(self.poll.registry()),
                Phase::Ready => w.phase = Phase::Retiring,
                // It gets the ids it holds, then no more.
                Phase::Starting => w.retire_on_ready = true,
                Phase::Retiring => {}
            }
        }
    }
}
