//! The message as its receiver reads it: where the header section ends and the body
//! begins in the text the relay sends (`relay::transaction::as_sent` of a stored header
//! block and body), and the header fields of that section, folded lines joined.
//!
//! Used by `sign.rs` (what a signature covers) and `from.rs` (whose domain signs); both
//! must see the same fields, so neither splits a message itself. It never copies the
//! message: it hands out slices of the stored bytes, whose line ends are read as
//! `as_sent` writes them (every LF a line end, a CR before it part of that line end, any
//! other CR an ordinary byte). Pure, and linear in its input: one pass, no recursion.

/// A stored message as sent, split where its receiver splits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rendered<'a> {
    /// The header section: every line before the first empty one, line ends as stored;
    /// its last line may lack its line end (the relay adds it).
    pub header: &'a [u8],
    /// The body after the empty line, as pieces to read in order (line ends as stored,
    /// the last line perhaps without its end, which the relay adds).
    pub body: [&'a [u8]; 3],
}

/// Splits a stored header block and body the way a receiver splits what `as_sent`
/// renders of them. The header section ends at the first empty line, wherever that is:
/// an empty line inside the stored header block starts the body there (its remaining
/// lines, then the line ends the relay adds, then the stored body); a block without one
/// ends where the relay adds it; an empty block leaves the stored body to be split.
pub fn split<'a>(headers: &'a [u8], body: &'a [u8]) -> Rendered<'a> {
    if headers.is_empty() {
        return match empty_line(body) {
            Some((start, end)) => Rendered {
                header: &body[..start],
                body: [&body[end..], b"", b""],
            },
            None => Rendered {
                header: body,
                body: [b"", b"", b""],
            },
        };
    }
    match empty_line(headers) {
        Some((start, end)) => Rendered {
            header: &headers[..start],
            body: [&headers[end..], terminator(headers), body],
        },
        None => Rendered {
            header: headers,
            body: [b"", b"", body],
        },
    }
}

/// The line ends `as_sent` appends to a non-empty header block: none when it already
/// ends with an empty line, else a CRLF to end its last line if that lacks one, and the
/// CRLF of the empty line.
fn terminator(headers: &[u8]) -> &'static [u8] {
    if headers.ends_with(b"\n\n") || headers.ends_with(b"\r\n\r\n") {
        b""
    } else if headers.ends_with(b"\n") {
        b"\r\n"
    } else {
        b"\r\n\r\n"
    }
}

/// The first empty line of `text` (a line start followed by LF or CRLF): where it
/// starts and where the line after it starts.
fn empty_line(text: &[u8]) -> Option<(usize, usize)> {
    let mut start = 0;
    loop {
        let rest = text.get(start..)?;
        if rest.starts_with(b"\n") {
            return Some((start, start + 1));
        }
        if rest.starts_with(b"\r\n") {
            return Some((start, start + 2));
        }
        start += rest.iter().position(|&b| b == b'\n')? + 1;
    }
}

/// One entry of a header section: a line that does not start with whitespace, and the
/// continuation lines (starting with SP or TAB) that follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field<'a> {
    /// The whole entry as stored, from its first byte to the end of its last line,
    /// without that line's end.
    pub raw: &'a [u8],
    /// The name: the bytes before the first colon of the first line, whitespace before
    /// the colon removed. `None` when the entry is no header field: no colon on its
    /// first line, or a name that is empty or holds other than printable ASCII
    /// (RFC 5322 `ftext`). Such a line is never signed nor read as any field.
    pub name: Option<&'a [u8]>,
    /// Everything after that colon (empty for an entry that is no field).
    pub value: &'a [u8],
}

impl Field<'_> {
    /// Is this a field of this name (compared as ASCII without case)?
    pub fn is(&self, name: &str) -> bool {
        self.name
            .is_some_and(|n| n.eq_ignore_ascii_case(name.as_bytes()))
    }

    /// Can a signature cover this field? Only a header field whose bytes hold no NUL
    /// and whose name has no `;` (which would end the `h=` tag early). Any other entry
    /// is left out of every signature: never listed in `h=`, never counted as an
    /// instance of its name.
    pub fn signable(&self) -> bool {
        self.name.is_some_and(|n| !n.contains(&b';')) && !self.raw.contains(&0)
    }
}

/// The entries of a header section, in order.
pub fn fields(section: &[u8]) -> Fields<'_> {
    Fields { section, pos: 0 }
}

/// The iterator [`fields`] returns.
pub struct Fields<'a> {
    /// The header section.
    section: &'a [u8],
    /// Where the next entry starts.
    pos: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = Field<'a>;

    fn next(&mut self) -> Option<Field<'a>> {
        let section = self.section;
        let start = self.pos;
        let first = section.get(start..).filter(|r| !r.is_empty())?;
        let mut line_end = start
            + first
                .iter()
                .position(|&b| b == b'\n')
                .unwrap_or(first.len());
        let first_line = &section[start..content_end(section, start, line_end)];
        // Continuation lines: each line after a line end that starts with SP or TAB.
        loop {
            let next = line_end + 1;
            match section.get(next) {
                Some(b' ' | b'\t') => {
                    let rest = &section[next..];
                    line_end = next + rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
                }
                _ => break,
            }
        }
        self.pos = line_end.saturating_add(1).min(section.len());
        let raw = &section[start..content_end(section, start, line_end)];
        let (name, value) = match name_of(first_line) {
            Some((name, colon)) => (Some(name), &raw[colon + 1..]),
            None => (None, &raw[raw.len()..]),
        };
        Some(Field { raw, name, value })
    }
}

/// Where the content of the line running from `start` to `line_end` (the index of its
/// LF, or the section's end) ends: before the CR of a CRLF.
fn content_end(section: &[u8], start: usize, line_end: usize) -> usize {
    if line_end < section.len() && line_end > start && section[line_end - 1] == b'\r' {
        line_end - 1
    } else {
        line_end
    }
}

/// The name of a field's first line and the index of its colon; `None` when the line
/// is no header field.
fn name_of(line: &[u8]) -> Option<(&[u8], usize)> {
    let colon = line.iter().position(|&b| b == b':')?;
    let mut name = &line[..colon];
    while let [rest @ .., b' ' | b'\t'] = name {
        name = rest;
    }
    let printable = !name.is_empty() && name.iter().all(|&b| (33..=126).contains(&b));
    printable.then_some((name, colon))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stages::relay::transaction::as_sent;

    /// The header section and body as a receiver of `as_sent` reads them.
    fn receiver_view(headers: &[u8], body: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let text = as_sent(headers, body);
        let at = text
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|i| (i + 2, i + 4));
        let at = if text.starts_with(b"\r\n") {
            Some((0, 2))
        } else {
            at
        };
        match at {
            Some((h, b)) => (text[..h].to_vec(), text[b..].to_vec()),
            None => (text, Vec::new()),
        }
    }

    /// What `split` says, with its line ends made CRLF as the relay makes them.
    fn split_view(headers: &[u8], body: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let r = split(headers, body);
        let mut header = as_sent(r.header, b"");
        // `as_sent` adds the empty line ending a header block; the section has none.
        if header.ends_with(b"\r\n\r\n") {
            header.truncate(header.len() - 2);
        }
        let joined: Vec<u8> = r.body.concat();
        let body = if joined.is_empty() {
            Vec::new()
        } else {
            as_sent(b"", &joined)
        };
        (header, body)
    }

    #[test]
    fn the_split_is_where_a_receiver_of_the_relays_text_splits() {
        let cases: &[(&[u8], &[u8])] = &[
            (b"A: 1\r\nB: 2\r\n", b"body\r\n"),
            (b"A: 1\r\nB: 2\r\n\r\n", b"body\r\n"),
            (b"A: 1\nB: 2\n\n", b"body\n"),
            (b"A: 1\r\nB: 2", b"body"),
            (b"A: 1\r\nB: 2\r", b"body"),
            (b"A: 1\r\n\r\nB: 2\r\n", b"body\r\n"),
            (b"A: 1\n\r\n", b"body\r\n"),
            (b"\r\nA: 1\r\n", b"body\r\n"),
            (b"A: 1\r\n", b""),
            (b"", b"A: 1\r\n\r\nbody\r\n"),
            (b"", b"A: 1\r\nno empty line"),
            (
                b"A: 1\r\n\tfolded\r\n",
                b"\r\n\r\nbody after empty lines\r\n",
            ),
        ];
        for (headers, body) in cases {
            assert_eq!(
                split_view(headers, body),
                receiver_view(headers, body),
                "{:?} {:?}",
                String::from_utf8_lossy(headers),
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_stored_body_is_never_copied_into_the_split() {
        let body = b"text\r\n".to_vec();
        let r = split(b"A: 1\r\n", &body);
        assert!(std::ptr::eq(r.body[2], &body[..]));
        assert_eq!(r.body[..2], [b"", b""]);
        let r = split(b"A: 1\r\n\r\nB: 2", &body);
        assert!(std::ptr::eq(r.body[2], &body[..]));
        assert_eq!(r.body[..2], [&b"B: 2"[..], b"\r\n\r\n"]);
    }

    #[test]
    fn fields_join_their_continuation_lines_and_name_only_real_fields() {
        let section = b"From: a@b\r\nSubject: one\r\n\ttwo\r\n  three\r\nno colon here\r\n \
            cont\r\nB : spaced\r\nBad Name: x\r\n: empty\r\nX-Nul: a\0b\nLast:end";
        let got: Vec<Field> = fields(section).collect();
        let names: Vec<Option<&[u8]>> = got.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            [
                Some(&b"From"[..]),
                Some(b"Subject"),
                None,
                Some(b"B"),
                None,
                None,
                Some(b"X-Nul"),
                Some(b"Last"),
            ]
        );
        assert_eq!(got[1].raw, b"Subject: one\r\n\ttwo\r\n  three");
        assert_eq!(got[1].value, b" one\r\n\ttwo\r\n  three");
        assert_eq!(got[2].raw, b"no colon here\r\n cont");
        assert_eq!(got[3].value, b" spaced");
        assert_eq!(got[7].value, b"end");
        assert!(got[0].is("from") && got[0].is("FROM") && !got[0].is("fro"));
        let signable: Vec<bool> = got.iter().map(Field::signable).collect();
        assert_eq!(
            signable,
            [true, true, false, true, false, false, false, true]
        );
    }

    #[test]
    fn a_leading_continuation_line_and_a_bare_cr_are_read_without_harm() {
        let got: Vec<Field> = fields(b" lead\r\nA: x\ry\r\n\r").collect();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].name, None);
        assert_eq!(got[1].value, b" x\ry");
        assert_eq!(got[2].raw, b"\r");
        assert_eq!(fields(b"").count(), 0);
        let semicolon: Vec<Field> = fields(b"List-X;y: 1\r\n").collect();
        assert!(semicolon[0].name.is_some() && !semicolon[0].signable());
    }
}
