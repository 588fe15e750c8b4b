//! Signatures checked by an independent verifier: Debian's dkimpy (`python3-dkim`, with
//! `python3-nacl` for Ed25519), run as `/usr/bin/python3` on the text the relay would
//! send (`as_sent` of the signed header block and the body), with the keys' DNS records
//! as `dkim-sign` would publish them. Each message is checked signature by signature;
//! the negative controls must fail.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use super::keys::KeyTable;
use super::sign::{Options, sign};
use super::test_keys::{self, Kind, TempDir, loaded};
use crate::stages::relay::transaction::as_sent;

/// The verifier, shared with the integration tests: the message on stdin, the DNS
/// records as a JSON object; a JSON array with one entry per signature, `true` for a
/// pass, else why not.
const VERIFIER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/util/dkim_verify.py");

/// Each signature's result (`true` for a pass) as dkimpy sees it.
#[track_caller]
fn dkimpy(message: &[u8], records: &[(String, String)]) -> Vec<bool> {
    let records: serde_json::Map<String, serde_json::Value> = records
        .iter()
        .map(|(name, text)| (name.clone(), serde_json::Value::String(text.clone())))
        .collect();
    let mut child = Command::new("/usr/bin/python3")
        .arg(VERIFIER)
        .arg(serde_json::Value::Object(records).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run /usr/bin/python3 ({e}): install python3-dkim and python3-nacl")
        });
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(message).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the verifier failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdicts: Vec<serde_json::Value> = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("unexpected verifier output ({e}): {stdout}"));
    eprintln!("dkimpy: {stdout}");
    verdicts
        .iter()
        .map(|v| v == &serde_json::Value::Bool(true))
        .collect()
}

/// Signs with every key of the table; the message as the relay sends it and the DNS
/// records of the keys.
fn signed(
    table: &KeyTable,
    headers: &[u8],
    body: &[u8],
    options: &Options,
) -> (Vec<u8>, Vec<(String, String)>) {
    let keys: Vec<_> = table.entries().iter().collect();
    let fields = sign(headers, body, &keys, options, SystemTime::now()).unwrap();
    let stored = [fields, headers.to_vec()].concat();
    let records = keys.iter().map(|k| k.dns_record()).collect();
    (as_sent(&stored, body), records)
}

/// The `h=` value of the first signature of a message, whitespace removed.
fn h_tag(message: &[u8]) -> String {
    let text = String::from_utf8_lossy(message);
    let start = text.find(" h=").expect("an h= tag") + 3;
    let end = start + text[start..].find(';').expect("the end of h=");
    text[start..end].split_whitespace().collect()
}

/// A table of one key of this kind for example.com.
fn one_key(kind: Kind) -> (TempDir, KeyTable) {
    let algorithm = if kind == Kind::Ed25519 {
        "ed25519-sha256"
    } else {
        "rsa-sha256"
    };
    loaded(
        &[("k.pem", test_keys::pem(kind))],
        &format!("example.com sel {algorithm} k.pem\n"),
    )
}

/// A table of an Ed25519 and an RSA-2048 key for example.com.
fn dual() -> (TempDir, KeyTable) {
    loaded(
        &[
            ("ed.pem", test_keys::pem(Kind::Ed25519)),
            ("rsa.pem", test_keys::pem(Kind::Rsa2048)),
        ],
        "example.com ed ed25519-sha256 ed.pem\nexample.com rsa rsa-sha256 rsa.pem\n",
    )
}

/// The header block of most messages signed here (RFC 8463's, with the blank line).
const HEADERS: &[u8] = b"From: Joe <joe@example.com>\r\nTo: sue@example.net\r\n\
    Subject: dinner\r\nDate: Fri, 11 Jul 2003 21:00:37 -0700\r\n\
    Message-ID: <1@example.com>\r\n\r\n";
/// The body of most messages signed here.
const BODY: &[u8] = b"Hi.\r\n\r\nWe lost the game.  Are you hungry yet?\r\n\r\nJoe.\r\n";

#[test]
fn rsa_2048_signatures_verify_with_pkcs8_and_pkcs1_keys() {
    for kind in [Kind::Rsa2048, Kind::Rsa2048Pkcs1] {
        let (_dir, t) = one_key(kind);
        let (message, records) = signed(&t, HEADERS, BODY, &Options::default());
        assert_eq!(dkimpy(&message, &records), [true], "{kind:?}");
    }
}

#[test]
fn an_rsa_4096_signature_verifies() {
    let (_dir, t) = one_key(Kind::Rsa4096);
    let (message, records) = signed(&t, HEADERS, BODY, &Options::default());
    assert_eq!(dkimpy(&message, &records), [true]);
}

#[test]
fn an_ed25519_signature_verifies() {
    let (_dir, t) = one_key(Kind::Ed25519);
    let (message, records) = signed(&t, HEADERS, BODY, &Options::default());
    assert_eq!(dkimpy(&message, &records), [true]);
}

#[test]
fn both_signatures_of_a_dual_signed_message_verify() {
    let (_dir, t) = dual();
    let (message, records) = signed(&t, HEADERS, BODY, &Options::default());
    assert!(message.starts_with(b"DKIM-Signature: v=1; a=ed25519-sha256;"));
    assert_eq!(dkimpy(&message, &records), [true, true]);
}

#[test]
fn eight_bit_bodies_and_headers_verify() {
    let (_dir, t) = dual();
    let headers = "From: Jörg <j@example.com>\r\nSubject: Grüße\r\nTo: x@example.net\r\n";
    let body = b"caf\xc3\xa9 \xe9\xff\x80 raw octets\r\n\xff\r\n";
    let (message, records) = signed(&t, headers.as_bytes(), body, &Options::default());
    assert!(message.windows(3).any(|w| w == b"\xe9\xff\x80"));
    assert_eq!(dkimpy(&message, &records), [true, true]);
}

#[test]
fn a_100_kb_signed_field_bidi_and_control_characters_and_10000_recipients_in_to_verify() {
    let (_dir, t) = dual();
    let long: String = "x".repeat(100 * 1024);
    let to: String = (0..10_000)
        .map(|i| format!("r{i}@example.net"))
        .collect::<Vec<_>>()
        .join(",\r\n ");
    let headers = format!(
        "From: j@example.com\r\nSubject: \u{202e}evil\u{202c} \x01bell\r\nTo: {to}\r\nReferences: {long}\r\n"
    );
    let body = b"a NUL \0 and a bare CR \r here\r\n";
    let (message, records) = signed(&t, headers.as_bytes(), body, &Options::default());
    assert_eq!(dkimpy(&message, &records), [true, true]);
    let mut changed = message.clone();
    let at = changed.len() - 10;
    changed[at] ^= 1;
    assert_eq!(dkimpy(&changed, &records), [false, false]);
}

#[test]
fn folded_and_odd_header_fields_verify() {
    let (_dir, t) = dual();
    let headers = b"FROM:   Joe   Six\t\tPack <joe@example.com>  \r\n\
        SUBJECT:\tlots   of\t\tspace  \r\n\tfolded  \r\n   twice\r\n\
        To:\r\n  sue@example.net,\r\n\tbob@example.net\r\n\
        Cc:\r\n\
        cc: \r\n\
        Reply-To:x@example.com\r\n\
        X-Unsigned: not on the list\r\n\
        List-Unsubscribe: <mailto:u@example.com>\r\n\
        list-id: Some list <l.example.com>\r\n\
        Date: Fri, 11 Jul 2003 21:00:37 -0700\r\n";
    let body = b"  leading space\r\n\ttab\tand  spaces \t \r\ntrailing\t\r\n";
    let (message, records) = signed(&t, headers, body, &Options::default());
    assert_eq!(
        h_tag(&message),
        "from:from:reply-to:subject:subject:date:date:to:to:cc:cc:list-unsubscribe:list-id"
    );
    assert_eq!(dkimpy(&message, &records), [true, true]);
}

#[test]
fn trailing_blank_lines_and_an_empty_body_verify() {
    let (_dir, t) = dual();
    for body in [
        &b"text\r\n\r\n\r\n   \r\n\r\n"[..],
        b"",
        b"\r\n\r\n",
        b"no final line end",
    ] {
        let (message, records) = signed(&t, HEADERS, body, &Options::default());
        assert_eq!(dkimpy(&message, &records), [true, true], "{body:?}");
    }
}

#[test]
fn a_header_block_without_its_final_line_end_verifies_as_the_relay_sends_it() {
    let (_dir, t) = dual();
    for headers in [
        &b"From: joe@example.com\r\nSubject: no end"[..],
        b"From: joe@example.com\r\nSubject: no blank line\r\n",
    ] {
        let (message, records) = signed(&t, headers, b"body\r\n", &Options::default());
        assert_eq!(dkimpy(&message, &records), [true, true], "{headers:?}");
    }
}

#[test]
fn a_stored_message_with_bare_lf_line_ends_verifies() {
    let (_dir, t) = dual();
    let headers = b"From: joe@example.com\nSubject: bare\n\tfolded\nTo: sue@example.net\n\n";
    let body = b"line one\nline  two \n\n\nlast\n";
    let (message, records) = signed(&t, headers, body, &Options::default());
    assert!(!message.windows(2).any(|w| w[1] == b'\n' && w[0] != b'\r'));
    assert_eq!(dkimpy(&message, &records), [true, true]);
}

#[test]
fn a_signature_with_an_expiry_verifies_until_it_expires() {
    let (_dir, t) = one_key(Kind::Ed25519);
    let options = Options {
        expire: Some(Duration::from_secs(3600)),
        ..Options::default()
    };
    let (message, records) = signed(&t, HEADERS, BODY, &options);
    assert!(String::from_utf8_lossy(&message).contains(" x="));
    assert_eq!(dkimpy(&message, &records), [true]);
    let keys: Vec<_> = t.entries().iter().collect();
    // dkimpy allows ten hours for clocks that are wrong: two days is past them.
    let long_ago = SystemTime::now() - Duration::from_secs(2 * 86_400);
    let fields = sign(HEADERS, BODY, &keys, &options, long_ago).unwrap();
    let expired = as_sent(&[fields, HEADERS.to_vec()].concat(), BODY);
    assert_eq!(dkimpy(&expired, &records), [false]);
}

/// Replaces the first `from` in `text` by `to`.
fn replace(text: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = text
        .windows(from.len())
        .position(|w| w == from)
        .unwrap_or_else(|| panic!("{:?} not found", String::from_utf8_lossy(from)));
    [&text[..at], to, &text[at + from.len()..]].concat()
}

#[test]
fn tampering_breaks_both_signatures_and_an_unsigned_addition_does_not() {
    let (_dir, t) = dual();
    let (message, records) = signed(&t, HEADERS, BODY, &Options::default());
    assert_eq!(dkimpy(&message, &records), [true, true]);
    // Control: a field no signature covers, added on top and at the bottom.
    let received = [
        &b"Received: from relay by mx; Fri, 1 Jan 2027 00:00:00 +0000\r\n"[..],
        &message,
    ]
    .concat();
    let received = replace(&received, b"\r\n\r\nHi.", b"\r\nX-Later: added\r\n\r\nHi.");
    assert_eq!(dkimpy(&received, &records), [true, true]);
    // One body byte changed.
    let body_changed = replace(&message, b"hungry", b"hungrY");
    assert_eq!(dkimpy(&body_changed, &records), [false, false]);
    // A second From: added after signing, below the first.
    let second_from = replace(
        &message,
        b"\r\n\r\nHi.",
        b"\r\nFrom: Mallory <m@evil.example>\r\n\r\nHi.",
    );
    assert_eq!(dkimpy(&second_from, &records), [false, false]);
    // A header value changed.
    let subject_changed = replace(&message, b"Subject: dinner", b"Subject: Dinner");
    assert_eq!(dkimpy(&subject_changed, &records), [false, false]);
    // A Cc: added where there was none (oversigning covers only From, Subject, Date,
    // To; an added Cc is not caught, and the signatures stay valid).
    let cc_added = replace(
        &message,
        b"\r\n\r\nHi.",
        b"\r\nCc: extra@evil.example\r\n\r\nHi.",
    );
    assert_eq!(dkimpy(&cc_added, &records), [true, true]);
}
