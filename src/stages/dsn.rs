//! Writing a delivery status notification (RFC 3464) for a failed message: a
//! `multipart/report; report-type=delivery-status` (RFC 6522) of a human part, a
//! `message/delivery-status` part and, as far as it can be carried, the original.
//!
//! Called by `bounce.rs`, which decides who is notified and why; this file decides
//! nothing about the message's fate and touches no database. It reads the original's
//! header block with `mailparse` (unfolding, RFC 2047 words, message ids) and writes
//! the report itself: every part needs an exact content type and transfer encoding that
//! depends on what the original holds, and the delivery-status fields are RFC 3464's own
//! syntax.
//!
//! What the original holds decides how it travels:
//! - a header block with UTF-8 (RFC 6532) makes the attachment `message/global` or
//!   `message/global-headers`, and an address with UTF-8 makes the report
//!   `message/global-delivery-status` with `utf-8;` recipients (RFC 6533);
//! - 8-bit content travels as `8bit`, never re-encoded (`message/rfc822` admits no
//!   other encoding, RFC 2046 §5.2.1), so the original survives byte for byte (its line
//!   ends as CRLF);
//! - an original that cannot be carried within RFC 5322's limits (a line beyond 998
//!   octets, a NUL, a lone CR) is attached as its header block only; a header block that
//!   is missing or not RFC 5322 is not attached at all. The human part says which.
//!
//! Its dates are RFC 5322's, in UTC, written with `jiff` ([`date`]).

use std::time::{SystemTime, UNIX_EPOCH};

use crate::escape;

/// The longest line RFC 5322 allows, without its CRLF.
const MAX_LINE: usize = 998;
/// Field values taken from the message or its state are cut to this many bytes, so a
/// report line stays well within [`MAX_LINE`].
const MAX_VALUE: usize = 900;
/// The report's subject.
pub const SUBJECT: &str = "Undelivered Mail Returned to Sender";

/// The sender's RFC 3461 `RET`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ret {
    /// `RET=FULL`: the whole original, whatever its size.
    Full,
    /// `RET=HDRS`: its header block only.
    Headers,
    /// No `RET`: the whole original when it is within the size limit.
    Unspecified,
}

/// One recipient the report is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedRecipient {
    /// The address, as in `rcpt_to`.
    pub address: String,
    /// The RFC 3461 `ORCPT` (`type;address`), echoed as `Original-Recipient`.
    pub original: Option<String>,
    /// The RFC 3463 status code, e.g. `5.1.1`.
    pub status: String,
    /// The `Diagnostic-Code` (`type; text`), only as a stage gave it for the sender.
    pub diagnostic: Option<String>,
}

/// Everything a report says.
#[derive(Clone, Debug)]
pub struct Report<'a> {
    /// The system's host name: `MAILER-DAEMON@` it and the `Reporting-MTA`.
    pub hostname: &'a str,
    /// The failed message's envelope sender, the report's recipient.
    pub sender: &'a str,
    /// The recipients it reports on (at least one).
    pub recipients: &'a [FailedRecipient],
    /// The RFC 3461 `ENVID`.
    pub envid: Option<&'a str>,
    /// The RFC 3461 `RET`.
    pub ret: Ret,
    /// Without `RET`, the largest original attached whole, in bytes.
    pub size_limit: usize,
    /// When the original arrived.
    pub arrived: Option<SystemTime>,
    /// Now: the report's `Date` and the `Last-Attempt-Date`.
    pub now: SystemTime,
    /// Why, for a person: generic, never naming files, tables or hosts.
    pub reason: &'a str,
    /// Makes the report's `Message-ID` unique (the original's id and random digits).
    pub unique: &'a str,
    /// The original's header block.
    pub headers: Option<&'a [u8]>,
    /// The original's body.
    pub body: Option<&'a [u8]>,
}

/// How much of the original a report carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// The whole message.
    Message,
    /// Its header block.
    Headers,
    /// Nothing: it had no usable header block.
    Nothing,
}

/// A written report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// Its header block, each line ending in CRLF, without the blank line.
    pub headers: Vec<u8>,
    /// Its body.
    pub body: Vec<u8>,
    /// Its `From:`.
    pub from: String,
    /// How much of the original it carries.
    pub attached: Attached,
}

/// The original, as far as it can be carried.
struct Original {
    /// The header block with CRLF line ends, its last line's included, without its
    /// blank line; `None` when it is missing or not RFC 5322.
    headers: Option<Vec<u8>>,
    /// The header block holds UTF-8 beyond ASCII (RFC 6532).
    utf8_headers: bool,
    /// The body with CRLF line ends; `None` when it cannot be carried in 8bit.
    body: Option<Vec<u8>>,
    /// Its size as stored.
    size: usize,
    /// Its `Message-ID`, without angle brackets.
    message_id: Option<String>,
}

/// Writes the report.
pub fn write(report: &Report<'_>) -> Written {
    let original = Original::read(report.headers, report.body);
    let whole = match report.ret {
        Ret::Full => true,
        Ret::Headers => false,
        Ret::Unspecified => original.size <= report.size_limit,
    };
    let attached = match (&original.headers, &original.body) {
        (None, _) => Attached::Nothing,
        (Some(_), Some(_)) if whole => Attached::Message,
        (Some(_), _) => Attached::Headers,
    };
    let human = human_part(report, attached, whole);
    let status = status_part(report);
    let original_part = original_part(&original, attached);
    let parts: Vec<&[u8]> = [
        Some(&human[..]),
        Some(&status[..]),
        original_part.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let boundary = boundary(&parts, || crate::random::hex(16));

    let from = format!("MAILER-DAEMON@{}", report.hostname);
    let mut h = Lines::default();
    h.field("From", &from);
    h.field("To", &format!("<{}>", clean(report.sender)));
    h.field("Subject", SUBJECT);
    h.field("Date", &date(report.now));
    h.field(
        "Message-ID",
        &format!(
            "<{}.{}@{}>",
            report.unique,
            report
                .now
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros()),
            report.hostname
        ),
    );
    if let Some(id) = &original.message_id {
        h.field("In-Reply-To", &format!("<{id}>"));
        h.field("References", &format!("<{id}>"));
    }
    h.field("Auto-Submitted", "auto-replied");
    h.field("MIME-Version", "1.0");
    h.line(b"Content-Type: multipart/report; report-type=delivery-status;");
    h.line(format!("\tboundary=\"{boundary}\"").as_bytes());

    let mut body = Vec::new();
    body.extend_from_slice(b"This is a MIME-encapsulated message.\r\n");
    for part in parts {
        body.extend_from_slice(format!("\r\n--{boundary}\r\n").as_bytes());
        body.extend_from_slice(part);
    }
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    Written {
        headers: h.0,
        body,
        from,
        attached,
    }
}

impl Original {
    fn read(headers: Option<&[u8]>, body: Option<&[u8]>) -> Original {
        let size = headers.map_or(0, <[u8]>::len) + body.map_or(0, <[u8]>::len);
        let block = headers.and_then(crlf).map(|mut h| {
            while h.ends_with(b"\r\n\r\n") {
                h.truncate(h.len() - 2);
            }
            // The block's last line keeps its line end, stored or not: the blank line
            // written after it must end the header block, or the body's first lines
            // would be read as fields of the attached message.
            if !h.is_empty() && !h.ends_with(b"\r\n") {
                h.extend_from_slice(b"\r\n");
            }
            h
        });
        let parsed = block.as_deref().and_then(header_fields);
        let message_id = parsed.as_ref().and_then(|fields| {
            fields
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("Message-ID"))
                .and_then(|(_, v)| mailparse::msgidparse(v).ok())
                .and_then(|ids| ids.first().cloned())
                .filter(|id| usable_message_id(id))
        });
        let headers = block.filter(|_| parsed.is_some());
        let utf8_headers = headers
            .as_deref()
            .is_some_and(|h| !h.is_ascii() && std::str::from_utf8(h).is_ok());
        let body = body.map_or(Some(Vec::new()), crlf);
        Original {
            headers,
            utf8_headers,
            body,
            size,
            message_id,
        }
    }
}

/// The text with every line end as CRLF, or `None` when it cannot be carried within
/// RFC 5322's limits: a line beyond 998 octets, a NUL or a CR not before LF.
fn crlf(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() + text.len() / 32);
    let mut line = 0;
    let mut bytes = text.iter().peekable();
    while let Some(&b) = bytes.next() {
        match b {
            0 => return None,
            b'\r' if bytes.peek() != Some(&&b'\n') => return None,
            b'\r' => {}
            b'\n' => {
                out.extend_from_slice(b"\r\n");
                line = 0;
            }
            _ => {
                out.push(b);
                line += 1;
                if line > MAX_LINE {
                    return None;
                }
            }
        }
    }
    Some(out)
}

/// The fields of an RFC 5322 header block (CRLF line ends, no blank line), each name
/// with its unfolded value; `None` when the block is empty or not a header block: a
/// line that is neither a field (a name of printable ASCII, then a colon) nor the
/// continuation of one.
fn header_fields(block: &[u8]) -> Option<Vec<(String, String)>> {
    if block.is_empty() {
        return None;
    }
    let (fields, used) = mailparse::parse_headers(block).ok()?;
    if used != block.len() || fields.is_empty() {
        return None;
    }
    let named = |f: &mailparse::MailHeader<'_>| {
        let key = f.get_key_raw();
        !key.is_empty() && key.iter().all(|&b| (33..=126).contains(&b) && b != b':')
    };
    // A line without a colon comes back as a field with that line as its name.
    if !fields.iter().all(named) {
        return None;
    }
    Some(
        fields
            .iter()
            .map(|f| (f.get_key(), f.get_value()))
            .collect(),
    )
}

/// A message id fit to be repeated in `In-Reply-To`: `left@right`, printable ASCII.
fn usable_message_id(id: &str) -> bool {
    id.len() <= MAX_VALUE
        && id.contains('@')
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'<' | b'>'))
}

/// Header-style lines with CRLF ends.
#[derive(Default)]
struct Lines(Vec<u8>);

impl Lines {
    fn line(&mut self, text: &[u8]) {
        self.0.extend_from_slice(text);
        self.0.extend_from_slice(b"\r\n");
    }

    fn field(&mut self, name: &str, value: &str) {
        self.line(format!("{name}: {value}").as_bytes());
    }
}

/// A value from the message or its state, fit for one field or text line: control
/// characters and the invisible formatting characters ([`escape::must_escape`]: line
/// separators, bidirectional controls) become spaces, the ends are trimmed and the
/// length is cut to [`MAX_VALUE`] bytes on a character boundary.
fn clean(value: &str) -> String {
    let mut out: String = value
        .chars()
        .map(|c| {
            if c.is_control() || escape::must_escape(c) {
                ' '
            } else {
                c
            }
        })
        .collect::<String>()
        .trim()
        .to_string();
    if out.len() > MAX_VALUE {
        let mut cut = MAX_VALUE;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

/// The first part: what happened, for a person.
fn human_part(report: &Report<'_>, attached: Attached, whole: bool) -> Vec<u8> {
    let mut text = Lines::default();
    text.line(format!("This is the mail system at {}.", report.hostname).as_bytes());
    text.line(b"");
    text.line(b"Your message could not be delivered to the recipients below.");
    text.line(clean(report.reason).as_bytes());
    text.line(b"");
    for r in report.recipients {
        let mut line = format!("  <{}>: {}", clean(&r.address), r.status);
        if let Some(d) = &r.diagnostic {
            line.push_str(&format!(" ({})", clean(d)));
        }
        text.line(line.as_bytes());
    }
    text.line(b"");
    text.line(
        match attached {
            Attached::Message => "Your message is attached.",
            Attached::Headers if whole => {
                "The header of your message is attached; the message itself could not be \
             carried in a report."
            }
            Attached::Headers => "The header of your message is attached.",
            Attached::Nothing => "Your message could not be attached: it has no usable header.",
        }
        .as_bytes(),
    );
    let mut part = Lines::default();
    part.field("Content-Description", "Notification");
    if text.0.is_ascii() {
        part.field("Content-Type", "text/plain; charset=us-ascii");
        part.field("Content-Transfer-Encoding", "7bit");
    } else {
        part.field("Content-Type", "text/plain; charset=utf-8");
        part.field("Content-Transfer-Encoding", "8bit");
    }
    part.line(b"");
    part.0.extend_from_slice(&text.0);
    part.0
}

/// The second part: the machine-readable report (RFC 3464, RFC 6533 where an address
/// is not ASCII).
fn status_part(report: &Report<'_>) -> Vec<u8> {
    let global = report
        .recipients
        .iter()
        .any(|r| !r.address.is_ascii() || r.original.as_deref().is_some_and(|o| !o.is_ascii()));
    let mut fields = Lines::default();
    fields.field("Reporting-MTA", &format!("dns; {}", report.hostname));
    if let Some(envid) = report.envid.map(clean).filter(|e| !e.is_empty()) {
        fields.field("Original-Envelope-Id", &envid);
    }
    if let Some(arrived) = report.arrived {
        fields.field("Arrival-Date", &date(arrived));
    }
    for r in report.recipients {
        fields.line(b"");
        if let Some(original) = r.original.as_deref().map(clean).filter(|o| o.contains(';')) {
            fields.field("Original-Recipient", &original);
        }
        let kind = if r.address.is_ascii() {
            "rfc822"
        } else {
            "utf-8"
        };
        fields.field("Final-Recipient", &format!("{kind}; {}", clean(&r.address)));
        fields.field("Action", "failed");
        fields.field("Status", &r.status);
        if let Some(d) = r.diagnostic.as_deref().map(clean).filter(|d| !d.is_empty()) {
            fields.field("Diagnostic-Code", &d);
        }
        fields.field("Last-Attempt-Date", &date(report.now));
    }
    let mut part = Lines::default();
    part.field("Content-Description", "Delivery report");
    if global {
        part.field("Content-Type", "message/global-delivery-status");
        part.field("Content-Transfer-Encoding", "8bit");
    } else {
        part.field("Content-Type", "message/delivery-status");
        part.field("Content-Transfer-Encoding", "7bit");
    }
    part.line(b"");
    part.0.extend_from_slice(&fields.0);
    part.0
}

/// The third part, when there is one: the original or its header block.
fn original_part(original: &Original, attached: Attached) -> Option<Vec<u8>> {
    let headers = original.headers.as_deref()?;
    let mut part = Lines::default();
    let content: Vec<u8> = match attached {
        Attached::Nothing => return None,
        Attached::Message => {
            part.field("Content-Description", "Undelivered Message");
            let kind = if original.utf8_headers {
                "message/global"
            } else {
                "message/rfc822"
            };
            part.field("Content-Type", kind);
            let body = original.body.as_deref().unwrap_or_default();
            let mut content = Vec::with_capacity(headers.len() + body.len() + 2);
            content.extend_from_slice(headers);
            content.extend_from_slice(b"\r\n");
            content.extend_from_slice(body);
            content
        }
        Attached::Headers => {
            part.field("Content-Description", "Undelivered Message Headers");
            let kind = if original.utf8_headers {
                "message/global-headers"
            } else {
                "text/rfc822-headers"
            };
            part.field("Content-Type", kind);
            headers.to_vec()
        }
    };
    let encoding = if content.is_ascii() { "7bit" } else { "8bit" };
    part.field("Content-Transfer-Encoding", encoding);
    part.line(b"");
    part.0.extend_from_slice(&content);
    Some(part.0)
}

/// A MIME boundary that occurs in none of the parts: `=_pepsi-report-` and 128 random
/// bits from `draw` (the system's random source: [`crate::random::hex`]). Nobody can plant it
/// in a message beforehand, so the first drawn is nearly always free and the parts are
/// scanned once; one that occurs is drawn again.
fn boundary(parts: &[&[u8]], mut draw: impl FnMut() -> String) -> String {
    let occurs = |needle: &[u8]| {
        parts
            .iter()
            .any(|p| p.windows(needle.len()).any(|w| w == needle))
    };
    loop {
        let candidate = format!("=_pepsi-report-{}", draw());
        if !occurs(candidate.as_bytes()) {
            return candidate;
        }
    }
}

/// The form of [`date`]: RFC 5322's `date-time` in UTC, the day in two digits (jiff's
/// `rfc2822` printer writes the day in one digit where it can and a timestamp's zone as
/// `-0000`, "local time unknown", so the form is spelled out here).
const DATE_FORMAT: &str = "%a, %d %b %Y %H:%M:%S %z";

/// An RFC 5322 date in UTC: `Wed, 02 Dec 2026 18:04:05 +0000`; the whole second at or
/// before `time`. A time beyond what a [`jiff::Timestamp`] holds (years -9999 to 9999)
/// is written as the nearest one it holds.
pub fn date(time: SystemTime) -> String {
    let at = jiff::Timestamp::try_from(time).unwrap_or(if time < UNIX_EPOCH {
        jiff::Timestamp::MIN
    } else {
        jiff::Timestamp::MAX
    });
    at.strftime(DATE_FORMAT).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_rfc_5322_in_utc() {
        let at = |s: u64| date(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "Thu, 01 Jan 1970 00:00:00 +0000");
        assert_eq!(at(951_782_400), "Tue, 29 Feb 2000 00:00:00 +0000");
        assert_eq!(at(1_796_220_245), "Wed, 02 Dec 2026 14:04:05 +0000");
        assert_eq!(at(4_107_542_399), "Sun, 28 Feb 2100 23:59:59 +0000");
        assert_eq!(at(4_133_980_799), "Fri, 31 Dec 2100 23:59:59 +0000");
        assert_eq!(
            date(UNIX_EPOCH - Duration::from_secs(1)),
            "Wed, 31 Dec 1969 23:59:59 +0000"
        );
    }

    #[test]
    fn a_date_is_the_whole_second_at_or_before_the_time_and_reads_back_as_rfc_2822() {
        assert_eq!(
            date(UNIX_EPOCH + Duration::from_millis(1_796_220_245_999)),
            "Wed, 02 Dec 2026 14:04:05 +0000"
        );
        assert_eq!(
            date(UNIX_EPOCH - Duration::from_millis(500)),
            "Wed, 31 Dec 1969 23:59:59 +0000"
        );
        for secs in [0, 951_782_400, 1_796_220_245, 4_133_980_799] {
            let written = date(UNIX_EPOCH + Duration::from_secs(secs));
            let read = jiff::fmt::rfc2822::parse(&written).unwrap();
            assert_eq!(read.timestamp().as_second(), secs as i64, "{written}");
        }
    }

    #[test]
    fn a_time_beyond_what_a_date_can_hold_is_written_as_the_nearest_one() {
        let far = Duration::from_secs(400_000 * 366 * 86_400);
        assert_eq!(date(UNIX_EPOCH + far), "Thu, 30 Dec 9999 22:00:00 +0000");
        assert_eq!(date(UNIX_EPOCH - far), "Tue, 02 Jan -9999 01:59:59 +0000");
    }

    #[test]
    fn line_ends_become_crlf_and_what_cannot_travel_is_refused() {
        assert_eq!(crlf(b"a\nb\r\nc").unwrap(), b"a\r\nb\r\nc");
        assert_eq!(crlf(b"").unwrap(), b"");
        assert!(crlf(b"a\rb").is_none(), "a lone CR");
        assert!(crlf(b"a\0b").is_none(), "a NUL");
        let long = vec![b'x'; MAX_LINE];
        assert!(crlf(&long).is_some());
        let longer = vec![b'x'; MAX_LINE + 1];
        assert!(crlf(&longer).is_none());
    }

    #[test]
    fn a_header_block_must_be_fields() {
        assert!(header_fields(b"Subject: x\r\nFrom: a@b\r\n").is_some());
        assert!(header_fields(b"Subject: x\r\n  folded\r\n").is_some());
        assert!(header_fields(b"").is_none());
        assert!(header_fields(b" starts folded\r\n").is_none());
        assert!(header_fields(b"no colon here\r\n").is_none());
        assert!(header_fields(b"Bad Name: x\r\n").is_none());
    }

    #[test]
    fn values_lose_control_characters_and_excess_length() {
        assert_eq!(clean(" a\r\nBcc: x\t"), "a  Bcc: x");
        assert_eq!(
            clean("a\u{2028}Bcc: x\u{202e}y\u{85}z\u{feff}"),
            "a Bcc: x y z"
        );
        assert_eq!(clean("jörg@bücher.example"), "jörg@bücher.example");
        let long = "é".repeat(MAX_VALUE);
        let cut = clean(&long);
        assert!(cut.len() <= MAX_VALUE && cut.len() >= MAX_VALUE - 1);
    }

    /// A report on one recipient of an original with these headers and body.
    fn report_of(headers: &[u8], body: &[u8], ret: Ret) -> Written {
        let recipients = [FailedRecipient {
            address: "bob@dest.example".into(),
            original: None,
            status: "5.0.0".into(),
            diagnostic: None,
        }];
        write(&Report {
            hostname: "mx.example",
            sender: "alice@origin.example",
            recipients: &recipients,
            envid: None,
            ret,
            size_limit: 50_000,
            arrived: None,
            now: UNIX_EPOCH,
            reason: "Delivery failed.",
            unique: "1.2",
            headers: Some(headers),
            body: Some(body),
        })
    }

    /// The report's boundary, from its `Content-Type`.
    fn boundary_of(written: &Written) -> String {
        let headers = String::from_utf8_lossy(&written.headers);
        let at = headers.find("boundary=\"").expect("a boundary") + "boundary=\"".len();
        headers[at..].split('"').next().unwrap().to_string()
    }

    /// The third part's content (after its own header block) of a written report.
    fn attached(written: &Written) -> Vec<u8> {
        let body = &written.body;
        let b = boundary_of(written);
        let boundary = format!("\r\n--{b}\r\n").into_bytes();
        let start = body
            .windows(boundary.len())
            .enumerate()
            .filter(|(_, w)| *w == boundary.as_slice())
            .nth(2)
            .map(|(i, _)| i + boundary.len())
            .expect("a third part");
        let end = body.len() - format!("\r\n--{b}--\r\n").len();
        let part = &body[start..end];
        let blank = part.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        part[blank + 4..].to_vec()
    }

    #[test]
    fn a_header_block_without_its_last_line_end_still_ends_before_the_body() {
        for stored in [&b"Subject: x\r\nFrom: a@b"[..], b"Subject: x\nFrom: a@b"] {
            let whole = report_of(stored, b"Bcc: evil@y\r\nbody\r\n", Ret::Full);
            assert_eq!(whole.attached, Attached::Message);
            assert_eq!(
                attached(&whole),
                b"Subject: x\r\nFrom: a@b\r\n\r\nBcc: evil@y\r\nbody\r\n"
            );
            let headers = report_of(stored, b"Bcc: evil@y\r\n", Ret::Headers);
            assert_eq!(headers.attached, Attached::Headers);
            assert_eq!(attached(&headers), b"Subject: x\r\nFrom: a@b\r\n");
        }
        let complete = report_of(b"Subject: x\r\n", b"body\r\n", Ret::Full);
        assert_eq!(attached(&complete), b"Subject: x\r\n\r\nbody\r\n");
    }

    #[test]
    fn the_boundary_is_random_and_avoids_the_content() {
        let taken = b"--=_pepsi-report-aa\r\n".to_vec();
        let mut draws = ["aa", "bb"].into_iter().map(str::to_string);
        assert_eq!(
            boundary(&[&taken], || draws.next().unwrap()),
            "=_pepsi-report-bb"
        );
        // Whatever a sender put in the message (a report's id, its claim), the
        // boundary is none of it.
        let a = report_of(b"Subject: x\r\n", b"--=_pepsi-report-1.2-0\r\n", Ret::Full);
        let b = report_of(b"Subject: x\r\n", b"x\r\n", Ret::Full);
        assert_ne!(boundary_of(&a), boundary_of(&b));
        assert!(!boundary_of(&a).contains("1.2"), "{}", boundary_of(&a));
    }
}
