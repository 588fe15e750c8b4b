//! Which rows fill a stage's free capacity: the claim policy, pure (no I/O).
//!
//! The loop computes each stage's free capacity and asks the policy for a
//! [`ClaimRequest`]; the coordinator turns the request into its one statement. The
//! policy hears about every claimed row's life (claimed, ran for so long, requeued
//! without running, killed at MAX_RUNTIME) from the claim [`Ledger`](super::ledger::Ledger) so a policy that charges senders for worker
//! time (SPEC §7) plugs in here without reshaping the loop.

use std::time::Duration;

use super::ledger::Claim;
use crate::config::DispatchOptions;

/// One claim statement's worth of work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimRequest {
    /// Per stage, its oldest pending rows up to the capacity (`FAIR_SCHEDULING = no`).
    Oldest(Vec<(String, i32)>),
}

impl ClaimRequest {
    /// The capacity asked per stage.
    pub fn asked(&self) -> &[(String, i32)] {
        match self {
            ClaimRequest::Oldest(asked) => asked,
        }
    }
}

/// A claim policy.
pub trait ClaimPolicy: Send {
    /// The claim for these free capacities (stages with none are left out).
    fn request(&mut self, capacities: Vec<(String, i32)>) -> ClaimRequest;
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

/// The policy the configuration asks for.
pub fn from_options(opts: &DispatchOptions) -> Box<dyn ClaimPolicy> {
    if opts.fair_scheduling {
        log::warn!(
            "FAIR_SCHEDULING = yes: fair claims between senders are not available in this release; claiming oldest first"
        );
    }
    Box::new(OldestFirst)
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
}
