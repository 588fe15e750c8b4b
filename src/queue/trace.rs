//! `pepsi-queue trace ID | --message-id ID | --remote-id ID [--json]`: what became of
//! a message (schema 22) — its rows still in the queue (the original and every part
//! split from it, with the stages each passed), and its history, oldest first: every
//! deferral, split, delivery, bounce, discard and notification, each recipient's with
//! the downstream reply.
//!
//! A row id finds its message whether it is the original or a part; a Message-ID or a
//! next hop's queue id may find several messages (a resent message, a list's copies),
//! each shown in turn, at most [`MESSAGES_MAX`]. Called by `queue::run`; its statements
//! (`db::sql_history`) only read. Every value was written by a correspondent, a peer
//! or a worker: the text shows each escaped ([`crate::escape`]), the JSON gives them
//! exactly. Nothing found is exit 65, as for `show`.

use serde_json::{Value, json};

use super::format::{sender, shown};
use super::{Session, db_failure, emit, emit_json};
use crate::db::{Queries, sql_history as sql};
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, Failure};

/// The most messages one trace shows.
pub const MESSAGES_MAX: i64 = 20;

/// The most history rows shown per message.
const HISTORY_MAX: i64 = 10_000;

/// What to trace by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceKey {
    /// A row id (the original's or a part's).
    Id(i64),
    /// The header block's Message-ID, with its angle brackets.
    MessageId(String),
    /// The next hop's queue id.
    RemoteId(String),
}

impl TraceKey {
    /// The key as the text and JSON say it.
    fn describe(&self) -> String {
        match self {
            TraceKey::Id(id) => format!("id {id}"),
            TraceKey::MessageId(m) => format!("Message-ID {}", Visible(m)),
            TraceKey::RemoteId(r) => format!("remote queue id {}", Visible(r)),
        }
    }
}

/// A Message-ID as given: with its angle brackets added when the operator left them off.
pub fn message_id(value: &str) -> String {
    let v = value.trim();
    if v.starts_with('<') && v.ends_with('>') {
        v.to_string()
    } else {
        format!("<{v}>")
    }
}

/// One row of the message still in the queue.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveRow {
    id: i64,
    stage: String,
    status: String,
    retry_at: Option<f64>,
    arrived: Option<f64>,
    mail_from: String,
    rcpt_to: Vec<String>,
    message_id: Option<String>,
    trail: Value,
    last_error: Option<String>,
}

/// One history row.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    at: f64,
    id: i64,
    event: String,
    stage: String,
    mail_from: String,
    recipient: Option<String>,
    message_id: Option<String>,
    relay: Option<String>,
    reply: Option<String>,
    remote_id: Option<String>,
    dsn: Option<String>,
    arrived: Option<f64>,
    queued_ms: Option<i64>,
    stage_ms: Option<i64>,
    detail: Value,
    trail: Value,
}

/// One message: its original id, its rows in the queue, its history.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    origin: i64,
    rows: Vec<LiveRow>,
    events: Vec<Event>,
}

/// Finds the messages `key` names and reads each.
pub fn read(client: &mut impl Queries, key: &TraceKey) -> Result<Vec<Trace>, postgres::Error> {
    let origins: Vec<i64> = match key {
        TraceKey::Id(id) => client.query(sql::TRACE_BY_ID, &[id])?,
        TraceKey::MessageId(m) => client.query(sql::TRACE_BY_MESSAGE_ID, &[m, &MESSAGES_MAX])?,
        TraceKey::RemoteId(r) => client.query(sql::TRACE_BY_REMOTE_ID, &[r, &MESSAGES_MAX])?,
    }
    .iter()
    .map(|r| r.get(0))
    .collect();
    let mut traces = Vec::new();
    for origin in origins.into_iter().take(MESSAGES_MAX as usize) {
        let rows = client
            .query(sql::TRACE_ROWS, &[&origin])?
            .iter()
            .map(|r| LiveRow {
                id: r.get(0),
                stage: r.get(1),
                status: r.get(2),
                retry_at: r.get(3),
                arrived: r.get(4),
                mail_from: r.get(5),
                rcpt_to: r
                    .get::<_, Option<Vec<Option<String>>>>(6)
                    .unwrap_or_default()
                    .into_iter()
                    .map(Option::unwrap_or_default)
                    .collect(),
                message_id: r.get(7),
                trail: trail(r.get::<_, Option<String>>(8).as_deref()),
                last_error: r.get(9),
            })
            .collect();
        let events = client
            .query(sql::TRACE_HISTORY, &[&origin, &HISTORY_MAX])?
            .iter()
            .map(|r| Event {
                at: r.get(0),
                id: r.get(1),
                event: r.get(2),
                stage: r.get(3),
                mail_from: r.get(4),
                recipient: r.get(5),
                message_id: r.get(6),
                relay: r.get(7),
                reply: r.get(8),
                remote_id: r.get(9),
                dsn: r.get(10),
                arrived: r.get(11),
                queued_ms: r.get(12),
                stage_ms: r.get(13),
                detail: parsed(r.get(14)),
                trail: trail(r.get::<_, Option<String>>(15).as_deref()),
            })
            .collect();
        traces.push(Trace {
            origin,
            rows,
            events,
        });
    }
    Ok(traces)
}

/// A trail (`STAGE US AT` lines) as a JSON array of {stage, us, at}; lines that are
/// not three words (the last two numbers) are skipped.
fn trail(text: Option<&str>) -> Value {
    Value::Array(
        text.unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                let [stage, us, at] = words[..] else {
                    return None;
                };
                let (us, at) = (us.parse::<u64>().ok()?, at.parse::<u64>().ok()?);
                Some(json!({"stage": stage, "us": us, "at": at}))
            })
            .collect(),
    )
}

/// JSON text read back; `null` for none or text that does not parse.
fn parsed(text: Option<String>) -> Value {
    text.and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

/// Runs `pepsi-queue trace`.
pub fn run(session: &mut Session, key: &TraceKey, json: bool) -> Result<(), Failure> {
    let traces =
        read(&mut session.client, key).map_err(|e| db_failure("reading the history", &e))?;
    if json {
        emit_json(&to_json(key, &traces))?;
    } else if !traces.is_empty() {
        emit(to_text(&traces).as_bytes())?;
    }
    if traces.is_empty() {
        return Err(Failure::new(
            EX_DATAERR,
            format!(
                "no message with {} in the queue or the history",
                key.describe()
            ),
        ));
    }
    Ok(())
}

/// A time in epoch seconds as RFC 3339 in UTC with milliseconds; `-` when unknown.
fn time(epoch: Option<f64>) -> String {
    epoch
        .filter(|s| s.is_finite())
        .and_then(|s| jiff::Timestamp::from_millisecond((s * 1000.0) as i64).ok())
        .map_or("-".to_string(), |t| format!("{t:.3}"))
}

/// Milliseconds as seconds with two decimals.
fn secs(ms: Option<i64>) -> String {
    ms.map_or("-".to_string(), |m| format!("{:.2}", m as f64 / 1000.0))
}

/// A trail's passes on one line: `if 0.1ms, relay 45.2ms`.
fn passes(trail: &Value) -> String {
    let Some(steps) = trail.as_array() else {
        return "-".to_string();
    };
    let shown_steps: Vec<String> = steps
        .iter()
        .map(|s| {
            let stage = s.get("stage").and_then(Value::as_str).unwrap_or("?");
            let us = s.get("us").and_then(Value::as_f64).unwrap_or(0.0);
            let at = s
                .get("at")
                .and_then(Value::as_f64)
                .map(|ms| time(Some(ms / 1000.0)))
                .unwrap_or_default();
            format!("{} {:.1}ms ({at})", Visible(stage), us / 1000.0)
        })
        .collect();
    if shown_steps.is_empty() {
        "-".to_string()
    } else {
        shown_steps.join(", ")
    }
}

/// The traces for people.
pub fn to_text(traces: &[Trace]) -> String {
    let mut out = String::new();
    for t in traces {
        let first_row = t.rows.iter().find(|r| r.id == t.origin).or(t.rows.first());
        let (from, message_id, arrived) = match (first_row, t.events.first()) {
            (Some(r), _) => (r.mail_from.clone(), r.message_id.clone(), r.arrived),
            (None, Some(e)) => (e.mail_from.clone(), e.message_id.clone(), e.arrived),
            (None, None) => (String::new(), None, None),
        };
        out.push_str(&format!(
            "message {}  from <{}>  Message-ID {}  arrived {}\n",
            t.origin,
            shown(&sender(&from).replace("<>", ""), 200),
            message_id
                .as_deref()
                .map_or("-".to_string(), |m| shown(m, 200)),
            time(arrived)
        ));
        for r in &t.rows {
            let retry = r
                .retry_at
                .map(|s| format!(", retry at {}", time(Some(s))))
                .unwrap_or_default();
            out.push_str(&format!(
                "  in the queue: {} at {}, {}{retry}, to {}\n",
                r.id,
                Visible(&r.stage),
                Visible(&r.status),
                shown(&r.rcpt_to.join(", "), 300)
            ));
            out.push_str(&format!("    passed: {}\n", passes(&r.trail)));
            if let Some(e) = &r.last_error {
                out.push_str(&format!("    last error: {}\n", shown(e, 300)));
            }
        }
        for e in &t.events {
            out.push_str(&format!("  {}  {}  ", time(Some(e.at)), e.id));
            match e.event.as_str() {
                "split" => out.push_str(&format!(
                    "split from {} at {}: {}\n",
                    e.detail.get("from").and_then(Value::as_i64).unwrap_or(0),
                    Visible(&e.stage),
                    shown(
                        &e.detail
                            .get("recipients")
                            .and_then(Value::as_array)
                            .map(|a| {
                                a.iter()
                                    .filter_map(Value::as_str)
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            })
                            .unwrap_or_default(),
                        300
                    )
                )),
                "returned" => out.push_str(&format!(
                    "{}: delivery status notification {} to <{}>\n",
                    Visible(&e.stage),
                    e.detail
                        .get("notification")
                        .and_then(Value::as_i64)
                        .unwrap_or(0),
                    shown(e.recipient.as_deref().unwrap_or(""), 200)
                )),
                event => {
                    out.push_str(&format!(
                        "{}: {event} <{}> relay={} dsn={} delays={}/{} ({})\n",
                        Visible(&e.stage),
                        shown(e.recipient.as_deref().unwrap_or(""), 200),
                        e.relay
                            .as_deref()
                            .map_or("none".to_string(), |r| shown(r, 200)),
                        e.dsn.as_deref().map_or("-".to_string(), |d| shown(d, 20)),
                        secs(e.queued_ms),
                        secs(e.stage_ms),
                        e.reply.as_deref().map_or(String::new(), |r| shown(r, 500))
                    ));
                    if let Some(remote) = &e.remote_id {
                        out.push_str(&format!(
                            "      next hop's queue id: {}\n",
                            shown(remote, 80)
                        ));
                    }
                    if e.trail.as_array().is_some_and(|t| !t.is_empty()) {
                        out.push_str(&format!("      passed: {}\n", passes(&e.trail)));
                    }
                }
            }
        }
    }
    out
}

/// The traces as one JSON document.
pub fn to_json(key: &TraceKey, traces: &[Trace]) -> Value {
    let (by, value) = match key {
        TraceKey::Id(id) => ("id", json!(id)),
        TraceKey::MessageId(m) => ("message-id", json!(m)),
        TraceKey::RemoteId(r) => ("remote-id", json!(r)),
    };
    json!({
        "by": by,
        "value": value,
        "messages": traces.iter().map(|t| json!({
            "origin": t.origin,
            "rows": t.rows.iter().map(|r| json!({
                "id": r.id,
                "stage": r.stage,
                "status": r.status,
                "retry_at": r.retry_at.map(|s| time(Some(s))),
                "arrived": time(r.arrived),
                "from": r.mail_from,
                "to": r.rcpt_to,
                "message_id": r.message_id,
                "trail": r.trail,
                "last_error": r.last_error,
            })).collect::<Vec<_>>(),
            "history": t.events.iter().map(|e| json!({
                "at": time(Some(e.at)),
                "id": e.id,
                "event": e.event,
                "stage": e.stage,
                "from": e.mail_from,
                "to": e.recipient,
                "message_id": e.message_id,
                "relay": e.relay,
                "reply": e.reply,
                "remote_id": e.remote_id,
                "dsn": e.dsn,
                "queued_s": e.queued_ms.map(|m| m as f64 / 1000.0),
                "stage_s": e.stage_ms.map(|m| m as f64 / 1000.0),
                "delay_s": e.arrived.map(|a| e.at - a),
                "detail": e.detail,
                "trail": e.trail,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trail_reads_back_and_garbage_lines_are_skipped() {
        let t = trail(Some(
            "in 12 1733377200123\nbad line\nout x 1\nrelay 4500 1733377200200\n",
        ));
        assert_eq!(
            t,
            json!([
                {"stage": "in", "us": 12, "at": 1_733_377_200_123u64},
                {"stage": "relay", "us": 4500, "at": 1_733_377_200_200u64},
            ])
        );
        assert_eq!(trail(None), json!([]));
        assert_eq!(
            passes(&t),
            "in 0.0ms (2024-12-05T05:40:00.123Z), relay 4.5ms (2024-12-05T05:40:00.200Z)"
        );
    }

    #[test]
    fn a_message_id_gets_its_brackets() {
        assert_eq!(message_id("m@x"), "<m@x>");
        assert_eq!(message_id(" <m@x> "), "<m@x>");
    }
}
