//! `pepsi-stage-bounce` (§13.2): turns a failed message into one delivery status
//! notification to its sender, or discards it. Loads headers and body; not fusable by
//! default. `NEXT` (required) is where the notification goes; `BOUNCE_SIZE_LIMIT`
//! (bytes, default 50,000) is the largest original attached whole when the sender gave
//! no `RET`.
//!
//! A bounce is never bounced: a message from the null sender (a notification that
//! could not be delivered) or a mailing-list copy is deleted, and so is one whose sender
//! is not a single valid mailbox ([`crate::mailbox`]): the report goes to that sender
//! alone, or to nobody. Otherwise the recipients
//! whose RFC 3461 `NOTIFY` asks for failures (no `NOTIFY` asks for them; `NEVER` never
//! does) get one report; none left, the message is deleted without one. The report and
//! the deletion are one write ([`Outcome::Bounce`]).
//!
//! This file decides who is told and what status and reason they read; `dsn.rs` writes
//! the report. The sender reads a generic reason by `state.failure_class`, the status
//! of `state.dsn_status` or of the class, and only the diagnostic a stage set for them
//! in `state.dsn_diagnostic`: `state.last_error` can name files, tables and hosts and
//! never appears.
//!
//! Listed in `stages::BUILTINS`; the worker runtime configures it and runs its body,
//! and writes the [`Outcome::Bounce`] it returns (the notification in, the original
//! out); it must not write to the database itself.

use std::time::SystemTime;

use serde_json::{Map, Value};

use super::dsn::{self, FailedRecipient, Report, Ret};
use crate::config::{ConfigError, StageSection};
use crate::escape::Visible;
use crate::mailbox;
use crate::worker::{
    Configured, Context, Load, Message, Notification, Outcome, Stage, StageError, required_next,
};

/// The stage.
pub struct Bounce;

/// `BOUNCE_SIZE_LIMIT`'s default, in bytes.
pub const DEFAULT_SIZE_LIMIT: u64 = 50_000;

struct ConfiguredBounce {
    next: String,
    size_limit: usize,
}

impl Stage for Bounce {
    fn name(&self) -> &'static str {
        "bounce"
    }

    fn loads(&self) -> Load {
        Load::Full
    }

    fn fusion_default(&self) -> bool {
        false
    }

    fn delivers(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &["BOUNCE_SIZE_LIMIT"]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &["BOUNCE_SIZE_LIMIT"]
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let size_limit =
            section
                .section
                .number("BOUNCE_SIZE_LIMIT", DEFAULT_SIZE_LIMIT, 0..=1 << 40)?;
        Ok(Box::new(ConfiguredBounce {
            next: required_next(section)?,
            size_limit: usize::try_from(size_limit).unwrap_or(usize::MAX),
        }))
    }
}

impl Configured for ConfiguredBounce {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let stage = &cx.section.name;
        let id = message.id;
        if message.mail_from().is_empty() {
            log::info!(
                "{stage}: message {id} is from the null sender (a notification); discarded, never bounced"
            );
            return Ok(Outcome::Finish);
        }
        if message.list_copy() {
            log::info!("{stage}: message {id} is a mailing-list copy; discarded, never bounced");
            return Ok(Outcome::Finish);
        }
        // The report goes to the sender alone: a sender that is not one mailbox (a
        // list smuggled in with `>, <`, a line break, a bidirectional control) could
        // address it to others, or forge its header, so it gets none.
        if let Err(why) = mailbox::check(message.mail_from()) {
            log::warn!(
                "{stage}: message {id}: its sender <{}> is not a valid mailbox ({why}); discarded, never bounced",
                Visible(message.mail_from())
            );
            return Ok(Outcome::Finish);
        }
        let params = DsnParams::of(message);
        let recipients: Vec<FailedRecipient> = message
            .rcpt_to()
            .iter()
            .filter(|r| params.wants_failure(r))
            .map(|r| FailedRecipient {
                address: r.clone(),
                original: params.orcpt(r),
                status: status(message, r),
                diagnostic: diagnostic(message, r),
            })
            .collect();
        if recipients.is_empty() {
            log::info!(
                "{stage}: message {id}: no recipient asked to hear of a failure (NOTIFY); discarded without a report"
            );
            return Ok(Outcome::Finish);
        }
        // The message id and random digits: no claim token (a secret of the claim, spent
        // now but never shown) reaches the report.
        let unique = format!("{id}.{}", crate::random::hex(8));
        let written = dsn::write(&Report {
            hostname: &cx.pepsi.hostname,
            sender: message.mail_from(),
            recipients: &recipients,
            envid: params.envid.as_deref(),
            ret: params.ret,
            size_limit: self.size_limit,
            arrived: message.arrived,
            now: SystemTime::now(),
            reason: reason(message.state_text("failure_class").as_deref()),
            unique: &unique,
            headers: message.headers(),
            body: message.body(),
        });
        Ok(Outcome::Bounce(Box::new(Notification {
            stage: self.next.clone(),
            recipient: message.mail_from().to_string(),
            header_from: written.from,
            subject: dsn::SUBJECT.to_string(),
            headers: written.headers,
            body: written.body,
        })))
    }
}

/// `state.dsn`, the RFC 3461 parameters the message was accepted with. Whatever does
/// not have the documented shape is as if it were not given.
struct DsnParams {
    ret: Ret,
    envid: Option<String>,
    /// Per recipient (lower-cased): its `NOTIFY` and `ORCPT`.
    rcpt: Vec<(String, Option<String>, Option<String>)>,
}

impl DsnParams {
    fn of(message: &Message) -> DsnParams {
        let empty = Map::new();
        let dsn = message
            .state
            .get("dsn")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
        let ret = match text(dsn.get("ret"))
            .map(|r| r.to_ascii_uppercase())
            .as_deref()
        {
            Some("FULL") => Ret::Full,
            Some("HDRS") => Ret::Headers,
            _ => Ret::Unspecified,
        };
        let rcpt = dsn
            .get("rcpt")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(address, p)| {
                        (
                            address.to_lowercase(),
                            text(p.get("notify")),
                            text(p.get("orcpt")),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        DsnParams {
            ret,
            envid: text(dsn.get("envid")),
            rcpt,
        }
    }

    fn of_rcpt(&self, address: &str) -> Option<&(String, Option<String>, Option<String>)> {
        let address = address.to_lowercase();
        self.rcpt.iter().find(|(a, _, _)| *a == address)
    }

    /// Does this recipient's `NOTIFY` ask for a failure report? No `NOTIFY` does;
    /// `NEVER` never does, nor does a list without `FAILURE`.
    fn wants_failure(&self, address: &str) -> bool {
        let Some(notify) = self.of_rcpt(address).and_then(|(_, n, _)| n.as_deref()) else {
            return true;
        };
        let words: Vec<String> = notify
            .split(',')
            .map(|w| w.trim().to_ascii_uppercase())
            .filter(|w| !w.is_empty())
            .collect();
        if words.is_empty() {
            return true;
        }
        !words.iter().any(|w| w == "NEVER") && words.iter().any(|w| w == "FAILURE")
    }

    fn orcpt(&self, address: &str) -> Option<String> {
        self.of_rcpt(address).and_then(|(_, _, o)| o.clone())
    }
}

/// A state value for one recipient: a string for all of them, or an object by address
/// (case-insensitive).
fn per_recipient(message: &Message, key: &str, address: &str) -> Option<String> {
    match message.state.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m
            .iter()
            .find(|(a, _)| a.eq_ignore_ascii_case(address))
            .and_then(|(_, v)| v.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// A failure's RFC 3463 status: `4.x.x` or `5.x.x`.
fn is_failure_status(status: &str) -> bool {
    let parts: Vec<&str> = status.split('.').collect();
    parts.len() == 3
        && matches!(parts[0], "4" | "5")
        && parts[1..]
            .iter()
            .all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The status a recipient reads: `state.dsn_status` as a stage set it, else by the
/// failure class.
fn status(message: &Message, address: &str) -> String {
    if let Some(given) = per_recipient(message, "dsn_status", address) {
        let given = given.trim();
        if is_failure_status(given) {
            return given.to_string();
        }
        log::warn!(
            "message {}: state.dsn_status {given:?} is not a failure status (4.x.x or 5.x.x); using its failure class",
            message.id
        );
    }
    status_of_class(message.state_text("failure_class").as_deref()).to_string()
}

/// The status of a failure class (§13.2).
pub fn status_of_class(class: Option<&str>) -> &'static str {
    match class {
        Some("retries-exhausted") => "4.4.7",
        Some("looped") => "5.4.6",
        Some("crashed" | "timed-out" | "unreadable" | "unwritable") => "5.3.0",
        _ => "5.0.0",
    }
}

/// The generic reason a person reads, by failure class.
fn reason(class: Option<&str>) -> &'static str {
    match class {
        Some("permanent") => "It was refused permanently.",
        Some("retries-exhausted") => "Delivery was retried until the message expired.",
        Some("looped") => "It was passed around in a loop.",
        Some("crashed" | "timed-out" | "unreadable" | "unwritable") => {
            "The mail system could not process it."
        }
        _ => "Delivery failed.",
    }
}

/// The `Diagnostic-Code` a recipient reads: only `state.dsn_diagnostic`, which a stage
/// sets for the sender's eyes (`type; text`; a bare text is given the type `x-pepsi`).
fn diagnostic(message: &Message, address: &str) -> Option<String> {
    let given = per_recipient(message, "dsn_diagnostic", address)?;
    let given = given.trim();
    if given.is_empty() {
        return None;
    }
    let typed = given.split_once(';').is_some_and(|(kind, _)| {
        !kind.trim().is_empty()
            && kind
                .trim()
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    });
    Some(if typed {
        given.to_string()
    } else {
        format!("x-pepsi; {given}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(rcpt: &[&str], state: Value) -> Message {
        let Value::Object(state) = state else {
            panic!()
        };
        Message::new(
            1,
            "bounce".into(),
            "a@x.example".into(),
            rcpt.iter().map(|r| r.to_string()).collect(),
            None,
            None,
            state,
            String::new(),
        )
    }

    #[test]
    fn notify_selects_who_hears_of_a_failure() {
        let m = message(
            &["a@y", "B@y", "c@y", "d@y", "e@y"],
            json!({"dsn": {"rcpt": {
                "a@y": {"notify": "NEVER"},
                "b@y": {"notify": "SUCCESS,DELAY"},
                "c@y": {"notify": "success, failure"},
                "d@y": {"notify": 7},
            }}}),
        );
        let p = DsnParams::of(&m);
        let told: Vec<&str> = m
            .rcpt_to()
            .iter()
            .filter(|r| p.wants_failure(r))
            .map(String::as_str)
            .collect();
        assert_eq!(told, ["c@y", "d@y", "e@y"]);
    }

    #[test]
    fn ret_and_envid_are_read_and_garbage_ignored() {
        let p = DsnParams::of(&message(
            &["a@y"],
            json!({"dsn": {"ret": "hdrs", "envid": "E1"}}),
        ));
        assert_eq!((p.ret, p.envid.as_deref()), (Ret::Headers, Some("E1")));
        let p = DsnParams::of(&message(&["a@y"], json!({"dsn": {"ret": "FULL"}})));
        assert_eq!(p.ret, Ret::Full);
        let p = DsnParams::of(&message(&["a@y"], json!({"dsn": "nonsense"})));
        assert_eq!((p.ret, p.envid), (Ret::Unspecified, None));
    }

    #[test]
    fn status_follows_the_stage_then_the_class() {
        let s = |state: Value| status(&message(&["a@y"], state), "a@y");
        assert_eq!(s(json!({"failure_class": "permanent"})), "5.0.0");
        assert_eq!(s(json!({"failure_class": "retries-exhausted"})), "4.4.7");
        assert_eq!(s(json!({"failure_class": "looped"})), "5.4.6");
        for class in ["crashed", "timed-out", "unreadable", "unwritable"] {
            assert_eq!(s(json!({ "failure_class": class })), "5.3.0");
        }
        assert_eq!(s(json!({})), "5.0.0");
        assert_eq!(
            s(json!({"failure_class": "permanent", "dsn_status": "5.1.1"})),
            "5.1.1"
        );
        assert_eq!(
            s(json!({"failure_class": "crashed", "dsn_status": {"A@Y": "5.2.2"}})),
            "5.2.2"
        );
        assert_eq!(
            s(json!({"failure_class": "permanent", "dsn_status": "2.0.0"})),
            "5.0.0",
            "a success is no failure status"
        );
        assert_eq!(
            s(json!({"failure_class": "permanent", "dsn_status": "5.1.1 x"})),
            "5.0.0"
        );
    }

    #[test]
    fn only_the_stage_diagnostic_is_shown() {
        let d = |state: Value| diagnostic(&message(&["a@y"], state), "a@y");
        assert_eq!(d(json!({"last_error": "/etc/secret: denied"})), None);
        assert_eq!(
            d(json!({"dsn_diagnostic": "smtp; 550 5.1.1 user unknown"})).as_deref(),
            Some("smtp; 550 5.1.1 user unknown")
        );
        assert_eq!(
            d(json!({"dsn_diagnostic": "mailbox full"})).as_deref(),
            Some("x-pepsi; mailbox full")
        );
    }
}
