//! The DATA command of a session of `pepsi-ingress` (§16): the message read up to
//! `<CR><LF>.<CR><LF>` within its deadline and size limit, dot-stuffing undone, then
//! handed to the committer and answered with what became of it (250 after its commit,
//! 451 when the database could not take it, 552/554 when it is refused; in LMTP one
//! reply per recipient). The rest of the session is `session.rs`'s.

use std::io::{self, Read, Write};
use std::time::Instant;

use super::commit::{Message, Outcome};
use super::counters::Counters;
use super::params;
use super::reply::Reply;
use super::session::{Deadline, End, Forwarded, Line, Session, Transaction};
use crate::config::ingress::Protocol;
use crate::intake;

impl<R: Read, W: Write> Session<'_, R, W> {
    /// DATA (its line ended in CRLF: `crlf`): the message, then its fate.
    pub(super) fn data(&mut self, arg: &str, crlf: bool) -> io::Result<Option<End>> {
        if !arg.trim().is_empty() {
            return Ok(self.error(Reply::new(501, "5.5.4", "Syntax: DATA")));
        }
        if self.tx.mail.is_none() {
            return Ok(self.error(Reply::new(503, "5.5.1", "Error: need MAIL command")));
        }
        if self.tx.rcpts.is_empty() {
            return Ok(self.error(Reply::new(554, "5.5.1", "Error: no valid recipients")));
        }
        self.say(&Reply::plain(354, "End data with <CR><LF>.<CR><LF>"));
        self.flush()?;
        let max = self.settings.max_size as usize;
        // The size the client announced, so the buffer need not grow by doubling (and
        // end up to twice the message); never more than the limit.
        let announced = self.tx.mail.as_ref().and_then(|m| m.size).unwrap_or(0);
        let mut data = Vec::with_capacity((announced as usize).min(max));
        let mut too_big = false;
        // The whole data by its deadline, which grows with what arrives.
        self.deadline = Deadline::Data {
            started: Instant::now(),
            received: 0,
        };
        // Did the line before end in CRLF (as sent)? Only <CR><LF>.<CR><LF> ends the
        // data; the DATA command's own line end counts for a message that is empty.
        let mut after_crlf = crlf;
        loop {
            let line = match self.read_line(max + 2)? {
                Line::Text(l) => l,
                Line::TooLong(ended_crlf) => {
                    too_big = true;
                    after_crlf = ended_crlf;
                    continue;
                }
                Line::Eof => return Ok(Some(self.closed())),
            };
            if let Deadline::Data { received, .. } = &mut self.deadline {
                *received += line.len() as u64;
            }
            if after_crlf && line == b".\r\n" {
                break;
            }
            after_crlf = line.ends_with(b"\r\n");
            let content = content_line(&line);
            if !too_big {
                if data.len() + content.len() > max {
                    too_big = true;
                    data = Vec::new();
                } else {
                    data.extend_from_slice(&content);
                }
            }
        }
        let tx = std::mem::take(&mut self.tx);
        let forwarded = std::mem::take(&mut self.forwarded);
        let reply_ok = |id: i64| Reply::new(250, "2.0.0", format!("Ok: queued as {id}"));
        let outcome = if too_big {
            Err(Reply::new(
                552,
                "5.3.4",
                format!("Message size exceeds the limit of {max} bytes"),
            ))
        } else {
            self.queue(&tx, forwarded, data)
        };
        let lmtp = self.settings.protocol == Protocol::Lmtp;
        let replies: Vec<Reply> = match &outcome {
            Ok(id) if lmtp => tx
                .rcpts
                .iter()
                .map(|_| Reply::new(250, "2.1.5", format!("Ok: queued as {id}")))
                .collect(),
            Ok(id) => vec![reply_ok(*id)],
            Err(r) if lmtp => vec![r.clone(); tx.rcpts.len()],
            Err(r) => vec![r.clone()],
        };
        match &outcome {
            Ok(_) => {
                self.summary.accepted += 1;
                self.summary.recipients += tx.rcpts.len() as u64;
            }
            Err(r) if r.code < 500 => {
                self.summary.deferred += 1;
                Counters::bump(&self.counters.deferred, 1);
            }
            Err(_) => {
                self.summary.refused += 1;
                Counters::bump(&self.counters.refused, 1);
            }
        }
        for r in &replies {
            self.say(r);
        }
        Ok(None)
    }

    /// Hands a received message to the committer: its id once committed, or the reply
    /// that says why not.
    fn queue(&self, tx: &Transaction, forwarded: Forwarded, data: Vec<u8>) -> Result<i64, Reply> {
        let mail = tx.mail.as_ref().expect("DATA needs MAIL");
        let parsed = intake::read_owned(data).map_err(|why| {
            Reply::new(
                554,
                "5.6.0",
                format!("Message refused: {}", crate::escape::Visible(&why)),
            )
        })?;
        let mut state = serde_json::Map::new();
        if let Some(dsn) = params::dsn_state(mail, &tx.rcpts) {
            state.insert("dsn".into(), dsn);
        }
        let msg = Message {
            mail_from: mail.address.clone(),
            rcpt_to: tx.rcpts.iter().map(|r| r.address.clone()).collect(),
            headers: parsed.headers,
            body: parsed.body,
            auth_user: forwarded.login,
            client_ip: forwarded.addr.or(self.peer),
            header_from: parsed.header_from,
            subject: parsed.subject,
            state: serde_json::Value::Object(state),
        };
        match self.committer.commit(msg) {
            Outcome::Queued(id) => Ok(id),
            Outcome::Deferred => Err(Reply::new(
                451,
                "4.3.0",
                "Temporary failure: the mail queue is unavailable, try again later",
            )),
            Outcome::Refused(why) => {
                log::warn!(
                    "a message from <{}> was refused by the queue: {}",
                    crate::escape::Visible(&mail.address),
                    crate::escape::Visible(&why)
                );
                Err(Reply::new(
                    554,
                    "5.6.0",
                    "Message refused by the mail queue",
                ))
            }
        }
    }
}

/// A line of the data as it is stored: without the dot a client doubles at the start
/// of a line (RFC 5321 §4.5.2), and ending in CRLF where it ended in a bare LF.
fn content_line(line: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let line = line.strip_prefix(b".").unwrap_or(line);
    match line.strip_suffix(b"\n") {
        Some(rest) if !rest.ends_with(b"\r") => {
            let mut fixed = Vec::with_capacity(line.len() + 1);
            fixed.extend_from_slice(rest);
            fixed.extend_from_slice(b"\r\n");
            std::borrow::Cow::Owned(fixed)
        }
        _ => std::borrow::Cow::Borrowed(line),
    }
}
