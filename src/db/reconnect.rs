//! The waits between attempts to reach the database again after a session was lost
//! (§8.4): every [`FAST`] for the first [`FAST_FOR`] of an outage — a failover
//! manager's promotion, or a restart, is over within that, and the first attempt after
//! it should come at once — then doubling from twice [`FAST`] up to a cap of the
//! program's, so that a long outage costs the server little.
//!
//! Used by the dispatcher's coordinator and LISTEN threads, the failure bouncer and
//! `pepsi-ingress`; the workers' pools connect on demand (the dispatcher starts workers
//! only once it holds its lock again).

use std::time::{Duration, Instant};

/// The wait between attempts early in an outage.
pub const FAST: Duration = Duration::from_millis(250);
/// How long attempts come every [`FAST`].
pub const FAST_FOR: Duration = Duration::from_secs(10);

/// The waits of one outage.
#[derive(Debug)]
pub struct Reconnect {
    /// When the first attempt failed.
    since: Option<Instant>,
    /// The next wait once past [`FAST_FOR`].
    slow: Duration,
    /// The longest wait.
    max: Duration,
}

impl Reconnect {
    /// Waits that grow up to `max`.
    pub fn new(max: Duration) -> Reconnect {
        Reconnect {
            since: None,
            slow: FAST * 2,
            max: max.max(FAST),
        }
    }

    /// The wait after an attempt that failed.
    pub fn after_failure(&mut self) -> Duration {
        self.after_failure_at(Instant::now())
    }

    fn after_failure_at(&mut self, now: Instant) -> Duration {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) < FAST_FOR {
            return FAST;
        }
        let wait = self.slow.min(self.max);
        self.slow = (self.slow * 2).min(self.max);
        wait
    }

    /// How long the outage has lasted (zero before a failure).
    pub fn outage(&self) -> Duration {
        self.since.map(|s| s.elapsed()).unwrap_or_default()
    }

    /// The database is back: the next outage starts fast again.
    pub fn reset(&mut self) {
        *self = Reconnect::new(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_for_ten_seconds_then_doubling_up_to_the_cap() {
        let start = Instant::now();
        let mut r = Reconnect::new(Duration::from_secs(5));
        let at = |s: f64| start + Duration::from_secs_f64(s);
        assert_eq!(r.after_failure_at(at(0.0)), FAST);
        assert_eq!(r.after_failure_at(at(9.9)), FAST);
        let waits: Vec<u64> = [10.0, 11.0, 12.0, 14.0, 18.0, 23.0, 28.0]
            .iter()
            .map(|&s| r.after_failure_at(at(s)).as_millis() as u64)
            .collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 5000, 5000, 5000]);
        r.reset();
        assert_eq!(r.after_failure_at(at(30.0)), FAST);
    }

    #[test]
    fn a_cap_below_the_fast_wait_is_the_fast_wait() {
        let mut r = Reconnect::new(Duration::from_millis(10));
        assert_eq!(r.after_failure(), FAST);
    }
}
