//! `pepsi-queue metrics` (`src/queue/metrics.rs`): the Prometheus text format checked
//! by `promtool` and against the tables (the queue, the dispatcher's and the stages'
//! statistics, `pepsi-ingress`'s counters), label values escaped, and `--output`
//! replacing its file whole.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use crate::util::queue::{STAGES, both, expect, odd_row, queue, varied_queue};
use crate::util::{Scenario, assert_has, inject, stderr, stdout};

/// The samples of an exposition text: `name{labels}` → value.
fn samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').unwrap();
            (key.to_string(), value.parse().unwrap())
        })
        .collect()
}

/// `promtool check metrics` on `text`: its findings, or `None` when promtool is not
/// installed (outside CI only: under CI a missing promtool fails the test).
pub(super) fn promtool_check(text: &str) -> Option<Output> {
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                std::env::var_os("CI").is_none(),
                "promtool is not installed (CI is set): apt-get install prometheus"
            );
            eprintln!(
                "promtool is not installed: the exposition format is not checked \
                 (apt-get install prometheus)"
            );
            return None;
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    Some(child.wait_with_output().unwrap())
}

#[test]
fn metrics_pass_promtool_and_match_the_tables() {
    let (s, mut c) = Scenario::new("q-metrics").stages(STAGES).connect();
    varied_queue(&mut c);
    // A stage name that needs escaping in a label.
    inject(&mut c, "we\"ird\\", "a@x.example", &["r@y.example"]);
    // pepsi-ingress's counters, as it would have added to them.
    c.batch_execute(
        "UPDATE pepsi.ingress_stats SET sessions = 11, accepted = 23, recipients = 42, \
           deferred = 3, refused = 2, commits = 7, updated = now() - interval '5 seconds'",
    )
    .unwrap();
    let out = queue(&s.conf, &["metrics"]);
    expect(&out, 0);
    let text = stdout(&out);
    if let Some(check) = promtool_check(&text) {
        assert!(
            check.status.success() && check.stdout.is_empty() && check.stderr.is_empty(),
            "promtool check metrics:\n{}\n{}\n---\n{text}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    let m = samples(&text);
    // Every stage (configured or with rows) by every status, against the table.
    let statuses: Vec<String> = c
        .query(
            "SELECT s::text FROM unnest(enum_range(NULL::pepsi.workqueue_status)) s",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for stage in ["in", "relay", "lost", "we\\\"ird\\\\"] {
        for status in &statuses {
            let key = format!("pepsi_queue_messages{{stage=\"{stage}\",status=\"{status}\"}}");
            let name = stage.replace("\\\"", "\"").replace("\\\\", "\\");
            let want: i64 = c
                .query_one(
                    "SELECT count(*) FROM pepsi.workqueue WHERE stage = $1 AND status::text = $2",
                    &[&name, status],
                )
                .unwrap()
                .get(0);
            assert_eq!(m.get(&key), Some(&(want as f64)), "{key}\n{text}");
        }
    }
    let oldest = m["pepsi_queue_oldest_age_seconds{stage=\"relay\",status=\"failed\"}"];
    assert!(
        (3.0 * 3600.0 - 5.0..3.0 * 3600.0 + 60.0).contains(&oldest),
        "{oldest}"
    );
    assert_eq!(
        m["pepsi_queue_oldest_age_seconds{stage=\"in\",status=\"pending\"}"],
        0.0
    );
    assert_eq!(m["pepsi_queue_unknown_stage_messages"], 2.0);
    for (name, want) in [
        ("passes", 40.0),
        ("fused_passes", 3.0),
        ("failures", 2.0),
        ("crashes", 1.0),
        ("timeouts", 1.0),
        ("requeues", 5.0),
        ("deferrals", 4.0),
        ("senders_served", 17.0),
        ("busy_seconds", 2.5),
    ] {
        assert_eq!(
            m[&format!("pepsi_stage_{name}_total{{stage=\"relay\"}}")],
            want,
            "{name}"
        );
    }
    for (name, want) in [
        ("stages_executed", 37.0),
        ("claims", 12.0),
        ("rows_claimed", 45.0),
        ("worker_starts", 6.0),
    ] {
        assert_eq!(m[&format!("pepsi_dispatch_{name}_total")], want, "{name}");
    }
    let updated: f64 = c
        .query_one(
            "SELECT extract(epoch FROM updated)::float8 FROM pepsi.dispatch_stats",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(m["pepsi_dispatch_stats_updated_timestamp_seconds"], updated);
    assert!(m["pepsi_dispatch_stats_age_seconds"] >= 29.0);
    assert_eq!(m["pepsi_dispatcher_up"], 0.0);
    for (name, want) in [
        ("sessions", 11.0),
        ("accepted", 23.0),
        ("recipients", 42.0),
        ("deferred", 3.0),
        ("refused", 2.0),
        ("commits", 7.0),
    ] {
        let family = format!("pepsi_ingress_{name}_total");
        assert_eq!(m[&family], want, "{name}");
        assert_has!(text, &format!("# TYPE {family} counter\n"), "{family}");
    }
    let updated: f64 = c
        .query_one(
            "SELECT extract(epoch FROM updated)::float8 FROM pepsi.ingress_stats",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(m["pepsi_ingress_stats_updated_timestamp_seconds"], updated);
}

#[test]
fn metrics_show_a_stage_name_escaped_and_pass_promtool() {
    let (s, mut c) = Scenario::new("q-metrics-escaped").stages(STAGES).connect();
    odd_row(&mut c);
    let out = queue(&s.conf, &["metrics"]);
    expect(&out, 0);
    let text = stdout(&out);
    if let Some(check) = promtool_check(&text) {
        assert!(
            check.status.success() && check.stdout.is_empty() && check.stderr.is_empty(),
            "promtool check metrics:\n{}\n{}\n---\n{text}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    // Backslash, double quote and line feed as the format escapes them; the others
    // written out, their backslash escaped, so Prometheus reads `\u{1b}` and so on.
    let label = "stage=\"ev\\\\u{1b}[2J\\\\r\\nil\\\\u{202e}x\\\\u{2028}y\"";
    let m = samples(&text);
    assert_eq!(
        m.get(&format!(
            "pepsi_queue_messages{{{label},status=\"pending\"}}"
        )),
        Some(&1.0),
        "{text}"
    );
    for c in ['\u{1b}', '\r', '\u{202e}', '\u{2028}'] {
        assert!(!text.contains(c), "{c:?} raw in:\n{text}");
    }
    assert!(
        text.lines()
            .all(|l| l.starts_with("# ") || l.starts_with("pepsi_")),
        "every line a comment or a sample:\n{text}"
    );
}

#[test]
fn metrics_output_replaces_the_file_whole_and_says_when_it_cannot() {
    let s = Scenario::new("q-metrics-file").stages(STAGES).build();
    let prom = s.dir.path("pepsi.prom");
    std::fs::write(&prom, "stale\n").unwrap();
    let out = queue(&s.conf, &["metrics", "--output", prom.to_str().unwrap()]);
    expect(&out, 0);
    assert!(out.stdout.is_empty(), "{}", both(&out));
    let text = std::fs::read_to_string(&prom).unwrap();
    assert!(text.contains("# TYPE pepsi_dispatcher_up gauge"), "{text}");
    let left: Vec<String> = std::fs::read_dir(&s.dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let out = queue(
        &s.conf,
        &[
            "metrics",
            "--output",
            s.dir.path("no/such/dir.prom").to_str().unwrap(),
        ],
    );
    expect(&out, 73);
    assert!(stderr(&out).contains("no/such/dir.prom"), "{}", both(&out));
}
