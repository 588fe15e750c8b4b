//! `pepsi-stage-if` with a condition on recipients (`recipient-domain`): a message whose
//! recipients the condition holds for only in part is split at the stage, and each part
//! goes its own way, so mail for other domains never follows the matching recipients.

use postgres::Client;

use crate::util::Scenario;
use crate::util::worker::{Worker, code};
use crate::util::{claim, inject, row_at, stage};

/// `route` sends mail for `a.example` to `ta`, the rest to `tb` (fusion off, so each
/// part waits at its stage).
const STAGES: &str = "[stage-route]\nPROGRAM = {if}\nMATCH = recipient-domain is a.example\nNEXT = ta\nELSE_STAGE = tb\n\n\
                      [stage-ta]\nPROGRAM = {discard}\n\n\
                      [stage-tb]\nPROGRAM = {discard}\n";

/// Every row's stage, status and recipients, by id.
fn rows(c: &mut Client) -> Vec<(i64, String, String, Vec<String>)> {
    c.query(
        "SELECT workqueue_id, stage, status::text, rcpt_to FROM pepsi.workqueue ORDER BY 1",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

#[test]
fn a_recipient_condition_splits_the_message_by_the_recipients_it_holds_for() {
    let (s, mut c) = Scenario::new("if-split")
        .pepsi("ALLOW_FUSION = no\n")
        .stages(STAGES)
        .connect();
    let mixed = inject(
        &mut c,
        "route",
        "s@x.example",
        &["one@a.example", "two@b.example", "three@A.example"],
    );
    let all = inject(
        &mut c,
        "route",
        "s@x.example",
        &["four@a.example", "five@a.example"],
    );
    let none = inject(&mut c, "route", "s@x.example", &["six@c.example"]);
    claim(&mut c, &[mixed, all, none]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    for line in w.run(&[mixed, all, none]) {
        assert_eq!(code(&line), 0, "{line}");
    }
    // One message all one way, the other all the other: no split.
    assert_eq!(row_at(&mut c, all), Some(("ta".into(), "pending".into())));
    assert_eq!(row_at(&mut c, none), Some(("tb".into(), "pending".into())));
    // The mixed one: split at the stage, the matching recipients on the row.
    let after = rows(&mut c);
    let parts: Vec<_> = after
        .iter()
        .filter(|(id, ..)| *id != all && *id != none)
        .cloned()
        .collect();
    assert_eq!(parts.len(), 2, "{after:?}");
    assert_eq!(
        (parts[0].0, parts[0].1.as_str(), parts[0].2.as_str()),
        (mixed, "route", "pending")
    );
    assert_eq!(parts[0].3, ["one@a.example", "three@A.example"]);
    assert_eq!(
        (parts[1].1.as_str(), parts[1].2.as_str()),
        ("route", "pending")
    );
    assert_eq!(parts[1].3, ["two@b.example"]);
    // Each part then goes its own way, whole.
    let ids = [parts[0].0, parts[1].0];
    claim(&mut c, &ids);
    for line in w.run(&ids) {
        assert_eq!(code(&line), 0, "{line}");
    }
    assert_eq!(
        row_at(&mut c, ids[0]),
        Some(("ta".into(), "pending".into()))
    );
    assert_eq!(
        row_at(&mut c, ids[1]),
        Some(("tb".into(), "pending".into()))
    );
}

#[test]
fn a_recipient_condition_joined_with_and_is_judged_per_recipient_too() {
    // Neither recipient is in both domains: no recipient satisfies the whole MATCH.
    let (s, mut c) = Scenario::new("if-split-and")
        .pepsi("ALLOW_FUSION = no\n")
        .stages(&STAGES.replace(
            "MATCH = recipient-domain is a.example",
            "MATCH = recipient-domain is a.example and recipient-domain is b.example",
        ))
        .connect();
    let id = inject(
        &mut c,
        "route",
        "s@x.example",
        &["one@a.example", "two@b.example"],
    );
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    assert_eq!(row_at(&mut c, id), Some(("tb".into(), "pending".into())));
    assert_eq!(rows(&mut c).len(), 1, "not split");
}

#[test]
fn ten_thousand_recipients_split_in_one_pass_each_part_whole() {
    let (s, mut c) = Scenario::new("if-split-many")
        .pepsi("ALLOW_FUSION = no\n")
        .stages(STAGES)
        .connect();
    let to: Vec<String> = (0..10_000)
        .map(|i| format!("r{i}@{}.example", if i % 2 == 0 { "a" } else { "b" }))
        .collect();
    let refs: Vec<&str> = to.iter().map(String::as_str).collect();
    let id = inject(&mut c, "route", "s@x.example", &refs);
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    let parts = rows(&mut c);
    assert_eq!(parts.len(), 2, "one split");
    let (kept, other) = (&parts[0], &parts[1]);
    assert_eq!(kept.0, id);
    assert_eq!(kept.3.len(), 5_000);
    assert!(kept.3.iter().all(|r| r.ends_with("@a.example")));
    assert_eq!(other.3.len(), 5_000);
    assert!(other.3.iter().all(|r| r.ends_with("@b.example")));
    let ids = [kept.0, other.0];
    claim(&mut c, &ids);
    for line in w.run(&ids) {
        assert_eq!(code(&line), 0, "{line}");
    }
    assert_eq!(
        row_at(&mut c, ids[0]),
        Some(("ta".into(), "pending".into()))
    );
    assert_eq!(
        row_at(&mut c, ids[1]),
        Some(("tb".into(), "pending".into()))
    );
}
