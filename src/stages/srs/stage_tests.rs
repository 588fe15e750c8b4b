//! The stage's own part (mod.rs): its section's checks, and what forward and reverse
//! mode do with a message's envelope, the scheme itself being `scheme_tests.rs`'s.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use super::scheme::Srs;
use super::{ConfiguredSrs, Mode, SrsStage};
use crate::config::{StageSection, raw};
use crate::worker::{ErrorClass, Message, Outcome, Stage};

/// 2026-12-04 12:00 UTC.
fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_385_600)
}

fn section(text: &str) -> StageSection {
    let mut sections = raw::parse(std::path::Path::new("pepsi.conf"), text).unwrap();
    StageSection::check(&sections.remove(0)).unwrap()
}

const BASE: &str = "[stage-srs]\nPROGRAM = pepsi-stage-srs\nNEXT = out\n";

fn configured(mode: Mode) -> ConfiguredSrs {
    ConfiguredSrs {
        mode,
        domain: "fwd.example".into(),
        secrets_file: "/nonexistent".into(),
        local_domains: vec!["local.example".into()],
        max_age_days: 21,
        next: "out".into(),
        scheme: std::sync::OnceLock::new(),
    }
}

fn scheme() -> Srs {
    Srs::new(vec![b"s3cret".to_vec()], "fwd.example", 21).unwrap()
}

fn message(from: &str, to: &[&str]) -> Message {
    Message::new(
        1,
        "srs".into(),
        from.into(),
        to.iter().map(|s| s.to_string()).collect(),
        None,
        None,
        Default::default(),
        String::new(),
    )
}

#[test]
fn a_section_needs_a_mode_a_domain_and_an_absolute_secrets_file_and_whole_days() {
    let good = "MODE = forward\nSRS_DOMAIN = fwd.example\nSECRETS_FILE = /etc/pepsi/srs\n";
    assert!(
        SrsStage
            .configure(&section(&format!("{BASE}{good}")))
            .is_ok()
    );
    for (lines, expected) in [
        (
            "SRS_DOMAIN = fwd.example\nSECRETS_FILE = /s\n",
            "MODE: is required",
        ),
        (
            "MODE = both\nSRS_DOMAIN = f.example\nSECRETS_FILE = /s\n",
            "neither forward nor reverse",
        ),
        (
            "MODE = forward\nSECRETS_FILE = /s\n",
            "SRS_DOMAIN: is required",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = a b\nSECRETS_FILE = /s\n",
            "is not a domain",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = f.example\n",
            "SECRETS_FILE: is required",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = f.example\nSECRETS_FILE = s\n",
            "absolute path",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = f.example\nSECRETS_FILE = /s\nLOCAL_DOMAINS = ok.example, @bad\n",
            "LOCAL_DOMAINS",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = f.example\nSECRETS_FILE = /s\nMAX_AGE = 36h\n",
            "whole number of days",
        ),
        (
            "MODE = forward\nSRS_DOMAIN = f.example\nSECRETS_FILE = /s\nMAX_AGE = 1001d\n",
            "whole number of days",
        ),
    ] {
        let err = SrsStage
            .configure(&section(&format!("{BASE}{lines}")))
            .err()
            .unwrap_or_else(|| panic!("{lines:?} accepted"));
        assert!(err.to_string().contains(expected), "{lines:?}: {err}");
    }
}

#[test]
fn check_reads_the_secrets_file_the_workers_will_read() {
    let dir = std::env::temp_dir().join(format!("pepsi-srs-stage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secrets");
    std::fs::write(&file, "s3cret\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let text = format!(
        "{BASE}MODE = reverse\nSRS_DOMAIN = f.example\nSECRETS_FILE = {}\n",
        file.display()
    );
    assert!(SrsStage.file_errors(&section(&text).section).is_empty());
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let errors = SrsStage.file_errors(&section(&text).section);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].to_string().contains("SECRETS_FILE"),
        "{}",
        errors[0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let errors = SrsStage.file_errors(&section(&text).section);
    assert!(
        errors[0].to_string().contains(&file.display().to_string()),
        "{}",
        errors[0]
    );
}

#[test]
fn forward_rewrites_senders_from_elsewhere_and_leaves_local_and_null_ones() {
    let stage = configured(Mode::Forward);
    let srs = scheme();
    let mut m = message("Alice@Remote.Example", &["r@dest.example"]);
    assert_eq!(
        stage.forward(&mut m, "srs", &srs, now()),
        Outcome::Advance("out".into())
    );
    assert!(m.rewritten());
    assert!(m.mail_from().starts_with("SRS0="), "{}", m.mail_from());
    assert_eq!(
        srs.reverse(m.mail_from(), now()).unwrap().as_deref(),
        Some("Alice@Remote.Example")
    );
    for sender in ["", "bob@LOCAL.example", "x@fwd.example"] {
        let mut m = message(sender, &["r@dest.example"]);
        assert_eq!(
            stage.forward(&mut m, "srs", &srs, now()),
            Outcome::Advance("out".into())
        );
        assert_eq!(m.mail_from(), sender);
        assert!(!m.rewritten(), "{sender:?} left alone");
    }
    // A sender too long to rewrite goes on as it is.
    let long = format!("{}@remote.example", "a".repeat(230));
    let mut m = message(&long, &["r@dest.example"]);
    assert_eq!(
        stage.forward(&mut m, "srs", &srs, now()),
        Outcome::Advance("out".into())
    );
    assert_eq!(m.mail_from(), long);
    assert!(!m.rewritten());
}

#[test]
fn reverse_turns_recipients_back_and_fails_the_ones_that_do_not_turn_back() {
    let stage = configured(Mode::Reverse);
    let srs = scheme();
    let alice = srs.forward("alice@remote.example", now()).unwrap().unwrap();
    let old = srs
        .forward(
            "old@remote.example",
            now() - Duration::from_secs(30 * 86_400),
        )
        .unwrap()
        .unwrap();
    let forged = Srs::new(vec![b"other".to_vec()], "fwd.example", 21)
        .unwrap()
        .forward("v@remote.example", now())
        .unwrap()
        .unwrap();
    // Every recipient turns back (or is no SRS address): rewritten, advanced.
    let mut m = message("", &[&alice, "plain@dest.example"]);
    assert_eq!(
        stage.reverse(&mut m, "unsrs", &srs, now()).unwrap(),
        Outcome::Advance("out".into())
    );
    assert_eq!(m.rcpt_to(), ["alice@remote.example", "plain@dest.example"]);
    assert!(m.rewritten());
    let mut m = message("", &["plain@dest.example"]);
    stage.reverse(&mut m, "unsrs", &srs, now()).unwrap();
    assert!(!m.rewritten(), "nothing to turn back, nothing rewritten");
    // Some do not: split here first, the ones that do on the row.
    let mut m = message("d@dest.example", &[&old, &alice, &forged]);
    assert_eq!(
        stage.reverse(&mut m, "unsrs", &srs, now()).unwrap(),
        Outcome::Split {
            groups: vec![vec![alice.clone()], vec![old.clone(), forged.clone()]],
            stage: "unsrs".into(),
        }
    );
    assert!(
        !m.rewritten(),
        "the split carries the addresses as they came"
    );
    // None does: a permanent error with each reason, 5.1.1 for the sender.
    let mut m = message("d@dest.example", &[&old, &forged]);
    let err = stage.reverse(&mut m, "unsrs", &srs, now()).unwrap_err();
    assert_eq!(err.class, ErrorClass::Permanent);
    assert!(
        err.message.contains("SRS address expired"),
        "{}",
        err.message
    );
    assert!(
        err.message.contains("SRS hash does not match"),
        "{}",
        err.message
    );
    assert!(err.message.contains(&forged), "{}", err.message);
    let dsn = err.dsn.expect("a status for the notification");
    assert_eq!(dsn.status, "5.1.1");
    let diagnostic = dsn.diagnostic.unwrap();
    assert!(
        !diagnostic.contains("does not match") && !diagnostic.contains(&forged),
        "the same generic reason for every sender: {diagnostic}"
    );
}
