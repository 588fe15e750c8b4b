//! The line format of `pepsi-settings export` and `import`: one setting a line, four
//! fields separated by one TAB each — address, stage, key, value — in UTF-8, lines
//! ending in LF (a CR before it is taken too).
//!
//! Within a field, `\\` is a backslash, `\t` a TAB, `\n` a line feed, `\r` a carriage
//! return, and `\u{X}` the character of code point X (one to six hexadecimal digits).
//! [`encode`] writes that way every character [`crate::escape::must_escape`] marks (the
//! controls, DEL, the C1 controls and the invisible formatting characters), so a file
//! it wrote shows on a terminal and in a diff exactly what it holds; and, so that
//! editors and the comment rule cannot change a line, a `#` that starts the line and the
//! spaces that end the value (`\u{23}`, `\u{20}`). Everything else is written as it is:
//! spaces, quotes, `#` elsewhere, `é`. [`decode`] reads exactly that back, and refuses
//! any other escape and those characters written raw: what an import reads is what the
//! file shows. A line that is empty, or whose first character is `#`, is a comment; a
//! line of three fields has an empty value (its trailing TAB removed by an editor).
//!
//! Pure: text in, text out. Used by `show.rs` (export) and `import.rs`; the rules of what
//! a field may hold (an address, a stage, a key) are `judge.rs`'s.

use std::fmt::Write as _;

use crate::escape::must_escape;
use crate::worker::settings::SettingRow;

/// The first line `export` writes: what the fields are and how they are escaped.
pub const HEADER: &str = "# pepsi-settings export: ADDRESS<TAB>STAGE<TAB>KEY<TAB>VALUE, \
                          escapes \\\\ \\t \\n \\r \\u{X}";

/// Writes `c` escaped into `out`.
fn escaped(out: &mut String, c: char) {
    match c {
        '\\' => out.push_str("\\\\"),
        '\t' => out.push_str("\\t"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        // Writing into a String cannot fail.
        _ => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
}

/// Writes one field; `first` for the address (a leading `#` escaped), `last` for the
/// value (its trailing spaces escaped).
fn field(out: &mut String, text: &str, first: bool, last: bool) {
    // Where the trailing run of spaces starts, for the value.
    let trailing = if last {
        text.trim_end_matches(' ').len()
    } else {
        text.len()
    };
    for (i, c) in text.char_indices() {
        let plain = c != '\\'
            && c != '\t'
            && !must_escape(c)
            && !(first && i == 0 && c == '#')
            && !(i >= trailing && c == ' ');
        if plain {
            out.push(c);
        } else {
            escaped(out, c);
        }
    }
}

/// One setting as a line, without its line feed.
pub fn encode(row: &SettingRow) -> String {
    let mut out = String::with_capacity(
        row.address.len() + row.stage.len() + row.key.len() + row.value.len() + 3,
    );
    field(&mut out, &row.address, true, false);
    out.push('\t');
    field(&mut out, &row.stage, false, false);
    out.push('\t');
    field(&mut out, &row.key, false, false);
    out.push('\t');
    field(&mut out, &row.value, false, true);
    out
}

/// Reads one field's escapes; why not, naming the field.
fn unescape(text: &str, what: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            if must_escape(c) {
                return Err(format!(
                    "the {what} holds U+{:04X} written as it is; write it as \\u{{{:x}}}",
                    c as u32, c as u32
                ));
            }
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => out.push('\\'),
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('u') => {
                if chars.next() != Some('{') {
                    return Err(format!("the {what} has \\u without {{ after it"));
                }
                let mut hex = String::new();
                loop {
                    match chars.next() {
                        Some('}') if !hex.is_empty() => break,
                        Some(h) if h.is_ascii_hexdigit() && hex.len() < 6 => hex.push(h),
                        _ => {
                            return Err(format!(
                                "the {what} has a \\u{{…}} that is not one to six hexadecimal digits in braces"
                            ));
                        }
                    }
                }
                let code = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32);
                match code {
                    Some(ch) => out.push(ch),
                    None => {
                        return Err(format!(
                            "the {what} has \\u{{{hex}}}, which is no character"
                        ));
                    }
                }
            }
            Some(other) => {
                let mut shown = String::new();
                escaped_or_plain(&mut shown, other);
                return Err(format!(
                    "the {what} has the unknown escape \\{shown} (a backslash is written \\\\)"
                ));
            }
            None => {
                return Err(format!(
                    "the {what} ends in a lone backslash (a backslash is written \\\\)"
                ));
            }
        }
    }
    Ok(out)
}

/// `c` as it may be shown in a message: escaped when it must be.
fn escaped_or_plain(out: &mut String, c: char) {
    if must_escape(c) {
        escaped(out, c);
    } else {
        out.push(c);
    }
}

/// Reads one line (without its line feed; a CR at its end is dropped): `None` for a
/// comment or an empty line, else the setting as written (its address not yet
/// lower-cased), or why the line is not one.
pub fn decode(line: &str) -> Result<Option<SettingRow>, String> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let fields: Vec<&str> = line.split('\t').collect();
    let (address, stage, key, value) = match fields[..] {
        [a, s, k, v] => (a, s, k, v),
        [a, s, k] => (a, s, k, ""),
        _ => {
            let plural = if fields.len() == 1 { "" } else { "s" };
            return Err(format!(
                "{} field{plural}; a setting is ADDRESS, STAGE, KEY and VALUE separated by \
                 one TAB each (a TAB inside a field is written \\t)",
                fields.len()
            ));
        }
    };
    let row = SettingRow {
        address: unescape(address, "address")?,
        stage: unescape(stage, "stage")?,
        key: unescape(key, "key")?,
        value: unescape(value, "value")?,
    };
    for (text, what) in [
        (&row.address, "address"),
        (&row.stage, "stage"),
        (&row.key, "key"),
    ] {
        if text.is_empty() {
            return Err(format!("the {what} is empty"));
        }
    }
    Ok(Some(row))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(address: &str, stage: &str, key: &str, value: &str) -> SettingRow {
        SettingRow {
            address: address.into(),
            stage: stage.into(),
            key: key.into(),
            value: value.into(),
        }
    }

    #[test]
    fn every_value_round_trips_and_the_line_shows_no_control_or_invisible_character() {
        for value in [
            "",
            "recipient-domain is a.example",
            "  leading and trailing  ",
            "subject contains \"# not a comment\"",
            "tab\there",
            "line\nfeed and\r\nCRLF",
            "back\\slash \\t \\u{41}",
            "é 日本 \u{202e}reversed\u{2066}",
            "\u{1b}[2J\u{0}\u{7f}\u{85}\u{feff}\u{200b}",
            " ",
            "#",
        ] {
            for address in ["a@x.example", "#hash@x.example", "é@x.example"] {
                let original = row(address, "route", "MATCH", value);
                let line = encode(&original);
                assert!(
                    !line.contains(|c: char| must_escape(c) && c != '\t'),
                    "{line:?}"
                );
                assert_eq!(line.matches('\t').count(), 3, "{line:?}");
                assert!(!line.starts_with('#'), "{line:?}");
                assert!(!line.ends_with(' '), "{line:?}");
                assert_eq!(decode(&line), Ok(Some(original.clone())), "{line:?}");
                assert_eq!(
                    decode(&format!("{line}\r")),
                    Ok(Some(original)),
                    "a CRLF line end"
                );
            }
        }
    }

    #[test]
    fn the_escaped_forms_are_written_as_documented() {
        assert_eq!(
            encode(&row("#a@x", "s", "K", "a\\b\tc\nd\re\u{1b} ")),
            "\\u{23}a@x\ts\tK\ta\\\\b\\tc\\nd\\re\\u{1b}\\u{20}"
        );
        assert_eq!(encode(&row("a@x", "s", "K", "")), "a@x\ts\tK\t");
    }

    #[test]
    fn comments_blank_lines_and_a_lost_trailing_tab_are_read() {
        assert_eq!(decode(""), Ok(None));
        assert_eq!(decode("\r"), Ok(None));
        assert_eq!(decode("# a comment\twith a tab"), Ok(None));
        assert_eq!(decode("#"), Ok(None));
        assert_eq!(decode("a@x\ts\tK"), Ok(Some(row("a@x", "s", "K", ""))));
        assert_eq!(
            decode("a@x\ts\tK\t\\u{10FFFF}"),
            Ok(Some(row("a@x", "s", "K", "\u{10ffff}")))
        );
    }

    #[test]
    fn a_malformed_line_is_refused_with_why() {
        for (line, says) in [
            ("a@x\ts", "2 fields"),
            ("a@x\ts\tK\tv\textra", "5 fields"),
            ("a@x s K v", "1 field;"),
            ("a@x\ts\tK\tv\\", "lone backslash"),
            ("a@x\ts\tK\t\\q", "unknown escape \\q"),
            ("a@x\ts\tK\t\\u41", "without {"),
            ("a@x\ts\tK\t\\u{}", "one to six"),
            ("a@x\ts\tK\t\\u{1234567}", "one to six"),
            ("a@x\ts\tK\t\\u{d800}", "no character"),
            ("a@x\ts\tK\t\\u{110000}", "no character"),
            ("a@x\ts\tK\t\\u{41", "one to six"),
            ("a@x\ts\tK\tv\u{202e}", "U+202E written as it is"),
            ("a@x\u{1b}\ts\tK\tv", "the address holds U+001B"),
            ("a@x\ts\tK\tcr\rinside", "U+000D"),
            ("\ts\tK\tv", "the address is empty"),
            ("a@x\t\tK\tv", "the stage is empty"),
            ("a@x\ts\t\tv", "the key is empty"),
        ] {
            let err = decode(line).expect_err(line);
            assert!(err.contains(says), "{line:?}: {err}");
            assert!(
                !err.contains(|c: char| must_escape(c)),
                "the reason shows no raw control: {err:?}"
            );
        }
    }
}
