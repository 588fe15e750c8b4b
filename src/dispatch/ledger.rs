//! The claim ledger: the one place where a claimed row's life is accounted for, and the
//! statistics not yet flushed. It is owned by the claim side of the loop
//! ([`super::claim_side`]); the claim, worker and shutdown handlers call its verbs, the
//! housekeeping takes its deltas for a flush and hands back a failed one's. It builds
//! the claim policy the configuration asks for and feeds it; it reads and writes
//! nothing else.
//!
//! The [`Ledger`] applies each transition of a claim exactly once — claimed (with how
//! many distinct senders each stage served, §7), started
//! (reached the head of a worker's queue), ran (a status line, with the measured time),
//! requeued without running, deferred (74), struck (crash or hang), or dropped (reset by
//! the coordinator at a lock loss or at shutdown) — to the statistics and to the
//! [`ClaimPolicy`], so a policy that charges senders for worker time (§7) sees every
//! charge, correction and refund once. A transition for a claim the ledger does not
//! hold (already settled, or from an earlier claim of the same row) changes nothing.
//! The ledger does no I/O; the loop calls it from its handlers. It owns the claim
//! floors (`floors.rs`) too: a claim that settles may have put its row back to
//! pending, so each settled claim lowers them.

use std::collections::HashMap;
use std::time::Duration;

use super::claim::{Claim, StrikeKind};
use super::fair::FairPolicy;
use super::floors::{FULL_PICK_EVERY, Floors, full_every};
use super::scheduler::{ClaimPolicy, OldestFirst, Window, served};
use super::stats::{self, Deltas};
use crate::config::DispatchOptions;
use crate::protocol::{Report, StageEvent};

/// The transition of a claim its worker's pass settles ([`Ledger::ran`]).
const PASS: &str = "a pass";
/// Where a live claim is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Claimed, not yet at the head of a worker's queue.
    Claimed,
    /// At the head of a worker's queue.
    Started,
}

/// A REPORT checked against the stage graph (see [`vet_report`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vetted {
    /// The stages to count, with their (clamped) microseconds, claimed stage first.
    pub stages: Vec<(String, u64)>,
    /// Stage names the REPORT gave that are not in the graph (ignored).
    pub unknown: Vec<String>,
    /// Some microseconds were beyond MAX_RUNTIME and were clamped.
    pub clamped: bool,
    /// The events to count: (stage, event, count), each of a stage counted here.
    pub events: Vec<(String, String, i64)>,
    /// Events left out: a name that is not an event name, of a stage not counted here,
    /// or a count beyond one line's; shown with [`Vetted::unknown`].
    pub refused_events: Vec<String>,
}

/// Checks a worker's REPORT: entries naming stages the graph does not have are left
/// out, microseconds are clamped to `max_us`; without a usable entry (no REPORT, an
/// unreadable one, only unknown stages) the pass counts at the claimed stage with the
/// time the dispatcher measured. Pure.
pub fn vet_report(
    (report, events): (&Report, &[StageEvent]),
    claimed: &str,
    measured: Duration,
    max_us: u64,
    known: impl Fn(&str) -> bool,
) -> Vetted {
    let mut vetted = Vetted::default();
    if let Report::Stages(list) = report {
        for (name, us) in list {
            if !known(name) {
                vetted.unknown.push(name.clone());
                continue;
            }
            if *us > max_us {
                vetted.clamped = true;
            }
            vetted.stages.push((name.clone(), (*us).min(max_us)));
        }
    }
    if vetted.stages.is_empty() {
        let us = u64::try_from(measured.as_micros()).unwrap_or(u64::MAX);
        vetted.stages.push((claimed.to_string(), us.min(max_us)));
    }
    for (stage, event, n) in events {
        let counted = vetted.stages.iter().any(|(s, _)| s == stage);
        if counted && stats::event_name_ok(event) && *n <= stats::MAX_EVENT_COUNT {
            vetted
                .events
                .push((stage.clone(), event.clone(), *n as i64));
        } else {
            vetted
                .refused_events
                .push(format!("{stage}:{}", crate::escape::Visible(event)));
        }
    }
    vetted
}

/// Counts microseconds into an `i64` counter without overflow.
fn micros(us: u64) -> i64 {
    i64::try_from(us).unwrap_or(i64::MAX)
}

/// The live claims and what their transitions add up to.
pub struct Ledger {
    /// Keyed by (id, token): one row can have two live claims at once — its worker's
    /// answer for one stage not yet read when the claim at the next stage arrives.
    live: HashMap<(i64, i64), Step>,
    /// Statistics not yet flushed.
    deltas: Deltas,
    policy: Box<dyn ClaimPolicy>,
    /// The claim floors: every claim that leaves the dispatcher's hands lowers them.
    floors: Floors,
}

impl Ledger {
    /// An empty ledger feeding `policy`.
    pub fn new(policy: Box<dyn ClaimPolicy>) -> Ledger {
        Ledger {
            live: HashMap::new(),
            deltas: Deltas::default(),
            policy,
            floors: Floors::new(FULL_PICK_EVERY),
        }
    }

    /// An empty ledger feeding the policy the configuration asks for: fair between
    /// senders (§7) unless `FAIR_SCHEDULING = no`, then oldest first.
    pub fn for_options(opts: &DispatchOptions) -> Ledger {
        let mut ledger = if opts.fair_scheduling {
            Ledger::new(Box::new(FairPolicy::new(opts)))
        } else {
            Ledger::new(Box::new(OldestFirst))
        };
        ledger.floors = Floors::new(full_every(opts.poll_interval));
        ledger
    }

    /// The claim floors, for a claim's start and answer and the wholesale resets.
    pub fn floors(&mut self) -> &mut Floors {
        &mut self.floors
    }

    /// The policy, to build a claim request.
    pub fn policy(&mut self) -> &mut dyn ClaimPolicy {
        self.policy.as_mut()
    }

    /// How many claims are live (claimed and not yet settled).
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Is this claim live?
    pub fn holds(&self, claim: &Claim) -> bool {
        self.live.contains_key(&(claim.id, claim.token))
    }

    /// Settles a claim: true when it was live (the transition applies).
    fn settle(&mut self, claim: &Claim, transition: &str) -> bool {
        match self.live.remove(&(claim.id, claim.token)) {
            Some(_) => {
                // A worker's pass leaves the row at a stage its section routes to; the
                // dispatcher's own writes (a requeue, a deferral, a strike, a reset)
                // leave it at its stage. No floor of those stays above it.
                if transition == PASS {
                    self.floors.passed(claim.id, &claim.stage);
                } else {
                    self.floors.released(claim.id);
                }
                true
            }
            None => {
                log::debug!(
                    "{}: message {} claim {}: {transition} of a claim already settled; ignored",
                    claim.stage,
                    claim.id,
                    claim.token
                );
                false
            }
        }
    }

    /// A claim statement took these rows (none: nothing to count, §10) and, for a fair
    /// claim, ended each stage's sender window there (`windows`). The policy hears the
    /// answer first, then each row.
    pub fn claimed(&mut self, claims: &[Claim], windows: &[Window]) {
        let served = served(claims);
        self.policy.answered(windows, &served);
        if claims.is_empty() {
            return;
        }
        self.deltas.claims = self.deltas.claims.saturating_add(1);
        self.deltas.rows_claimed = self.deltas.rows_claimed.saturating_add(claims.len() as i64);
        for (stage, s) in &served {
            let c = self.deltas.stage(stage);
            c.senders_served = c
                .senders_served
                .saturating_add(i64::try_from(s.senders).unwrap_or(i64::MAX));
        }
        for claim in claims {
            self.live.insert((claim.id, claim.token), Step::Claimed);
            self.policy.claimed(claim);
        }
    }

    /// The claim reached the head of its worker's queue: MAX_RUNTIME and the measured
    /// time count from here.
    pub fn started(&mut self, claim: &Claim) {
        if let Some(step) = self.live.get_mut(&(claim.id, claim.token)) {
            *step = Step::Started;
        }
    }

    /// Its worker answered with a status other than 74/75: one pass (the worker wrote
    /// the outcome). `failed` when the worker marked the row failed.
    pub fn ran(&mut self, claim: &Claim, took: Duration, vetted: &Vetted, failed: bool) {
        if !self.settle(claim, PASS) {
            return;
        }
        self.policy.ran(claim, took);
        self.deltas.stages_executed = self.deltas.stages_executed.saturating_add(1);
        for (i, (name, us)) in vetted.stages.iter().enumerate() {
            let c = self.deltas.stage(name);
            c.passes = c.passes.saturating_add(1);
            c.busy_us = c.busy_us.saturating_add(micros(*us));
            if i > 0 {
                c.fused_passes = c.fused_passes.saturating_add(1);
            }
        }
        if failed {
            let c = self.deltas.stage(&claim.stage);
            c.failures = c.failures.saturating_add(1);
        }
        for (stage, event, n) in &vetted.events {
            self.deltas.event(stage, event, *n);
        }
    }

    /// Claims put back to pending without having run (siblings of a death, a start
    /// failure, a 75, a stage that went away): refunded to their senders.
    pub fn requeued(&mut self, claims: &[Claim]) {
        for claim in claims {
            if self.settle(claim, "a requeue") {
                self.policy.requeued(claim);
                let c = self.deltas.stage(&claim.stage);
                c.requeues = c.requeues.saturating_add(1);
            }
        }
    }

    /// Its worker lost the database (74): nothing was committed; the row is paused for
    /// a retry, so the sender is refunded.
    pub fn deferred(&mut self, claim: &Claim) {
        if self.settle(claim, "a deferral") {
            self.policy.requeued(claim);
            let c = self.deltas.stage(&claim.stage);
            c.deferrals = c.deferrals.saturating_add(1);
        }
    }

    /// The claim's worker died with it at the front (`took` since it reached the head):
    /// a crash charges the measured time, a hang the whole MAX_RUNTIME.
    pub fn struck(&mut self, claim: &Claim, kind: StrikeKind, took: Duration) {
        if !self.settle(claim, "a strike") {
            return;
        }
        let c = self.deltas.stage(&claim.stage);
        match kind {
            StrikeKind::TimedOut => {
                c.timeouts = c.timeouts.saturating_add(1);
                self.policy.timed_out(claim);
            }
            StrikeKind::Crashed => {
                c.crashes = c.crashes.saturating_add(1);
                self.policy.ran(claim, took);
            }
        }
    }

    /// Claims whose rows the coordinator resets wholesale (a lock loss's reconcile, the
    /// shutdown reset): refunded, counted nowhere.
    pub fn dropped(&mut self, claims: &[Claim]) {
        for claim in claims {
            if self.settle(claim, "a reset") {
                self.policy.requeued(claim);
            }
        }
    }

    /// The statistics not yet flushed, taken for a flush; none when nothing was
    /// counted (no deltas, no write, §10).
    pub fn take_deltas(&mut self) -> Option<Deltas> {
        if self.deltas.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut self.deltas))
    }

    /// Deltas a failed flush handed back: kept for the next one.
    pub fn restore_deltas(&mut self, deltas: &Deltas) {
        self.deltas.merge(deltas);
    }

    /// A worker process was started.
    pub fn worker_started(&mut self) {
        self.deltas.worker_starts = self.deltas.worker_starts.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::scheduler::ClaimRequest;
    use std::time::Instant;

    fn claim(id: i64, token: i64) -> Claim {
        Claim {
            id,
            stage: "s".into(),
            sender_key: "from:x".into(),
            tenant_key: String::new(),
            token,
            claimed_at: Instant::now(),
        }
    }

    fn options(text: &str) -> DispatchOptions {
        let path = std::path::PathBuf::from("/t.conf");
        let sections = crate::config::raw::parse(&path, text).expect("parses");
        crate::config::Config::from_sections(path, sections)
            .expect("valid")
            .dispatch
    }

    #[test]
    fn fair_scheduling_no_claims_oldest_first_and_yes_claims_fair() {
        let caps = vec![("a".to_string(), 4)];
        let mut off = Ledger::for_options(&options("[pepsi-dispatch]\nFAIR_SCHEDULING = no\n"));
        assert_eq!(
            off.policy().request(caps.clone()),
            ClaimRequest::Oldest(caps.clone())
        );
        let mut on = Ledger::for_options(&options(""));
        let r = on.policy().request(caps.clone());
        assert!(matches!(r, ClaimRequest::Fair(_)), "{r:?}");
        assert_eq!(r.asked(), &caps[..]);
    }

    #[test]
    fn each_transition_applies_once() {
        let mut l = Ledger::new(Box::new(OldestFirst));
        let (a, b, c) = (claim(1, 7), claim(2, 7), claim(3, 7));
        l.claimed(&[a.clone(), b.clone(), c.clone()], &[]);
        assert_eq!(l.live(), 3);
        let v = vet_report(
            (&Report::Absent, &[]),
            "s",
            Duration::from_micros(40),
            1000,
            |_| true,
        );
        l.ran(&a, Duration::from_micros(40), &v, false);
        l.ran(&a, Duration::from_micros(40), &v, false);
        l.requeued(&[b.clone(), b.clone()]);
        l.struck(&c, StrikeKind::TimedOut, Duration::ZERO);
        l.requeued(std::slice::from_ref(&c));
        assert_eq!(l.live(), 0);
        let s = &l.deltas.stages["s"];
        assert_eq!((s.passes, s.requeues, s.timeouts, s.busy_us), (1, 1, 1, 40));
        assert_eq!((l.deltas.claims, l.deltas.rows_claimed), (1, 3));
        assert_eq!(l.deltas.stages_executed, 1);
    }

    #[test]
    fn senders_served_adds_the_distinct_senders_of_each_claim_per_stage() {
        let mut l = Ledger::new(Box::new(OldestFirst));
        let of = |id, sender: &str| Claim {
            sender_key: sender.into(),
            tenant_key: String::new(),
            ..claim(id, 1)
        };
        l.claimed(&[of(1, "ip:a"), of(2, "ip:a"), of(3, "ip:b")], &[]);
        l.claimed(&[of(4, "ip:a")], &[]);
        l.claimed(&[], &[]);
        assert_eq!(l.deltas.stages["s"].senders_served, 3);
        assert_eq!((l.deltas.claims, l.deltas.rows_claimed), (2, 4));
    }

    #[test]
    fn a_transition_of_another_claim_of_the_same_row_changes_nothing() {
        let mut l = Ledger::new(Box::new(OldestFirst));
        l.claimed(&[claim(1, 8)], &[]);
        let before = l.deltas.clone();
        l.requeued(&[claim(1, 7)]);
        assert!(l.holds(&claim(1, 8)));
        assert_eq!(l.deltas, before);
    }

    #[test]
    fn a_row_claimed_at_its_next_stage_before_its_answer_was_read_counts_both_passes() {
        let mut l = Ledger::new(Box::new(OldestFirst));
        let v = Vetted {
            stages: vec![("s".into(), 1)],
            ..Vetted::default()
        };
        l.claimed(&[claim(1, 7)], &[]);
        // The worker advanced the row and the next claim took it at once.
        l.claimed(&[claim(1, 8)], &[]);
        l.ran(&claim(1, 7), Duration::ZERO, &v, false);
        l.ran(&claim(1, 8), Duration::ZERO, &v, false);
        assert_eq!(l.deltas.stages["s"].passes, 2);
        assert_eq!(l.live(), 0);
    }

    #[test]
    fn a_report_is_vetted_against_the_graph_and_clamped() {
        let report = Report::Stages(vec![
            ("s".into(), 1u64 << 62),
            ("nosuch".into(), 5),
            ("t".into(), 10),
        ]);
        let v = vet_report((&report, &[]), "s", Duration::from_micros(3), 1_000, |n| {
            n != "nosuch"
        });
        assert_eq!(v.stages, vec![("s".into(), 1_000), ("t".into(), 10)]);
        assert_eq!(v.unknown, vec!["nosuch".to_string()]);
        assert!(v.clamped);
        // Only unknown stages: the pass counts at the claimed stage, measured.
        let only = Report::Stages(vec![("nosuch".into(), 5)]);
        let v = vet_report((&only, &[]), "s", Duration::from_micros(3), 1_000, |n| {
            n == "s"
        });
        assert_eq!(v.stages, vec![("s".into(), 3)]);
        let v = vet_report(
            (&Report::Unreadable("x".into()), &[]),
            "s",
            Duration::from_secs(99),
            1_000,
            |_| true,
        );
        assert_eq!(v.stages, vec![("s".into(), 1_000)]);
    }

    #[test]
    fn events_of_counted_stages_with_good_names_are_counted_and_the_rest_refused() {
        let report = Report::Stages(vec![("s".into(), 5), ("t".into(), 7)]);
        let events: Vec<StageEvent> = vec![
            ("s".into(), "tls-verified".into(), 1),
            ("t".into(), "tlsv1.3".into(), 2),
            ("nosuch".into(), "x".into(), 1),
            ("s".into(), "Bad Name\n".into(), 1),
            ("s".into(), "huge".into(), stats::MAX_EVENT_COUNT + 1),
        ];
        let v = vet_report((&report, &events), "s", Duration::ZERO, 1_000, |_| true);
        assert_eq!(
            v.events,
            vec![
                ("s".into(), "tls-verified".into(), 1),
                ("t".into(), "tlsv1.3".into(), 2)
            ]
        );
        assert_eq!(v.refused_events, ["nosuch:x", "s:Bad Name\\n", "s:huge"]);
        let mut l = Ledger::new(Box::new(OldestFirst));
        let a = claim(1, 7);
        l.claimed(std::slice::from_ref(&a), &[]);
        l.ran(&a, Duration::ZERO, &v, false);
        assert_eq!(l.deltas.events[&("s".into(), "tls-verified".into())], 1);
        // A stage keeps at most MAX_EVENTS_PER_STAGE names between flushes.
        let mut d = Deltas::default();
        for i in 0..stats::MAX_EVENTS_PER_STAGE {
            assert!(d.event("s", &format!("e{i}"), 1));
        }
        assert!(!d.event("s", "one-more", 1));
        assert!(d.event("s", "e0", 1), "a name it has still counts");
        assert!(d.event("t", "one-more", 1), "another stage has its own");
    }

    #[test]
    fn counters_saturate() {
        let mut l = Ledger::new(Box::new(OldestFirst));
        let v = Vetted {
            stages: vec![("s".into(), u64::MAX)],
            ..Vetted::default()
        };
        for n in 0..2 {
            l.claimed(&[claim(n, 1)], &[]);
            l.ran(&claim(n, 1), Duration::ZERO, &v, false);
        }
        assert_eq!(l.deltas.stages["s"].busy_us, i64::MAX);
    }
}
