//! The relay's TLS and SMTP AUTH (§21) against a real Postfix as the smarthost
//! (`tls_peer::Smarthost`: a private instance with a certificate from a test CA and
//! Cyrus SASL), the relay stages run by the dispatcher: `verify` delivers, a
//! certificate for another name or from an unknown CA defers and sends nothing; `may`
//! uses TLS when offered and clear text when not; wrapper mode; AUTH PLAIN logs in, a
//! wrong password defers with one log line and appears in no log or row.

use std::path::Path;
use std::time::Duration;

use postgres::Client;

use crate::util::rows::wait_empty;
use crate::util::scenario::Scenario;
use crate::util::tls_peer::{self, NAME, Smarthost, TestCa, TlsOptions};
use crate::util::{assert_has, assert_lacks, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// A message from alice to `to`, injected at `stage`.
fn inject(c: &mut Client, stage: &str, to: &str) -> i64 {
    let headers = format!("From: <alice@origin.example>\r\nTo: <{to}>\r\nSubject: tls\r\n");
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, 'alice@origin.example', ARRAY[$2], $3, \
         'Over the relay.\r\n'::bytea, NULL, NULL, NULL, NULL, '{}'::jsonb)",
        &[&stage, &to, &headers.as_bytes()],
    )
    .unwrap()
    .get(0)
}

/// A relay stage `name` to `port` of the loopback with `extra` lines.
fn relay(name: &str, port: u16, extra: &str) -> String {
    format!("[stage-{name}]\nPROGRAM = {{relay}}\nSMARTHOST = 127.0.0.1:{port}\n{extra}\n")
}

/// The paused rows at `stage`: each one's last error.
fn paused(c: &mut Client, stage: &str) -> Vec<String> {
    c.query(
        "SELECT coalesce(state->>'last_error', '') FROM pepsi.workqueue \
          WHERE stage = $1 AND status = 'paused'",
        &[&stage],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// `TLS`, `TLS_NAME` and `CA_FILE` lines.
fn verifying(ca: &Path) -> String {
    format!(
        "TLS = verify\nTLS_NAME = {NAME}\nCA_FILE = {}\n",
        ca.display()
    )
}

#[test]
fn verify_delivers_inside_tls_and_both_ends_say_so() {
    if !tls_peer::available("verify_delivers_inside_tls_and_both_ends_say_so") {
        return;
    }
    let ca = TestCa::new("relay-verify");
    let host = Smarthost::start(
        "relay-verify",
        &TlsOptions {
            cert: Some(ca.server_cert(NAME)),
            wrapper_port: true,
            ..TlsOptions::default()
        },
        &["a", "w"],
    );
    let wrapper = host.wrapper_port.unwrap();
    let stages = relay("out", host.port, &verifying(&ca.cert_path()))
        + &relay(
            "wrapped",
            wrapper,
            &format!("TLS_WRAPPER = yes\n{}", verifying(&ca.cert_path())),
        );
    let (s, mut c) = Scenario::new("relay-verify")
        .timers("")
        .stages(&stages)
        .connect();
    inject(&mut c, "out", "a@local.test");
    inject(&mut c, "wrapped", "w@local.test");
    let mut d = s.start();
    let a = host.wait_mailbox("a", 1, WAIT);
    host.wait_mailbox("w", 1, WAIT);
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success());
    let received = String::from_utf8_lossy(&a[0]);
    assert_has!(received, "using TLSv1.");
    let log = d.log();
    assert_has!(
        log,
        &format!("Verified TLS connection established to {NAME}: TLSv1.")
    );
    assert_has!(log, "(Verified TLS, TLSv1.");
    assert_has!(host.maillog(), "TLS connection established from");
    // Counted for the metrics (the dispatcher writes its statistics as it stops).
    let events: Vec<(String, String, i64)> = c
        .query(
            "SELECT stage, event, count FROM pepsi.stage_events ORDER BY 1, 2",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let row = |s: &str, e: &str| (s.to_string(), e.to_string(), 1);
    assert_eq!(
        events,
        [
            row("out", "tls-verified"),
            row("out", "tlsv1.3"),
            row("wrapped", "tls-verified"),
            row("wrapped", "tlsv1.3"),
        ]
    );
}

#[test]
fn a_certificate_for_another_name_or_from_an_unknown_ca_defers_and_sends_nothing() {
    if !tls_peer::available("a_certificate_for_another_name_or_from_an_unknown_ca") {
        return;
    }
    let ca = TestCa::new("relay-wrong");
    let stranger = TestCa::new("relay-stranger");
    let host = Smarthost::start(
        "relay-wrong",
        &TlsOptions {
            cert: Some(ca.server_cert("other.test")),
            ..TlsOptions::default()
        },
        &["a"],
    );
    // `named` trusts the CA but wants mx.pepsi.test; `unknown` wants the certificate's
    // own name but trusts another CA.
    let stages = relay("named", host.port, &verifying(&ca.cert_path()))
        + &relay(
            "unknown",
            host.port,
            &format!(
                "TLS = verify\nTLS_NAME = other.test\nCA_FILE = {}\n",
                stranger.cert_path().display()
            ),
        );
    let (s, mut c) = Scenario::new("relay-wrong")
        .timers("")
        .stages(&stages)
        .connect();
    inject(&mut c, "named", "a@local.test");
    inject(&mut c, "unknown", "a@local.test");
    let mut d = s.start();
    wait_until(WAIT, "both messages wait", || {
        paused(&mut c, "named").len() == 1 && paused(&mut c, "unknown").len() == 1
    });
    assert!(d.terminate().success());
    let named = paused(&mut c, "named").remove(0);
    let unknown = paused(&mut c, "unknown").remove(0);
    assert_has!(named, "TLS handshake failed");
    assert_has!(named, "certificate not valid for name");
    assert_has!(unknown, "UnknownIssuer");
    assert!(host.mailbox("a").is_empty());
    let maillog = host.maillog();
    assert_lacks!(maillog, "alice@origin.example");
    assert_lacks!(maillog, "from=<");
}

#[test]
fn may_uses_tls_when_offered_and_clear_text_when_not() {
    if !tls_peer::available("may_uses_tls_when_offered_and_clear_text_when_not") {
        return;
    }
    let ca = TestCa::new("relay-may");
    let with = Smarthost::start(
        "relay-may-tls",
        &TlsOptions {
            cert: Some(ca.server_cert(NAME)),
            ..TlsOptions::default()
        },
        &["a"],
    );
    let without = Smarthost::start("relay-may-clear", &TlsOptions::default(), &["b"]);
    let stages =
        relay("tls", with.port, "TLS = may\n") + &relay("clear", without.port, "TLS = may\n");
    let (s, mut c) = Scenario::new("relay-may")
        .timers("")
        .stages(&stages)
        .connect();
    inject(&mut c, "tls", "a@local.test");
    inject(&mut c, "clear", "b@local.test");
    let mut d = s.start();
    with.wait_mailbox("a", 1, WAIT);
    let b = without.wait_mailbox("b", 1, WAIT);
    assert!(d.terminate().success());
    assert_has!(with.maillog(), "Anonymous TLS connection established from");
    assert_lacks!(without.maillog(), "TLS connection established");
    assert_lacks!(String::from_utf8_lossy(&b[0]), "using TLS");
    let log = d.log();
    assert_has!(log, "Untrusted TLS connection established to");
    assert_has!(log, "(no TLS)");
    let mut counted = |stage: &str, event: &str| -> i64 {
        c.query_opt(
            "SELECT count FROM pepsi.stage_events WHERE stage = $1 AND event = $2",
            &[&stage, &event],
        )
        .unwrap()
        .map_or(0, |r| r.get(0))
    };
    assert_eq!(counted("tls", "tls-unverified"), 1);
    assert_eq!(counted("tls", "no-tls"), 0);
    assert_eq!(counted("clear", "no-tls"), 1);
}

#[test]
fn auth_plain_logs_in_and_a_wrong_password_defers_with_one_line_and_shows_nowhere() {
    if !tls_peer::available("auth_plain_logs_in_and_a_wrong_password_defers") {
        return;
    }
    const PASSWORD: &str = "Correct-Horse-42";
    const WRONG: &str = "Wrong-Battery-17";
    let ca = TestCa::new("relay-auth");
    let host = Smarthost::start(
        "relay-auth",
        &TlsOptions {
            cert: Some(ca.server_cert(NAME)),
            auth: Some(("relay", PASSWORD)),
            auth_required: true,
            ..TlsOptions::default()
        },
        &["a", "b"],
    );
    let dir = crate::util::TempDir::new("relay-auth-files");
    let login = |name: &str, password: &str| {
        let path = dir.path(name);
        std::fs::write(
            &path,
            format!("# the smarthost's login\nrelay {password}\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let good = login("good", PASSWORD);
    let bad = login("bad", WRONG);
    let stages = relay(
        "good",
        host.port,
        &format!(
            "{}AUTH_FILE = {}\n",
            verifying(&ca.cert_path()),
            good.display()
        ),
    ) + &relay(
        "bad",
        host.port,
        &format!(
            "{}AUTH_FILE = {}\n",
            verifying(&ca.cert_path()),
            bad.display()
        ),
    );
    let (s, mut c) = Scenario::new("relay-auth")
        .timers("")
        .stages(&stages)
        .connect();
    inject(&mut c, "good", "a@local.test");
    inject(&mut c, "bad", "b@local.test");
    let mut d = s.start();
    let a = host.wait_mailbox("a", 1, WAIT);
    wait_until(WAIT, "the message with the wrong password waits", || {
        paused(&mut c, "bad").len() == 1
    });
    assert!(d.terminate().success());
    assert_has!(host.maillog(), "sasl_method=PLAIN");
    assert_has!(
        host.maillog(),
        &format!("sasl_username={}", host.sasl_username.clone().unwrap())
    );
    assert_has!(String::from_utf8_lossy(&a[0]), "Authenticated sender");
    assert!(host.mailbox("b").is_empty());
    let error = paused(&mut c, "bad").remove(0);
    assert_has!(error, "the smarthost refused the login: 535");
    let log = d.log();
    assert_eq!(log.matches("refused the login").count(), 1, "{log}");
    // Neither password, nor the base64 that carried it, anywhere.
    let rows: String = c
        .query("SELECT row_to_json(q)::text FROM pepsi.workqueue q", &[])
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    use base64::Engine;
    for secret in [PASSWORD, WRONG] {
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("\0relay\0{secret}"));
        for (what, text) in [("the log", &log), ("the rows", &rows)] {
            assert!(!text.contains(secret), "{what} shows a password");
            assert!(!text.contains(&b64), "{what} shows the AUTH PLAIN token");
        }
    }
}

#[test]
fn a_chain_of_100_certificates_defers_at_verify_within_the_deadline_and_sends_nothing() {
    if !tls_peer::available("a_chain_of_100_certificates_defers_at_verify") {
        return;
    }
    let ca = TestCa::new("relay-chain");
    let host = Smarthost::start(
        "relay-chain",
        &TlsOptions {
            cert: Some(ca.long_chain(NAME, 100)),
            ..TlsOptions::default()
        },
        &["a"],
    );
    let (s, mut c) = Scenario::new("relay-chain")
        .timers("")
        .stages(&relay("out", host.port, &verifying(&ca.cert_path())))
        .connect();
    inject(&mut c, "out", "a@local.test");
    let mut d = s.start();
    wait_until(WAIT, "the message waits", || {
        paused(&mut c, "out").len() == 1
    });
    assert!(d.terminate().success());
    assert_has!(paused(&mut c, "out").remove(0), "TLS handshake failed");
    assert!(host.mailbox("a").is_empty());
    assert_lacks!(host.maillog(), "from=<");
}

#[test]
fn the_overlay_can_neither_lower_the_relays_tls_nor_send_its_login_elsewhere() {
    if !tls_peer::available("the_overlay_can_neither_lower_the_relays_tls") {
        return;
    }
    use crate::util::{bin, run, stderr, stdout};
    const PASSWORD: &str = "Overlay-Proof-9";
    let ca = TestCa::new("relay-overlay");
    let host = Smarthost::start(
        "relay-overlay",
        &TlsOptions {
            cert: Some(ca.server_cert(NAME)),
            auth: Some(("relay", PASSWORD)),
            auth_required: true,
            ..TlsOptions::default()
        },
        &["a"],
    );
    let dir = crate::util::TempDir::new("relay-overlay-files");
    let login = dir.path("login");
    std::fs::write(&login, format!("relay {PASSWORD}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&login, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (s, mut c) = Scenario::new("relay-overlay")
        .timers("")
        .stages(&relay(
            "out",
            host.port,
            &format!(
                "{}AUTH_FILE = {}\n",
                verifying(&ca.cert_path()),
                login.display()
            ),
        ))
        .connect();
    let conf = s.conf.to_str().unwrap();
    // The tool refuses each, writing nothing.
    for (key, value) in [
        ("TLS", "none"),
        ("TLS_NAME", "evil.example"),
        ("CA_FILE", "/tmp/evil-ca.pem"),
        ("AUTH_FILE", "/tmp/evil-login"),
        ("SMARTHOST", "192.0.2.66:587"),
    ] {
        let out = run(
            &bin("pepsi-queue"),
            &["-c", conf, "config", "set", "stage-out", key, value],
        );
        assert_eq!(out.status.code(), Some(78), "{key}: {}", stderr(&out));
        assert_has!(stderr(&out), &format!("{key} is refused"));
    }
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing written");
    // Rows planted behind the tool's back are reported and left out: the message
    // still goes to the file's smarthost, verified, logged in.
    c.execute(
        "INSERT INTO pepsi.config_override VALUES \
         ('stage-out', 'TLS', 'none'), ('stage-out', 'SMARTHOST', '192.0.2.66:587')",
        &[],
    )
    .unwrap();
    let out = run(&bin("pepsi-dispatch"), &["-c", conf, "check"]);
    assert_eq!(out.status.code(), Some(78), "{}", stdout(&out));
    assert_has!(stdout(&out), "[stage-out] TLS: TLS is refused");
    assert_has!(stdout(&out), "[stage-out] SMARTHOST: SMARTHOST is refused");
    inject(&mut c, "out", "a@local.test");
    let mut d = s.start();
    let a = host.wait_mailbox("a", 1, WAIT);
    assert!(d.terminate().success());
    assert_has!(String::from_utf8_lossy(&a[0]), "Authenticated sender");
    assert_has!(d.log(), "Verified TLS connection established to");
}
