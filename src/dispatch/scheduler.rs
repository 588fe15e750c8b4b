//! Which rows fill a stage's free capacity: the claim policy's vocabulary — the
//! [`ClaimPolicy`] trait, the [`ClaimRequest`] (with the fair claim's
//! [`FairRequest`]) and what a claim served — and the plain [`OldestFirst`] policy.
//! Pure (no I/O), and it uses no other file of the dispatcher but the claim record.
//!
//! The claim side computes each stage's free capacity and asks the policy for a
//! [`ClaimRequest`]; the coordinator turns the request into its one statement. The
//! policy hears about every claim statement's answer (where each stage's sender window
//! ended, how many senders each stage served) and every claimed row's life (claimed,
//! ran for so long, requeued without running, killed at MAX_RUNTIME) from the claim
//! ledger (`ledger.rs`), so a policy that charges senders for worker time (the fair
//! policy of `fair.rs`, §7) plugs in without reshaping the loop. The ledger
//! builds the policy the configuration asks for; `FAIR_SCHEDULING = no` keeps
//! [`OldestFirst`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::shares::Share;

/// One row of `pepsi.fair_weights`: pattern, weight, rate (messages a second).
pub type WeightRow = (String, f64, Option<f64>);

/// One claim statement's worth of work.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimRequest {
    /// Per stage, its oldest pending rows up to the capacity (`FAIR_SCHEDULING = no`).
    Oldest(Vec<(String, i32)>),
    /// The fair claim between senders (§7): `sql::CLAIM_FAIR`'s parameters.
    Fair(Box<FairRequest>),
}

impl ClaimRequest {
    /// The capacity asked per stage.
    pub fn asked(&self) -> &[(String, i32)] {
        match self {
            ClaimRequest::Oldest(asked) => asked,
            ClaimRequest::Fair(fair) => &fair.asked,
        }
    }
}

/// The parameters of one fair claim statement (`sql::CLAIM_FAIR`), stage arrays
/// parallel to `asked`, lead arrays parallel to each other.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FairRequest {
    /// Per stage, the free capacity (`$1` stages, `$2` caps).
    pub asked: Vec<(String, i32)>,
    /// `$3`: of each cap, the slots for the stage's oldest rows regardless of sender.
    pub fifo: Vec<i32>,
    /// `$4`: the stage's average worker time per message, µs, > 0.
    pub avg_us: Vec<f64>,
    /// `$5`: the sender window starts after this sender (`None`: from the first).
    pub cursor: Vec<Option<String>>,
    /// `$6`: the stage of each known lead.
    pub lead_stage: Vec<String>,
    /// `$7`: its sender.
    pub lead_sender: Vec<String>,
    /// `$8`: its lead, µs. Senders without a lead are left out: the statement sets them
    /// level with the least-served waiting sender of their tenant.
    pub lead_us: Vec<f64>,
    /// `$13`: its weight among its tenant's senders (`pepsi.fair_weights`).
    pub lead_w: Vec<f64>,
    /// `$14`–`$17`: the known tenant leads: stage, tenant, lead in µs, weight.
    pub tlead_stage: Vec<String>,
    pub tlead_tenant: Vec<String>,
    pub tlead_us: Vec<f64>,
    pub tlead_w: Vec<f64>,
    /// `$18`–`$20`: where each tenant's walk of its senders starts: stage, tenant, the
    /// sender after which it starts.
    pub tcur_stage: Vec<String>,
    pub tcur_tenant: Vec<String>,
    pub tcur_sender: Vec<String>,
    /// `$21`: per stage, the most rows a tenant not listed below may take (its burst
    /// at the stage's `RATE`; `None`: no limit).
    pub allow_default: Vec<Option<i32>>,
    /// `$22`–`$24`: the tenants held to a rate whose bucket is not full: stage, tenant
    /// and the rows it may take now (0: throttled).
    pub allow_stage: Vec<String>,
    pub allow_tenant: Vec<String>,
    pub allow_n: Vec<i32>,
}

/// Where one window of a fair claim ended (`sql::CLAIM_FAIR`'s rows without an id):
/// a stage's window of tenants (`tenant` `None`) or one tenant's walk of its senders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// The stage.
    pub stage: String,
    /// The tenant whose senders were walked; `None` for the stage's tenants.
    pub tenant: Option<String>,
    /// The last one considered when the window was full, where the next claim starts
    /// after; `None`: it reached the last one, the next claim starts over.
    pub end: Option<String>,
}

/// What one claim statement gave one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Rows claimed.
    pub rows: usize,
    /// Distinct senders among them.
    pub senders: usize,
}

/// Per stage, the rows a claim statement took and how many distinct senders they
/// came from. Pure.
pub fn served(claims: &[Claim]) -> BTreeMap<&str, Served> {
    let mut senders: BTreeMap<&str, (usize, BTreeSet<&str>)> = BTreeMap::new();
    for c in claims {
        let entry = senders.entry(c.stage.as_str()).or_default();
        entry.0 += 1;
        entry.1.insert(c.sender_key.as_str());
    }
    senders
        .into_iter()
        .map(|(stage, (rows, keys))| {
            (
                stage,
                Served {
                    rows,
                    senders: keys.len(),
                },
            )
        })
        .collect()
}

/// A claim policy.
pub trait ClaimPolicy: Send {
    /// The claim for these free capacities (stages with none are left out).
    fn request(&mut self, capacities: Vec<(String, i32)>) -> ClaimRequest;
    /// A claim statement answered, before its rows are reported one by one to
    /// [`claimed`](ClaimPolicy::claimed): where its windows ended (fair claims only,
    /// empty otherwise), and per stage the rows taken and from how many senders.
    fn answered(&mut self, _windows: &[Window], _served: &BTreeMap<&str, Served>) {}
    /// The weights and rates of `pepsi.fair_weights`, read at start and at every
    /// reload.
    fn weights(&mut self, _weights: Vec<WeightRow>) {}
    /// The stages' `RATE`s (messages a second), at start and at every reload. False
    /// when the policy holds no rates (the caller warns that they are ignored).
    fn rates(&mut self, _rates: Vec<(String, f64)>) -> bool {
        false
    }
    /// When a tenant held back by a rate may take a row again: a claim is due then.
    fn release_at(&self, _now: Instant) -> Option<Instant> {
        None
    }
    /// What each tenant got at each stage over the last minute (fair claims only).
    fn shares(&mut self, _now: Instant) -> Vec<Share> {
        Vec::new()
    }
    /// A row was claimed.
    fn claimed(&mut self, _claim: &Claim) {}
    /// A claimed row ran for `took`, from the head of its worker's queue to its status.
    fn ran(&mut self, _claim: &Claim, _took: Duration) {}
    /// A claimed row went back to pending without having run.
    fn requeued(&mut self, _claim: &Claim) {}
    /// A row was killed at MAX_RUNTIME.
    fn timed_out(&mut self, _claim: &Claim) {}
}

/// The plain oldest-first claim.
#[derive(Debug, Default)]
pub struct OldestFirst;

impl ClaimPolicy for OldestFirst {
    fn request(&mut self, capacities: Vec<(String, i32)>) -> ClaimRequest {
        ClaimRequest::Oldest(capacities)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_first_asks_exactly_the_capacities() {
        let mut p = OldestFirst;
        let caps = vec![("a".to_string(), 4), ("b".to_string(), 16)];
        let r = p.request(caps.clone());
        assert_eq!(r, ClaimRequest::Oldest(caps.clone()));
        assert_eq!(r.asked(), &caps[..]);
    }

    #[test]
    fn served_counts_rows_and_distinct_senders_per_stage() {
        let claim = |id, stage: &str, sender: &str| Claim {
            id,
            stage: stage.into(),
            sender_key: sender.into(),
            tenant_key: String::new(),
            token: 1,
            claimed_at: Instant::now(),
        };
        let claims = [
            claim(1, "a", "ip:1"),
            claim(2, "a", "ip:1"),
            claim(3, "a", "ip:2"),
            claim(4, "b", "ip:1"),
        ];
        let s = served(&claims);
        assert_eq!(
            s["a"],
            Served {
                rows: 3,
                senders: 2
            }
        );
        assert_eq!(
            s["b"],
            Served {
                rows: 1,
                senders: 1
            }
        );
        assert!(served(&[]).is_empty());
    }
}
