//! The worker's writes (SPEC §12.2, §12.3, §6 "Claim tokens"): what one batch entry
//! writes ([`Plan`], [`Write`]), committing a batch in one UPDATE and one DELETE (splits
//! one by one), and what happens when a write fails or matches nothing.
//!
//! Called by `batch.rs` (commit a processed batch), `chain.rs` (the lazy split before a
//! stage runs, the JSON of an update-shaped outcome) and `errors.rs` (the same JSON).
//! Every write is guarded by `status = 'running' AND stage = <claimed stage> AND claim =
//! <token read with the row>`; a write that matches nothing means the row was taken
//! away: a warning and answer 0, never a retry. This file must not decide outcomes (the
//! stages and the error model do) nor read stdin or write status lines.

use std::collections::HashSet;
use std::time::Duration;

use postgres::types::Type;
use serde_json::{Value, json};

use super::errors::status_for;
use super::runtime::Worker;
use super::{Message, Notification};
use crate::db::pool::PgConn;
use crate::db::{self, ErrorKind, sql};
use crate::escape::Visible;
use crate::protocol::{self, StageTime};

/// What a batch entry writes.
pub(super) enum Write {
    /// No write: the row was gone or taken away, or the database failed.
    Nothing,
    /// An update-shaped outcome (advance, pause, fail, redirect): one element of
    /// [`sql::WRITE_OUTCOMES`]'s recordset, made by [`update_row`].
    Update(Value),
    /// Delete the row: the message is done.
    Delete,
    /// Fail the row at its claimed stage without rewriting its state (the worker could
    /// not load or read it): [`sql::FAIL_IN_PLACE`] merges these failure keys into the
    /// stored state.
    Fail {
        /// `state.failure_class`.
        class: &'static str,
        /// `state.last_error`.
        error: String,
    },
    /// Split the row; every group continues at `stage`, pending.
    Split {
        groups: Value,
        stage: String,
        state: String,
    },
    /// Replace the row by this delivery status notification.
    Bounce(Box<Notification>),
}

/// One id of a batch: what to write, under which guard, and what to answer.
pub(super) struct Plan {
    /// The message id.
    pub(super) id: i64,
    /// The stage the row was claimed at (the write's guard).
    pub(super) claimed: String,
    /// The claim token read with the row (the write's guard).
    pub(super) claim: i64,
    /// The status to answer.
    pub(super) answer: u8,
    /// The stages run in this pass, with their times.
    pub(super) report: Vec<StageTime>,
    /// What to write.
    pub(super) write: Write,
}

impl Plan {
    /// A plan that writes nothing and answers `answer`.
    pub(super) fn answer_only(id: i64, answer: u8) -> Plan {
        Plan {
            id,
            claimed: String::new(),
            claim: 0,
            answer,
            report: Vec::new(),
            write: Write::Nothing,
        }
    }

    /// A plan for a loaded message, guarded by its claimed stage and token; so far it
    /// writes nothing and answers 0.
    pub(super) fn for_message(message: &Message) -> Plan {
        Plan {
            id: message.id,
            claimed: message.claimed_stage.clone(),
            claim: message.claim,
            answer: protocol::STATUS_OK,
            report: Vec::new(),
            write: Write::Nothing,
        }
    }
}

/// How many times a worker tries to write an outcome the database refuses for a
/// non-connection reason before it gives up and fails the row `unwritable`: attempts
/// 1 to 4 pause it for 1, 2, 4 and 8 minutes, the 5th fails it, about a quarter of an
/// hour after the first. Serialization failures and deadlocks are re-run inside each
/// attempt (`db::retry_transient`) and a lost connection is no attempt (it answers 74),
/// so what is left is a refusal of this very outcome (a constraint, a trigger, a value
/// out of range): it rarely clears by itself, and every attempt re-runs the stage's
/// side effects (a delivery by `exec`), so a few attempts bound the duplicates, while a
/// quarter of an hour leaves an operator who is fixing a constraint or trigger the time
/// to do so before messages fail.
pub(super) const UNWRITABLE_ATTEMPTS: i32 = 5;

/// The longest pause a stage's outcome may ask for: far beyond any retry policy, and
/// far within what a `timestamptz` can hold (a pause beyond it would make the write
/// fail).
const MAX_PAUSE: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

/// The two batched write statements.
#[derive(Clone, Copy)]
enum Shape {
    Update,
    Delete,
}

impl Worker {
    /// Writes every plan's outcome: failures in place and splits one by one (both are
    /// rare), then one UPDATE and one DELETE.
    pub(super) fn commit(&mut self, conn: &mut PgConn, plans: &mut [Plan]) {
        for plan in plans.iter_mut() {
            if let Write::Fail { class, error } = &plan.write {
                let (class, error) = (*class, error.clone());
                fail_in_place(conn, plan, class, &error);
            }
        }
        for plan in plans.iter_mut() {
            let Write::Split {
                groups,
                stage,
                state,
            } = &plan.write
            else {
                continue;
            };
            let (groups, stage, state) = (groups.to_string(), stage.clone(), state.clone());
            let result = split_row(
                conn,
                plan.id,
                &groups,
                &plan.claimed,
                plan.claim,
                Some(&stage),
                Some(&state),
                true,
            );
            match result {
                Ok(None) => {
                    log::warn!(
                        "{}: message {} was taken away; its split was not written",
                        plan.claimed,
                        plan.id
                    );
                }
                Ok(_) => {}
                Err(e) => self.write_failed(conn, std::slice::from_mut(plan), &e),
            }
        }
        for plan in plans.iter_mut() {
            if let Write::Bounce(notification) = &plan.write {
                let notification = notification.clone();
                self.bounce(conn, plan, &notification);
            }
        }
        let mut updates: Vec<&mut Plan> = plans
            .iter_mut()
            .filter(|p| matches!(p.write, Write::Update(_)))
            .collect();
        self.write_batch(conn, &mut updates, Shape::Update);
        let mut deletes: Vec<&mut Plan> = plans
            .iter_mut()
            .filter(|p| matches!(p.write, Write::Delete))
            .collect();
        self.write_batch(conn, &mut deletes, Shape::Delete);
    }

    /// Writes a [`Write::Bounce`]: the notification's row in, the original out, in one
    /// guarded call.
    fn bounce(&mut self, conn: &mut PgConn, plan: &mut Plan, notification: &Notification) {
        let n = notification;
        let result = db::retry_transient(|| {
            conn.query_typed_one(
                sql::BOUNCE,
                &[
                    (&plan.id, Type::INT8),
                    (&plan.claimed, Type::TEXT),
                    (&plan.claim, Type::INT8),
                    (&n.stage, Type::TEXT),
                    (&n.recipient, Type::TEXT),
                    (&n.header_from, Type::TEXT),
                    (&n.subject, Type::TEXT),
                    (&n.headers, Type::BYTEA),
                    (&n.body, Type::BYTEA),
                ],
            )
        });
        match result.map(|row| row.get::<_, Option<i64>>(0)) {
            Ok(Some(dsn)) => {
                log::info!(
                    "{}: message {}: delivery status notification {dsn} to <{}> queued at {}",
                    plan.claimed,
                    plan.id,
                    Visible(&n.recipient),
                    n.stage
                );
                plan.write = Write::Nothing;
            }
            Ok(None) => {
                log::warn!(
                    "{}: message {} was taken away; its delivery status notification was not written",
                    plan.claimed,
                    plan.id
                );
                plan.write = Write::Nothing;
            }
            Err(e) => self.write_failed(conn, std::slice::from_mut(plan), &e),
        }
    }

    fn write_batch(&mut self, conn: &mut PgConn, plans: &mut [&mut Plan], shape: Shape) {
        if plans.is_empty() {
            return;
        }
        match run_shape(conn, plans, shape) {
            Ok(written) => {
                for plan in plans.iter_mut() {
                    if !written.contains(&plan.id) {
                        log::warn!(
                            "{}: message {} was taken away while this worker held it; its outcome was not written",
                            plan.claimed,
                            plan.id
                        );
                        plan.answer = protocol::STATUS_OK;
                    }
                }
            }
            Err(e) if plans.len() > 1 && db::classify(&e) == ErrorKind::Other => {
                // One bad row must not hold up its batch: write them one at a time.
                log::warn!(
                    "batched write failed ({}); writing one message at a time",
                    db::describe(&e)
                );
                for plan in plans.iter_mut() {
                    self.write_batch(conn, std::slice::from_mut(plan), shape);
                }
            }
            Err(e) => {
                for plan in plans.iter_mut() {
                    self.write_failed(conn, std::slice::from_mut(&mut **plan), &e);
                }
            }
        }
    }

    /// A write failed: connection and overload errors are answered as such (nothing was
    /// committed); anything else pauses the row with the error as a last resort.
    fn write_failed(&mut self, conn: &mut PgConn, plans: &mut [Plan], err: &postgres::Error) {
        for plan in plans {
            plan.write = Write::Nothing;
            plan.answer = match db::classify(err) {
                ErrorKind::Connection => {
                    log::warn!(
                        "{}: message {}: database connection lost while writing: {}",
                        plan.claimed,
                        plan.id,
                        db::describe(err)
                    );
                    protocol::STATUS_IOERR
                }
                ErrorKind::Overload => protocol::STATUS_TEMPFAIL,
                _ => pause_or_fail_unwritten(conn, plan, err),
            };
        }
    }
}

/// Writing an outcome failed for a non-connection reason: pause the row at its claimed
/// stage with the error, as a last resort, so it is retried; or, at the
/// [`UNWRITABLE_ATTEMPTS`]th such attempt, fail it `unwritable`. Guarded like every
/// write; the state is merged server-side.
fn pause_or_fail_unwritten(conn: &mut PgConn, plan: &Plan, err: &postgres::Error) -> u8 {
    let error = db::storable(&format!("cannot write the outcome: {}", db::describe(err)));
    let result = db::retry_transient(|| {
        conn.query_typed_opt(
            sql::PAUSE_OR_FAIL_UNWRITTEN,
            &[
                (&plan.id, Type::INT8),
                (&plan.claimed, Type::TEXT),
                (&error, Type::TEXT),
                (&plan.claim, Type::INT8),
                (&UNWRITABLE_ATTEMPTS, Type::INT4),
            ],
        )
    });
    match result {
        Ok(Some(row)) => {
            let attempt: i64 = row.get(2);
            match row.get::<_, Option<i64>>(1) {
                Some(minutes) => {
                    log::warn!(
                        "{}: message {}: {}; attempt {attempt} of {UNWRITABLE_ATTEMPTS}, paused for {minutes} min",
                        plan.claimed,
                        plan.id,
                        Visible(&error)
                    );
                    protocol::STATUS_OK
                }
                None => {
                    log::warn!(
                        "{}: message {}: {}; attempt {attempt} of {UNWRITABLE_ATTEMPTS}, failing it as unwritable",
                        plan.claimed,
                        plan.id,
                        Visible(&error)
                    );
                    protocol::STATUS_EXHAUSTED
                }
            }
        }
        Ok(None) => {
            log::warn!(
                "{}: message {}: {}; it was no longer running there",
                plan.claimed,
                plan.id,
                Visible(&error)
            );
            protocol::STATUS_OK
        }
        Err(e) => {
            log::warn!(
                "{}: message {}: {}; cannot pause it either: {}",
                plan.claimed,
                plan.id,
                Visible(&error),
                db::describe(&e)
            );
            status_for(db::classify(&e))
        }
    }
}

/// Writes a [`Write::Fail`]: the row fails at its claimed stage with these failure keys
/// merged into its stored state, in one guarded statement; sets the plan's answer when
/// the row was taken away or the write failed.
fn fail_in_place(conn: &mut PgConn, plan: &mut Plan, class: &str, error: &str) {
    let error = db::storable(error);
    let result = db::retry_transient(|| {
        conn.query_typed_opt(
            sql::FAIL_IN_PLACE,
            &[
                (&plan.id, Type::INT8),
                (&plan.claimed, Type::TEXT),
                (&plan.claim, Type::INT8),
                (&class, Type::TEXT),
                (&error, Type::TEXT),
            ],
        )
    });
    match result {
        Ok(Some(_)) => {}
        Ok(None) => {
            log::warn!(
                "{}: message {} was taken away; its failure ({class}) was not written",
                plan.claimed,
                plan.id
            );
            plan.answer = protocol::STATUS_OK;
        }
        Err(e) => {
            // Nothing was written; the dispatcher defers the row and it is loaded again.
            let answer = status_for(db::classify(&e));
            log::warn!(
                "{}: message {}: cannot fail it ({class}: {}): {}; answering {answer}",
                plan.claimed,
                plan.id,
                Visible(&error),
                db::describe(&e)
            );
            plan.answer = answer;
        }
    }
    plan.write = Write::Nothing;
}

/// Calls `workqueue_split` (one round trip), guarded by the claimed stage and the claim
/// token; `None` when the guard did not match.
#[allow(clippy::too_many_arguments)]
pub(super) fn split_row(
    conn: &mut PgConn,
    id: i64,
    groups: &str,
    claimed: &str,
    claim: i64,
    stage: Option<&str>,
    state: Option<&str>,
    release: bool,
) -> Result<Option<Vec<i64>>, postgres::Error> {
    let row = db::retry_transient(|| {
        conn.query_typed_one(
            sql::SPLIT,
            &[
                (&id, Type::INT8),
                (&groups, Type::TEXT),
                (&claimed, Type::TEXT),
                (&stage, Type::TEXT),
                (&state, Type::TEXT),
                (&release, Type::BOOL),
                (&claim, Type::INT8),
            ],
        )
    })?;
    Ok(row.get(0))
}

/// Runs one batched write; returns the ids it wrote (the others were taken away).
fn run_shape(
    conn: &mut PgConn,
    plans: &[&mut Plan],
    shape: Shape,
) -> Result<HashSet<i64>, postgres::Error> {
    let rows = match shape {
        Shape::Update => {
            let rows: Vec<Value> = plans
                .iter()
                .filter_map(|p| match &p.write {
                    Write::Update(v) => Some(v.clone()),
                    _ => None,
                })
                .collect();
            let statement = update_statement(&rows);
            let payload = Value::Array(rows).to_string();
            db::retry_transient(|| conn.query_prepared(statement, &[Type::TEXT], &[&payload]))?
        }
        Shape::Delete => {
            let ids: Vec<i64> = plans.iter().map(|p| p.id).collect();
            let claimed: Vec<String> = plans.iter().map(|p| p.claimed.clone()).collect();
            let claims: Vec<i64> = plans.iter().map(|p| p.claim).collect();
            db::retry_transient(|| {
                conn.query_prepared(
                    sql::DELETE_FINISHED,
                    &[Type::INT8_ARRAY, Type::TEXT_ARRAY, Type::INT8_ARRAY],
                    &[&ids, &claimed, &claims],
                )
            })?
        }
    };
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}

/// The statement that writes these elements of [`sql::WRITE_OUTCOMES`]'s recordset:
/// [`sql::WRITE_ADVANCES`] when no stage rewrote a message's envelope or metadata, so
/// the stored `sender_key` is not computed again for every row.
fn update_statement(rows: &[Value]) -> &'static str {
    if rows.iter().any(|r| r["rewritten"] == Value::Bool(true)) {
        sql::WRITE_OUTCOMES
    } else {
        sql::WRITE_ADVANCES
    }
}

/// One element of [`sql::WRITE_OUTCOMES`]'s recordset: the message's outcome, guarded by
/// the stage it was claimed at (`claimed`) and the claim token it was loaded under.
pub(super) fn update_row(
    message: &Message,
    claimed: &str,
    stage: &str,
    status: &str,
    delay: Option<Duration>,
) -> Value {
    let mut row = json!({
        "id": message.id,
        "claimed": claimed,
        "claim": message.claim,
        "stage": stage,
        "status": status,
        "delay_ms": delay.map(|d| d.min(MAX_PAUSE).as_millis() as u64),
        "state": Value::Object(message.state.clone()),
        "rewritten": message.rewritten(),
    });
    if message.rewritten() {
        row["mail_from"] = json!(message.mail_from());
        row["rcpt_to"] = json!(message.rcpt_to());
        row["header_from"] = json!(message.header_from());
        row["subject"] = json!(message.subject());
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Message 7 from a@x.example to r@y.example, claimed at `relay`.
    fn relay_message() -> Message {
        Message::new(
            7,
            "relay".into(),
            "a@x.example".into(),
            vec!["r@y.example".into()],
            None,
            None,
            Default::default(),
            "from:x.example".into(),
        )
    }

    #[test]
    fn an_update_row_carries_the_claim_token_it_is_guarded_by() {
        let mut m = relay_message();
        m.claim = 42;
        let row = update_row(&m, "relay", "done", "pending", None);
        assert_eq!(row["id"], 7);
        assert_eq!(row["claimed"], "relay");
        assert_eq!(row["claim"], 42);
        let plan = Plan::for_message(&m);
        assert_eq!(
            (plan.id, plan.claimed.as_str(), plan.claim),
            (7, "relay", 42)
        );
    }

    #[test]
    fn only_a_batch_with_a_rewritten_message_writes_the_envelope() {
        let mut plain = relay_message();
        let row = update_row(&plain, "relay", "done", "pending", None);
        assert_eq!(
            update_statement(std::slice::from_ref(&row)),
            sql::WRITE_ADVANCES
        );
        plain.set_mail_from("b@z.example".into());
        let rewritten = update_row(&plain, "relay", "done", "pending", None);
        assert_eq!(rewritten["mail_from"], "b@z.example");
        assert_eq!(update_statement(&[row, rewritten]), sql::WRITE_OUTCOMES);
    }

    #[test]
    fn a_pause_beyond_a_century_is_cut_to_one_the_database_can_store() {
        let m = Message::new(
            7,
            "relay".into(),
            String::new(),
            vec!["r@y.example".into()],
            None,
            None,
            Default::default(),
            String::new(),
        );
        let row = update_row(&m, "relay", "relay", "paused", Some(Duration::MAX));
        assert_eq!(row["delay_ms"], MAX_PAUSE.as_millis() as u64);
        assert!(row["delay_ms"].as_i64().is_some(), "fits a bigint");
        let row = update_row(
            &m,
            "relay",
            "relay",
            "paused",
            Some(Duration::from_secs(60)),
        );
        assert_eq!(row["delay_ms"], 60_000);
    }

    #[test]
    fn a_state_keeps_numbers_beyond_f64_and_u64_exactly() {
        let text = r#"{"n":1e400,"big":123456789012345678901234567890,"trailing":1.50,"small":7}"#;
        let state: Value = serde_json::from_str(text).unwrap();
        // Keys come out sorted and an exponent signed; the numbers keep every digit.
        assert_eq!(
            state.to_string(),
            r#"{"big":123456789012345678901234567890,"n":1e+400,"small":7,"trailing":1.50}"#
        );
        assert_eq!(state["small"].as_u64(), Some(7));
        assert_eq!(state["small"].as_i64(), Some(7));
        assert_eq!(state["big"].as_u64(), None, "beyond u64: not a u64");
        assert_eq!(state["trailing"].as_f64(), Some(1.5));
    }
}
