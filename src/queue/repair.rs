//! The repair commands: `resume`, `hold`, `release`, `delete` and `requeue`. Each is
//! one call of its stored function (schema 006, or `workqueue_resume` by stage and
//! status): one round trip, and one NOTIFY on `workqueue` when anything changed.
//!
//! The functions answer for every id; [`Report`] sorts the answers into changed, not
//! found (exit 65) and in a status the command does not touch (exit 69), and this file
//! prints them. The ids that could be changed are changed even when others could not:
//! the report says which.

use serde_json::{Value, json};

use super::args::ResumeWhat;
use super::{Session, db_failure, emit, emit_json};
use crate::db::sql;
use crate::exit::{EX_DATAERR, EX_UNAVAILABLE, Failure};

/// A repair by ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `resume ID…`.
    Resume,
    /// `hold ID…`.
    Hold,
    /// `release ID…`.
    Release,
    /// `delete ID…`.
    Delete,
    /// `requeue --stage S ID…`.
    Requeue(String),
}

impl Action {
    /// The command's name.
    fn name(&self) -> &'static str {
        match self {
            Action::Resume => "resume",
            Action::Hold => "hold",
            Action::Release => "release",
            Action::Delete => "delete",
            Action::Requeue(_) => "requeue",
        }
    }

    /// What happened to a changed message, for people.
    fn done(&self) -> String {
        match self {
            Action::Resume => "resumed".into(),
            Action::Hold => "held".into(),
            Action::Release => "released".into(),
            Action::Delete => "deleted".into(),
            Action::Requeue(stage) => format!("moved to stage {stage} as pending:"),
        }
    }

    /// Why a message in `status` was left alone.
    fn refusal(&self, status: &str) -> String {
        if status == "running" {
            return format!(
                "is running: it belongs to a worker; {} it once it is not",
                self.name()
            );
        }
        match self {
            Action::Resume if status == "held" => "is held; release it instead".into(),
            Action::Resume => {
                format!("is {status}; only paused, failed and timeout messages are resumed")
            }
            Action::Hold => format!("is already {status}"),
            Action::Release => format!("is {status}, not held"),
            // Every status but running is deleted and requeued.
            Action::Delete | Action::Requeue(_) => format!("is {status}"),
        }
    }
}

/// A repair function's answer, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The ids changed.
    pub changed: Vec<i64>,
    /// The ids with no row.
    pub not_found: Vec<i64>,
    /// The ids left alone, with their status.
    pub not_eligible: Vec<(i64, String)>,
}

impl Report {
    /// Sorts the rows `(id, status before or NULL, changed)` of a repair function.
    pub fn from_rows(rows: &[postgres::Row]) -> Report {
        let mut report = Report::default();
        for r in rows {
            let id: i64 = r.get(0);
            let status: Option<String> = r.get(1);
            let changed: bool = r.get(2);
            match (changed, status) {
                (true, _) => report.changed.push(id),
                (false, None) => report.not_found.push(id),
                (false, Some(s)) => report.not_eligible.push((id, s)),
            }
        }
        report
    }

    /// The exit: 65 when an id does not exist, else 69 when one was left alone, with
    /// one line per such id; else success.
    fn outcome(&self, action: &Action) -> Result<(), Failure> {
        let mut lines: Vec<String> = self
            .not_found
            .iter()
            .map(|id| format!("message {id}: no such message"))
            .collect();
        lines.extend(
            self.not_eligible
                .iter()
                .map(|(id, status)| format!("message {id}: {}", action.refusal(status))),
        );
        let code = if !self.not_found.is_empty() {
            EX_DATAERR
        } else if !self.not_eligible.is_empty() {
            EX_UNAVAILABLE
        } else {
            return Ok(());
        };
        Err(Failure::new(
            code,
            format!(
                "{}: {} of {} messages left unchanged:\n{}",
                action.name(),
                lines.len(),
                lines.len() + self.changed.len(),
                lines.join("\n")
            ),
        ))
    }

    /// The report as one JSON document.
    fn to_json(&self, action: &Action) -> Value {
        let mut o = json!({
            "command": action.name(),
            "changed": self.changed.len(),
            "ids": self.changed,
            "not_found": self.not_found,
            "not_eligible": self.not_eligible.iter()
                .map(|(id, status)| json!({"id": id, "status": status}))
                .collect::<Vec<_>>(),
        });
        if let Action::Requeue(stage) = action {
            o["stage"] = json!(stage);
        }
        o
    }

    /// The report for people: how many changed, and which.
    fn to_text(&self, action: &Action) -> String {
        let ids: Vec<String> = self.changed.iter().map(i64::to_string).collect();
        let plural = if self.changed.len() == 1 { "" } else { "s" };
        if ids.is_empty() {
            format!("{}: no message changed\n", action.name())
        } else {
            format!(
                "{} {} message{plural}: {}\n",
                action.done(),
                ids.len(),
                ids.join(" ")
            )
        }
    }
}

/// Runs a repair by ids: one call, then the report and the exit.
pub fn by_ids(
    session: &mut Session,
    action: Action,
    ids: &[i64],
    json: bool,
) -> Result<(), Failure> {
    if let Action::Requeue(stage) = &action {
        // Moved to a stage without a section, a message would never be claimed.
        if !session.configured_stages()?.contains(stage) {
            return Err(Failure::new(
                EX_DATAERR,
                format!(
                    "--stage {stage:?}: no [stage-{stage}] section in the configuration or the overlay; nothing was moved"
                ),
            ));
        }
    }
    let ids = ids.to_vec();
    let doing = format!("running {}", action.name());
    let rows = match &action {
        Action::Resume => session.client.query(sql::RESUME_EACH, &[&ids]),
        Action::Hold => session.client.query(sql::HOLD, &[&ids]),
        Action::Release => session.client.query(sql::RELEASE, &[&ids]),
        Action::Delete => session.client.query(sql::DELETE_MESSAGES, &[&ids]),
        Action::Requeue(stage) => session.client.query(sql::REQUEUE_TO, &[&ids, stage]),
    }
    .map_err(|e| db_failure(&doing, &e))?;
    let report = Report::from_rows(&rows);
    if json {
        emit_json(&report.to_json(&action))?;
    } else {
        emit(report.to_text(&action).as_bytes())?;
    }
    report.outcome(&action)
}

/// Runs `resume`: by ids, or every resumable message at a stage and/or in a status.
pub fn resume(session: &mut Session, what: ResumeWhat, json: bool) -> Result<(), Failure> {
    let (stage, status) = match what {
        ResumeWhat::Ids(ids) => return by_ids(session, Action::Resume, &ids, json),
        ResumeWhat::Matching { stage, status } => (stage, status),
    };
    if let Some(stage) = &stage {
        // Resumed at a stage without a section, a message would never be claimed; and a
        // misspelt stage must not look like a queue with nothing to resume.
        if !session.configured_stages()?.contains(stage) {
            return Err(Failure::new(
                EX_DATAERR,
                format!(
                    "--stage {stage:?}: no [stage-{stage}] section in the configuration or the overlay; nothing was resumed (requeue its messages to a stage that has one)"
                ),
            ));
        }
    }
    let n: i32 = session
        .client
        .query_one(sql::RESUME_MATCHING, &[&stage, &status])
        .map_err(|e| db_failure("running resume", &e))?
        .get(0);
    if json {
        emit_json(&json!({
            "command": "resume",
            "changed": n,
            "stage": stage,
            "status": status,
        }))
    } else {
        let plural = if n == 1 { "" } else { "s" };
        emit(format!("resumed {n} message{plural}\n").as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exit_says_what_was_left_alone_missing_ids_first() {
        let mut r = Report {
            changed: vec![1],
            not_found: vec![],
            not_eligible: vec![(3, "running".into())],
        };
        let e = r.outcome(&Action::Hold).unwrap_err();
        assert_eq!(e.code, 69);
        assert!(
            e.message
                .contains("message 3: is running: it belongs to a worker"),
            "{}",
            e.message
        );
        r.not_found.push(99);
        let e = r.outcome(&Action::Hold).unwrap_err();
        assert_eq!(e.code, 65);
        assert!(e.message.contains("message 99: no such message"));
        assert!(
            e.message.contains("2 of 3 messages left unchanged"),
            "{}",
            e.message
        );
        let ok = Report {
            changed: vec![1, 2],
            ..Report::default()
        };
        assert!(ok.outcome(&Action::Delete).is_ok());
        assert_eq!(ok.to_text(&Action::Delete), "deleted 2 messages: 1 2\n");
        assert_eq!(
            ok.to_json(&Action::Requeue("relay".into()))["stage"],
            "relay"
        );
        assert_eq!(Action::Release.refusal("pending"), "is pending, not held");
        assert_eq!(
            Action::Resume.refusal("held"),
            "is held; release it instead"
        );
    }
}
