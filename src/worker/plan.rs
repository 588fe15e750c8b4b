//! The worker's write plan (§12.2, §6 "Claim tokens"): for each id of a batch,
//! what to write ([`Write`]), under which guard (claimed stage and claim token), and
//! which status to answer ([`Plan`]); and the JSON element of an update-shaped outcome
//! ([`update_row`]).
//!
//! Made by `chain.rs` (a stage's outcome), `errors.rs` (an error's fate) and `batch.rs`
//! (rows answered without a chain); carried out by `writes.rs`; its answers and
//! reports become status lines in `batch.rs`. Vocabulary only: this file must not
//! touch the database nor decide an outcome.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Value, json};

use super::maillog::About;
use super::message::Message;
use super::outcome::Notification;
use super::record::{Handed, Record, Timing};
use crate::protocol::{self, StageEvent, StageTime};

/// The longest pause a stage's outcome may ask for: far beyond any retry policy, and
/// far within what a `timestamptz` can hold (a pause beyond it would make the write
/// fail).
const MAX_PAUSE: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

/// What a batch entry writes.
pub(super) enum Write {
    /// No write: the row was gone or taken away, or the database failed.
    Nothing,
    /// An update-shaped outcome (advance, pause, fail, redirect): one element of
    /// [`crate::db::sql::WRITE_OUTCOMES`]'s recordset, made by [`update_row`].
    Update(Value),
    /// Delete the row: the message is done.
    Delete,
    /// [`Write::Delete`] as the write carries it: one element of
    /// [`crate::db::sql::DELETE_FINISHED`]'s recordset.
    Done(Value),
    /// Fail the row at its claimed stage without rewriting its state (the worker could
    /// not load or read it): [`crate::db::sql::FAIL_IN_PLACE`] merges these failure
    /// keys into the stored state.
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
    /// The events the stages counted in this pass, with how often.
    pub(super) events: Vec<StageEvent>,
    /// What to write.
    pub(super) write: Write,
    /// What the write records of each recipient (`pepsi.history`, the delivery log).
    pub(super) records: Vec<Record>,
    /// The message the records are of; set with them.
    pub(super) about: About,
    /// When this pass began.
    pub(super) timing: Timing,
    /// What the stage said of each recipient it handed on (a relay's replies).
    pub(super) handed: Option<Handed>,
    /// Did the database take the write?
    pub(super) written: bool,
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
            events: Vec::new(),
            write: Write::Nothing,
            records: Vec::new(),
            about: About::default(),
            timing: Timing::now(),
            handed: None,
            written: false,
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
            events: Vec::new(),
            write: Write::Nothing,
            records: Vec::new(),
            about: About::default(),
            timing: Timing::now(),
            handed: None,
            written: false,
        }
    }

    /// Adds what `stage` counted of the message.
    pub(super) fn count(&mut self, stage: &str, counted: &[&'static str]) {
        for event in counted {
            match self
                .events
                .iter_mut()
                .find(|(s, e, _)| s == stage && e == event)
            {
                Some((_, _, n)) => *n += 1,
                None => self.events.push((stage.to_string(), event.to_string(), 1)),
            }
        }
    }
}

/// One element of [`crate::db::sql::WRITE_OUTCOMES`]'s recordset: the message's
/// outcome, guarded by the stage it was claimed at (`claimed`) and the claim token it
/// was loaded under.
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
        if !message.prepended().is_empty() {
            row["prepend_headers"] = json!(STANDARD.encode(message.prepended()));
        }
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
