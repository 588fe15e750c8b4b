//! The stage error model (SPEC §12.4): what a failed stage's message becomes. A
//! permanent error fails the row at once; a host error pauses it at the failing stage
//! with a backoff of 1, 2, 4 … minutes up to an hour, until the stage's `MAX_LIFETIME`
//! is spent, then moves it to `BOUNCE_STAGE` or fails it; connection and overload
//! errors only set the answer (74, 75), since nothing may be committed.
//!
//! Called by `chain.rs` (a stage or its set-up failed) and `batch.rs` (a row that cannot
//! be read into a message). It records the decision in the [`Plan`] (its write and
//! answer) and the message's state; it must not touch the database itself: the write is
//! `writes.rs`'s, guarded like every other.

use std::time::Duration;

use serde_json::{Value, json};

use super::runtime::Worker;
use super::writes::{Plan, Write, update_row};
use super::{ErrorClass, Message, StageError};
use crate::config::StageSection;
use crate::db::{self, ErrorKind};
use crate::protocol;

/// Host-error backoff: the first retry after this, doubling.
const BACKOFF_FIRST: Duration = Duration::from_secs(60);
/// Host-error backoff cap.
const BACKOFF_CAP: Duration = Duration::from_secs(3600);
/// `MAX_LIFETIME` for a stage without a section (one that cannot run at all).
const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(120 * 3600);

/// The host-error retry delay after `failures` consecutive failures at a stage: 1, 2,
/// 4 … minutes, capped at an hour.
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (BACKOFF_FIRST * (1u32 << doublings)).min(BACKOFF_CAP)
}

/// The answer for a database that could not be used: 75 for overload, else 74.
pub(super) fn status_for(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Overload => protocol::STATUS_TEMPFAIL,
        _ => protocol::STATUS_IOERR,
    }
}

impl Worker {
    /// The error model (§12.4), at the stage that failed; the chain up to it is
    /// committed by the same write (the row moves to that stage).
    pub(super) fn handle_error(
        &mut self,
        plan: &mut Plan,
        mut message: Message,
        stage: &str,
        section: Option<&StageSection>,
        error: StageError,
    ) {
        let claimed = plan.claimed.clone();
        let id = message.id;
        match error.class {
            ErrorClass::Connection => {
                log::warn!("{stage}: message {id}: database connection lost: {error}");
                plan.answer = protocol::STATUS_IOERR;
            }
            ErrorClass::Overload => {
                log::warn!("{stage}: message {id}: database overloaded: {error}");
                plan.answer = protocol::STATUS_TEMPFAIL;
            }
            ErrorClass::Permanent => {
                log::warn!("{stage}: message {id}: permanent error, failing it: {error}");
                mark_failed(&mut message, stage, "permanent", &error.message);
                plan.write = Write::Update(update_row(&message, &claimed, stage, "failed", None));
                plan.answer = protocol::STATUS_PERMANENT;
            }
            ErrorClass::Host => {
                let max_lifetime = section.map_or(DEFAULT_MAX_LIFETIME, |s| s.max_lifetime);
                if message.lifetime_age > max_lifetime {
                    mark_failed(&mut message, stage, "retries-exhausted", &error.message);
                    let bounce = section
                        .and_then(|s| s.bounce_stage.clone())
                        .filter(|_| !message.list_copy());
                    match bounce {
                        Some(bounce) => {
                            log::warn!(
                                "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), moving it to {bounce}: {error}",
                                max_lifetime.as_secs()
                            );
                            plan.write = Write::Update(update_row(
                                &message, &claimed, &bounce, "pending", None,
                            ));
                        }
                        None => {
                            log::warn!(
                                "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), failing it: {error}",
                                max_lifetime.as_secs()
                            );
                            plan.write = Write::Update(update_row(
                                &message, &claimed, stage, "failed", None,
                            ));
                            plan.answer = protocol::STATUS_EXHAUSTED;
                        }
                    }
                } else {
                    let same_stage =
                        message.state.get("temporary_stage").and_then(Value::as_str) == Some(stage);
                    let failures = if same_stage {
                        // Whatever the stored count holds (a string, a fraction, a
                        // number beyond u32) it must not overflow: garbage counts as
                        // none, a huge count as the largest.
                        let stored = message
                            .state
                            .get("temporary_failures")
                            .and_then(Value::as_u64)
                            .unwrap_or(0);
                        u32::try_from(stored).unwrap_or(u32::MAX).saturating_add(1)
                    } else {
                        1
                    };
                    let delay = backoff(failures);
                    log::warn!(
                        "{stage}: message {id}: host error, retry {failures} in {} min: {error}",
                        delay.as_secs() / 60
                    );
                    message
                        .state
                        .insert("last_error".into(), json!(error.message));
                    message
                        .state
                        .insert("temporary_failures".into(), json!(failures));
                    message.state.insert("temporary_stage".into(), json!(stage));
                    plan.write =
                        Write::Update(update_row(&message, &claimed, stage, "paused", Some(delay)));
                }
            }
        }
    }
}

/// Records why and where a message failed in its state.
fn mark_failed(message: &mut Message, stage: &str, class: &str, error: &str) {
    message
        .state
        .insert("last_error".into(), json!(db::storable(error)));
    message.state.insert("failed_stage".into(), json!(stage));
    message.state.insert("failure_class".into(), json!(class));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_a_minute_up_to_an_hour() {
        let mins: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs() / 60).collect();
        assert_eq!(mins, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(0), Duration::from_secs(60));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(3600));
    }
}
