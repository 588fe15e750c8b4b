//! The fair shares of `pepsi-queue status` and `metrics` (§7 "Seen"): per stage, the
//! tenants waiting, what each tenant got over the last minute (worker time, messages,
//! time a rate held it back, its weight; `pepsi.tenant_shares`, which the dispatcher
//! writes) and the Jain fairness index of the worker time among the waiting tenants.
//!
//! The index is `(Σx)² / (n · Σx²)` over the n tenants waiting at the stage, x a
//! tenant's worker time over the last minute divided by its weight (0 for a waiting
//! tenant that got none): 1 when every waiting tenant got its share, 1/n when one got
//! everything. With equal weights it is the index of their worker time. Read in the
//! status snapshot's transaction ([`read`]); the rest is arithmetic.

use std::collections::BTreeMap;

use crate::db::sql;

/// The most tenants counted as waiting at one stage (a loose index scan, one probe
/// each).
pub const WAITING_COUNTED: i32 = 10_000;

/// One tenant's figures at one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantShare {
    pub tenant: String,
    /// Worker time over the last minute, µs.
    pub worker_us: i64,
    pub messages: i64,
    /// Time a rate held it back over the last minute, µs.
    pub throttled_us: i64,
    pub weight: f64,
    /// It has rows pending at the stage now.
    pub waiting: bool,
}

/// One stage's fair shares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageShares {
    /// Tenants with rows pending (at most [`WAITING_COUNTED`]).
    pub waiting: i64,
    /// The tenants the dispatcher reported, most worker time first.
    pub tenants: Vec<TenantShare>,
}

impl StageShares {
    /// The Jain fairness index among the waiting tenants; `None` when none waits or
    /// none of them got worker time.
    pub fn jain(&self) -> Option<f64> {
        let xs: Vec<f64> = self
            .tenants
            .iter()
            .filter(|t| t.waiting)
            .map(|t| t.worker_us as f64 / t.weight.max(1e-9))
            .collect();
        let n = (self.waiting.max(xs.len() as i64)) as f64;
        let sum: f64 = xs.iter().sum();
        let squares: f64 = xs.iter().map(|x| x * x).sum();
        (n > 0.0 && squares > 0.0).then(|| sum * sum / (n * squares))
    }

    /// The worker time of all tenants reported, µs.
    pub fn worker_us(&self) -> i64 {
        self.tenants.iter().map(|t| t.worker_us).sum()
    }
}

/// Reads the shares of every stage that has tenants waiting (of `stages`) or figures.
pub fn read(
    tx: &mut impl crate::db::Queries,
    stages: &[&str],
) -> Result<BTreeMap<String, StageShares>, postgres::Error> {
    let mut out: BTreeMap<String, StageShares> = BTreeMap::new();
    for r in tx.query(sql::QUEUE_TENANTS_WAITING, &[&stages, &WAITING_COUNTED])? {
        let waiting: i64 = r.get(1);
        if waiting > 0 {
            out.entry(r.get(0)).or_default().waiting = waiting;
        }
    }
    for r in tx.query(sql::QUEUE_TENANT_SHARES, &[])? {
        out.entry(r.get(0)).or_default().tenants.push(TenantShare {
            tenant: r.get(1),
            worker_us: r.get(2),
            messages: r.get(3),
            throttled_us: r.get(4),
            weight: r.get(5),
            waiting: r.get(6),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, worker_us: i64, weight: f64, waiting: bool) -> TenantShare {
        TenantShare {
            tenant: name.into(),
            worker_us,
            messages: 1,
            throttled_us: 0,
            weight,
            waiting,
        }
    }

    #[test]
    fn the_jain_index_is_one_for_equal_shares_and_falls_with_one_tenant_taking_all() {
        let even = StageShares {
            waiting: 4,
            tenants: (0..4)
                .map(|i| t(&format!("t{i}"), 1000, 1.0, true))
                .collect(),
        };
        assert!((even.jain().unwrap() - 1.0).abs() < 1e-12);
        // One of four got everything: 1/4.
        let hog = StageShares {
            waiting: 4,
            tenants: vec![t("a", 4000, 1.0, true)],
        };
        assert!((hog.jain().unwrap() - 0.25).abs() < 1e-12);
        // Weighted shares in their weights' proportion count as fair.
        let weighted = StageShares {
            waiting: 2,
            tenants: vec![t("a", 2000, 2.0, true), t("b", 1000, 1.0, true)],
        };
        assert!((weighted.jain().unwrap() - 1.0).abs() < 1e-12);
        // A tenant no longer waiting does not count; none waiting, no index.
        let gone = StageShares {
            waiting: 1,
            tenants: vec![t("a", 2000, 1.0, true), t("b", 9000, 1.0, false)],
        };
        assert!((gone.jain().unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(StageShares::default().jain(), None);
        assert_eq!(gone.worker_us(), 11_000);
    }
}
