//! A stage's pool (§8.1, §8.3): its section, the claimed ids waiting for a worker, its
//! workers, the start-failure cooldown and the overload throttle — and the pure
//! decisions over them: the free capacity a claim may ask for, which worker takes the
//! next id (packing work onto as few workers as possible), how long a cooldown lasts,
//! how far a throttle halves the cap, when a worker retires ([`retires`]) and which
//! stage a 75 throttles ([`throttle_rule`]).
//!
//! The table of pools and the worker processes belong to [`super::pools`], which calls
//! these decisions (and the worker handlers read [`THROTTLE_WINDOW`] for a log line).
//! Here a worker is seen only through its [`WorkerView`]; nothing here does I/O or
//! touches a process, so every decision is unit-tested without processes.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::worker_view::{Phase, WorkerView};
use crate::config::StageSection;

/// Start-failure cooldown: the first, doubling up to the cap.
const COOLDOWN_FIRST: Duration = Duration::from_secs(2);
const COOLDOWN_CAP: Duration = Duration::from_secs(60);
/// A 75 halves the biggest stage's cap for this long.
pub const THROTTLE_WINDOW: Duration = Duration::from_secs(300);
/// Overload halvings closer together than this are one episode (a batch of 75s).
const THROTTLE_GAP: Duration = Duration::from_secs(1);
/// An answer claims again once at least 1/REFILL_SHARE of its stage's slots are free
/// ([`StagePool::refill_due`]).
const REFILL_SHARE: usize = 4;
/// A death by an outside signal before `ready` cools the stage for at most this.
const COOLDOWN_BRIEF: Duration = Duration::from_secs(2);
/// After a 75 the stage claims nothing for this long, doubling up to the cap (§8.3).
const OVERLOAD_FIRST: Duration = Duration::from_millis(100);
const OVERLOAD_CAP: Duration = Duration::from_secs(5);

/// What kind of start failure cools a stage down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cooldown {
    /// The program failed at its own start: 2 s, doubling per episode up to a minute.
    Growing,
    /// Killed by an outside signal before `ready`: nobody's fault, at most 2 s.
    Brief,
    /// It could not reach the database (exit 74): growing, but over as soon as the
    /// dispatcher's own claims succeed again.
    Database,
}

/// Does the worker still take ids (starting or ready, not retiring)?
fn takes_ids(w: &WorkerView) -> bool {
    matches!(w.phase, Phase::Starting | Phase::Ready) && !w.retire_on_ready
}

/// Where the next claimed id of a stage goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// To this worker.
    Worker(u64),
    /// To a new worker: every existing one is full and the cap allows another.
    Start,
    /// Nowhere yet: wait for a free slot.
    Wait,
    /// Nowhere during the cooldown, and no worker is left to free a slot: the claimed
    /// ids must go back to pending.
    GiveBack,
}

/// One stage of the table.
pub struct StagePool {
    /// Its section.
    pub section: StageSection,
    /// Claimed ids not yet handed to a worker.
    pub queue: VecDeque<Claim>,
    /// Capacity asked in the claim in flight.
    pub reserved: usize,
    /// Its workers (including retiring ones), by serial.
    pub workers: Vec<u64>,
    /// No worker is started before this (after start failures).
    pub cooldown_until: Option<Instant>,
    cooldown_step: u32,
    /// The cooldown ends when the dispatcher's own claims succeed ([`Cooldown::Database`]).
    cooldown_database: bool,
    /// A lowered PARALLELISM cap after a 75, and until when.
    pub throttle: Option<(u32, Instant)>,
    /// After a 75 the stage claims nothing until then.
    pub overload_until: Option<Instant>,
    overload_step: Duration,
    /// The stage left the configuration; it goes when its workers are gone.
    pub removed: bool,
}

impl StagePool {
    /// A pool with nothing in it.
    pub fn new(section: StageSection) -> StagePool {
        StagePool {
            section,
            queue: VecDeque::new(),
            reserved: 0,
            workers: Vec::new(),
            cooldown_until: None,
            cooldown_step: 0,
            cooldown_database: false,
            throttle: None,
            overload_until: None,
            overload_step: Duration::ZERO,
            removed: false,
        }
    }

    /// The PARALLELISM cap now (lowered while throttled).
    pub fn cap(&self) -> u32 {
        match self.throttle {
            Some((cap, _)) => cap.min(self.section.parallelism),
            None => self.section.parallelism,
        }
    }

    /// Is the start-failure cooldown running?
    pub fn cooling(&self, now: Instant) -> bool {
        self.cooldown_until.is_some_and(|t| t > now)
    }

    /// The free capacity a claim may ask for: `QUEUE_LIMIT` for every worker slot the
    /// stage may use (its cap, or only its live workers during a cooldown; retiring ones
    /// never), less what its workers hold, what waits for a worker and what a claim in
    /// flight already asked.
    pub fn capacity(&self, workers: &[WorkerView], now: Instant) -> usize {
        if self.removed || self.overload_until.is_some_and(|t| t > now) {
            return 0;
        }
        let held: usize = workers
            .iter()
            .filter(|w| takes_ids(w))
            .map(|w| w.queued)
            .sum::<usize>()
            + self.queue.len()
            + self.reserved;
        self.slots(workers, now).saturating_sub(held)
    }

    /// `QUEUE_LIMIT` for every worker slot the stage may use now (see
    /// [`Self::capacity`]).
    fn slots(&self, workers: &[WorkerView], now: Instant) -> usize {
        let retiring = workers.iter().filter(|w| !takes_ids(w)).count() as u32;
        let usable = if self.cooling(now) {
            workers.len() as u32 - retiring
        } else {
            self.cap().saturating_sub(retiring)
        };
        usable as usize * self.section.queue_limit as usize
    }

    /// Does an answer of this stage call for a claim now (§6 "Refills")? Yes when it
    /// has free capacity and any of: a [`REFILL_SHARE`] of its slots is free; a worker
    /// that takes ids holds at most the one it works on (its pipeline ran dry) or none
    /// takes ids; the stage has a `NEXT`, so its answers put rows at another stage.
    /// Otherwise the claim waits for more answers and takes them in one go: a stage
    /// whose workers take one message at a time would claim a row or two per answer.
    pub fn refill_due(&self, workers: &[WorkerView], now: Instant) -> bool {
        let free = self.capacity(workers, now);
        if free == 0 {
            return false;
        }
        let mut takers = workers
            .iter()
            .filter(|w| takes_ids(w) && !w.isolated)
            .peekable();
        let dry = takers.peek().is_none() || takers.any(|w| w.queued <= 1);
        free * REFILL_SHARE >= self.slots(workers, now) || dry || self.section.next.is_some()
    }

    /// Where the next id goes: the fullest ready worker with a free slot (then the
    /// fullest starting one), so work packs onto few workers and the rest go idle; a
    /// suspect only to a worker holding nothing, which then takes nothing else.
    pub fn pick_worker(&self, workers: &[WorkerView], suspect: bool, now: Instant) -> Pick {
        let limit = if suspect {
            1
        } else {
            self.section.queue_limit as usize
        };
        let target = workers
            .iter()
            .filter(|w| {
                takes_ids(w)
                    && !w.isolated
                    && w.assigned_total < self.section.max_messages
                    && w.queued < limit
            })
            .max_by_key(|w| {
                (
                    w.phase == Phase::Ready,
                    w.queued,
                    std::cmp::Reverse(w.serial),
                )
            });
        // No worker is started while the stage cools down after start failures or
        // backs off after an overload: the ids wait for a running one, or go back.
        let holding = self.cooling(now) || self.overload_until.is_some_and(|t| t > now);
        match target {
            Some(w) => Pick::Worker(w.serial),
            None if holding => {
                if workers.is_empty() {
                    Pick::GiveBack
                } else {
                    Pick::Wait
                }
            }
            None if (workers.len() as u32) < self.cap() => Pick::Start,
            None => Pick::Wait,
        }
    }

    /// A start failure: enters the cooldown (growing: 2 s, doubling per episode up to a
    /// minute; workers started together fail together, so a failure during a running
    /// cooldown is the same episode; brief: 2 s at most, the episode count untouched).
    /// Returns how long remains.
    pub fn cool_down(&mut self, now: Instant, kind: Cooldown) -> Duration {
        if kind == Cooldown::Brief {
            let until = self
                .cooldown_until
                .filter(|&t| t > now)
                .map_or(now + COOLDOWN_BRIEF, |t| t.min(now + COOLDOWN_BRIEF));
            self.cooldown_until = Some(until);
        } else if !self.cooling(now) {
            self.cooldown_step += 1;
            let delay =
                (COOLDOWN_FIRST * (1u32 << (self.cooldown_step - 1).min(8))).min(COOLDOWN_CAP);
            self.cooldown_until = Some(now + delay);
        }
        self.cooldown_database = kind == Cooldown::Database;
        self.cooldown_until
            .map_or(Duration::ZERO, |t| t.saturating_duration_since(now))
    }

    /// The dispatcher's own claim succeeded: a cooldown for a worker that could not
    /// reach the database ends now. True when one did.
    pub fn database_is_back(&mut self) -> bool {
        if !std::mem::take(&mut self.cooldown_database) || self.cooldown_until.is_none() {
            return false;
        }
        self.cooldown_until = None;
        self.cooldown_step = 0;
        true
    }

    /// A worker of the stage answered: its start failures are over.
    pub fn started_fine(&mut self) {
        self.cooldown_step = 0;
    }

    /// A worker answered 75 (or exited 75 before answering): the stage claims nothing
    /// for a while, 100 ms doubling to 5 s, so a fast-failing worker cannot hammer an
    /// overloaded server. Returns the wait.
    pub fn back_off(&mut self, now: Instant) -> Duration {
        self.overload_step = if self.overload_step.is_zero() {
            OVERLOAD_FIRST
        } else {
            (self.overload_step * 2).min(OVERLOAD_CAP)
        };
        self.overload_until = Some(now + self.overload_step);
        self.overload_step
    }

    /// A worker answered something else than 74/75: the overload backoff starts over.
    pub fn answered_fine(&mut self) {
        self.overload_step = Duration::ZERO;
    }

    /// Halves the cap (floor 1) for [`THROTTLE_WINDOW`]; returns the new cap.
    pub fn throttle(&mut self, now: Instant) -> u32 {
        let cap = (self.cap() / 2).max(1);
        self.throttle = Some((cap, now + THROTTLE_WINDOW));
        cap
    }
}

/// The retire rule (§8.1, §9): a worker takes no more ids once it was handed
/// `max_messages` ids (it is recycled when its pipeline drains), or when it was asked to
/// retire while it started (a reload). Applied when the worker reports ready and each
/// time it is handed an id.
pub fn retires(w: &WorkerView, max_messages: u64) -> bool {
    w.retire_on_ready || w.assigned_total >= max_messages
}

/// What a 75 does to the PARALLELISM caps (§8.3), by [`throttle_rule`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Throttle {
    /// The 75 belongs to an overload episode already throttled: nothing more.
    SameEpisode,
    /// A new episode: halve this stage's cap (it runs the most workers).
    Halve(String),
    /// A new episode, and no stage runs a worker: nothing to halve.
    Nobody,
}

/// The throttle rule (§8.3) for a 75 at `now`, the last episode having started at
/// `last`: the 75s of one worker batch, closer together than `THROTTLE_GAP`, are one
/// episode and throttle once; a new episode halves the cap of the stage that runs the
/// most worker processes.
pub fn throttle_rule(
    stages: &BTreeMap<String, StagePool>,
    last: Option<Instant>,
    now: Instant,
) -> Throttle {
    if last.is_some_and(|t| t + THROTTLE_GAP > now) {
        return Throttle::SameEpisode;
    }
    match biggest(stages) {
        Some(name) => Throttle::Halve(name),
        None => Throttle::Nobody,
    }
}

/// The stage that runs the most worker processes (the biggest contributor to the
/// connection count, §8.3), if any runs one.
pub fn biggest(stages: &BTreeMap<String, StagePool>) -> Option<String> {
    stages
        .iter()
        .filter(|(_, s)| !s.workers.is_empty())
        .max_by_key(|(_, s)| s.workers.len())
        .map(|(name, _)| name.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(parallelism: u32, queue_limit: u32) -> StagePool {
        let text = format!(
            "[stage-s]\nPROGRAM = /bin/true\nPARALLELISM = {parallelism}\nQUEUE_LIMIT = {queue_limit}\nMAX_MESSAGES = 10\n"
        );
        let path = std::path::Path::new("/t.conf");
        let sections = crate::config::raw::parse(path, &text).expect("parses");
        let config = crate::config::Config::from_sections(path.into(), sections).expect("config");
        let graph = config.file_graph().expect("graph");
        StagePool::new(graph.get("s").expect("s").clone())
    }

    fn view(serial: u64, phase: Phase, queued: usize) -> WorkerView {
        WorkerView {
            serial,
            phase,
            retire_on_ready: false,
            isolated: false,
            assigned_total: queued as u64,
            queued,
        }
    }

    #[test]
    fn capacity_counts_every_usable_slot_less_what_is_held() {
        let now = Instant::now();
        let mut p = pool(4, 4);
        assert_eq!(p.capacity(&[], now), 16);
        let ws = [view(1, Phase::Ready, 3), view(2, Phase::Retiring, 4)];
        p.reserved = 2;
        // 3 usable slots (one retiring) × 4 − 3 held − 2 reserved.
        assert_eq!(p.capacity(&ws, now), 7);
        p.throttle(now);
        // Cap 2, one retiring: one usable worker.
        assert_eq!(p.capacity(&ws, now), 0);
        p.cool_down(now, Cooldown::Growing);
        assert_eq!(p.capacity(&[], now), 0, "no worker may start while cooling");
        p.removed = true;
        assert_eq!(p.capacity(&[], now + Duration::from_secs(999)), 0);
    }

    #[test]
    fn an_answer_claims_again_once_a_quarter_is_free_a_pipeline_ran_dry_or_rows_move_on() {
        let now = Instant::now();
        let p = pool(4, 4);
        let ready = |queued: &[usize]| -> Vec<WorkerView> {
            (1..)
                .zip(queued)
                .map(|(serial, &q)| view(serial, Phase::Ready, q))
                .collect()
        };
        // 16 slots: 3 free of 16 waits; 4 free claims.
        assert!(!p.refill_due(&ready(&[4, 3, 3, 3]), now));
        assert!(p.refill_due(&ready(&[3, 3, 3, 3]), now));
        // A worker down to the message it works on claims at once.
        assert!(p.refill_due(&ready(&[4, 4, 4, 1]), now));
        // Nothing free, nothing to claim; no worker yet, claim.
        assert!(!p.refill_due(&ready(&[4, 4, 4, 4]), now));
        assert!(p.refill_due(&[], now));
        // A worker that runs a suspect alone takes nothing else: it does not count.
        let mut lone = ready(&[4, 4, 4, 1]);
        lone[3].isolated = true;
        assert!(!p.refill_due(&lone, now));
        // A stage with a NEXT claims at every answer: its rows went on.
        let mut text = p.section.clone();
        text.next = Some("t".into());
        let chained = StagePool::new(text);
        assert!(chained.refill_due(&ready(&[4, 3, 3, 3]), now));
    }

    #[test]
    fn work_packs_onto_the_fullest_ready_worker() {
        let now = Instant::now();
        let p = pool(4, 4);
        let ws = [
            view(1, Phase::Ready, 1),
            view(2, Phase::Ready, 3),
            view(3, Phase::Starting, 3),
            view(4, Phase::Ready, 4),
        ];
        assert_eq!(p.pick_worker(&ws, false, now), Pick::Worker(2));
        let full = [view(1, Phase::Ready, 4), view(2, Phase::Ready, 4)];
        assert_eq!(p.pick_worker(&full, false, now), Pick::Start);
        let capped: Vec<WorkerView> = (1..=4).map(|s| view(s, Phase::Ready, 4)).collect();
        assert_eq!(p.pick_worker(&capped, false, now), Pick::Wait);
    }

    #[test]
    fn a_suspect_goes_only_to_an_empty_worker() {
        let now = Instant::now();
        let p = pool(1, 4);
        assert_eq!(
            p.pick_worker(&[view(1, Phase::Ready, 1)], true, now),
            Pick::Wait
        );
        assert_eq!(
            p.pick_worker(&[view(1, Phase::Ready, 0)], true, now),
            Pick::Worker(1)
        );
        let mut lone = view(1, Phase::Ready, 1);
        lone.isolated = true;
        assert_eq!(p.pick_worker(&[lone], false, now), Pick::Wait);
    }

    #[test]
    fn a_cooling_stage_without_workers_gives_its_ids_back() {
        let now = Instant::now();
        let mut p = pool(4, 4);
        assert_eq!(p.cool_down(now, Cooldown::Growing), Duration::from_secs(2));
        assert_eq!(p.pick_worker(&[], false, now), Pick::GiveBack);
        assert_eq!(
            p.pick_worker(&[view(1, Phase::Ready, 4)], false, now),
            Pick::Wait
        );
        // A failure within the episode does not extend it; the next episode doubles.
        assert_eq!(
            p.cool_down(now + Duration::from_secs(1), Cooldown::Growing),
            Duration::from_secs(1)
        );
        let later = now + Duration::from_secs(3);
        assert_eq!(
            p.cool_down(later, Cooldown::Growing),
            Duration::from_secs(4)
        );
        p.started_fine();
        assert_eq!(
            p.cool_down(later + Duration::from_secs(10), Cooldown::Growing),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn the_throttle_halves_down_to_one_and_the_biggest_stage_is_chosen() {
        let now = Instant::now();
        let mut p = pool(8, 4);
        assert_eq!(p.throttle(now), 4);
        assert_eq!(p.throttle(now), 2);
        assert_eq!(p.throttle(now), 1);
        assert_eq!(p.throttle(now), 1);
        let mut stages = BTreeMap::new();
        let mut a = pool(4, 4);
        a.workers = vec![1];
        let mut b = pool(4, 4);
        b.workers = vec![2, 3];
        stages.insert("a".to_string(), a);
        stages.insert("b".to_string(), b);
        assert_eq!(biggest(&stages), Some("b".to_string()));
    }

    #[test]
    fn a_burst_of_75s_throttles_once_and_only_a_stage_with_workers() {
        let now = Instant::now();
        let mut stages = BTreeMap::new();
        assert_eq!(throttle_rule(&stages, None, now), Throttle::Nobody);
        let mut a = pool(4, 4);
        a.workers = vec![1];
        stages.insert("a".to_string(), a);
        assert_eq!(
            throttle_rule(&stages, None, now),
            Throttle::Halve("a".into())
        );
        let soon = now + Duration::from_millis(500);
        assert_eq!(
            throttle_rule(&stages, Some(now), soon),
            Throttle::SameEpisode
        );
        let later = now + THROTTLE_GAP;
        assert_eq!(
            throttle_rule(&stages, Some(now), later),
            Throttle::Halve("a".into())
        );
    }

    #[test]
    fn a_worker_retires_at_max_messages_or_when_asked_while_starting() {
        let mut w = view(1, Phase::Ready, 0);
        assert!(!retires(&w, 10));
        w.assigned_total = 10;
        assert!(retires(&w, 10));
        let mut s = view(2, Phase::Starting, 0);
        s.retire_on_ready = true;
        assert!(retires(&s, 10));
    }

    #[test]
    fn an_outside_kill_cools_briefly_and_a_database_cooldown_ends_with_a_good_claim() {
        let now = Instant::now();
        let mut p = pool(4, 4);
        for n in 0..5 {
            let t = now + Duration::from_secs(100 * n);
            assert_eq!(
                p.cool_down(t, Cooldown::Growing),
                Duration::from_secs(2 << n)
            );
        }
        // A long cooldown running: an outside kill does not extend it past 2 s.
        let t = now + Duration::from_secs(401);
        assert_eq!(p.cool_down(t, Cooldown::Brief), Duration::from_secs(2));
        assert!(!p.database_is_back(), "not a database cooldown");
        let t = now + Duration::from_secs(1000);
        assert!(p.cool_down(t, Cooldown::Database) >= Duration::from_secs(2));
        assert!(p.cooling(t));
        assert!(p.database_is_back());
        assert!(!p.cooling(t));
        assert_eq!(p.cool_down(t, Cooldown::Growing), Duration::from_secs(2));
    }

    #[test]
    fn the_overload_backoff_doubles_to_five_seconds_and_starts_over_after_an_answer() {
        let now = Instant::now();
        let mut p = pool(4, 4);
        let steps: Vec<u128> = (0..8).map(|_| p.back_off(now).as_millis()).collect();
        assert_eq!(steps, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(p.capacity(&[], now), 0, "no claim while backing off");
        assert_eq!(p.capacity(&[], now + Duration::from_secs(6)), 16);
        assert_eq!(p.pick_worker(&[], false, now), Pick::GiveBack, "no start");
        p.answered_fine();
        assert_eq!(p.back_off(now), Duration::from_millis(100));
    }
}
