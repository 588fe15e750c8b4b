//! A smarthost's replies (RFC 5321 §4.2, RFC 2034 enhanced status codes), read from
//! the network, which is hostile: a line is at most [`MAX_LINE`] octets, a reply at
//! most [`MAX_LINES`] lines, every line of a reply must carry the same code; the text
//! keeps printable ASCII only. Also what a reply means for a recipient's delivery
//! status notification: its enhanced code ([`Reply::status`], derived from the basic
//! code when the reply has none) and its `Diagnostic-Code` ([`Reply::diagnostic`]).
//!
//! Pure apart from reading a `BufRead`; used by `client.rs` and `transaction.rs`.

use std::io::{self, BufRead};

/// The longest reply line taken (RFC 5321 allows 512 octets; servers exceed it).
pub const MAX_LINE: usize = 2048;
/// The most lines one reply may have.
pub const MAX_LINES: usize = 100;
/// The most characters of reply text kept (in the log, `last_error` and a DSN).
const MAX_TEXT: usize = 400;

/// One reply of the smarthost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The three-digit code.
    pub code: u16,
    /// The text of every line, joined by a space, printable ASCII only, at most
    /// [`MAX_TEXT`] characters (the enhanced code left in).
    pub text: String,
    /// The text of each line, printable ASCII only (an EHLO reply's capabilities).
    pub lines: Vec<String>,
}

/// A reply that could not be read: the connection failed or the peer does not speak
/// SMTP. Either way the connection is of no further use.
#[derive(Debug)]
pub struct Broken(pub String);

impl From<io::Error> for Broken {
    fn from(e: io::Error) -> Broken {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                Broken("timed out waiting for the smarthost".into())
            }
            io::ErrorKind::UnexpectedEof => Broken("the smarthost closed the connection".into()),
            _ => Broken(format!("connection to the smarthost failed: {e}")),
        }
    }
}

/// Keeps printable ASCII of `text` (anything else becomes `?`), at most `max` chars.
pub fn printable(text: &str, max: usize) -> String {
    text.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .take(max)
        .collect()
}

/// Reads one line of at most [`MAX_LINE`] octets, without its line end.
fn read_line(input: &mut impl BufRead) -> Result<Vec<u8>, Broken> {
    let mut line = Vec::new();
    loop {
        let (done, used) = {
            let buf = input.fill_buf()?;
            if buf.is_empty() {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
            match buf.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    line.extend_from_slice(&buf[..i]);
                    (true, i + 1)
                }
                None => {
                    line.extend_from_slice(buf);
                    (false, buf.len())
                }
            }
        };
        input.consume(used);
        if line.len() > MAX_LINE {
            return Err(Broken(format!(
                "the smarthost sent a reply line over {MAX_LINE} octets"
            )));
        }
        if done {
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(line);
        }
    }
}

/// Parses one reply line: its code, whether more lines follow, its text.
fn parse_line(line: &[u8]) -> Option<(u16, bool, &[u8])> {
    if line.len() < 3 || !line[..3].iter().all(u8::is_ascii_digit) {
        return None;
    }
    let code =
        (line[0] - b'0') as u16 * 100 + (line[1] - b'0') as u16 * 10 + (line[2] - b'0') as u16;
    if !(200..600).contains(&code) {
        return None;
    }
    match line.get(3) {
        None => Some((code, false, b"")),
        Some(b' ') => Some((code, false, &line[4..])),
        Some(b'-') => Some((code, true, &line[4..])),
        Some(_) => None,
    }
}

/// Reads one (possibly multi-line) reply.
pub fn read_reply(input: &mut impl BufRead) -> Result<Reply, Broken> {
    let mut code = None;
    let mut text = String::new();
    let mut lines = Vec::new();
    for _ in 0..MAX_LINES {
        let line = read_line(input)?;
        let Some((c, more, part)) = parse_line(&line) else {
            return Err(Broken(format!(
                "the smarthost sent a line that is no reply: {:?}",
                printable(&String::from_utf8_lossy(&line), 80)
            )));
        };
        if *code.get_or_insert(c) != c {
            return Err(Broken(format!(
                "the smarthost changed its reply code from {} to {c} within a reply",
                code.unwrap_or(c)
            )));
        }
        let clean = printable(String::from_utf8_lossy(part).trim(), MAX_LINE);
        if text.len() < MAX_TEXT {
            if !text.is_empty() {
                text.push(' ');
            }
            text.extend(clean.chars().take(MAX_TEXT - text.len()));
        }
        lines.push(clean);
        if !more {
            return Ok(Reply {
                code: c,
                text,
                lines,
            });
        }
    }
    Err(Broken(format!(
        "the smarthost sent a reply of more than {MAX_LINES} lines"
    )))
}

/// An enhanced status code (RFC 3463) at the start of `text`, when it is one of class
/// `class` (`class.subject.detail`, subject and detail of 1 to 3 digits).
fn enhanced_in(text: &str, class: u16) -> Option<&str> {
    let word = text.split(' ').next()?;
    let mut parts = word.split('.');
    let c = parts.next()?;
    let subject = parts.next()?;
    let detail = parts.next()?;
    let digits = |s: &str| (1..=3).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
    let ok = parts.next().is_none()
        && c == class.to_string()
        && digits(subject)
        && digits(detail)
        && !(subject.len() > 1 && subject.starts_with('0'))
        && !(detail.len() > 1 && detail.starts_with('0'));
    ok.then_some(word)
}

/// The enhanced status code a basic reply code stands for, for replies without one:
/// the code's class with a detail where the basic code says more than its class.
pub fn status_of_code(code: u16) -> &'static str {
    match code {
        421 => "4.3.0",
        450 => "4.2.0",
        451 => "4.3.0",
        452 => "4.3.1",
        552 => "5.2.2",
        553 => "5.1.3",
        c if (200..300).contains(&c) => "2.0.0",
        c if (400..500).contains(&c) => "4.0.0",
        _ => "5.0.0",
    }
}

impl Reply {
    /// The reply's class: 2, 3, 4 or 5.
    pub fn class(&self) -> u16 {
        self.code / 100
    }

    /// Is it a positive completion (2xx)?
    pub fn is_ok(&self) -> bool {
        self.class() == 2
    }

    /// Its enhanced status code: the one it starts with when that matches its class,
    /// else the one its basic code stands for ([`status_of_code`]).
    pub fn status(&self) -> String {
        enhanced_in(&self.text, self.class())
            .map(str::to_string)
            .unwrap_or_else(|| status_of_code(self.code).to_string())
    }

    /// The reply as a `Diagnostic-Code` of a DSN: `smtp; 550 5.1.1 <x>: user unknown`
    /// (printable ASCII: the reply was read so).
    pub fn diagnostic(&self) -> String {
        if self.text.is_empty() {
            format!("smtp; {}", self.code)
        } else {
            format!("smtp; {} {}", self.code, self.text)
        }
    }
}

/// For logs and `last_error`: `550 5.1.1 text`.
impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.code, self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(bytes: &[u8]) -> Result<Reply, Broken> {
        read_reply(&mut io::BufReader::new(bytes))
    }

    #[test]
    fn a_multi_line_reply_is_one_reply_with_its_lines_joined() {
        let r = read(b"250-mx.example hello\r\n250-PIPELINING\r\n250 DSN\r\n").unwrap();
        assert_eq!(r.code, 250);
        assert_eq!(r.text, "mx.example hello PIPELINING DSN");
        let bare = read(b"354\n").unwrap();
        assert_eq!((bare.code, bare.text.as_str()), (354, ""));
    }

    #[test]
    fn replies_are_read_one_at_a_time_from_a_pipelined_stream() {
        let mut input =
            io::BufReader::new(&b"250 2.1.0 ok\r\n550 5.1.1 <x@y>: no\r\n354 go\r\n"[..]);
        let codes: Vec<u16> = (0..3)
            .map(|_| read_reply(&mut input).unwrap().code)
            .collect();
        assert_eq!(codes, vec![250, 550, 354]);
        assert!(read_reply(&mut input).is_err(), "end of stream");
    }

    #[test]
    fn hostile_replies_are_refused_or_cleaned() {
        assert!(read(b"hello\r\n").is_err(), "no code");
        assert!(read(b"250-a\r\n550 b\r\n").is_err(), "code changed");
        assert!(read(b"650 x\r\n").is_err(), "no such class");
        assert!(read(b"250x\r\n").is_err());
        assert!(read(&[b"250 ".as_slice(), &[b'a'; MAX_LINE + 10], b"\r\n"].concat()).is_err());
        let many = b"250-x\r\n".repeat(MAX_LINES + 1);
        assert!(read(&many).is_err(), "too many lines");
        let r = read(b"550 5.1.1 bad\x1b[31m \xc3\xa9\0 user\r\n").unwrap();
        assert_eq!(r.text, "5.1.1 bad?[31m ?? user");
        let long = read(
            &[
                &b"250-a\r\n".repeat(20)[..],
                &[b"250 ".as_slice(), &[b'b'; 1000]].concat(),
                b"\r\n",
            ]
            .concat(),
        )
        .unwrap();
        assert!(long.text.len() <= MAX_TEXT, "{}", long.text.len());
    }

    #[test]
    fn the_enhanced_code_comes_from_the_reply_or_from_its_basic_code() {
        let r = |code: u16, text: &str| Reply {
            code,
            text: text.into(),
            lines: vec![text.into()],
        };
        assert_eq!(r(550, "5.1.1 <x@y>: user unknown").status(), "5.1.1");
        assert_eq!(r(451, "4.3.0 try later").status(), "4.3.0");
        assert_eq!(r(550, "user unknown").status(), "5.0.0");
        assert_eq!(r(550, "4.1.1 wrong class").status(), "5.0.0");
        assert_eq!(r(550, "5.1 too short").status(), "5.0.0");
        assert_eq!(r(550, "5.01.1 leading zero").status(), "5.0.0");
        assert_eq!(r(554, "5.7.1234 too long").status(), "5.0.0");
        assert_eq!(r(552, "mailbox full").status(), "5.2.2");
        assert_eq!(r(553, "").status(), "5.1.3");
        assert_eq!(r(452, "no space").status(), "4.3.1");
        assert_eq!(r(450, "busy").status(), "4.2.0");
        assert_eq!(r(421, "closing").status(), "4.3.0");
        assert_eq!(r(451, "x").status(), "4.3.0");
        assert_eq!(r(454, "x").status(), "4.0.0");
        assert_eq!(r(250, "ok").status(), "2.0.0");
        assert_eq!(
            r(550, "5.1.1 <x@y>: user unknown").diagnostic(),
            "smtp; 550 5.1.1 <x@y>: user unknown"
        );
        assert_eq!(r(550, "").diagnostic(), "smtp; 550");
    }
}
