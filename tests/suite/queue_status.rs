//! `pepsi-queue status` (`src/queue/status.rs`): every stage and status, the age
//! shape, stages without a section and the statistics, as text and as `--json`; and
//! who holds the database's oldest snapshot, there and in the dispatcher's log.

use std::time::Duration;

use serde_json::Value;

use crate::util::pg::login_role;
use crate::util::queue::{STAGES, expect, json, queue, varied_queue};
use crate::util::{Scenario, assert_has, assert_lacks, stdout, wait_until};

#[test]
fn status_shows_every_stage_and_status_the_age_shape_unknown_stages_and_statistics() {
    let (s, mut c) = Scenario::new("q-status").stages(STAGES).connect();
    varied_queue(&mut c);
    let out = queue(&s.conf, &["status", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert_eq!(j["rows"], 7);
    for (status, n) in [
        ("pending", 2),
        ("running", 1),
        ("paused", 1),
        ("failed", 1),
        ("timeout", 1),
        ("held", 1),
    ] {
        assert_eq!(j["statuses"][status], n, "{status}");
    }
    let stage = |name: &str| -> Value {
        j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("no stage {name} in {j}"))
            .clone()
    };
    let relay = stage("relay");
    assert_eq!(relay["configured"], true);
    assert_eq!(relay["rows"], 6);
    assert_eq!(relay["statuses"]["held"]["rows"], 1);
    assert!(relay["oldest_age_seconds"].as_f64().unwrap() >= 3.0 * 3600.0 - 5.0);
    assert!(
        relay["statuses"]["paused"]["oldest_age_seconds"]
            .as_f64()
            .unwrap()
            >= 420.0
    );
    assert_eq!(
        relay["age_buckets"],
        serde_json::json!([4, 1, 0, 0, 0, 0, 1]),
        "0-5m, 5-10m (7 minutes), …, 160m+ (3 hours)"
    );
    assert_eq!(stage("in")["rows"], 0, "a configured stage without rows");
    assert_eq!(stage("lost")["configured"], false);
    assert_eq!(
        j["unknown_stages"],
        serde_json::json!([{"stage": "lost", "rows": 1}])
    );
    assert_eq!(j["stage_stats"][0]["stage"], "relay");
    assert_eq!(j["stage_stats"][0]["busy_us"], 2_500_000);
    assert_eq!(j["stage_stats"][0]["senders_served"], 17);
    assert_eq!(j["dispatch_stats"]["rows_claimed"], 45);
    assert!(j["dispatch_stats"]["updated_age_seconds"].as_f64().unwrap() >= 29.0);
    assert_eq!(j["dispatcher_running"], false);

    let out = queue(&s.conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.starts_with("queue: 7 messages ("), "{text}");
    assert!(text.contains("lost (no section)"), "{text}");
    assert_has!(
        text,
        "without a [stage-NAME] section are never claimed: lost (1)"
    );
    assert!(text.contains("0-5m  5-10m  10-20m"), "{text}");
    assert!(text.contains("dispatcher: NOT RUNNING"), "{text}");
    assert!(text.contains("37 stages executed, 12 claims, 45 rows claimed, 6 worker starts"));
}

/// A session of the test's database that holds a snapshot: REPEATABLE READ, one read,
/// then idle in transaction until dropped. Returns the client, its pid, its role and
/// its client address as the holders show it (`local` for a Unix socket).
fn snapshot_holder(s: &Scenario, application: &str) -> (postgres::Client, i32, String, String) {
    let mut h = s.client();
    h.batch_execute(&format!(
        "SET application_name = '{application}'; \
         BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pepsi.workqueue"
    ))
    .unwrap();
    let r = h
        .query_one(
            "SELECT pg_backend_pid(), current_user::text, \
                    coalesce(host(inet_client_addr()), 'local')",
            &[],
        )
        .unwrap();
    (h, r.get(0), r.get(1), r.get(2))
}

#[test]
fn the_holder_named_in_the_log_and_in_pepsi_queue_status_json_while_a_test_holds_a_snapshot() {
    let (s, mut c) = Scenario::new("q-holder")
        .timers("SNAPSHOT_WARNING = 1s")
        .stages(STAGES)
        .connect();
    varied_queue(&mut c);
    let (mut h, pid, role, client) = snapshot_holder(&s, "pepsi-holder-test");
    let d = s.start();
    let named = format!(
        "held by session pid {pid} (application \"pepsi-holder-test\", client {client}, \
         role \"{role}\", state \"idle in transaction\""
    );
    d.wait_log(&named, Duration::from_secs(60));
    let warning = d
        .log()
        .lines()
        .find(|l| l.contains(&named))
        .unwrap()
        .to_string();
    assert!(warning.contains("WARN"), "{warning}");
    assert_has!(warning, "over SNAPSHOT_WARNING (1s)");
    assert_has!(warning, "transactions behind");

    // `status --json` names the same session, with every detail (it is of the role
    // pepsi-queue connects as), past the file's threshold.
    let mut j = Value::Null;
    wait_until(Duration::from_secs(60), "status names the holder", || {
        let out = queue(&s.conf, &["status", "--json"]);
        expect(&out, 0);
        j = json(&out);
        j["oldest_snapshot"]["pid"] == pid && j["oldest_snapshot"]["over_threshold"] == true
    });
    let o = &j["oldest_snapshot"];
    assert_eq!(o["kind"], "session", "{j}");
    assert_eq!(o["name"], "pepsi-holder-test");
    assert_eq!(o["state"], "idle in transaction");
    assert_eq!(o["client"], client.as_str());
    assert_eq!(o["role"], role.as_str());
    assert_eq!(o["database"], s.db.name.as_str());
    assert_eq!(o["details_visible"], true);
    assert!(o["age_seconds"].as_f64().unwrap() >= 1.0, "{o}");
    assert!(o["age_transactions"].as_i64().unwrap() >= 0, "{o}");
    assert_eq!(j["snapshot_warning_seconds"], 1);
    assert!(
        j["snapshot_holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["pid"] == pid)
    );
    let out = queue(&s.conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert_has!(
        text,
        &format!("held by session pid {pid} (application \"pepsi-holder-test\"")
    );
    assert!(text.contains("over SNAPSHOT_WARNING (1s)"), "{text}");
    // `metrics` exports its age.
    let out = queue(&s.conf, &["metrics"]);
    expect(&out, 0);
    let text = stdout(&out);
    let gauge = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(gauge("pepsi_oldest_snapshot_age_seconds") >= 1.0, "{text}");
    assert!(
        gauge("pepsi_oldest_snapshot_age_transactions") >= 0.0,
        "{text}"
    );

    // The end is said once the snapshot is gone.
    h.batch_execute("COMMIT").unwrap();
    d.wait_log(
        "the database's oldest snapshot is younger than SNAPSHOT_WARNING (1s) again",
        Duration::from_secs(60),
    );
    let out = queue(&s.conf, &["status", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert!(
        j["snapshot_holders"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["pid"] != pid),
        "{j}"
    );
}

#[test]
fn a_role_without_pg_read_all_stats_sees_the_holder_with_its_pid_and_xmin_age_only() {
    let (s, _c) = Scenario::new("q-holder-hidden").stages(STAGES).connect();
    let (_h, pid, _, _) = snapshot_holder(&s, "pepsi-hidden-holder");
    // A plain login role: not a superuser, not the holder's role, no pg_read_all_stats.
    let role = login_role("pepsi_t_nostats", &[]);
    let mut low = s.db.client_as(&role);
    let holders = pepsi::db::horizon::read(&mut low).unwrap();
    let h = holders
        .iter()
        .find(|h| h.pid == Some(pid))
        .unwrap_or_else(|| panic!("pid {pid} not among {holders:?}"));
    assert_eq!(h.kind, "session");
    assert_eq!(h.name.as_deref(), Some("pepsi-hidden-holder"));
    assert!(!h.visible);
    assert_eq!((&h.client, &h.state, h.age_seconds), (&None, &None, None));
    assert!(h.xid_age.is_some(), "{h:?}");
    let text = pepsi::db::horizon::describe(h);
    assert!(text.contains("pg_read_all_stats"), "{text}");
}

#[test]
fn a_hostile_gid_is_named_escaped_in_the_log_and_in_pepsi_queue_status() {
    let (s, mut c) = Scenario::new("q-holder-hostile")
        .timers("SNAPSHOT_WARNING = 1s")
        .stages(STAGES)
        .connect();
    let max: String = c
        .query_one("SHOW max_prepared_transactions", &[])
        .unwrap()
        .get(0);
    if max == "0" {
        eprintln!("max_prepared_transactions is 0 on this server: not tested");
        return;
    }
    // Any role may prepare a transaction under a name of its choosing: a line end, a
    // forged log line, a right-to-left override.
    let gid = "x\r\n2026-01-01 WARN forged\u{202e}gnp.exe";
    struct Prepared(postgres::Client, String);
    impl Drop for Prepared {
        fn drop(&mut self) {
            let _ = self.0.batch_execute(&format!(
                "ROLLBACK PREPARED '{}'",
                self.1.replace('\'', "''")
            ));
        }
    }
    let mut p = s.client();
    p.batch_execute(&format!(
        "BEGIN; UPDATE pepsi.dispatch_stats SET claims = claims; \
         PREPARE TRANSACTION '{}'",
        gid.replace('\'', "''")
    ))
    .unwrap();
    let escaped = "x\\r\\n2026-01-01 WARN forged\\u{202e}gnp.exe";
    let _prepared = Prepared(p, gid.to_string());
    let d = s.start();
    d.wait_log(
        &format!("held by prepared transaction (gid \"{escaped}\""),
        Duration::from_secs(60),
    );
    let log = d.log();
    assert!(
        !log.contains('\u{202e}') && !log.lines().any(|l| l.starts_with("2026-01-01 WARN forged")),
        "{log}"
    );
    let out = queue(&s.conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.contains(&format!("gid \"{escaped}\"")), "{text}");
    assert_lacks!(text, '\u{202e}');
    assert_lacks!(text, '\r');
    assert_lacks!(text, "\n2026");
    // The JSON carries the name as it is, encoded.
    let out = queue(&s.conf, &["status", "--json"]);
    expect(&out, 0);
    assert!(
        json(&out)["snapshot_holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == gid),
        "{}",
        stdout(&out)
    );
}

#[test]
fn a_prepared_transaction_holding_the_horizon_is_named_by_its_gid() {
    let (s, mut c) = Scenario::new("q-holder-prepared").stages(STAGES).connect();
    let max: String = c
        .query_one("SHOW max_prepared_transactions", &[])
        .unwrap()
        .get(0);
    if max == "0" {
        eprintln!("max_prepared_transactions is 0 on this server: not tested");
        return;
    }
    /// Rolls the prepared transaction back however the test ends: left behind, it
    /// would keep its database from being dropped.
    struct Prepared(postgres::Client, &'static str);
    impl Drop for Prepared {
        fn drop(&mut self) {
            let _ = self
                .0
                .batch_execute(&format!("ROLLBACK PREPARED '{}'", self.1));
        }
    }
    let mut p = s.client();
    p.batch_execute(
        "BEGIN; UPDATE pepsi.dispatch_stats SET claims = claims; \
         PREPARE TRANSACTION 'pepsi-holder-gid'",
    )
    .unwrap();
    let _prepared = Prepared(p, "pepsi-holder-gid");
    let out = queue(&s.conf, &["status", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    let prepared = j["snapshot_holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["kind"] == "prepared transaction")
        .unwrap_or_else(|| panic!("no prepared transaction in {j}"))
        .clone();
    assert_eq!(prepared["name"], "pepsi-holder-gid");
    assert_eq!(prepared["state"], "prepared");
    assert!(prepared["age_seconds"].as_f64().is_some(), "{prepared}");
}
