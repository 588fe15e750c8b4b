//! STARTTLS on `pepsi-ingress` (§21) from the outside: a real daemon with a certificate
//! from a test CA (`tls_peer::TestCa`, made with the `openssl` command), driven by
//! Python's `smtplib` and `ssl` (a TLS and SMTP implementation that is not ours) or by
//! raw bytes where no library would send them. STARTTLS offered, taken and the session
//! started over; `REQUIRE_TLS` refusing mail before it; a command pipelined behind
//! STARTTLS discarded; SIGHUP serving a new certificate to the next session while one
//! in progress completes; and hostile clients: a handshake that stops half-way,
//! garbage instead of a TLS record, and a certificate chain too long to serve.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::ingress::{open, tcp};
use crate::util::ingress::{Raw, drain, python, python_child, wait_child};
use crate::util::rows::count;
use crate::util::scenario::Scenario;
use crate::util::tls_peer::{self, TestCa};
use crate::util::{assert_has, wait_until};

/// The longest a client script may run.
const SCRIPT: Duration = Duration::from_secs(60);

/// The messages queued at the entry stage `in`.
fn queued(c: &mut postgres::Client) -> i64 {
    count(c, "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'in'")
}

/// `TLS_CERT` and `TLS_KEY` lines for these files.
fn tls_lines(cert: &Path, key: &Path) -> String {
    format!(
        "TLS_CERT = {}\nTLS_KEY = {}\n",
        cert.display(),
        key.display()
    )
}

/// The client script's helpers: `starttls(session, cafile)` verifies the server as
/// 127.0.0.1 against the test CA and returns the certificate's serial number.
const TLS_PRELUDE: &str = r#"
import ssl

def starttls(session, cafile):
    ctx = ssl.create_default_context(cafile=cafile)
    code, msg = session.starttls(context=ctx)
    assert code == 220, (code, msg)
    cert = session.sock.getpeercert()
    return {"serial": cert["serialNumber"], "version": session.sock.version()}
"#;

#[test]
fn starttls_is_offered_taken_and_the_session_starts_over_inside_tls() {
    if !tls_peer::ca_available("starttls_is_offered_taken_and_the_session_starts_over_inside_tls") {
        return;
    }
    let ca = TestCa::new("ingress");
    let (cert, key) = ca.server_cert("127.0.0.1");
    let (listen, target) = tcp("smtp");
    let mut t = open(Scenario::new("i-tls"), &listen, &tls_lines(&cert, &key));
    let out = python(
        &format!(
            "{TLS_PRELUDE}\n{}",
            r#"
s = smtp(sys.argv[1])
before = sorted(s.esmtp_features)
tls = starttls(s, sys.argv[2])
code, _ = s.ehlo("client.example")
after = sorted(s.esmtp_features)
msg = b"From: a@x.example\r\nSubject: inside\r\n\r\nSent inside TLS.\r\n"
out = transaction(s, "a@x.example", ["b@y.example"], msg)
s.quit()
print(json.dumps({"before": before, "after": after, "tls": tls, "ehlo": code, "tx": out}))
"#
        ),
        &[&target, ca.cert_path().to_str().unwrap()],
        SCRIPT,
    );
    let features = |k: &str| -> Vec<String> {
        out[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    assert!(
        features("before").contains(&"starttls".to_string()),
        "{out}"
    );
    assert!(
        !features("after").contains(&"starttls".to_string()),
        "not offered again inside TLS: {out}"
    );
    assert!(
        out["tls"]["version"]
            .as_str()
            .unwrap()
            .starts_with("TLSv1."),
        "{out}"
    );
    assert_eq!(out["tx"]["data"][0][0], 250, "{out}");
    t.daemon.wait_log("TLS TLSv1.", Duration::from_secs(10));
    assert!(t.daemon.terminate().success());
    assert_eq!(queued(&mut t.c), 1);
    // Counted for the metrics (written at the exit at the latest).
    assert_eq!(
        count(&mut t.c, "SELECT tls_sessions FROM pepsi.ingress_stats"),
        1
    );
}

#[test]
fn a_require_tls_listener_refuses_mail_before_starttls_and_another_listener_does_not() {
    if !tls_peer::ca_available("a_require_tls_listener_refuses_mail_before_starttls") {
        return;
    }
    let ca = TestCa::new("ingress-req");
    let (cert, key) = ca.server_cert("127.0.0.1");
    let (strict, strict_target) = tcp("smtp");
    let (open_listen, open_target) = tcp("smtp");
    let mut t = open(
        Scenario::new("i-tls-req"),
        &format!("{strict} {open_listen}"),
        &format!("{}REQUIRE_TLS = {strict}\n", tls_lines(&cert, &key)),
    );
    let script = format!(
        "{TLS_PRELUDE}\n{}",
        r#"
s = smtp(sys.argv[1])
clear = text(s.mail("a@x.example"))
s.rset()
if sys.argv[3] == "tls":
    starttls(s, sys.argv[2])
    s.ehlo("client.example")
msg = b"From: a@x.example\r\nSubject: one\r\n\r\nOne.\r\n"
out = transaction(s, "a@x.example", ["b@y.example"], msg)
s.quit()
print(json.dumps({"clear": clear, "tx": out}))
"#
    );
    let ca_file = ca.cert_path();
    let ca_file = ca_file.to_str().unwrap();
    let strict_out = python(&script, &[&strict_target, ca_file, "tls"], SCRIPT);
    assert_eq!(strict_out["clear"][0], 530, "{strict_out}");
    assert_has!(strict_out["clear"][1].as_str().unwrap(), "5.7.0");
    assert_eq!(strict_out["tx"]["data"][0][0], 250, "{strict_out}");
    let open_out = python(&script, &[&open_target, ca_file, "clear"], SCRIPT);
    assert_eq!(open_out["clear"][0], 250, "{open_out}");
    assert_eq!(open_out["tx"]["data"][0][0], 250, "{open_out}");
    assert!(t.daemon.terminate().success());
    assert_eq!(queued(&mut t.c), 2);
}

#[test]
fn a_command_pipelined_behind_starttls_is_discarded_not_run_inside_tls() {
    if !tls_peer::ca_available("a_command_pipelined_behind_starttls_is_discarded") {
        return;
    }
    let ca = TestCa::new("ingress-pipe");
    let (cert, key) = ca.server_cert("127.0.0.1");
    let (listen, target) = tcp("smtp");
    let mut t = open(
        Scenario::new("i-tls-pipe"),
        &listen,
        &tls_lines(&cert, &key),
    );
    // STARTTLS and MAIL in one write, in clear text; inside TLS, RCPT must find no
    // transaction (503), and EHLO must be asked for again first.
    let out = python(
        r#"
import socket, ssl
host, port = sys.argv[1].rsplit(":", 1)
raw = socket.create_connection((host, int(port)), timeout=30)
f = raw.makefile("rb")
def reply(f):
    lines = []
    while True:
        line = f.readline().decode()
        lines.append(line.strip())
        if line[3:4] != "-":
            return lines
reply(f)
raw.sendall(b"EHLO client.example\r\n")
reply(f)
raw.sendall(b"STARTTLS now\r\n")
with_arg = reply(f)
raw.sendall(b"STARTTLS\r\nMAIL FROM:<evil@x.example>\r\n")
started = reply(f)
ctx = ssl.create_default_context(cafile=sys.argv[2])
tls = ctx.wrap_socket(raw, server_hostname=host)
g = tls.makefile("rb")
tls.sendall(b"MAIL FROM:<a@x.example>\r\n")
no_helo = reply(g)
tls.sendall(b"EHLO client.example\r\n")
reply(g)
tls.sendall(b"RCPT TO:<b@y.example>\r\n")
rcpt = reply(g)
tls.sendall(b"STARTTLS\r\n")
again = reply(g)
tls.sendall(b"QUIT\r\n")
reply(g)
print(json.dumps({"with_arg": with_arg, "started": started, "no_helo": no_helo, "rcpt": rcpt,
                  "again": again}))
"#,
        &[&target, ca.cert_path().to_str().unwrap()],
        SCRIPT,
    );
    let first = |k: &str| out[k][0].as_str().unwrap().to_string();
    assert!(first("started").starts_with("220"), "{out}");
    assert!(first("no_helo").starts_with("503"), "EHLO forgotten: {out}");
    assert!(
        first("rcpt").starts_with("503"),
        "the pipelined MAIL was not run: {out}"
    );
    assert!(
        first("with_arg").starts_with("501"),
        "STARTTLS takes no argument: {out}"
    );
    assert!(
        first("again").starts_with("554"),
        "TLS is on already: {out}"
    );
    t.daemon
        .wait_log("bytes sent after STARTTLS", Duration::from_secs(10));
    assert!(t.daemon.terminate().success());
    assert_eq!(queued(&mut t.c), 0);
}

#[test]
fn sighup_serves_a_new_certificate_to_the_next_session_while_one_in_progress_completes() {
    if !tls_peer::ca_available("sighup_serves_a_new_certificate_to_the_next_session") {
        return;
    }
    let ca = TestCa::new("ingress-hup");
    let (old_cert, old_key) = ca.server_cert("127.0.0.1");
    let (new_cert, new_key) = ca.server_cert("127.0.0.1");
    let dir = crate::util::TempDir::new("ingress-hup-files");
    let (cert, key) = (dir.path("cert.pem"), dir.path("key.pem"));
    std::fs::copy(&old_cert, &cert).unwrap();
    std::fs::copy(&old_key, &key).unwrap();
    let (listen, target) = tcp("smtp");
    let mut t = open(Scenario::new("i-tls-hup"), &listen, &tls_lines(&cert, &key));
    let (go, ready) = (dir.path("go"), dir.path("ready"));
    // A session inside TLS with its transaction begun, waiting for the file `go`.
    let mut first = python_child(
        &format!(
            "{TLS_PRELUDE}\n{}",
            r#"
import os, time
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2])
s.ehlo("client.example")
mail = text(s.mail("a@x.example"))
open(sys.argv[4], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
rcpt = text(s.rcpt("b@y.example"))
data = text(s.data(b"From: a@x.example\r\nSubject: before\r\n\r\nBefore the reload.\r\n"))
s.quit()
print(json.dumps({"tls": tls, "mail": mail, "rcpt": rcpt, "data": data}))
"#
        ),
        &[
            &target,
            ca.cert_path().to_str().unwrap(),
            go.to_str().unwrap(),
            ready.to_str().unwrap(),
        ],
    );
    let stdout = drain(first.stdout.take().unwrap());
    let stderr = drain(first.stderr.take().unwrap());
    wait_until(
        SCRIPT,
        "the first session is inside TLS with MAIL said",
        || ready.exists(),
    );
    std::fs::copy(&new_cert, &cert).unwrap();
    std::fs::copy(&new_key, &key).unwrap();
    t.daemon.signal(libc::SIGHUP);
    t.daemon
        .wait_log("SIGHUP: reloaded", Duration::from_secs(10));
    let second = python(
        &format!(
            "{TLS_PRELUDE}\n{}",
            r#"
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2])
s.quit()
print(json.dumps({"tls": tls}))
"#
        ),
        &[&target, ca.cert_path().to_str().unwrap()],
        SCRIPT,
    );
    std::fs::write(&go, "").unwrap();
    let status = wait_child(&mut first, SCRIPT, "the first session");
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    assert!(status.success(), "{stdout}\n{stderr}");
    let first: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(
        first["data"][0], 250,
        "the session in progress completed: {first}"
    );
    assert_ne!(
        first["tls"]["serial"], second["tls"]["serial"],
        "the next session got the new certificate: {first} {second}"
    );
    let serial_of = |pem: &Path| -> String {
        let out = std::process::Command::new("openssl")
            .args(["x509", "-noout", "-serial", "-in"])
            .arg(pem)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .trim_start_matches("serial=")
            .to_string()
    };
    assert_eq!(
        second["tls"]["serial"].as_str().unwrap(),
        serial_of(&new_cert)
    );
    // A certificate that does not read keeps the one in use.
    std::fs::write(&cert, "not a certificate\n").unwrap();
    t.daemon.signal(libc::SIGHUP);
    t.daemon.wait_log(
        "cannot reload the certificate, keeping the old one",
        Duration::from_secs(10),
    );
    assert!(t.daemon.terminate().success());
}

#[test]
fn a_handshake_that_stops_half_way_or_garbage_instead_of_tls_ends_the_session_in_time() {
    if !tls_peer::ca_available("a_handshake_that_stops_half_way") {
        return;
    }
    let ca = TestCa::new("ingress-hostile");
    let (cert, key) = ca.server_cert("127.0.0.1");
    let (listen, target) = tcp("smtp");
    let port: u16 = target.rsplit_once(':').unwrap().1.parse().unwrap();
    let mut t = open(
        Scenario::new("i-tls-hostile"),
        &listen,
        &format!("{}TIMEOUT = 2s\n", tls_lines(&cert, &key)),
    );
    // Half a ClientHello (a record header announcing 512 bytes, then 5 of them), then
    // nothing: the session ends at TIMEOUT, not later.
    let mut stalled = Raw::connect(port, Duration::from_secs(20));
    stalled.command("EHLO client.example");
    assert_eq!(stalled.command("STARTTLS").0, 220);
    let started = Instant::now();
    stalled.send(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03]);
    assert!(stalled.ended(), "the session ended");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "within TIMEOUT and a margin: {:?}",
        started.elapsed()
    );
    // Garbage instead of a TLS record: the session ends at once.
    let mut garbage = Raw::connect(port, Duration::from_secs(20));
    garbage.command("EHLO client.example");
    assert_eq!(garbage.command("STARTTLS").0, 220);
    garbage.send(b"MAIL FROM:<a@x.example>\r\nthis is no TLS record\r\n");
    assert!(garbage.ended(), "the session ended");
    t.daemon
        .wait_log("TLS handshake failed", Duration::from_secs(10));
    // The daemon still serves.
    let mut fine = Raw::connect(port, Duration::from_secs(20));
    assert_eq!(fine.command("EHLO client.example").0, 250);
    assert!(t.daemon.terminate().success());
    assert_eq!(queued(&mut t.c), 0);
}

#[test]
fn a_certificate_chain_too_long_to_serve_keeps_the_ingress_from_starting() {
    if !tls_peer::ca_available("a_certificate_chain_too_long_to_serve") {
        return;
    }
    let ca = TestCa::new("ingress-chain");
    let (chain, key) = ca.long_chain("127.0.0.1", 100);
    let (listen, _) = tcp("smtp");
    let (s, _c) = Scenario::new("i-tls-chain")
        .section(
            "pepsi-ingress",
            &crate::util::ingress::section(&listen, &tls_lines(&chain, &key)),
        )
        .stages(crate::util::ingress::PIPELINE)
        .connect();
    let out = crate::util::run(
        &crate::util::bin("pepsi-ingress"),
        &["-c", s.conf.to_str().unwrap(), "serve"],
    );
    let err = crate::util::stderr(&out);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert_has!(err, "TLS_CERT");
    assert_has!(err, "more than the 16");
}
