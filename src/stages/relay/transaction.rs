//! One message's mail transaction over an open [`Connection`]: the message data as
//! sent (CRLF line ends, dot-stuffed), the checks against what the smarthost offers
//! (SIZE, SMTPUTF8, 8BITMIME), the XFORWARD, MAIL, RCPT and DATA commands with their
//! parameters (DSN from `state.dsn`), pipelined in windows when PIPELINING is offered, and
//! each recipient's result from the replies, the LMTP replies after the data included.
//!
//! Used by `mod.rs`; it owns neither the connection's life nor the message's outcome.

use serde_json::Value;

use super::client::Connection;
use super::reply::{Broken, Reply};
use crate::worker::RecipientResult;

/// The most commands written under PIPELINING before their replies are read.
const WINDOW_COMMANDS: usize = 100;
/// The most octets of commands written under PIPELINING before their replies are read
/// (a single longer command goes alone).
const WINDOW_BYTES: usize = 16 * 1024;

/// Each recipient with its result.
pub type Results = Vec<(String, RecipientResult)>;

/// What a transaction sends: the envelope, its parameters and the data.
pub struct Envelope<'a> {
    /// The sender, empty for the null sender.
    pub mail_from: &'a str,
    /// The recipients.
    pub rcpt_to: &'a [String],
    /// `state.dsn`, if any.
    pub dsn: Option<&'a Value>,
    /// The original client's address (XFORWARD ADDR).
    pub client_ip: Option<&'a str>,
    /// The original client's login (XFORWARD LOGIN).
    pub auth_user: Option<&'a str>,
    /// Is it LMTP (one reply per recipient after the data)?
    pub lmtp: bool,
}

/// The message as it reaches the other side, before dot-stuffing: the header block,
/// the blank line that ends it if it lacks one, the body; every bare LF made CRLF (bare
/// CRs kept), and a final CRLF when the text does not end with a line end. What a
/// signature (`dkim-sign`) covers is exactly this.
pub fn as_sent(headers: &[u8], body: &[u8]) -> Vec<u8> {
    let mut text = Vec::with_capacity(headers.len() + body.len() + 64);
    text.extend_from_slice(headers);
    let ended = headers.is_empty() || headers.ends_with(b"\n\n") || headers.ends_with(b"\r\n\r\n");
    if !ended {
        if !headers.ends_with(b"\n") {
            text.extend_from_slice(b"\r\n");
        }
        text.extend_from_slice(b"\r\n");
    }
    text.extend_from_slice(body);
    let mut out = Vec::with_capacity(text.len() + text.len() / 40 + 8);
    for (i, &b) in text.iter().enumerate() {
        if b == b'\n' && (i == 0 || text[i - 1] != b'\r') {
            out.push(b'\r');
        }
        out.push(b);
    }
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// The message as sent after DATA: [`as_sent`], every line that starts with a dot
/// (after LF or a bare CR) given another, and the final dot.
pub fn encode(headers: &[u8], body: &[u8]) -> Vec<u8> {
    let text = as_sent(headers, body);
    let mut out = Vec::with_capacity(text.len() + text.len() / 40 + 8);
    // A line starts after LF or after a bare CR: a server that takes a bare CR for a
    // line end must never see an unstuffed "." there (SMTP smuggling).
    let mut line_start = true;
    for (i, &b) in text.iter().enumerate() {
        if line_start && b == b'.' {
            out.push(b'.');
        }
        out.push(b);
        line_start = b == b'\n' || (b == b'\r' && text.get(i + 1) != Some(&b'\n'));
    }
    out.extend_from_slice(b".\r\n");
    out
}

/// xtext (RFC 3461 §4): `+`, `=`, controls, space and non-ASCII as `+XX`.
pub fn xtext(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (b'!'..=b'~').contains(&b) && b != b'+' && b != b'=' {
            out.push(b as char);
        } else {
            out.push_str(&format!("+{b:02X}"));
        }
    }
    out
}

/// A recipient's `state.dsn.rcpt` entry (addresses match case-insensitively).
fn dsn_of<'a>(dsn: Option<&'a Value>, address: &str) -> Option<&'a Value> {
    dsn?.get("rcpt")?
        .as_object()?
        .iter()
        .find(|(a, _)| a.eq_ignore_ascii_case(address))
        .map(|(_, v)| v)
}

/// A permanent failure of every recipient, found before sending anything.
fn refuse_all(rcpt_to: &[String], status: &str, why: &str) -> Vec<(String, RecipientResult)> {
    rcpt_to
        .iter()
        .map(|r| {
            (
                r.clone(),
                RecipientResult::Failed {
                    error: why.to_string(),
                    status: status.to_string(),
                    diagnostic: None,
                },
            )
        })
        .collect()
}

/// A recipient's result from a reply: 2xx done, 5xx failed with the reply's status
/// and text, anything else (4xx, or a reply no command may get here) deferred.
pub fn result_of(reply: &Reply, what: &str) -> RecipientResult {
    match reply.class() {
        2 => RecipientResult::Done,
        5 => RecipientResult::Failed {
            error: format!("smarthost refused {what}: {reply}"),
            status: reply.status(),
            diagnostic: Some(reply.diagnostic()),
        },
        _ => RecipientResult::Deferred(format!("smarthost deferred {what}: {reply}")),
    }
}

/// A reply to MAIL, RCPT, XFORWARD or the final dot must be 2xx, 4xx or 5xx; any other
/// (a 3xx) is a protocol error: nothing is decided by it and the connection is dropped.
fn sane(reply: &Reply, line: &str) -> Result<(), Broken> {
    if matches!(reply.class(), 2 | 4 | 5) {
        return Ok(());
    }
    let verb = line.split([' ', ':']).next().unwrap_or(line);
    Err(Broken(format!(
        "protocol error: the smarthost answered {verb} with {reply}"
    )))
}

/// The command lines before DATA: XFORWARD (when offered), MAIL FROM, each RCPT TO.
fn commands(
    c: &Connection,
    e: &Envelope<'_>,
    size: usize,
    utf8: bool,
    eightbit: bool,
) -> Vec<String> {
    let o = &c.offers;
    let mut lines = Vec::new();
    let mut forward = Vec::new();
    for (attr, value) in [("ADDR", e.client_ip), ("LOGIN", e.auth_user)] {
        if o.xforward.iter().any(|a| a == attr) {
            let value = value.map_or("[UNAVAILABLE]".to_string(), xtext);
            forward.push(format!("{attr}={value}"));
        }
    }
    if !forward.is_empty() {
        lines.push(format!("XFORWARD {}", forward.join(" ")));
    }
    let mut mail = format!("MAIL FROM:<{}>", e.mail_from);
    if o.size.is_some() {
        mail.push_str(&format!(" SIZE={size}"));
    }
    if eightbit && o.eightbit {
        mail.push_str(" BODY=8BITMIME");
    }
    if utf8 && o.smtputf8 {
        mail.push_str(" SMTPUTF8");
    }
    if o.dsn {
        if let Some(ret) = e.dsn.and_then(|d| d.get("ret")).and_then(Value::as_str) {
            if ret == "FULL" || ret == "HDRS" {
                mail.push_str(&format!(" RET={ret}"));
            }
        }
        if let Some(envid) = e.dsn.and_then(|d| d.get("envid")).and_then(Value::as_str) {
            mail.push_str(&format!(" ENVID={}", xtext(envid)));
        }
    }
    lines.push(mail);
    for r in e.rcpt_to {
        let mut rcpt = format!("RCPT TO:<{r}>");
        if o.dsn {
            let entry = dsn_of(e.dsn, r);
            let notify = entry.and_then(|v| v.get("notify")).and_then(Value::as_str);
            if let Some(n) = notify
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_uppercase() || b == b','))
            {
                rcpt.push_str(&format!(" NOTIFY={n}"));
            }
            let orcpt = entry.and_then(|v| v.get("orcpt")).and_then(Value::as_str);
            if let Some((kind, address)) = orcpt.and_then(|o| o.split_once(';')) {
                if !kind.is_empty() && kind.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                {
                    rcpt.push_str(&format!(" ORCPT={kind};{}", xtext(address.trim())));
                }
            }
        }
        lines.push(rcpt);
    }
    lines
}

/// Does an envelope address hold a character that may not go into a command line (a
/// control character: CR or LF would end the command and start another)? The queue
/// refuses such addresses from every writer; the relay never sends one all the same.
fn unsendable(address: &str) -> bool {
    address.chars().any(char::is_control)
}

/// Runs one transaction: each recipient's result, or the failure that broke the
/// connection (for every recipient without a final reply; in LMTP the replies read
/// before it stand). After `Err` the connection is of no further use. A sender or a
/// recipient that cannot go into a command line fails (5.1.7, 5.1.3) without a word
/// to the smarthost.
pub fn deliver(
    c: &mut Connection,
    e: &Envelope<'_>,
    headers: &[u8],
    body: &[u8],
) -> Result<Results, (Broken, Results)> {
    c.last_reply = None;
    if unsendable(e.mail_from) {
        return Ok(refuse_all(
            e.rcpt_to,
            "5.1.7",
            "the sender's address holds a control character and cannot be sent",
        ));
    }
    let (bad, good): (Vec<String>, Vec<String>) =
        e.rcpt_to.iter().cloned().partition(|r| unsendable(r));
    if bad.is_empty() {
        return deliver_clean(c, e, headers, body);
    }
    let mut refused = refuse_all(
        &bad,
        "5.1.3",
        "the recipient's address holds a control character and cannot be sent",
    );
    if good.is_empty() {
        return Ok(refused);
    }
    let clean = Envelope {
        rcpt_to: &good,
        ..*e
    };
    match deliver_clean(c, &clean, headers, body) {
        Ok(mut results) => {
            results.append(&mut refused);
            Ok(results)
        }
        Err((broken, mut results)) => {
            results.append(&mut refused);
            Err((broken, results))
        }
    }
}

/// [`deliver`] of an envelope whose addresses may all be sent.
fn deliver_clean(
    c: &mut Connection,
    e: &Envelope<'_>,
    headers: &[u8],
    body: &[u8],
) -> Result<Results, (Broken, Results)> {
    let envelope_utf8 = !e.mail_from.is_ascii() || e.rcpt_to.iter().any(|r| !r.is_ascii());
    let utf8 = envelope_utf8 || !headers.is_ascii();
    let eightbit = !headers.is_ascii() || !body.is_ascii();
    let data = encode(headers, body);
    // The size as SIZE counts it: the data without the stuffing and the final dot is
    // close enough, and the final dot's three octets never decide a limit.
    let size = data.len();
    let o = c.offers.clone();
    if let Some(limit) = o.size.filter(|&l| l > 0 && size as u64 > l) {
        return Ok(refuse_all(
            e.rcpt_to,
            "5.3.4",
            &format!("the message ({size} octets) is larger than the smarthost takes ({limit})"),
        ));
    }
    if envelope_utf8 && !o.smtputf8 {
        return Ok(refuse_all(
            e.rcpt_to,
            "5.6.7",
            "the envelope has UTF-8 addresses and the smarthost does not offer SMTPUTF8",
        ));
    }
    if eightbit && !o.eightbit {
        return Ok(refuse_all(
            e.rcpt_to,
            "5.6.3",
            "the message has 8-bit data and the smarthost does not offer 8BITMIME",
        ));
    }
    let lines = commands(c, e, size, utf8, eightbit);
    let broken = |b: Broken| (b, Vec::new());
    let forwarded = lines[0].starts_with("XFORWARD ");
    let mut replies: Vec<Reply> = Vec::new();
    if o.pipelining {
        // In windows, each written whole and then its replies read: a smarthost that
        // writes its replies as it reads (blocking) fills its socket buffer, then ours,
        // if thousands of commands go out before a reply is read.
        let all: Vec<&str> = lines.iter().map(String::as_str).chain(["DATA"]).collect();
        let mut start = 0;
        while start < all.len() {
            let mut batch = String::new();
            let mut end = start;
            while end < all.len()
                && end - start < WINDOW_COMMANDS
                && (end == start || batch.len() + all[end].len() + 2 <= WINDOW_BYTES)
            {
                batch.push_str(all[end]);
                batch.push_str("\r\n");
                end += 1;
            }
            c.send(batch.as_bytes(), c.timeouts().command)
                .map_err(broken)?;
            for _ in start..end {
                replies.push(c.reply().map_err(broken)?);
            }
            start = end;
        }
        for (reply, line) in replies.iter().zip(&lines) {
            sane(reply, line).map_err(broken)?;
        }
    } else {
        for (i, l) in lines.iter().enumerate() {
            let reply = c.command(l).map_err(broken)?;
            sane(&reply, l).map_err(broken)?;
            let stop = !reply.is_ok() && (i == 0 || (forwarded && i == 1));
            replies.push(reply);
            if stop {
                break;
            }
        }
    }
    // Under PIPELINING DATA went out with the envelope: its reply is the last.
    let pipelined_data = if o.pipelining { replies.pop() } else { None };
    // Did DATA open the data phase though nothing is to be sent? Then the session is
    // inside the data, where no "." may end it for nobody: the connection is dropped.
    let inside_data = pipelined_data.as_ref().is_some_and(|r| r.code == 354);
    let skip = usize::from(forwarded);
    let mut results: Vec<(String, Option<RecipientResult>)> =
        e.rcpt_to.iter().map(|r| (r.clone(), None)).collect();
    if forwarded && !replies[0].is_ok() {
        // XFORWARD only informs: its refusal says nothing of the recipients. A host
        // error for the message, retried on another connection.
        return Err(broken(Broken(format!(
            "the smarthost refused XFORWARD: {}",
            replies[0]
        ))));
    }
    // A refused MAIL decides for every recipient.
    if let Some(reply) = replies.get(skip).filter(|r| !r.is_ok()) {
        let results: Results = e
            .rcpt_to
            .iter()
            .map(|r| (r.clone(), result_of(reply, "the sender")))
            .collect();
        return match &pipelined_data {
            Some(r) if inside_data || !matches!(r.class(), 4 | 5) => Err((
                Broken(format!(
                    "protocol error: the smarthost answered DATA with {r} after refusing the sender"
                )),
                results,
            )),
            _ => Ok(results),
        };
    }
    let mut accepted = Vec::new();
    for (i, (address, result)) in results.iter_mut().enumerate() {
        let Some(reply) = replies.get(skip + 1 + i) else {
            continue;
        };
        if reply.is_ok() {
            accepted.push(i);
        } else {
            *result = Some(result_of(reply, &format!("<{address}>")));
        }
    }
    if accepted.is_empty() && inside_data {
        return Err((
            Broken("protocol error: the smarthost answered DATA with 354 for no recipient".into()),
            finished(results),
        ));
    }
    let data_reply = if o.pipelining {
        pipelined_data
    } else if accepted.is_empty() {
        None
    } else {
        Some(c.command("DATA").map_err(broken)?)
    };
    match data_reply {
        Some(r) if r.code == 354 => {
            c.send(&data, c.timeouts().data).map_err(broken)?;
            let done = c.timeouts().data_done;
            if e.lmtp {
                for (n, &i) in accepted.iter().enumerate() {
                    match c
                        .reply_within(done)
                        .and_then(|r| sane(&r, "the data's final dot").map(|()| r))
                    {
                        Ok(reply) => {
                            if reply.is_ok() {
                                c.last_reply = Some(reply.to_string());
                            }
                            results[i].1 = Some(result_of(&reply, &format!("<{}>", results[i].0)))
                        }
                        Err(b) => {
                            let error = format!("{}: no reply for it after the data", b.0);
                            for &j in &accepted[n..] {
                                results[j].1 = Some(RecipientResult::Deferred(error.clone()));
                            }
                            return Err((b, finished(results)));
                        }
                    }
                }
            } else {
                let reply = c.reply_within(done).map_err(broken)?;
                sane(&reply, "the data's final dot").map_err(broken)?;
                if reply.is_ok() {
                    c.last_reply = Some(reply.to_string());
                }
                for &i in &accepted {
                    results[i].1 = Some(result_of(&reply, "the message"));
                }
            }
        }
        Some(r) if matches!(r.class(), 4 | 5) => {
            for &i in &accepted {
                results[i].1 = Some(result_of(&r, "the data"));
            }
        }
        Some(r) => {
            // Only 354 lets the data go: a 2xx or 3xx to DATA delivered nothing, and
            // the session's state is unknown.
            let why = format!("protocol error: the smarthost answered DATA with {r}");
            for &i in &accepted {
                results[i].1 = Some(RecipientResult::Deferred(why.clone()));
            }
            return Err((Broken(why), finished(results)));
        }
        None => {}
    }
    Ok(finished(results))
}

/// The results, every recipient without one deferred.
fn finished(results: Vec<(String, Option<RecipientResult>)>) -> Vec<(String, RecipientResult)> {
    results
        .into_iter()
        .map(|(a, r)| {
            let r = r.unwrap_or_else(|| {
                RecipientResult::Deferred("the smarthost gave no result for this recipient".into())
            });
            (a, r)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_gets_crlf_line_ends_dot_stuffing_and_the_final_dot() {
        assert_eq!(
            encode(b"A: 1\r\nB: 2\r\n", b".hidden\r\nx\r\n..two\r\n"),
            b"A: 1\r\nB: 2\r\n\r\n..hidden\r\nx\r\n...two\r\n.\r\n"
        );
        assert_eq!(encode(b"A: 1\n\n", b"a\nb"), b"A: 1\r\n\r\na\r\nb\r\n.\r\n");
        assert_eq!(encode(b"A: 1", b".\n"), b"A: 1\r\n\r\n..\r\n.\r\n");
        assert_eq!(encode(b"", b""), b".\r\n");
        assert_eq!(
            encode(b"A: 1\r\n\r\n", b"\xc3\xa9\r"),
            b"A: 1\r\n\r\n\xc3\xa9\r\r\n.\r\n"
        );
    }

    #[test]
    fn a_dot_after_a_bare_cr_is_stuffed() {
        assert_eq!(
            encode(b"A: 1\r\n\r\n", b"x\r.\r\nMAIL FROM:<e@vil>\r\n"),
            b"A: 1\r\n\r\nx\r..\r\nMAIL FROM:<e@vil>\r\n.\r\n"
        );
        assert_eq!(
            encode(b"", b"a\r.\rb\r\n"),
            b"a\r..\rb\r\n.\r\n",
            "CRLF bodies stay byte for byte, bare CRs kept"
        );
        assert_eq!(encode(b"", b"a\r\n.\r"), b"a\r\n..\r\r\n.\r\n");
    }

    #[test]
    fn xtext_encodes_plus_equals_controls_space_and_non_ascii() {
        assert_eq!(xtext("a+b=c d"), "a+2Bb+3Dc+20d");
        assert_eq!(xtext("rfc\r\n"), "rfc+0D+0A");
        assert_eq!(xtext("é"), "+C3+A9");
    }

    #[test]
    fn a_reply_gives_a_recipient_its_result() {
        let r = |code, text: &str| Reply {
            code,
            text: text.into(),
            lines: vec![],
        };
        assert_eq!(result_of(&r(250, "2.1.5 ok"), "x"), RecipientResult::Done);
        assert!(matches!(
            result_of(&r(451, "4.3.0 later"), "x"),
            RecipientResult::Deferred(_)
        ));
        assert!(matches!(
            result_of(&r(354, "go ahead"), "x"),
            RecipientResult::Deferred(_)
        ));
        assert_eq!(
            result_of(&r(550, "5.1.1 <x@y>: user unknown"), "<x@y>"),
            RecipientResult::Failed {
                error: "smarthost refused <x@y>: 550 5.1.1 <x@y>: user unknown".into(),
                status: "5.1.1".into(),
                diagnostic: Some("smtp; 550 5.1.1 <x@y>: user unknown".into()),
            }
        );
    }
}
