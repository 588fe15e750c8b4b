//! Shutdown (§6, on SIGINT/SIGTERM or a failure that ends the loop): answers already in
//! the pipes are counted, every worker is killed with its session and its database
//! sessions are terminated, every in-flight or claimed-but-unassigned row goes back to
//! pending through the coordinator's reset — or, when the coordinator thread died and
//! its lock with it, through a connection of the loop's own that takes the lock first —
//! and the last statistics are flushed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::coordinator::Command;
use super::event_loop::{Dispatcher, Stop};
use super::events::Event;
use super::session;
use crate::exit::Failure;

/// How long shutdown waits for the coordinator's reset and the last flush.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(15);

impl Dispatcher {
    pub(super) fn shutdown(mut self) -> Result<(), Failure> {
        // A coordinator waiting out an outage gives up; so does the listener.
        self.stopping.store(true, Ordering::Relaxed);
        log::info!("shutting down: stopping {} workers", self.workers.len());
        let serials: Vec<u64> = self.workers.keys().copied().collect();
        // Answers already in the pipes are outcomes committed: count them before the
        // kill. (`stop` is still set: a death found here blames nobody.)
        for &serial in &serials {
            self.read_from(serial);
        }
        let stop = self.stop.take().unwrap_or(Stop::Signal);
        let mut sessions = Vec::new();
        for serial in serials {
            if let Some((mut w, _)) = self.remove_worker(serial, true) {
                sessions.push(std::mem::take(&mut w.session));
                let held: Vec<Claim> = w.queue.drain(..).map(|s| s.claim).collect();
                self.ledger.dropped(&held);
            }
        }
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        // Every running row is this dispatcher's (claimed, in flight, or from a claim
        // still in the coordinator's queue, which runs before the reset). The killed
        // workers' statements go first, so that no lock they hold stalls the reset.
        let sent = !self.coordinator_dead
            && (sessions.is_empty()
                || self
                    .coordinator
                    .send(Command::TerminateSessions(sessions))
                    .is_ok())
            && self.coordinator.send(Command::Reset).is_ok();
        if sent {
            self.wait_for_reset(deadline);
        } else {
            // The coordinator is gone and its connection, the lock with it: take the
            // lock on a connection of our own to put the rows back.
            match session::reset_alone(
                self.config
                    .postgres
                    .connection_for(crate::config::DbRole::Dispatch),
            ) {
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
        match stop {
            Stop::Signal => {
                log::info!("stopped");
                Ok(())
            }
            Stop::Fail(f) => Err(f),
        }
    }

    fn wait_for_reset(&mut self, deadline: Instant) {
        loop {
            match self.events.recv_deadline(deadline) {
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
                    self.ledger.claimed(&claims, &windows);
                    self.ledger.dropped(&claims);
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
        while self.flush_in_flight {
            match self.events.recv_deadline(deadline) {
                Ok(Event::Flushed(Ok(()))) => self.flush_in_flight = false,
                Ok(Event::Flushed(Err((e, deltas)))) => {
                    log::warn!("a statistics flush failed at shutdown: {e}");
                    self.flush_in_flight = false;
                    self.ledger.deltas.merge(&deltas);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}
