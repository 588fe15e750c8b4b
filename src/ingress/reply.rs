//! A reply of the server (RFC 5321 §4.2) with its enhanced status code (RFC 3463,
//! advertised as ENHANCEDSTATUSCODES, RFC 2034), and its text on the wire. A leaf:
//! used by `params.rs` and `session.rs`, it uses nothing of theirs.

use std::fmt;

/// One reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The three-digit code.
    pub code: u16,
    /// The enhanced status code (`2.1.0`), or empty where RFC 2034 has none (the
    /// greeting, the answer to EHLO/LHLO).
    pub enhanced: &'static str,
    /// The text, one line (line ends and control characters never reach it: see
    /// [`Reply::wire`]).
    pub text: String,
}

impl Reply {
    /// A reply with an enhanced status code.
    pub fn new(code: u16, enhanced: &'static str, text: impl Into<String>) -> Reply {
        Reply {
            code,
            enhanced,
            text: text.into(),
        }
    }

    /// A reply without an enhanced status code.
    pub fn plain(code: u16, text: impl Into<String>) -> Reply {
        Reply::new(code, "", text)
    }

    /// Is it a positive completion (2xx)?
    pub fn is_ok(&self) -> bool {
        (200..300).contains(&self.code)
    }

    /// Does it close the session (421, 221)?
    pub fn closes(&self) -> bool {
        self.code == 421 || self.code == 221
    }

    /// The reply as sent: `CODE ENHANCED TEXT\r\n`, the text cut at 400 bytes and
    /// freed of control characters (a value quoted from the client must not inject a
    /// line).
    pub fn wire(&self) -> Vec<u8> {
        Self::lines(self.code, self.enhanced, std::slice::from_ref(&self.text))
    }

    /// A multi-line reply (`CODE-…` then `CODE …`), as the answer to EHLO.
    pub fn lines(code: u16, enhanced: &str, lines: &[String]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            let sep = if i + 1 == lines.len() { ' ' } else { '-' };
            let mut text: String = line
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            if text.len() > 400 {
                let mut cut = 400;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
            }
            if enhanced.is_empty() {
                out.extend_from_slice(format!("{code}{sep}{text}\r\n").as_bytes());
            } else {
                out.extend_from_slice(format!("{code}{sep}{enhanced} {text}\r\n").as_bytes());
            }
        }
        out
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.enhanced.is_empty() {
            write!(f, "{} {}", self.code, self.text)
        } else {
            write!(f, "{} {} {}", self.code, self.enhanced, self.text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_one_clean_line() {
        assert_eq!(Reply::new(250, "2.1.0", "Ok").wire(), b"250 2.1.0 Ok\r\n");
        assert_eq!(Reply::plain(220, "mx ESMTP").wire(), b"220 mx ESMTP\r\n");
        assert_eq!(
            Reply::new(501, "5.5.4", "bad \r\n250 injected").wire(),
            b"501 5.5.4 bad   250 injected\r\n"
        );
        assert_eq!(
            Reply::lines(
                250,
                "",
                &["mx".into(), "PIPELINING".into(), "SIZE 10".into()]
            ),
            b"250-mx\r\n250-PIPELINING\r\n250 SIZE 10\r\n"
        );
        assert_eq!(
            Reply::new(250, "2.0.0", "é".repeat(300)).wire().len(),
            4 + 6 + 400 + 2
        );
    }
}
