//! `pepsi-queue metrics [--output FILE]`: the status snapshot in the Prometheus text
//! exposition format (version 0.0.4), for the node exporter's textfile collector.
//!
//! Counters come from `pepsi.stage_stats`, `pepsi.dispatch_stats` and
//! `pepsi.ingress_stats` (`_total` names; busy time in seconds), gauges from the
//! queue: rows and the oldest row's age by stage and status (every status of every
//! stage, 0 when empty, so an alert sees a series fall to 0 rather than vanish), rows
//! at stages without a section, whether a dispatcher holds its lock, when the
//! dispatcher and `pepsi-ingress` last wrote their statistics, the age of the
//! database's oldest snapshot in seconds and in transactions ([`super::horizon`]), and
//! for each of relay-to-internet's destinations in trouble its failures in a row and
//! the seconds its suspension lasts still ([`super::destinations`]). `--output` writes
//! a temporary file beside FILE, syncs it and renames it over FILE, so the collector
//! never reads half a file.
//!
//! Label values are escaped as the format requires and, beyond it, their control and
//! invisible formatting characters written out ([`crate::escape`]): a stage name or a
//! destination read from a row may hold anything.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use super::horizon;
use super::status::{DISPATCH_COUNTERS, INGRESS_COUNTERS, STAGE_COUNTERS, Snapshot};
use super::{Session, emit};
use crate::escape::{self, Visible};
use crate::exit::{EX_CANTCREAT, Failure};

/// A label value escaped for the text format: backslash, double quote and line feed
/// as the format escapes them (`\\`, `\"`, `\n`), and every other character
/// [`escape::must_escape`] marks in its escaped form ([`Visible`]) with that form's
/// backslash escaped, so the value Prometheus reads shows `\u{1b}` where the stage
/// name had ESC.
fn label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if escape::must_escape(c) => {
                out.push('\\');
                out.push_str(&Visible(c.encode_utf8(&mut [0; 4])).to_string());
            }
            c => out.push(c),
        }
    }
    out
}

/// A sample value: integers as such, floats in Rust's shortest form, non-finite ones
/// as the format spells them.
fn number(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x == f64::INFINITY {
        "+Inf".into()
    } else if x == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{x}")
    }
}

/// One metric family being written.
struct Family<'a> {
    out: &'a mut String,
    name: &'a str,
}

impl<'a> Family<'a> {
    /// Starts a family with its HELP and TYPE lines.
    fn new(out: &'a mut String, name: &'a str, kind: &str, help: &str) -> Family<'a> {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        Family { out, name }
    }

    /// One sample with labels.
    fn sample(&mut self, labels: &[(&str, &str)], value: String) {
        let labels: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        if labels.is_empty() {
            let _ = writeln!(self.out, "{} {value}", self.name);
        } else {
            let _ = writeln!(self.out, "{}{{{}}} {value}", self.name, labels.join(","));
        }
    }
}

/// The help text of each stage counter, by column.
const STAGE_HELP: [&str; 9] = [
    "Messages run at the stage (fused or not).",
    "Messages run at the stage fused into a predecessor's pass.",
    "Passes whose worker failed the message.",
    "Workers that died holding a message of the stage.",
    "Messages of the stage whose worker was killed at MAX_RUNTIME.",
    "Claimed messages put back to pending without a result.",
    "Worker time spent on the stage's messages.",
    "Messages paused because their worker lost the database.",
    "Distinct senders served, summed over the fair claims.",
];

/// The help text of each dispatcher counter, by column.
const DISPATCH_HELP: [&str; 4] = [
    "Worker passes (a fused chain counts once).",
    "Claim statements that claimed rows.",
    "Rows claimed.",
    "Worker processes started.",
];

/// The help text of each ingress counter, by column.
const INGRESS_HELP: [&str; 7] = [
    "LMTP and SMTP sessions pepsi-ingress served.",
    "Messages pepsi-ingress accepted: committed to the queue and answered 250.",
    "Recipients of the messages pepsi-ingress accepted.",
    "Messages pepsi-ingress answered 4xx at the end of their data (the database away).",
    "Messages pepsi-ingress answered 5xx at the end of their data (too large, no header block, refused).",
    "Transactions that queued accepted messages (several messages each under load).",
    "Sessions pepsi-ingress served inside TLS (their STARTTLS handshake completed).",
];

/// The snapshot in the text format.
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    let stages = s.stages();

    let mut f = Family::new(
        &mut out,
        "pepsi_queue_messages",
        "gauge",
        "Messages in pepsi.workqueue by stage and status.",
    );
    for stage in &stages {
        for status in &s.statuses {
            f.sample(
                &[("stage", stage), ("status", status)],
                s.rows(stage, status).to_string(),
            );
        }
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_queue_oldest_age_seconds",
        "gauge",
        "Age since arrival of the oldest message by stage and status (0 when there is none).",
    );
    for stage in &stages {
        for status in &s.statuses {
            let age = s.cell(stage, status).map_or(0.0, |c| c.oldest.max(0.0));
            f.sample(&[("stage", stage), ("status", status)], number(age));
        }
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_queue_unknown_stage_messages",
        "gauge",
        "Messages at stages without a [stage-NAME] section (never claimed).",
    );
    let unknown = s.unknown_stages();
    f.sample(&[], unknown.iter().map(|(_, n)| n).sum::<i64>().to_string());

    for (i, column) in STAGE_COUNTERS.iter().enumerate() {
        let (name, value): (String, Box<dyn Fn(i64) -> String>) = if *column == "busy_us" {
            (
                "pepsi_stage_busy_seconds_total".into(),
                Box::new(|v| number(v as f64 / 1e6)),
            )
        } else {
            (
                format!("pepsi_stage_{column}_total"),
                Box::new(|v: i64| v.to_string()),
            )
        };
        let mut f = Family::new(&mut out, &name, "counter", STAGE_HELP[i]);
        for st in &s.stage_stats {
            f.sample(&[("stage", &st.stage)], value(st.counters[i]));
        }
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_stage_stats_updated_timestamp_seconds",
        "gauge",
        "When the dispatcher last added to the stage's statistics (Unix time).",
    );
    for st in &s.stage_stats {
        f.sample(&[("stage", &st.stage)], number(st.updated));
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_stage_events_total",
        "counter",
        "Events stages counted of their messages (the relay: tls-verified, tls-unverified, \
         no-tls, tlsv1.2, tlsv1.3 per message handed over).",
    );
    for (stage, event, count) in &s.stage_events {
        f.sample(&[("stage", stage), ("event", event)], count.to_string());
    }

    for (i, column) in DISPATCH_COUNTERS.iter().enumerate() {
        let name = format!("pepsi_dispatch_{column}_total");
        let mut f = Family::new(&mut out, &name, "counter", DISPATCH_HELP[i]);
        f.sample(&[], s.dispatch.counters[i].to_string());
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_dispatch_stats_updated_timestamp_seconds",
        "gauge",
        "When the dispatcher last flushed its statistics (Unix time; it flushes only when they changed).",
    );
    f.sample(&[], number(s.dispatch.updated));
    let mut f = Family::new(
        &mut out,
        "pepsi_dispatch_stats_age_seconds",
        "gauge",
        "Seconds since the dispatcher last flushed its statistics.",
    );
    f.sample(&[], number(s.flush_age().max(0.0)));
    let mut f = Family::new(
        &mut out,
        "pepsi_dispatcher_up",
        "gauge",
        "1 when a session holds the dispatcher's lock (a dispatcher is running), else 0.",
    );
    f.sample(&[], u8::from(s.dispatcher_running).to_string());
    let mut f = Family::new(
        &mut out,
        "pepsi_oldest_snapshot_age_seconds",
        "gauge",
        "Age of the oldest snapshot or transaction holding the database's MVCC horizon \
         (VACUUM cannot remove the queue's dead rows newer than it), among those whose start \
         this role can see; 0 when none.",
    );
    f.sample(&[], number(horizon::age_seconds(&s.holders)));
    let mut f = Family::new(
        &mut out,
        "pepsi_oldest_snapshot_age_transactions",
        "gauge",
        "Transactions since the oldest xmin holding the database's MVCC horizon (sessions, \
         standbys, replication slots, prepared transactions); 0 when none.",
    );
    f.sample(&[], horizon::age_transactions(&s.holders).to_string());
    let mut f = Family::new(
        &mut out,
        "pepsi_destination_failures",
        "gauge",
        "Connection attempts of relay-to-internet to the destination that failed in a row \
         (only destinations in trouble have a sample).",
    );
    for d in &s.destinations {
        f.sample(&[("destination", &d.destination)], d.failures.to_string());
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_destination_suspended_seconds",
        "gauge",
        "Seconds the destination stays suspended still (no worker connects to it); 0 when \
         not suspended.",
    );
    for d in &s.destinations {
        f.sample(
            &[("destination", &d.destination)],
            number(d.seconds_left.max(0.0)),
        );
    }
    tenant_families(&mut out, s);

    for (i, column) in INGRESS_COUNTERS.iter().enumerate() {
        let name = format!("pepsi_ingress_{column}_total");
        let mut f = Family::new(&mut out, &name, "counter", INGRESS_HELP[i]);
        f.sample(&[], s.ingress.counters[i].to_string());
    }
    let mut f = Family::new(
        &mut out,
        "pepsi_ingress_stats_updated_timestamp_seconds",
        "gauge",
        "When pepsi-ingress last added to its statistics (Unix time; only when they changed).",
    );
    f.sample(&[], number(s.ingress.updated));
    out
}

/// The fair shares (§7 "Seen"): per stage the tenants waiting and the Jain index, per
/// stage and tenant what it got over the last minute.
fn tenant_families(out: &mut String, s: &Snapshot) {
    let mut f = Family::new(
        out,
        "pepsi_stage_tenants_waiting",
        "gauge",
        "Tenants with messages pending at the stage (counted up to 10000).",
    );
    for (stage, sh) in &s.shares {
        f.sample(&[("stage", stage)], sh.waiting.to_string());
    }
    let mut f = Family::new(
        out,
        "pepsi_stage_fairness_jain",
        "gauge",
        "The Jain fairness index of the worker time over the last minute among the tenants \
         waiting at the stage, each divided by its weight: 1 all got their share, 1/n one got \
         all (no sample: none of them ran).",
    );
    for (stage, sh) in &s.shares {
        if let Some(j) = sh.jain() {
            f.sample(&[("stage", stage)], number(j));
        }
    }
    type Field = fn(&super::tenants::TenantShare) -> String;
    let fields: [(&str, &str, Field); 4] = [
        (
            "pepsi_tenant_worker_seconds",
            "Worker time the tenant's messages took at the stage over the last minute.",
            |t| number(t.worker_us as f64 / 1e6),
        ),
        (
            "pepsi_tenant_messages",
            "The tenant's messages run at the stage over the last minute.",
            |t| t.messages.to_string(),
        ),
        (
            "pepsi_tenant_throttled_seconds",
            "Time a rate held the tenant back at the stage over the last minute.",
            |t| number(t.throttled_us as f64 / 1e6),
        ),
        (
            "pepsi_tenant_weight",
            "The tenant's fair-share weight (pepsi.fair_weights; 1 by default).",
            |t| number(t.weight),
        ),
    ];
    for (name, help, value) in fields {
        let mut f = Family::new(out, name, "gauge", help);
        for (stage, sh) in &s.shares {
            for t in &sh.tenants {
                f.sample(&[("stage", stage), ("tenant", &t.tenant)], value(t));
            }
        }
    }
}

/// Writes `text` to `path` atomically: a temporary file in the same directory
/// (`FILE.tmp.PID`), synced, renamed over `path`, and the directory synced.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), Failure> {
    let cannot = |what: &str, e: std::io::Error| {
        Failure::new(
            EX_CANTCREAT,
            format!("--output {}: cannot {what}: {e}", path.display()),
        )
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let mut tmp_name = path
        .file_name()
        .ok_or_else(|| {
            Failure::new(
                EX_CANTCREAT,
                format!("--output {}: not a file name", path.display()),
            )
        })?
        .to_os_string();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| cannot(&format!("create {}", tmp.display()), e))?;
        file.write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| cannot(&format!("write {}", tmp.display()), e))?;
        std::fs::rename(&tmp, path).map_err(|e| cannot("rename the temporary file over it", e))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename is durable once the directory is synced; failing that is no error
    // (some file systems refuse to sync a directory).
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Runs `pepsi-queue metrics`.
pub fn run(session: &mut Session, output: Option<&Path>) -> Result<(), Failure> {
    let text = render(&Snapshot::read(session)?);
    match output {
        Some(path) => write_atomically(path, &text),
        None => emit(text.as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::destinations::Destination;
    use crate::queue::status::{Cell, DispatchStats, IngressStats, StageStats};

    #[test]
    fn families_have_help_and_type_and_labels_are_escaped() {
        let mut s = Snapshot {
            statuses: vec!["pending".into(), "held".into()],
            configured: ["in".to_string()].into(),
            now: 100.0,
            dispatch: DispatchStats {
                counters: [1, 2, 3, 4],
                updated: 90.0,
                updated_text: String::new(),
            },
            stage_events: vec![("out".into(), "tls-verified".into(), 12)],
            stage_stats: vec![StageStats {
                stage: "in".into(),
                counters: [5, 0, 0, 0, 0, 0, 1_500_000, 0, 2],
                updated: 95.5,
                updated_text: String::new(),
            }],
            ingress: IngressStats {
                counters: [7, 20, 31, 2, 1, 9, 4],
                updated: 99.25,
            },
            ..Snapshot::default()
        };
        s.cells.entry("we\"ird\\\n".into()).or_default().insert(
            "held".into(),
            Cell {
                rows: 2,
                oldest: 12.5,
                buckets: [2, 0, 0, 0, 0, 0, 0],
            },
        );
        let text = render(&s);
        assert!(text.contains("# TYPE pepsi_queue_messages gauge\n"));
        assert!(text.contains("pepsi_queue_messages{stage=\"in\",status=\"pending\"} 0\n"));
        assert!(
            text.contains("pepsi_queue_messages{stage=\"we\\\"ird\\\\\\n\",status=\"held\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("pepsi_queue_unknown_stage_messages 2\n"));
        assert!(text.contains("pepsi_stage_passes_total{stage=\"in\"} 5\n"));
        assert!(text.contains("pepsi_stage_busy_seconds_total{stage=\"in\"} 1.5\n"));
        assert!(text.contains("# TYPE pepsi_dispatch_claims_total counter\n"));
        assert!(text.contains("pepsi_dispatch_rows_claimed_total 3\n"));
        assert!(text.contains("pepsi_dispatch_stats_age_seconds 10\n"));
        assert!(text.contains("pepsi_dispatcher_up 0\n"));
        assert!(text.contains("# TYPE pepsi_ingress_accepted_total counter\n"));
        assert!(text.contains("pepsi_ingress_sessions_total 7\n"));
        assert!(text.contains("pepsi_ingress_commits_total 9\n"));
        assert!(text.contains("pepsi_ingress_tls_sessions_total 4\n"));
        assert!(text.contains("# TYPE pepsi_stage_events_total counter\n"));
        assert!(
            text.contains("pepsi_stage_events_total{stage=\"out\",event=\"tls-verified\"} 12\n")
        );
        assert!(text.contains("pepsi_ingress_stats_updated_timestamp_seconds 99.25\n"));
        assert!(text.contains("# TYPE pepsi_destination_failures gauge\n"));
        assert!(text.contains("# HELP pepsi_destination_suspended_seconds "));
        assert!(
            !text.contains("pepsi_destination_failures{"),
            "no rows, no samples"
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} has no TYPE"
            );
        }
    }

    #[test]
    fn each_destination_in_trouble_has_its_failures_and_suspension() {
        let row = |destination: &str, failures, seconds_left| Destination {
            destination: destination.into(),
            failures,
            suspended_until: None,
            seconds_left,
            reason: "no-such-label\r\n".into(),
            updated: std::time::SystemTime::UNIX_EPOCH,
        };
        let s = Snapshot {
            destinations: vec![
                row("example.org", 5, 251.5),
                row("[192.0.2.1]", 2, 0.0),
                row("x\"\\\n\u{1b}\u{202e}", 1, 0.0),
            ],
            ..Snapshot::default()
        };
        let text = render(&s);
        assert!(text.contains("# TYPE pepsi_destination_failures gauge\n"));
        assert!(text.contains("# TYPE pepsi_destination_suspended_seconds gauge\n"));
        assert!(text.contains("pepsi_destination_failures{destination=\"example.org\"} 5\n"));
        assert!(
            text.contains(
                "pepsi_destination_suspended_seconds{destination=\"example.org\"} 251.5\n"
            )
        );
        assert!(text.contains("pepsi_destination_failures{destination=\"[192.0.2.1]\"} 2\n"));
        assert!(
            text.contains("pepsi_destination_suspended_seconds{destination=\"[192.0.2.1]\"} 0\n")
        );
        assert!(
            text.contains(
                "pepsi_destination_failures{destination=\"x\\\"\\\\\\n\\\\u{1b}\\\\u{202e}\"} 1\n"
            ),
            "{text}"
        );
        assert!(!text.contains("no-such-label"), "the reason is no label");
    }

    #[test]
    fn label_values_show_controls_and_invisible_characters_escaped() {
        assert_eq!(label("in"), "in");
        assert_eq!(label("we\"ird\\\n"), "we\\\"ird\\\\\\n");
        assert_eq!(
            label("a\u{1b}[2J\r\u{202e}\u{2028}é"),
            "a\\\\u{1b}[2J\\\\r\\\\u{202e}\\\\u{2028}é"
        );
    }

    #[test]
    fn the_output_file_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("pepsi-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pepsi.prom");
        std::fs::write(&file, "old").unwrap();
        write_atomically(&file, "new\n").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new\n");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("pepsi.prom")],
            "no temporary file left"
        );
        let err = write_atomically(&dir.join("missing/x.prom"), "x").unwrap_err();
        assert_eq!(err.code, 73);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
