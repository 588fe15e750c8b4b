//! Per-recipient outcomes (§12.5, §17): a stage that gives each recipient its own
//! result ([`Outcome::Recipients`]: done, deferred, failed) gets one outcome per group
//! of recipients that share a result, through the lazy split.
//!
//! Recipients that all share one result are no split: the result is the message's
//! outcome (an advance or finish, a host error, a permanent error with each
//! recipient's `state.dsn_status` and `state.dsn_diagnostic`). A mixed result is
//! written in two round trips, in this order:
//!
//! 1. `workqueue_split`, guarded by the claimed stage and the claim token: the first
//!    group (the done recipients, when there are any) stays on the row, still running
//!    under the claim; every other group becomes a pending row at the stage. Every row
//!    of the split carries the whole verdict in `state.recipient_outcomes`;
//! 2. the batch write of the kept group's outcome, which drops the verdict.
//!
//! A row that comes to the stage carrying a verdict for each of its recipients takes
//! its outcome from the verdict and never runs the stage again ([`take_recorded`]):
//! that is how the split-off groups get theirs, at their first claim, and how the kept
//! group gets its own when the worker or the database died between the two writes (the
//! dispatcher recovers the row as after any crash). No recipient is lost (every group
//! is a row from the split on) nor handed over twice (no row with a verdict runs the
//! stage for it again). A split the database refuses (other than by losing the
//! connection) pauses the row with the verdict on it: its retry splits again from the
//! verdict instead of handing the message over again.
//!
//! Called by `chain.rs`; uses `writes.rs` for the split. It must not read stdin, write
//! status lines nor decide an error's fate (that is `errors.rs`'s, after it).

use serde_json::{Map, Value, json};

use super::message::Message;
use super::outcome::{Outcome, RecipientOutcomes, RecipientResult, StageError};
use super::plan::Plan;
use super::record::Handed;
use super::writes::split_row;
use crate::escape::Visible;

/// The state key of a verdict carried by the rows of a per-recipient split.
pub(super) const RECORD: &str = "recipient_outcomes";

/// The result of recipients a stage gave none for.
const NO_RESULT: &str = "the stage gave no result for this recipient";

/// A result as the verdict stores it.
fn result_json(result: &RecipientResult) -> Value {
    match result {
        RecipientResult::Done => json!({"result": "done"}),
        RecipientResult::Deferred(error) => json!({"result": "deferred", "error": error}),
        RecipientResult::Failed {
            error,
            status,
            diagnostic,
        } => json!({
            "result": "failed",
            "error": error,
            "status": status,
            "diagnostic": diagnostic,
        }),
    }
}

/// A result as the verdict stores it, read back; `None` for anything else.
fn result_of(value: &Value) -> Option<RecipientResult> {
    let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_string);
    match value.get("result")?.as_str()? {
        "done" => Some(RecipientResult::Done),
        "deferred" => Some(RecipientResult::Deferred(text("error")?)),
        "failed" => Some(RecipientResult::Failed {
            error: text("error")?,
            status: text("status")?,
            diagnostic: text("diagnostic"),
        }),
        _ => None,
    }
}

/// The verdict for `outcomes` at `stage`, as stored in `state.recipient_outcomes`.
fn record(stage: &str, outcomes: &RecipientOutcomes) -> Value {
    let rcpt: Map<String, Value> = outcomes
        .results
        .iter()
        .map(|(address, result)| (address.clone(), result_json(result)))
        .collect();
    json!({
        "stage": stage,
        "next": outcomes.next,
        "rcpt": rcpt,
        "relay": outcomes.relay,
        "accepted": outcomes.accepted,
    })
}

/// Takes a verdict off the message's state: the outcomes it records for the message's
/// recipients, when it was recorded at `stage` and holds a readable result for every
/// one of them; otherwise the verdict is dropped and the stage runs as usual.
pub(super) fn take_recorded(message: &mut Message, stage: &str) -> Option<RecipientOutcomes> {
    let verdict = message.state.remove(RECORD)?;
    if verdict.get("stage").and_then(Value::as_str) != Some(stage) {
        return None;
    }
    let next = match verdict.get("next") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Null) | None => None,
        Some(_) => return None,
    };
    let rcpt = verdict.get("rcpt")?.as_object()?;
    let results = message
        .rcpt_to()
        .iter()
        .map(|address| Some((address.clone(), result_of(rcpt.get(address)?)?)))
        .collect::<Option<Vec<_>>>()?;
    let text = |key: &str| verdict.get(key).and_then(Value::as_str).map(str::to_string);
    Some(RecipientOutcomes {
        next,
        results,
        relay: text("relay"),
        accepted: text("accepted"),
    })
}

/// The recipients grouped by the kind of their result (done, deferred, failed, in
/// that order), each in `rcpt_to` order; a recipient without a result is deferred.
fn grouped(
    rcpt_to: &[String],
    outcomes: &RecipientOutcomes,
) -> Vec<Vec<(String, RecipientResult)>> {
    let mut groups: Vec<Vec<(String, RecipientResult)>> = vec![Vec::new(), Vec::new(), Vec::new()];
    // By address, once: a message may have thousands of recipients.
    let by_address: std::collections::HashMap<&str, &RecipientResult> = outcomes
        .results
        .iter()
        .map(|(a, r)| (a.as_str(), r))
        .collect();
    for address in rcpt_to {
        let result = by_address
            .get(address.as_str())
            .map(|r| (*r).clone())
            .unwrap_or_else(|| RecipientResult::Deferred(NO_RESULT.into()));
        groups[usize::from(result.kind())].push((address.clone(), result));
    }
    groups.retain(|g| !g.is_empty());
    groups
}

/// The most distinct error texts [`joined`] lists; the rest are counted.
const JOINED_ERRORS: usize = 5;

/// The distinct texts of `errors`, joined: the first [`JOINED_ERRORS`] of them and how
/// many more there were (a message may have thousands of recipients, each refused
/// with its own text, and this goes to a log line and `state.last_error`).
fn joined<'a>(errors: impl Iterator<Item = &'a String>) -> String {
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut listed: Vec<&str> = Vec::new();
    for e in errors {
        if seen.insert(e.as_str()) && listed.len() < JOINED_ERRORS {
            listed.push(e);
        }
    }
    let mut text = listed.join("; ");
    if seen.len() > listed.len() {
        text.push_str(&format!("; and {} more", seen.len() - listed.len()));
    }
    text
}

/// The outcome of recipients that share one kind of result: an advance or finish, a
/// host error, or a permanent error that leaves each recipient's status and
/// diagnostic in the message's state for its delivery status notification.
fn uniform(
    message: &mut Message,
    next: Option<String>,
    group: &[(String, RecipientResult)],
) -> Result<Outcome, StageError> {
    match group.first().map(|(_, r)| r) {
        None | Some(RecipientResult::Done) => Ok(next.map_or(Outcome::Finish, Outcome::Advance)),
        Some(RecipientResult::Deferred(_)) => {
            let reason = joined(group.iter().filter_map(|(_, r)| match r {
                RecipientResult::Deferred(e) => Some(e),
                _ => None,
            }));
            Err(StageError::deferred(reason))
        }
        Some(RecipientResult::Failed { .. }) => {
            let mut statuses = Map::new();
            let mut diagnostics = Map::new();
            let mut errors = Vec::new();
            for (address, result) in group {
                if let RecipientResult::Failed {
                    error,
                    status,
                    diagnostic,
                } = result
                {
                    statuses.insert(address.clone(), json!(status));
                    if let Some(d) = diagnostic {
                        diagnostics.insert(address.clone(), json!(d));
                    }
                    errors.push(error);
                }
            }
            message
                .state
                .insert("dsn_status".into(), Value::Object(statuses));
            if diagnostics.is_empty() {
                message.state.remove("dsn_diagnostic");
            } else {
                message
                    .state
                    .insert("dsn_diagnostic".into(), Value::Object(diagnostics));
            }
            Err(StageError::permanent(joined(errors.into_iter())))
        }
    }
}

/// Settles a per-recipient outcome that `stage` gave the message: the outcome (or
/// error) of the recipients that stay on the row, after splitting off the others when
/// the results differ. `None` when the row was taken away before its split. A split
/// at a fused stage moves the row there (still running under the claim), and the
/// plan's guard with it.
pub(super) fn settle(
    conn: &mut crate::db::pool::PgConn,
    message: &mut Message,
    plan: &mut Plan,
    stage: &str,
    outcomes: RecipientOutcomes,
) -> Option<Result<Outcome, StageError>> {
    plan.handed = Some(Handed::from_results(
        outcomes.relay.clone(),
        outcomes.accepted.as_deref(),
        &outcomes.results,
    ));
    let groups = grouped(message.rcpt_to(), &outcomes);
    if groups.len() <= 1 {
        let group = groups.into_iter().next().unwrap_or_default();
        return Some(uniform(message, outcomes.next, &group));
    }
    let addresses: Vec<Vec<&String>> = groups
        .iter()
        .map(|g| g.iter().map(|(a, _)| a).collect())
        .collect();
    let mut state = message.state.clone();
    state.insert(RECORD.into(), record(stage, &outcomes));
    let moved = (stage != plan.claimed).then_some(stage);
    let split = split_row(
        conn,
        message.id,
        &json!(addresses).to_string(),
        &plan.claimed,
        plan.claim,
        moved,
        Some(&Value::Object(state).to_string()),
        false,
    );
    match split {
        Err(e) => {
            // Refused (not a lost connection: then nothing is written at all): the
            // row is retried carrying the verdict, so its next claim takes the
            // outcomes from it and splits again, and the recipients already delivered
            // are not handed over a second time. Only at the claimed stage, where the
            // retry comes back to.
            if moved.is_none() {
                message
                    .state
                    .insert(RECORD.into(), record(stage, &outcomes));
            }
            Some(Err(StageError::from_db(&e)))
        }
        Ok(None) => {
            log::warn!(
                "{}: message {} was taken away before its per-recipient split",
                plan.claimed,
                message.id
            );
            None
        }
        Ok(Some(new)) => {
            log::info!(
                "{stage}: message {}: recipients with different results split into {} rows (new: {new:?}); kept: {}",
                message.id,
                new.len() + 1,
                Visible(
                    &addresses[0]
                        .iter()
                        .map(|a| a.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                )
            );
            let kept = groups.into_iter().next().unwrap_or_default();
            message.keep_recipients(kept.iter().map(|(a, _)| a.clone()).collect());
            if moved.is_some() {
                plan.claimed = stage.to_string();
                message.claimed_stage = stage.to_string();
            }
            Some(uniform(message, outcomes.next, &kept))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(rcpts: &[&str]) -> Message {
        Message::new(
            7,
            "relay".into(),
            "a@x.example".into(),
            rcpts.iter().map(|r| r.to_string()).collect(),
            None,
            None,
            Default::default(),
            "from:x.example".into(),
        )
    }

    #[test]
    fn deferred_recipients_leave_their_reason_for_a_notification_should_the_message_expire() {
        let deferred = |reason: &str| {
            let group = vec![("b@y".to_string(), RecipientResult::Deferred(reason.into()))];
            uniform(&mut message(&["b@y"]), None, &group).unwrap_err()
        };
        let e = deferred("connect to 127.0.0.1:10026: Connection refused");
        assert_eq!(e.class, crate::worker::ErrorClass::Host);
        assert_eq!(
            e.dsn,
            Some(crate::worker::DsnReason {
                status: "4.4.7".into(),
                diagnostic: Some("x-pepsi; connect to 127.0.0.1:10026: Connection refused".into()),
            })
        );
        let e = deferred("smarthost deferred RCPT: 452 4.2.2 mailbox full");
        assert_eq!(e.dsn.unwrap().status, "4.2.2", "the reply's own status");
        assert_eq!(deferred("451 4.3 x 5.1.1").dsn.unwrap().status, "4.4.7");
    }

    fn failed(status: &str) -> RecipientResult {
        RecipientResult::Failed {
            error: format!("refused {status}"),
            status: status.into(),
            diagnostic: Some(format!("smtp; 550 {status} no")),
        }
    }

    fn mixed() -> RecipientOutcomes {
        RecipientOutcomes {
            next: Some("done".into()),
            results: vec![
                ("c@y".into(), failed("5.1.1")),
                ("a@y".into(), RecipientResult::Done),
                ("b@y".into(), RecipientResult::Deferred("451 later".into())),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn recipients_are_grouped_done_deferred_failed_and_a_missing_one_is_deferred() {
        let g = grouped(
            &["a@y".into(), "b@y".into(), "c@y".into(), "d@y".into()],
            &mixed(),
        );
        let names: Vec<Vec<&str>> = g
            .iter()
            .map(|g| g.iter().map(|(a, _)| a.as_str()).collect())
            .collect();
        assert_eq!(names, vec![vec!["a@y"], vec!["b@y", "d@y"], vec!["c@y"]]);
        assert_eq!(g[1][1].1, RecipientResult::Deferred(NO_RESULT.into()));
    }

    #[test]
    fn a_verdict_read_back_gives_each_recipient_its_result_at_its_stage_only() {
        let mut m = message(&["b@y", "c@y"]);
        m.state.insert(RECORD.into(), record("relay", &mixed()));
        let got = take_recorded(&mut m, "relay").unwrap();
        assert!(!m.state.contains_key(RECORD), "taken off the state");
        assert_eq!(got.next.as_deref(), Some("done"));
        assert_eq!(
            got.results,
            vec![
                ("b@y".into(), RecipientResult::Deferred("451 later".into())),
                ("c@y".into(), failed("5.1.1")),
            ]
        );
        let mut elsewhere = message(&["b@y"]);
        elsewhere
            .state
            .insert(RECORD.into(), record("relay", &mixed()));
        assert_eq!(take_recorded(&mut elsewhere, "other"), None);
        let mut stranger = message(&["b@y", "z@y"]);
        stranger
            .state
            .insert(RECORD.into(), record("relay", &mixed()));
        assert_eq!(take_recorded(&mut stranger, "relay"), None, "z@y has none");
        assert!(!stranger.state.contains_key(RECORD), "dropped all the same");
    }

    #[test]
    fn failed_recipients_leave_their_status_and_diagnostic_per_address() {
        let mut m = message(&["c@y", "e@y"]);
        let group = vec![
            ("c@y".into(), failed("5.1.1")),
            ("e@y".into(), failed("5.2.2")),
        ];
        let e = uniform(&mut m, None, &group).unwrap_err();
        assert_eq!(e.class, crate::worker::ErrorClass::Permanent);
        assert_eq!(
            m.state["dsn_status"],
            json!({"c@y": "5.1.1", "e@y": "5.2.2"})
        );
        assert_eq!(m.state["dsn_diagnostic"]["e@y"], "smtp; 550 5.2.2 no");
        assert_eq!(
            uniform(
                &mut m,
                Some("n".into()),
                &[("c@y".into(), RecipientResult::Done)]
            ),
            Ok(Outcome::Advance("n".into()))
        );
        assert_eq!(uniform(&mut m, None, &[]), Ok(Outcome::Finish));
    }

    #[test]
    fn the_joined_errors_are_bounded() {
        let errors: Vec<String> = (0..1000)
            .map(|i| format!("550 5.1.1 <r{i}@x>: unknown"))
            .collect();
        let text = super::joined(errors.iter().chain(errors.iter()));
        assert!(
            text.starts_with("550 5.1.1 <r0@x>: unknown; 550 5.1.1 <r1@x>: unknown"),
            "{text}"
        );
        assert!(text.ends_with("; and 995 more"), "{text}");
        assert_eq!(
            super::joined(["a".to_string(), "a".to_string()].iter()),
            "a"
        );
    }
}
