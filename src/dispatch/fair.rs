//! Fair scheduling between tenants and senders (§7), the dispatcher's half: per stage,
//! each tenant's and each sender's **lead** in microseconds of worker time divided by
//! its weight (`weights.rs`), the stage's average time per message, the credit of slots
//! kept for the oldest rows, the cursor of the tenant window and each tenant's cursor
//! of its senders — and from them each claim's [`FairRequest`]. The ranking itself
//! (tenant lead + j × average / weight across tenants, sender lead + k × average /
//! weight within one, newcomers level with the least-served, the FIFO reserve, the
//! 64-tenant window) is done by `pepsi.workqueue_claim_fair` in the claim statement.
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
use super::rates::Rates;
use super::scheduler::{ClaimPolicy, ClaimRequest, FairRequest, Served, Window};
use super::shares::{Share, Shares};
use super::weights::{WeightRow, Weights};
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

/// One sender, or one tenant, at one stage.
#[derive(Clone, Debug)]
struct Sender {
    /// Worker time charged, µs (divided by the weight), decayed up to `at`; 0 once
    /// forgotten.
    lead: f64,
    /// A sender's tenant (empty for a tenant).
    tenant: String,
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
    /// Tenants with a lead or an unsettled claim.
    tenants: HashMap<String, Sender>,
    /// Per tenant whose last walk of its senders stopped short, where the next starts.
    tenant_cursors: HashMap<String, String>,
    /// FIFO slots owed, in hundredths.
    fifo_credit: u64,
    /// Where the next tenant window starts.
    cursor: Option<String>,
    /// What the request in flight gave the stage.
    given: Option<Given>,
    /// When a claim last asked for the stage.
    last_request: Option<Instant>,
}

impl Stage {
    fn new() -> Stage {
        Stage {
            avg: AVG_START_US,
            measured: false,
            senders: HashMap::new(),
            tenants: HashMap::new(),
            tenant_cursors: HashMap::new(),
            fifo_credit: 0,
            cursor: None,
            given: None,
            last_request: None,
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

    /// Decays every sender and tenant to `now`, dropping those with nothing left, and
    /// the cursors of tenants gone.
    fn sweep(&mut self, half_life: f64, now: Instant) {
        let avg = self.avg;
        self.senders
            .retain(|_, s| !Stage::decay(s, avg, half_life, now));
        self.tenants
            .retain(|_, s| !Stage::decay(s, avg, half_life, now));
        let tenants = &self.tenants;
        self.tenant_cursors.retain(|t, _| tenants.contains_key(t));
    }

    /// Applies a charge's correction to its sender and its tenant (see [`adjust`]).
    fn settle(&mut self, claim: &Claim, c: &Charge, by_us: f64, half_life: f64, now: Instant) {
        let avg = self.avg;
        let sender = by_us / c.sender_w;
        adjust(
            &mut self.senders,
            &claim.sender_key,
            sender,
            (avg, half_life),
            now,
        );
        let tenant = by_us / c.tenant_w;
        adjust(
            &mut self.tenants,
            &claim.tenant_key,
            tenant,
            (avg, half_life),
            now,
        );
    }
}

/// Applies `delta` µs to the lead of `key` in `map` (never below 0) at `now`, ending one
/// of its claims; drops it when nothing is left.
fn adjust(
    map: &mut HashMap<String, Sender>,
    key: &str,
    delta: f64,
    (avg, half_life): (f64, f64),
    now: Instant,
) {
    let Some(sender) = map.get_mut(key) else {
        return;
    };
    Stage::decay(sender, avg, half_life, now);
    sender.lead = (sender.lead + delta).max(0.0);
    sender.unsettled = sender.unsettled.saturating_sub(1);
    if sender.lead == 0.0 && sender.unsettled == 0 {
        map.remove(key);
    }
}

/// Charges `charge` µs (already divided by the weight) to `key` in `map` at `now`: a
/// newcomer starts level with the least-served of `map` with the same `tenant` (a
/// sender: of its tenant's senders; a tenant, whose `tenant` is empty: of the tenants),
/// less half a message (`avg`), as the claim statement ranked it.
fn charge(
    map: &mut HashMap<String, Sender>,
    (key, tenant): (&str, &str),
    charge: f64,
    (avg, half_life): (f64, f64),
    now: Instant,
) {
    if !map.contains_key(key) {
        let least = map
            .values()
            .filter(|s| s.tenant == tenant && s.lead > 0.0)
            .map(|s| s.lead)
            .fold(f64::INFINITY, f64::min);
        let level = if least.is_finite() {
            (least - avg / 2.0).max(0.0)
        } else {
            0.0
        };
        map.insert(
            key.to_string(),
            Sender {
                lead: level,
                tenant: tenant.to_string(),
                at: now,
                unsettled: 0,
                charged: now,
            },
        );
    }
    let sender = map.get_mut(key).expect("present");
    Stage::decay(sender, avg, half_life, now);
    sender.lead += charge;
    sender.unsettled += 1;
    sender.charged = now;
}

/// What a live claim was charged: the stage's average, and the weights its sender and
/// tenant had then (a reload between the claim and its end changes neither).
#[derive(Clone, Copy, Debug)]
struct Charge {
    avg: f64,
    sender_w: f64,
    tenant_w: f64,
    /// It took a cell of its tenant's rate at the stage (given back if it goes back
    /// without having run).
    rated: bool,
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
    charges: HashMap<(i64, i64), Charge>,
    /// `pepsi.fair_weights`, as of the last start or reload.
    weights: Weights,
    /// The rates' buckets (`rates.rs`).
    rates: Rates,
    /// What each tenant got over the last minute (`shares.rs`).
    shares: Shares,
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
            weights: Weights::default(),
            rates: Rates::default(),
            shares: Shares::new(Instant::now()),
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
            self.rates.sweep(now);
            self.next_sweep = Some(now + Duration::from_secs_f64(half_life));
        }
        let mut r = FairRequest::default();
        for (name, cap) in &capacities {
            let stage = self.stages.entry(name.clone()).or_insert_with(Stage::new);
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
                r.lead_w.push(self.weights.of(key));
            }
            for (key, tenant) in stage.tenants.iter().filter(|(_, s)| s.lead > 0.0) {
                r.tlead_stage.push(name.clone());
                r.tlead_tenant.push(key.clone());
                r.tlead_us.push(tenant.lead);
                r.tlead_w.push(self.weights.of(key));
            }
            for (tenant, sender) in &stage.tenant_cursors {
                r.tcur_stage.push(name.clone());
                r.tcur_tenant.push(tenant.clone());
                r.tcur_sender.push(sender.clone());
            }
            let (default, listed) = self.rates.allowances(name, now);
            r.allow_default.push(default);
            // Held back since this stage's last claim, at most a second of it.
            let held = stage
                .last_request
                .replace(now)
                .map_or(Duration::ZERO, |t| now.saturating_duration_since(t))
                .min(Duration::from_secs(1));
            for (tenant, n) in listed {
                if n == 0 {
                    self.shares.throttled(name, &tenant, held, now);
                }
                r.allow_stage.push(name.clone());
                r.allow_tenant.push(tenant);
                r.allow_n.push(n);
            }
        }
        r.asked = capacities;
        r
    }

    pub fn answered_at(&mut self, windows: &[Window], served: &BTreeMap<&str, Served>) {
        for w in windows {
            let stage = self.stage(&w.stage);
            if let Some(tenant) = &w.tenant {
                match &w.end {
                    Some(end) => stage.tenant_cursors.insert(tenant.clone(), end.clone()),
                    None => stage.tenant_cursors.remove(tenant),
                };
                continue;
            }
            let given = stage.given.take();
            let from = given.as_ref().and_then(|g| g.from.clone());
            stage.cursor = w.end.clone();
            let s = served.get(w.stage.as_str()).copied().unwrap_or_default();
            if (s.rows == 0 && w.end.is_none()) || !log::log_enabled!(log::Level::Debug) {
                continue;
            }
            let (cap, fifo) = given.map_or((0, 0), |g| (g.cap, g.fifo));
            let start = from.map_or("from the first tenant".to_string(), |f| {
                format!("after {f:?}")
            });
            let stop = w
                .end
                .as_ref()
                .map_or("through the last waiting tenant".to_string(), |e| {
                    format!("through {e:?}; more tenants wait, the next claim starts there")
                });
            log::debug!(
                "{}: fair claim: {} of {cap} slots ({fifo} kept for the oldest rows) to {} senders; tenant window {start} {stop}",
                w.stage,
                s.rows,
                s.senders,
            );
        }
    }

    /// Takes the weights and rates read from `pepsi.fair_weights`; live claims keep
    /// the weights they were charged with.
    pub fn set_weights(&mut self, rows: Vec<WeightRow>) {
        self.weights = Weights::new(rows);
    }

    /// Takes the stages' `RATE`s.
    pub fn set_rates(&mut self, rates: Vec<(String, f64)>) {
        self.rates.set_stage_rates(rates);
    }

    pub fn claimed_at(&mut self, claim: &Claim, now: Instant) {
        if self.charges.contains_key(&(claim.id, claim.token)) {
            return;
        }
        let half_life = self.half_life;
        let sender_w = self.weights.of(&claim.sender_key);
        let tenant_w = self.weights.of(&claim.tenant_key);
        let tenant_rate = self.weights.rate_of(&claim.tenant_key);
        let rate = self.rates.effective(&claim.stage, tenant_rate);
        if let Some(rate) = rate {
            self.rates.took(&claim.stage, &claim.tenant_key, rate, now);
        }
        let stage = self.stage(&claim.stage);
        let avg = stage.avg;
        let tenant = (claim.tenant_key.as_str(), "");
        charge(
            &mut stage.tenants,
            tenant,
            avg / tenant_w,
            (avg, half_life),
            now,
        );
        let sender = (claim.sender_key.as_str(), claim.tenant_key.as_str());
        charge(
            &mut stage.senders,
            sender,
            avg / sender_w,
            (avg, half_life),
            now,
        );
        let c = Charge {
            avg,
            sender_w,
            tenant_w,
            rated: rate.is_some(),
        };
        self.charges.insert((claim.id, claim.token), c);
    }

    pub fn ran_at(&mut self, claim: &Claim, took: Duration, now: Instant) {
        let Some(c) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let took_us = took.as_secs_f64() * 1e6;
        let half_life = self.half_life;
        self.shares.ran(&claim.stage, &claim.tenant_key, took, now);
        let stage = self.stage(&claim.stage);
        stage.settle(claim, &c, took_us - c.avg, half_life, now);
        stage.measure(took_us);
    }

    pub fn requeued_at(&mut self, claim: &Claim, now: Instant) {
        let Some(c) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let half_life = self.half_life;
        if c.rated {
            self.rates.gave_back(&claim.stage, &claim.tenant_key, now);
        }
        self.stage(&claim.stage)
            .settle(claim, &c, -c.avg, half_life, now);
    }

    pub fn timed_out_at(&mut self, claim: &Claim, now: Instant) {
        let Some(c) = self.charges.remove(&(claim.id, claim.token)) else {
            return;
        };
        let (half_life, max) = (self.half_life, self.max_runtime_us);
        self.stage(&claim.stage)
            .settle(claim, &c, max - c.avg, half_life, now);
    }
}

impl ClaimPolicy for FairPolicy {
    fn request(&mut self, capacities: Vec<(String, i32)>) -> ClaimRequest {
        ClaimRequest::Fair(Box::new(self.request_at(capacities, Instant::now())))
    }

    fn answered(&mut self, windows: &[Window], served: &BTreeMap<&str, Served>) {
        self.answered_at(windows, served);
    }

    fn weights(&mut self, weights: Vec<WeightRow>) {
        self.set_weights(weights);
    }

    fn rates(&mut self, rates: Vec<(String, f64)>) -> bool {
        self.set_rates(rates);
        true
    }

    fn release_at(&self, now: Instant) -> Option<Instant> {
        self.rates.release_at(now)
    }

    fn shares(&mut self, now: Instant) -> Vec<Share> {
        let weights = &mut self.weights;
        self.shares.snapshot(now, |tenant| weights.of(tenant))
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
#[path = "fair_tests.rs"]
mod tests;
