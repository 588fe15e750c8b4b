//! The arguments of `MAIL FROM`, `RCPT TO` and `XFORWARD` (RFC 5321 §4.1.1 and RFC 5321 §4.1.2;
//! RFC 1870 SIZE, RFC 6152 8BITMIME, RFC 6531 SMTPUTF8, RFC 3461 DSN; Postfix's
//! XFORWARD), and the `state.dsn` object the bounce stage reads (§13.2).
//!
//! Pure: a command's argument text in, the parsed path and parameters or the reply that
//! refuses them out. Called by `session.rs`; it knows nothing of sockets or the
//! database. Addresses are judged by [`crate::mailbox`], the one rule of the system.

use serde_json::{Map, Value, json};

use super::reply::Reply;
use crate::mailbox;

/// `BODY=` of `MAIL FROM`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// `7BIT`, or none given.
    SevenBit,
    /// `8BITMIME`.
    EightBitMime,
}

/// `RET=` of `MAIL FROM` (RFC 3461).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ret {
    /// `FULL`: the whole message in a report.
    Full,
    /// `HDRS`: its header block only.
    Hdrs,
}

/// `MAIL FROM:<path> params`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MailFrom {
    /// The sender; empty for the null sender `<>`.
    pub address: String,
    /// `SIZE=`: the client's estimate of the message's size.
    pub size: Option<u64>,
    /// `BODY=`.
    pub body: Body,
    /// `SMTPUTF8`: the transaction may use UTF-8 addresses and header fields.
    pub smtputf8: bool,
    /// `RET=`.
    pub ret: Option<Ret>,
    /// `ENVID=`, xtext decoded.
    pub envid: Option<String>,
}

/// `RCPT TO:<path> params`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RcptTo {
    /// The recipient.
    pub address: String,
    /// `NOTIFY=`: `NEVER`, or a comma list of `SUCCESS`, `FAILURE`, `DELAY`, upper-cased.
    pub notify: Option<String>,
    /// `ORCPT=`: `addr-type;address`, the address xtext decoded.
    pub orcpt: Option<String>,
}

/// Splits `<path> params` (after `FROM:` or `TO:`): the path without its brackets and
/// the parameters. A space after the colon is tolerated, as most servers do.
fn split_path(args: &str) -> Result<(&str, &str), Reply> {
    let args = args.trim_start();
    let Some(rest) = args.strip_prefix('<') else {
        return Err(Reply::new(
            501,
            "5.5.4",
            "Syntax: the address must be in <>",
        ));
    };
    // The path ends at the first '>' outside a quoted local part.
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in rest.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '>' if !quoted => {
                let params = &rest[i + 1..];
                if !params.is_empty() && !params.starts_with(' ') {
                    return Err(Reply::new(
                        501,
                        "5.5.4",
                        "Syntax: a space must follow the address",
                    ));
                }
                return Ok((&rest[..i], params.trim()));
            }
            _ => {}
        }
    }
    Err(Reply::new(
        501,
        "5.5.4",
        "Syntax: the address has no closing >",
    ))
}

/// A path's address without a source route (`@a,@b:user@host`, RFC 5321 Appendix C:
/// accepted and ignored).
fn without_route(path: &str) -> &str {
    match path.strip_prefix('@') {
        Some(_) => path.split_once(':').map_or(path, |(_, a)| a),
        None => path,
    }
}

/// The parameters `KEY=VALUE` or `KEY`, keys upper-cased.
fn parameters(text: &str) -> Vec<(String, Option<&str>)> {
    text.split(' ')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_ascii_uppercase(), Some(v)),
            None => (p.to_ascii_uppercase(), None),
        })
        .collect()
}

/// Decodes xtext (RFC 3461 §4): `+XX` is the byte of hex XX; any other character is
/// itself. Returns `None` when the text is not xtext or decodes to something not UTF-8
/// or holding a control character (a NUL, a line break): no value a client encodes
/// may reach a message's state, a log or a header so.
pub fn xtext_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'+' {
            let hex = text.get(i + 1..i + 3)?;
            if !hex
                .bytes()
                .all(|h| h.is_ascii_digit() || (b'A'..=b'F').contains(&h))
            {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if (33..=126).contains(&b) && b != b'=' {
            out.push(b);
            i += 1;
        } else {
            return None;
        }
    }
    String::from_utf8(out)
        .ok()
        .filter(|s| !s.chars().any(char::is_control))
}

/// Whether an address needs SMTPUTF8 (it has a character beyond ASCII).
fn needs_utf8(address: &str) -> bool {
    !address.is_ascii()
}

/// Judges an address of a path: a mailbox, and ASCII unless the transaction said
/// SMTPUTF8 (RFC 6531 §3.4: 553 5.6.7 otherwise).
fn check_address(
    address: &str,
    smtputf8: bool,
    role: &str,
    code: &'static str,
) -> Result<(), Reply> {
    mailbox::check(address).map_err(|why| {
        Reply::new(
            553,
            code,
            format!(
                "Bad {role} address syntax: it {}",
                crate::escape::Visible(&why)
            ),
        )
    })?;
    if needs_utf8(address) && !smtputf8 {
        return Err(Reply::new(
            553,
            "5.6.7",
            format!("The {role} address is UTF-8: MAIL FROM must say SMTPUTF8"),
        ));
    }
    Ok(())
}

/// Parses the argument of `MAIL FROM:`; `max_size` is the largest message accepted
/// (a larger `SIZE=` is refused at once with 552).
pub fn mail_from(args: &str, max_size: u64) -> Result<MailFrom, Reply> {
    let (path, params) = split_path(args)?;
    let mut mail = MailFrom {
        address: without_route(path).to_string(),
        size: None,
        body: Body::SevenBit,
        smtputf8: false,
        ret: None,
        envid: None,
    };
    for (key, value) in parameters(params) {
        let bad = |what: &str| Reply::new(501, "5.5.4", format!("Bad {key} parameter: {what}"));
        match (key.as_str(), value) {
            ("SIZE", Some(v)) => {
                let size: u64 = v.parse().map_err(|_| bad("not a number"))?;
                if size > max_size {
                    return Err(Reply::new(
                        552,
                        "5.3.4",
                        format!("Message size exceeds the limit of {max_size} bytes"),
                    ));
                }
                mail.size = Some(size);
            }
            ("BODY", Some(v)) if v.eq_ignore_ascii_case("7BIT") => mail.body = Body::SevenBit,
            ("BODY", Some(v)) if v.eq_ignore_ascii_case("8BITMIME") => {
                mail.body = Body::EightBitMime
            }
            ("BODY", _) => return Err(bad("7BIT or 8BITMIME")),
            ("SMTPUTF8", None) => mail.smtputf8 = true,
            ("RET", Some(v)) if v.eq_ignore_ascii_case("FULL") => mail.ret = Some(Ret::Full),
            ("RET", Some(v)) if v.eq_ignore_ascii_case("HDRS") => mail.ret = Some(Ret::Hdrs),
            ("RET", _) => return Err(bad("FULL or HDRS")),
            ("ENVID", Some(v)) => {
                let id = xtext_decode(v).filter(|i| i.len() <= 100);
                mail.envid = Some(id.ok_or_else(|| bad("not xtext of at most 100 characters"))?);
            }
            // Postfix sends AUTH=<> and friends; an empty AUTH is no login (RFC 4954).
            ("AUTH", Some(_)) => {}
            _ => {
                return Err(Reply::new(
                    555,
                    "5.5.4",
                    format!("Unsupported MAIL FROM parameter {key}"),
                ));
            }
        }
    }
    if !mail.address.is_empty() {
        check_address(&mail.address, mail.smtputf8, "sender", "5.1.7")?;
    }
    Ok(mail)
}

/// Parses the argument of `RCPT TO:` in a transaction that said (or did not say)
/// SMTPUTF8.
pub fn rcpt_to(args: &str, smtputf8: bool) -> Result<RcptTo, Reply> {
    let (path, params) = split_path(args)?;
    let mut rcpt = RcptTo {
        address: without_route(path).to_string(),
        notify: None,
        orcpt: None,
    };
    for (key, value) in parameters(params) {
        let bad = |what: &str| Reply::new(501, "5.5.4", format!("Bad {key} parameter: {what}"));
        match (key.as_str(), value) {
            ("NOTIFY", Some(v)) => {
                let v = v.to_ascii_uppercase();
                let words: Vec<&str> = v.split(',').collect();
                let ok = if words == ["NEVER"] {
                    true
                } else {
                    !words.is_empty()
                        && words
                            .iter()
                            .all(|w| ["SUCCESS", "FAILURE", "DELAY"].contains(w))
                };
                if !ok {
                    return Err(bad("NEVER, or SUCCESS, FAILURE and DELAY joined by commas"));
                }
                rcpt.notify = Some(v);
            }
            ("ORCPT", Some(v)) => {
                let (kind, text) = v.split_once(';').ok_or_else(|| bad("addr-type;xtext"))?;
                let address = xtext_decode(text)
                    .filter(|a| !a.is_empty() && a.len() <= 500)
                    .ok_or_else(|| bad("the address is not xtext"))?;
                if !kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') || kind.is_empty() {
                    return Err(bad("the address type is not an atom"));
                }
                rcpt.orcpt = Some(format!("{};{address}", kind.to_ascii_lowercase()));
            }
            _ => {
                return Err(Reply::new(
                    555,
                    "5.5.4",
                    format!("Unsupported RCPT TO parameter {key}"),
                ));
            }
        }
    }
    check_address(&rcpt.address, smtputf8, "recipient", "5.1.3")?;
    Ok(rcpt)
}

/// The attributes of Postfix's `XFORWARD` (NAME, ADDR, PORT, PROTO, HELO, IDENT,
/// SOURCE, LOGIN): each value xtext decoded, `None` for `[UNAVAILABLE]` and
/// `[TEMPUNAVAIL]`.
pub fn xforward(args: &str) -> Result<Vec<(String, Option<String>)>, Reply> {
    let mut out = Vec::new();
    for (key, value) in parameters(args) {
        let Some(value) = value else {
            return Err(Reply::new(
                501,
                "5.5.4",
                format!("Bad XFORWARD attribute {key}"),
            ));
        };
        if ![
            "NAME", "ADDR", "PORT", "PROTO", "HELO", "IDENT", "SOURCE", "LOGIN",
        ]
        .contains(&key.as_str())
        {
            return Err(Reply::new(
                501,
                "5.5.4",
                format!("Bad XFORWARD attribute {key}"),
            ));
        }
        let value = match value {
            "[UNAVAILABLE]" | "[TEMPUNAVAIL]" => None,
            v => Some(
                xtext_decode(v)
                    .ok_or_else(|| Reply::new(501, "5.5.4", format!("Bad XFORWARD {key} value")))?,
            ),
        };
        out.push((key, value));
    }
    if out.is_empty() {
        return Err(Reply::new(
            501,
            "5.5.4",
            "Syntax: XFORWARD attribute=value ...",
        ));
    }
    Ok(out)
}

/// The client address of an `XFORWARD ADDR=` value: an IPv4 or IPv6 address (with or
/// without Postfix's `IPv6:` prefix).
pub fn forwarded_address(value: &str) -> Option<std::net::IpAddr> {
    let v = value
        .strip_prefix("IPv6:")
        .or_else(|| value.strip_prefix("ipv6:"))
        .unwrap_or(value);
    v.parse().ok()
}

/// The `state.dsn` object of a message (§13.2): `ret`, `envid`, and per recipient
/// its `notify` and `orcpt`, each only when given; `None` when nothing was given.
pub fn dsn_state(mail: &MailFrom, rcpts: &[RcptTo]) -> Option<Value> {
    let mut dsn = Map::new();
    match mail.ret {
        Some(Ret::Full) => {
            dsn.insert("ret".into(), json!("FULL"));
        }
        Some(Ret::Hdrs) => {
            dsn.insert("ret".into(), json!("HDRS"));
        }
        None => {}
    }
    if let Some(envid) = &mail.envid {
        dsn.insert("envid".into(), json!(envid));
    }
    let mut per = Map::new();
    for r in rcpts {
        let mut entry = Map::new();
        if let Some(n) = &r.notify {
            entry.insert("notify".into(), json!(n));
        }
        if let Some(o) = &r.orcpt {
            entry.insert("orcpt".into(), json!(o));
        }
        if !entry.is_empty() {
            per.insert(r.address.clone(), Value::Object(entry));
        }
    }
    if !per.is_empty() {
        dsn.insert("rcpt".into(), Value::Object(per));
    }
    (!dsn.is_empty()).then_some(Value::Object(dsn))
}

/// `arg` after a keyword such as `FROM:`, matched without regard to case.
pub fn strip_keyword<'a>(arg: &'a str, keyword: &str) -> Option<&'a str> {
    let head = arg.get(..keyword.len())?;
    head.eq_ignore_ascii_case(keyword)
        .then(|| &arg[keyword.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_with_every_parameter() {
        let m = mail_from(
            "<a@x.example> SIZE=4096 BODY=8BITMIME SMTPUTF8 RET=HDRS ENVID=E1+2Bx",
            10_000,
        )
        .unwrap();
        assert_eq!(m.address, "a@x.example");
        assert_eq!(m.size, Some(4096));
        assert_eq!(m.body, Body::EightBitMime);
        assert!(m.smtputf8);
        assert_eq!(m.ret, Some(Ret::Hdrs));
        assert_eq!(m.envid.as_deref(), Some("E1+x"));
        let null = mail_from("<>", 10).unwrap();
        assert_eq!(null.address, "");
        assert_eq!(
            mail_from(" <a@x.example>", 10).unwrap().address,
            "a@x.example"
        );
        assert_eq!(
            mail_from("<@r1,@r2:a@x.example>", 10).unwrap().address,
            "a@x.example"
        );
    }

    #[test]
    fn a_bad_sender_is_refused_with_the_right_reply() {
        for (args, code, enhanced) in [
            ("a@x.example", 501, "5.5.4"),
            ("<a@x.example", 501, "5.5.4"),
            ("<a@x.example>SIZE=1", 501, "5.5.4"),
            ("<a@x.example> SIZE=lots", 501, "5.5.4"),
            ("<a@x.example> SIZE=20000", 552, "5.3.4"),
            ("<a@x.example> BODY=BINARYMIME", 501, "5.5.4"),
            ("<a@x.example> FROB=1", 555, "5.5.4"),
            ("<a@x>, <evil@y>", 501, "5.5.4"),
            ("<a\u{202e}@x.example>", 553, "5.1.7"),
            ("<jörg@x.example>", 553, "5.6.7"),
            ("<root>", 553, "5.1.7"),
        ] {
            let r = mail_from(args, 10_000).unwrap_err();
            assert_eq!((r.code, r.enhanced), (code, enhanced), "{args}: {r:?}");
        }
        assert!(mail_from("<jörg@x.example> SMTPUTF8", 10).is_ok());
    }

    #[test]
    fn a_recipient_with_dsn_parameters() {
        let r = rcpt_to(
            "<r@y.example> NOTIFY=success,failure ORCPT=rfc822;x+40y.example",
            false,
        )
        .unwrap();
        assert_eq!(r.notify.as_deref(), Some("SUCCESS,FAILURE"));
        assert_eq!(r.orcpt.as_deref(), Some("rfc822;x@y.example"));
        assert_eq!(
            rcpt_to("<r@y.example> NOTIFY=NEVER", false)
                .unwrap()
                .notify
                .as_deref(),
            Some("NEVER")
        );
        for args in [
            "<r@y.example> NOTIFY=NEVER,FAILURE",
            "<r@y.example> NOTIFY=SOMETIMES",
            "<r@y.example> ORCPT=x+4",
            "<r@y.example> ORCPT=rfc822;a\u{1}b",
        ] {
            assert_eq!(rcpt_to(args, false).unwrap_err().code, 501, "{args}");
        }
        assert_eq!(rcpt_to("<>", false).unwrap_err().code, 553);
        assert_eq!(rcpt_to("<r@y.example> FROB", false).unwrap_err().code, 555);
    }

    #[test]
    fn xtext_decodes_hex_pairs_and_refuses_the_rest() {
        assert_eq!(xtext_decode("a+2Bb+3Dc").as_deref(), Some("a+b=c"));
        assert_eq!(xtext_decode("a b"), None);
        assert_eq!(xtext_decode("a+2b"), None, "hex digits are upper-case");
        assert_eq!(xtext_decode("a+2"), None);
        assert_eq!(xtext_decode("+C3+A9").as_deref(), Some("é"));
        assert_eq!(xtext_decode("+FF"), None, "not UTF-8");
        for control in ["a+00b", "a+0Ab", "a+0D+0Ab", "+7F", "+C2+85"] {
            assert_eq!(xtext_decode(control), None, "{control}");
        }
    }

    #[test]
    fn xforward_attributes_and_the_forwarded_address() {
        let a = xforward("NAME=mx.example ADDR=IPv6:2001:db8::1 LOGIN=[UNAVAILABLE] HELO=h+2Bx")
            .unwrap();
        assert_eq!(
            a,
            [
                ("NAME".to_string(), Some("mx.example".to_string())),
                ("ADDR".to_string(), Some("IPv6:2001:db8::1".to_string())),
                ("LOGIN".to_string(), None),
                ("HELO".to_string(), Some("h+x".to_string())),
            ]
        );
        assert_eq!(
            forwarded_address("IPv6:2001:db8::1"),
            Some("2001:db8::1".parse().unwrap())
        );
        assert_eq!(
            forwarded_address("192.0.2.7"),
            Some("192.0.2.7".parse().unwrap())
        );
        assert_eq!(forwarded_address("mx"), None);
        assert_eq!(xforward("COLOUR=red").unwrap_err().code, 501);
        assert_eq!(xforward("").unwrap_err().code, 501);
    }

    #[test]
    fn the_dsn_state_holds_what_was_given() {
        let mail = mail_from("<a@x.example> RET=HDRS ENVID=E1", 10).unwrap();
        let rcpts = [
            rcpt_to(
                "<r1@y.example> NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;x+40y",
                false,
            )
            .unwrap(),
            rcpt_to("<r2@y.example>", false).unwrap(),
        ];
        assert_eq!(
            dsn_state(&mail, &rcpts),
            Some(
                json!({"ret": "HDRS", "envid": "E1", "rcpt": {"r1@y.example": {
                "notify": "SUCCESS,FAILURE", "orcpt": "rfc822;x@y"}}})
            )
        );
        let plain = mail_from("<a@x.example>", 10).unwrap();
        assert_eq!(dsn_state(&plain, &rcpts[1..]), None);
    }
}
