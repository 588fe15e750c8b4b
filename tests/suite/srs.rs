//! The Sender Rewriting Scheme stage (§19): `pepsi-stage-srs` workers run by the
//! dispatcher rewrite what `pepsi-stage-relay` then hands to a scripted smarthost
//! (`util::smarthost`). Forward mode gives mail from elsewhere a sender at
//! `SRS_DOMAIN`, reverse mode turns such addresses back; what does not reverse fails
//! that recipient alone (5.1.1) and reaches the sender as a notification. The
//! addresses' bytes against postsrsd are the unit tests' (`src/stages/srs/`).

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use pepsi::stages::srs::scheme::Srs;
use postgres::Client;

use crate::util::bouncer::Bouncer;
use crate::util::rows::wait_empty;
use crate::util::scenario::Scenario;
use crate::util::smarthost::{Script, Smarthost};
use crate::util::{TempDir, assert_has, bin, run, stderr, stdout, wait_until};

const WAIT: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

/// A secrets file in `dir` (mode 0600): `lines`, the first signing.
fn secrets(dir: &TempDir, lines: &[&str]) -> std::path::PathBuf {
    let path = dir.write("srs-secrets", &format!("{}\n", lines.join("\n")));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// `out` (forward) and `back` (reverse) at `fwd.example` with `secrets`, both to the
/// relay to `host`; failed mail bounced through the relay too.
fn pipeline(secrets: &std::path::Path, host: &Smarthost) -> String {
    format!(
        "[stage-out]\nPROGRAM = {{srs}}\nMODE = forward\nSRS_DOMAIN = fwd.example\n\
         LOCAL_DOMAINS = local.example, other.example\nSECRETS_FILE = {s}\nNEXT = relay\n\n\
         [stage-back]\nPROGRAM = {{srs}}\nMODE = reverse\nSRS_DOMAIN = fwd.example\n\
         SECRETS_FILE = {s}\nNEXT = relay\n\n\
         [stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {h}\n\n\
         [stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = relay\n\n\
         [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
        s = secrets.display(),
        h = host.address
    )
}

/// Injects a one-line message at `stage` from `from` to `to`.
fn inject(c: &mut Client, stage: &str, from: &str, to: &[&str]) -> i64 {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, $2, $3, 'From: x@remote.example\r\nSubject: t\r\n'::bytea, 'x\r\n'::bytea)",
        &[&stage, &from, &to],
    )
    .unwrap()
    .get(0)
}

/// The envelope sender of the message the smarthost took for `rcpt`.
fn sender_for(host: &Smarthost, rcpt: &str) -> String {
    let seen = host.seen();
    let m = seen
        .messages
        .iter()
        .find(|m| m.delivered.iter().any(|d| d == rcpt))
        .unwrap_or_else(|| panic!("nothing delivered to {rcpt}"));
    let start = m.mail.find('<').unwrap() + 1;
    let end = m.mail[start..].find('>').unwrap() + start;
    m.mail[start..end].to_string()
}

#[test]
fn forwarded_mail_gets_a_sender_that_reverses_and_local_and_null_senders_stay() {
    let dir = TempDir::new("srs-forward");
    let file = secrets(&dir, &["n3w-s3cret", "0ld-s3cret"]);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("srs-forward")
        .timers("")
        .stages(&pipeline(&file, &host))
        .connect();
    inject(&mut c, "out", "Alice@Remote.Example", &["a@dest.example"]);
    inject(&mut c, "out", "bob@local.example", &["b@dest.example"]);
    inject(&mut c, "out", "", &["c@dest.example"]);
    let other = "SRS0=AbCd=2W=origin.example=carol@relay.example";
    inject(&mut c, "out", other, &["d@dest.example"]);
    let _d = s.start();
    wait_empty(&mut c, WAIT);
    let srs = Srs::new(vec![b"n3w-s3cret".to_vec()], "fwd.example", 21).unwrap();
    let now = SystemTime::now();
    let a = sender_for(&host, "a@dest.example");
    assert!(a.starts_with("SRS0="), "{a}");
    assert!(a.ends_with("@fwd.example"), "{a}");
    assert_eq!(
        srs.reverse(&a, now).unwrap().as_deref(),
        Some("Alice@Remote.Example")
    );
    assert_eq!(sender_for(&host, "b@dest.example"), "bob@local.example");
    assert_eq!(sender_for(&host, "c@dest.example"), "");
    let d = sender_for(&host, "d@dest.example");
    assert!(d.starts_with("SRS1="), "{d}");
    assert_has!(d, "=relay.example==");
    assert_eq!(srs.reverse(&d, now).unwrap().as_deref(), Some(other));
}

#[test]
fn a_bounce_finds_its_way_back_and_a_bad_srs_address_fails_alone_with_5_1_1() {
    let dir = TempDir::new("srs-reverse");
    // The old secret still verifies; the new one signs.
    let file = secrets(&dir, &["n3w-s3cret", "0ld-s3cret"]);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("srs-reverse")
        .pepsi("HOSTNAME = pepsi.test.example\n")
        .timers("")
        .stages(&pipeline(&file, &host))
        .connect();
    let now = SystemTime::now();
    let old = Srs::new(vec![b"0ld-s3cret".to_vec()], "fwd.example", 21).unwrap();
    let valid = old.forward("alice@remote.example", now).unwrap().unwrap();
    let expired = old
        .forward("old@remote.example", now - 30 * DAY)
        .unwrap()
        .unwrap();
    let stranger = Srs::new(vec![b"not-ours".to_vec()], "fwd.example", 21).unwrap();
    let forged = stranger
        .forward("victim@remote.example", now)
        .unwrap()
        .unwrap();
    // A bounce (the null sender) for the valid address and a plain one: both delivered.
    inject(&mut c, "back", "", &[&valid, "plain@dest.example"]);
    // A message from dave to the valid address and two that do not reverse: alice gets
    // it, the other two fail alone and dave is told (5.1.1).
    inject(
        &mut c,
        "back",
        "dave@dest.example",
        &[&valid, &expired, &forged],
    );
    let _d = s.start();
    let _b = Bouncer::ready(&s.conf, &[]);
    wait_until(WAIT, "alice twice, plain once, dave's notification", || {
        host.deliveries("alice@remote.example") == 2
            && host.deliveries("plain@dest.example") == 1
            && host.deliveries("dave@dest.example") == 1
    });
    wait_empty(&mut c, WAIT);
    let seen = host.seen();
    let report = seen
        .messages
        .iter()
        .find(|m| m.delivered.iter().any(|d| d == "dave@dest.example"))
        .unwrap();
    let text = String::from_utf8_lossy(&report.data);
    assert_has!(text, "Status: 5.1.1");
    assert_eq!(text.matches("Status: 5.1.1").count(), 2, "{text}");
    assert_has!(text, &format!("Final-Recipient: rfc822; {expired}"));
    assert_has!(text, &format!("Final-Recipient: rfc822; {forged}"));
    assert!(!text.contains("Final-Recipient: rfc822; alice"), "{text}");
    let to_srs = seen
        .messages
        .iter()
        .filter(|m| m.delivered.iter().any(|d| d.ends_with("@fwd.example")))
        .count();
    assert_eq!(to_srs, 0, "no SRS address is handed on");
}

#[test]
fn a_missing_or_open_secrets_file_keeps_the_workers_from_starting() {
    let dir = TempDir::new("srs-secrets");
    let host = Smarthost::start(Script::default());
    let file = secrets(&dir, &["s3cret"]);
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (s, _c) = Scenario::new("srs-secrets")
        .timers("")
        .stages(&pipeline(&file, &host))
        .connect();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    assert!(!out.status.success());
    let report = stdout(&out) + &stderr(&out);
    assert_has!(report, "SECRETS_FILE");
    assert_has!(report, &file.display().to_string());
    std::fs::remove_file(&file).unwrap();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    assert!(!out.status.success());
    assert_has!(stdout(&out) + &stderr(&out), &file.display().to_string());
}
