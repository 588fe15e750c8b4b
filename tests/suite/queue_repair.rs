//! `pepsi-queue resume`, `hold`, `release`, `delete` and `requeue`
//! (`src/queue/repair.rs`): what each may change, what it reports, one NOTIFY per
//! command, and held rows left alone by a running dispatcher.

use std::time::Duration;

use crate::util::notify::notified;
use crate::util::queue::{STAGES, both, expect, json, listener, os, queue, queue_in, set_status};
use crate::util::rows::count;
use crate::util::{
    Scenario, assert_has, claim, inject, row_at, state_of, stderr, stdout, wait_until,
};

#[test]
fn each_repair_command_changes_what_it_may_reports_the_rest_and_notifies_once() {
    let (sc, mut c) = Scenario::new("q-repair").stages(STAGES).connect();
    let mut l = listener(&sc.db);
    let ids: Vec<i64> = (0..5)
        .map(|_| inject(&mut c, "in", "a@x.example", &["r@y.example"]))
        .collect();
    let [a, b, r, f, p] = ids[..] else { panic!() };
    notified(&mut l, &mut c);
    claim(&mut c, &[r]);
    set_status(&mut c, f, "failed");
    set_status(&mut c, p, "paused");
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{\"strikes\": 3, \"failure_class\": \"crashed\", \
         \"last_error\": \"x\"}', hops = 7 WHERE workqueue_id = $1",
        &[&f],
    )
    .unwrap();
    let s = |id: i64| id.to_string();

    // hold: pending, paused and failed rows; the running one and an unknown id are
    // reported; the others changed anyway, with one NOTIFY.
    let out = queue(
        &sc.conf,
        &["hold", &s(a), &s(f), &s(p), &s(r), "999999", "--json"],
    );
    expect(&out, 65);
    let j = json(&out);
    assert_eq!(j["changed"], 3);
    assert_eq!(j["ids"], serde_json::json!([a, f, p]));
    assert_eq!(j["not_found"], serde_json::json!([999999]));
    assert_eq!(
        j["not_eligible"],
        serde_json::json!([{"id": r, "status": "running"}])
    );
    assert!(stderr(&out).contains("is running: it belongs to a worker"));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    for id in [a, f, p] {
        assert_eq!(row_at(&mut c, id).unwrap().1, "held");
    }
    assert_eq!(row_at(&mut c, r).unwrap().1, "running");
    let held: Option<String> = c
        .query_one(
            "SELECT timeout::text FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&p],
        )
        .unwrap()
        .get(0);
    assert_eq!(held, None, "a held row has no retry time");
    assert_eq!(state_of(&mut c, p)["held_from"], "paused");

    // Only a running row left alone: 69, nothing notified.
    let out = queue(&sc.conf, &["hold", &s(r), &s(a)]);
    expect(&out, 69);
    assert!(stderr(&out).contains(&format!("message {a}: is already held")));
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());

    // release: held rows back to pending, started afresh.
    let out = queue(&sc.conf, &["release", &s(f), &s(b)]);
    expect(&out, 69);
    assert!(stdout(&out).contains(&format!("released 1 message: {f}")));
    assert!(stderr(&out).contains(&format!("message {b}: is pending, not held")));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, f).unwrap().1, "pending");
    assert_eq!(state_of(&mut c, f), serde_json::json!({"last_error": "x"}));
    let hops: i32 = c
        .query_one(
            "SELECT hops FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&f],
        )
        .unwrap()
        .get(0);
    assert_eq!(hops, 0);

    // requeue: to a configured stage only; a held row moves too, the running one not.
    let out = queue(&sc.conf, &["requeue", "--stage", "nowhere", &s(b)]);
    expect(&out, 65);
    assert!(stderr(&out).contains("no [stage-nowhere] section"));
    let out = queue(&sc.conf, &["requeue", "--stage", "relay", &s(b), &s(p)]);
    expect(&out, 0);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(
        row_at(&mut c, p).unwrap(),
        ("relay".to_string(), "pending".to_string())
    );
    assert_eq!(row_at(&mut c, b).unwrap().0, "relay");

    // resume by ids: paused, failed, timeout only.
    set_status(&mut c, b, "timeout");
    // What a stage left when the message failed: a resumed message starts afresh, so a
    // later failure reports its own status, and a verdict is not taken again.
    c.execute(
        "UPDATE pepsi.workqueue SET state = state || '{\"dsn_status\": \"5.1.1\", \
         \"dsn_diagnostic\": \"smtp; 550 5.1.1 gone\", \"recipient_outcomes\": {}, \
         \"list_copy\": true}' WHERE workqueue_id = $1",
        &[&b],
    )
    .unwrap();
    let out = queue(&sc.conf, &["resume", &s(b), &s(a)]);
    expect(&out, 69);
    assert!(stderr(&out).contains(&format!("message {a}: is held; release it instead")));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, b).unwrap().1, "pending");
    let resumed = state_of(&mut c, b);
    for key in ["dsn_status", "dsn_diagnostic", "recipient_outcomes"] {
        assert!(resumed.get(key).is_none(), "{key} cleared: {resumed}");
    }
    assert_eq!(resumed["list_copy"], true, "the message's own keys stay");

    // resume by stage and status.
    set_status(&mut c, b, "failed");
    set_status(&mut c, p, "paused");
    let out = queue(
        &sc.conf,
        &["resume", "--stage", "relay", "--status", "failed", "--json"],
    );
    expect(&out, 0);
    assert_eq!(json(&out)["changed"], 1);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, p).unwrap().1, "paused");
    let out = queue(&sc.conf, &["resume", "--all"]);
    expect(&out, 0);
    assert!(stdout(&out).contains("resumed 1 message"), "{}", both(&out));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    let out = queue(&sc.conf, &["resume", "--all"]);
    expect(&out, 0);
    assert_eq!(
        notified(&mut l, &mut c),
        Vec::<String>::new(),
        "nothing changed, nothing notified"
    );

    // delete: the body goes with the row; a running row stays. Ids from stdin.
    let bodies = count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body");
    let out = queue_in(
        &sc.conf,
        &os(&["delete", "-"]),
        format!("{a}\n{b} {r}\n").as_bytes(),
    );
    expect(&out, 69);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, a), None);
    assert_eq!(row_at(&mut c, b), None);
    assert_eq!(row_at(&mut c, r).unwrap().1, "running");
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body"),
        bodies - 2
    );
    let out = queue(&sc.conf, &["delete", &s(a)]);
    expect(&out, 65);
    assert!(stderr(&out).contains(&format!("message {a}: no such message")));

    // Usage errors.
    for args in [
        &["hold"][..],
        &["hold", "x"],
        &["requeue", &s(p)],
        &["resume"],
        &["resume", "--status", "held"],
        &["release", &s(p), "-v"],
    ] {
        expect(&queue(&sc.conf, args), 64);
    }
    let out = queue(&sc.conf, &["resume", "--status", "held"]);
    assert_has!(
        stderr(&out),
        "held messages are not taken here",
        "{}",
        both(&out)
    );
    assert_has!(stderr(&out), "pepsi-queue release", "{}", both(&out));
    // A stage without a section is not a stage with nothing to resume.
    let out = queue(&sc.conf, &["resume", "--stage", "nosuch"]);
    expect(&out, 65);
    assert_has!(stderr(&out), "no [stage-nosuch] section", "{}", both(&out));
}

#[test]
fn held_rows_are_neither_claimed_nor_flipped_nor_bounced_nor_reset() {
    let (s, mut c) = Scenario::new("q-held")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n")
        .connect();
    let held = inject(&mut c, "a", "h@x.example", &["r@y.example"]);
    let held_paused = inject(&mut c, "a", "h@x.example", &["r@y.example"]);
    set_status(&mut c, held_paused, "paused");
    expect(
        &queue(
            &s.conf,
            &["hold", &held.to_string(), &held_paused.to_string()],
        ),
        0,
    );
    // Even a retry time long past does not make the paused clock flip a held row.
    c.execute(
        "UPDATE pepsi.workqueue SET timeout = now() - interval '1 hour' WHERE workqueue_id = $1",
        &[&held_paused],
    )
    .unwrap();
    // The failure bouncer's move takes failed and timeout rows only.
    let moved = count(
        &mut c,
        "SELECT count(*) FROM pepsi.workqueue_bounce_failed('b', \
         ARRAY['failed', 'timeout']::pepsi.workqueue_status[], 100)",
    );
    assert_eq!(moved, 0);

    // The dispatcher starts (resetting running rows), claims and flips around them.
    let mut d = s.start();
    let flowing = inject(&mut c, "a", "f@x.example", &["r@y.example"]);
    // Paused before its injection commits, so the dispatcher first sees it paused.
    let mut tx = c.transaction().unwrap();
    let due: i64 = tx
        .query_one(
            "SELECT pepsi.workqueue_inject('a', 'f@x.example', ARRAY['r@y.example'], NULL, NULL)",
            &[],
        )
        .unwrap()
        .get(0);
    tx.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() - interval '1 second' \
         WHERE workqueue_id = $1",
        &[&due],
    )
    .unwrap();
    tx.commit().unwrap();
    wait_until(
        Duration::from_secs(30),
        "the other messages went through",
        || row_at(&mut c, flowing).is_none() && row_at(&mut c, due).is_none(),
    );
    // One more pass of the loop after the flip, to be sure.
    let last = inject(&mut c, "a", "f@x.example", &["r@y.example"]);
    wait_until(
        Duration::from_secs(30),
        "one more message went through",
        || row_at(&mut c, last).is_none(),
    );
    assert_eq!(row_at(&mut c, held).unwrap(), ("a".into(), "held".into()));
    assert_eq!(
        row_at(&mut c, held_paused).unwrap(),
        ("a".into(), "held".into())
    );

    // Released, they go through at once (the release notifies the dispatcher).
    expect(
        &queue(
            &s.conf,
            &["release", &held.to_string(), &held_paused.to_string()],
        ),
        0,
    );
    wait_until(
        Duration::from_secs(30),
        "the released messages went through",
        || row_at(&mut c, held).is_none() && row_at(&mut c, held_paused).is_none(),
    );
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
}
