//! The claim (`src/dispatch/claims.rs`, `scheduler.rs`, `statements.rs`): a paused
//! row retried on time, never more rows than the free capacity, the partial pending
//! index and no row read beyond those claimed, and advances that notify nobody.

use std::time::{Duration, Instant};

use super::fair_sql::nested_plans;
use crate::util::notify::{listen, notified};
use crate::util::rows::{count, inject_many, wait_empty};
use crate::util::{Scenario, TestDb, row_at, wait_until};

#[test]
fn a_paused_row_is_retried_at_its_due_time_not_at_the_next_heartbeat() {
    let (s, mut c) = Scenario::new("d-due")
        .timers("POLL_INTERVAL = 60s\nWORKER_IDLE_TIMEOUT = 60s")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    let mut d = s.start();
    d.wait_log("serving 2 stages", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(500));
    // A row paused by someone else, due in 3 s, inserted without a notification.
    let paused: i64 = c
        .query_one(
            "INSERT INTO pepsi.workqueue (stage, status, timeout, mail_from, rcpt_to) \
             VALUES ('s', 'paused', now() + interval '3 seconds', 'a@x.example', ARRAY['r@y.example']) RETURNING workqueue_id",
            &[],
        )
        .unwrap()
        .get(0);
    // A worker's report brings the dispatcher to a claim, which re-reads the due time.
    let other = inject_many(&mut c, "s", "a@x.example", 1)[0];
    wait_until(
        Duration::from_secs(10),
        "the other message completes",
        || row_at(&mut c, other).is_none(),
    );
    let due = Instant::now() + Duration::from_secs_f64(
        c.query_one("SELECT extract(epoch FROM timeout - now())::float8 FROM pepsi.workqueue WHERE workqueue_id = $1", &[&paused])
            .unwrap()
            .get::<_, f64>(0),
    );
    wait_until(Duration::from_secs(30), "the paused row completes", || {
        row_at(&mut c, paused).is_none()
    });
    // Retried about a second after its due time; the bound leaves a busy machine
    // several seconds and is still far below POLL_INTERVAL (60 s), when the heartbeat's
    // claim would have taken it anyway.
    let late = Instant::now().saturating_duration_since(due);
    assert!(
        late < Duration::from_secs(10),
        "retried {late:?} after its due time"
    );
    assert!(d.terminate().success());
}

#[test]
fn the_claim_never_takes_more_than_free_capacity_even_with_a_deep_backlog() {
    let (s, mut c) = Scenario::new("d-cap")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\nQUEUE_LIMIT = 3\n")
        .connect();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, state) \
         SELECT 's', 'a@x.example', ARRAY['r@y.example'], '{\"fault\": \"slow\"}' FROM generate_series(1, 5000)",
        &[],
    )
    .unwrap();
    let mut d = s.start();
    let running = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'";
    wait_until(Duration::from_secs(20), "the first claim", || {
        count(&mut c, running) > 0
    });
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        most = most.max(count(&mut c, running));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(most > 0, "the stage ran");
    assert!(
        most <= 6,
        "at most QUEUE_LIMIT × PARALLELISM = 6 rows running, saw {most}"
    );
    assert!(d.terminate().success());
}

#[test]
fn the_claim_uses_the_partial_pending_index() {
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, status, timeout, mail_from, rcpt_to) \
         SELECT CASE WHEN g % 10 = 0 THEN 'a' ELSE 'b' END, \
                CASE WHEN g % 3 = 0 THEN 'pending' ELSE 'paused' END::pepsi.workqueue_status, \
                CASE WHEN g % 3 = 0 THEN NULL ELSE now() + interval '1 hour' END, \
                'a@x.example', ARRAY['r@y.example'] FROM generate_series(1, 20000) g",
        &[],
    )
    .unwrap();
    let stages = vec!["a".to_string(), "b".to_string()];
    let caps = vec![4i32, 8];
    // Run: no step reads more rows than are claimed, with statistics that have not seen
    // the rows yet and with current ones (a join of the update with the picked ids was
    // once planned as a walk over every pending row).
    // The claim is a function (schema 13): its statements' plans are read through
    // auto_explain, rolled back.
    let call = |stages: &[String], caps: &[i32]| {
        format!(
            "BEGIN;\nSELECT * FROM pepsi.workqueue_claim_oldest('{{{}}}', '{{{}}}', NULL, 100);\nROLLBACK;\n",
            stages.join(","),
            caps.iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    let touches_only_the_claimed = |db: &TestDb, stages: &[String], caps: &[i32], when: &str| {
        let most: i64 = caps.iter().map(|&n| i64::from(n)).sum();
        let plans = nested_plans(db, &call(stages, caps));
        let analyzed: Vec<&str> = plans.lines().collect();
        // Nor does any step filter out more rows than are claimed (a walk of the
        // primary key in id order, filtering by stage, reads as few rows as it returns
        // but skips over all the others).
        for line in analyzed
            .iter()
            .filter(|l| l.contains("Rows Removed by Filter"))
        {
            let removed: i64 = line
                .rsplit(':')
                .next()
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no count in {line:?}"));
            assert!(removed <= most, "{when}: {line}\n{plans}");
        }
        for line in analyzed.iter().filter(|l| l.contains(" on workqueue ")) {
            let rows: i64 = line
                .split("actual rows=")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no row count in {line:?}"));
            assert!(rows <= most, "{when}: {line}\n{plans}");
        }
        plans
    };
    // A burst just injected into an empty queue, before any ANALYZE.
    let burst = TestDb::new();
    let mut b = burst.client();
    b.execute(
        "SELECT count(pepsi.workqueue_inject('p' || (g % 5 + 1), 'a@x.example', ARRAY['r@y.example'], NULL, NULL)) \
         FROM generate_series(1, 5000) g",
        &[],
    )
    .unwrap();
    let five: Vec<String> = (1..=5).map(|i| format!("p{i}")).collect();
    touches_only_the_claimed(&burst, &five, &[64; 5], "a fresh burst");
    touches_only_the_claimed(&db, &stages, &caps, "before ANALYZE");
    c.batch_execute("ANALYZE pepsi.workqueue").unwrap();
    let plan = touches_only_the_claimed(&db, &stages, &caps, "after ANALYZE");
    assert!(plan.contains("workqueue_pending_idx"), "{plan}");
    assert!(!plan.contains("Seq Scan on workqueue"), "{plan}");
    // And it takes exactly the capacities asked, though thousands wait.
    let rows = c
        .query(
            pepsi::db::sql::CLAIM_OLDEST,
            &[&stages, &caps, &100i32, &None::<Vec<i64>>],
        )
        .unwrap();
    let claimed: Vec<String> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<String>>(1))
        .collect();
    assert_eq!(claimed.iter().filter(|s| *s == "a").count(), 4);
    assert_eq!(claimed.iter().filter(|s| *s == "b").count(), 8);
}

#[test]
fn an_advance_issues_no_notify() {
    let (s, mut c) = Scenario::new("d-nonotify")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {pass}\nNEXT = c\nFUSION = no\n\n[stage-c]\nPROGRAM = {discard}\nFUSION = no\n")
        .connect();
    let mut listener = listen(&s.db, &["workqueue", "workqueue_failed", "config_changed"]);
    let mut d = s.start();
    d.wait_log("serving 3 stages", Duration::from_secs(10));
    inject_many(&mut c, "a", "a@x.example", 300);
    wait_empty(&mut c, Duration::from_secs(30));
    let seen = notified(&mut listener, &mut c);
    assert_eq!(
        seen,
        vec!["workqueue"],
        "only the injection notified; 900 advances did not"
    );
    assert!(d.terminate().success());
}
