//! The one judge of an envelope address (RFC 5321 `Mailbox`, with RFC 6531's non-ASCII
//! characters): `pepsi-queue inject` checks its `--from` and `--to` with it
//! (`intake.rs`), and the bounce stage sends a delivery status notification
//! only to a sender it accepts. Pure: a string in, `Ok` or the reason out.
//!
//! The rules, exactly (the schema's SQL check states the same ones):
//! - The empty string is the null sender; [`check_sender`] allows it, [`check`] does not.
//! - Anything else is `Local-part "@" Domain`, at most 256 octets in all (UTF-8 bytes).
//! - Refused anywhere, inside quotes too: the characters of
//!   [`escape::must_escape`](crate::escape::must_escape) — the C0 controls, DEL, the C1
//!   controls U+0080–U+009F, U+061C, U+200B–U+200F, U+202A–U+202E, U+2060–U+2064,
//!   U+2066–U+2069, U+2028, U+2029, U+FEFF and U+FFF9–U+FFFB.
//! - Local-part is a Dot-string or a Quoted-string. A Dot-string is atoms joined by
//!   single dots (no leading, trailing or doubled dot); an atom is one or more of: ASCII
//!   letters and digits, ``!#$%&'*+-/=?^_`{|}~``, and any non-ASCII character. A
//!   Quoted-string is `"`, then any number (none included) of: printable ASCII 32–126
//!   other than `"` and `\`, a non-ASCII character, or a quoted pair `\` followed by a
//!   printable ASCII character 32–126; then `"`. An unquoted local part holds no `@`, so
//!   an address with a second `@` outside quotes is refused.
//! - Domain is labels joined by single dots, each 1–63 octets of ASCII letters, digits,
//!   hyphens and non-ASCII characters, neither starting nor ending with `-` (one label,
//!   `localhost`, is a domain too); or an address literal: `[` four decimal numbers
//!   0–255 of one to three digits joined by dots `]`, or `[IPv6:` one or more hex
//!   digits, `:` and `.` `]` (the tag `IPv6:` spelt exactly so).
//!
//! Every refusal says what is wrong, quoting parts of the address in Rust's escaped
//! form, so a reason can be shown as it is.

use crate::escape;

/// The most octets an address may have (RFC 5321's path limit less its brackets).
pub const MAX_OCTETS: usize = 256;
/// The most octets of one domain label.
pub const MAX_LABEL: usize = 63;

/// The characters of a Dot-string's atoms besides ASCII letters and digits (and any
/// non-ASCII character).
const ATEXT: &str = "!#$%&'*+-/=?^_`{|}~";

/// Checks a mailbox; the empty string is refused.
pub fn check(address: &str) -> Result<(), String> {
    if address.is_empty() {
        return Err("is empty".into());
    }
    if address.len() > MAX_OCTETS {
        return Err(format!(
            "is {} octets long; at most {MAX_OCTETS} are allowed",
            address.len()
        ));
    }
    if let Some(c) = address.chars().find(|&c| escape::must_escape(c)) {
        return Err(format!(
            "contains U+{:04X}, {}",
            c as u32,
            escape::kind(c).unwrap_or("a character not allowed")
        ));
    }
    let (local, domain) = split(address)?;
    check_local(local)?;
    check_domain(domain)
}

/// Checks an envelope sender: the null sender (the empty string) or a mailbox.
pub fn check_sender(address: &str) -> Result<(), String> {
    if address.is_empty() {
        Ok(())
    } else {
        check(address)
    }
}

/// Splits an address at the `@` that ends its local part: after the closing quote of a
/// quoted local part, else the only `@`.
fn split(address: &str) -> Result<(&str, &str), String> {
    if let Some(inner) = address.strip_prefix('"') {
        let mut escaped = false;
        for (i, c) in inner.char_indices() {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    let end = 1 + i + 1;
                    return match address[end..].strip_prefix('@') {
                        Some(domain) => Ok((&address[..end], domain)),
                        None => {
                            Err("the quoted local part is not followed by @ and a domain".into())
                        }
                    };
                }
                _ => {}
            }
        }
        return Err("the quoted local part has no closing double quote".into());
    }
    match address.split_once('@') {
        None => Err("has no @ (an address is local-part@domain)".into()),
        Some((_, rest)) if rest.contains('@') => {
            Err("has more than one @ outside a quoted local part".into())
        }
        Some(parts) => Ok(parts),
    }
}

/// Is this printable ASCII (32–126)?
fn printable_ascii(c: char) -> bool {
    matches!(c, ' '..='~')
}

/// Checks a local part: a Dot-string, or a Quoted-string (with its quotes).
fn check_local(local: &str) -> Result<(), String> {
    if local.is_empty() {
        return Err("the local part before @ is empty".into());
    }
    if let Some(inner) = local.strip_prefix('"') {
        // `split` found the closing quote: it is the last character.
        let inner = &inner[..inner.len() - 1];
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some(q) if printable_ascii(q) => {}
                    Some(q) => {
                        return Err(format!(
                            "a backslash in the quoted local part is followed by {q:?}, \
                             not by printable ASCII"
                        ));
                    }
                    None => {
                        return Err("the quoted local part ends in a backslash".into());
                    }
                },
                c if printable_ascii(c) || !c.is_ascii() => {}
                c => return Err(format!("{c:?} is not allowed in a quoted local part")),
            }
        }
        return Ok(());
    }
    if local.split('.').any(str::is_empty) {
        return Err("the local part has a leading, trailing or doubled dot".into());
    }
    match local
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || c == '.' || ATEXT.contains(c) || !c.is_ascii()))
    {
        Some(c) => Err(format!(
            "{c:?} is not allowed in a local part outside double quotes"
        )),
        None => Ok(()),
    }
}

/// Checks a domain: labels, or an address literal.
fn check_domain(domain: &str) -> Result<(), String> {
    if domain.is_empty() {
        return Err("the domain after @ is empty".into());
    }
    if domain.starts_with('[') {
        return if address_literal(domain) {
            Ok(())
        } else {
            Err(format!(
                "{domain:?} is not an address literal ([192.0.2.1] or [IPv6:2001:db8::1])"
            ))
        };
    }
    for label in domain.split('.') {
        if label.is_empty() {
            return Err(format!(
                "the domain {domain:?} has an empty label (a leading, trailing or doubled dot)"
            ));
        }
        if label.len() > MAX_LABEL {
            return Err(format!(
                "the domain has a label of {} octets; at most {MAX_LABEL} are allowed",
                label.len()
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!(
                "the domain {domain:?} has a label that starts or ends with a hyphen"
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|&c| !(c.is_ascii_alphanumeric() || c == '-' || !c.is_ascii()))
        {
            return Err(format!("{c:?} is not allowed in a domain"));
        }
    }
    Ok(())
}

/// Is this `[d.d.d.d]` (each 0–255, one to three digits) or `[IPv6:…]` (hex digits, `:`
/// and `.`)?
fn address_literal(domain: &str) -> bool {
    let Some(inner) = domain.strip_prefix('[').and_then(|d| d.strip_suffix(']')) else {
        return false;
    };
    if let Some(v6) = inner.strip_prefix("IPv6:") {
        return !v6.is_empty()
            && v6
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.');
    }
    let parts: Vec<&str> = inner.split('.').collect();
    parts.len() == 4
        && parts.iter().all(|p| {
            (1..=3).contains(&p.len())
                && p.bytes().all(|b| b.is_ascii_digit())
                && p.parse::<u16>().is_ok_and(|n| n <= 255)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mailboxes_of_every_form_pass() {
        for good in [
            "a@x",
            "alice@example.org",
            "first.last+tag@sub.x-y.example",
            "postmaster@localhost",
            "!#$%&'*+-/=?^_`{|}~@x.example",
            "jörg@bücher.example",
            "用户@例子.广告",
            "\"a b@c\"@x.example",
            "\"\"@x.example",
            "\"with \\\"quotes\\\" and \\\\\"@x",
            "\"ünï\"@x",
            "u@[192.0.2.1]",
            "u@[0.0.0.0]",
            "u@[255.255.255.255]",
            "u@[IPv6:2001:db8::1]",
            "u@[IPv6:::ffff:192.0.2.1]",
            "a@1.2.3.4",
            "a@x-1.example",
        ] {
            assert_eq!(check(good), Ok(()), "{good:?}");
            assert_eq!(check_sender(good), Ok(()), "{good:?}");
        }
        let label = "d".repeat(MAX_LABEL);
        assert_eq!(check(&format!("a@{label}.example")), Ok(()));
        // 256 octets in all, the limit.
        let longest = format!(
            "{}@{label}.{label}.{}.example",
            "l".repeat(64),
            "e".repeat(55)
        );
        assert_eq!(longest.len(), 256);
        assert_eq!(check(&longest), Ok(()));
        assert!(check(&format!("l{longest}")).is_err(), "257 octets");
    }

    #[test]
    fn the_null_sender_is_a_sender_but_no_mailbox() {
        assert_eq!(check_sender(""), Ok(()));
        assert_eq!(check(""), Err("is empty".into()));
    }

    #[test]
    fn malformed_addresses_are_refused_with_the_reason() {
        for (bad, why) in [
            ("a@x>, <evil@y", "more than one @"),
            ("a@x>,<b@y", "more than one @"),
            ("<a@x>", "'<' is not allowed in a local part"),
            ("a@x>", "'>' is not allowed in a domain"),
            ("root", "has no @"),
            ("a@", "the domain after @ is empty"),
            ("@x", "the local part before @ is empty"),
            ("a b@x", "' ' is not allowed in a local part"),
            ("a,b@x", "',' is not allowed"),
            ("a..b@x", "doubled dot"),
            (".a@x", "leading"),
            ("a.@x", "trailing"),
            ("a@x..y", "empty label"),
            ("a@x.", "empty label"),
            ("a@.x", "empty label"),
            ("a@-x.example", "hyphen"),
            ("a@x-.example", "hyphen"),
            ("a@x_y.example", "'_' is not allowed in a domain"),
            ("a@x y", "' ' is not allowed in a domain"),
            ("a@[]", "not an address literal"),
            ("a@[256.1.1.1]", "not an address literal"),
            ("a@[1.2.3]", "not an address literal"),
            ("a@[1.2.3.4.5]", "not an address literal"),
            ("a@[1.2.3.0004]", "not an address literal"),
            ("a@[1.2.3.4", "not an address literal"),
            ("a@[IPv6:]", "not an address literal"),
            ("a@[IPv6:fe80::1%eth0]", "not an address literal"),
            ("a@[ipv6:::1]", "not an address literal"),
            ("a@[x.example]", "not an address literal"),
            ("\"open@x", "no closing double quote"),
            ("\"a\"b@x", "not followed by @"),
            ("\"a\\\"@x", "no closing double quote"),
            ("\"a\\é\"@x", "followed by 'é'"),
            ("\"a\"@", "the domain after @ is empty"),
        ] {
            let err = check(bad).expect_err(bad);
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        let label = "d".repeat(MAX_LABEL + 1);
        let err = check(&format!("a@{label}.example")).unwrap_err();
        assert!(err.contains("label of 64 octets"), "{err}");
    }

    #[test]
    fn controls_and_invisible_characters_are_refused_even_in_quotes() {
        for (bad, why) in [
            ("a@x\r\nRCPT TO:<b@y>", "U+000D, a control character"),
            ("a\n@x", "U+000A, a control character"),
            ("a\0@x", "U+0000, a control character"),
            ("\"a\tb\"@x", "U+0009, a control character"),
            ("\"a\u{1b}[31m\"@x", "U+001B, a control character"),
            ("a\u{7f}@x", "U+007F, a control character"),
            ("a\u{85}@x", "U+0085, a control character"),
            (
                "a\u{202e}gpj.exe@x",
                "U+202E, a bidirectional control character",
            ),
            (
                "\"a\u{2066}\"@x",
                "U+2066, a bidirectional control character",
            ),
            ("a@x\u{61c}y", "U+061C, a bidirectional control character"),
            ("a@x\u{2028}y", "U+2028, a line or paragraph separator"),
            ("a\u{2029}@x", "U+2029, a line or paragraph separator"),
            ("a\u{200b}@x", "U+200B, an invisible formatting character"),
            ("a@\u{feff}x", "U+FEFF, an invisible formatting character"),
            ("a\u{2060}@x", "U+2060, an invisible formatting character"),
            ("a\u{fffb}@x", "U+FFFB, an interlinear annotation character"),
        ] {
            let err = check(bad).expect_err(bad);
            assert_eq!(err, format!("contains {why}"), "{bad:?}");
        }
    }

    #[test]
    fn an_address_is_at_most_256_octets() {
        let long = format!("{}@x.example", "a".repeat(300));
        assert_eq!(
            check(&long),
            Err("is 310 octets long; at most 256 are allowed".into())
        );
        // Octets, not characters: 128 two-octet characters and "@x" are 258.
        let wide = format!("{}@x", "é".repeat(128));
        assert!(check(&wide).unwrap_err().contains("258 octets"));
        let fits = format!("{}@x", "é".repeat(127));
        assert_eq!(check(&fits), Ok(()));
    }
}
