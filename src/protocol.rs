//! The worker protocol's lines (SPEC §5), shared by both ends: the worker formats
//! status lines, the dispatcher parses them.
//!
//! A status line is `STATUS` or `STATUS REPORT`: a decimal status, optionally a space
//! and a JSON array `[["stage",microseconds],…]` of every stage run in that pass. Only
//! an unreadable STATUS is fatal (it desynchronises the positional protocol); an
//! unreadable REPORT is kept as a warning so the outcome still counts.

use std::fmt::Write as _;

/// The line a worker prints once it is ready for ids.
pub const READY: &str = "ready";

/// Success: the worker wrote the outcome on the row.
pub const STATUS_OK: u8 = 0;
/// The worker marked the row failed for a permanent error.
pub const STATUS_PERMANENT: u8 = crate::exit::EX_DATAERR;
/// The worker marked the row failed after exhausting its retries.
pub const STATUS_EXHAUSTED: u8 = 69;
/// The database connection broke; nothing was committed (§8.4).
pub const STATUS_IOERR: u8 = crate::exit::EX_IOERR;
/// The database refused a connection for overload (§8.3).
pub const STATUS_TEMPFAIL: u8 = crate::exit::EX_TEMPFAIL;

/// The environment variable through which the dispatcher tells a worker which stage
/// (`[stage-NAME]` section) it serves; a worker names its database sessions after it.
pub const WORKER_STAGE_ENV: &str = "PEPSI_WORKER_STAGE";

/// What every worker's `application_name` starts with.
const SESSION_PREFIX: &str = "pepsi-worker:";

/// PostgreSQL keeps this many bytes of an `application_name`.
const MAX_APPLICATION_NAME: usize = 63;

/// The `application_name` of a worker's database sessions, `pepsi-worker:PID:STAGE`:
/// when the dispatcher kills a worker it terminates the sessions it left behind by its
/// pid (§8.2 "Bounded waits"). Cut to what PostgreSQL keeps, never inside a character.
pub fn worker_session_name(pid: u32, stage: &str) -> String {
    let mut name = format!("{SESSION_PREFIX}{pid}:{stage}");
    if name.len() > MAX_APPLICATION_NAME {
        let mut end = MAX_APPLICATION_NAME;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    name
}

/// The `LIKE` pattern matching the sessions of every worker.
pub const ANY_WORKER_SESSION: &str = "pepsi-worker:%";

/// The `LIKE` pattern matching every session of the worker with this pid.
pub fn worker_session_pattern(pid: u32) -> String {
    format!("{SESSION_PREFIX}{pid}:%")
}

/// One stage of a pass with the microseconds it took.
pub type StageTime = (String, u64);

/// The REPORT part of a status line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// No report on the line.
    Absent,
    /// The stages of the pass, claimed stage first.
    Stages(Vec<StageTime>),
    /// A report that could not be read, with why.
    Unreadable(String),
}

/// A parsed status line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusLine {
    /// The status.
    pub status: u8,
    /// The report.
    pub report: Report,
}

/// Formats a status line (without the newline).
pub fn format_status(status: u8, stages: &[StageTime]) -> String {
    let mut line = status.to_string();
    if !stages.is_empty() {
        let report = serde_json::Value::Array(
            stages
                .iter()
                .map(|(s, us)| serde_json::json!([s, us]))
                .collect(),
        );
        let _ = write!(line, " {report}");
    }
    line
}

/// Parses a status line. `Err` means the STATUS itself is unreadable.
pub fn parse_status(line: &str) -> Result<StatusLine, String> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let (head, rest) = match line.split_once(' ') {
        Some((h, r)) => (h, Some(r)),
        None => (line, None),
    };
    if head.is_empty() || !head.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("unreadable status line {:?}", truncate(line)));
    }
    let status: u8 = head
        .parse()
        .map_err(|_| format!("status {head:?} is out of range"))?;
    let report = match rest {
        None => Report::Absent,
        Some(text) => parse_report(text.trim()),
    };
    Ok(StatusLine { status, report })
}

fn parse_report(text: &str) -> Report {
    let bad = |why: &str| Report::Unreadable(format!("{why}: {:?}", truncate(text)));
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str::<serde_json::Value>(text)
    else {
        return bad("not a JSON array");
    };
    let mut stages = Vec::with_capacity(items.len());
    for item in items {
        match item.as_array().map(Vec::as_slice) {
            Some([serde_json::Value::String(s), us]) if us.as_u64().is_some() => {
                stages.push((s.clone(), us.as_u64().unwrap_or(0)));
            }
            _ => return bad("an entry is not [\"stage\", microseconds]"),
        }
    }
    Report::Stages(stages)
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(200) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_and_parse_round_trip() {
        let stages = vec![("pass".to_string(), 12), ("if".to_string(), 3)];
        let line = format_status(0, &stages);
        assert_eq!(line, r#"0 [["pass",12],["if",3]]"#);
        assert_eq!(
            parse_status(&line),
            Ok(StatusLine {
                status: 0,
                report: Report::Stages(stages)
            })
        );
        assert_eq!(format_status(74, &[]), "74");
        assert_eq!(
            parse_status("74"),
            Ok(StatusLine {
                status: 74,
                report: Report::Absent
            })
        );
    }

    #[test]
    fn a_worker_session_name_carries_the_pid_and_fits_postgresql() {
        assert_eq!(worker_session_name(42, "relay"), "pepsi-worker:42:relay");
        let long = worker_session_name(4_194_304, &"é".repeat(40));
        assert!(long.len() <= MAX_APPLICATION_NAME, "{long}");
        assert!(long.starts_with("pepsi-worker:4194304:é"));
        assert_eq!(worker_session_pattern(42), "pepsi-worker:42:%");
    }

    #[test]
    fn an_unreadable_status_is_an_error() {
        for line in ["", "ok", "-1", "x 0", "300", " 0", "0x1"] {
            assert!(parse_status(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn an_unreadable_report_keeps_the_status() {
        for line in ["0 {not json", "0 [1,2]", r#"0 [["a",-1]]"#, r#"0 {"a":1}"#] {
            let parsed = parse_status(line).unwrap();
            assert_eq!(parsed.status, 0);
            assert!(matches!(parsed.report, Report::Unreadable(_)), "{line:?}");
        }
    }
}
