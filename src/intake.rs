//! What a message must be before it is queued, for `pepsi-queue inject` and
//! `pepsi-ingress` alike: the header block split from the body at the first empty
//! line, the header block checked to be header fields, the `From:` address and the
//! `Subject:` (RFC 2047 words decoded, with `mailparse`) extracted, and the envelope
//! addresses checked (by [`crate::mailbox`], beside it).
//!
//! Pure: bytes in, values or a reason out. The callers (`queue::inject`,
//! `ingress::session`) refuse the message on any reason (exit 65, a 5xx reply) and
//! write nothing.

use crate::{db, mailbox};

/// A message split and read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The header block, up to and including the line end of its last line; without
    /// the empty line that ends it.
    pub headers: Vec<u8>,
    /// Everything after the empty line (empty when the message has none).
    pub body: Vec<u8>,
    /// The first address of the `From:` field (its decoded value when that is no
    /// address).
    pub header_from: Option<String>,
    /// The `Subject:` field, RFC 2047 words decoded.
    pub subject: Option<String>,
}

/// Where the header block ends: (end of the block, start of the body). The block ends
/// before the first empty line (LF or CRLF); without one the whole message is the
/// block and the body is empty.
fn split_at_empty_line(message: &[u8]) -> (usize, usize) {
    let mut start = 0;
    while start < message.len() {
        let end = message[start..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(message.len(), |i| start + i + 1);
        let line = &message[start..end];
        if line == b"\n" || line == b"\r\n" {
            return (start, end);
        }
        start = end;
    }
    (message.len(), message.len())
}

/// Checks that a header block is header fields: every line a `NAME:` field (NAME
/// printable ASCII without `:`) or the continuation of the one before (starting with a
/// space or tab).
fn check_fields(block: &[u8]) -> Result<(), String> {
    if block.is_empty() {
        return Err(
            "the message has no header block (it is empty or starts with an empty line)"
                .to_string(),
        );
    }
    for (n, line) in block.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            // Only the split after the block's last line end.
            continue;
        }
        if line[0] == b' ' || line[0] == b'\t' {
            if n == 0 {
                return Err(
                    "the message has no header block: it starts with a continuation line"
                        .to_string(),
                );
            }
            continue;
        }
        let name_ok = line.iter().position(|&b| b == b':').is_some_and(|colon| {
            colon > 0 && line[..colon].iter().all(|&b| (33..=126).contains(&b))
        });
        if !name_ok {
            let shown: String = String::from_utf8_lossy(line).chars().take(60).collect();
            return Err(if n == 0 {
                format!("the message has no header block: line 1 is not a header field ({shown:?})")
            } else {
                format!(
                    "line {} of the header block is not a header field ({shown:?})",
                    n + 1
                )
            });
        }
    }
    Ok(())
}

/// Splits and reads a message.
pub fn read(message: &[u8]) -> Result<Message, String> {
    let (block_end, body_start) = split_at_empty_line(message);
    let (header_from, subject) = metadata(&message[..block_end])?;
    Ok(Message {
        headers: message[..block_end].to_vec(),
        body: message[body_start..].to_vec(),
        header_from,
        subject,
    })
}

/// [`read`] of a message it may keep: the body is `message`'s own buffer, its header
/// block moved out of the front, so a large message is held once, not twice.
pub fn read_owned(mut message: Vec<u8>) -> Result<Message, String> {
    let (block_end, body_start) = split_at_empty_line(&message);
    let (header_from, subject) = metadata(&message[..block_end])?;
    let headers = message[..block_end].to_vec();
    message.drain(..body_start);
    Ok(Message {
        headers,
        body: message,
        header_from,
        subject,
    })
}

/// Checks a header block and reads its `From:` address and `Subject:`.
fn metadata(headers: &[u8]) -> Result<(Option<String>, Option<String>), String> {
    check_fields(headers)?;
    let fields = mailparse::parse_headers(headers)
        .map_err(|e| format!("the header block cannot be read: {e}"))?
        .0;
    let first = |name: &str| {
        fields
            .iter()
            .find(|h| h.get_key_ref().eq_ignore_ascii_case(name))
    };
    let header_from = first("From").and_then(|h| {
        let address = match mailparse::addrparse_header(h) {
            Ok(list) => list.into_inner().into_iter().find_map(|a| match a {
                mailparse::MailAddr::Single(s) => Some(s.addr),
                mailparse::MailAddr::Group(g) => g.addrs.into_iter().next().map(|s| s.addr),
            }),
            Err(_) => None,
        };
        let text = address.unwrap_or_else(|| h.get_value().trim().to_string());
        (!text.is_empty()).then(|| db::storable(&text))
    });
    let subject = first("Subject").map(|h| db::storable(h.get_value().trim()));
    Ok((header_from, subject))
}

/// Checks an envelope address as given on the command line and returns it as stored:
/// one pair of angle brackets removed, then judged by [`mailbox`] (`local@domain`,
/// SMTPUTF8 non-ASCII taken); the empty address is the null sender, allowed only when
/// `null_ok`.
pub fn envelope_address(raw: &str, null_ok: bool) -> Result<String, String> {
    let address = raw
        .strip_prefix('<')
        .and_then(|a| a.strip_suffix('>'))
        .unwrap_or(raw);
    if address.is_empty() {
        return if null_ok {
            Ok(String::new())
        } else {
            Err("a recipient cannot be empty".into())
        };
    }
    mailbox::check(address).map(|()| address.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_a_message_it_may_keep_gives_what_reading_a_copy_gives() {
        for m in [
            &b"From: <a@x.example>\r\nSubject: s\r\n\r\nbody\r\n"[..],
            b"Subject: no body\r\n",
            b"From: a@x.example\n\nbare\n",
        ] {
            assert_eq!(read_owned(m.to_vec()), read(m));
        }
        assert!(read_owned(b"not a header\r\n\r\nbody".to_vec()).is_err());
    }

    #[test]
    fn the_header_block_ends_at_the_first_empty_line_crlf_or_lf() {
        let m = read(b"From: a@x\r\nSubject: hi\r\n\r\nbody\r\n\r\nmore\r\n").unwrap();
        assert_eq!(m.headers, b"From: a@x\r\nSubject: hi\r\n");
        assert_eq!(m.body, b"body\r\n\r\nmore\r\n");
        let m = read(b"Subject: hi\n\nbody\n").unwrap();
        assert_eq!(m.headers, b"Subject: hi\n");
        assert_eq!(m.body, b"body\n");
        let m = read(b"Subject: only headers\n").unwrap();
        assert_eq!(m.body, b"");
        assert_eq!(m.subject.as_deref(), Some("only headers"));
        let m = read(b"Subject: x\r\n\tfolded\r\n\r\n").unwrap();
        assert_eq!(m.subject.as_deref(), Some("x folded"));
        assert_eq!(m.body, b"");
    }

    #[test]
    fn a_message_without_a_header_block_is_refused_with_the_reason() {
        for (text, want) in [
            (&b""[..], "no header block"),
            (b"\r\nbody", "no header block"),
            (
                b"Hello there\n\nbody",
                "line 1 is not a header field (\"Hello there\")",
            ),
            (
                b"From a@x Mon Jan 1\nSubject: x\n\n",
                "line 1 is not a header field",
            ),
            (b" folded: x\n\n", "continuation"),
            (
                b"Subject: x\nno colon here\n\nbody",
                "line 2 of the header block",
            ),
            (b": empty name\n\n", "line 1"),
        ] {
            let err = read(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }

    #[test]
    fn from_gives_its_address_and_subject_its_decoded_text() {
        let m = read(
            b"from: =?UTF-8?B?SsO2cmc=?= <joerg@example.org>, b@x\r\n\
              Subject: =?ISO-8859-1?Q?Gr=FC=DFe?= aus Bern\r\n\r\n",
        )
        .unwrap();
        assert_eq!(m.header_from.as_deref(), Some("joerg@example.org"));
        assert_eq!(m.subject.as_deref(), Some("Grüße aus Bern"));
        let m = read(b"From: undisclosed:;\nX: 1\n\n").unwrap();
        assert_eq!(m.header_from.as_deref(), Some("undisclosed:;"));
        let m = read(b"X-Other: 1\n\n").unwrap();
        assert_eq!((m.header_from, m.subject), (None, None));
    }

    #[test]
    fn envelope_addresses_are_checked() {
        assert_eq!(
            envelope_address("<a@x.example>", false).unwrap(),
            "a@x.example"
        );
        assert_eq!(envelope_address("", true).unwrap(), "");
        assert_eq!(envelope_address("<>", true).unwrap(), "");
        assert_eq!(
            envelope_address("jörg@bücher.example", false).unwrap(),
            "jörg@bücher.example"
        );
        assert_eq!(
            envelope_address("\"a b@c\"@x", false).unwrap(),
            "\"a b@c\"@x"
        );
        assert_eq!(
            envelope_address("u@[192.0.2.1]", false).unwrap(),
            "u@[192.0.2.1]"
        );
        assert_eq!(
            envelope_address("first.last+tag@sub.x-y.example", false).unwrap(),
            "first.last+tag@sub.x-y.example"
        );
        for bad in [
            "", "<>", "a b@x", "a@", "@x", "a@x..y", "a@-x", "a..b@x", ".a@x", "a@x\n", "a\0@x",
            "<a@x", "a@x>", "a@[]", "\"open@x", "a,b@x", "a@x y",
        ] {
            assert!(envelope_address(bad, false).is_err(), "{bad:?} passed");
        }
        assert!(envelope_address(&format!("{}@x", "a".repeat(260)), false).is_err());
        // A mailbox has a domain: a bare local name is no envelope address.
        assert!(
            envelope_address("root", false)
                .unwrap_err()
                .contains("no @")
        );
        for (bad, why) in [
            ("<a@x>, <evil@y>", "more than one @"),
            ("a@x>, <evil@y", "more than one @"),
            ("a\u{202e}b@x", "U+202E, a bidirectional control character"),
            ("a@x\u{2028}y", "U+2028, a line or paragraph separator"),
            ("<a@x\r\n>", "U+000D, a control character"),
        ] {
            let err = envelope_address(bad, true).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }
}
