//! Text from messages and the database, made safe to show: the one escaping used
//! wherever such text reaches a log line, a terminal or a metrics label, and the one
//! list of characters that no envelope address may hold ([`crate::mailbox`] refuses
//! exactly [`must_escape`]'s characters).
//!
//! The characters escaped are those that can rewrite or hide what a person reads: the C0
//! controls U+0000–U+001F (ESC starts terminal sequences, CR and LF forge log lines),
//! DEL U+007F, the C1 controls U+0080–U+009F, and the invisible formatting characters
//! that reorder or hide text: the bidirectional controls U+061C, U+200E, U+200F,
//! U+202A–U+202E and U+2066–U+2069; the zero-width and invisible characters
//! U+200B–U+200D, U+2060–U+2064 and U+FEFF; the line and paragraph separators U+2028 and
//! U+2029; the interlinear annotations U+FFF9–U+FFFB. Everything else, ordinary
//! non-ASCII such as `é` included, is written as it is.
//!
//! The escaped form, one for all: `\t`, `\n` and `\r` for TAB, LF and CR, and `\u{X}`
//! with the code point in lower-case hexadecimal, without leading zeros, for every other
//! (`\u{1b}` for ESC, `\u{202e}` for RIGHT-TO-LEFT OVERRIDE), as Rust writes them. A
//! byte that is not part of valid UTF-8 is written `\xNN` ([`VisibleBytes`]). A
//! backslash is left alone: the escaped text is for eyes and cannot be read back.
//!
//! Pure: no I/O. [`Visible`] is for one value on one line; [`VisibleLines`] keeps the
//! line feeds of text the program wrote in lines (a log message, pretty JSON), and
//! [`VisibleBytes`] the line ends (LF, CRLF) of stored content (a header block, a body).

use std::fmt;

/// Must this character be escaped before it is shown (and is it refused in an address)?
pub fn must_escape(c: char) -> bool {
    matches!(
        c,
        '\u{0}'..='\u{1f}'
            | '\u{7f}'..='\u{9f}'
            | '\u{61c}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{2069}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
    )
}

/// What kind of character [`must_escape`] refuses, for error messages ("a control
/// character"); `None` for any other.
pub fn kind(c: char) -> Option<&'static str> {
    Some(match c {
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' => "a control character",
        '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => {
            "a bidirectional control character"
        }
        '\u{2028}' | '\u{2029}' => "a line or paragraph separator",
        '\u{200b}'..='\u{200d}' | '\u{2060}'..='\u{2064}' | '\u{feff}' => {
            "an invisible formatting character"
        }
        '\u{fff9}'..='\u{fffb}' => "an interlinear annotation character",
        _ => return None,
    })
}

/// Writes one character, escaped when [`must_escape`] says so.
fn write_char(f: &mut dyn fmt::Write, c: char) -> fmt::Result {
    match c {
        '\t' => f.write_str("\\t"),
        '\n' => f.write_str("\\n"),
        '\r' => f.write_str("\\r"),
        c if must_escape(c) => write!(f, "\\u{{{:x}}}", c as u32),
        c => f.write_char(c),
    }
}

/// Which line ends stay as they are.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// None: a value on one line.
    Nothing,
    /// LF: a text of lines the program wrote (a log message).
    LineFeeds,
    /// LF, and CR right before LF: stored content (a header block, a body).
    LineEnds,
}

/// Writes text escaped, but for the line ends `keep` names.
fn write_text(f: &mut dyn fmt::Write, text: &str, keep: Keep) -> fmt::Result {
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let line_end = match c {
            '\n' => keep != Keep::Nothing,
            '\r' => keep == Keep::LineEnds && chars.peek() == Some(&'\n'),
            _ => false,
        };
        if line_end {
            f.write_char(c)?;
        } else {
            write_char(f, c)?;
        }
    }
    Ok(())
}

/// Serialized JSON made safe to show, and still the same JSON: every character
/// [`must_escape`] marks that the serializer left as it is (the C1 controls, the
/// invisible formatting characters; all in the Basic Multilingual Plane, and only ever
/// inside strings) is written as a JSON escape `\uXXXX`, which a JSON reader turns back
/// into the character.
pub fn json_visible(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if must_escape(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// One value shown on one line: every character [`must_escape`] marks is written in
/// its escaped form, line ends included. `format!("{}", Visible("a\u{1b}b"))` is
/// `a\u{1b}b` written out with a backslash.
#[derive(Clone, Copy, Debug)]
pub struct Visible<'a>(pub &'a str);

impl fmt::Display for Visible<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_text(f, self.0, Keep::Nothing)
    }
}

/// Lines the program wrote (a log message, a failure, pretty JSON) shown as lines: like
/// [`Visible`], but a line feed stays a line feed. A carriage return is escaped.
#[derive(Clone, Copy, Debug)]
pub struct VisibleLines<'a>(pub &'a str);

impl fmt::Display for VisibleLines<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_text(f, self.0, Keep::LineFeeds)
    }
}

/// Stored content (a header block, a body) shown as lines: like [`Visible`], but its
/// line ends, LF and CRLF, stay as they are, and each byte that is not part of valid
/// UTF-8 is written `\xNN`.
#[derive(Clone, Copy, Debug)]
pub struct VisibleBytes<'a>(pub &'a [u8]);

impl fmt::Display for VisibleBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            // A chunk's valid part ends before an invalid byte or at the end, so a CR
            // it ends in comes before no LF and is escaped, as it should be.
            write_text(f, chunk.valid(), Keep::LineEnds)?;
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(text: &str) -> String {
        Visible(text).to_string()
    }

    #[test]
    fn controls_and_invisible_formatting_are_escaped() {
        assert_eq!(shown("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(shown("a\r\nb\tc\0"), "a\\r\\nb\\tc\\u{0}");
        assert_eq!(shown("\u{7f}\u{80}\u{9f}"), "\\u{7f}\\u{80}\\u{9f}");
        assert_eq!(
            shown("x\u{202e}gpj.exe\u{2028}y\u{2029}"),
            "x\\u{202e}gpj.exe\\u{2028}y\\u{2029}"
        );
        for c in [
            '\u{61c}', '\u{200b}', '\u{200f}', '\u{202a}', '\u{2060}', '\u{2064}', '\u{2066}',
            '\u{2069}', '\u{feff}', '\u{fff9}', '\u{fffb}',
        ] {
            let text = shown(&c.to_string());
            assert_eq!(text, format!("\\u{{{:x}}}", c as u32));
            assert!(kind(c).is_some(), "{text} has a kind");
        }
    }

    #[test]
    fn everything_else_is_left_alone() {
        for text in [
            "alice@example.org",
            "jörg@bücher.example",
            "日本語",
            "a\\b \"q\" é ü ß",
            "\u{a0}\u{ad}\u{2065}\u{206a}\u{fffc}\u{1f600}",
        ] {
            assert_eq!(shown(text), text);
        }
        assert_eq!(kind('é'), None);
        assert_eq!(kind('\u{2065}'), None, "unassigned, not in the list");
    }

    #[test]
    fn escaping_twice_changes_nothing_more() {
        let once = shown("a\u{1b}\n\u{202e}");
        assert_eq!(shown(&once), once);
    }

    #[test]
    fn lines_keep_their_ends_and_nothing_else() {
        assert_eq!(
            VisibleLines("a\r\nb\nc\rd\u{1b}\n").to_string(),
            "a\\r\nb\nc\\rd\\u{1b}\n"
        );
        assert_eq!(
            VisibleBytes(b"Subject: caf\xe9\r\nX: \x1b\xff\n").to_string(),
            "Subject: caf\\xe9\r\nX: \\u{1b}\\xff\n"
        );
        assert_eq!(
            VisibleBytes("é\u{2028}".as_bytes()).to_string(),
            "é\\u{2028}"
        );
    }

    #[test]
    fn kinds_name_what_a_character_is() {
        assert_eq!(kind('\u{202e}'), Some("a bidirectional control character"));
        assert_eq!(kind('\n'), Some("a control character"));
        assert_eq!(kind('\u{85}'), Some("a control character"));
        assert_eq!(kind('\u{2028}'), Some("a line or paragraph separator"));
        assert_eq!(kind('\u{200b}'), Some("an invisible formatting character"));
        assert_eq!(
            kind('\u{fffa}'),
            Some("an interlinear annotation character")
        );
    }
}
