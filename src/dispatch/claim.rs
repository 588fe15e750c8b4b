//! The claim record (§6 "Claim tokens"): one row taken by one claim statement, and why
//! a claim can be struck. Vocabulary only, shared by every file that handles claims;
//! it uses no other file of the dispatcher.
//!
//! A [`Claim`] is created by the coordinator from a row the claim statement returned and
//! travels unchanged through the loop: the stage's claimed queue, a worker's slot, and
//! back to the coordinator in a requeue, strike or deferral, whose write it guards with
//! its token.

use std::time::Instant;

/// One row taken by one claim statement, end to end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// `workqueue_id`.
    pub id: i64,
    /// The stage it was claimed at; every write of the claim is guarded by it.
    pub stage: String,
    /// Its fairness key (§7).
    pub sender_key: String,
    /// The tenant its sender belongs to (§7), `pepsi.workqueue.tenant_key`.
    pub tenant_key: String,
    /// The claim token stamped on the row; every write of the claim is guarded by it.
    pub token: i64,
    /// When the claim's answer reached the loop.
    pub claimed_at: Instant,
}

/// Why a claim was struck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrikeKind {
    /// Its worker crashed (or spoke garbage) while it was at the front.
    Crashed,
    /// It was unanswered for MAX_RUNTIME at the front of its worker's queue.
    TimedOut,
}

impl StrikeKind {
    /// The `failure_class` a third strike records.
    pub fn class(self) -> &'static str {
        match self {
            StrikeKind::Crashed => "crashed",
            StrikeKind::TimedOut => "timed-out",
        }
    }
}
