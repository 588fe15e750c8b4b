//! The table of stage pools and worker processes (§8.1–§8.3, §9): every
//! [`StagePool`] by name, every [`WorkerProc`] by serial with the pipe tokens that lead
//! to it, the serial and token counters (never reused, so a late event of a dead worker
//! is ignored), the suspects of batch deaths and the start of the last overload episode.
//!
//! One owner with verbs, a field of the loop's `Dispatcher`: the worker handlers
//! ([`super::workers`]), the claim handlers ([`super::claims`]), the reload
//! ([`super::reload`]), shutdown and the loop's timers change it only through them.
//! The decisions it applies are the pure functions of [`super::pool`]; processes are
//! started elsewhere and inserted here, and written, read, killed and reaped through
//! [`super::process`]. It never talks to another thread and never touches the claim
//! ledger: a verb that frees claims returns them for the caller to settle.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use mio::{Registry, Token};

use super::claim::Claim;
use super::pool::{self, Cooldown, Pick, StagePool, Throttle};
use super::process::{ReadOutcome, Slot, WorkerProc};
use super::timers::{StageClock, WorkerClock};
use super::worker_view::{Phase, WorkerView};
use crate::config::{StageGraph, StageSection};

/// Child pipe tokens start here and are never reused (below are the loop's own).
const FIRST_CHILD_TOKEN: usize = 16;
/// How long a worker may take to exit after its stdout closed before it is killed.
const REAP_GRACE: Duration = Duration::from_millis(200);
/// Suspects remembered at most (they are only a hint).
const MAX_SUSPECTS: usize = 10_000;

/// A stage whose PARALLELISM cap a 75 halved (§8.3), for the log.
pub struct Throttled {
    /// The stage.
    pub stage: String,
    /// Its cap now.
    pub cap: u32,
    /// The worker processes it runs.
    pub workers: usize,
}

/// Every stage's pool and every worker process.
pub struct Pools {
    stages: BTreeMap<String, StagePool>,
    workers: HashMap<u64, WorkerProc>,
    tokens: HashMap<Token, u64>,
    next_token: usize,
    next_serial: u64,
    /// Ids read by a worker that died with several ids read: each runs alone next time,
    /// so the culprit ends up alone at the front of its worker's queue.
    suspects: HashSet<i64>,
    /// When the last overload episode started (its 75s throttle once).
    last_throttle: Option<Instant>,
}

impl Pools {
    /// A pool per stage of `graph`, no worker.
    pub fn new(graph: &StageGraph) -> Pools {
        Pools {
            stages: graph
                .stages()
                .map(|s| (s.name.clone(), StagePool::new(s.clone())))
                .collect(),
            workers: HashMap::new(),
            tokens: HashMap::new(),
            next_token: FIRST_CHILD_TOKEN,
            next_serial: 1,
            suspects: HashSet::new(),
            last_throttle: None,
        }
    }

    // ---- what is there -------------------------------------------------------------

    /// The worker a pipe token leads to.
    pub fn serial_of(&self, token: Token) -> Option<u64> {
        self.tokens.get(&token).copied()
    }

    /// A worker, to read its facts.
    pub fn worker(&self, serial: u64) -> Option<&WorkerProc> {
        self.workers.get(&serial)
    }

    /// Is the worker still there?
    pub fn has_worker(&self, serial: u64) -> bool {
        self.workers.contains_key(&serial)
    }

    /// How many worker processes run.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Every worker's serial.
    pub fn serials(&self) -> Vec<u64> {
        self.workers.keys().copied().collect()
    }

    /// Every stage's name, in order.
    pub fn stage_names(&self) -> Vec<String> {
        self.stages.keys().cloned().collect()
    }

    /// A stage's section.
    pub fn section(&self, stage: &str) -> Option<&StageSection> {
        self.stages.get(stage).map(|s| &s.section)
    }

    /// Does any worker or stage hold claims?
    pub fn busy(&self) -> bool {
        self.workers.values().any(|w| !w.queue.is_empty())
            || self.stages.values().any(|s| !s.queue.is_empty())
    }

    /// The ids of every claim held, by a worker or waiting for one.
    pub fn held_ids(&self) -> Vec<i64> {
        self.workers
            .values()
            .flat_map(|w| w.queue.iter().map(|s| s.claim.id))
            .chain(
                self.stages
                    .values()
                    .flat_map(|s| s.queue.iter().map(|c| c.id)),
            )
            .collect()
    }

    /// Every worker's clocks, for the loop's deadlines.
    pub fn worker_clocks(&self) -> Vec<WorkerClock> {
        self.workers
            .values()
            .map(|w| WorkerClock {
                serial: w.serial,
                starting: w.phase == Phase::Starting,
                started: w.started,
                front_since: w.queue.front().and_then(|s| s.head_since),
                idle_since: (w.phase == Phase::Ready && w.queue.is_empty()).then_some(w.idle_since),
                closing_since: w.closing_since,
            })
            .collect()
    }

    /// The clocks of every stage with a cooldown, throttle or backoff.
    pub fn stage_clocks(&self) -> Vec<StageClock> {
        self.stages
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
            .collect()
    }

    /// What the pool decisions see of a stage's workers.
    fn views(&self, stage: &StagePool) -> Vec<WorkerView> {
        stage
            .workers
            .iter()
            .filter_map(|serial| self.workers.get(serial))
            .map(|w| w.view())
            .collect()
    }

    // ---- a worker's pipes ----------------------------------------------------------

    /// Writes what the worker's stdin takes; `None` when it is gone.
    pub fn flush(&mut self, serial: u64) -> Option<io::Result<()>> {
        Some(self.workers.get_mut(&serial)?.flush())
    }

    /// Reads what the worker wrote, until the pipe would block; `None` when it is gone.
    pub fn read(&mut self, serial: u64) -> Option<ReadOutcome> {
        Some(self.workers.get_mut(&serial)?.read())
    }

    /// The claims that reached the head of the worker's queue since the last call.
    pub fn take_started(&mut self, serial: u64) -> Vec<Claim> {
        self.workers
            .get_mut(&serial)
            .map(|w| w.take_started())
            .unwrap_or_default()
    }

    /// The workers past their start with ids not yet written.
    pub fn unwritten(&self) -> Vec<u64> {
        self.workers
            .values()
            .filter(|w| w.phase != Phase::Starting && w.queue.iter().any(|s| !s.written))
            .map(|w| w.serial)
            .collect()
    }

    // ---- a worker's life -----------------------------------------------------------

    /// A serial and two pipe tokens for a new worker, never used before.
    pub fn new_ids(&mut self) -> (u64, (Token, Token)) {
        let serial = self.next_serial;
        self.next_serial += 1;
        let tokens = (Token(self.next_token), Token(self.next_token + 1));
        self.next_token += 2;
        (serial, tokens)
    }

    /// Takes in a worker just started for its stage.
    pub fn insert(&mut self, w: WorkerProc) {
        self.tokens.insert(w.out_token, w.serial);
        self.tokens.insert(w.in_token, w.serial);
        if let Some(s) = self.stages.get_mut(&w.stage) {
            s.workers.push(w.serial);
        }
        self.workers.insert(w.serial, w);
    }

    /// Has the worker not said `ready` yet?
    pub fn is_starting(&self, serial: u64) -> bool {
        self.workers
            .get(&serial)
            .is_some_and(|w| w.phase == Phase::Starting)
    }

    /// The worker said `ready`: it takes ids, or retires at once by the retire rule
    /// (its input closed when it holds nothing).
    pub fn ready(&mut self, serial: u64, registry: &Registry) {
        let Some(w) = self.workers.get_mut(&serial) else {
            return;
        };
        let max_messages = self
            .stages
            .get(&w.stage)
            .map_or(u64::MAX, |s| s.section.max_messages);
        w.phase = if pool::retires(&w.view(), max_messages) {
            Phase::Retiring
        } else {
            Phase::Ready
        };
        log::debug!("{}: worker {serial} (pid {}) is ready", w.stage, w.pid);
        if w.phase == Phase::Retiring && w.queue.is_empty() {
            w.close_stdin(registry);
        }
    }

    /// The worker answered its front id: takes it off (`None`: it held none). A
    /// retiring worker that drained gets its input closed; a stage whose worker answers
    /// for the first time has its start failures behind it.
    pub fn answered(&mut self, serial: u64, registry: &Registry) -> Option<Slot> {
        let w = self.workers.get_mut(&serial)?;
        let slot = w.pop_front()?;
        let first_answer = w.answered == 1;
        if w.phase == Phase::Retiring && w.queue.is_empty() {
            w.close_stdin(registry);
        }
        if first_answer {
            // It started and works: the stage's start failures are over.
            if let Some(s) = self.stages.get_mut(&slot.claim.stage) {
                s.started_fine();
            }
        }
        Some(slot)
    }

    /// A doubtful REPORT of the worker: its pid the first time (to warn once per
    /// worker), `None` after.
    pub fn first_report_warning(&mut self, serial: u64) -> Option<u32> {
        let w = self.workers.get_mut(&serial)?;
        (!std::mem::replace(&mut w.report_warned, true)).then_some(w.pid)
    }

    /// Stops a worker idle for WORKER_IDLE_TIMEOUT: its input is closed.
    pub fn stop_idle(&mut self, serial: u64, registry: &Registry) {
        if let Some(w) = self.workers.get_mut(&serial) {
            log::debug!("{}: stopping idle worker {serial} (pid {})", w.stage, w.pid);
            w.close_stdin(registry);
        }
    }

    /// Retires every worker: idle ones at once, busy ones when their pipeline drains.
    pub fn retire_all(&mut self, registry: &Registry) {
        for w in self.workers.values_mut() {
            match w.phase {
                Phase::Closing => {}
                _ if w.queue.is_empty() => w.close_stdin(registry),
                Phase::Ready => w.phase = Phase::Retiring,
                // It gets the ids it holds, then no more.
                Phase::Starting => w.retire_on_ready = true,
                Phase::Retiring => {}
            }
        }
    }

    /// Takes a worker out of the table; kills it (its whole session) when asked, and
    /// reaps it. Returns the process (with the slots it held) and its exit status. A
    /// stage removed by a reload goes with its last worker.
    pub fn remove(
        &mut self,
        serial: u64,
        kill: bool,
        registry: &Registry,
    ) -> Option<(WorkerProc, Option<ExitStatus>)> {
        let mut w = self.workers.remove(&serial)?;
        self.tokens.remove(&w.out_token);
        self.tokens.remove(&w.in_token);
        if kill {
            if let Err(e) = w.kill() {
                // The launcher is gone (the loop shuts down on it): the worker dies with
                // this process; it is not waited for.
                log::error!(
                    "{}: cannot kill worker {serial} (pid {}): {e}",
                    w.stage,
                    w.pid
                );
                w.abandon();
            }
        }
        let exit = w.reap(registry, REAP_GRACE);
        if let Some(s) = self.stages.get_mut(&w.stage) {
            s.workers.retain(|&x| x != serial);
            if s.removed && s.workers.is_empty() && s.queue.is_empty() {
                self.stages.remove(&w.stage);
            }
        }
        Some((w, exit))
    }

    /// Kills and reaps every worker. Returns their database session names and the
    /// claims they held.
    pub fn kill_all(&mut self, registry: &Registry) -> (Vec<String>, Vec<Claim>) {
        let mut sessions = Vec::new();
        let mut held = Vec::new();
        for serial in self.serials() {
            if let Some((mut w, _)) = self.remove(serial, true, registry) {
                sessions.push(std::mem::take(&mut w.session));
                held.extend(w.queue.drain(..).map(|s| s.claim));
            }
        }
        (sessions, held)
    }

    // ---- claims --------------------------------------------------------------------

    /// Every stage's free capacity a claim may ask for, stages with none left out.
    pub fn free_capacities(&self, now: Instant) -> Vec<(String, i32)> {
        let mut asked = Vec::new();
        for (name, s) in &self.stages {
            let capacity = s.capacity(&self.views(s), now);
            if capacity > 0 {
                asked.push((name.clone(), i32::try_from(capacity).unwrap_or(i32::MAX)));
            }
        }
        asked
    }

    /// Does an answer of this stage call for a claim now ([`StagePool::refill_due`])?
    /// A stage that is not in the table does not.
    pub fn refill_due(&self, stage: &str, now: Instant) -> bool {
        self.stages
            .get(stage)
            .is_some_and(|s| s.refill_due(&self.views(s), now))
    }

    /// A claim asking this capacity per stage was sent.
    pub fn reserve(&mut self, asked: &[(String, i32)]) {
        for (name, cap) in asked {
            self.stages.get_mut(name).expect("asked for it").reserved = *cap as usize;
        }
    }

    /// The claim that asked capacity of these stages was answered (or failed).
    pub fn release(&mut self, stages: &[String]) {
        for stage in stages {
            if let Some(s) = self.stages.get_mut(stage) {
                s.reserved = 0;
            }
        }
    }

    /// Claimed rows join their stages' queues. Returns those of stages that went away
    /// meanwhile, to go straight back.
    pub fn enqueue(&mut self, claims: Vec<Claim>) -> Vec<Claim> {
        let mut stray = Vec::new();
        for claim in claims {
            match self.stages.get_mut(&claim.stage) {
                Some(s) if !s.removed => s.queue.push_back(claim),
                _ => stray.push(claim),
            }
        }
        stray
    }

    /// Where the stage's next waiting claim goes (`None`: none waits).
    pub fn next_pick(&self, stage: &str, now: Instant) -> Option<Pick> {
        let s = self.stages.get(stage)?;
        let front = s.queue.front()?;
        let suspect = self.suspects.contains(&front.id);
        Some(s.pick_worker(&self.views(s), suspect, now))
    }

    /// Hands the stage's next waiting claim to the worker picked for it; a suspect runs
    /// alone. A worker that reaches MAX_MESSAGES retires by the retire rule.
    pub fn hand_front(&mut self, stage: &str, serial: u64) {
        let s = self.stages.get_mut(stage).expect("picked for it");
        let claim = s.queue.pop_front().expect("the front was just seen");
        let max_messages = s.section.max_messages;
        let suspect = self.suspects.contains(&claim.id);
        let w = self.workers.get_mut(&serial).expect("picked");
        w.assign(claim);
        w.isolated = suspect;
        if w.phase == Phase::Ready && pool::retires(&w.view(), max_messages) {
            // Recycled once its pipeline drains (MAX_MESSAGES).
            w.phase = Phase::Retiring;
        }
    }

    /// Takes every claim waiting at the stage (to go back to pending).
    pub fn take_waiting(&mut self, stage: &str) -> Vec<Claim> {
        self.stages
            .get_mut(stage)
            .map(|s| s.queue.drain(..).collect())
            .unwrap_or_default()
    }

    /// The claim's row is no suspect (any more).
    pub fn clear_suspect(&mut self, id: i64) {
        self.suspects.remove(&id);
    }

    /// These claims' rows become suspects: each runs alone next time.
    pub fn add_suspects(&mut self, claims: &[Claim]) {
        if self.suspects.len() + claims.len() > MAX_SUSPECTS {
            self.suspects.clear();
        }
        self.suspects.extend(claims.iter().map(|c| c.id));
    }

    // ---- a stage's health ----------------------------------------------------------

    /// The dispatcher's own claim succeeded: every cooldown for a worker that could not
    /// reach the database ends. True when one did.
    pub fn database_is_back(&mut self) -> bool {
        let mut any = false;
        for (name, s) in self.stages.iter_mut() {
            if s.database_is_back() {
                log::info!(
                    "{name}: the database answers the dispatcher again; the start-failure cooldown ends"
                );
                any = true;
            }
        }
        any
    }

    /// A start failure of the stage: it cools down. Returns how long, with the claims
    /// that waited for a worker (they would wait out the cooldown as running); `None`
    /// when the stage is gone.
    pub fn cool_down(
        &mut self,
        stage: &str,
        kind: Cooldown,
        now: Instant,
    ) -> Option<(Duration, Vec<Claim>)> {
        let s = self.stages.get_mut(stage)?;
        let delay = s.cool_down(now, kind);
        Some((delay, s.queue.drain(..).collect()))
    }

    /// A worker of the stage answered (or exited) 75: the stage backs off before
    /// claiming again. Returns the wait; `None` when the stage is gone.
    pub fn back_off(&mut self, stage: &str, now: Instant) -> Option<Duration> {
        Some(self.stages.get_mut(stage)?.back_off(now))
    }

    /// A worker of the stage answered something other than 74/75.
    pub fn answered_fine(&mut self, stage: &str) {
        if let Some(s) = self.stages.get_mut(stage) {
            s.answered_fine();
        }
    }

    /// A 75 at `now`: halves the cap of the stage running the most workers, once per
    /// overload episode, by the throttle rule.
    pub fn throttle_biggest(&mut self, now: Instant) -> Option<Throttled> {
        match pool::throttle_rule(&self.stages, self.last_throttle, now) {
            Throttle::SameEpisode => None,
            Throttle::Nobody => {
                self.last_throttle = Some(now);
                None
            }
            Throttle::Halve(stage) => {
                self.last_throttle = Some(now);
                let s = self.stages.get_mut(&stage).expect("biggest exists");
                let cap = s.throttle(now);
                let workers = s.workers.len();
                Some(Throttled {
                    stage,
                    cap,
                    workers,
                })
            }
        }
    }

    /// The stage's start-failure cooldown ended.
    pub fn end_cooldown(&mut self, stage: &str) {
        if let Some(s) = self.stages.get_mut(stage) {
            s.cooldown_until = None;
        }
    }

    /// The stage's overload throttle window passed.
    pub fn end_throttle(&mut self, stage: &str) {
        if let Some(s) = self.stages.get_mut(stage) {
            log::info!(
                "{stage}: the overload throttle window passed; PARALLELISM back to {}",
                s.section.parallelism
            );
            s.throttle = None;
        }
    }

    /// The stage's backoff after a 75 ended.
    pub fn end_overload(&mut self, stage: &str) {
        if let Some(s) = self.stages.get_mut(stage) {
            s.overload_until = None;
        }
    }

    // ---- reload (§9) ---------------------------------------------------------------

    /// Takes a new stage graph: stages keep their pools with their new section, new
    /// ones get one, removed ones are marked (they go with their last worker). Returns
    /// the claims waiting at removed stages, to go back.
    pub fn adopt(&mut self, graph: &StageGraph) -> Vec<Claim> {
        let mut back = Vec::new();
        for (name, s) in self.stages.iter_mut() {
            match graph.get(name) {
                Some(section) => {
                    s.section = section.clone();
                    s.removed = false;
                }
                None => {
                    s.removed = true;
                    back.extend(s.queue.drain(..));
                }
            }
        }
        for section in graph.stages() {
            self.stages
                .entry(section.name.clone())
                .or_insert_with(|| StagePool::new(section.clone()));
        }
        back
    }

    /// Drops the removed stages that have no worker left.
    pub fn drop_removed(&mut self) {
        self.stages
            .retain(|_, s| !(s.removed && s.workers.is_empty()));
    }
}
