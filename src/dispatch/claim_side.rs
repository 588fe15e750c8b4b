//! The claim side of the loop's state (§6, §8.4): the claim gate (at most one claim in
//! flight, none without the lock, a burst of wake-ups collapses into one claim) with the
//! stages the claim in flight asked for, the paused-row clock, the rows deferred for 74,
//! the claim [`Ledger`] (with the claim floors) and the catch-up claim a second after a
//! notification, which goes without floors.
//!
//! One owner with verbs, a field of the loop's `Dispatcher`: the claim handlers
//! ([`super::claims`]), the worker handlers ([`super::workers`]), shutdown and the
//! loop's event and timer dispatch record what happened through these verbs, and
//! nothing else changes its fields. It does no I/O and sends nothing: a verb that calls
//! for a statement returns what the caller sends to the coordinator. It knows nothing
//! of stages' pools or worker processes.

use std::time::{Duration, Instant};

use super::claim::Claim;
use super::floors::{self, Next, Starts};
use super::ledger::Ledger;
use super::scheduler::{ClaimRequest, Window};
use crate::config::DispatchOptions;

/// How soon a claim that failed is tried again.
const CLAIM_RETRY: Duration = Duration::from_secs(1);
/// A failed paused-row flip is tried again after this.
const FLIP_RETRY: Duration = Duration::from_secs(1);
/// A row deferred for 74 is resumed early no sooner than this after its deferral, so a
/// worker that keeps losing its connection while the dispatcher keeps its own retries
/// a message once a second, not in a hot loop.
pub const DEFER_GRACE: Duration = Duration::from_secs(1);

/// Whether and when to claim.
struct ClaimGate {
    /// The coordinator holds the dispatcher lock: claims may be sent.
    lock_held: bool,
    /// A claim was sent and not yet answered.
    in_flight: bool,
    /// A wake-up asked for a claim.
    want: bool,
    /// When the last claim was sent (the heartbeat counts from here).
    last: Instant,
    /// When a claim that failed is tried again.
    retry_at: Option<Instant>,
}

impl ClaimGate {
    /// A gate that claims at the first turn.
    fn new(now: Instant) -> ClaimGate {
        ClaimGate {
            lock_held: true,
            in_flight: false,
            want: true,
            last: now,
            retry_at: None,
        }
    }

    /// May a claim be sent now?
    fn open(&self) -> bool {
        self.lock_held && !self.in_flight
    }
}

/// When the earliest paused row is due, and whether a flip is running.
#[derive(Default)]
struct PausedClock {
    /// When the earliest paused row is due.
    next: Option<Instant>,
    /// A flip was sent and not yet answered.
    flip_in_flight: bool,
}

impl PausedClock {
    /// Takes in a due time the database reported, in seconds from now (negative when
    /// overdue); keeps the earlier of it and the one known. A value that is not a
    /// number is ignored; one beyond a year is capped (the heartbeat looks again).
    fn learn(&mut self, due_in: Option<f64>, now: Instant) {
        let Some(secs) = due_in.filter(|s| !s.is_nan()) else {
            return;
        };
        let Ok(delay) = Duration::try_from_secs_f64(secs.clamp(0.0, 366.0 * 86_400.0)) else {
            return;
        };
        let at = now + delay;
        self.next = Some(self.next.map_or(at, |t| t.min(at)));
    }

    /// The deadline, when a flip may be sent (none in flight, the lock held).
    fn deadline(&self, lock_held: bool) -> Option<Instant> {
        self.next.filter(|_| lock_held && !self.flip_in_flight)
    }
}

/// The claim side's state and its verbs.
pub struct ClaimSide {
    gate: ClaimGate,
    /// The stages the claim in flight asked capacity of: their reservations end with
    /// its answer. Kept here, not sent to the coordinator and back.
    asked: Vec<String>,
    paused: PausedClock,
    /// Claims deferred for 74 (their worker lost the database), oldest first, with
    /// when: resumed early once the dispatcher's own session works (§8.4 "Early
    /// resume").
    deferred: Vec<(Claim, Instant)>,
    ledger: Ledger,
    /// After a notification on `workqueue` (another session's write, which may have put
    /// a row back below a floor): when a claim goes without floors for every stage
    /// whose floors were last set aside before it (`floors.rs`).
    catch_up_at: Option<Instant>,
    /// When a tenant a rate holds back may take a row again (§7 "Rates"): a claim then.
    release_at: Option<Instant>,
    /// How often each stage's claim goes without its floor.
    full_every: Duration,
}

impl ClaimSide {
    /// A claim side that claims at the first turn, its ledger feeding the policy the
    /// configuration asks for.
    pub fn new(opts: &DispatchOptions, now: Instant) -> ClaimSide {
        ClaimSide {
            gate: ClaimGate::new(now),
            asked: Vec::new(),
            paused: PausedClock::default(),
            deferred: Vec::new(),
            ledger: Ledger::for_options(opts),
            catch_up_at: None,
            release_at: None,
            full_every: floors::full_every(opts.poll_interval),
        }
    }

    /// The stage graph's routes, for the floors a worker's pass lowers
    /// ([`floors::Floors::passed`]).
    pub fn routes(&mut self, graph: &crate::config::StageGraph) {
        self.ledger.floors().set_routes(graph.stages().map(|s| {
            (
                s.name.as_str(),
                s.references().map(|(_, to)| to).collect::<Vec<&str>>(),
            )
        }));
        let rates: Vec<(String, f64)> = graph
            .stages()
            .filter_map(|s| Some((s.name.clone(), s.rate?)))
            .collect();
        let named: Vec<String> = rates.iter().map(|(s, _)| s.clone()).collect();
        if !self.ledger.policy().rates(rates) && !named.is_empty() {
            log::warn!(
                "RATE of {} is held by the fair claim; with FAIR_SCHEDULING = no it is ignored",
                named.join(", ")
            );
        }
    }

    /// The claim ledger, for the transitions of claimed rows.
    pub fn ledger(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    // ---- the gate ------------------------------------------------------------------

    /// A wake-up asks for a claim (collapsed with every other until one is sent).
    pub fn want(&mut self) {
        self.gate.want = true;
    }

    /// Another session wrote the queue and notified `workqueue`: claim now, and once
    /// more when every stage's floor has been set aside since, so a row it moved back
    /// below a floor (a resume, a requeue) is claimed within [`floors::FULL_PICK_EVERY`]
    /// even when nothing else wakes a claim.
    pub fn notified(&mut self, now: Instant) {
        self.gate.want = true;
        if self.catch_up_at.is_none() {
            self.catch_up_at = Some(now + self.full_every);
        }
    }

    /// A claim that failed (or the catch-up after a notification) is due again.
    pub fn retry_due(&mut self) {
        self.gate.retry_at = None;
        self.release_at = None;
        self.gate.want = true;
    }

    /// Does the coordinator hold the dispatcher lock?
    pub fn lock_held(&self) -> bool {
        self.gate.lock_held
    }

    /// Is a claim in flight?
    pub fn in_flight(&self) -> bool {
        self.gate.in_flight
    }

    /// Did a wake-up ask for a claim that the gate lets through now?
    pub fn due(&self) -> bool {
        self.gate.want && self.gate.open()
    }

    /// The claim to send now for these free capacities (stages with none left out), if
    /// any: the wake-up is consumed either way, and with no capacity asked only the
    /// heartbeat claims (for the paused clock it brings back). A claim returned is in
    /// flight until [`Self::answered`] or [`Self::failed`]; it comes with where it
    /// starts at each stage it asks of, in order.
    pub fn begin(
        &mut self,
        asked: Vec<(String, i32)>,
        poll_interval: Duration,
        now: Instant,
    ) -> Option<(ClaimRequest, Starts)> {
        let heartbeat = self.gate.last + poll_interval <= now;
        self.gate.want = false;
        // The catch-up is spent even when no stage has capacity: a stage asked later
        // goes without its floor then, its last claim without one being old enough.
        if self.catch_up_at.is_some_and(|t| t <= now) {
            self.catch_up_at = None;
        }
        if asked.is_empty() && !heartbeat {
            return None;
        }
        self.gate.in_flight = true;
        self.gate.retry_at = None;
        self.gate.last = now;
        self.asked = asked.iter().map(|(stage, _)| stage.clone()).collect();
        let stages: Vec<&str> = self.asked.iter().map(String::as_str).collect();
        let floors = self.ledger.floors().for_claim(&stages, now);
        let walks = self.ledger.floors().walks(&stages, now);
        let sweeps = self.ledger.floors().sweeps(&stages);
        Some((
            self.ledger.policy().request(asked),
            Starts {
                floors,
                walks,
                sweeps,
            },
        ))
    }

    /// The claim in flight answered: the ledger and its policy take in the rows and
    /// where a fair claim's sender windows ended, the floors where each stage's next
    /// pick starts, the paused clock the earliest due row. Returns the stages it asked
    /// capacity of.
    pub fn answered(
        &mut self,
        claims: &[Claim],
        windows: &[Window],
        (floors, sweeps): (&[Next], &[Next]),
        next_paused: Option<f64>,
        now: Instant,
    ) -> Vec<String> {
        self.gate.in_flight = false;
        self.paused.learn(next_paused, now);
        self.ledger.claimed(claims, windows);
        self.ledger.floors().answered(floors, sweeps);
        self.release_at = self.ledger.policy().release_at(now);
        std::mem::take(&mut self.asked)
    }

    /// The database's oldest snapshot at the last read of its holders: while one older
    /// than [`floors::HELD`] holds the horizon, a slow claim may pause the senders'
    /// walks.
    pub fn oldest_snapshot(&mut self, age: Option<Duration>) {
        self.ledger
            .floors()
            .horizon_held(age.is_some_and(|a| a >= floors::HELD));
    }

    /// The claim in flight took `took`, answered or failed: a slow one pauses the
    /// senders' walks it let run ([`floors::WALK_BUDGET`]).
    pub fn took(&mut self, took: Duration, now: Instant) {
        self.ledger.floors().took(took, now);
    }

    /// The claim in flight failed (database trouble): nothing was claimed; the wake-up
    /// that asked for it still stands and is retried shortly. Returns the stages it
    /// asked capacity of.
    pub fn failed(&mut self, now: Instant) -> Vec<String> {
        self.gate.in_flight = false;
        self.gate.retry_at = Some(now + CLAIM_RETRY);
        std::mem::take(&mut self.asked)
    }

    /// The coordinator lost the lock: no claim until it is back. True when it was held.
    pub fn lock_lost(&mut self) -> bool {
        std::mem::replace(&mut self.gate.lock_held, false)
    }

    /// The coordinator holds the lock again: claim.
    pub fn lock_regained(&mut self) {
        // The reconcile that follows puts running rows back to pending.
        self.ledger.floors().reset();
        self.gate.lock_held = true;
        self.gate.want = true;
    }

    // ---- the paused clock ----------------------------------------------------------

    /// A row was paused (a strike, a deferral) or a claim reported the earliest paused
    /// row: due in `due_in` seconds.
    pub fn learn_paused(&mut self, due_in: Option<f64>, now: Instant) {
        self.paused.learn(due_in, now);
    }

    /// A flip of due paused rows is sent.
    pub fn flip(&mut self) {
        self.paused.flip_in_flight = true;
        self.paused.next = None;
    }

    /// Due paused rows were flipped to pending (`count`), the next is due then: a
    /// claim when any was.
    pub fn flipped(&mut self, count: i64, next_paused: Option<f64>, now: Instant) {
        self.paused.flip_in_flight = false;
        self.paused.next = None;
        self.paused.learn(next_paused, now);
        if count > 0 {
            // The flipped rows are pending again, below any floor.
            self.ledger.floors().reset();
            self.gate.want = true;
        }
    }

    /// The flip failed: try again shortly.
    pub fn flip_failed(&mut self, now: Instant) {
        self.paused.flip_in_flight = false;
        self.paused.next = Some(now + FLIP_RETRY);
    }

    // ---- deferrals (§8.4) ----------------------------------------------------------

    /// A worker answered 74 for this claim: settled in the ledger as a deferral, and
    /// remembered to be resumed early.
    pub fn defer(&mut self, claim: &Claim, now: Instant) {
        self.ledger.deferred(claim);
        self.deferred.push((claim.clone(), now));
    }

    /// The deferred claims to resume now: those deferred at least [`DEFER_GRACE`] ago.
    pub fn resumable(&mut self, now: Instant) -> Vec<Claim> {
        let split = self
            .deferred
            .iter()
            .position(|d| d.1 + DEFER_GRACE > now)
            .unwrap_or(self.deferred.len());
        if split > 0 {
            // The resume puts them back to pending before the next claim runs (the
            // coordinator's commands run in order), below any floor.
            self.ledger.floors().reset();
        }
        self.deferred.drain(..split).map(|d| d.0).collect()
    }

    // ---- deadlines, for the loop's timers ------------------------------------------

    /// May a claim be sent (the lock held, none in flight)?
    pub fn open(&self) -> bool {
        self.gate.open()
    }

    /// Did a wake-up ask for a claim?
    pub fn wanted(&self) -> bool {
        self.gate.want
    }

    /// When the last claim was sent.
    pub fn last_claim(&self) -> Instant {
        self.gate.last
    }

    /// When a failed claim is tried again, the catch-up claim after a notification is
    /// due, or a tenant a rate held back may take a row again, whichever comes first.
    pub fn retry_at(&self) -> Option<Instant> {
        [self.gate.retry_at, self.catch_up_at, self.release_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// When the earliest paused row is due, if a flip may be sent.
    pub fn paused_due(&self) -> Option<Instant> {
        self.paused.deadline(self.gate.lock_held)
    }

    /// When the earliest deferred row may be resumed.
    pub fn resume_at(&self) -> Option<Instant> {
        self.deferred.first().map(|d| d.1 + DEFER_GRACE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paused_clock_keeps_the_earliest_and_survives_any_value() {
        let now = Instant::now();
        let mut p = PausedClock::default();
        p.learn(Some(10.0), now);
        p.learn(Some(5.0), now);
        p.learn(Some(20.0), now);
        assert_eq!(p.next, Some(now + Duration::from_secs(5)));
        for odd in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1e300, 1e300] {
            let mut p = PausedClock::default();
            p.learn(Some(odd), now);
            assert!(p.next.is_none_or(|t| t >= now), "{odd}");
        }
        let mut p = PausedClock::default();
        p.learn(Some(-3.0), now);
        assert_eq!(p.deadline(true), Some(now), "an overdue row is due now");
        assert_eq!(p.deadline(false), None, "no flip without the lock");
        p.flip_in_flight = true;
        assert_eq!(p.deadline(true), None, "no second flip in flight");
    }

    #[test]
    fn the_gate_opens_only_with_the_lock_and_no_claim_in_flight() {
        let mut g = ClaimGate::new(Instant::now());
        assert!(g.open() && g.want);
        g.in_flight = true;
        assert!(!g.open());
        g.in_flight = false;
        g.lock_held = false;
        assert!(!g.open());
    }

    fn options() -> DispatchOptions {
        let path = std::path::PathBuf::from("/t.conf");
        let sections = crate::config::raw::parse(&path, "[pepsi-dispatch]\nFAIR_SCHEDULING = no\n")
            .expect("parses");
        crate::config::Config::from_sections(path, sections)
            .expect("valid")
            .dispatch
    }

    #[test]
    fn the_stages_a_claim_asked_of_come_back_with_its_answer_or_its_failure() {
        let now = Instant::now();
        let poll = Duration::from_secs(30);
        let mut side = ClaimSide::new(&options(), now);
        assert!(side.due());
        let asked = vec![("a".to_string(), 4), ("b".to_string(), 1)];
        let (request, starts) = side.begin(asked.clone(), poll, now).expect("a claim");
        assert_eq!(
            starts.floors,
            [None, None],
            "no floor before a first answer"
        );
        assert_eq!(starts.walks, [true, true]);
        assert_eq!(request.asked(), &asked[..]);
        assert!(side.in_flight() && !side.due());
        assert_eq!(side.answered(&[], &[], (&[], &[]), None, now), ["a", "b"]);
        side.want();
        side.begin(vec![("c".to_string(), 2)], poll, now);
        assert_eq!(side.failed(now), ["c"]);
        assert_eq!(side.retry_at(), Some(now + CLAIM_RETRY));
        // Nothing to ask and no heartbeat due: no claim, and the wake-up is spent.
        side.want();
        assert!(side.begin(Vec::new(), poll, now).is_none());
        assert!(!side.wanted() && !side.in_flight());
        assert!(side.begin(Vec::new(), poll, now + poll).is_some());
    }

    #[test]
    fn a_notification_asks_for_a_claim_now_and_a_catch_up_once_the_floors_are_stale() {
        let now = Instant::now();
        let poll = Duration::from_secs(30);
        let mut side = ClaimSide::new(&options(), now);
        side.begin(vec![("a".to_string(), 1)], poll, now);
        side.answered(&[], &[], (&[("a".to_string(), Some(10))], &[]), None, now);
        let t = now + Duration::from_millis(100);
        side.notified(t);
        assert!(side.due());
        let catch_up = t + floors::FULL_PICK_EVERY;
        assert_eq!(side.retry_at(), Some(catch_up));
        // The claim the notification woke does not end the wait; a claim at the
        // catch-up time does, and it reads without the floor.
        let (_, starts) = side.begin(vec![("a".to_string(), 1)], poll, t).unwrap();
        assert_eq!(starts.floors, [Some(10)]);
        side.answered(&[], &[], (&[], &[]), None, t);
        assert_eq!(side.retry_at(), Some(catch_up));
        side.retry_due();
        let (_, starts) = side
            .begin(vec![("a".to_string(), 1)], poll, catch_up)
            .unwrap();
        assert_eq!(starts.floors, [None]);
        assert_eq!(side.retry_at(), None);
        // With no capacity anywhere at the catch-up time, it is spent all the same (no
        // timer left in the past to spin on).
        side.answered(&[], &[], (&[], &[]), None, catch_up);
        side.notified(catch_up);
        let later = catch_up + floors::FULL_PICK_EVERY;
        side.retry_due();
        assert!(side.begin(Vec::new(), poll, later).is_none());
        assert_eq!(side.retry_at(), None);
    }
}
