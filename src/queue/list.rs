//! `pepsi-queue list` (one line per message, oldest first, like `mailq`) and
//! `pepsi-queue show ID` (a message's columns and its state; the header block and body
//! only when asked). Reads only. The text shows every value escaped
//! ([`crate::escape`]); `--json` gives them exactly.

use serde_json::{Value, json};

use super::format::{self, Align, Table};
use super::{Session, db_failure, emit, emit_json};
use crate::db::sql;
use crate::escape::{Visible, VisibleBytes, VisibleLines};
use crate::exit::{EX_DATAERR, Failure};

/// `list`'s filters.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only this stage.
    pub stage: Option<String>,
    /// Only this status.
    pub status: Option<String>,
    /// Only this sender key.
    pub sender: Option<String>,
    /// At most this many rows.
    pub limit: i64,
}

/// One line of `list`.
struct Line {
    id: i64,
    stage: String,
    status: String,
    age: f64,
    mail_from: String,
    first_rcpt: String,
    rcpts: i32,
    last_error: Option<String>,
    sender_key: String,
}

/// Runs `pepsi-queue list`.
pub fn list(session: &mut Session, filter: &Filter, json: bool) -> Result<(), Failure> {
    // One row more than asked tells whether the list was cut.
    let rows = session
        .client
        .query(
            sql::QUEUE_LIST,
            &[
                &filter.stage,
                &filter.status,
                &filter.sender,
                &(filter.limit.saturating_add(1)),
            ],
        )
        .map_err(|e| db_failure("listing the queue", &e))?;
    let truncated = rows.len() as i64 > filter.limit;
    let lines: Vec<Line> = rows
        .iter()
        .take(filter.limit as usize)
        .map(|r| Line {
            id: r.get(0),
            stage: r.get(1),
            status: r.get(2),
            age: r.get(3),
            mail_from: r.get(4),
            first_rcpt: r.get::<_, Option<String>>(5).unwrap_or_default(),
            rcpts: r.get(6),
            last_error: r.get(7),
            sender_key: r.get(8),
        })
        .collect();
    if json {
        let rows: Vec<Value> = lines
            .iter()
            .map(|l| {
                json!({
                    "id": l.id,
                    "stage": l.stage,
                    "status": l.status,
                    "age_seconds": if l.age.is_finite() { json!(l.age) } else { Value::Null },
                    "mail_from": l.mail_from,
                    "first_recipient": l.first_rcpt,
                    "recipients": l.rcpts,
                    "last_error": l.last_error,
                    "sender_key": l.sender_key,
                })
            })
            .collect();
        return emit_json(&json!({ "messages": rows, "truncated": truncated }));
    }
    let mut table = Table::new(&[
        ("ID", Align::Right),
        ("STAGE", Align::Left),
        ("STATUS", Align::Left),
        ("AGE", Align::Right),
        ("SENDER", Align::Left),
        ("RECIPIENT", Align::Left),
        ("LAST ERROR", Align::Left),
    ]);
    // Every value is shown escaped (the table escapes its cells, `shown` the values it
    // shortens): a sender or stage name may hold terminal controls or line breaks.
    for l in &lines {
        let first = format::shown(&l.first_rcpt, 50);
        let rcpt = if l.rcpts > 1 {
            format!("{first} (+{} more)", l.rcpts - 1)
        } else {
            first
        };
        table.row(vec![
            l.id.to_string(),
            l.stage.clone(),
            l.status.clone(),
            format::age(l.age),
            format::shown(&format::sender(&l.mail_from), 40),
            rcpt,
            format::one_line(l.last_error.as_deref().unwrap_or(""), 60),
        ]);
    }
    let mut out = if table.is_empty() {
        "no messages\n".to_string()
    } else {
        table.render()
    };
    if truncated {
        out.push_str(&format!(
            "… more messages than --limit {}; narrow the list or raise the limit\n",
            filter.limit
        ));
    }
    emit(out.as_bytes())
}

/// Bytes for JSON: a string when they are UTF-8, else base64 under a `_base64` key.
fn bytes_json(object: &mut serde_json::Map<String, Value>, key: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => object.insert(key.into(), json!(text)),
        Err(_) => object.insert(format!("{key}_base64"), json!(base64(bytes))),
    };
}

/// Standard base64 with padding (RFC 4648).
fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Runs `pepsi-queue show ID`.
pub fn show(
    session: &mut Session,
    id: i64,
    with_headers: bool,
    with_body: bool,
    json: bool,
) -> Result<(), Failure> {
    let row = session
        .client
        .query_opt(sql::QUEUE_SHOW, &[&id, &with_headers, &with_body])
        .map_err(|e| db_failure(&format!("reading message {id}"), &e))?
        .ok_or_else(|| Failure::new(EX_DATAERR, format!("message {id}: no such message")))?;
    let state_text: String = row.get(12);
    let state: Value = serde_json::from_str(&state_text).unwrap_or(Value::String(state_text));
    let age: f64 = row.get(5);
    let client_ip: Option<String> = row.get(9);
    let rcpt_to: Vec<String> = row.get(7);
    let headers: Option<Vec<u8>> = row.get(20);
    let body: Option<Vec<u8>> = row.get(21);
    let mut o = serde_json::Map::new();
    o.insert("id".into(), json!(row.get::<_, i64>(0)));
    o.insert("stage".into(), json!(row.get::<_, String>(1)));
    o.insert("status".into(), json!(row.get::<_, String>(2)));
    o.insert("timeout".into(), json!(row.get::<_, Option<String>>(3)));
    o.insert("arrived".into(), json!(row.get::<_, Option<String>>(4)));
    o.insert(
        "age_seconds".into(),
        if age.is_finite() {
            json!(age)
        } else {
            Value::Null
        },
    );
    o.insert("mail_from".into(), json!(row.get::<_, String>(6)));
    o.insert("rcpt_to".into(), json!(rcpt_to));
    o.insert("auth_user".into(), json!(row.get::<_, Option<String>>(8)));
    o.insert("client_ip".into(), json!(client_ip));
    o.insert(
        "header_from".into(),
        json!(row.get::<_, Option<String>>(10)),
    );
    o.insert("subject".into(), json!(row.get::<_, Option<String>>(11)));
    o.insert("sender_key".into(), json!(row.get::<_, String>(13)));
    o.insert("claim".into(), json!(row.get::<_, i64>(14)));
    o.insert("hops".into(), json!(row.get::<_, i32>(15)));
    o.insert("hop_stage".into(), json!(row.get::<_, Option<String>>(16)));
    o.insert("body_id".into(), json!(row.get::<_, Option<i64>>(17)));
    o.insert("header_bytes".into(), json!(row.get::<_, Option<i64>>(18)));
    o.insert("body_bytes".into(), json!(row.get::<_, Option<i64>>(19)));
    o.insert("state".into(), state.clone());
    if json {
        if with_headers {
            match &headers {
                Some(h) => bytes_json(&mut o, "headers", h),
                None => {
                    o.insert("headers".into(), Value::Null);
                }
            }
        }
        if with_body {
            match &body {
                Some(b) => bytes_json(&mut o, "body", b),
                None => {
                    o.insert("body".into(), Value::Null);
                }
            }
        }
        return emit_json(&Value::Object(o));
    }
    let mut out = Vec::new();
    let field = |out: &mut Vec<u8>, name: &str, value: String| {
        out.extend_from_slice(format!("{name:<12} {value}\n").as_bytes());
    };
    // Every value is shown escaped on its line; the state as pretty JSON (whose strings
    // serde escapes but for the invisible formatting characters) keeps its line feeds,
    // the content its line ends, and everything else is escaped.
    let text = |v: &Value| match v {
        Value::Null => "-".to_string(),
        Value::String(s) => format::shown(s, 200),
        other => other.to_string(),
    };
    for (name, key) in [
        ("id", "id"),
        ("stage", "stage"),
        ("status", "status"),
        ("retry at", "timeout"),
        ("arrived", "arrived"),
    ] {
        field(&mut out, name, text(&o[key]));
    }
    field(&mut out, "age", format::age(age));
    field(
        &mut out,
        "sender",
        format::shown(&format::sender(o["mail_from"].as_str().unwrap_or("")), 200),
    );
    let recipients: Vec<String> = rcpt_to.iter().map(|r| Visible(r).to_string()).collect();
    field(&mut out, "recipients", recipients.join(", "));
    for (name, key) in [
        ("auth user", "auth_user"),
        ("client ip", "client_ip"),
        ("from", "header_from"),
        ("subject", "subject"),
        ("sender key", "sender_key"),
        ("claim", "claim"),
        ("hops", "hops"),
        ("hop stage", "hop_stage"),
        ("body id", "body_id"),
        ("header size", "header_bytes"),
        ("body size", "body_bytes"),
    ] {
        field(&mut out, name, text(&o[key]));
    }
    let pretty = serde_json::to_string_pretty(&state).unwrap_or_default();
    out.extend_from_slice(format!("state\n{}\n", VisibleLines(&pretty)).as_bytes());
    if with_headers {
        out.extend_from_slice(b"\nheader block:\n");
        let shown = headers.as_deref().map(|h| VisibleBytes(h).to_string());
        out.extend_from_slice(shown.as_deref().unwrap_or("(none)\n").as_bytes());
    }
    if with_body {
        out.extend_from_slice(b"\nbody:\n");
        let shown = body.as_deref().map(|b| VisibleBytes(b).to_string());
        out.extend_from_slice(shown.as_deref().unwrap_or("(none)\n").as_bytes());
    }
    emit(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_rfc_4648() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
    }
}
