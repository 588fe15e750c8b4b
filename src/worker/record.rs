//! What became of a message, recipient by recipient (§11 "Delivery log"): the
//! [`Record`]s of an outcome, which the outcome's own write puts into `pepsi.history`
//! (schema 22) and which `maillog.rs` writes as the delivery log once it committed.
//!
//! Made by `chain.rs` and `errors.rs` when they decide a message's write, from what the
//! stage said of each recipient ([`Handed`], kept by `recipients.rs` for a relay's
//! per-recipient replies); carried by the plan to `writes.rs`. Vocabulary and pure
//! functions: this file must not touch the database nor write a line.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::message::Message;
use super::outcome::{RecipientResult, enhanced};

/// What happened to a recipient. (`pepsi.history` also records a split-off part and a
/// notification made, which the database writes itself.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Handed on for good: a relay's downstream accepted it, or a stage delivered it.
    Delivered,
    /// Not now: retried later.
    Deferred,
    /// Failed for good: the sender gets a notification (unless there is none to send).
    Bounced,
    /// Retried past the stage's lifetime: failed, as bounced.
    Expired,
    /// Dropped on purpose (a discard stage, a bounce of a bounce).
    Discarded,
}

impl Event {
    /// The name `pepsi.history.event` stores.
    pub fn name(self) -> &'static str {
        match self {
            Event::Delivered => "delivered",
            Event::Deferred => "deferred",
            Event::Bounced => "bounced",
            Event::Expired => "expired",
            Event::Discarded => "discarded",
        }
    }

    /// The word of Postfix's `status=` that says the same (`pflogsumm` counts `sent`,
    /// `deferred` and `bounced`).
    pub fn status(self) -> &'static str {
        match self {
            Event::Delivered => "sent",
            other => other.name(),
        }
    }
}

/// One recipient's outcome at a stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// What happened.
    pub event: Event,
    /// The stage that decided it.
    pub stage: String,
    /// The recipient.
    pub recipient: String,
    /// Where the message was handed (`host[address]:port`); `None`: nowhere.
    pub relay: Option<String>,
    /// The downstream reply, or the reason.
    pub reply: Option<String>,
    /// The next hop's queue id, when the reply names one.
    pub remote_id: Option<String>,
    /// The enhanced status code.
    pub dsn: String,
    /// How long the message waited at the stage before this pass.
    pub waited: Duration,
    /// How long this pass took.
    pub took: Duration,
}

/// When a message came to its stage and when this pass began, for a record's delays.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// When the pass began.
    pub started: SystemTime,
}

impl Timing {
    /// A pass beginning now.
    pub fn now() -> Timing {
        Timing {
            started: SystemTime::now(),
        }
    }

    /// (waited at the stage, this pass) for `message`.
    fn delays(&self, message: &Message) -> (Duration, Duration) {
        let waited = message
            .entered
            .and_then(|e| self.started.duration_since(e).ok())
            .unwrap_or_default();
        let took = self.started.elapsed().unwrap_or_default();
        (waited, took)
    }
}

/// What a stage said of each recipient it handed on: a relay's replies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Handed {
    /// Where the message was handed.
    pub relay: Option<String>,
    /// Each recipient's reply and enhanced status code.
    pub replies: HashMap<String, (String, String)>,
}

impl Handed {
    /// What `relay` (a relay stage) said of `results`, `accepted` being the reply that
    /// took the message for the done ones.
    pub fn from_results(
        relay: Option<String>,
        accepted: Option<&str>,
        results: &[(String, RecipientResult)],
    ) -> Handed {
        let replies = results
            .iter()
            .map(|(address, result)| {
                let said = match result {
                    RecipientResult::Done => {
                        let reply = accepted.unwrap_or("accepted").to_string();
                        let dsn = enhanced(&reply, '2').unwrap_or("2.0.0").to_string();
                        (reply, dsn)
                    }
                    RecipientResult::Deferred(why) => (
                        why.clone(),
                        enhanced(why, '4').unwrap_or("4.0.0").to_string(),
                    ),
                    RecipientResult::Failed { error, status, .. } => {
                        (error.clone(), status.clone())
                    }
                };
                (address.clone(), said)
            })
            .collect();
        Handed { relay, replies }
    }
}

/// The longest values a record keeps, in characters: what `pepsi.history` keeps of
/// them, so that a peer's 100 KB reply makes neither a 100 KB log line nor a record
/// the log and the history tell apart.
const STAGE_MAX: usize = 200;
const RECIPIENT_MAX: usize = 1000;
const RELAY_MAX: usize = 300;
const REPLY_MAX: usize = 2000;
const DSN_MAX: usize = 20;

/// `text`, cut to `max` characters.
fn bounded(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => text[..at].to_string(),
        None => text.to_string(),
    }
}

/// The records of `event` for every recipient the message still has at `stage`:
/// each with what the stage said of it ([`Handed`]), else with `reason` and `dsn`.
pub fn records(
    message: &Message,
    stage: &str,
    event: Event,
    handed: Option<&Handed>,
    reason: Option<&str>,
    dsn: &str,
    timing: Timing,
) -> Vec<Record> {
    let (waited, took) = timing.delays(message);
    message
        .rcpt_to()
        .iter()
        .map(|recipient| {
            let said = handed.and_then(|h| h.replies.get(recipient));
            let reply = said.map(|(r, _)| r.as_str()).or(reason);
            Record {
                event,
                stage: bounded(stage, STAGE_MAX),
                recipient: bounded(recipient, RECIPIENT_MAX),
                relay: handed
                    .and_then(|h| h.relay.as_deref())
                    .map(|r| bounded(r, RELAY_MAX)),
                remote_id: (event == Event::Delivered)
                    .then(|| reply.and_then(remote_id))
                    .flatten(),
                reply: reply.map(|r| bounded(r, REPLY_MAX)),
                dsn: bounded(said.map_or(dsn, |(_, d)| d.as_str()), DSN_MAX),
                waited,
                took,
            }
        })
        .collect()
}

/// The records as `pepsi.workqueue_write` and `pepsi.workqueue_done` take them (the
/// element's "log"). A value that is absent is left out (the server reads it as NULL),
/// so the server parses no more than the record holds.
pub fn to_json(records: &[Record]) -> Value {
    Value::Array(
        records
            .iter()
            .map(|r| {
                let mut o = serde_json::Map::new();
                o.insert("event".into(), r.event.name().into());
                o.insert("stage".into(), r.stage.clone().into());
                o.insert("rcpt".into(), r.recipient.clone().into());
                for (key, value) in [
                    ("relay", &r.relay),
                    ("reply", &r.reply),
                    ("remote_id", &r.remote_id),
                ] {
                    if let Some(v) = value {
                        o.insert(key.into(), v.clone().into());
                    }
                }
                o.insert("dsn".into(), r.dsn.clone().into());
                o.insert("queued_ms".into(), (r.waited.as_millis() as u64).into());
                o.insert("stage_ms".into(), (r.took.as_millis() as u64).into());
                Value::Object(o)
            })
            .collect(),
    )
}

/// The most characters a remote queue id may have.
const REMOTE_ID_MAX: usize = 64;

/// The next hop's queue id in its reply to the data: Postfix's `queued as 4F2K7x1Z3`,
/// Exim's `id=1tQ2Xx-000ABC-7Z`, Sendmail's `2.0.0 4B5C6D7E8F Message accepted`.
pub fn remote_id(reply: &str) -> Option<String> {
    let words: Vec<&str> = reply.split_whitespace().collect();
    let found = words
        .windows(3)
        .find(|w| w[0].eq_ignore_ascii_case("queued") && w[1].eq_ignore_ascii_case("as"))
        .map(|w| w[2])
        .or_else(|| {
            words
                .iter()
                .find_map(|w| w.strip_prefix("id=").or_else(|| w.strip_prefix("ID=")))
        })
        .or_else(|| {
            words
                .windows(3)
                .find(|w| w[1].eq_ignore_ascii_case("message") && w[2].starts_with("accepted"))
                .map(|w| w[0])
                .filter(|w| enhanced(w, '2').is_none() && w.parse::<u16>().is_err())
        })?;
    let id = found.trim_matches(|c| matches!(c, '<' | '>' | '(' | ')' | ',' | '.' | ';'));
    let clean = !id.is_empty()
        && id.len() <= REMOTE_ID_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@+=/".contains(&b));
    clean.then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remote_queue_id_is_found_in_the_replies_of_common_servers() {
        assert_eq!(
            remote_id("250 2.0.0 Ok: queued as 4F2K7x1Z3b").as_deref(),
            Some("4F2K7x1Z3b")
        );
        assert_eq!(
            remote_id("250 OK id=1tQ2Xx-000ABC-7Z").as_deref(),
            Some("1tQ2Xx-000ABC-7Z")
        );
        assert_eq!(
            remote_id("250 2.0.0 4B5C6D7E8F012 Message accepted for delivery").as_deref(),
            Some("4B5C6D7E8F012")
        );
        assert_eq!(remote_id("250 2.0.0 Ok"), None);
        assert_eq!(remote_id("250 2.0.0 Message accepted for delivery"), None);
        assert_eq!(remote_id("250 ok queued as \u{1b}[31mX"), None, "hostile");
        assert_eq!(
            remote_id(&format!("250 queued as {}", "x".repeat(65))),
            None
        );
    }

    #[test]
    fn a_100_kb_reply_is_kept_as_the_history_keeps_it_and_every_value_is_bounded() {
        let long = "é".repeat(100_000);
        let results = vec![(
            "a@y".to_string(),
            RecipientResult::Deferred(format!("451 4.3.0 {long}")),
        )];
        let h = Handed::from_results(Some(long.clone()), None, &results);
        let m = Message::new(
            7,
            "relay".into(),
            "s@x".into(),
            vec!["a@y".into()],
            None,
            None,
            Default::default(),
            String::new(),
        );
        let r = records(
            &m,
            &long,
            Event::Deferred,
            Some(&h),
            None,
            "4.0.0",
            Timing::now(),
        );
        assert_eq!(
            r[0].reply.as_ref().map(|t| t.chars().count()),
            Some(REPLY_MAX)
        );
        assert!(r[0].reply.as_ref().unwrap().starts_with("451 4.3.0 é"));
        assert_eq!(
            r[0].relay.as_ref().map(|t| t.chars().count()),
            Some(RELAY_MAX)
        );
        assert_eq!(r[0].stage.chars().count(), STAGE_MAX);
        assert_eq!(r[0].dsn, "4.3.0");
        assert_eq!(bounded("abc", 5), "abc");
        assert_eq!(bounded("abcdef", 3), "abc");
    }

    #[test]
    fn a_relays_replies_give_each_recipient_its_own_status() {
        let results = vec![
            ("a@y".to_string(), RecipientResult::Done),
            (
                "b@y".to_string(),
                RecipientResult::Deferred("host y said: 451 4.3.0 later".into()),
            ),
            (
                "c@y".to_string(),
                RecipientResult::Failed {
                    error: "host y said: 550 5.1.1 unknown".into(),
                    status: "5.1.1".into(),
                    diagnostic: None,
                },
            ),
        ];
        let h = Handed::from_results(
            Some("y[192.0.2.1]:25".into()),
            Some("250 2.0.0 Ok: queued as ABC"),
            &results,
        );
        assert_eq!(h.replies["a@y"].1, "2.0.0");
        assert_eq!(h.replies["b@y"].1, "4.3.0");
        assert_eq!(h.replies["c@y"].1, "5.1.1");
        let m = Message::new(
            7,
            "relay".into(),
            "s@x".into(),
            vec!["a@y".into()],
            None,
            None,
            Default::default(),
            String::new(),
        );
        let r = records(
            &m,
            "relay",
            Event::Delivered,
            Some(&h),
            None,
            "2.0.0",
            Timing::now(),
        );
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].remote_id.as_deref(), Some("ABC"));
        assert_eq!(r[0].relay.as_deref(), Some("y[192.0.2.1]:25"));
        let j = to_json(&r);
        assert_eq!(j[0]["event"], "delivered");
        assert_eq!(j[0]["rcpt"], "a@y");
        assert_eq!(j[0]["remote_id"], "ABC");
        // What a record lacks is left out, not sent as null.
        let r = records(
            &m,
            "drop",
            Event::Discarded,
            None,
            None,
            "2.0.0",
            Timing::now(),
        );
        let j = to_json(&r);
        let keys: Vec<&str> = j[0]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(
            keys,
            ["dsn", "event", "queued_ms", "rcpt", "stage", "stage_ms"],
            "{j}"
        );
    }
}
