//! The claim floors (§6 "Floors and held snapshots"): per stage, the lowest id the next claim's pick needs to
//! read, so that a snapshot held open elsewhere — which keeps the pending indexes'
//! entries of every row claimed since — does not make each claim walk them all again.
//! Pure (no I/O); owned by the claim [`Ledger`](super::ledger::Ledger), which tells it
//! every claim that leaves the dispatcher's hands, and driven by the claim side
//! ([`super::claim_side`]) at each claim's start and answer.
//!
//! The invariant: no row below a stage's floor is pending at that stage, but rows that
//! came back there since the floor was set. They come back in three ways, each caught:
//! - a claim of this dispatcher ends: its worker's pass (an advance, split or pause)
//!   lowers the floors of the stages the pass's section routes to (`NEXT`, every
//!   `*_STAGE`, and on through theirs: a fused pass carries a row further) to the
//!   row's id at once, and the dispatcher's own writes (a requeue, a strike, a
//!   deferral, a reset) every floor, so the next claim reads from there (a row a
//!   worker advanced before its status line was read is held until then, and its
//!   status line wakes a claim). A stage's own finished rows leave its floor alone
//!   (unless it routes back to itself): its next claim does not step over the rows it
//!   claimed after them again. A program that writes a row to a stage its section does
//!   not name is caught by the claims without a floor;
//! - the dispatcher flips paused rows, resumes deferred ones or reconciles after a lock
//!   loss: every floor is forgotten;
//! - another session moves a row back (a resume, requeue or release, the failure
//!   bouncer, an injection whose id was drawn before a newer one committed): every
//!   stage's claim goes without a floor at least once per [`full_every`] (a second,
//!   or the poll interval when shorter) — while a snapshot older than [`HELD`] holds
//!   the horizon, such a claim reads every dead entry the snapshot keeps, so after one
//!   that took longer than [`WALK_BUDGET`] the next waits as long as a paused walk (20
//!   times that claim, at least a second): the reads from the first entry take at most
//!   about a twentieth of the claimer's time, and a row moved back waits that long.
//!
//! A claim raises a stage's floor to what its answer says (the lowest id it read and
//! left, or just past the highest it took), lowered again by whatever ended while it
//! was in flight.
//!
//! The sweep (schema 18): per stage, where the fair claim's read of the 513 rows it
//! takes its senders and their candidates from begins while the horizon is held —
//! just past the last row of those the previous claim took, wrapping round to the
//! floor. The floor stays where the oldest row left waits, so without the sweep every
//! claim over a backlog read again the entries of the rows it took above the floor.
//! The sweep is no bound on what a claim may leave unread (the floor is): nothing
//! lowers it but a reset, and a row that comes back below it is read by the head of
//! the stage, its oldest rows' slots, and the sweep's next round.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often at most a stage's claim reads from the start of its index, catching rows
/// another session moved back below the floor.
pub const FULL_PICK_EVERY: Duration = Duration::from_secs(1);

/// Per stage asked, where its next read starts (a floor or a sweep; `None`: none).
pub type Next = (String, Option<i64>);

/// No floor: the pick reads from the stage's first entry.
const NONE: i64 = i64::MIN;

/// While a snapshot older than this holds the horizon, a claim that let stages walk
/// their senders and took longer than [`WALK_BUDGET`] pauses their walks: the walk of a
/// fair claim over a deep backlog reads every dead entry a held snapshot keeps, and its
/// cost grows with the hold. Without a held snapshot a slow claim has other causes (a
/// busy machine), and the walks, which keep a flood from delaying a small sender, go on.
pub const HELD: Duration = Duration::from_secs(10);

/// See [`HELD`].
pub const WALK_BUDGET: Duration = Duration::from_millis(5);

/// A paused walk waits at least this long, and at least [`WALK_PAUSE_FACTOR`] times the
/// slow claim, so that walks take at most about a twentieth of the claimer's time.
const WALK_PAUSE_MIN: Duration = Duration::from_secs(1);
const WALK_PAUSE_FACTOR: u32 = 20;

/// Where a claim starts at each stage it asks of, in order: the floor (`None`: the
/// stage's first entry) and whether it may walk the stage's senders.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Starts {
    /// Each stage's floor.
    pub floors: Vec<Option<i64>>,
    /// Whether each stage may walk its senders ([`Floors::walks`]).
    pub walks: Vec<bool>,
    /// Each stage's sweep, while the horizon is held ([`Floors::sweeps`]).
    pub sweeps: Vec<Option<i64>>,
}

/// One stage's floor.
#[derive(Clone, Copy, Debug)]
struct Stage {
    /// The floor ([`NONE`]: none).
    key: i64,
    /// The sweep ([`NONE`]: none).
    sweep: i64,
    /// When the stage's claim last went without a floor.
    last_full: Option<Instant>,
    /// Until when the stage's claims do not walk its senders (a slow claim paused it).
    walk_after: Option<Instant>,
    /// Until when the stage's claims keep their floor (a slow claim without one
    /// postponed the next).
    full_after: Option<Instant>,
}

/// The floors of every stage asked so far.
#[derive(Debug)]
pub struct Floors {
    stages: HashMap<String, Stage>,
    /// Per stage, the stages a worker's pass there may leave a row pending at: those
    /// its section's references reach, in any number of steps (fused passes carry a
    /// row further). A stage missing here may send a row anywhere.
    routes: HashMap<String, Vec<String>>,
    /// The lowest id a claim that ended (or a reset: [`NONE`]) brought since the claim
    /// in flight was sent; `i64::MAX` when nothing did.
    lowered_in_flight: i64,
    /// The same for a worker's pass, per stage it routes to.
    lowered_stages: HashMap<String, i64>,
    /// At most this long between two claims of a stage without a floor.
    full_every: Duration,
    /// The stages the claim in flight lets walk their senders.
    walking: Vec<String>,
    /// The stages the claim in flight reads without their floor.
    unfloored: Vec<String>,
    /// Whether a snapshot older than [`HELD`] holds the horizon.
    held: bool,
}

/// How often a stage's claim goes without a floor: [`FULL_PICK_EVERY`], or the poll
/// interval when that is shorter, so that a row moved back below the floor by another
/// session is claimed within one poll interval.
pub fn full_every(poll_interval: Duration) -> Duration {
    FULL_PICK_EVERY.min(poll_interval)
}

impl Floors {
    /// No floors yet: every stage's first claim reads from its first entry.
    pub fn new(full_every: Duration) -> Floors {
        Floors {
            stages: HashMap::new(),
            routes: HashMap::new(),
            lowered_in_flight: i64::MAX,
            lowered_stages: HashMap::new(),
            full_every,
            walking: Vec::new(),
            unfloored: Vec::new(),
            held: false,
        }
    }

    /// The floors of a claim about to be sent for `stages`, in order (`None`: read from
    /// the first entry — no floor yet, or the stage's periodic claim without one).
    pub fn for_claim(&mut self, stages: &[&str], now: Instant) -> Vec<Option<i64>> {
        self.lowered_in_flight = i64::MAX;
        self.lowered_stages.clear();
        self.unfloored.clear();
        let every = self.full_every;
        stages
            .iter()
            .map(|stage| {
                let s = self.stages.entry((*stage).to_string()).or_insert(Stage {
                    key: NONE,
                    sweep: NONE,
                    last_full: None,
                    walk_after: None,
                    full_after: None,
                });
                let stale = s.last_full.is_none_or(|t| now.duration_since(t) >= every)
                    && s.full_after.is_none_or(|t| now >= t);
                if s.key == NONE || stale {
                    s.last_full = Some(now);
                    self.unfloored.push((*stage).to_string());
                    None
                } else {
                    Some(s.key)
                }
            })
            .collect()
    }

    /// Whether each of `stages` (asked by the claim about to be sent, after
    /// [`Self::for_claim`]) may walk its senders: yes, unless a slow claim paused its
    /// walks. A fair claim that may not reads the stage's senders from its oldest rows
    /// from the floor instead (schema 13), so a sender whose rows are all behind them
    /// waits for the next walk.
    pub fn walks(&mut self, stages: &[&str], now: Instant) -> Vec<bool> {
        self.walking.clear();
        stages
            .iter()
            .map(|stage| {
                let after = self.stages.get(*stage).and_then(|s| s.walk_after);
                let walk = after.is_none_or(|t| now >= t);
                if walk {
                    self.walking.push((*stage).to_string());
                }
                walk
            })
            .collect()
    }

    /// The sweeps of the claim about to be sent for `stages` (after [`Self::for_claim`]):
    /// while the horizon is held, each stage's where it is above the floor that claim
    /// reads from; otherwise none, and the fair claim reads its 513 rows from the floor
    /// as without a held snapshot.
    pub fn sweeps(&self, stages: &[&str]) -> Vec<Option<i64>> {
        stages
            .iter()
            .map(|stage| {
                let s = self.stages.get(*stage)?;
                let floored = !self.unfloored.iter().any(|u| u == stage);
                (self.held && floored && s.key != NONE && s.sweep > s.key).then_some(s.sweep)
            })
            .collect()
    }

    /// Whether a snapshot older than [`HELD`] holds the horizon (from the dispatcher's
    /// read of its holders); when none does any more, every paused walk resumes.
    pub fn horizon_held(&mut self, held: bool) {
        self.held = held;
        if !held {
            for s in self.stages.values_mut() {
                s.walk_after = None;
                s.full_after = None;
            }
        }
    }

    /// The claim in flight took `took`: while the horizon is held, past
    /// [`WALK_BUDGET`], the stages it let walk walk again only after the pause.
    pub fn took(&mut self, took: Duration, now: Instant) {
        let walking = std::mem::take(&mut self.walking);
        let unfloored = std::mem::take(&mut self.unfloored);
        if !self.held || took <= WALK_BUDGET {
            return;
        }
        let pause = WALK_PAUSE_MIN.max(took * WALK_PAUSE_FACTOR);
        for stage in walking {
            if let Some(s) = self.stages.get_mut(&stage) {
                s.walk_after = Some(now + pause);
            }
        }
        // A read from the first entry costs every dead entry the snapshot keeps: the
        // next one waits as long as a paused walk.
        for stage in unfloored {
            if let Some(s) = self.stages.get_mut(&stage) {
                s.full_after = Some(now + pause);
            }
        }
    }

    /// The claim in flight answered: per stage, its next floor (`None`: it read no row
    /// there, so the floor stays), lowered by whatever ended meanwhile, and for a fair
    /// claim its next sweep (`None`: the stage's rows fitted without a set read, so
    /// none; an oldest-first claim answers no sweeps).
    pub fn answered(&mut self, next: &[(String, Option<i64>)], sweeps: &[(String, Option<i64>)]) {
        for (stage, floor) in next {
            if let (Some(s), Some(floor)) = (self.stages.get_mut(stage), floor) {
                let passed = self.lowered_stages.get(stage).copied().unwrap_or(i64::MAX);
                s.key = (*floor).min(self.lowered_in_flight).min(passed);
            }
        }
        // A reset while the claim was in flight forgets its sweeps too.
        if self.lowered_in_flight != NONE {
            for (stage, sweep) in sweeps {
                if let Some(s) = self.stages.get_mut(stage) {
                    s.sweep = sweep.unwrap_or(NONE);
                }
            }
        }
        self.lowered_in_flight = i64::MAX;
        self.lowered_stages.clear();
    }

    /// A claim of row `id` ended: the row may be pending again at any stage, so no
    /// floor stays above it.
    pub fn released(&mut self, id: i64) {
        for s in self.stages.values_mut() {
            s.key = s.key.min(id);
        }
        self.lowered_in_flight = self.lowered_in_flight.min(id);
    }

    /// The stage graph's routes ([`Self::passed`]): `references` gives each stage's
    /// directly named stages (`NEXT`, every `*_STAGE`).
    pub fn set_routes<'a>(
        &mut self,
        references: impl IntoIterator<Item = (&'a str, Vec<&'a str>)>,
    ) {
        let direct: HashMap<&str, Vec<&str>> = references.into_iter().collect();
        self.routes = direct
            .keys()
            .map(|&from| {
                let mut seen: Vec<&str> = Vec::new();
                let mut next: Vec<&str> = direct[from].clone();
                while let Some(stage) = next.pop() {
                    if seen.contains(&stage) {
                        continue;
                    }
                    seen.push(stage);
                    if let Some(more) = direct.get(stage) {
                        next.extend(more);
                    }
                }
                (
                    from.to_string(),
                    seen.into_iter().map(str::to_string).collect(),
                )
            })
            .collect();
    }

    /// A worker's pass over row `id` at `stage` ended: the worker left it pending at
    /// one of the stages its section routes to (or deleted, paused or failed it), so
    /// only their floors go down to it. A worker that routes elsewhere (a program that
    /// writes any stage) is caught by the claims without a floor. The stage's own floor
    /// stays where its claims left it, unless the stage routes back to itself: a
    /// stage's finished rows do not make its next claim step over the rows it claimed
    /// after them again.
    pub fn passed(&mut self, id: i64, stage: &str) {
        let Some(routes) = self.routes.get(stage) else {
            self.released(id);
            return;
        };
        for to in routes {
            if let Some(s) = self.stages.get_mut(to) {
                s.key = s.key.min(id);
            }
            // A claim in flight may be reading that stage: its answer cannot raise the
            // floor past the row.
            let lowered = self.lowered_stages.entry(to.clone()).or_insert(i64::MAX);
            *lowered = (*lowered).min(id);
        }
    }

    /// Rows went back to pending wholesale (a flip, an early resume, a reconcile):
    /// every floor is forgotten, also by the answer of a claim in flight.
    pub fn reset(&mut self) {
        for s in self.stages.values_mut() {
            s.key = NONE;
            s.sweep = NONE;
        }
        self.lowered_in_flight = NONE;
    }
}

/// The next floors of an oldest-first claim's answer: per stage asked, just past the
/// highest id it took there (every pending row from the floor up to it was taken, but
/// for rows locked elsewhere), or `None` when it took none. `claimed` holds (stage, id)
/// of every row the claim took, looped ones included.
pub fn oldest_next(asked: &[&str], claimed: &[(String, i64)]) -> Vec<(String, Option<i64>)> {
    asked
        .iter()
        .map(|stage| {
            let top = claimed
                .iter()
                .filter(|(s, _)| s == stage)
                .map(|(_, id)| *id)
                .max();
            ((*stage).to_string(), top.map(|id| id.saturating_add(1)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(1);

    #[test]
    fn a_stage_claims_without_a_floor_first_then_from_its_answer() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        assert_eq!(f.for_claim(&["a", "b"], t), [None, None]);
        f.answered(&[("a".into(), Some(50)), ("b".into(), None)], &[]);
        let t1 = t + Duration::from_millis(10);
        assert_eq!(f.for_claim(&["a", "b"], t1), [Some(50), None]);
        f.answered(&[("a".into(), Some(60)), ("b".into(), Some(7))], &[]);
        let t2 = t + Duration::from_millis(20);
        assert_eq!(f.for_claim(&["a", "b"], t2), [Some(60), Some(7)]);
    }

    #[test]
    fn every_stage_claims_without_a_floor_once_per_period() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        f.for_claim(&["a"], t);
        f.answered(&[("a".into(), Some(50))], &[]);
        assert_eq!(f.for_claim(&["a"], t + EVERY / 2), [Some(50)]);
        f.answered(&[("a".into(), None)], &[]);
        assert_eq!(f.for_claim(&["a"], t + EVERY), [None], "the period is up");
        // A claim without a floor that read nothing leaves the floor where it was.
        f.answered(&[("a".into(), None)], &[]);
        assert_eq!(f.for_claim(&["a"], t + EVERY * 3 / 2), [Some(50)]);
    }

    #[test]
    fn a_claim_that_ends_lowers_every_floor_even_past_the_answer_in_flight() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        f.for_claim(&["a", "b"], t);
        f.answered(&[("a".into(), Some(100)), ("b".into(), Some(200))], &[]);
        f.released(150);
        assert_eq!(f.for_claim(&["a", "b"], t), [Some(100), Some(150)]);
        // While that claim is in flight, row 120 comes back: its answer cannot raise
        // a floor past it.
        f.released(120);
        f.answered(&[("a".into(), Some(300)), ("b".into(), Some(400))], &[]);
        assert_eq!(f.for_claim(&["a", "b"], t), [Some(120), Some(120)]);
        f.answered(&[("a".into(), Some(300)), ("b".into(), Some(400))], &[]);
        assert_eq!(f.for_claim(&["a", "b"], t), [Some(300), Some(400)]);
    }

    #[test]
    fn a_reset_forgets_every_floor_and_the_answer_in_flight() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        f.for_claim(&["a"], t);
        f.answered(&[("a".into(), Some(100))], &[]);
        f.for_claim(&["a"], t);
        f.reset();
        f.answered(&[("a".into(), Some(300))], &[]);
        assert_eq!(f.for_claim(&["a"], t), [None]);
    }

    #[test]
    fn a_slow_claim_pauses_the_walks_it_let_run_for_twenty_times_its_duration() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut f = Floors::new(EVERY);
        f.for_claim(&["a", "b"], t);
        assert_eq!(f.walks(&["a", "b"], t), [true, true]);
        f.took(ms(100), t);
        assert_eq!(
            f.walks(&["a", "b"], t),
            [true, true],
            "no snapshot held: a slow claim has another cause"
        );
        f.horizon_held(true);
        f.took(WALK_BUDGET, t);
        assert_eq!(f.walks(&["a"], t), [true], "within the budget: no pause");
        f.took(ms(100), t);
        assert_eq!(f.walks(&["a", "b"], t), [false, true], "only a walked");
        // A fast claim that let b walk pauses nothing.
        f.took(ms(1), t);
        let end = t + ms(100) * WALK_PAUSE_FACTOR;
        assert_eq!(f.walks(&["a", "b"], end - ms(1)), [false, true]);
        assert_eq!(f.walks(&["a", "b"], end), [true, true]);
        // A slow claim just past the budget pauses for the minimum.
        f.took(ms(6), end);
        assert_eq!(
            f.walks(&["a", "b"], end + WALK_PAUSE_MIN - ms(1)),
            [false, false]
        );
        assert_eq!(f.walks(&["a", "b"], end + WALK_PAUSE_MIN), [true, true]);
        // The hold ends: paused walks resume at once.
        f.took(ms(100), end);
        f.horizon_held(false);
        assert_eq!(f.walks(&["a", "b"], end), [true, true]);
    }

    #[test]
    fn a_slow_claim_without_a_floor_postpones_the_next_while_the_horizon_is_held() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut f = Floors::new(EVERY);
        assert_eq!(f.for_claim(&["a", "b"], t), [None, None]);
        f.answered(&[("a".into(), Some(50)), ("b".into(), Some(60))], &[]);
        f.took(ms(200), t);
        // No snapshot held: the period alone decides.
        assert_eq!(f.for_claim(&["a", "b"], t + EVERY), [None, None]);
        f.answered(&[("a".into(), Some(50)), ("b".into(), Some(60))], &[]);
        f.horizon_held(true);
        f.took(ms(200), t + EVERY);
        // Held, and the claim without floors took 200 ms: the next waits 20 times as
        // long, keeping the floors meanwhile.
        let after = t + EVERY + ms(200) * WALK_PAUSE_FACTOR;
        assert_eq!(
            f.for_claim(&["a", "b"], after - ms(1)),
            [Some(50), Some(60)]
        );
        f.took(ms(1), after - ms(1));
        assert_eq!(f.for_claim(&["a", "b"], after), [None, None]);
        // A fast one postpones nothing; the hold's end lifts a postponement.
        f.took(ms(1), after);
        assert_eq!(f.for_claim(&["a"], after + EVERY), [None]);
        f.took(ms(300), after + EVERY);
        f.horizon_held(false);
        assert_eq!(f.for_claim(&["a"], after + EVERY * 2), [None]);
    }

    #[test]
    fn a_pass_lowers_only_the_floors_of_the_stages_it_routes_to() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        // a → b → c, b also to d; e routes to itself.
        f.set_routes([
            ("a", vec!["b"]),
            ("b", vec!["c", "d"]),
            ("c", vec![]),
            ("d", vec![]),
            ("e", vec!["e"]),
        ]);
        f.for_claim(&["a", "b", "c", "d", "e"], t);
        let at = |n: i64| -> Vec<(String, Option<i64>)> {
            ["a", "b", "c", "d", "e"]
                .iter()
                .map(|s| (s.to_string(), Some(n)))
                .collect()
        };
        f.answered(&at(100), &[]);
        f.passed(40, "a");
        let floors = |f: &mut Floors| f.for_claim(&["a", "b", "c", "d", "e"], t);
        assert_eq!(
            floors(&mut f),
            [Some(100), Some(40), Some(40), Some(40), Some(100)],
            "a's own floor stays; b and what b reaches go down"
        );
        f.answered(&at(100), &[]);
        f.passed(30, "c");
        f.passed(20, "e");
        assert_eq!(
            floors(&mut f),
            [Some(100), Some(100), Some(100), Some(100), Some(20)],
            "the end of the pipeline lowers nothing; a stage routing to itself lowers its own"
        );
        // While a claim is in flight, a pass at a holds b's answer down, not a's.
        f.passed(50, "a");
        f.answered(&at(200), &[]);
        assert_eq!(
            floors(&mut f),
            [Some(200), Some(50), Some(50), Some(50), Some(200)]
        );
        // A stage the routes do not know may send a row anywhere.
        f.answered(&at(200), &[]);
        f.passed(10, "gone");
        assert_eq!(floors(&mut f), [Some(10); 5]);
    }

    #[test]
    fn a_sweep_is_passed_only_while_the_horizon_is_held_and_only_a_reset_lowers_it() {
        let t = Instant::now();
        let mut f = Floors::new(EVERY);
        let ab = ["a", "b"];
        f.for_claim(&ab, t);
        assert_eq!(
            f.sweeps(&ab),
            [None, None],
            "no floor yet: from the first entry"
        );
        f.answered(
            &[("a".into(), Some(10)), ("b".into(), Some(20))],
            &[("a".into(), Some(500)), ("b".into(), None)],
        );
        let t1 = t + Duration::from_millis(10);
        f.for_claim(&ab, t1);
        assert_eq!(f.sweeps(&ab), [None, None], "no snapshot held");
        f.answered(&[], &[]);
        f.horizon_held(true);
        f.for_claim(&ab, t1);
        assert_eq!(
            f.sweeps(&ab),
            [Some(500), None],
            "b's rows fitted: no sweep"
        );
        // Rows ending below it lower the floor, not the sweep.
        f.released(5);
        f.passed(7, "gone");
        f.answered(&[], &[("a".into(), Some(900))]);
        assert_eq!(f.for_claim(&ab, t1), [Some(5), Some(5)]);
        assert_eq!(f.sweeps(&ab), [Some(900), None]);
        // The periodic claim from the first entry reads without a sweep.
        f.answered(&[], &[]);
        assert_eq!(f.for_claim(&ab, t1 + EVERY), [None, None]);
        assert_eq!(f.sweeps(&ab), [None, None]);
        f.answered(&[("a".into(), Some(950))], &[]);
        f.for_claim(&ab, t1 + EVERY);
        assert_eq!(
            f.sweeps(&ab),
            [None, None],
            "a sweep at or below the floor is none"
        );
        // A reset forgets the sweeps, also those a claim in flight answers.
        f.answered(&[("a".into(), Some(10))], &[("a".into(), Some(900))]);
        f.for_claim(&ab, t1 + EVERY);
        assert_eq!(f.sweeps(&ab), [Some(900), None]);
        f.reset();
        f.answered(&[("a".into(), Some(10))], &[("a".into(), Some(1000))]);
        assert_eq!(f.for_claim(&ab, t1 + EVERY), [None, None]);
        f.answered(&[("a".into(), Some(10))], &[]);
        assert_eq!(f.for_claim(&ab, t1 + EVERY), [Some(10), None]);
        assert_eq!(f.sweeps(&ab), [None, None]);
    }

    #[test]
    fn the_period_is_the_poll_interval_when_shorter() {
        assert_eq!(full_every(Duration::from_secs(30)), FULL_PICK_EVERY);
        let short = Duration::from_millis(200);
        assert_eq!(full_every(short), short);
    }

    #[test]
    fn an_oldest_claim_moves_each_floor_past_what_it_took() {
        let claimed = [
            ("a".to_string(), 5),
            ("a".to_string(), 9),
            ("b".to_string(), 7),
        ];
        assert_eq!(
            oldest_next(&["a", "b", "c"], &claimed),
            [
                ("a".to_string(), Some(10)),
                ("b".to_string(), Some(8)),
                ("c".to_string(), None)
            ]
        );
    }
}
