//! Which rows fill a stage's free capacity: the claim policy, pure (no I/O).
//!
//! The loop computes each stage's free capacity and asks the policy for a
//! [`ClaimRequest`]; the coordinator turns the request into its one statement. The
//! policy hears about every claim statement's answer (where each stage's sender window
//! ended, how many senders each stage served) and every claimed row's life (claimed,
//! ran for so long, requeued without running, killed at MAX_RUNTIME) from the claim
//! [`Ledger`](super::ledger::Ledger), so a policy that charges senders for worker time
//! ([`FairPolicy`](super::fair::FairPolicy), SPEC §7) plugs in here without reshaping
//! the loop. `FAIR_SCHEDULING = no` keeps [`OldestFirst`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::fair::{FairPolicy, FairRequest};
use super::ledger::Claim;
use crate::config::DispatchOptions;

/// One claim statement's worth of work.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimRequest {
    /// Per stage, its oldest pending rows up to the capacity (`FAIR_SCHEDULING = no`).
    Oldest(Vec<(String, i32)>),
    /// The fair claim between senders (§7): `sql::CLAIM_FAIR`'s parameters.
    Fair(FairRequest),
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
    /// [`claimed`](ClaimPolicy::claimed): per stage asked, the last sender of a full
    /// sender window (`None`: the window reached the last waiting sender; fair claims
    /// only, empty otherwise), and per stage the rows taken and from how many senders.
    fn answered(
        &mut self,
        _windows: &[(String, Option<String>)],
        _served: &BTreeMap<&str, Served>,
    ) {
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

/// The policy the configuration asks for: fair between senders unless
/// `FAIR_SCHEDULING = no`.
pub fn from_options(opts: &DispatchOptions) -> Box<dyn ClaimPolicy> {
    if opts.fair_scheduling {
        Box::new(FairPolicy::new(opts))
    } else {
        Box::new(OldestFirst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::time::Instant;

    fn options(text: &str) -> DispatchOptions {
        let path = PathBuf::from("/t.conf");
        let sections = crate::config::raw::parse(&path, text).expect("parses");
        crate::config::Config::from_sections(path, sections)
            .expect("valid")
            .dispatch
    }

    #[test]
    fn oldest_first_asks_exactly_the_capacities() {
        let mut p = OldestFirst;
        let caps = vec![("a".to_string(), 4), ("b".to_string(), 16)];
        let r = p.request(caps.clone());
        assert_eq!(r, ClaimRequest::Oldest(caps.clone()));
        assert_eq!(r.asked(), &caps[..]);
    }

    #[test]
    fn fair_scheduling_no_claims_oldest_first_and_yes_claims_fair() {
        let caps = vec![("a".to_string(), 4)];
        let mut off = from_options(&options("[pepsi-dispatch]\nFAIR_SCHEDULING = no\n"));
        assert_eq!(
            off.request(caps.clone()),
            ClaimRequest::Oldest(caps.clone())
        );
        let mut on = from_options(&options(""));
        let r = on.request(caps.clone());
        assert!(matches!(r, ClaimRequest::Fair(_)), "{r:?}");
        assert_eq!(r.asked(), &caps[..]);
    }

    #[test]
    fn served_counts_rows_and_distinct_senders_per_stage() {
        let claim = |id, stage: &str, sender: &str| Claim {
            id,
            stage: stage.into(),
            sender_key: sender.into(),
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
