//! The worker protocol's lines (§5), shared by both ends: the dispatcher formats
//! assignment lines and the worker parses them; the worker formats status lines and
//! the dispatcher parses them.
//!
//! An assignment line is `ID TOKEN`: the message id and the claim token of the claim
//! that took it, both decimal. The token is the worker's proof of the claim: the
//! stage role cannot read it from the queue, and every write of an outcome takes it
//! (§6 "Claim tokens", amended 2026-12-04).
//!
//! A status line is `STATUS` or `STATUS REPORT`: a decimal status, optionally a space
//! and a JSON array `[["stage",microseconds],…]` of every stage run in that pass; an
//! entry may carry a third element, an object of the events the stage counted in that
//! pass (`["relay",812,{"tls-verified":1,"tlsv1.3":1}]`, schema 20). Only an
//! unreadable STATUS is fatal (it desynchronises the positional protocol); an
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

/// The environment variable in which the dispatcher gives each worker it starts the
/// name of its database sessions. libpq reads it as the default `application_name`, so
/// a worker written in any language on libpq (psycopg2, DBD::Pg, plain C) names its
/// sessions without knowing about Pepsi; the worker library reads it itself (see
/// [`own_session_name`]).
pub const SESSION_NAME_ENV: &str = "PGAPPNAME";

/// What every worker's `application_name` starts with.
const SESSION_PREFIX: &str = "pepsi-worker:";

/// PostgreSQL keeps this many bytes of an `application_name`.
const MAX_APPLICATION_NAME: usize = 63;

/// The `application_name` the dispatcher gives the `serial`-th worker it starts,
/// `pepsi-worker:TAG-SERIAL:STAGE` (TAG in eight hex digits): when it kills that worker
/// it terminates the sessions the worker left behind by this name (§8.2 "Bounded
/// waits").
///
/// The name must be known before the fork, so it cannot hold the worker's pid. The
/// serial is never reused by one dispatcher, which makes the name unique among its
/// workers; `tag` is drawn at random once per dispatcher start, so that a dispatcher
/// that lost the lock and terminates its killed workers' sessions late cannot hit the
/// workers of the one that took over (whose serials start at 1 too, and whose pid may
/// well be the same in another container). The `-` keeps these names apart from those
/// of workers started by hand ([`worker_session_name`]). The identity part is at most
/// 43 bytes, so only STAGE is ever cut, and [`session_pattern`] still matches.
pub fn dispatched_session_name(tag: u32, serial: u64, stage: &str) -> String {
    cut_to_application_name(format!("{SESSION_PREFIX}{tag:08x}-{serial}:{stage}"))
}

/// The `application_name` of the sessions of a worker started without one from the
/// dispatcher (by hand, by a test), `pepsi-worker:PID:STAGE`.
pub fn worker_session_name(pid: u32, stage: &str) -> String {
    cut_to_application_name(format!("{SESSION_PREFIX}{pid}:{stage}"))
}

/// A worker session name cut to what PostgreSQL keeps, never inside a character.
fn cut_to_application_name(mut name: String) -> String {
    if name.len() > MAX_APPLICATION_NAME {
        let mut end = MAX_APPLICATION_NAME;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    name
}

/// The session name the dispatcher gave a worker, from the value of
/// [`SESSION_NAME_ENV`]: only a value that starts with `pepsi-worker:` is one (an
/// operator's own `PGAPPNAME` in a shell that starts a worker by hand is not).
pub fn given_session_name(value: Option<&str>) -> Option<&str> {
    value.filter(|v| v.starts_with(SESSION_PREFIX) && v.len() > SESSION_PREFIX.len())
}

/// The name this worker process gives its database sessions: the one the dispatcher
/// gave it in `PGAPPNAME`, else `pepsi-worker:PID:STAGE`.
pub fn own_session_name(stage: &str) -> String {
    let given = std::env::var(SESSION_NAME_ENV).ok();
    match given_session_name(given.as_deref()) {
        Some(name) => cut_to_application_name(name.to_string()),
        None => worker_session_name(std::process::id(), stage),
    }
}

/// The `LIKE` pattern matching the sessions of every worker.
pub const ANY_WORKER_SESSION: &str = "pepsi-worker:%";

/// The `LIKE` pattern matching every session named `name` (a name made by
/// [`dispatched_session_name`] or [`worker_session_name`]): its prefix up to and
/// including the colon after the worker's identity. The stage is left out on purpose:
/// PostgreSQL may have cut it, or rewritten its characters outside printable ASCII,
/// and it may hold `_` or `%`, which `LIKE` would read as wildcards. The identity is
/// digits, hex digits and `-`, never a wildcard.
pub fn session_pattern(name: &str) -> String {
    let identity_end = name
        .strip_prefix(SESSION_PREFIX)
        .and_then(|rest| rest.find(':'))
        .map_or(name.len(), |i| SESSION_PREFIX.len() + i + 1);
    format!("{}%", &name[..identity_end])
}

/// One message handed to a worker: its id and the token of the claim that took it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// `workqueue_id`.
    pub id: i64,
    /// The claim token, the proof every write of this claim's outcome carries.
    pub token: i64,
}

/// Formats an assignment line (with its newline).
pub fn format_assignment(a: Assignment) -> String {
    format!("{} {}\n", a.id, a.token)
}

/// Parses an assignment line (without its newline): two decimals, one space between.
pub fn parse_assignment(line: &str) -> Option<Assignment> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let (id, token) = line.split_once(' ')?;
    let decimal = |s: &str| {
        let digits = s.strip_prefix('-').unwrap_or(s);
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<i64>().ok())
            .flatten()
    };
    Some(Assignment {
        id: decimal(id)?,
        token: decimal(token)?,
    })
}

/// One stage of a pass with the microseconds it took.
pub type StageTime = (String, u64);

/// An event a stage counted in a pass: (stage, event, count).
pub type StageEvent = (String, String, u64);

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
    /// The events its entries carried, in order (none when the report is unreadable).
    pub events: Vec<StageEvent>,
}

/// Formats a status line (without the newline); each stage's events go on its first
/// entry.
pub fn format_status(status: u8, stages: &[StageTime], events: &[StageEvent]) -> String {
    let mut line = status.to_string();
    if !stages.is_empty() {
        let report = serde_json::Value::Array(
            stages
                .iter()
                .enumerate()
                .map(|(i, (s, us))| {
                    let first = stages.iter().position(|(t, _)| t == s) == Some(i);
                    let mine: serde_json::Map<String, serde_json::Value> = events
                        .iter()
                        .filter(|(stage, _, _)| first && stage == s)
                        .map(|(_, e, n)| (e.clone(), serde_json::json!(n)))
                        .collect();
                    if mine.is_empty() {
                        serde_json::json!([s, us])
                    } else {
                        serde_json::json!([s, us, mine])
                    }
                })
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
    let (report, events) = match rest {
        None => (Report::Absent, Vec::new()),
        Some(text) => parse_report(text.trim()),
    };
    Ok(StatusLine {
        status,
        report,
        events,
    })
}

fn parse_report(text: &str) -> (Report, Vec<StageEvent>) {
    let bad = |why: &str| {
        (
            Report::Unreadable(format!("{why}: {:?}", truncate(text))),
            Vec::new(),
        )
    };
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str::<serde_json::Value>(text)
    else {
        return bad("not a JSON array");
    };
    let mut stages = Vec::with_capacity(items.len());
    let mut events = Vec::new();
    for item in items {
        match item.as_array().map(Vec::as_slice) {
            Some([serde_json::Value::String(s), us]) if us.as_u64().is_some() => {
                stages.push((s.clone(), us.as_u64().unwrap_or(0)));
            }
            Some(
                [
                    serde_json::Value::String(s),
                    us,
                    serde_json::Value::Object(counted),
                ],
            ) if us.as_u64().is_some() => {
                stages.push((s.clone(), us.as_u64().unwrap_or(0)));
                for (event, n) in counted {
                    let Some(n) = n.as_u64() else {
                        return bad("an event's count is not a number");
                    };
                    events.push((s.clone(), event.clone(), n));
                }
            }
            _ => return bad("an entry is not [\"stage\", microseconds, {events}]"),
        }
    }
    (Report::Stages(stages), events)
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
        let line = format_status(0, &stages, &[]);
        assert_eq!(line, r#"0 [["pass",12],["if",3]]"#);
        assert_eq!(
            parse_status(&line),
            Ok(StatusLine {
                status: 0,
                report: Report::Stages(stages),
                events: Vec::new(),
            })
        );
        assert_eq!(format_status(74, &[], &[]), "74");
        assert_eq!(
            parse_status("74"),
            Ok(StatusLine {
                status: 74,
                report: Report::Absent,
                events: Vec::new(),
            })
        );
        // Events ride on their stage's entry.
        let stages = vec![("pass".to_string(), 12), ("relay".to_string(), 800)];
        let events = vec![
            ("relay".to_string(), "tls-verified".to_string(), 1),
            ("relay".to_string(), "tlsv1.3".to_string(), 1),
        ];
        let line = format_status(0, &stages, &events);
        assert_eq!(
            line,
            r#"0 [["pass",12],["relay",800,{"tls-verified":1,"tlsv1.3":1}]]"#
        );
        let parsed = parse_status(&line).unwrap();
        assert_eq!(parsed.report, Report::Stages(stages));
        assert_eq!(parsed.events, events);
        let bad = parse_status(r#"0 [["relay",800,{"tls-verified":"many"}]]"#).unwrap();
        assert!(matches!(bad.report, Report::Unreadable(_)) && bad.events.is_empty());
    }

    /// Does `name` match the `LIKE` pattern `pattern`, a literal prefix and `%`?
    fn matches(name: &str, pattern: &str) -> bool {
        let prefix = pattern.strip_suffix('%').expect("ends in %");
        assert!(!prefix.contains(['%', '_']), "{pattern}");
        name.starts_with(prefix)
    }

    #[test]
    fn a_worker_started_by_hand_names_its_sessions_after_its_pid_within_postgresql_limits() {
        assert_eq!(worker_session_name(42, "relay"), "pepsi-worker:42:relay");
        let long = worker_session_name(4_194_304, &"é".repeat(40));
        assert!(long.len() <= MAX_APPLICATION_NAME, "{long}");
        assert!(long.starts_with("pepsi-worker:4194304:é"));
        assert_eq!(session_pattern(&long), "pepsi-worker:4194304:%");
        assert_eq!(
            session_pattern(&worker_session_name(42, "re_lay%")),
            "pepsi-worker:42:%"
        );
    }

    #[test]
    fn a_dispatched_worker_name_is_chosen_before_the_fork_and_its_pattern_survives_the_cut() {
        assert_eq!(
            dispatched_session_name(0xbeef, 7, "relay"),
            "pepsi-worker:0000beef-7:relay"
        );
        // The longest identity, with a stage far past what PostgreSQL keeps: only the
        // stage is cut, so the pattern still matches the name the server holds.
        let name = dispatched_session_name(u32::MAX, u64::MAX, &"é".repeat(40));
        assert!(name.len() <= MAX_APPLICATION_NAME, "{name}");
        let pattern = session_pattern(&name);
        assert_eq!(pattern, format!("pepsi-worker:ffffffff-{}:%", u64::MAX));
        assert!(matches(&name, &pattern), "{name} {pattern}");
        // PostgreSQL may rewrite the stage's characters; the identity stays.
        assert!(matches(
            &format!("{}?????", &pattern[..pattern.len() - 1]),
            &pattern
        ));
    }

    #[test]
    fn one_worker_pattern_matches_no_other_worker() {
        let one = session_pattern(&dispatched_session_name(1, 1, "s"));
        for other in [
            dispatched_session_name(1, 10, "s"),
            dispatched_session_name(1, 11, "s"),
            dispatched_session_name(2, 1, "s"),
            worker_session_name(1, "s"),
        ] {
            assert!(!matches(&other, &one), "{one} matches {other}");
        }
        assert!(matches(&dispatched_session_name(1, 1, "s"), &one));
        // A pid-named worker and a dispatched one whose tag reads as that pid.
        let by_hand = session_pattern(&worker_session_name(12_345_678, "s"));
        assert!(!matches(
            &dispatched_session_name(0x1234_5678, 1, "s"),
            &by_hand
        ));
    }

    #[test]
    fn only_a_pepsi_worker_name_in_pgappname_is_taken() {
        assert_eq!(
            given_session_name(Some("pepsi-worker:0000beef-7:relay")),
            Some("pepsi-worker:0000beef-7:relay")
        );
        for value in [None, Some(""), Some("psql"), Some("pepsi-worker:")] {
            assert_eq!(given_session_name(value), None, "{value:?}");
        }
    }

    #[test]
    fn an_assignment_is_an_id_and_a_token() {
        let a = Assignment {
            id: 42,
            token: -7_305_119_840_124_961_218,
        };
        assert_eq!(format_assignment(a), "42 -7305119840124961218\n");
        assert_eq!(parse_assignment("42 -7305119840124961218"), Some(a));
        assert_eq!(parse_assignment("42 -7305119840124961218\r"), Some(a));
        for line in [
            "",
            "42",
            "42 ",
            " 42 1",
            "42 1 2",
            "42  1",
            "x 1",
            "42 +1",
            "42 1e3",
            "42 99999999999999999999",
            "42 -",
            "-",
        ] {
            assert_eq!(parse_assignment(line), None, "{line:?}");
        }
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
