//! The stage error model (§12.4): what a failed stage's message becomes. A
//! permanent error fails the row at once; a host error pauses it at the failing stage
//! with a backoff of 1, 2, 4 … minutes up to an hour, until the stage's `MAX_LIFETIME`
//! is spent, then moves it to `BOUNCE_STAGE` or fails it (a mailing-list copy is never
//! bounced); connection and overload errors only set the answer (74, 75), since nothing
//! may be committed.
//!
//! The decision is [`fate`], a pure function; [`handle_error`] applies it to a
//! message and its [`Plan`] (the state keys, the write, the answer, the log line).
//! Called by `chain.rs` (a stage or its set-up failed); `batch.rs` and `writes.rs` use
//! [`status_for`]. It must not touch the database itself: the write is `writes.rs`'s,
//! guarded like every other.

use std::time::Duration;

use serde_json::{Map, Value, json};

use super::maillog::About;
use super::message::Message;
use super::outcome::{ErrorClass, StageError, enhanced};
use super::plan::{Plan, Write, update_row};
use super::record::{Event, records};
use crate::config::StageSection;
use crate::db::{self, ErrorKind};
use crate::protocol;

/// Host-error backoff: the first retry after this, doubling.
const BACKOFF_FIRST: Duration = Duration::from_secs(60);
/// Host-error backoff cap.
const BACKOFF_CAP: Duration = Duration::from_secs(3600);
/// `MAX_LIFETIME` for a stage without a section (one that cannot run at all).
const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(120 * 3600);

/// `state.failure_class` of a permanent error.
pub(super) const PERMANENT: &str = "permanent";
/// `state.failure_class` of a host error still failing after `MAX_LIFETIME`.
pub(super) const RETRIES_EXHAUSTED: &str = "retries-exhausted";

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

/// What becomes of a message whose stage failed: [`fate`]'s decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Fate {
    /// Write nothing (nothing may be committed) and answer this: 74 for a lost
    /// connection, 75 for overload; the dispatcher defers the row.
    Defer {
        /// The status to answer.
        answer: u8,
    },
    /// Pause the row at the failing stage and retry it after `delay`.
    Retry {
        /// Host errors in a row at this stage, this one included.
        failures: u32,
        /// [`backoff`] of `failures`.
        delay: Duration,
    },
    /// Give up: move the row to the failing stage's `BOUNCE_STAGE`, pending, as
    /// [`RETRIES_EXHAUSTED`] (the answer stays 0).
    Bounce {
        /// The `BOUNCE_STAGE`.
        stage: String,
    },
    /// Fail the row at the failing stage.
    Fail {
        /// `state.failure_class`: [`PERMANENT`] or [`RETRIES_EXHAUSTED`].
        class: &'static str,
        /// The status to answer.
        answer: u8,
    },
}

/// The error model's decision (§12.4), from what the failing stage and the message say:
/// `class`, the error's; `failures_before`, the host errors in a row already counted at
/// this stage ([`failures_before`]); `age`, how long the message has lived (from
/// `arrived`, or `state.dsn_created` for a DSN); `max_lifetime` and `bounce_stage`, the
/// failing stage's `MAX_LIFETIME` and `BOUNCE_STAGE`; `list_copy`, whether it is a
/// mailing-list copy, which is never bounced.
pub(super) fn fate(
    class: ErrorClass,
    failures_before: u32,
    age: Duration,
    max_lifetime: Duration,
    bounce_stage: Option<&str>,
    list_copy: bool,
) -> Fate {
    match class {
        ErrorClass::Connection => Fate::Defer {
            answer: protocol::STATUS_IOERR,
        },
        ErrorClass::Overload => Fate::Defer {
            answer: protocol::STATUS_TEMPFAIL,
        },
        ErrorClass::Permanent => Fate::Fail {
            class: PERMANENT,
            answer: protocol::STATUS_PERMANENT,
        },
        ErrorClass::Host if age > max_lifetime => match bounce_stage.filter(|_| !list_copy) {
            Some(stage) => Fate::Bounce {
                stage: stage.to_string(),
            },
            None => Fate::Fail {
                class: RETRIES_EXHAUSTED,
                answer: protocol::STATUS_EXHAUSTED,
            },
        },
        ErrorClass::Host => {
            let failures = failures_before.saturating_add(1);
            Fate::Retry {
                failures,
                delay: backoff(failures),
            }
        }
    }
}

/// The host errors in a row a message's state counts at `stage`: its
/// `temporary_failures` when its `temporary_stage` is `stage`, else none. Whatever the
/// stored count holds (a string, a fraction, a number beyond u32) it must not
/// overflow: garbage counts as none, a huge count as the largest.
pub(super) fn failures_before(state: &Map<String, Value>, stage: &str) -> u32 {
    if state.get("temporary_stage").and_then(Value::as_str) != Some(stage) {
        return 0;
    }
    let stored = state
        .get("temporary_failures")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    u32::try_from(stored).unwrap_or(u32::MAX)
}

/// The error model (§12.4), at the stage that failed: decides the message's [`fate`]
/// and records it in its state and in `plan` (the write and the answer); the chain up
/// to that stage is committed by the same write (the row moves to that stage).
pub(super) fn handle_error(
    plan: &mut Plan,
    mut message: Message,
    stage: &str,
    section: Option<&StageSection>,
    error: StageError,
) {
    let claimed = plan.claimed.clone();
    let id = message.id;
    let max_lifetime = section.map_or(DEFAULT_MAX_LIFETIME, |s| s.max_lifetime);
    let decided = fate(
        error.class,
        failures_before(&message.state, stage),
        message.lifetime_age,
        max_lifetime,
        section.and_then(|s| s.bounce_stage.as_deref()),
        message.list_copy(),
    );
    match decided {
        Fate::Defer { answer } => {
            if answer == protocol::STATUS_TEMPFAIL {
                log::warn!("{stage}: message {id}: database overloaded: {error}");
            } else {
                log::warn!("{stage}: message {id}: database connection lost: {error}");
            }
            plan.answer = answer;
        }
        Fate::Fail { class, answer } => {
            let event = if class == PERMANENT {
                Event::Bounced
            } else {
                Event::Expired
            };
            record(plan, &message, stage, event, &error);
            if class == PERMANENT {
                log::warn!("{stage}: message {id}: permanent error, failing it: {error}");
            } else {
                log::warn!(
                    "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), failing it: {error}",
                    max_lifetime.as_secs()
                );
            }
            mark_failed(&mut message, stage, class, &error);
            plan.write = Write::Update(update_row(&message, &claimed, stage, "failed", None));
            plan.answer = answer;
        }
        Fate::Bounce { stage: bounce } => {
            record(plan, &message, stage, Event::Expired, &error);
            mark_failed(&mut message, stage, RETRIES_EXHAUSTED, &error);
            log::warn!(
                "{stage}: message {id}: giving up after MAX_LIFETIME ({}s), moving it to {bounce}: {error}",
                max_lifetime.as_secs()
            );
            plan.write = Write::Update(update_row(&message, &claimed, &bounce, "pending", None));
        }
        Fate::Retry { failures, delay } => {
            record(plan, &message, stage, Event::Deferred, &error);
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

/// Records `event` for each of the message's recipients in the plan: what the stage
/// said of it, else the error's text with the status the stage chose, else one by the
/// event (4.0.0 deferred, 4.4.7 expired, 5.0.0 bounced).
fn record(plan: &mut Plan, message: &Message, stage: &str, event: Event, error: &StageError) {
    let chosen = error.dsn.as_ref().map(|d| d.status.as_str());
    let dsn = match event {
        // A deferral's chosen status is the one it would expire with; what it says
        // now is the reason's own, if it has one.
        Event::Deferred => enhanced(&error.message, '4').unwrap_or("4.0.0"),
        Event::Expired => chosen.unwrap_or("4.4.7"),
        _ => chosen.unwrap_or("5.0.0"),
    };
    plan.about = About::of(message);
    plan.records.extend(records(
        message,
        stage,
        event,
        plan.handed.as_ref(),
        Some(&error.message),
        dsn,
        plan.timing,
    ));
}

/// Records why and where a message failed in its state: the error for the system
/// (`last_error`, never shown to the sender), and the status and diagnostic the stage
/// chose for the sender, if it did ([`crate::worker::DsnReason`]), for all the row's
/// recipients.
fn mark_failed(message: &mut Message, stage: &str, class: &str, error: &StageError) {
    message
        .state
        .insert("last_error".into(), json!(db::storable(&error.message)));
    message.state.insert("failed_stage".into(), json!(stage));
    message.state.insert("failure_class".into(), json!(class));
    if let Some(reason) = &error.dsn {
        message
            .state
            .insert("dsn_status".into(), json!(reason.status));
        match &reason.diagnostic {
            Some(d) => {
                message
                    .state
                    .insert("dsn_diagnostic".into(), json!(db::storable(d)));
            }
            // A diagnostic an earlier failure left must not describe this one.
            None => {
                message.state.remove("dsn_diagnostic");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);
    const DAY: Duration = Duration::from_secs(24 * 3600);

    /// The fate of an error of `class` for a message `age` old at a stage with a
    /// `MAX_LIFETIME` of a day, after `before` host errors there.
    fn at_a_day(class: ErrorClass, before: u32, age: Duration, bounce: Option<&str>) -> Fate {
        fate(class, before, age, DAY, bounce, false)
    }

    #[test]
    fn backoff_doubles_from_a_minute_up_to_an_hour() {
        let mins: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs() / 60).collect();
        assert_eq!(mins, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(0), Duration::from_secs(60));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(3600));
    }

    #[test]
    fn a_lost_connection_or_overload_writes_nothing_and_answers_74_or_75() {
        for age in [Duration::ZERO, Duration::MAX] {
            assert_eq!(
                at_a_day(ErrorClass::Connection, 3, age, Some("bounce")),
                Fate::Defer { answer: 74 }
            );
            assert_eq!(
                at_a_day(ErrorClass::Overload, 3, age, Some("bounce")),
                Fate::Defer { answer: 75 }
            );
        }
    }

    #[test]
    fn a_permanent_error_fails_the_message_at_once_never_to_the_bounce_stage() {
        let failed = Fate::Fail {
            class: "permanent",
            answer: protocol::STATUS_PERMANENT,
        };
        for age in [Duration::ZERO, 2 * DAY] {
            assert_eq!(
                at_a_day(ErrorClass::Permanent, 0, age, Some("bounce")),
                failed
            );
            assert_eq!(at_a_day(ErrorClass::Permanent, 5, age, None), failed);
        }
    }

    #[test]
    fn a_host_error_within_max_lifetime_pauses_with_a_doubling_backoff() {
        let retry = |before| at_a_day(ErrorClass::Host, before, HOUR, Some("bounce"));
        assert_eq!(
            retry(0),
            Fate::Retry {
                failures: 1,
                delay: Duration::from_secs(60)
            }
        );
        assert_eq!(
            retry(2),
            Fate::Retry {
                failures: 3,
                delay: Duration::from_secs(4 * 60)
            }
        );
        assert_eq!(
            retry(40),
            Fate::Retry {
                failures: 41,
                delay: HOUR
            }
        );
        assert_eq!(
            retry(u32::MAX),
            Fate::Retry {
                failures: u32::MAX,
                delay: HOUR
            },
            "a count at its largest stays there"
        );
        assert!(
            matches!(at_a_day(ErrorClass::Host, 0, DAY, None), Fate::Retry { .. }),
            "a message exactly MAX_LIFETIME old is retried once more"
        );
    }

    #[test]
    fn a_host_error_past_max_lifetime_goes_to_the_bounce_stage() {
        assert_eq!(
            at_a_day(ErrorClass::Host, 7, DAY + HOUR, Some("bounce")),
            Fate::Bounce {
                stage: "bounce".into()
            }
        );
        assert_eq!(
            at_a_day(ErrorClass::Host, 0, Duration::MAX, Some("bounce")),
            Fate::Bounce {
                stage: "bounce".into()
            },
            "an age that cannot be known counts as spent"
        );
    }

    #[test]
    fn a_host_error_past_max_lifetime_without_a_bounce_stage_fails_as_retries_exhausted() {
        assert_eq!(
            at_a_day(ErrorClass::Host, 7, DAY + HOUR, None),
            Fate::Fail {
                class: "retries-exhausted",
                answer: protocol::STATUS_EXHAUSTED
            }
        );
    }

    #[test]
    fn a_list_copy_is_never_bounced_it_fails() {
        let list_copy = |class| fate(class, 7, DAY + HOUR, DAY, Some("bounce"), true);
        assert_eq!(
            list_copy(ErrorClass::Host),
            Fate::Fail {
                class: "retries-exhausted",
                answer: protocol::STATUS_EXHAUSTED
            }
        );
        assert_eq!(
            list_copy(ErrorClass::Permanent),
            Fate::Fail {
                class: "permanent",
                answer: protocol::STATUS_PERMANENT
            }
        );
        assert!(matches!(
            fate(ErrorClass::Host, 0, HOUR, DAY, Some("bounce"), true),
            Fate::Retry { failures: 1, .. }
        ));
    }

    #[test]
    fn a_failure_records_the_status_and_diagnostic_the_stage_chose_for_the_sender() {
        use crate::worker::DsnReason;
        let mut m = Message::new(
            7,
            "relay".into(),
            "a@x.example".into(),
            vec!["r@y.example".into()],
            None,
            None,
            Map::new(),
            String::new(),
        );
        m.state.insert(
            "dsn_diagnostic".into(),
            json!("x-pepsi; an earlier failure"),
        );
        mark_failed(
            &mut m,
            "relay",
            PERMANENT,
            &StageError::permanent("/etc/x: no"),
        );
        assert_eq!(m.state["last_error"], "/etc/x: no");
        assert_eq!(
            m.state.get("dsn_status"),
            None,
            "none chosen: the class decides"
        );
        let chosen = StageError::permanent("/etc/x: no").with_dsn(DsnReason {
            status: "5.1.1".into(),
            diagnostic: None,
        });
        mark_failed(&mut m, "relay", PERMANENT, &chosen);
        assert_eq!(m.state["dsn_status"], "5.1.1");
        assert_eq!(m.state.get("dsn_diagnostic"), None, "not an earlier one's");
        let said = StageError::host("x").with_dsn(DsnReason {
            status: "4.2.2".into(),
            diagnostic: Some("x-pepsi; 4.2.2 full\0".into()),
        });
        mark_failed(&mut m, "relay", RETRIES_EXHAUSTED, &said);
        assert_eq!(m.state["dsn_status"], "4.2.2");
        assert_eq!(m.state["dsn_diagnostic"], "x-pepsi; 4.2.2 full\u{FFFD}");
    }

    #[test]
    fn failures_count_only_at_their_own_stage_and_garbage_counts_as_none() {
        let state = |stage: &str, count: Value| {
            let mut m = Map::new();
            m.insert("temporary_stage".into(), json!(stage));
            m.insert("temporary_failures".into(), count);
            m
        };
        assert_eq!(failures_before(&Map::new(), "relay"), 0);
        assert_eq!(failures_before(&state("relay", json!(3)), "relay"), 3);
        assert_eq!(failures_before(&state("other", json!(3)), "relay"), 0);
        assert_eq!(failures_before(&state("relay", json!("3")), "relay"), 0);
        assert_eq!(failures_before(&state("relay", json!(2.5)), "relay"), 0);
        assert_eq!(failures_before(&state("relay", json!(-1)), "relay"), 0);
        assert_eq!(
            failures_before(&state("relay", json!(u64::MAX)), "relay"),
            u32::MAX
        );
        let beyond: Value = serde_json::from_str("123456789012345678901234567890").unwrap();
        assert_eq!(failures_before(&state("relay", beyond), "relay"), 0);
    }
}
