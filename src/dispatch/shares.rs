//! What each tenant got at each stage over the last minute (§7 "Seen"): worker time,
//! messages, and the time a rate held it back, for `pepsi-queue status` and `metrics`.
//! The fair policy (`fair.rs`) adds to it; the ledger takes a [`Share`] list with each
//! statistics flush, which writes it to `pepsi.tenant_shares`. Pure.
//!
//! A minute is six slots of ten seconds: a figure is the sum of the slots of the last
//! minute, so it moves by a sixth at most every ten seconds. A tenant with nothing in
//! the last minute is forgotten.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// One slot's length.
const SLOT: Duration = Duration::from_secs(10);
/// Slots in the window.
const SLOTS: u64 = 6;
/// The most tenants a stage reports (the busiest); the rest are left out of the table.
pub const REPORTED: usize = 1000;

/// A tenant's figures at a stage over the last minute.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Share {
    pub stage: String,
    pub tenant: String,
    /// Worker time, µs.
    pub worker_us: i64,
    /// Messages run.
    pub messages: i64,
    /// Time a rate held it back, µs.
    pub throttled_us: i64,
    /// Its weight now.
    pub weight: f64,
}

/// One slot's sums.
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    n: u64,
    worker_us: i64,
    messages: i64,
    throttled_us: i64,
}

/// Every tenant's slots.
#[derive(Debug)]
pub struct Shares {
    start: Instant,
    slots: HashMap<(String, String), VecDeque<Slot>>,
}

impl Shares {
    pub fn new(now: Instant) -> Shares {
        Shares {
            start: now,
            slots: HashMap::new(),
        }
    }

    fn slot_of(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.start).as_secs() / SLOT.as_secs()
    }

    /// Adds to a tenant's current slot.
    fn add(&mut self, stage: &str, tenant: &str, now: Instant, f: impl Fn(&mut Slot)) {
        let n = self.slot_of(now);
        let slots = self
            .slots
            .entry((stage.to_string(), tenant.to_string()))
            .or_default();
        if slots.back().is_none_or(|s| s.n != n) {
            slots.push_back(Slot {
                n,
                ..Slot::default()
            });
        }
        while slots.front().is_some_and(|s| s.n + SLOTS <= n) {
            slots.pop_front();
        }
        f(slots.back_mut().expect("just pushed"));
    }

    /// A message of `tenant` ran at `stage` for `took`.
    pub fn ran(&mut self, stage: &str, tenant: &str, took: Duration, now: Instant) {
        let us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
        self.add(stage, tenant, now, |s| {
            s.worker_us = s.worker_us.saturating_add(us);
            s.messages += 1;
        });
    }

    /// A rate held `tenant` back at `stage` for `held`.
    pub fn throttled(&mut self, stage: &str, tenant: &str, held: Duration, now: Instant) {
        let us = i64::try_from(held.as_micros()).unwrap_or(i64::MAX);
        self.add(stage, tenant, now, |s| {
            s.throttled_us = s.throttled_us.saturating_add(us);
        });
    }

    /// The figures of the last minute, the busiest [`REPORTED`] tenants of each stage,
    /// each with its weight; forgets the tenants with nothing in it.
    pub fn snapshot(&mut self, now: Instant, mut weight: impl FnMut(&str) -> f64) -> Vec<Share> {
        let n = self.slot_of(now);
        self.slots.retain(|_, slots| {
            while slots.front().is_some_and(|s| s.n + SLOTS <= n) {
                slots.pop_front();
            }
            !slots.is_empty()
        });
        let mut all: Vec<Share> = self
            .slots
            .iter()
            .map(|((stage, tenant), slots)| {
                let mut s = Share {
                    stage: stage.clone(),
                    tenant: tenant.clone(),
                    weight: weight(tenant),
                    ..Share::default()
                };
                for slot in slots {
                    s.worker_us = s.worker_us.saturating_add(slot.worker_us);
                    s.messages += slot.messages;
                    s.throttled_us = s.throttled_us.saturating_add(slot.throttled_us);
                }
                s
            })
            .collect();
        all.sort_by(|a, b| {
            (a.stage.as_str(), b.worker_us, a.tenant.as_str()).cmp(&(
                b.stage.as_str(),
                a.worker_us,
                b.tenant.as_str(),
            ))
        });
        let mut kept: HashMap<String, usize> = HashMap::new();
        all.retain(|s| {
            let k = kept.entry(s.stage.clone()).or_default();
            *k += 1;
            *k <= REPORTED
        });
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minute_of_slots_is_summed_and_older_ones_forgotten() {
        let t = Instant::now();
        let mut s = Shares::new(t);
        let ms = Duration::from_millis;
        s.ran("a", "x", ms(5), t);
        s.ran("a", "x", ms(5), t + Duration::from_secs(15));
        s.ran("a", "y", ms(1), t + Duration::from_secs(15));
        s.throttled("a", "y", ms(300), t + Duration::from_secs(20));
        let snap = s.snapshot(t + Duration::from_secs(30), |k| {
            if k == "x" { 2.0 } else { 1.0 }
        });
        assert_eq!(
            snap,
            vec![
                Share {
                    stage: "a".into(),
                    tenant: "x".into(),
                    worker_us: 10_000,
                    messages: 2,
                    throttled_us: 0,
                    weight: 2.0
                },
                Share {
                    stage: "a".into(),
                    tenant: "y".into(),
                    worker_us: 1_000,
                    messages: 1,
                    throttled_us: 300_000,
                    weight: 1.0
                },
            ]
        );
        // 65 s on, the first slot has left the minute; 90 s on, everything.
        let snap = s.snapshot(t + Duration::from_secs(65), |_| 1.0);
        assert_eq!(snap[0].worker_us, 5_000);
        assert!(s.snapshot(t + Duration::from_secs(90), |_| 1.0).is_empty());
        assert!(s.slots.is_empty());
    }
}
