//! `pepsi-queue destinations` and `destinations lift` (`src/queue/destinations.rs`) on
//! rows written through the workers' own function, one with a hostile reason: the
//! text (suspended first, every value escaped), the JSON (exact), the two gauges of
//! `metrics`, lifting (and lifting what is not in trouble, 65), a refused argument
//! (64), and the statements on the `pepsi_admin` role's grants.

use serde_json::json;

use pepsi::db::sql_destinations::{DESTINATION_FAILED, LIFT_DESTINATION};

use crate::util::queue::{STAGES, expect, json, nothing_raw, queue};
use crate::util::{Scenario, stderr, stdout};

/// A reason a worker could have written: a line break, ESC and RIGHT-TO-LEFT OVERRIDE.
const HOSTILE: &str = "421 bye\r\nil.test  9 failures\u{1b}[2J\u{202e}tset.b";

/// Counts a failed connection to `destination` as a worker does (suspended at
/// `dead_after` failures for an hour).
fn failed(c: &mut postgres::Client, destination: &str, reason: &str, dead_after: i32) {
    c.execute(
        DESTINATION_FAILED,
        &[&destination, &reason, &dead_after, &3600.0_f64],
    )
    .unwrap();
}

#[test]
fn destinations_are_listed_suspended_first_escaped_exported_and_lifted() {
    let (s, mut c) = Scenario::new("q-destinations").stages(STAGES).connect();
    let out = queue(&s.conf, &["destinations"]);
    expect(&out, 0);
    assert_eq!(stdout(&out), "no destination in trouble\n");
    assert_eq!(
        json(&queue(&s.conf, &["destinations", "--json"])),
        json!([])
    );

    failed(&mut c, "b.test", HOSTILE, 5);
    failed(&mut c, "a.test", "connect to mx.a.test: refused", 2);
    failed(&mut c, "z.test", "timed out", 2);
    failed(&mut c, "z.test", "timed out again", 2);

    let out = queue(&s.conf, &["destinations"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("z.test  suspended for 59m5")
            || lines[0].starts_with("z.test  suspended for 1h00m"),
        "{text}"
    );
    assert!(
        lines[0].ends_with(" more, 2 failures in a row: timed out again"),
        "{text}"
    );
    assert_eq!(
        lines[1],
        "a.test  1 failure in a row, not suspended: connect to mx.a.test: refused"
    );
    assert_eq!(
        lines[2],
        "b.test  1 failure in a row, not suspended: 421 bye\\r\\nil.test  9 failures\\u{1b}[2J\\u{202e}tset.b"
    );
    // A second failure of a.test, now with DEAD_AFTER 3: still not suspended.
    failed(&mut c, "a.test", "connect to mx.a.test: refused", 3);
    let j = json(&queue(&s.conf, &["destinations", "--json"]));
    let rows = j.as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["destination"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["z.test", "a.test", "b.test"], "{j}");
    assert_eq!(rows[0]["suspended"], true);
    assert_eq!(rows[0]["failures"], 2);
    let until = rows[0]["suspended_until"].as_str().unwrap();
    assert!(until.len() == 20 && until.ends_with('Z'), "{until}");
    let left = rows[0]["seconds_left"].as_f64().unwrap();
    assert!((3500.0..=3600.0).contains(&left), "{left}");
    assert_eq!(rows[1]["suspended"], false);
    assert_eq!(rows[1]["failures"], 2);
    assert_eq!(rows[1]["suspended_until"], serde_json::Value::Null);
    assert_eq!(rows[1]["seconds_left"], 0.0);
    assert_eq!(rows[2]["reason"], HOSTILE);
    assert!(rows[2]["updated"].as_str().unwrap().ends_with('Z'));

    let out = queue(&s.conf, &["metrics"]);
    expect(&out, 0);
    let metrics = stdout(&out);
    if let Some(check) = super::queue_metrics::promtool_check(&metrics) {
        assert!(
            check.status.success() && check.stdout.is_empty() && check.stderr.is_empty(),
            "promtool check metrics:\n{}\n{}\n---\n{metrics}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    for line in [
        "# TYPE pepsi_destination_failures gauge",
        "# TYPE pepsi_destination_suspended_seconds gauge",
        "pepsi_destination_failures{destination=\"z.test\"} 2",
        "pepsi_destination_failures{destination=\"b.test\"} 1",
        "pepsi_destination_suspended_seconds{destination=\"a.test\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line}\n{metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("pepsi_destination_suspended_seconds{destination=\"z.test\"} 35")
        ),
        "{metrics}"
    );

    let out = queue(&s.conf, &["destinations", "lift", "Z.Test"]);
    expect(&out, 0);
    assert_eq!(stdout(&out), "lifted z.test\n");
    let left: i64 = c
        .query_one("SELECT count(*) FROM pepsi.destinations", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, 2);
    let out = queue(&s.conf, &["destinations", "lift", "z.test"]);
    expect(&out, 65);
    assert!(
        stderr(&out).contains("z.test is not in trouble (no suspension to lift)"),
        "{}",
        stderr(&out)
    );
    let out = queue(&s.conf, &["destinations", "lift", "a.test", "--json"]);
    expect(&out, 0);
    assert_eq!(
        json(&out),
        json!({"command": "destinations lift", "destination": "a.test", "lifted": true})
    );
    let out = queue(&s.conf, &["destinations", "lift", "a.test", "--json"]);
    expect(&out, 65);
    assert_eq!(json(&out)["lifted"], false);
    let out = queue(&s.conf, &["destinations", "lift", "evil\u{1b}[2J.test"]);
    expect(&out, 64);
    assert!(
        stderr(&out).contains("\"evil\\u{1b}[2J.test\""),
        "{}",
        stderr(&out)
    );
    nothing_raw(&stderr(&out));

    // pepsi-queue's own role reads and lifts with its grants.
    let mut admin = s.db.client_as(&super::roles::admin_login());
    let rows = pepsi::queue::destinations::read(&mut admin).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, HOSTILE);
    assert!(
        admin
            .query_opt(LIFT_DESTINATION, &[&"b.test"])
            .unwrap()
            .is_some()
    );
    assert!(
        pepsi::queue::destinations::read(&mut admin)
            .unwrap()
            .is_empty()
    );
}
