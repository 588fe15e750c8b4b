//! The claim side of the loop (§6): the claim gate (at most one claim in flight, none
//! without the lock, a wake-up collapses into one claim), building one claim for every
//! stage with free capacity, the paused-row clock, and what a lock loss and its re-take
//! mean: every worker killed at once (another dispatcher may take their rows), then a
//! reconcile of everything this dispatcher does not hold.
//!
//! The coordinator runs the statements; these handlers record what it answered and
//! decide what to ask next.

use std::time::{Duration, Instant};

use super::claim::Claim;
use super::coordinator::Command;
use super::event_loop::Dispatcher;

/// How soon a claim that failed is tried again.
const CLAIM_RETRY: Duration = Duration::from_secs(1);
/// A failed paused-row flip is tried again after this.
const FLIP_RETRY: Duration = Duration::from_secs(1);
/// A row deferred for 74 is resumed early no sooner than this after its deferral, so a
/// worker that keeps losing its connection while the dispatcher keeps its own retries
/// a message once a second, not in a hot loop.
pub const DEFER_GRACE: Duration = Duration::from_secs(1);

/// Whether and when to claim.
pub struct ClaimGate {
    /// The coordinator holds the dispatcher lock: claims may be sent.
    pub lock_held: bool,
    /// A claim was sent and not yet answered.
    pub in_flight: bool,
    /// A wake-up asked for a claim.
    pub want: bool,
    /// When the last claim was sent (the heartbeat counts from here).
    pub last: Instant,
    /// When a claim that failed is tried again.
    pub retry_at: Option<Instant>,
}

impl ClaimGate {
    /// A gate that claims at the first turn.
    pub fn new(now: Instant) -> ClaimGate {
        ClaimGate {
            lock_held: true,
            in_flight: false,
            want: true,
            last: now,
            retry_at: None,
        }
    }

    /// May a claim be sent now?
    pub fn open(&self) -> bool {
        self.lock_held && !self.in_flight
    }
}

/// When the earliest paused row is due, and whether a flip is running.
#[derive(Default)]
pub struct PausedClock {
    /// When the earliest paused row is due.
    pub next: Option<Instant>,
    /// A flip was sent and not yet answered.
    pub flip_in_flight: bool,
}

impl PausedClock {
    /// Takes in a due time the database reported, in seconds from now (negative when
    /// overdue); keeps the earlier of it and the one known. A value that is not a
    /// number is ignored; one beyond a year is capped (the heartbeat looks again).
    pub fn learn(&mut self, due_in: Option<f64>, now: Instant) {
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
    pub fn deadline(&self, lock_held: bool) -> Option<Instant> {
        self.next.filter(|_| lock_held && !self.flip_in_flight)
    }
}

impl Dispatcher {
    /// A claim answered: the policy learns where a fair claim's sender windows ended,
    /// then its rows join their stages' queues (rows of a stage that went away
    /// meanwhile go straight back).
    pub(super) fn on_claimed(
        &mut self,
        claims: Vec<Claim>,
        asked: &[(String, i32)],
        next_paused: Option<f64>,
        windows: &[(String, Option<String>)],
    ) {
        self.gate.in_flight = false;
        self.release_reserved(asked);
        self.paused.learn(next_paused, Instant::now());
        // The dispatcher's own claims succeed: the database answers again.
        for (name, s) in self.stages.iter_mut() {
            if s.database_is_back() {
                log::info!(
                    "{name}: the database answers the dispatcher again; the start-failure cooldown ends"
                );
                self.gate.want = true;
            }
        }
        self.ledger.claimed(&claims, windows);
        let mut stray = Vec::new();
        for claim in claims {
            match self.stages.get_mut(&claim.stage) {
                Some(s) if !s.removed => s.queue.push_back(claim),
                _ => stray.push(claim),
            }
        }
        self.requeue(stray);
    }

    /// A claim failed (database trouble): nothing was claimed; the wake-up that asked
    /// for it still stands and is retried shortly.
    pub(super) fn on_claim_failed(&mut self, asked: &[(String, i32)]) {
        self.gate.in_flight = false;
        self.release_reserved(asked);
        self.gate.retry_at = Some(Instant::now() + CLAIM_RETRY);
    }

    fn release_reserved(&mut self, asked: &[(String, i32)]) {
        for (stage, _) in asked {
            if let Some(s) = self.stages.get_mut(stage) {
                s.reserved = 0;
            }
        }
    }

    /// Due paused rows were flipped to pending (`count`), the next is due then.
    pub(super) fn on_flipped(&mut self, count: i64, next_paused: Option<f64>) {
        self.paused.flip_in_flight = false;
        self.paused.next = None;
        self.paused.learn(next_paused, Instant::now());
        if count > 0 {
            self.gate.want = true;
        }
    }

    /// The flip failed: try again shortly.
    pub(super) fn on_flip_failed(&mut self) {
        self.paused.flip_in_flight = false;
        self.paused.next = Some(Instant::now() + FLIP_RETRY);
    }

    /// A worker answered 74 for this claim: its row is paused for 30 s, and resumed
    /// earlier, once the dispatcher's own session works (§8.4).
    pub(super) fn defer(&mut self, claim: Claim) {
        self.ledger.deferred(&claim);
        self.deferred.push((claim.clone(), Instant::now()));
        self.send(Command::Defer(claim));
    }

    /// Rows deferred at least [`DEFER_GRACE`] ago go back to pending. The command runs
    /// on the coordinator's session, so after a reconnect if that session was lost too:
    /// exactly when the database answers the dispatcher again. Guarded by the claim
    /// token, so a row flipped and claimed again meanwhile is left alone.
    pub(super) fn resume_deferred(&mut self, now: Instant) {
        let split = self
            .deferred
            .iter()
            .position(|d| d.1 + DEFER_GRACE > now)
            .unwrap_or(self.deferred.len());
        let due: Vec<Claim> = self.deferred.drain(..split).map(|d| d.0).collect();
        if !due.is_empty() {
            self.send(Command::Resume(due));
        }
    }

    /// The earliest paused row is due: flip due rows back to pending.
    pub(super) fn flip_paused(&mut self) {
        self.paused.flip_in_flight = true;
        self.paused.next = None;
        self.send(Command::FlipPaused);
    }

    /// The coordinator lost its connection and with it the lock. Another dispatcher may
    /// now take the lock and the rows: stop claiming, and kill every worker at once
    /// (and their database sessions, as soon as the coordinator is connected again).
    /// Nobody is blamed; the reconcile after the re-take puts their rows back.
    pub(super) fn on_lock_lost(&mut self) {
        if self.gate.lock_held {
            log::warn!(
                "the dispatcher lock was lost with the database connection; not claiming until it is back, and stopping {} workers",
                self.workers.len()
            );
        }
        self.gate.lock_held = false;
        let serials: Vec<u64> = self.workers.keys().copied().collect();
        let mut sessions = Vec::new();
        for serial in serials {
            if let Some((mut w, _)) = self.remove_worker(serial, true) {
                sessions.push(std::mem::take(&mut w.session));
                let claims: Vec<Claim> = w.queue.drain(..).map(|s| s.claim).collect();
                self.ledger.dropped(&claims);
            }
        }
        if !sessions.is_empty() {
            self.send(Command::TerminateSessions(sessions));
        }
    }

    /// The lock is held again (for the `generation`-th time): reset every running row
    /// this dispatcher does not hold — its killed workers' rows, and those of a claim
    /// that committed while its answer was lost — then claim.
    pub(super) fn on_lock_regained(&mut self, generation: u64) {
        self.gate.lock_held = true;
        self.gate.want = true;
        let held: Vec<i64> = self
            .workers
            .values()
            .flat_map(|w| w.queue.iter().map(|s| s.claim.id))
            .chain(
                self.stages
                    .values()
                    .flat_map(|s| s.queue.iter().map(|c| c.id)),
            )
            .collect();
        self.send(Command::Reconcile { held, generation });
    }

    /// Claims for every stage with free capacity, in one statement, when a wake-up
    /// asked for it and the gate is open. The heartbeat claims even with no capacity
    /// asked, for the paused clock it brings back.
    pub(super) fn claim(&mut self) {
        if !self.gate.want || !self.gate.open() {
            return;
        }
        let now = Instant::now();
        let heartbeat = self.gate.last + self.opts.poll_interval <= now;
        let mut asked = Vec::new();
        for (name, s) in &self.stages {
            let capacity = s.capacity(&self.views(s), now);
            if capacity > 0 {
                asked.push((name.clone(), i32::try_from(capacity).unwrap_or(i32::MAX)));
            }
        }
        self.gate.want = false;
        if asked.is_empty() && !heartbeat {
            return;
        }
        for (name, cap) in &asked {
            self.stages.get_mut(name).expect("asked for it").reserved = *cap as usize;
        }
        self.gate.in_flight = true;
        self.gate.retry_at = None;
        self.gate.last = now;
        let request = self.ledger.policy().request(asked);
        self.send(Command::Claim(request));
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
}
