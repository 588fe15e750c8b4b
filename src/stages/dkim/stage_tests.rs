//! The stage's own part (mod.rs): its section's checks, the files `check` reads, what
//! it does with a message it can sign and with one it cannot, and `dns`. The
//! signatures themselves are `sign_tests.rs`' and `verify_tests.rs`'.

use std::time::{Duration, SystemTime};

use super::test_keys::{Kind, loaded, pem, table};
use super::{ConfiguredDkim, DkimSign, UNSIGNED_KEY, sign};
use crate::config::{Config, StageSection, raw};
use crate::worker::{ErrorClass, Message, Outcome, Stage};

fn section(text: &str) -> StageSection {
    let mut sections = raw::parse(std::path::Path::new("pepsi.conf"), text).unwrap();
    StageSection::check(&sections.remove(0)).unwrap()
}

const BASE: &str = "[stage-sign]\nPROGRAM = pepsi-stage-dkim-sign\nNEXT = out\n";

fn configured(require: bool, subdomains: bool) -> ConfiguredDkim {
    ConfiguredDkim {
        key_table: "/nonexistent".into(),
        subdomains,
        options: sign::Options::default(),
        require,
        next: "out".into(),
    }
}

fn message(headers: &[u8]) -> Message {
    let mut m = Message::new(
        1,
        "sign".into(),
        "a@example.org".into(),
        vec!["r@dest.example".into()],
        None,
        None,
        Default::default(),
        String::new(),
    );
    m.set_content(Some(headers.to_vec()), Some(b"Hi.\r\n".to_vec()));
    m
}

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_385_600)
}

#[test]
fn a_section_needs_an_absolute_key_table_and_checks_its_values() {
    assert!(
        DkimSign
            .configure(&section(&format!(
                "{BASE}KEY_TABLE = /etc/pepsi/dkim/keys\n"
            )))
            .is_ok()
    );
    for (lines, expected) in [
        ("", "KEY_TABLE: is required"),
        ("KEY_TABLE = keys\n", "absolute path"),
        ("KEY_TABLE = /k\nSUBDOMAINS = perhaps\n", "SUBDOMAINS"),
        ("KEY_TABLE = /k\nREQUIRE = sometimes\n", "REQUIRE"),
        ("KEY_TABLE = /k\nEXPIRE = 0s\n", "at least a second"),
        ("KEY_TABLE = /k\nEXPIRE = soon\n", "EXPIRE"),
        ("KEY_TABLE = /k\nHEADERS = From, Sub;ject\n", "HEADERS"),
    ] {
        let err = DkimSign
            .configure(&section(&format!("{BASE}{lines}")))
            .err()
            .unwrap_or_else(|| panic!("{lines:?} accepted"));
        assert!(err.to_string().contains(expected), "{lines:?}: {err}");
    }
}

#[test]
fn check_reports_every_problem_of_the_key_table_by_its_line() {
    let (dir, loaded) = table(
        &[
            ("ok.pem", pem(Kind::Ed25519)),
            ("small.pem", pem(Kind::Rsa1024)),
        ],
        "example.org e ed25519-sha256 ok.pem\nsmall.example s rsa-sha256 small.pem\nx y\n",
    );
    assert!(loaded.is_err());
    let path = dir.path().join("keys");
    let text = format!("{BASE}KEY_TABLE = {}\n", path.display());
    let errors = DkimSign.file_errors(&section(&text).section);
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (e, line) in errors.iter().zip([2, 3]) {
        let e = e.to_string();
        assert!(e.contains("KEY_TABLE"), "{e}");
        assert!(
            e.contains(&format!("{} line {line}", path.display())),
            "{e}"
        );
    }
    let text = format!("{BASE}KEY_TABLE = {}\n", dir.path().join("gone").display());
    let errors = DkimSign.file_errors(&section(&text).section);
    assert_eq!(errors.len(), 1, "{errors:?}");
}

#[test]
fn a_message_from_a_keyed_domain_gets_its_signatures_on_top_of_the_header_block() {
    let (_dir, keys) = loaded(
        &[("r.pem", pem(Kind::Rsa2048)), ("e.pem", pem(Kind::Ed25519))],
        "example.org r rsa-sha256 r.pem\nexample.org e ed25519-sha256 e.pem\n",
    );
    let headers = b"From: Alice <alice@Example.ORG>\r\nSubject: hi\r\n";
    let mut m = message(headers);
    let stage = configured(false, false);
    assert_eq!(
        stage.sign_with(&mut m, "sign", &keys, now()).unwrap(),
        Outcome::Advance("out".into())
    );
    assert!(m.rewritten());
    let prepended = m.prepended().to_vec();
    let text = String::from_utf8(prepended.clone()).unwrap();
    assert_eq!(text.matches("DKIM-Signature:").count(), 2, "{text}");
    assert!(
        text.contains("a=rsa-sha256") && text.contains("a=ed25519-sha256"),
        "{text}"
    );
    assert!(text.contains("t=1796385600"), "{text}");
    assert_eq!(
        m.headers().unwrap(),
        [prepended.as_slice(), headers].concat()
    );
    assert_eq!(m.body().unwrap(), b"Hi.\r\n", "the body is not touched");
}

#[test]
fn a_message_that_cannot_be_signed_goes_on_told_or_fails_with_require() {
    let (_dir, keys) = loaded(
        &[("e.pem", pem(Kind::Ed25519))],
        "example.org e ed25519-sha256 e.pem\n",
    );
    for (headers, why) in [
        (
            &b"From: carol@other.example\r\n"[..],
            "no key for other.example",
        ),
        (b"From: a@example.org\r\nFrom: b@example.org\r\n", "From:"),
        (b"Subject: none\r\n", "From:"),
        (b"From: a@example.org, b@example.org\r\n", "From:"),
    ] {
        let mut m = message(headers);
        let outcome = configured(false, false).sign_with(&mut m, "sign", &keys, now());
        assert_eq!(outcome.unwrap(), Outcome::Advance("out".into()));
        assert!(m.prepended().is_empty());
        let told = m.state[UNSIGNED_KEY].as_str().unwrap();
        assert!(told.contains(why), "{told}");
        let mut m = message(headers);
        let err = configured(true, false)
            .sign_with(&mut m, "sign", &keys, now())
            .unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent);
        assert_eq!(err.dsn.unwrap().status, "5.7.0");
        assert!(err.message.contains(why), "{}", err.message);
    }
    // SUBDOMAINS: the parent's key signs a subdomain without one of its own.
    let mut m = message(b"From: a@news.example.org\r\n");
    configured(false, true)
        .sign_with(&mut m, "sign", &keys, now())
        .unwrap();
    let text = String::from_utf8_lossy(m.prepended()).into_owned();
    assert!(text.contains("d=example.org"), "{text}");
}

#[test]
fn dns_prints_one_zone_line_per_key_of_every_dkim_sign_section() {
    let (dir, _keys) = loaded(
        &[("r.pem", pem(Kind::Rsa4096)), ("e.pem", pem(Kind::Ed25519))],
        "example.org r rsa-sha256 r.pem\nexample.net e ed25519-sha256 e.pem\n",
    );
    let text = format!(
        "[pepsi]\nRUN_AS = root\n\n[stage-sign]\nPROGRAM = pepsi-stage-dkim-sign\nKEY_TABLE = {}\nNEXT = out\n\n\
         [stage-out]\nPROGRAM = pepsi-stage-discard\n",
        dir.path().join("keys").display()
    );
    let path = std::path::Path::new("pepsi.conf");
    let config = Config::from_sections(path.into(), raw::parse(path, &text).unwrap()).unwrap();
    let graph = config.file_graph().unwrap();
    let zone = DkimSign.show("dns", &graph).unwrap();
    let lines: Vec<&str> = zone.lines().collect();
    assert_eq!(lines.len(), 2, "{zone}");
    assert!(
        lines[0].starts_with("r._domainkey.example.org. IN TXT ( \"v=DKIM1; k=rsa; p="),
        "{zone}"
    );
    assert!(
        lines[1].starts_with("e._domainkey.example.net. IN TXT ( \"v=DKIM1; k=ed25519; p="),
        "{zone}"
    );
    // A 4096-bit key's record is longer than one TXT string: split at 255 characters.
    let strings: Vec<&str> = lines[0].split('"').skip(1).step_by(2).collect();
    assert!(
        strings.len() > 1 && strings.iter().all(|s| s.len() <= 255),
        "{zone}"
    );
    assert!(DkimSign.show("zone", &graph).is_err());
}
