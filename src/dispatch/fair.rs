//! Fair scheduling between senders (§7), the dispatcher's half: per stage, each
//! sender's **lead** in microseconds of worker time, the stage's average time per
//! message, the credit of slots kept for the oldest rows and the cursor of the sender
//! window — and from them each claim's [`FairRequest`]. The ranking itself (lead + k ×
//! average, newcomers level with the least-served waiting sender, the FIFO reserve, the
//! 64-sender window) is done by `pepsi.workqueue_claim_fair` in the claim statement.
//!
//! [`FairPolicy`] is a [`ClaimPolicy`]: the claim ledger tells it each claimed row's
//! life exactly once (charged the stage's average when claimed, corrected to the
//! measured time when it ran, refunded when it went back without running, charged the
//! whole MAX_RUNTIME when killed), and the claim side asks it, through the ledger, for
//! each claim's request. It does no I/O, touches no state but its own, and reads no
//! clock of its own beyond `Instant::now()` in the trait methods: every rule is an
//! inherent method taking `now`, unit-tested here.
//!
//! Memory is bounded: a lead halves every `FAIR_HALF_LIFE`, a lead worth less than
//! one message is forgotten, and a sender with no lead and nothing claimed unsettled is
//! dropped; what each live claim was charged is kept only until it settles. A restart
//! forgets everything (harmless: every sender starts level).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::claim::Claim;
use super::scheduler::{ClaimPolicy, ClaimRequest, FairRequest, Served};
use crate::config::DispatchOptions;

/// A stage's average time per message before its first measurement: a guess, replaced
/// by the first measured time. Any positive value works; 1 ms is the order of a
/// metadata-only stage, so the first claims charge about right for the common case.
const AVG_START_US: f64 = 1_000.0;
/// The weight of a new measurement in the stage's average. 1/16 averages over the last
/// few dozen messages: it follows a stage whose cost changes within a few claims' worth
/// of messages, yet one slow message moves the charge of the next claims by little.
const AVG_WEIGHT: f64 = 1.0 / 16.0;
/// A measurement counts as at most this many averages, so one outlier (a crash after
/// minutes) cannot make every later charge huge; a real change in the stage's cost
/// still moves the average by 7/16 per message, about 13 messages for a factor 100.
const AVG_OUTLIER: f64 = 8.0;
/// The average never goes below one microsecond: the claim statement divides by it
/// and requires it positive, and a stage of zero-time messages must not drive it to 0.
const AVG_MIN_US: f64 = 1.0;
/// FIFO credit is counted in hundredths of a slot so `cap × percent / 100` accumulates
/// exactly (ten claims of 0.1 slot make exactly one slot).
const CREDIT_PER_SLOT: u64 = 100;

/// One sender at one stage.
#[derive(Clone, Debug)]
struct Sender {
    /// Worker time charged, µs, decayed up to `at`; 0 once forgotten.
    lead: f64,
    /// When `lead` was last decayed.
    at: Instant,
    /// Claimed rows not yet settled (their charges are in `lead`).
    unsettled: u32,
    /// When it was last charged for a claim.
    charged: Instant,
}

/// What the last request gave a stage, for the debug line of its answer.
#[derive(Clone, Debug)]
struct Given {
    cap: i32,
    fifo: i32,
    from: Option<String>,
}

/// One stage's fairness state.
#[derive(Clone, Debug)]
struct Stage {
    /// Average worker time per message, µs, always ≥ [`AVG_MIN_US`].
    avg: f64,
    /// `avg` is still the start value.
    measured: bool,
    /// Senders with a lead or an unsettled claim.
    senders: HashMap<String, Sender>,
    /// FIFO slots owed, in hundredths.
    fifo_credit: u64,
    /// Where the next sender window starts.
    cursor: Option<String>,
    /// What the request in flight gave the stage.
    given: Option<Given>,
}

impl Stage {
    fn new() -> Stage {
        Stage {
            avg: AVG_START_US,
            measured: false,
            senders: HashMap::new(),
            fifo_credit: 0,
            cursor: None,
            given: None,
        }
    }

    /// Takes a measured time into the average.
    fn measure(&mut self, took_us: f64) {
        let sample = took_us.max(AVG_MIN_US);
        self.avg = if self.measured {
            let sample = sample.min(self.avg * AVG_OUTLIER);
            self.avg + (sample - self.avg) * AVG_WEIGHT
        } else {
            sample
        }
        .max(AVG_MIN_US);
        self.measured = true;
    }

    /// This claim's FIFO slots for a cap: the credit grows by `cap × percent / 100`
    /// and gives its whole slots, at most the cap.
    fn fifo(&mut self, cap: i32, percent: u32) -> i32 {
        let cap = u64::try_from(cap).unwrap_or(0);
        self.fifo_credit = self
            .fifo_credit
            .saturating_add(cap.saturating_mul(u64::from(percent)));
        let slots = (self.fifo_credit / CREDIT_PER_SLOT).min(cap);
        self.fifo_credit -= slots * CREDIT_PER_SLOT;
        i32::try_from(slots).unwrap_or(i32::MAX)
    }

    /// Decays a sender's lead to `now` and forgets it when it has decayed away: worth
    /// less than one message with no charge for a half-life. (A sender served all the
    /// time holds about a message of lead between its claims; forgetting that at once
    /// would make it level with every newcomer claim after claim, and the tie goes to
    /// its older rows.) True when the sender can be dropped (no lead, nothing unsettled).
    fn decay(sender: &mut Sender, avg: f64, half_life: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(sender.at).as_secs_f64();
        if elapsed > 0.0 {
            sender.lead *= (-elapsed / half_life).exp2();
            sender.at = now;
        }
        let idle = now.saturating_duration_since(sender.charged).as_secs_f64();
        if sender.lead < avg && idle >= half_life {
            sender.lead = 0.0;
        }
        sender.lead == 0.0 && sender.unsettled == 0
    }

    /// Decays every sender to `now`, dropping those with nothing left.
    fn sweep(&mut self, half_life: f64, now: Instant) {
        let avg = self.avg;
        self.senders
            .retain(|_, s| !Stage::decay(s, avg, half_life, now));
    }

    /// Applies `delta` µs to a sender's lead (never below 0) at `now`; `settled` when
    /// this ends one of its claims.
    fn adjust(&mut self, key: &str, delta: f64, settled: bool, half_life: f64, now: Instant) {
        let avg = self.avg;
        let Some(sender) = self.senders.get_mut(key) else {
            return;
        };
        Stage::decay(sender, avg, half_life, now);
        sender.lead = (sender.lead + delta).max(0.0);
        if settled {
            sender.unsettled = sender.unsettled.saturating_sub(1);
        }
        if sender.lead == 0.0 && sender.unsettled == 0 {
            self.senders.remove(key);
        }
    }
}

/// The fair claim policy (§7).
#[derive(Debug)]
pub struct FairPolicy {
    /// `FAIR_HALF_LIFE`, seconds.
    half_life: f64,
    /// `FAIR_FIFO_PERCENT`.
    fifo_percent: u32,
    /// `MAX_RUNTIME`, µs: what a timed-out row is charged.
    max_runtime_us: f64,
    stages: BTreeMap<String, Stage>,
    /// What each live claim, by (id, token), was charged; removed when it settles.
    charges: HashMap<(i64, i64), f64>,
    /// When every stage's senders are next swept (asked stages are swept at every
    /// claim; this catches stages that were not asked for a while, or went away).
    next_sweep: Option<Instant>,
}

impl FairPolicy {
    /// A policy with no leads, from `[pepsi-dispatch]`.
    pub fn new(opts: &DispatchOptions) -> FairPolicy {
        FairPolicy::with(
            opts.fair_half_life,
            opts.fair_fifo_percent,
            opts.max_runtime,
        )
    }

    /// A policy with no leads.
    pub fn with(half_life: Duration, fifo_percent: u32, max_runtime: Duration) -> FairPolicy {
        FairPolicy {
            // A zero half-life is refused by the configuration; never divide by 0.
            half_life: half_life.as_secs_f64().max(1e-6),
            fifo_percent: fifo_percent.min(100),
            max_runtime_us: max_runtime.as_secs_f64() * 1e6,
            stages: BTreeMap::new(),
            charges: HashMap::new(),
            next_sweep: None,
        }
    }

    fn stage(&mut self, name: &str) -> &mut Stage {
        if !self.stages.contains_key(name) {
            self.stages.insert(name.to_string(), Stage::new());
        }
        self.stages.get_mut(name).expect("just inserted")
    }

    /// The request for these free capacities at `now`.
    pub fn request_at(&mut self, capacities: Vec<(String, i32)>, now: Instant) -> FairRequest {
        let (half_life, percent) = (self.half_life, self.fifo_percent);
        if self.next_sweep.is_none_or(|t| t <= now) {
            for stage in self.stages.values_mut() {
                stage.sweep(half_life, now);
            }
            self.next_sweep = Some(now + Duration::from_secs_f64(half_life));
        }
        let mut r = FairRequest::default();
        for (name, cap) in &capacities {
            let stage = self.stage(name);
            // Asked stages are swept at every claim: the leads passed are current, and
            // a forgotten lead is left out, so its sender starts level.
            stage.sweep(half_life, now);
            let fifo = stage.fifo(*cap, percent);
            stage.given = Some(Given {
                cap: *cap,
                fifo,
                from: stage.cursor.clone(),
            });
            r.fifo.push(fifo);
            r.avg_us.push(stage.avg);
            r.cursor.push(stage.cursor.clone());
            for (key, sender) in stage.senders.iter().filter(|(_, s)| s.lead > 0.0) {
                r.lead_stage.push(name.clone());
                r.lead_sender.push(key.clone());
                r.lead_us.push(sender.lead);
            }
        }
        r.asked = capacities;
        r
    }

    /// A claim statement answered: the cursors move to where each window ended.
    pub fn answered_at(
        &mut self,
        windows: &[(String, Option<String>)],
        served: &BTreeMap<&str, Served>,
    ) {
        for (name, end) in windows {
            let stage = self.stage(name);
            let given = stage.given.take();
            let from = given.as_ref().and_then(|g| g.from.clone());
            stage.cursor = end.clone();
            let s = served.get(name.as_str()).copied().unwrap_or_default();
            // Only stages that took rows or filled their window say anything, and the
            // line is built only when it is logged.
            if (s.rows == 0 && end.is_none()) || !log::log_enabled!(log::Level::Debug) {
                continue;
            }
            let (cap, fifo) = given.map_or((0, 0), |g| (g.cap, g.fifo));
            let start = from.map_or("from the first sender".to_string(), |f| {
                format!("after {f:?}")
            });
            let stop = end
                .as_ref()
                .map_or("through the last waiting sender".to_string(), |e| {
                    format!("through {e:?}; more senders wait, the next claim starts there")
                });
            log::debug!(
                "{name}: fair claim: {} of {cap} slots ({fifo} kept for the oldest rows) to {} senders; sender window {start} {stop}",
                s.rows,
                s.senders,
            );
        }
    }

    /// A row was claimed at `now`: its sender is charged the stage's average.
    pub fn claimed_at(&mut self, claim: &Claim, now: Instant) {
        if self.charges.contains_key(&(claim.id, claim.token)) {
            return;
        }
        let half_life = self.half_life;
        let stage = self.stage(&claim.stage);
        let charge = stage.avg;
        // A newcomer starts where the claim ranked it: level with the least-served
        // sender the stage knows, less half a message (see `sql::CLAIM_FAIR`).
        let least = stage
            .senders
            .values()
            .map(|s| s.lead)
            .filter(|&l| l > 0.0)
            .fold(f64::INFINITY, f64::min);
        let level = if least.is_finite() {
            (least - charge / 2.0).max(0.0)
        } else {
            0.0
        };
        let sender = stage
            .senders
            .entry(claim.sender_key.clone())
            .or_insert(Sender {
                lead: level,
                at: now,
                unsettled: 0,
                charged: now,
            });
        // Decay (and perhaps forget) what it had before adding the new charge.
        Stage::decay(sender, charge, half_life, now);
        sender.lead += charge;
        sender.unsettled += 1;
        sender.charged = now;
        self.charges.insert((claim.id, claim.token), charge);
    }

    /// A claimed row ran for `took`: its charge is corrected to the measured time,
    /// which also goes into the stage's average.
    pub fn ran_at(&mut self, claim: &Claim, took: Duration, now: Instant) {
        let Some(charge) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let took_us = took.as_secs_f64() * 1e6;
        let half_life = self.half_life;
        let stage = self.stage(&claim.stage);
        stage.adjust(&claim.sender_key, took_us - charge, true, half_life, now);
        stage.measure(took_us);
    }

    /// A claimed row went back to pending without running: its charge is refunded.
    pub fn requeued_at(&mut self, claim: &Claim, now: Instant) {
        let Some(charge) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let half_life = self.half_life;
        self.stage(&claim.stage)
            .adjust(&claim.sender_key, -charge, true, half_life, now);
    }

    /// A row was killed at MAX_RUNTIME: it is charged the whole of it. A hang says
    /// nothing about the stage's usual cost, so the average is left alone.
    pub fn timed_out_at(&mut self, claim: &Claim, now: Instant) {
        let Some(charge) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let (half_life, max) = (self.half_life, self.max_runtime_us);
        self.stage(&claim.stage)
            .adjust(&claim.sender_key, max - charge, true, half_life, now);
    }
}

impl ClaimPolicy for FairPolicy {
    fn request(&mut self, capacities: Vec<(String, i32)>) -> ClaimRequest {
        ClaimRequest::Fair(self.request_at(capacities, Instant::now()))
    }

    fn answered(&mut self, windows: &[(String, Option<String>)], served: &BTreeMap<&str, Served>) {
        self.answered_at(windows, served);
    }

    fn claimed(&mut self, claim: &Claim) {
        self.claimed_at(claim, Instant::now());
    }

    fn ran(&mut self, claim: &Claim, took: Duration) {
        self.ran_at(claim, took, Instant::now());
    }

    fn requeued(&mut self, claim: &Claim) {
        self.requeued_at(claim, Instant::now());
    }

    fn timed_out(&mut self, claim: &Claim) {
        self.timed_out_at(claim, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HALF: Duration = Duration::from_secs(60);

    fn policy() -> FairPolicy {
        FairPolicy::with(HALF, 10, Duration::from_secs(300))
    }

    fn claim(id: i64, stage: &str, sender: &str) -> Claim {
        Claim {
            id,
            stage: stage.into(),
            sender_key: sender.into(),
            token: 7,
            claimed_at: Instant::now(),
        }
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// The known leads of a stage, as the request passes them.
    fn leads(p: &mut FairPolicy, stage: &str, now: Instant) -> BTreeMap<String, f64> {
        let r = p.request_at(vec![(stage.to_string(), 1)], now);
        r.lead_sender.into_iter().zip(r.lead_us).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn a_claim_is_charged_the_average_then_corrected_refunded_or_charged_max_runtime() {
        let mut p = policy();
        let t = Instant::now();
        // Charged the start average (1 ms) at once.
        p.claimed_at(&claim(1, "s", "ip:a"), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], AVG_START_US);
        // Corrected to the measured 3 ms, which becomes the average.
        p.ran_at(&claim(1, "s", "ip:a"), us(3_000), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 3_000.0);
        assert_eq!(p.stages["s"].avg, 3_000.0);
        // Charged 3 ms, refunded when requeued without running.
        p.claimed_at(&claim(2, "s", "ip:a"), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 6_000.0);
        p.requeued_at(&claim(2, "s", "ip:a"), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 3_000.0);
        // A timed-out row is charged the whole MAX_RUNTIME; the average is untouched.
        p.claimed_at(&claim(3, "s", "ip:a"), t);
        p.timed_out_at(&claim(3, "s", "ip:a"), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 3_000.0 + 300e6);
        assert_eq!(p.stages["s"].avg, 3_000.0);
        // A settled claim settles once; nothing is left charged.
        p.ran_at(&claim(3, "s", "ip:a"), us(1), t);
        assert!(p.charges.is_empty());
        assert_eq!(p.stages["s"].senders["ip:a"].unsettled, 0);
    }

    #[test]
    fn a_message_cheaper_than_charged_lowers_the_lead_but_never_below_zero() {
        let mut p = policy();
        let t = Instant::now();
        for id in 0..4 {
            p.claimed_at(&claim(id, "s", "ip:a"), t);
        }
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 4_000.0);
        p.ran_at(&claim(0, "s", "ip:a"), us(500), t);
        assert_eq!(leads(&mut p, "s", t)["ip:a"], 3_500.0);
        // Refunds of charges that decayed meanwhile cannot make a lead negative.
        let later = t + HALF * 4;
        for id in 1..4 {
            p.requeued_at(&claim(id, "s", "ip:a"), later);
        }
        assert!(leads(&mut p, "s", later).is_empty());
        assert!(p.stages["s"].senders.is_empty());
    }

    #[test]
    fn leads_halve_every_half_life() {
        let mut p = policy();
        let t = Instant::now();
        p.claimed_at(&claim(1, "s", "ip:a"), t);
        p.ran_at(&claim(1, "s", "ip:a"), us(1_000), t);
        p.claimed_at(&claim(2, "s", "ip:a"), t);
        p.ran_at(&claim(2, "s", "ip:a"), us(15_000), t);
        // Lead 16 ms; the average is 1 ms + (8 ms − 1 ms)/16 (the outlier capped at 8×).
        assert_eq!(p.stages["s"].avg, 1_000.0 + 7_000.0 / 16.0);
        let lead = |p: &mut FairPolicy, at| leads(p, "s", at)["ip:a"];
        assert!(close(lead(&mut p, t), 16_000.0));
        assert!(close(lead(&mut p, t + HALF), 8_000.0));
        assert!(close(lead(&mut p, t + HALF * 2), 4_000.0));
        // Continuous: half a half-life is a factor √2.
        assert!(close(lead(&mut p, t + HALF * 5 / 2), 4_000.0 / 2f64.sqrt()));
    }

    #[test]
    fn a_lead_worth_less_than_one_message_is_forgotten_and_its_sender_dropped() {
        let mut p = policy();
        let t = Instant::now();
        p.claimed_at(&claim(1, "s", "ip:a"), t);
        p.ran_at(&claim(1, "s", "ip:a"), us(1_000), t);
        p.claimed_at(&claim(2, "s", "ip:a"), t);
        p.ran_at(&claim(2, "s", "ip:a"), us(1_000), t);
        // 2 ms of lead, 1 ms average: one half-life later it is worth exactly one
        // message, just after that less.
        assert!(leads(&mut p, "s", t + HALF).contains_key("ip:a"));
        assert!(leads(&mut p, "s", t + HALF + Duration::from_secs(1)).is_empty());
        assert!(p.stages["s"].senders.is_empty());
        // A message cheaper than the average leaves less than one message: kept while
        // its sender is being served, forgotten once it had no charge for a half-life,
        // so the sender starts level again.
        p.claimed_at(&claim(3, "s", "ip:b"), t);
        p.ran_at(&claim(3, "s", "ip:b"), us(100), t);
        assert!(leads(&mut p, "s", t).contains_key("ip:b"));
        let l = leads(&mut p, "s", t + HALF);
        assert!(!l.contains_key("ip:b"), "{l:?}");
        assert!(p.stages["s"].senders.is_empty());
    }

    #[test]
    fn a_sender_with_a_claim_unsettled_is_kept_even_when_its_lead_is_forgotten() {
        let mut p = policy();
        let t = Instant::now();
        // A first measurement makes the average 1 ms.
        p.claimed_at(&claim(9, "s", "ip:z"), t);
        p.ran_at(&claim(9, "s", "ip:z"), us(1_000), t);
        p.claimed_at(&claim(1, "s", "ip:a"), t);
        let much_later = t + HALF * 10;
        assert!(leads(&mut p, "s", much_later).is_empty(), "forgotten");
        assert_eq!(p.stages["s"].senders["ip:a"].unsettled, 1, "still held");
        // Its measured time lands on a lead of 0.
        p.ran_at(&claim(1, "s", "ip:a"), us(5_000), much_later);
        assert_eq!(leads(&mut p, "s", much_later)["ip:a"], 4_000.0);
    }

    #[test]
    fn memory_stays_bounded_by_the_senders_recently_served() {
        let mut p = policy();
        let t = Instant::now();
        // 10,000 senders of one message each at two stages, each message dearer than
        // the average so every sender keeps a lead at first.
        for id in 0..10_000 {
            for stage in ["a", "b"] {
                let c = claim(id, stage, &format!("ip:{id}"));
                p.claimed_at(&c, t);
                p.ran_at(&c, us(2_000), t);
            }
        }
        assert!(p.charges.is_empty());
        assert_eq!(p.stages["a"].senders.len(), 10_000);
        // A few half-lives later a claim asking only for stage a drops them at both
        // stages: stage b's senders go in the periodic sweep.
        let later = t + HALF * 8;
        p.request_at(vec![("a".into(), 4)], t);
        let r = p.request_at(vec![("a".into(), 4)], later);
        assert!(r.lead_us.is_empty());
        assert!(p.stages.values().all(|s| s.senders.is_empty()));
    }

    #[test]
    fn fifo_credit_with_cap_one_and_ten_percent_gives_one_slot_every_ten_claims() {
        let mut p = policy();
        let t = Instant::now();
        let fifo: Vec<i32> = (0..30)
            .map(|_| p.request_at(vec![("s".into(), 1)], t).fifo[0])
            .collect();
        let given: Vec<usize> = (0..30).filter(|&i| fifo[i] == 1).collect();
        assert_eq!(given, vec![9, 19, 29]);
        assert!(fifo.iter().all(|&f| f <= 1));
    }

    #[test]
    fn fifo_credit_gives_its_share_of_any_cap_and_never_more_than_the_cap() {
        let mut p = policy();
        let t = Instant::now();
        let total: i32 = (0..10)
            .map(|_| p.request_at(vec![("s".into(), 16)], t).fifo[0])
            .sum();
        assert_eq!(total, 16);
        let mut all = FairPolicy::with(HALF, 100, Duration::from_secs(300));
        assert_eq!(all.request_at(vec![("s".into(), 3)], t).fifo, vec![3]);
        let mut none = FairPolicy::with(HALF, 0, Duration::from_secs(300));
        assert_eq!(none.request_at(vec![("s".into(), 3)], t).fifo, vec![0]);
        // A big cap's credit then a small cap: never more slots than asked.
        let mut p = FairPolicy::with(HALF, 50, Duration::from_secs(300));
        assert_eq!(p.request_at(vec![("s".into(), 9)], t).fifo, vec![4]);
        assert_eq!(p.request_at(vec![("s".into(), 1)], t).fifo, vec![1]);
    }

    #[test]
    fn the_window_cursor_moves_to_where_each_claims_window_ended() {
        let mut p = policy();
        let t = Instant::now();
        let ask = vec![("a".to_string(), 2), ("b".to_string(), 2)];
        assert_eq!(p.request_at(ask.clone(), t).cursor, vec![None, None]);
        let none = BTreeMap::new();
        p.answered_at(
            &[("a".into(), Some("ip:m".into())), ("b".into(), None)],
            &none,
        );
        assert_eq!(
            p.request_at(ask.clone(), t).cursor,
            vec![Some("ip:m".into()), None]
        );
        // The window moves on, then wraps to the start.
        p.answered_at(&[("a".into(), Some("ip:z".into()))], &none);
        assert_eq!(p.request_at(ask.clone(), t).cursor[0], Some("ip:z".into()));
        p.answered_at(&[("a".into(), None)], &none);
        assert_eq!(p.request_at(ask, t).cursor, vec![None, None]);
    }

    #[test]
    fn the_request_carries_each_stage_and_only_the_leads_it_knows() {
        let mut p = policy();
        let t = Instant::now();
        p.claimed_at(&claim(1, "a", "ip:x"), t);
        p.ran_at(&claim(1, "a", "ip:x"), us(4_000), t);
        p.claimed_at(&claim(2, "a", "ip:x"), t);
        p.claimed_at(&claim(3, "a", "ip:y"), t);
        p.claimed_at(&claim(4, "c", "ip:x"), t);
        let r = p.request_at(vec![("a".into(), 8), ("b".into(), 1)], t);
        assert_eq!(r.asked, vec![("a".into(), 8), ("b".into(), 1)]);
        assert_eq!(r.fifo, vec![0, 0]);
        assert_eq!(r.avg_us, vec![4_000.0, AVG_START_US]);
        assert_eq!(r.cursor, vec![None, None]);
        let mut known: Vec<(String, String, f64)> = r
            .lead_stage
            .into_iter()
            .zip(r.lead_sender)
            .zip(r.lead_us)
            .map(|((s, k), l)| (s, k, l))
            .collect();
        known.sort_by(|x, y| x.1.cmp(&y.1));
        // Stage c was not asked: its lead is not sent. ip:y came new to a stage where
        // ip:x held 8 ms: level with it less half a message (6 ms), plus its charge.
        assert_eq!(
            known,
            vec![
                ("a".into(), "ip:x".into(), 8_000.0),
                ("a".into(), "ip:y".into(), 10_000.0),
            ]
        );
        // No capacity anywhere (a heartbeat): an empty request.
        assert_eq!(p.request_at(vec![], t), FairRequest::default());
    }

    #[test]
    fn the_average_follows_measurements_and_stays_positive() {
        let mut s = Stage::new();
        assert_eq!(s.avg, AVG_START_US);
        s.measure(0.0);
        assert_eq!(
            s.avg, AVG_MIN_US,
            "the first measurement replaces the guess"
        );
        for _ in 0..100_000 {
            s.measure(0.0);
        }
        assert_eq!(s.avg, AVG_MIN_US);
        let mut s = Stage::new();
        s.measure(1_600.0);
        s.measure(3_200.0);
        assert_eq!(s.avg, 1_700.0);
        // One outlier counts as eight averages at most.
        s.measure(1e12);
        assert_eq!(s.avg, 1_700.0 + 7.0 * 1_700.0 / 16.0);
    }

    #[test]
    fn through_the_trait_every_claim_settles() {
        let mut p = policy();
        let (a, b, c, d) = (
            claim(1, "s", "ip:a"),
            claim(2, "s", "ip:a"),
            claim(3, "s", "ip:b"),
            claim(4, "s", "ip:b"),
        );
        let policy: &mut dyn ClaimPolicy = &mut p;
        assert!(matches!(
            policy.request(vec![("s".into(), 4)]),
            ClaimRequest::Fair(_)
        ));
        for x in [&a, &b, &c, &d] {
            policy.claimed(x);
        }
        policy.ran(&a, us(10));
        policy.requeued(&b);
        policy.timed_out(&c);
        policy.requeued(&d);
        assert!(p.charges.is_empty());
        assert!(p.stages["s"].senders.values().all(|s| s.unsettled == 0));
    }
}
