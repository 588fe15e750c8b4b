//! The loop's claim handlers (§6, §8.4): a claim answered or failed, a lock loss and
//! its re-take, the paused-row and deferred-row timers, and the policy step's claim for
//! every stage with free capacity.
//!
//! Called by the loop's event and timer dispatch and its policy step
//! ([`super::event_loop`]). The coordinator runs the statements; these handlers record
//! what it answered through the claim side's verbs ([`super::claim_side`]) and the
//! pools' ([`super::pools`]), and send what to ask next. A lock loss means every worker
//! killed at once (another dispatcher may take their rows); its re-take, a reconcile of
//! everything this dispatcher does not hold. The gate, clock and ledger themselves live
//! in [`super::claim_side`], not here.

use std::time::{Duration, Instant};

use super::claim::Claim;
use super::coordinator::Command;
use super::event_loop::Dispatcher;
use super::floors::Next;
use super::scheduler::Window;

impl Dispatcher {
    /// A claim answered: the claim side takes in the rows (the policy learns where a
    /// fair claim's sender windows ended, the floors where each stage's next pick
    /// starts), the stages it asked of are free to be asked
    /// again, then its rows join their stages' queues (rows of a stage that went away
    /// meanwhile go straight back).
    pub(super) fn on_claimed(
        &mut self,
        claims: Vec<Claim>,
        next_paused: Option<f64>,
        windows: &[Window],
        (floors, sweeps): (&[Next], &[Next]),
        took: Duration,
    ) {
        let now = Instant::now();
        self.claim_side.took(took, now);
        let asked = self
            .claim_side
            .answered(&claims, windows, (floors, sweeps), next_paused, now);
        self.pools.release(&asked);
        // The dispatcher's own claims succeed: the database answers again.
        if self.pools.database_is_back() {
            self.claim_side.want();
        }
        let stray = self.pools.enqueue(claims);
        self.requeue(stray);
    }

    /// A claim failed (database trouble): nothing was claimed; the wake-up that asked
    /// for it still stands and is retried shortly.
    pub(super) fn on_claim_failed(&mut self) {
        let asked = self.claim_side.failed(Instant::now());
        self.pools.release(&asked);
    }

    /// The earliest paused row is due: flip due rows back to pending.
    pub(super) fn on_paused_due(&mut self) {
        self.claim_side.flip();
        self.send(Command::FlipPaused);
    }

    /// Rows deferred for 74 at least `DEFER_GRACE` ago go back to pending. The command
    /// runs on the coordinator's session, so after a reconnect if that session was lost
    /// too: exactly when the database answers the dispatcher again. Guarded by the claim
    /// token, so a row flipped and claimed again meanwhile is left alone.
    pub(super) fn on_deferred_due(&mut self, now: Instant) {
        let due = self.claim_side.resumable(now);
        if !due.is_empty() {
            self.send(Command::Resume(due));
        }
    }

    /// The coordinator lost its connection and with it the lock. Another dispatcher may
    /// now take the lock and the rows: stop claiming, and kill every worker at once
    /// (and their database sessions, as soon as the coordinator is connected again).
    /// Nobody is blamed; the reconcile after the re-take puts their rows back.
    pub(super) fn on_lock_lost(&mut self) {
        if self.claim_side.lock_lost() {
            log::warn!(
                "the dispatcher lock was lost with the database connection; not claiming until it is back, and stopping {} workers",
                self.pools.worker_count()
            );
        }
        let (sessions, held) = self.pools.kill_all(self.poll.registry());
        self.claim_side.ledger().dropped(&held);
        if !sessions.is_empty() {
            self.send(Command::TerminateSessions(sessions));
        }
    }

    /// The lock is held again (for the `generation`-th time): reset every running row
    /// this dispatcher does not hold — its killed workers' rows, and those of a claim
    /// that committed while its answer was lost — then claim.
    pub(super) fn on_lock_regained(&mut self, generation: u64) {
        // Sets the floors aside too: the reconcile puts rows back to pending.
        self.claim_side.lock_regained();
        let held = self.pools.held_ids();
        self.send(Command::Reconcile { held, generation });
    }

    /// Claims for every stage with free capacity, in one statement, when a wake-up
    /// asked for it and the gate is open. The heartbeat claims even with no capacity
    /// asked, for the paused clock it brings back.
    pub(super) fn claim(&mut self) {
        if !self.claim_side.due() {
            return;
        }
        let now = Instant::now();
        let asked = self.pools.free_capacities(now);
        let Some((request, starts)) = self.claim_side.begin(asked, self.opts.poll_interval, now)
        else {
            return;
        };
        self.pools.reserve(request.asked());
        self.send(Command::Claim(request, starts));
    }
}
