//! `pepsi-failure-bouncer serve` (§13.1): one thread that LISTENs on
//! `workqueue_failed` and sweeps at start, at every notification, once a minute and
//! after every reconnect; rides out database outages and stops on SIGINT or SIGTERM
//! once the call in progress has finished. The moves themselves are
//! [`super::sweep`]'s, as for `sweep`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::db::Client;
use postgres::fallible_iterator::FallibleIterator;

use super::{Scope, Target, Totals, Trouble, sweep};
use crate::db::reconnect::Reconnect;
use crate::db::{self, ErrorKind, sql};
use crate::exit::Failure;
use crate::logging::Every;

/// How long one wait for notifications lasts before the stop flag is looked at again.
const WAIT: Duration = Duration::from_millis(500);
/// The safety-net sweep's period, in case a notification went missing.
const SAFETY_NET: Duration = Duration::from_secs(60);
/// After a call the database refused for a reason other than the connection (a lock
/// or statement timeout, a permission): when to try again.
const RETRY_REFUSED: Duration = Duration::from_secs(5);
/// The longest wait between reconnection attempts (the first ten seconds of an
/// outage are tried every 250 ms, [`Reconnect`]; as the dispatcher's LISTEN session).
const RETRY_MAX: Duration = Duration::from_secs(5);
/// The longest sleep between two looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// What one wait for notifications brought.
enum Woken {
    /// One or more notifications (all drained).
    Notified,
    /// Nothing within the wait.
    Quiet,
    /// The session is gone.
    Lost(String),
}

/// `serve`: the one thread's whole state.
pub(super) struct Service {
    target: Target,
    scope: Scope,
    /// Set by SIGINT / SIGTERM.
    stop: Arc<AtomicBool>,
    /// Set by SIGHUP: nothing to reload (the bouncer reads its section once), so the
    /// signal is told about and otherwise ignored.
    hup: Arc<AtomicBool>,
    /// The session: LISTENing, schema checked. `None` while the database is away.
    client: Option<Client>,
    /// Has the bounce stage been checked against the stage graph (at the first
    /// session)?
    stage_checked: bool,
    /// Was a session lost (so the next one is a reconnect worth a line)?
    lost: bool,
    /// When the next sweep is due (at once after a (re)connect or a notification).
    next_sweep: Instant,
    /// The outage line, once a minute at most.
    outage: Every,
    /// The refused-call line, once a minute at most.
    refused: Every,
}

impl Service {
    pub(super) fn new(
        target: Target,
        scope: Scope,
        stop: Arc<AtomicBool>,
        hup: Arc<AtomicBool>,
    ) -> Service {
        Service {
            target,
            scope,
            stop,
            hup,
            client: None,
            stage_checked: false,
            lost: false,
            next_sweep: Instant::now(),
            outage: Every::minute(),
            refused: Every::minute(),
        }
    }

    fn stopping(&self) -> bool {
        if self.hup.swap(false, Ordering::Relaxed) {
            log::info!(
                "SIGHUP: pepsi-failure-bouncer reads its configuration when it starts; restart it to apply a change (it goes on as it is)"
            );
        }
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleeps up to `total`, waking early when a stop is asked for.
    fn sleep(&self, total: Duration) {
        let deadline = Instant::now() + total;
        while !self.stopping() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(STOP_POLL));
        }
    }

    /// The loop: (re)connect, sweep when due, wait for a notification; until a signal.
    pub(super) fn serve(mut self) -> Result<(), Failure> {
        log::info!(
            "pepsi-failure-bouncer {} serving: moving {} messages to bounce stage {}",
            env!("CARGO_PKG_VERSION"),
            self.scope.describe(),
            self.target.stage
        );
        let mut waits = Reconnect::new(RETRY_MAX);
        while !self.stopping() {
            if self.client.is_none() {
                match self.connect() {
                    Ok(client) => {
                        if self.lost {
                            log::info!(
                                "database connection re-established; sweeping what failed meanwhile"
                            );
                        }
                        self.client = Some(client);
                        waits.reset();
                        // Notifications sent while away are lost: catch up at once.
                        self.next_sweep = Instant::now();
                    }
                    Err(Trouble::Fatal(failure)) => return Err(failure),
                    Err(Trouble::Away(why)) => {
                        if self.outage.due() {
                            log::warn!(
                                "the database is not available ({why}); trying again every {}s at most (said once a minute)",
                                RETRY_MAX.as_secs()
                            );
                        }
                        self.sleep(waits.after_failure());
                    }
                }
                continue;
            }
            if Instant::now() >= self.next_sweep {
                self.sweep();
                continue;
            }
            match self.wait() {
                Woken::Notified => self.next_sweep = Instant::now(),
                Woken::Quiet => {}
                Woken::Lost(why) => self.lose(&why),
            }
        }
        log::info!("stopping on signal");
        Ok(())
    }

    /// Opens a session: connect, check the schema, LISTEN; the first time also check
    /// the bounce stage against the stage graph. The first session's refusals that
    /// waiting does not fix (authentication, a missing database) end the program; later
    /// ones are waited out like an outage: the service never exits because of the
    /// database, only for a schema that no longer matches.
    fn connect(&mut self) -> Result<Client, Trouble> {
        let first = !self.stage_checked;
        let patient = |t: Trouble| match t {
            Trouble::Fatal(f) if !first && f.code != crate::exit::EX_CONFIG => {
                Trouble::Away(f.message)
            }
            other => other,
        };
        let mut client = self.target.open().map_err(patient)?;
        if first {
            self.target.check_stage(&mut client)?;
        }
        // LISTEN before the catch-up sweep, so that nothing failing in between is
        // missed.
        client
            .batch_execute(sql::LISTEN_BOUNCER)
            .map_err(|e| patient(Trouble::from_db("cannot LISTEN", &e)))?;
        self.stage_checked = true;
        log::debug!(
            "session connected, listening on {}",
            sql::CHANNEL_WORKQUEUE_FAILED
        );
        Ok(client)
    }

    /// Forgets a lost session; the loop reconnects.
    fn lose(&mut self, why: &str) {
        self.client = None;
        self.lost = true;
        if self.outage.due() {
            log::warn!(
                "the database connection is lost ({why}); reconnecting, then sweeping (said once a minute)"
            );
        }
    }

    /// A sweep now; the next is the safety net's, or sooner after a refused call.
    fn sweep(&mut self) {
        let Some(client) = self.client.as_mut() else {
            return;
        };
        let mut totals = Totals::default();
        let result = sweep(
            client,
            &self.target.stage,
            self.scope,
            &self.stop,
            &mut totals,
        );
        let closed = client.is_closed();
        match result {
            Ok(()) => {
                self.next_sweep = Instant::now() + SAFETY_NET;
                self.refused.reset();
                log::debug!("sweep: {}", totals.summary(&self.target.stage));
            }
            Err(e) if closed || db::classify(&e) != ErrorKind::Other => {
                self.lose(&db::describe(&e));
            }
            Err(e) => {
                self.next_sweep = Instant::now() + RETRY_REFUSED;
                if self.refused.due() {
                    log::error!(
                        "cannot move {} messages to bounce stage {}: {}; trying again every {}s (said once a minute)",
                        self.scope.describe(),
                        self.target.stage,
                        db::describe(&e),
                        RETRY_REFUSED.as_secs()
                    );
                }
            }
        }
    }

    /// Waits up to [`WAIT`] (or until the next sweep is due) for a notification, then
    /// drains every pending one: a burst is one sweep.
    fn wait(&mut self) -> Woken {
        let Some(client) = self.client.as_mut() else {
            return Woken::Lost("no session".into());
        };
        let timeout = WAIT.min(self.next_sweep.saturating_duration_since(Instant::now()));
        let mut notes = client.notifications();
        let first = notes.timeout_iter(timeout).next();
        let woken = match first {
            Ok(Some(_)) => loop {
                match notes.iter().next() {
                    Ok(Some(_)) => {}
                    Ok(None) => break Woken::Notified,
                    Err(e) => break Woken::Lost(db::describe(&e)),
                }
            },
            Ok(None) => Woken::Quiet,
            Err(e) => Woken::Lost(db::describe(&e)),
        };
        drop(notes);
        // A session closed under the wait says so only here.
        match woken {
            Woken::Quiet if client.is_closed() => Woken::Lost("the session was closed".into()),
            other => other,
        }
    }
}
