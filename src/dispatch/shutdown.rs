//! Shutdown (§6, on SIGINT/SIGTERM or a failure that ends the loop): answers already in
//! the pipes are counted, every worker is killed with its session and its database
//! sessions are terminated, every in-flight or claimed-but-unassigned row goes back to
//! pending through the coordinator's reset — or, when the coordinator thread died and
//! its lock with it, through a connection of the loop's own that takes the lock first —
//! and the last statistics are flushed.
//!
//! Called once by the loop ([`super::event_loop`]) after its last turn, which has set
//! the flag the coordinator and the listener watch and decides the exit status after.
//! Everything goes through the owners' verbs and the loop's own helpers.

use std::time::{Duration, Instant};

use super::coordinator::Command;
use super::event_loop::Dispatcher;
use super::events::Event;
use super::session;

/// How long shutdown waits for the coordinator's reset and the last flush.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(15);

impl Dispatcher {
    /// Stops every worker, resets the rows and flushes the last statistics; the loop
    /// ([`super::event_loop`]) calls it once, after its last turn, and decides the exit.
    pub(super) fn shutdown(&mut self) {
        log::info!(
            "shutting down: stopping {} workers",
            self.pools.worker_count()
        );
        // Answers already in the pipes are outcomes committed: count them before the
        // kill. (The loop's stop is still set: a death found here blames nobody.)
        for serial in self.pools.serials() {
            self.read_from(serial);
        }
        let (sessions, held) = self.pools.kill_all(self.poll.registry());
        self.claim_side.ledger().dropped(&held);
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        // Every running row is this dispatcher's (claimed, in flight, or from a claim
        // still in the coordinator's queue, which runs before the reset). The killed
        // workers' statements go first, so that no lock they hold stalls the reset.
        let sent = (sessions.is_empty()
            || self.coordinator_takes(Command::TerminateSessions(sessions)))
            && self.coordinator_takes(Command::Reset);
        if sent {
            self.wait_for_reset(deadline);
        } else {
            // The coordinator is gone and its connection, the lock with it: take the
            // lock on a connection of our own to put the rows back.
            match session::reset_alone(&session::Target::of(&self.config)) {
                Ok(n) => log::info!("{n} in-flight rows back to pending"),
                Err(e) => {
                    log::warn!("cannot reset in-flight rows ({e}); the next start resets them")
                }
            }
        }
        // The last statistics: wait for a flush in flight, then write what is left.
        self.wait_for_flush(deadline);
        self.flush_stats();
        self.wait_for_flush(deadline);
    }

    fn wait_for_reset(&mut self, deadline: Instant) {
        loop {
            match self.next_event_before(deadline) {
                Ok(Event::ResetDone(Ok(n))) => {
                    log::info!("{n} in-flight rows back to pending");
                    return;
                }
                Ok(Event::ResetDone(Err(e))) => {
                    log::warn!("cannot reset in-flight rows ({e}); the next start resets them");
                    return;
                }
                Ok(Event::Flushed(result)) => self.on_event(Event::Flushed(result)),
                Ok(Event::Claimed {
                    claims, windows, ..
                }) => {
                    let ledger = self.claim_side.ledger();
                    ledger.claimed(&claims, &windows);
                    ledger.dropped(&claims);
                }
                Ok(Event::ThreadDied { thread, .. }) if thread == "coordinator" => {
                    log::warn!(
                        "the coordinator died before the reset; the next start resets the rows"
                    );
                    return;
                }
                Ok(_) => {}
                Err(_) => {
                    log::warn!(
                        "the in-flight rows were not reset in time; the next start resets them"
                    );
                    return;
                }
            }
        }
    }

    fn wait_for_flush(&mut self, deadline: Instant) {
        while self.housekeeping.flush_in_flight() {
            match self.next_event_before(deadline) {
                Ok(Event::Flushed(result)) => {
                    let ledger = self.claim_side.ledger();
                    if let Err(e) = self.housekeeping.flushed(result, ledger) {
                        log::warn!("a statistics flush failed at shutdown: {e}");
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}
