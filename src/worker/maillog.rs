//! The delivery log (§11 "Delivery log"): one line per [`Record`], written by the
//! worker once the outcome it records is committed, to the system log (facility mail,
//! as Postfix logs), to a file, or nowhere (`[pepsi] DELIVERY_LOG`), in Postfix's
//! `key=value` shape or as one JSON object a line (`[pepsi] LOG_FORMAT`).
//!
//! The text line is Postfix's delivery line, so `pflogsumm --syslog-name=pepsi` counts
//! Pepsi's deliveries: the program is `pepsi/STAGE`, the queue id Pepsi's id, then
//! `to=<…>, relay=…, delay=…, delays=a/b/c/d, dsn=…, status=… (reply)`, and after it
//! what Postfix logs on other lines (`stage=`, `from=<…>`, `message-id=`). The delays:
//! a, from arrival until the message came to the stage; b, waiting at the stage; c, 0
//! (Pepsi does not time a connection's setup apart); d, the stage's pass. Every value
//! is escaped in text ([`Visible`]; `<` and `>` in an address too, which would end its
//! brackets) and in JSON ([`json_visible`]).
//!
//! Set up once per worker ([`init`]) from the configuration; called by `writes.rs`.
//! A line that cannot be written is dropped with one warning on stderr (and the lines of
//! the next ten seconds without trying): the outcome is committed and in
//! `pepsi.history` either way.

use std::io::Write as _;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use super::record::Record;
use crate::config::{MailLogFormat, MailLogTarget, PepsiOptions};
use crate::escape::{Visible, json_visible};

/// The system log's socket.
const SYSLOG_SOCKET: &str = "/dev/log";

/// Facility mail (2), priority info (6), as syslog(3) numbers them.
const MAIL_INFO: u8 = 2 * 8 + 6;

/// The longest stage name the program name (`pepsi/STAGE`) carries.
const PROGRAM_STAGE_MAX: usize = 24;

static LOG: OnceLock<MailLog> = OnceLock::new();

/// Where and how this process writes the delivery log.
struct MailLog {
    target: MailLogTarget,
    format: MailLogFormat,
    host: String,
    pid: u32,
    socket: Mutex<Option<UnixDatagram>>,
    warned: AtomicBool,
    /// After a line could not be written: when to try again (lines until then are
    /// dropped without a system call each).
    retry_at: Mutex<Option<std::time::Instant>>,
}

/// How long lines are dropped after one could not be written.
const RETRY_GAP: Duration = Duration::from_secs(10);

/// Sets the delivery log up from `[pepsi]`; later calls change nothing.
pub fn init(pepsi: &PepsiOptions) {
    let _ = LOG.set(MailLog {
        target: pepsi.delivery_log.clone(),
        format: pepsi.log_format,
        host: pepsi.hostname.clone(),
        pid: std::process::id(),
        socket: Mutex::new(None),
        warned: AtomicBool::new(false),
        retry_at: Mutex::new(None),
    });
}

/// The message a record is of.
#[derive(Clone, Debug, Default)]
pub struct About {
    /// Its id.
    pub id: i64,
    /// Its envelope sender.
    pub from: String,
    /// Its Message-ID.
    pub message_id: Option<String>,
    /// When it arrived.
    pub arrived: Option<SystemTime>,
}

impl About {
    /// What the log says of `message`.
    pub fn of(message: &super::message::Message) -> About {
        About {
            id: message.id,
            from: message.mail_from().to_string(),
            message_id: message.message_id.clone(),
            arrived: message.arrived,
        }
    }
}

/// The delivery log, when lines are to be written now: set up, not `no`, not resting
/// after a failed write.
fn active() -> Option<&'static MailLog> {
    LOG.get()
        .filter(|log| log.target != MailLogTarget::Off && !log.resting())
}

/// Writes a line for each record.
pub fn records(about: &About, records: &[Record]) {
    let Some(log) = active() else { return };
    let now = SystemTime::now();
    for r in records {
        let line = match log.format {
            MailLogFormat::Text => text_line(about, r, now),
            MailLogFormat::Json => json_visible(&json_record(about, r, now).to_string()),
        };
        log.write(&r.stage, &line, now);
    }
}

/// Writes the line of a split: `new` took `recipients` off `from` at `stage`.
pub fn split(from: i64, new: &[(i64, Vec<String>)], stage: &str) {
    let Some(log) = active() else { return };
    let now = SystemTime::now();
    for (id, recipients) in new {
        let line = match log.format {
            MailLogFormat::Text => format!(
                "{id}: split from {from}: stage={}, nrcpt={}",
                Visible(stage),
                recipients.len()
            ),
            MailLogFormat::Json => json_visible(
                &json!({
                    "time": rfc3339(now),
                    "event": "split",
                    "id": id,
                    "from_id": from,
                    "stage": stage,
                    "recipients": recipients,
                })
                .to_string(),
            ),
        };
        log.write(stage, &line, now);
    }
}

/// Writes the line of a delivery status notification `notification` made for message
/// `id`'s sender `to`, as Postfix says it.
pub fn returned(id: i64, notification: i64, to: &str, stage: &str) {
    let Some(log) = active() else { return };
    let now = SystemTime::now();
    let line = match log.format {
        MailLogFormat::Text => {
            format!("{id}: sender non-delivery notification: {notification}")
        }
        MailLogFormat::Json => json_visible(
            &json!({
                "time": rfc3339(now),
                "event": "returned",
                "id": id,
                "notification": notification,
                "to": to,
                "stage": stage,
            })
            .to_string(),
        ),
    };
    log.write(stage, &line, now);
}

impl MailLog {
    /// Are lines dropped for now, after one could not be written?
    fn resting(&self) -> bool {
        let retry_at = self.retry_at.lock().unwrap_or_else(|p| p.into_inner());
        retry_at.is_some_and(|t| std::time::Instant::now() < t)
    }

    /// Writes one line as `pepsi/STAGE`.
    fn write(&self, stage: &str, line: &str, now: SystemTime) {
        let mut retry_at = self.retry_at.lock().unwrap_or_else(|p| p.into_inner());
        if retry_at.is_some_and(|t| std::time::Instant::now() < t) {
            return;
        }
        let program = program(stage);
        let result = match &self.target {
            MailLogTarget::Off => return,
            MailLogTarget::Syslog => self.to_syslog(&program, line),
            MailLogTarget::File(path) => self.to_file(path, &program, line, now),
        };
        *retry_at = result
            .is_err()
            .then(|| std::time::Instant::now() + RETRY_GAP);
        if let Err(e) = result {
            if !self.warned.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "cannot write the delivery log ({}): {e}; its lines are dropped (pepsi.history has them)",
                    match &self.target {
                        MailLogTarget::File(p) => p.display().to_string(),
                        _ => SYSLOG_SOCKET.to_string(),
                    }
                );
            }
        }
    }

    /// One datagram to the system log: `<PRI>pepsi/STAGE[PID]: line` (the system log
    /// stamps the time and host).
    fn to_syslog(&self, program: &str, line: &str) -> std::io::Result<()> {
        let mut socket = self.socket.lock().unwrap_or_else(|p| p.into_inner());
        if socket.is_none() {
            *socket = Some(UnixDatagram::unbound()?);
        }
        let datagram = format!("<{MAIL_INFO}>{program}[{}]: {line}", self.pid);
        let sent = socket
            .as_ref()
            .map(|s| s.send_to(datagram.as_bytes(), SYSLOG_SOCKET));
        match sent {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => {
                *socket = None;
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// One line appended to the file, opened for it (so a rotated file is followed):
    /// JSON as it is; text after an RFC 3339 time, the host and the program, as a
    /// system log writes it.
    fn to_file(
        &self,
        path: &PathBuf,
        program: &str,
        line: &str,
        now: SystemTime,
    ) -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let whole = match self.format {
            MailLogFormat::Json => format!("{line}\n"),
            MailLogFormat::Text => format!(
                "{} {} {program}[{}]: {line}\n",
                rfc3339(now),
                self.host,
                self.pid
            ),
        };
        // One write: appended lines of several workers never interleave.
        file.write_all(whole.as_bytes())
    }
}

/// `pepsi/STAGE`, the stage cut to [`PROGRAM_STAGE_MAX`] and to characters a program
/// name may carry.
fn program(stage: &str) -> String {
    let stage: String = stage
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(PROGRAM_STAGE_MAX)
        .collect();
    format!("pepsi/{stage}")
}

/// An address for a text line: escaped, and its `<` and `>` too.
fn address(a: &str) -> String {
    Visible(a)
        .to_string()
        .replace('<', "\\u{3c}")
        .replace('>', "\\u{3e}")
}

/// Seconds as Postfix writes a delay: two decimals.
fn seconds(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// (total, a, b, d) of a record.
fn delays(about: &About, r: &Record, now: SystemTime) -> (Duration, Duration) {
    let total = about
        .arrived
        .and_then(|a| now.duration_since(a).ok())
        .unwrap_or(r.waited + r.took);
    let before = total.saturating_sub(r.waited + r.took);
    (total, before)
}

/// A record as Postfix's delivery line (after the program name).
fn text_line(about: &About, r: &Record, now: SystemTime) -> String {
    let (total, before) = delays(about, r, now);
    let reply = r
        .reply
        .as_deref()
        .map(|t| format!(" ({})", Visible(t)))
        .unwrap_or_default();
    let message_id = about
        .message_id
        .as_deref()
        .map(|m| format!(", message-id={}", Visible(m)))
        .unwrap_or_default();
    format!(
        "{}: to=<{}>, relay={}, delay={}, delays={}/{}/0/{}, dsn={}, status={}{reply}, stage={}, from=<{}>{message_id}",
        about.id,
        address(&r.recipient),
        r.relay.as_deref().map_or("none".to_string(), |h| {
            // A host name from DNS may hold what would end the field.
            Visible(h)
                .to_string()
                .replace(',', "\\u{2c}")
                .replace(' ', "\\u{20}")
        }),
        seconds(total),
        seconds(before),
        seconds(r.waited),
        seconds(r.took),
        Visible(&r.dsn),
        r.event.status(),
        Visible(&r.stage),
        address(&about.from),
    )
}

/// A record as one JSON object.
fn json_record(about: &About, r: &Record, now: SystemTime) -> Value {
    let (total, before) = delays(about, r, now);
    json!({
        "time": rfc3339(now),
        "event": r.event.name(),
        "status": r.event.status(),
        "id": about.id,
        "message_id": about.message_id,
        "from": about.from,
        "to": r.recipient,
        "stage": r.stage,
        "relay": r.relay,
        "reply": r.reply,
        "remote_id": r.remote_id,
        "dsn": r.dsn,
        "delay": total.as_secs_f64(),
        "delays": {
            "before_stage": before.as_secs_f64(),
            "at_stage": r.waited.as_secs_f64(),
            "in_stage": r.took.as_secs_f64(),
        },
    })
}

/// A time as RFC 3339 in UTC with milliseconds.
fn rfc3339(time: SystemTime) -> String {
    let ms = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| format!("{t:.3}"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::super::record::Event;
    use super::*;

    fn hostile() -> &'static str {
        "a\r\nb\"c\u{0}d\u{202e}e<f>"
    }

    fn record(text: &str) -> Record {
        Record {
            event: Event::Delivered,
            stage: "relay".into(),
            recipient: text.into(),
            relay: Some(text.into()),
            reply: Some(text.into()),
            remote_id: Some(text.into()),
            dsn: text.into(),
            waited: Duration::from_millis(20),
            took: Duration::from_millis(30),
        }
    }

    #[test]
    fn a_text_line_is_postfixs_and_escapes_every_hostile_value() {
        let about = About {
            id: 4711,
            from: hostile().into(),
            message_id: Some(hostile().into()),
            arrived: Some(SystemTime::now() - Duration::from_secs(2)),
        };
        let line = text_line(&about, &record(hostile()), SystemTime::now());
        for bad in ['\r', '\n', '\0', '\u{202e}'] {
            assert!(!line.contains(bad), "{line:?}");
        }
        assert!(line.starts_with("4711: to=<a\\r\\nb\"c\\u{0}d\\u{202e}e\\u{3c}f\\u{3e}>, relay="));
        assert!(line.contains(", delays="), "{line}");
        assert!(line.contains(", status=sent ("), "{line}");
        let plain = Record {
            recipient: "b@y.example".into(),
            relay: Some("mx.y.example[192.0.2.1]:25".into()),
            reply: Some("250 2.0.0 Ok: queued as ABC".into()),
            dsn: "2.0.0".into(),
            ..record("x")
        };
        let about = About {
            id: 7,
            from: "a@x.example".into(),
            message_id: Some("<m@x.example>".into()),
            arrived: None,
        };
        assert_eq!(
            text_line(&about, &plain, SystemTime::now()),
            "7: to=<b@y.example>, relay=mx.y.example[192.0.2.1]:25, delay=0.05, \
             delays=0.00/0.02/0/0.03, dsn=2.0.0, status=sent (250 2.0.0 Ok: queued as ABC), \
             stage=relay, from=<a@x.example>, message-id=<m@x.example>"
        );
    }

    #[test]
    fn a_json_line_parses_back_to_the_hostile_values_and_hides_none() {
        let about = About {
            id: 4711,
            from: hostile().into(),
            message_id: Some(hostile().into()),
            arrived: None,
        };
        let line =
            json_visible(&json_record(&about, &record(hostile()), SystemTime::now()).to_string());
        for bad in ['\r', '\n', '\0', '\u{202e}'] {
            assert!(!line.contains(bad), "{line:?}");
        }
        let v: Value = serde_json::from_str(&line).unwrap();
        for key in [
            "from",
            "message_id",
            "to",
            "relay",
            "reply",
            "remote_id",
            "dsn",
        ] {
            assert_eq!(v[key], hostile(), "{key}");
        }
        assert_eq!(v["status"], "sent");
        assert_eq!(v["id"], 4711);
    }

    #[test]
    fn the_program_name_carries_only_a_safe_stage_name() {
        assert_eq!(program("relay-out"), "pepsi/relay-out");
        assert_eq!(program("a b[1]:\n"), "pepsi/ab1");
    }
}
