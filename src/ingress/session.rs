//! One LMTP (RFC 2033) or SMTP (RFC 5321) session of `pepsi-ingress`, from the
//! greeting to the close: the commands, PIPELINING (RFC 2920: replies are written when
//! the client has sent everything it had, so a pipelined burst is answered in one
//! write), the data with its dot-stuffing and size limit, and the end of the data:
//! the message handed to the committer ([`super::commit`]) and answered only with
//! what became of it — 250 after its commit, 451 when the database could not take it,
//! 552/554 when it is refused; in LMTP one reply per recipient.
//!
//! Every wait is bounded by a deadline, not by the time between two bytes: a command
//! line must be complete within `TIMEOUT` of the moment the session waits for it, and a
//! message's data within `TIMEOUT` and a second more per `MIN_DATA_RATE` bytes received
//! (Postfix's per-record deadline and minimum data rate); a client that misses one gets
//! 421 4.4.2 and is closed. A command line longer than [`MAX_COMMAND`] is 500 5.5.2
//! (the rest of the line skipped); more than `MAX_ERRORS` 5xx replies close the session
//! with 421 4.7.0.
//!
//! Only `<CR><LF>.<CR><LF>` ends the data (RFC 5321 §4.1.1.4): a dot line that ends in
//! a bare LF, or that follows a line which did, is content, so no client can end one
//! message and smuggle a second in behind a front end that reads the data otherwise.
//! A line of content or a command that ends in a bare LF is taken as if it ended in
//! CRLF, as Postfix's `smtpd_forbid_bare_newline = normalize` does; a bare CR is kept as
//! it came (it ends nothing). Called by `listen.rs`, one thread per session; it knows
//! nothing of the database but the committer.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustls::ServerConfig;

use super::channel::{Channel, Duplex};
use super::commit::Committer;
use super::counters::Counters;
use super::params::{self, MailFrom, RcptTo};
use super::reply::Reply;
use crate::config::ingress::Protocol;
use crate::tls::Negotiated;

/// The longest command line read whole (RFC 5321 §4.5.3.1.4 says 512 octets; the
/// extensions' parameters need more).
pub const MAX_COMMAND: usize = 4096;

/// What a session is allowed and how it presents itself.
pub struct Settings<'a> {
    /// LMTP or SMTP.
    pub protocol: Protocol,
    /// The name in the greeting and the answer to EHLO/LHLO.
    pub hostname: &'a str,
    /// `MAX_MESSAGE_SIZE`.
    pub max_size: u64,
    /// `MAX_RECIPIENTS`.
    pub max_recipients: usize,
    /// `MAX_ERRORS`.
    pub max_errors: u32,
    /// May this client use XFORWARD (`XFORWARD_FROM`)?
    pub xforward: bool,
    /// Set when the daemon shuts down: the session ends at its next command.
    pub stopping: &'a AtomicBool,
    /// `TIMEOUT`: each command line's deadline, and the data's at least.
    pub timeout: Duration,
    /// `MIN_DATA_RATE`, bytes per second: what extends the data's deadline.
    pub min_data_rate: u64,
    /// The TLS configuration STARTTLS uses (`TLS_CERT`, `TLS_KEY`, as read last);
    /// `None`: no STARTTLS.
    pub tls: Option<Arc<ServerConfig>>,
    /// `REQUIRE_TLS` names this listener: no mail before STARTTLS.
    pub require_tls: bool,
}

/// How a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The client said QUIT.
    Quit,
    /// The client closed the connection.
    Closed,
    /// The client said nothing for the timeout.
    Timeout,
    /// Too many errors.
    TooManyErrors,
    /// The daemon shuts down.
    ShuttingDown,
    /// The connection failed.
    Failed(String),
}

/// What a session did, for its log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The name the client gave in HELO/EHLO/LHLO.
    pub helo: Option<String>,
    /// Messages queued.
    pub accepted: u64,
    /// Their recipients.
    pub recipients: u64,
    /// Messages answered 4xx at the end of the data.
    pub deferred: u64,
    /// Messages answered 5xx at the end of the data.
    pub refused: u64,
    /// How it ended.
    pub end: End,
    /// What its TLS session negotiated; `None` in clear text.
    pub tls: Option<Negotiated>,
}

/// A line read from the client.
pub(super) enum Line {
    /// A line, with its line end.
    Text(Vec<u8>),
    /// A line longer than the limit (read and dropped up to its end), and whether it
    /// ended in CRLF.
    TooLong(bool),
    /// The client closed the connection.
    Eof,
}

/// When a read must be done by.
#[derive(Clone, Copy)]
pub(super) enum Deadline {
    /// A command line: by this instant.
    At(Instant),
    /// A message's data: `TIMEOUT` after it started, and a second more per
    /// `MIN_DATA_RATE` bytes received so far.
    Data { started: Instant, received: u64 },
}

/// The transaction in progress.
#[derive(Default)]
pub(super) struct Transaction {
    pub(super) mail: Option<MailFrom>,
    pub(super) rcpts: Vec<RcptTo>,
}

/// What XFORWARD said about the real client.
#[derive(Default)]
pub(super) struct Forwarded {
    pub(super) addr: Option<IpAddr>,
    pub(super) login: Option<String>,
}

/// A session (its fields are `starttls.rs`'s too).
pub(super) struct Session<'a, R: Read, W: Write> {
    pub(super) settings: &'a Settings<'a>,
    pub(super) peer: Option<IpAddr>,
    pub(super) deadline: Deadline,
    pub(super) committer: &'a Committer,
    pub(super) counters: &'a Counters,
    /// The connection, in clear text or inside TLS.
    pub(super) io: BufReader<Channel<'a, R, W>>,
    out: Vec<u8>,
    errors: u32,
    pub(super) helo: Option<String>,
    pub(super) tx: Transaction,
    pub(super) forwarded: Forwarded,
    pub(super) summary: Summary,
}

/// Serves one session on `reader`/`writer` (two handles of one connection, whose reads
/// wait as long as `read_timeout` last said) with a client at `peer` (`None`: a Unix
/// socket's).
pub fn serve<'a, R: Read, W: Write>(
    reader: R,
    writer: W,
    settings: &'a Settings<'a>,
    peer: Option<IpAddr>,
    read_timeout: &'a dyn Fn(Duration) -> io::Result<()>,
    committer: &'a Committer,
    counters: &'a Counters,
) -> Summary {
    let channel = Channel::Plain(Duplex::new(reader, writer, read_timeout));
    let mut s = Session {
        settings,
        peer,
        deadline: Deadline::At(Instant::now() + settings.timeout),
        committer,
        counters,
        io: BufReader::with_capacity(64 * 1024, channel),
        out: Vec::new(),
        errors: 0,
        helo: None,
        tx: Transaction::default(),
        forwarded: Forwarded::default(),
        summary: Summary {
            helo: None,
            accepted: 0,
            recipients: 0,
            deferred: 0,
            refused: 0,
            end: End::Closed,
            tls: None,
        },
    };
    let end = s.run();
    s.summary.helo = s.helo.take();
    s.summary.end = end;
    s.summary
}

/// Is this error a read timeout?
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl<R: Read, W: Write> Session<'_, R, W> {
    fn run(&mut self) -> End {
        let greeting = match self.settings.protocol {
            Protocol::Lmtp => "LMTP",
            Protocol::Smtp => "ESMTP",
        };
        self.say(&Reply::plain(
            220,
            format!("{} {greeting} Pepsi", self.settings.hostname),
        ));
        loop {
            // Everything the client pipelined is answered in one write, before waiting
            // for more (RFC 2920).
            if self.io.buffer().is_empty() {
                if let Err(e) = self.flush() {
                    return End::Failed(e.to_string());
                }
                if self.settings.stopping.load(Ordering::Relaxed) {
                    return self.shutting_down();
                }
            }
            // A command line in full within TIMEOUT, however it trickles in.
            self.deadline = Deadline::At(Instant::now() + self.settings.timeout);
            let line = match self.read_line(MAX_COMMAND) {
                Ok(Line::Text(l)) => l,
                Ok(Line::TooLong(_)) => {
                    if let Some(end) = self.error(Reply::new(500, "5.5.2", "Line too long")) {
                        return end;
                    }
                    continue;
                }
                Ok(Line::Eof) => return self.closed(),
                Err(e) => return self.broken(&e),
            };
            match self.command(&line) {
                Ok(None) => {}
                Ok(Some(end)) => {
                    let _ = self.flush();
                    return end;
                }
                Err(e) => return self.broken(&e),
            }
        }
    }

    /// A read or write that failed: a timeout is told to the client (421 4.4.2,
    /// RFC 5321 §4.5.3.2) before the close; anything else ends the session as it is.
    fn broken(&mut self, e: &io::Error) -> End {
        // Inside TLS the end of the input without close_notify (the client's close,
        // or the shutdown's) reads as this.
        if e.kind() == io::ErrorKind::UnexpectedEof {
            return self.closed();
        }
        if !timed_out(e) {
            return End::Failed(e.to_string());
        }
        self.say(&Reply::new(
            421,
            "4.4.2",
            "Timeout exceeded, closing the connection",
        ));
        let _ = self.flush();
        End::Timeout
    }

    /// The end of the client's input: its own close, or the daemon's shutdown ending
    /// the wait (the read side shut down), which the client is told with a 421
    /// (RFC 5321 §3.8); a message whose data had not ended is then sent again later.
    pub(super) fn closed(&mut self) -> End {
        if self.settings.stopping.load(Ordering::Relaxed) {
            self.shutting_down()
        } else {
            End::Closed
        }
    }

    /// Tells the client the service is shutting down and ends the session.
    fn shutting_down(&mut self) -> End {
        self.say(&Reply::new(
            421,
            "4.3.2",
            "Service shutting down, try again later",
        ));
        let _ = self.flush();
        End::ShuttingDown
    }

    /// Queues a reply.
    pub(super) fn say(&mut self, reply: &Reply) {
        self.out.extend_from_slice(&reply.wire());
    }

    /// Writes the queued replies.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.io.get_mut().write_all(&self.out)?;
            self.io.get_mut().flush()?;
            self.out.clear();
        }
        Ok(())
    }

    /// Queues an error reply, counting it; `Some` when the session must end.
    pub(super) fn error(&mut self, reply: Reply) -> Option<End> {
        self.say(&reply);
        if reply.code >= 500 {
            self.errors += 1;
            if self.errors > self.settings.max_errors {
                self.say(&Reply::new(
                    421,
                    "4.7.0",
                    "Too many errors, closing the connection",
                ));
                return Some(End::TooManyErrors);
            }
        }
        None
    }

    /// When the current read must be done by.
    fn due(&self) -> Instant {
        match self.deadline {
            Deadline::At(t) => t,
            Deadline::Data { started, received } => {
                let rate = self.settings.min_data_rate.max(1);
                started
                    + self.settings.timeout
                    + Duration::from_millis(received.saturating_mul(1000) / rate)
            }
        }
    }

    /// Reads one line (up to LF) of at most `max` bytes, by the current deadline.
    pub(super) fn read_line(&mut self, max: usize) -> io::Result<Line> {
        let mut line = Vec::new();
        let mut too_long = false;
        // The last byte taken, for a line too long: did it end in CRLF?
        let mut last = 0u8;
        loop {
            if self.io.buffer().is_empty() {
                // Every read of the connection ends by then (TLS may need several).
                let due = self.due();
                if let Some(d) = self.io.get_mut().duplex() {
                    d.due = Some(due);
                }
            }
            let buf = match self.io.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                return Ok(if line.is_empty() && !too_long {
                    Line::Eof
                } else if too_long {
                    Line::TooLong(false)
                } else {
                    Line::Text(line)
                });
            }
            let (take, done) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            let crlf = done && (if take >= 2 { buf[take - 2] } else { last }) == b'\r';
            if take >= 1 {
                last = buf[take - 1];
            }
            if !too_long {
                if line.len() + take > max {
                    too_long = true;
                    line.clear();
                } else {
                    line.extend_from_slice(&buf[..take]);
                }
            }
            self.io.consume(take);
            if done {
                return Ok(if too_long {
                    Line::TooLong(crlf)
                } else {
                    Line::Text(line)
                });
            }
        }
    }

    /// Handles one command line; `Some` when the session ends.
    fn command(&mut self, line: &[u8]) -> io::Result<Option<End>> {
        // An address is taken as sent or not at all: a line that is not UTF-8 would
        // otherwise reach the queue with its bytes replaced.
        let Ok(text) = std::str::from_utf8(line) else {
            return Ok(self.error(Reply::new(500, "5.5.2", "Error: the command is not UTF-8")));
        };
        let text = text.trim_end_matches(['\r', '\n']);
        let (verb, arg) = match text.split_once(' ') {
            Some((v, a)) => (v.to_ascii_uppercase(), a),
            None => (text.to_ascii_uppercase(), ""),
        };
        let lmtp = self.settings.protocol == Protocol::Lmtp;
        let reply = match verb.as_str() {
            "LHLO" | "EHLO" | "HELO" if (verb == "LHLO") == lmtp => {
                match self.hello(arg, verb != "HELO") {
                    Ok(()) => return Ok(None),
                    Err(r) => r,
                }
            }
            "EHLO" | "HELO" | "LHLO" => Reply::new(
                500,
                "5.5.1",
                if lmtp {
                    "This is LMTP: say LHLO"
                } else {
                    "This is SMTP: say EHLO or HELO"
                },
            ),
            "MAIL" => self.mail(arg),
            "RCPT" => self.rcpt(arg),
            "DATA" => return self.data(arg, line.ends_with(b"\r\n")),
            "RSET" => {
                self.reset();
                Reply::new(250, "2.0.0", "Ok")
            }
            "NOOP" => Reply::new(250, "2.0.0", "Ok"),
            "QUIT" => {
                self.say(&Reply::new(221, "2.0.0", "Bye"));
                return Ok(Some(End::Quit));
            }
            "VRFY" => Reply::new(252, "2.5.2", "Cannot VRFY a user; send some mail"),
            "HELP" => Reply::new(214, "2.0.0", "See RFC 5321 and RFC 2033"),
            "XFORWARD" => self.xforward(arg),
            "STARTTLS" if self.settings.tls.is_some() => return Ok(self.starttls(arg)),
            "" => Reply::new(500, "5.5.2", "Error: bad syntax"),
            _ => Reply::new(500, "5.5.2", "Error: command not recognized"),
        };
        Ok(self.error(reply))
    }

    /// EHLO/LHLO (`extended`) or HELO: its reply queued, or the error.
    fn hello(&mut self, arg: &str, extended: bool) -> Result<(), Reply> {
        let name = arg.trim();
        if name.is_empty() {
            return Err(Reply::new(501, "5.5.4", "Syntax: EHLO/LHLO/HELO hostname"));
        }
        self.reset();
        self.helo = Some(crate::escape::Visible(name).to_string());
        if !extended {
            self.say(&Reply::plain(250, self.settings.hostname.to_string()));
            return Ok(());
        }
        let mut lines = vec![
            self.settings.hostname.to_string(),
            "PIPELINING".to_string(),
            format!("SIZE {}", self.settings.max_size),
            "8BITMIME".to_string(),
            "SMTPUTF8".to_string(),
            "ENHANCEDSTATUSCODES".to_string(),
            "DSN".to_string(),
        ];
        if self.settings.xforward {
            lines.push("XFORWARD NAME ADDR PROTO HELO LOGIN".to_string());
        }
        if self.settings.tls.is_some() && !self.io.get_ref().is_tls() {
            lines.push("STARTTLS".to_string());
        }
        self.out.extend_from_slice(&Reply::lines(250, "", &lines));
        Ok(())
    }

    /// MAIL FROM.
    fn mail(&mut self, arg: &str) -> Reply {
        if self.helo.is_none() {
            return Reply::new(503, "5.5.1", "Error: send EHLO or LHLO first");
        }
        if self.settings.require_tls && !self.io.get_ref().is_tls() {
            return Reply::new(530, "5.7.0", "Must issue a STARTTLS command first");
        }
        if self.tx.mail.is_some() {
            return Reply::new(503, "5.5.1", "Error: nested MAIL command");
        }
        let Some(rest) = params::strip_keyword(arg, "FROM:") else {
            return Reply::new(501, "5.5.4", "Syntax: MAIL FROM:<address>");
        };
        match params::mail_from(rest, self.settings.max_size) {
            Ok(mail) => {
                self.tx.mail = Some(mail);
                Reply::new(250, "2.1.0", "Ok")
            }
            Err(r) => r,
        }
    }

    /// RCPT TO.
    fn rcpt(&mut self, arg: &str) -> Reply {
        let Some(mail) = &self.tx.mail else {
            return Reply::new(503, "5.5.1", "Error: need MAIL command");
        };
        let Some(rest) = params::strip_keyword(arg, "TO:") else {
            return Reply::new(501, "5.5.4", "Syntax: RCPT TO:<address>");
        };
        if self.tx.rcpts.len() >= self.settings.max_recipients {
            return Reply::new(452, "4.5.3", "Error: too many recipients");
        }
        match params::rcpt_to(rest, mail.smtputf8) {
            Ok(rcpt) => {
                self.tx.rcpts.push(rcpt);
                Reply::new(250, "2.1.5", "Ok")
            }
            Err(r) => r,
        }
    }

    /// XFORWARD (Postfix), from a client `XFORWARD_FROM` trusts, outside a transaction.
    fn xforward(&mut self, arg: &str) -> Reply {
        if !self.settings.xforward {
            return Reply::new(550, "5.7.0", "Error: insufficient authorization");
        }
        if self.tx.mail.is_some() {
            return Reply::new(503, "5.5.1", "Error: MAIL transaction in progress");
        }
        match params::xforward(arg) {
            Ok(attrs) => {
                for (key, value) in attrs {
                    match key.as_str() {
                        "ADDR" => {
                            self.forwarded.addr =
                                value.as_deref().and_then(params::forwarded_address)
                        }
                        "LOGIN" => self.forwarded.login = value.filter(|l| !l.is_empty()),
                        _ => {}
                    }
                }
                Reply::new(250, "2.0.0", "Ok")
            }
            Err(r) => r,
        }
    }

    /// Ends the transaction (and what XFORWARD said for it).
    pub(super) fn reset(&mut self) {
        self.tx = Transaction::default();
        self.forwarded = Forwarded::default();
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
