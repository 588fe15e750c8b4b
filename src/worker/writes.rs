//! The worker's writes (§12.2, §12.3, §6 "Claim tokens"): committing a batch's
//! [`Plan`]s in one call of `pepsi.workqueue_write` and one of `pepsi.workqueue_finish`
//! (failures in place, splits and bounces one by one), the lazy split's
//! `workqueue_split` call, and what happens when a write fails or matches nothing.
//!
//! Called by `batch.rs` (commit a processed batch) and `chain.rs` (the lazy split
//! before a stage runs). Every write goes through a function of the schema that takes
//! the claim token the dispatcher handed with the id and writes only while the row is
//! `running` at its claimed stage under that token; a write that matches nothing
//! means the row was taken away: a warning and answer 0, never a retry. Free
//! functions over a connection: this file holds no state, must not decide outcomes
//! (the stages and the error model do) nor read stdin or write status lines.

use std::collections::HashSet;
use std::fmt::Write as _;

use postgres::types::Type;
use serde_json::{Value, json};

use super::errors::status_for;
use super::maillog;
use super::outcome::Notification;
use super::plan::{Plan, Write};
use super::record;
use crate::db::pool::PgConn;
use crate::db::{self, ErrorKind, sql};
use crate::escape::Visible;
use crate::protocol;

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

/// The two batched write statements.
#[derive(Clone, Copy)]
enum Shape {
    Update,
    Delete,
}

/// Writes every plan's outcome and then its delivery log lines.
pub(super) fn commit(conn: &mut PgConn, plans: &mut [Plan]) {
    for plan in plans.iter_mut() {
        annotate(plan);
    }
    write_all(conn, plans);
    for plan in plans.iter().filter(|p| p.written && !p.records.is_empty()) {
        maillog::records(&plan.about, &plan.records);
    }
}

/// Adds to an update's or a delete's element what it records: the trail of this pass
/// (a line `STAGE US AT` for each stage run: its time in microseconds, when the pass
/// ended in epoch milliseconds) and the records of the outcome.
fn annotate(plan: &mut Plan) {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut trail = String::with_capacity(plan.report.len() * 40);
    for (stage, us) in &plan.report {
        if stage.contains(char::is_whitespace) {
            trail.push_str(&stage.replace(char::is_whitespace, "_"));
        } else {
            trail.push_str(stage);
        }
        let _ = writeln!(trail, " {us} {at}");
    }
    let log = (!plan.records.is_empty()).then(|| record::to_json(&plan.records));
    let element = match &mut plan.write {
        Write::Update(v) => v,
        Write::Delete => {
            plan.write = Write::Done(json!({
                "id": plan.id,
                "claimed": plan.claimed,
                "claim": plan.claim,
            }));
            let Write::Done(v) = &mut plan.write else {
                unreachable!("just set")
            };
            v
        }
        _ => return,
    };
    if !trail.is_empty() {
        element["trail"] = Value::String(trail);
    }
    if let Some(log) = log {
        element["log"] = log;
    }
}

/// Writes every plan's outcome: failures in place, splits and bounces one by one
/// (all are rare), then one UPDATE and one DELETE.
fn write_all(conn: &mut PgConn, plans: &mut [Plan]) {
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
            Err(e) => write_failed(conn, std::slice::from_mut(plan), &e),
        }
    }
    for plan in plans.iter_mut() {
        if let Write::Bounce(notification) = &plan.write {
            let notification = notification.clone();
            bounce(conn, plan, &notification);
        }
    }
    let mut updates: Vec<&mut Plan> = plans
        .iter_mut()
        .filter(|p| matches!(p.write, Write::Update(_)))
        .collect();
    write_batch(conn, &mut updates, Shape::Update);
    let mut deletes: Vec<&mut Plan> = plans
        .iter_mut()
        .filter(|p| matches!(p.write, Write::Done(_)))
        .collect();
    write_batch(conn, &mut deletes, Shape::Delete);
}

/// Writes a [`Write::Bounce`]: the notification's row in, the original out, in one
/// guarded call.
fn bounce(conn: &mut PgConn, plan: &mut Plan, notification: &Notification) {
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
            maillog::returned(plan.id, dsn, &n.recipient, &plan.claimed);
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
        Err(e) => write_failed(conn, std::slice::from_mut(plan), &e),
    }
}

/// Writes these plans' outcomes of one shape in one statement; a batch the database
/// refuses for a reason of its own is written again one plan at a time.
fn write_batch(conn: &mut PgConn, plans: &mut [&mut Plan], shape: Shape) {
    if plans.is_empty() {
        return;
    }
    match run_shape(conn, plans, shape) {
        Ok(written) => {
            for plan in plans.iter_mut() {
                plan.written = written.contains(&plan.id);
                if !plan.written {
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
                write_batch(conn, std::slice::from_mut(plan), shape);
            }
        }
        Err(e) => {
            for plan in plans.iter_mut() {
                write_failed(conn, std::slice::from_mut(&mut **plan), &e);
            }
        }
    }
}

/// A write failed: connection and overload errors are answered as such (nothing was
/// committed); anything else pauses the row with the error as a last resort.
fn write_failed(conn: &mut PgConn, plans: &mut [Plan], err: &postgres::Error) {
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
    match result.map(|row| row.and_then(|r| r.get::<_, Option<i64>>(0))) {
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
    let new: Option<Vec<i64>> = row.get(0);
    if let Some(new) = &new {
        let groups: Vec<Vec<String>> = serde_json::from_str(groups).unwrap_or_default();
        let parts: Vec<(i64, Vec<String>)> = new
            .iter()
            .copied()
            .zip(groups.into_iter().skip(1))
            .collect();
        maillog::split(id, &parts, stage.unwrap_or(claimed));
    }
    Ok(new)
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
            let payload = Value::Array(rows).to_string();
            db::retry_transient(|| {
                conn.query_prepared(sql::WRITE_OUTCOMES, &[Type::TEXT], &[&payload])
            })?
        }
        Shape::Delete => {
            let rows: Vec<Value> = plans
                .iter()
                .filter_map(|p| match &p.write {
                    Write::Done(v) => Some(v.clone()),
                    _ => None,
                })
                .collect();
            let payload = Value::Array(rows).to_string();
            db::retry_transient(|| {
                conn.query_prepared(sql::DELETE_FINISHED, &[Type::TEXT], &[&payload])
            })?
        }
    };
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}
