//! Whose domain signs a message: the domain of the one address of its one `From:`
//! field (what DMARC aligns on), or why there is none.
//!
//! Used by the `dkim-sign` stage before it picks keys. The header block is hostile: it
//! is read with the same field splitting as the signer (`fields.rs`, so both see the
//! same `From:`), in one pass over the field's bytes with early exit at a second
//! address; comments nest with a counter, not recursion; encoded words (RFC 2047) in a
//! display name are never decoded, they are atoms like any other, so a malformed one
//! changes nothing. Ambiguity is refused rather than guessed at: two `From:` fields, a
//! group, text after the address, two `@`, a domain literal.

use std::fmt;

use super::fields;

/// Why a message has no signing domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoSigner {
    /// The header section has no `From:` field.
    NoFromField,
    /// It has more than one.
    SeveralFromFields,
    /// The `From:` field holds a NUL byte (a field never signed, see `fields.rs`).
    NulByte,
    /// The `From:` field holds no address.
    NoAddress,
    /// It holds more than one.
    SeveralAddresses,
    /// It is a group (`name: …;`).
    Group,
    /// Its address has no domain.
    NoDomain,
    /// It cannot be parsed; the reason.
    Unparsable(&'static str),
}

impl fmt::Display for NoSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoSigner::NoFromField => f.write_str("no From: field"),
            NoSigner::SeveralFromFields => f.write_str("more than one From: field"),
            NoSigner::NulByte => f.write_str("a NUL byte in From:"),
            NoSigner::NoAddress => f.write_str("not exactly one address in From: (none)"),
            NoSigner::SeveralAddresses => f.write_str("not exactly one address in From:"),
            NoSigner::Group => f.write_str("group syntax in From:"),
            NoSigner::NoDomain => f.write_str("the From: address has no domain"),
            NoSigner::Unparsable(why) => write!(f, "unparsable From: {why}"),
        }
    }
}

impl std::error::Error for NoSigner {}

/// The domain (ASCII lower case) of the message's one `From:` address, or why there is
/// none: no `From:` field or more than one, a `From:` with no address or more than one
/// (a group included), an address without a domain, or one that cannot be parsed. Only
/// the header section counts (up to the first empty line, as a receiver reads it).
pub fn from_domain(header_block: &[u8]) -> Result<String, NoSigner> {
    let section = fields::split(header_block, b"").header;
    let mut from = None;
    for field in fields::fields(section) {
        if field.is("from") {
            if from.is_some() {
                return Err(NoSigner::SeveralFromFields);
            }
            from = Some(field);
        }
    }
    let field = from.ok_or(NoSigner::NoFromField)?;
    if field.raw.contains(&0) {
        return Err(NoSigner::NulByte);
    }
    one_domain(field.value)
}

/// A lexical token of an address list (RFC 5322 §3.2), comments and whitespace skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token<'a> {
    /// An atom (any run of bytes that are not whitespace nor specials; 8-bit included).
    Word(&'a [u8]),
    /// A quoted string.
    Quoted,
    /// A domain literal (`[…]`).
    Literal,
    /// One of `< > , : ; @ . ) ]`.
    Special(u8),
}

/// Splits a field value into tokens.
struct Scanner<'a> {
    /// The field value.
    s: &'a [u8],
    /// Where the next token starts (past the end once the end is reached).
    pos: usize,
}

/// Is this byte one that ends an atom?
fn delimiter(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'\t'
            | b'\r'
            | b'\n'
            | b'('
            | b')'
            | b'"'
            | b'['
            | b']'
            | b'<'
            | b'>'
            | b','
            | b':'
            | b';'
            | b'@'
            | b'.'
    )
}

impl<'a> Scanner<'a> {
    /// The next token; `None` at the end.
    fn next(&mut self) -> Result<Option<Token<'a>>, NoSigner> {
        self.skip_cfws()?;
        let Some(&b) = self.s.get(self.pos) else {
            return Ok(None);
        };
        let token = match b {
            b'"' => {
                self.pos = self.closing(b'"', "an unclosed quoted string")?;
                Token::Quoted
            }
            b'[' => {
                self.pos = self.closing(b']', "an unclosed domain literal")?;
                Token::Literal
            }
            b'<' | b'>' | b',' | b':' | b';' | b'@' | b'.' | b')' | b']' => {
                self.pos += 1;
                Token::Special(b)
            }
            _ => {
                let start = self.pos;
                let rest = &self.s[start..];
                let len = rest
                    .iter()
                    .position(|&c| delimiter(c))
                    .unwrap_or(rest.len());
                self.pos += len;
                Token::Word(&rest[..len])
            }
        };
        Ok(Some(token))
    }

    /// The position after the byte `close` that ends the quoted string or literal that
    /// starts at the current position (a backslash quotes the byte after it).
    fn closing(&self, close: u8, unclosed: &'static str) -> Result<usize, NoSigner> {
        let mut i = self.pos + 1;
        while let Some(&c) = self.s.get(i) {
            match c {
                b'\\' => i += 2,
                _ if c == close => return Ok(i + 1),
                _ => i += 1,
            }
        }
        Err(NoSigner::Unparsable(unclosed))
    }

    /// Skips whitespace, line ends and comments (which nest).
    fn skip_cfws(&mut self) -> Result<(), NoSigner> {
        while let Some(&b) = self.s.get(self.pos) {
            match b {
                b' ' | b'\t' | b'\r' | b'\n' => self.pos += 1,
                b'(' => {
                    let mut depth = 0usize;
                    loop {
                        match self.s.get(self.pos) {
                            None => return Err(NoSigner::Unparsable("an unclosed comment")),
                            Some(b'\\') => self.pos += 2,
                            Some(b'(') => {
                                depth += 1;
                                self.pos += 1;
                            }
                            Some(b')') => {
                                depth -= 1;
                                self.pos += 1;
                                if depth == 0 {
                                    break;
                                }
                            }
                            Some(_) => self.pos += 1,
                        }
                    }
                }
                _ => break,
            }
        }
        Ok(())
    }
}

/// Where the parse of one list element is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing of the element yet.
    Start,
    /// Words: a display name, or the local part of a bare address.
    Phrase,
    /// After the `@` of a bare address: its domain.
    Domain,
    /// Inside `<…>`, before an `@` (a local part, or a source route).
    Angle,
    /// Inside `<…>`, after an `@`.
    AngleDomain,
    /// After the `>`.
    Closed,
}

/// The domain of the one mailbox of a `From:` value.
fn one_domain(value: &[u8]) -> Result<String, NoSigner> {
    let mut scanner = Scanner { s: value, pos: 0 };
    let mut phase = Phase::Start;
    let mut domain = Domain::default();
    let mut found: Option<Vec<u8>> = None;
    loop {
        let token = scanner.next()?;
        let element_end = matches!(token, None | Some(Token::Special(b',')));
        if element_end && !matches!(phase, Phase::Angle | Phase::AngleDomain) {
            match phase {
                Phase::Start => {}
                Phase::Phrase => return Err(NoSigner::NoDomain),
                Phase::Domain | Phase::Closed => {
                    if found.is_some() {
                        return Err(NoSigner::SeveralAddresses);
                    }
                    found = Some(domain.finish()?);
                }
                Phase::Angle | Phase::AngleDomain => {}
            }
            phase = Phase::Start;
            if token.is_none() {
                break;
            }
            continue;
        }
        let Some(token) = token else {
            return Err(NoSigner::Unparsable("an unclosed <"));
        };
        if phase == Phase::Start && found.is_some() {
            return Err(NoSigner::SeveralAddresses);
        }
        phase = match (phase, token) {
            (Phase::Start | Phase::Phrase, Token::Word(_) | Token::Quoted) => Phase::Phrase,
            (Phase::Start | Phase::Phrase, Token::Special(b'.')) => Phase::Phrase,
            (Phase::Phrase, Token::Special(b'@')) => {
                domain = Domain::default();
                Phase::Domain
            }
            (Phase::Start | Phase::Phrase, Token::Special(b'<')) => Phase::Angle,
            (Phase::Start | Phase::Phrase, Token::Special(b':')) => return Err(NoSigner::Group),
            (Phase::Angle, Token::Word(_) | Token::Quoted) => Phase::Angle,
            (Phase::Angle, Token::Special(b'.' | b':' | b',')) => Phase::Angle,
            (Phase::Angle, Token::Special(b'@')) => {
                domain = Domain::default();
                Phase::AngleDomain
            }
            (Phase::Angle, Token::Special(b'>')) => return Err(NoSigner::NoDomain),
            // A source route (`<@a,@b:local@domain>`) ends at its colon.
            (Phase::AngleDomain, Token::Special(b':' | b',')) => Phase::Angle,
            (Phase::AngleDomain, Token::Special(b'>')) => {
                if domain.is_empty() {
                    return Err(NoSigner::NoDomain);
                }
                Phase::Closed
            }
            (Phase::Domain | Phase::AngleDomain, t) => {
                domain.take(t)?;
                phase
            }
            (Phase::Closed, _) => return Err(NoSigner::Unparsable("text after the address")),
            (_, Token::Special(b'@')) => return Err(NoSigner::Unparsable("an @ out of place")),
            (_, Token::Literal) => {
                return Err(NoSigner::Unparsable("a domain literal out of place"));
            }
            (_, _) => return Err(NoSigner::Unparsable("a character out of place")),
        };
    }
    let domain = found.ok_or(NoSigner::NoAddress)?;
    let domain =
        String::from_utf8(domain).map_err(|_| NoSigner::Unparsable("a domain not in UTF-8"))?;
    Ok(domain.to_ascii_lowercase())
}

/// A domain being read: atoms and dots, whitespace and comments allowed around dots.
#[derive(Default)]
struct Domain {
    /// The atoms and dots read, joined.
    text: Vec<u8>,
    /// Was the last token an atom (so another atom must not follow without a dot)?
    after_word: bool,
}

impl Domain {
    /// Has nothing of the domain been read?
    fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Takes the next token of the domain.
    fn take(&mut self, token: Token) -> Result<(), NoSigner> {
        match token {
            Token::Word(w) if !self.after_word => {
                self.text.extend_from_slice(w);
                self.after_word = true;
            }
            Token::Special(b'.') if self.after_word => {
                self.text.push(b'.');
                self.after_word = false;
            }
            Token::Literal => {
                return Err(NoSigner::Unparsable(
                    "a domain literal, which no key signs for",
                ));
            }
            Token::Special(b'@') => return Err(NoSigner::Unparsable("two @ in one address")),
            _ => return Err(NoSigner::Unparsable("a malformed domain")),
        }
        Ok(())
    }

    /// The whole domain.
    fn finish(&mut self) -> Result<Vec<u8>, NoSigner> {
        if self.text.is_empty() {
            return Err(NoSigner::NoDomain);
        }
        if !self.after_word {
            return Err(NoSigner::Unparsable("a malformed domain"));
        }
        Ok(std::mem::take(&mut self.text))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// `from_domain` of a header block whose one From: field has this value.
    fn domain_of(from_value: &str) -> Result<String, NoSigner> {
        from_domain(format!("Subject: x\r\nFrom:{from_value}\r\nTo: y@z\r\n").as_bytes())
    }

    /// Runs `f`, which must take less than two seconds (a debug build).
    #[track_caller]
    fn quick<T>(f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        out
    }

    #[test]
    fn the_domain_of_the_one_address_is_found_in_every_address_form() {
        for (value, want) in [
            (" joe@Football.Example.COM", "football.example.com"),
            (
                " Joe SixPack <joe@football.example.com>",
                "football.example.com",
            ),
            (" \"Six, Pack\" <joe@a.example>", "a.example"),
            (" joe@a.example (Joe (the) Six\\) Pack)", "a.example"),
            ("\r\n\t<joe@a.example>", "a.example"),
            (" Joe\r\n <joe\r\n @ a . example >", "a.example"),
            (" \"q@x\"@a.example", "a.example"),
            (" <@route.example,@r2.example:joe@a.example>", "a.example"),
            (" , joe@a.example ,", "a.example"),
            (" Jörg <jörg@bücher.example>", "bücher.example"),
            (" j@a.example.", "a.example."),
        ] {
            let got = domain_of(value);
            if want.ends_with('.') {
                assert!(got.is_err(), "{value:?}: {got:?}");
            } else {
                assert_eq!(got.as_deref(), Ok(want), "{value:?}");
            }
        }
    }

    #[test]
    fn encoded_words_in_the_display_name_even_malformed_ones_leave_the_address_found() {
        for value in [
            " =?utf-8?q?J=C3=B6rg?= <j@a.example>",
            " =?utf-8?B?!!!not base64?= <j@a.example>",
            " =?unknown-charset?Q?x?= <j@a.example>",
            " =?utf-8?q?unterminated <j@a.example>",
            " =?=?= =?utf-8?q?=FF=FE=?= <j@a.example>",
            " =?utf-8?q?J=C3=B6rg?=\r\n =?utf-8?q?_S?= <j@a.example>",
        ] {
            assert_eq!(domain_of(value).as_deref(), Ok("a.example"), "{value:?}");
        }
    }

    #[test]
    fn zero_or_several_from_fields_or_addresses_sign_nothing() {
        assert_eq!(from_domain(b"Subject: x\r\n"), Err(NoSigner::NoFromField));
        assert_eq!(
            from_domain(b"From: a@a.example\r\nFROM: b@b.example\r\n"),
            Err(NoSigner::SeveralFromFields)
        );
        assert_eq!(
            from_domain(b"From: a@a.example\r\nFrom : b@b.example"),
            Err(NoSigner::SeveralFromFields)
        );
        assert_eq!(domain_of(""), Err(NoSigner::NoAddress));
        assert_eq!(domain_of(" (just a comment)"), Err(NoSigner::NoAddress));
        assert_eq!(
            domain_of(" a@a.example, b@b.example"),
            Err(NoSigner::SeveralAddresses)
        );
        assert_eq!(
            domain_of(" Friends: a@a.example, b@b.example;"),
            Err(NoSigner::Group)
        );
        assert_eq!(domain_of(" undisclosed-recipients:;"), Err(NoSigner::Group));
        assert_eq!(
            NoSigner::SeveralAddresses.to_string(),
            "not exactly one address in From:"
        );
    }

    #[test]
    fn a_from_after_the_header_sections_end_is_body_text() {
        assert_eq!(
            from_domain(b"From: a@a.example\r\n\r\nFrom: b@b.example\r\n").as_deref(),
            Ok("a.example")
        );
        assert_eq!(
            from_domain(b"Subject: x\n\nFrom: b@b.example\n"),
            Err(NoSigner::NoFromField)
        );
    }

    #[test]
    fn addresses_without_a_domain_or_with_text_around_them_are_refused() {
        for (value, want) in [
            (" joe", NoSigner::NoDomain),
            (" <joe>", NoSigner::NoDomain),
            (" <>", NoSigner::NoDomain),
            (" joe@", NoSigner::NoDomain),
            (" <joe@>", NoSigner::NoDomain),
            (
                " <j@a.example> trailing",
                NoSigner::Unparsable("text after the address"),
            ),
            (
                " j@a@b.example",
                NoSigner::Unparsable("two @ in one address"),
            ),
            (
                " j@a.example <k@b.example>",
                NoSigner::Unparsable("a malformed domain"),
            ),
            (
                " j@exam ple.com",
                NoSigner::Unparsable("a malformed domain"),
            ),
            (" j@a..example", NoSigner::Unparsable("a malformed domain")),
            (
                " j@[192.0.2.1]",
                NoSigner::Unparsable("a domain literal, which no key signs for"),
            ),
            (" <j@a.example", NoSigner::Unparsable("an unclosed <")),
            (
                " \"open <j@a.example>",
                NoSigner::Unparsable("an unclosed quoted string"),
            ),
            (
                " (open <j@a.example>",
                NoSigner::Unparsable("an unclosed comment"),
            ),
            (" j@a.example)", NoSigner::Unparsable("a malformed domain")),
            (
                " ; j@a.example",
                NoSigner::Unparsable("a character out of place"),
            ),
        ] {
            assert_eq!(domain_of(value), Err(want), "{value:?}");
        }
    }

    #[test]
    fn nul_bytes_anywhere_near_from_are_refused_or_ignored_without_harm() {
        assert_eq!(
            from_domain(b"From: j@a.example\0\r\n"),
            Err(NoSigner::NulByte)
        );
        assert_eq!(
            from_domain(b"From: Jo\0e <j@a.example>\r\n"),
            Err(NoSigner::NulByte)
        );
        // A NUL in a name makes the line no field; the real From: is the one.
        assert_eq!(
            from_domain(b"Fr\0om: x@evil.example\r\nFrom: j@a.example\r\nX: \0\r\n").as_deref(),
            Ok("a.example")
        );
        assert_eq!(from_domain(b"\0\0\0"), Err(NoSigner::NoFromField));
    }

    #[test]
    fn ten_thousand_addresses_answer_not_exactly_one_quickly() {
        let many: Vec<String> = (0..10_000).map(|i| format!("u{i}@d{i}.example")).collect();
        let header = format!("From: {}\r\n", many.join(",\r\n "));
        let got = quick(|| from_domain(header.as_bytes()));
        assert_eq!(got, Err(NoSigner::SeveralAddresses));
        assert_eq!(
            got.unwrap_err().to_string(),
            "not exactly one address in From:"
        );
        let groups = format!("From: g: {};\r\n", many.join(", "));
        assert_eq!(
            quick(|| from_domain(groups.as_bytes())),
            Err(NoSigner::Group)
        );
    }

    #[test]
    fn megabyte_lines_and_deep_comments_are_read_in_bounded_time() {
        let long_local = format!("From: {}@a.example\r\n", "x".repeat(1 << 20));
        assert_eq!(
            quick(|| from_domain(long_local.as_bytes())).as_deref(),
            Ok("a.example")
        );
        let long_subject = format!("Subject: {}\r\nFrom: j@a.example\r\n", "s ".repeat(1 << 19));
        assert_eq!(
            quick(|| from_domain(long_subject.as_bytes())).as_deref(),
            Ok("a.example")
        );
        let deep = format!("From: {}j@a.example\r\n", "(".repeat(1 << 20));
        assert_eq!(
            quick(|| from_domain(deep.as_bytes())),
            Err(NoSigner::Unparsable("an unclosed comment"))
        );
        let nested = format!(
            "From: {}{} j@a.example\r\n",
            "(".repeat(1 << 19),
            ")".repeat(1 << 19)
        );
        assert_eq!(
            quick(|| from_domain(nested.as_bytes())).as_deref(),
            Ok("a.example")
        );
        let no_colon = "X".repeat(1 << 20);
        assert_eq!(
            quick(|| from_domain(no_colon.as_bytes())),
            Err(NoSigner::NoFromField)
        );
    }

    #[test]
    fn a_folded_from_and_a_block_without_its_final_line_end_are_read() {
        assert_eq!(
            from_domain(b"Subject: x\r\nFrom: Joe\r\n\t<j@A.example>").as_deref(),
            Ok("a.example")
        );
        assert_eq!(
            from_domain(b"From: j@a.example").as_deref(),
            Ok("a.example")
        );
        assert_eq!(
            from_domain(b"from:j@a.example\nto: k@b.example\n").as_deref(),
            Ok("a.example")
        );
        assert_eq!(
            from_domain(b"From: \\").unwrap_err(),
            NoSigner::NoDomain,
            "a lone backslash is an atom"
        );
    }
}
