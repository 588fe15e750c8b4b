//! DKIM's relaxed canonicalization (RFC 6376 §3.4.2 for header fields, RFC 6376 §3.4.4 for the
//! body), over the stored bytes as `fields.rs` reads them: every LF ends a line, a CR
//! just before it belongs to that line end, any other CR is an ordinary byte.
//!
//! Used by `sign.rs`. The body is canonicalized as a stream, piece by piece, into a
//! [`Sink`] (a SHA-256 context when signing), through a small fixed buffer: a body is
//! never copied whole. Pure and linear; no allocation that grows with the input beyond
//! the canonical header text itself.

use ring::digest;

/// Where canonical bytes go.
pub trait Sink {
    /// Takes the next canonical bytes.
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for digest::Context {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

/// Is this byte whitespace within a line (RFC 5234 WSP)?
fn wsp(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// Appends the relaxed form of a header field to `out`: its name in lower case, a
/// colon, and its value unfolded (line ends removed), every run of whitespace made one
/// SP, whitespace at its start and end removed. No line end is added: the caller adds
/// CRLF, except after the signature's own field, which is hashed without one.
pub fn relaxed_header(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.reserve(name.len() + value.len() + 3);
    out.extend(name.iter().map(u8::to_ascii_lowercase));
    out.push(b':');
    let mut space = false;
    let mut started = false;
    for (i, &b) in value.iter().enumerate() {
        // A line end (LF, with the CR before it) is removed: unfolding.
        if b == b'\n' || (b == b'\r' && value.get(i + 1) == Some(&b'\n')) {
            continue;
        }
        if wsp(b) {
            space = started;
            continue;
        }
        if space {
            out.push(b' ');
            space = false;
        }
        out.push(b);
        started = true;
    }
}

/// The buffer of canonical body bytes kept before they go to the sink.
const BUFFER: usize = 8 * 1024;

/// The relaxed body canonicalization as a stream: [`RelaxedBody::update`] with each
/// piece of the body in order, then [`RelaxedBody::finish`]. Whitespace at a line's end
/// is removed, every other run of it made one SP; empty lines at the end of the body are
/// removed; a last line without a line end gets one (the relay sends one); an empty
/// body, or one of empty lines only, is canonically empty.
pub struct RelaxedBody<S: Sink> {
    /// Where the canonical bytes go.
    sink: S,
    /// Canonical bytes not yet handed to the sink (at most [`BUFFER`]).
    buf: Vec<u8>,
    /// Whitespace seen in the current line and not yet written.
    space: bool,
    /// A CR seen and not yet known to end the line.
    cr: bool,
    /// Empty lines seen and not yet written (they are written only when a non-empty
    /// line follows).
    empty: usize,
    /// Has the current line written anything?
    in_line: bool,
}

impl<S: Sink> RelaxedBody<S> {
    /// A canonicalizer writing into `sink`.
    pub fn new(sink: S) -> Self {
        RelaxedBody {
            sink,
            buf: Vec::with_capacity(BUFFER),
            space: false,
            cr: false,
            empty: 0,
            in_line: false,
        }
    }

    /// Takes the next piece of the body.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.cr {
                self.cr = false;
                if bytes[0] == b'\n' {
                    self.line_end();
                    bytes = &bytes[1..];
                    continue;
                }
                // The CR ends no line: it is content.
                self.content(b"\r");
            }
            let run = bytes
                .iter()
                .position(|&b| wsp(b) || b == b'\r' || b == b'\n')
                .unwrap_or(bytes.len());
            if run > 0 {
                self.content(&bytes[..run]);
                bytes = &bytes[run..];
                continue;
            }
            match bytes[0] {
                b'\r' => self.cr = true,
                b'\n' => self.line_end(),
                _ => self.space = true,
            }
            bytes = &bytes[1..];
        }
    }

    /// Ends the body and hands back the sink, every canonical byte in it.
    pub fn finish(mut self) -> S {
        if self.cr {
            self.cr = false;
            self.content(b"\r");
        }
        if self.in_line {
            self.line_end();
        }
        self.flush();
        self.sink
    }

    /// Writes content of the current line, after the empty lines and the space that
    /// come before it.
    fn content(&mut self, bytes: &[u8]) {
        if !self.in_line {
            for _ in 0..self.empty {
                self.write(b"\r\n");
            }
            self.empty = 0;
            self.in_line = true;
        }
        if self.space {
            self.space = false;
            self.write(b" ");
        }
        self.write(bytes);
    }

    /// Ends the current line: whitespace at its end is dropped; an empty line is kept
    /// back until a non-empty one follows.
    fn line_end(&mut self) {
        self.space = false;
        if self.in_line {
            self.in_line = false;
            self.write(b"\r\n");
        } else {
            self.empty += 1;
        }
    }

    /// Queues canonical bytes, handing the buffer to the sink when it is full (a piece
    /// larger than the buffer goes to the sink at once).
    fn write(&mut self, bytes: &[u8]) {
        if self.buf.len() + bytes.len() > BUFFER {
            self.flush();
        }
        if bytes.len() > BUFFER {
            self.sink.put(bytes);
        } else {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Hands the buffered bytes to the sink.
    fn flush(&mut self) {
        if !self.buf.is_empty() {
            self.sink.put(&self.buf);
            self.buf.clear();
        }
    }
}

/// The SHA-256 digest of the relaxed canonical body made of these pieces.
pub fn body_hash(pieces: &[&[u8]]) -> digest::Digest {
    let mut canon = RelaxedBody::new(digest::Context::new(&digest::SHA256));
    for piece in pieces {
        canon.update(piece);
    }
    canon.finish().finish()
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;

    use super::*;
    use crate::stages::dkim::fields;

    /// The canonical body of these pieces.
    fn body(pieces: &[&[u8]]) -> Vec<u8> {
        let mut canon = RelaxedBody::new(Vec::new());
        for piece in pieces {
            canon.update(piece);
        }
        canon.finish()
    }

    /// The canonical header fields of a section, each ending CRLF.
    fn headers(section: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in fields::fields(section) {
            if let Some(name) = f.name {
                relaxed_header(name, f.value, &mut out);
                out.extend_from_slice(b"\r\n");
            }
        }
        out
    }

    #[test]
    fn rfc_6376_section_3_4_5_example_is_canonicalized_as_the_rfc_shows() {
        let message = b"A: X\r\nB : Y\t\r\n\tZ  \r\n\r\n C \r\nD \t E\r\n\r\n\r\n";
        let r = fields::split(message, b"");
        assert_eq!(headers(r.header), b"a:X\r\nb:Y Z\r\n");
        assert_eq!(body(&r.body), b" C\r\nD E\r\n");
    }

    #[test]
    fn an_empty_body_hashes_to_the_empty_strings_digest() {
        for pieces in [
            &[][..],
            &[&b""[..]],
            &[&b"\r\n\r\n"[..], b"\n", b"  \t\r\n"],
        ] {
            assert_eq!(body(pieces), b"");
            assert_eq!(
                STANDARD.encode(body_hash(pieces)),
                "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="
            );
        }
    }

    #[test]
    fn relaxed_body_reduces_whitespace_and_drops_trailing_empty_lines() {
        assert_eq!(body(&[b" a  \t b \r\n\r\n\r\n"]), b" a b\r\n");
        assert_eq!(body(&[b"no line end"]), b"no line end\r\n");
        assert_eq!(body(&[b"a\n\nb\n\n"]), b"a\r\n\r\nb\r\n");
        assert_eq!(body(&[b"\r\n\r\nlate\r\n"]), b"\r\n\r\nlate\r\n");
        assert_eq!(body(&[b"x \r y\r\r\n"]), b"x \r y\r\r\n");
        assert_eq!(body(&[b"ends with cr\r"]), b"ends with cr\r\r\n");
        assert_eq!(body(&[b"8bit \xe9\xff  \r\n"]), b"8bit \xe9\xff\r\n");
    }

    #[test]
    fn a_body_in_pieces_canonicalizes_as_the_joined_body() {
        let whole: &[u8] = b"a \t\r\n\r\n b\r\r\n \nc  \r\n\r\n\r\n";
        for i in 0..=whole.len() {
            for j in i..=whole.len() {
                assert_eq!(
                    body(&[&whole[..i], &whole[i..j], &whole[j..]]),
                    body(&[whole]),
                    "split at {i} and {j}"
                );
            }
        }
    }

    #[test]
    fn a_body_longer_than_the_buffer_hashes_as_its_canonical_bytes() {
        let mut long = Vec::new();
        for i in 0..5000 {
            long.extend_from_slice(format!("line {i}   with  spaces \t\r\n").as_bytes());
        }
        long.extend_from_slice(&[b'x'; 3 * BUFFER]);
        let canonical = body(&[&long]);
        assert_eq!(
            body_hash(&[&long]).as_ref(),
            digest::digest(&digest::SHA256, &canonical).as_ref()
        );
        assert!(canonical.starts_with(b"line 0 with spaces\r\nline 1"));
        assert!(canonical.ends_with(b"xxx\r\n"));
    }

    #[test]
    fn relaxed_header_lowercases_the_name_unfolds_and_trims_the_value() {
        let mut out = Vec::new();
        relaxed_header(b"SubJect", b"  a \t b  \r\n\t c  ", &mut out);
        assert_eq!(out, b"subject:a b c");
        out.clear();
        relaxed_header(b"Cc", b"", &mut out);
        assert_eq!(out, b"cc:");
        out.clear();
        relaxed_header(b"X", b" \r\n \t", &mut out);
        assert_eq!(out, b"x:");
        out.clear();
        relaxed_header(b"X", b"a\rb", &mut out);
        assert_eq!(out, b"x:a\rb", "a bare CR is content");
    }
}
