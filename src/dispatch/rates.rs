//! Rates (§7 "Rates"): at most N messages a second per tenant at a stage, from the
//! stage's `RATE` and the tenant's rate in `pepsi.fair_weights` (the lower of the two),
//! held as a generic cell rate algorithm in the dispatcher's memory. Pure: the fair
//! policy (`fair.rs`) keeps one [`Rates`], tells it every row claimed and every row
//! given back without having run, and asks it before each claim how many rows each
//! tenant it knows may take now; the claim statement holds each tenant of its window
//! to that. A throttled tenant's rows are simply not claimed: nothing is written for
//! them, and they hold no slot.
//!
//! The algorithm: a tenant's bucket is its theoretical arrival time (TAT); a row may
//! start when `TAT − τ ≤ now`, and each row started moves the TAT to `max(TAT, now) +
//! T`, with T = 1 / rate and τ = (burst − 1) × T. The burst is what the rate allows in
//! [`BURST`], at least one row. A bucket whose TAT has passed is full and forgotten; a
//! tenant never seen, and every tenant after a restart, starts full.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The burst: a tenant may start this long's worth of its rate at once.
pub const BURST: Duration = Duration::from_secs(1);

/// A rate in messages a second, with its interval and burst.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    per_second: f64,
}

impl Rate {
    /// A rate of `per_second` messages a second (positive and finite, as the
    /// configuration and the table make it).
    pub fn new(per_second: f64) -> Rate {
        Rate { per_second }
    }

    /// T: the time one row uses of the rate.
    fn interval(self) -> Duration {
        Duration::from_secs_f64(1.0 / self.per_second)
    }

    /// The most rows started at once.
    pub fn burst(self) -> i32 {
        let n = (self.per_second * BURST.as_secs_f64()).floor();
        if n >= 1.0 { n.min(1e6) as i32 } else { 1 }
    }

    /// τ: how far the TAT may run ahead of now and a row still start.
    fn tolerance(self) -> Duration {
        self.interval() * u32::try_from(self.burst() - 1).unwrap_or(0)
    }
}

/// One tenant's bucket at one stage.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tat: Instant,
    rate: Rate,
}

impl Bucket {
    /// How many rows may start at `now`.
    fn allowance(&self, now: Instant) -> i32 {
        let ahead = self.tat.saturating_duration_since(now);
        let room = self.rate.tolerance().saturating_sub(ahead);
        let t = self.rate.interval().as_secs_f64();
        if ahead > self.rate.tolerance() {
            return 0;
        }
        let n = (room.as_secs_f64() / t + 1e-9).floor() as i64 + 1;
        n.clamp(0, i64::from(self.rate.burst())) as i32
    }

    /// When one row may start again.
    fn release(&self) -> Instant {
        self.tat
            .checked_sub(self.rate.tolerance())
            .unwrap_or(self.tat)
    }
}

/// Every stage's rate and every bucket not full.
#[derive(Debug, Default)]
pub struct Rates {
    /// `RATE` per stage.
    stages: HashMap<String, Rate>,
    /// (stage, tenant) → bucket.
    buckets: HashMap<(String, String), Bucket>,
}

impl Rates {
    /// The stages' `RATE`s, from the stage graph at start and at every reload.
    pub fn set_stage_rates(&mut self, rates: impl IntoIterator<Item = (String, f64)>) {
        self.stages = rates.into_iter().map(|(s, r)| (s, Rate::new(r))).collect();
    }

    /// The rate a tenant is held to at a stage: the lower of the stage's and its own.
    pub fn effective(&self, stage: &str, tenant_rate: Option<f64>) -> Option<Rate> {
        let own = tenant_rate.map(Rate::new);
        match (self.stages.get(stage).copied(), own) {
            (Some(a), Some(b)) => Some(if a.per_second <= b.per_second { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Before a claim: the most rows a tenant without a bucket may take at `stage`
    /// (its burst at the stage's rate; `None`: no limit), and each tenant whose bucket
    /// is not full, with its allowance now.
    pub fn allowances(&self, stage: &str, now: Instant) -> (Option<i32>, Vec<(String, i32)>) {
        let default = self.stages.get(stage).map(|r| r.burst());
        let listed = self
            .buckets
            .iter()
            .filter(|((s, _), _)| s == stage)
            .map(|((_, tenant), b)| (tenant.clone(), b.allowance(now)))
            .collect();
        (default, listed)
    }

    /// A row of `tenant` was claimed at `stage`, held to `rate`.
    pub fn took(&mut self, stage: &str, tenant: &str, rate: Rate, now: Instant) {
        let key = (stage.to_string(), tenant.to_string());
        let tat = self.buckets.get(&key).map_or(now, |b| b.tat.max(now));
        let bucket = Bucket {
            tat: tat + rate.interval(),
            rate,
        };
        self.buckets.insert(key, bucket);
    }

    /// A row of `tenant` claimed at `stage` went back without having run: its cell is
    /// given back.
    pub fn gave_back(&mut self, stage: &str, tenant: &str, now: Instant) {
        let key = (stage.to_string(), tenant.to_string());
        if let Some(b) = self.buckets.get_mut(&key) {
            b.tat = b.tat.checked_sub(b.rate.interval()).unwrap_or(now);
            if b.tat <= now {
                self.buckets.remove(&key);
            }
        }
    }

    /// Forgets the full buckets.
    pub fn sweep(&mut self, now: Instant) {
        self.buckets.retain(|_, b| b.tat > now);
    }

    /// The earliest moment a throttled tenant (allowance 0) may start a row again: a
    /// claim then takes its rows.
    pub fn release_at(&self, now: Instant) -> Option<Instant> {
        self.buckets
            .values()
            .filter(|b| b.allowance(now) == 0)
            .map(Bucket::release)
            .min()
    }

    /// Whether `tenant` is throttled at `stage` now.
    pub fn throttled(&self, stage: &str, tenant: &str, now: Instant) -> bool {
        let key = (stage.to_string(), tenant.to_string());
        self.buckets
            .get(&key)
            .is_some_and(|b| b.allowance(now) == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_bucket_allows_its_burst_then_one_row_per_interval() {
        let mut r = Rates::default();
        r.set_stage_rates([("s".to_string(), 10.0)]);
        let t = Instant::now();
        assert_eq!(r.allowances("s", t), (Some(10), vec![]));
        let rate = r.effective("s", None).unwrap();
        for _ in 0..10 {
            r.took("s", "a", rate, t);
        }
        assert_eq!(r.allowances("s", t).1, vec![("a".to_string(), 0)]);
        assert!(r.throttled("s", "a", t));
        // One interval later, one row; the release is then.
        assert_eq!(r.release_at(t), Some(t + ms(100)));
        assert_eq!(r.allowances("s", t + ms(100)).1, vec![("a".to_string(), 1)]);
        assert_eq!(r.allowances("s", t + ms(550)).1, vec![("a".to_string(), 5)]);
        // Full again after a second: forgotten.
        r.sweep(t + ms(1000));
        assert!(r.allowances("s", t + ms(1000)).1.is_empty());
    }

    #[test]
    fn over_a_minute_the_rows_started_follow_the_rate() {
        let mut r = Rates::default();
        let rate = Rate::new(10.0);
        let t = Instant::now();
        let mut started = 0;
        // Claims every 30 ms, each taking what the bucket allows.
        for step in 0..2000u64 {
            let now = t + ms(30 * step);
            let key = ("s".to_string(), "a".to_string());
            let allowed = r
                .buckets
                .get(&key)
                .map_or(rate.burst(), |b| b.allowance(now));
            for _ in 0..allowed {
                r.took("s", "a", rate, now);
                started += 1;
            }
        }
        // 60 s at 10/s, plus the first burst.
        assert!((600..=610).contains(&started), "{started}");
    }

    #[test]
    fn the_lower_rate_holds_and_a_row_given_back_returns_its_cell() {
        let mut r = Rates::default();
        r.set_stage_rates([("s".to_string(), 100.0)]);
        assert_eq!(r.effective("s", Some(2.0)), Some(Rate::new(2.0)));
        assert_eq!(r.effective("s", None), Some(Rate::new(100.0)));
        assert_eq!(r.effective("t", Some(2.0)), Some(Rate::new(2.0)));
        assert_eq!(r.effective("t", None), None);
        let t = Instant::now();
        let slow = Rate::new(2.0);
        assert_eq!(slow.burst(), 2);
        r.took("s", "a", slow, t);
        r.took("s", "a", slow, t);
        assert!(r.throttled("s", "a", t));
        r.gave_back("s", "a", t);
        assert_eq!(r.allowances("s", t).1, vec![("a".to_string(), 1)]);
        r.gave_back("s", "a", t);
        assert!(r.allowances("s", t).1.is_empty(), "full again, forgotten");
        // A rate below one a second still allows one row at a time.
        assert_eq!(Rate::new(1.0 / 60.0).burst(), 1);
    }
}
