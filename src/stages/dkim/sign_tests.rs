//! Tests of `sign.rs` that need no outside verifier: RFC 8463's Ed25519 example
//! reproduced byte for byte, which fields `h=` lists and in what order they are hashed,
//! the signature field's tags and folding, dual signing, and the refusals.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::canon;
use super::fields;
use super::sign::{Options, Selected, SignError, select, sign};
use super::test_keys::{self, Kind, loaded};

/// RFC 8463 Appendix A.3: the signed message, its two signatures first.
const RFC_8463_MESSAGE: &[u8] = b"DKIM-Signature: v=1; a=ed25519-sha256; c=relaxed/relaxed;\r\n \
d=football.example.com; i=@football.example.com;\r\n \
q=dns/txt; s=brisbane; t=1528637909; h=from : to :\r\n \
subject : date : message-id : from : subject : date;\r\n \
bh=2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8=;\r\n \
b=/gCrinpcQOoIfuHNQIbq4pgh9kyIK3AQUdt9OdqQehSwhEIug4D11Bus\r\n \
Fa3bT3FY5OsU7ZbnKELq+eXdp1Q1Dw==\r\n\
DKIM-Signature: v=1; a=rsa-sha256; c=relaxed/relaxed;\r\n \
d=football.example.com; i=@football.example.com;\r\n \
q=dns/txt; s=test; t=1528637909; h=from : to : subject :\r\n \
date : message-id : from : subject : date;\r\n \
bh=2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8=;\r\n \
b=F45dVWDfMbQDGHJFlXUNB2HKfbCeLRyhDXgFpEL8GwpsRe0IeIixNTe3\r\n \
DhCVlUrSjV4BwcVcOF6+FF3Zo9Rpo1tFOeS9mPYQTnGdaSGsgeefOsk2Jz\r\n \
dA+L10TeYt9BgDfQNZtKdN1WO//KgIqXP7OdEFE4LjFYNcUxZQ4FADY+8=\r\n\
From: Joe SixPack <joe@football.example.com>\r\n\
To: Suzie Q <suzie@shopping.example.net>\r\n\
Subject: Is dinner ready?\r\n\
Date: Fri, 11 Jul 2003 21:00:37 -0700 (PDT)\r\n\
Message-ID: <20030712040037.46341.5F8J@football.example.com>\r\n\
\r\n\
Hi.\r\n\
\r\n\
We lost the game.  Are you hungry yet?\r\n\
\r\n\
Joe.\r\n";

/// The RFC example's signing time.
fn rfc_time() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_528_637_909)
}

/// The options of the RFC example: five names, three oversigned.
fn rfc_options() -> Options {
    Options {
        headers: ["from", "to", "subject", "date", "message-id"]
            .map(String::from)
            .to_vec(),
        oversign: ["from", "subject", "date"].map(String::from).to_vec(),
        expire: None,
    }
}

/// A signature field with its folding removed, as text.
fn unfold(field: &[u8]) -> String {
    String::from_utf8_lossy(field)
        .trim_end_matches("\r\n")
        .replace("\r\n ", " ")
}

/// The tag names of an unfolded signature field, in order.
fn tag_names(unfolded: &str) -> Vec<String> {
    let value = unfolded.strip_prefix("DKIM-Signature:").unwrap();
    value
        .split(';')
        .filter_map(|t| t.split_once('=').map(|(n, _)| n.trim().to_string()))
        .collect()
}

/// A tag's value in an unfolded signature field.
fn tag(unfolded: &str, name: &str) -> String {
    let value = unfolded.strip_prefix("DKIM-Signature:").unwrap();
    value
        .split(';')
        .filter_map(|t| t.split_once('='))
        .find(|(n, _)| n.trim() == name)
        .map(|(_, v)| v.split_whitespace().collect())
        .unwrap_or_default()
}

#[test]
fn rfc_8463_ed25519_example_is_reproduced_byte_for_byte() {
    let (_dir, table) = loaded(
        &[("brisbane.pem", &test_keys::rfc8463_ed25519())],
        "football.example.com brisbane ed25519-sha256 brisbane.pem\n",
    );
    let key = &table.entries()[0];
    assert_eq!(
        key.dns_record(),
        (
            "brisbane._domainkey.football.example.com".to_string(),
            "v=DKIM1; k=ed25519; p=11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=".to_string()
        )
    );
    let rendered = fields::split(RFC_8463_MESSAGE, b"");
    assert_eq!(
        STANDARD.encode(canon::body_hash(&rendered.body)),
        "2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8="
    );
    // The RFC's own field with its b= value removed, canonicalized: the rest of what
    // its signature covers.
    let field = fields::fields(rendered.header).next().unwrap();
    let b_at = field.raw.windows(5).position(|w| w == b"\r\n b=").unwrap() + 5;
    let mut data = select(rendered.header, &rfc_options()).canonical;
    canon::relaxed_header(b"DKIM-Signature", &field.value[..b_at - 15], &mut data);
    assert!(data.ends_with(b"date; bh=2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8=; b="));
    let b = STANDARD.encode(key.signature(&data).unwrap());
    assert_eq!(
        b,
        "/gCrinpcQOoIfuHNQIbq4pgh9kyIK3AQUdt9OdqQehSwhEIug4D11BusFa3bT3FY5OsU7ZbnKELq+eXdp1Q1Dw=="
    );
    // Signed here, the same message gets the RFC's body hash and names the same fields.
    let headers_only = &rendered.header[rendered
        .header
        .windows(6)
        .position(|w| w == b"From: ")
        .unwrap()..];
    let ours = sign(
        headers_only,
        rendered.body[0],
        &[key],
        &rfc_options(),
        rfc_time(),
    )
    .unwrap();
    let ours = unfold(&ours);
    assert_eq!(
        tag(&ours, "bh"),
        "2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8="
    );
    assert_eq!(
        tag(&ours, "h"),
        "from:from:to:subject:subject:date:date:message-id"
    );
    assert_eq!(tag(&ours, "t"), "1528637909");
}

#[test]
fn h_lists_each_present_instance_and_each_oversigned_name_once_more_bottom_up() {
    let section = b"From: a@x\r\nTo: b@y\r\nTo: c@y\r\nSubject: s\r\nX-Other: o\r\n\
        List-Id: <l>\r\nLIST-Unsubscribe: <u>\r\nList-Id: <l2>\r\n";
    let Selected { names, canonical } = select(section, &Options::default());
    assert_eq!(
        names,
        [
            "from",
            "from",
            "subject",
            "subject",
            "date",
            "to",
            "to",
            "to",
            "list-id",
            "list-id",
            "list-unsubscribe"
        ]
    );
    assert_eq!(
        String::from_utf8_lossy(&canonical),
        "from:a@x\r\nsubject:s\r\nto:c@y\r\nto:b@y\r\nlist-id:<l2>\r\nlist-id:<l>\r\n\
         list-unsubscribe:<u>\r\n"
    );
}

#[test]
fn fields_with_a_nul_or_without_a_colon_are_never_signed_nor_counted() {
    let section =
        b"From: a@x\r\nSubject: bad\0\r\nSubject no colon\r\nSubject: good\r\nTo\0: t\r\n";
    let s = select(section, &Options::default());
    assert_eq!(
        s.names,
        ["from", "from", "subject", "subject", "date", "to"]
    );
    assert_eq!(s.canonical, b"from:a@x\r\nsubject:good\r\n");
}

#[test]
fn from_is_always_listed_and_names_that_are_no_field_names_are_left_out() {
    let options = Options {
        headers: ["Subject", "x;y", "", "*", "bad name", "X-*"]
            .map(String::from)
            .to_vec(),
        oversign: vec![],
        expire: None,
    };
    let s = select(b"Subject: s\r\nX-A: 1\r\nx-b: 2\r\nX-A: 3\r\n", &options);
    assert_eq!(s.names, ["from", "subject", "x-a", "x-a", "x-b"]);
    assert_eq!(s.canonical, b"subject:s\r\nx-a:3\r\nx-a:1\r\nx-b:2\r\n");
    let s = select(b"From: f@x\r\n", &options);
    assert_eq!(s.names, ["from"]);
    assert_eq!(s.canonical, b"from:f@x\r\n");
}

#[test]
fn the_signature_field_has_exactly_its_tags_folded_at_78_columns() {
    let (_dir, table) = loaded(
        &[("k.pem", &test_keys::rfc8463_ed25519())],
        "Example.COM sel ed25519-sha256 k.pem\n",
    );
    let mut headers = b"From: a@example.com\r\nSubject: s\r\n".to_vec();
    for i in 0..40 {
        headers.extend_from_slice(format!("List-Header-Number-{i}: v\r\n").as_bytes());
    }
    let options = Options {
        expire: Some(Duration::from_millis(86_400_001)),
        ..Options::default()
    };
    let field = sign(
        &headers,
        b"body\r\n",
        &[&table.entries()[0]],
        &options,
        rfc_time(),
    )
    .unwrap();
    assert!(field.ends_with(b"\r\n") && !field.ends_with(b"\r\n\r\n"));
    let text = String::from_utf8(field.clone()).unwrap();
    let lines: Vec<&str> = text.trim_end_matches("\r\n").split("\r\n").collect();
    assert!(lines.len() > 10, "{text}");
    for (i, line) in lines.iter().enumerate() {
        assert!(
            line.len() <= 78,
            "line {i} is {} long: {line:?}",
            line.len()
        );
        assert_eq!(i > 0, line.starts_with(' '), "{line:?}");
        assert!(!line.contains('\n') && !line.contains('\r'));
    }
    let unfolded = unfold(&field);
    assert!(
        unfolded.starts_with("DKIM-Signature: v=1; a=ed25519-sha256; c=relaxed/relaxed; d=example.com; s=sel; t=1528637909; x=1528724310; h=from:"),
        "{unfolded}"
    );
    assert!(
        tag(&unfolded, "h").starts_with(
            "from:from:subject:subject:date:to:list-header-number-0:list-header-number-1:"
        ),
        "{unfolded}"
    );
    assert_eq!(
        tag_names(&unfolded),
        ["v", "a", "c", "d", "s", "t", "x", "h", "bh", "b"]
    );
    assert_eq!(tag(&unfolded, "h").split(':').count(), 46);
    assert_eq!(STANDARD.decode(tag(&unfolded, "b")).unwrap().len(), 64);
    assert_eq!(STANDARD.decode(tag(&unfolded, "bh")).unwrap().len(), 32);
    let without_x = sign(
        &headers,
        b"",
        &[&table.entries()[0]],
        &Options::default(),
        rfc_time(),
    )
    .unwrap();
    assert_eq!(
        tag_names(&unfold(&without_x)),
        ["v", "a", "c", "d", "s", "t", "h", "bh", "b"]
    );
    assert_eq!(
        tag(&unfold(&without_x), "bh"),
        "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="
    );
}

#[test]
fn two_keys_give_two_fields_in_key_order_each_signed_alone() {
    let (_dir, table) = loaded(
        &[
            ("ed.pem", &test_keys::rfc8463_ed25519()),
            ("rsa.pem", test_keys::pem(Kind::Rsa2048)),
        ],
        "example.com ed ed25519-sha256 ed.pem\nexample.com rsa rsa-sha256 rsa.pem\n",
    );
    let keys = table.keys_for("example.com", false);
    assert_eq!(keys.len(), 2);
    let headers = b"From: a@example.com\r\nSubject: two\r\n\r\n";
    let body = b"dual\r\n";
    let options = Options::default();
    let both = sign(headers, body, &keys, &options, rfc_time()).unwrap();
    let rsa_first = sign(headers, body, &[keys[1], keys[0]], &options, rfc_time()).unwrap();
    let ed = sign(headers, body, &keys[..1], &options, rfc_time()).unwrap();
    let rsa = sign(headers, body, &keys[1..], &options, rfc_time()).unwrap();
    // Both algorithms are deterministic: a field signed beside another is the field
    // signed alone.
    assert_eq!(both, [ed.clone(), rsa.clone()].concat());
    assert_eq!(rsa_first, [rsa.clone(), ed].concat());
    let rsa = unfold(&rsa);
    assert!(rsa.contains(" a=rsa-sha256;") && rsa.contains(" s=rsa;"));
    assert_eq!(STANDARD.decode(tag(&rsa, "b")).unwrap().len(), 256);
}

#[test]
fn signing_needs_a_key_and_a_time_after_1970() {
    let (_dir, table) = loaded(
        &[("k.pem", &test_keys::rfc8463_ed25519())],
        "example.com s ed25519-sha256 k.pem\n",
    );
    let options = Options::default();
    assert_eq!(
        sign(b"From: a@example.com\r\n", b"", &[], &options, rfc_time()),
        Err(SignError::NoKeys)
    );
    let before = UNIX_EPOCH - Duration::from_secs(1);
    let e = sign(
        b"From: a@example.com\r\n",
        b"",
        &[&table.entries()[0]],
        &options,
        before,
    );
    assert_eq!(e, Err(SignError::ClockBeforeEpoch));
    assert_eq!(SignError::NoKeys.to_string(), "no key to sign with");
}

#[test]
fn header_names_are_read_as_headers_writes_them() {
    assert_eq!(
        Options::parse_names("From, Subject:DATE  list-*\tX-A,from").unwrap(),
        ["from", "subject", "date", "list-*", "x-a"]
    );
    for bad in ["", " , ", "*", "a;b", "é", "x\u{7f}"] {
        assert!(Options::parse_names(bad).is_err(), "{bad:?}");
    }
    let e = Options::parse_names("from a;b").unwrap_err();
    assert!(e.contains("\"a;b\""), "{e}");
}
