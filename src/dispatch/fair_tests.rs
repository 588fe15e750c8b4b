//! The fair policy's tests (`fair.rs`): charges, corrections and refunds of senders
//! and tenants, weights, decay, the FIFO credit and the windows' cursors, each rule
//! against `now` given. A file of its own to keep `fair.rs` readable. Test code only.

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
        tenant_key: String::new(),
        token: 7,
        claimed_at: Instant::now(),
    }
}

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

fn win(stage: &str, end: Option<&str>) -> Window {
    Window {
        stage: stage.into(),
        tenant: None,
        end: end.map(str::to_string),
    }
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
    p.answered_at(&[win("a", Some("ip:m")), win("b", None)], &none);
    assert_eq!(
        p.request_at(ask.clone(), t).cursor,
        vec![Some("ip:m".into()), None]
    );
    // The window moves on, then wraps to the start.
    p.answered_at(&[win("a", Some("ip:z"))], &none);
    assert_eq!(p.request_at(ask.clone(), t).cursor[0], Some("ip:z".into()));
    p.answered_at(&[win("a", None)], &none);
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

fn tclaim(id: i64, sender: &str, tenant: &str) -> Claim {
    Claim {
        tenant_key: tenant.into(),
        ..claim(id, "s", sender)
    }
}

/// The known tenant leads of stage `s` with their weights.
fn tenant_leads(p: &mut FairPolicy, now: Instant) -> BTreeMap<String, (f64, f64)> {
    let r = p.request_at(vec![("s".to_string(), 1)], now);
    let pairs = r.tlead_us.into_iter().zip(r.tlead_w);
    r.tlead_tenant.into_iter().zip(pairs).collect()
}

#[test]
fn a_claim_charges_its_tenant_and_its_sender_each_divided_by_its_weight() {
    let mut p = policy();
    p.set_weights(vec![
        ("domain:paying.example".into(), 2.0, None),
        ("from:slow.*".into(), 0.5, None),
    ]);
    let t = Instant::now();
    p.claimed_at(
        &tclaim(1, "from:a.paying.example", "domain:paying.example"),
        t,
    );
    p.claimed_at(
        &tclaim(2, "from:slow.free.example", "domain:free.example"),
        t,
    );
    let tl = tenant_leads(&mut p, t);
    assert_eq!(tl["domain:paying.example"], (AVG_START_US / 2.0, 2.0));
    assert_eq!(tl["domain:free.example"], (AVG_START_US, 1.0));
    let r = p.request_at(vec![("s".to_string(), 1)], t);
    let sl: BTreeMap<_, _> = r
        .lead_sender
        .iter()
        .zip(r.lead_us.iter().zip(&r.lead_w))
        .collect();
    assert_eq!(
        sl[&"from:slow.free.example".to_string()],
        (&(AVG_START_US * 2.0), &0.5)
    );
    // The weights change; the live claims settle with the weights they were charged.
    p.set_weights(Vec::new());
    p.ran_at(
        &tclaim(1, "from:a.paying.example", "domain:paying.example"),
        us(3_000),
        t,
    );
    p.requeued_at(
        &tclaim(2, "from:slow.free.example", "domain:free.example"),
        t,
    );
    let tl = tenant_leads(&mut p, t);
    assert_eq!(tl["domain:paying.example"], (1_500.0, 1.0));
    assert!(!tl.contains_key("domain:free.example"), "{tl:?}");
    assert!(p.charges.is_empty());
}

#[test]
fn a_new_sender_starts_level_with_the_least_served_sender_of_its_own_tenant() {
    let mut p = policy();
    let t = Instant::now();
    for id in 0..5 {
        p.claimed_at(&tclaim(id, "from:x.big.example", "domain:big.example"), t);
    }
    p.claimed_at(
        &tclaim(10, "from:z.other.example", "domain:other.example"),
        t,
    );
    // Level with x (5 ms), less half a message; z, of another tenant, does not count.
    p.claimed_at(&tclaim(11, "from:y.big.example", "domain:big.example"), t);
    let s = &p.stages["s"].senders;
    assert_eq!(s["from:y.big.example"].lead, 5_000.0 - 500.0 + 1_000.0);
    assert_eq!(s["from:z.other.example"].lead, 1_000.0);
    // The tenant's lead counts all six of its claims.
    assert_eq!(p.stages["s"].tenants["domain:big.example"].lead, 6_000.0);
}

#[test]
fn each_tenants_sender_cursor_follows_its_walk_and_goes_with_the_tenant() {
    let mut p = policy();
    let t = Instant::now();
    p.claimed_at(&tclaim(1, "from:s1.big.example", "domain:big.example"), t);
    let tw = |tenant: &str, end: Option<&str>| Window {
        stage: "s".into(),
        tenant: Some(tenant.into()),
        end: end.map(str::to_string),
    };
    let none = BTreeMap::new();
    p.answered_at(
        &[
            win("s", None),
            tw("domain:big.example", Some("from:s37.big.example")),
        ],
        &none,
    );
    let r = p.request_at(vec![("s".to_string(), 4)], t);
    assert_eq!(r.tcur_tenant, ["domain:big.example"]);
    assert_eq!(r.tcur_sender, ["from:s37.big.example"]);
    assert_eq!(r.tcur_stage, ["s"]);
    // A walk that reached its last sender starts over next time.
    p.answered_at(&[tw("domain:big.example", None)], &none);
    assert!(
        p.request_at(vec![("s".to_string(), 4)], t)
            .tcur_tenant
            .is_empty()
    );
    // A cursor of a tenant the stage forgot goes at the sweep.
    p.answered_at(
        &[tw("domain:big.example", Some("from:s9.big.example"))],
        &none,
    );
    p.requeued_at(&tclaim(1, "from:s1.big.example", "domain:big.example"), t);
    assert!(
        p.request_at(vec![("s".to_string(), 4)], t)
            .tcur_tenant
            .is_empty()
    );
}
