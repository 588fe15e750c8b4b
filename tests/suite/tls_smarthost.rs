//! The TLS smarthost of `util::tls_peer`, checked with clients that are not ours:
//! Python's `smtplib` and `ssl` (OpenSSL), and `openssl verify -x509_strict`. Its
//! STARTTLS certificate verifies against the test CA for the name it is made for and
//! fails for another name or an unknown CA; AUTH is offered only after STARTTLS and
//! refused before it; AUTH PLAIN and LOGIN take the right password (235) and refuse a
//! wrong one (535), and the message of an authenticated session lands in its
//! mailbox, its `Received:` line naming TLS and the user, the log the TLS session and
//! `sasl_username=`; other domains pass the relay check only after AUTH, and with
//! `auth_required` even `local.test` does; without a certificate nothing offers
//! STARTTLS, AUTH is offered in clear text and mail arrives in clear text; the
//! implicit-TLS port speaks TLS from the first byte; a chain of 100 intermediate CAs is
//! served whole. These are the peer the relay stage's TLS and AUTH tests rely on:
//! each says what a client of ours will meet there. Needs root, Postfix and Cyrus
//! SASL's tools; elsewhere each test says why and passes, unless `CI` is set.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::util::ingress::python;
use crate::util::postfix::DOMAIN;
use crate::util::tls_peer::{self, NAME, Smarthost, TestCa, TlsOptions};
use crate::util::{assert_has, assert_lacks, stderr};

/// The longest a client script may take.
const SCRIPT: Duration = Duration::from_secs(60);

/// The longest a message may take to reach its mailbox.
const DELIVERY: Duration = Duration::from_secs(30);

/// The user and password of the smarthosts that take AUTH.
const USER: &str = "relay-user";
const PASSWORD: &str = "s3cret pass";

/// What the client scripts add to `util::ingress`'s prelude: STARTTLS and implicit
/// TLS with a certificate verified for a name of the test's choosing (smtplib's own
/// verify it for the address it connected to, 127.0.0.1), AUTH PLAIN and LOGIN by
/// hand (each reply seen), and the EHLO keywords.
const TLS: &str = r#"
import base64
import socket
import ssl


def context(cafile):
    ctx = ssl.create_default_context(cafile=cafile)
    # RFC 5280's rules for every certificate of the chain, as strict verifiers such
    # as webpki (and Python 3.13 by default) apply them.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def keywords(session):
    """The lines of the last EHLO reply after the greeting line."""
    return session.ehlo_resp.decode().split("\n")[1:]


def tls_facts(sock):
    # Public from Python 3.13; Debian 12's 3.11 has it on the internal object.
    chain = getattr(sock, "get_unverified_chain", None) or sock._sslobj.get_unverified_chain
    return {"ok": True, "version": sock.version(), "chain": len(chain())}


def starttls(session, cafile, name):
    """STARTTLS, the certificate verified for `name`, then EHLO again; the outcome."""
    code, msg = session.docmd("STARTTLS")
    if code != 220:
        return {"ok": False, "error": f"{code} {msg.decode()}"}
    try:
        session.sock = context(cafile).wrap_socket(session.sock, server_hostname=name)
    except ssl.SSLError as e:
        return {"ok": False, "error": str(e)}
    session.file = None
    session.helo_resp = session.ehlo_resp = None
    session.esmtp_features = {}
    session.does_esmtp = False
    code, _ = session.ehlo("client.example")
    assert code == 250, code
    return tls_facts(session.sock)


def wrapped(port, cafile, name):
    """A greeted session on the implicit-TLS port, verified for `name`."""
    raw = socket.create_connection(("127.0.0.1", int(port)), timeout=30)
    session = smtplib.SMTP(timeout=30)
    session.sock = context(cafile).wrap_socket(raw, server_hostname=name)
    code, _ = session.getreply()
    assert code == 220, code
    code, _ = session.ehlo("client.example")
    assert code == 250, code
    return session


def greeting_in_clear(port):
    """What a client that does not speak TLS first reads within 3 s (None: nothing)."""
    raw = socket.create_connection(("127.0.0.1", int(port)), timeout=3)
    try:
        return raw.recv(100).decode("latin-1")
    except socket.timeout:
        return None
    finally:
        raw.close()


def b64(text):
    return base64.b64encode(text.encode()).decode()


def auth_plain(session, user, password):
    return text(session.docmd("AUTH", "PLAIN " + b64(f"\0{user}\0{password}")))


def auth_login(session, user, password):
    reply = text(session.docmd("AUTH", "LOGIN"))
    for word in (user, password):
        if reply[0] != 334:
            break
        reply = text(session.docmd(b64(word)))
    return reply


MESSAGE = b"From: a@x.example\r\nSubject: over TLS\r\n\r\nOne message.\r\n"
"#;

/// Runs a client script: [`TLS`], then `script`, with `args`.
#[track_caller]
fn client(script: &str, args: &[&str]) -> Value {
    python(&format!("{TLS}\n{script}"), args, SCRIPT)
}

/// A smarthost with the CA's certificate for `name`, offering AUTH for [`USER`], and
/// the CA; none when it cannot run here.
fn with_cert(tag: &str, name: &str, wrapper_port: bool) -> Option<(Smarthost, TestCa)> {
    if !tls_peer::available(tag) {
        return None;
    }
    let ca = TestCa::new(tag);
    let options = TlsOptions {
        cert: Some(ca.server_cert(name)),
        auth: Some((USER, PASSWORD)),
        wrapper_port,
        ..TlsOptions::default()
    };
    Some((Smarthost::start(tag, &options, &["bob"]), ca))
}

/// `127.0.0.1:PORT` of the smarthost's STARTTLS `smtpd`.
fn target(host: &Smarthost) -> String {
    format!("127.0.0.1:{}", host.port)
}

/// The lines of a JSON array of text.
fn lines(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list: {v}"))
        .iter()
        .map(|l| l.as_str().unwrap().to_string())
        .collect()
}

/// The reply code of a `[code, text]` pair.
fn code(reply: &Value) -> u64 {
    reply[0]
        .as_u64()
        .unwrap_or_else(|| panic!("a reply: {reply}"))
}

#[test]
fn starttls_is_offered_and_the_certificate_verifies_for_the_smarthosts_name() {
    let Some((host, ca)) = with_cert("tls-starttls", NAME, false) else {
        return;
    };
    let out = client(
        r#"
s = smtp(sys.argv[1])
before = keywords(s)
auth_in_clear = auth_plain(s, sys.argv[4], sys.argv[5])
tls = starttls(s, sys.argv[2], sys.argv[3])
after = keywords(s)
s.quit()
print(json.dumps({"before": before, "auth_in_clear": auth_in_clear, "tls": tls, "after": after}))
"#,
        &[
            &target(&host),
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    let before = lines(&out["before"]);
    assert_has!(before, &"STARTTLS".to_string(), "{out}");
    assert!(
        !before.iter().any(|k| k.starts_with("AUTH")),
        "no AUTH before STARTTLS: {out}"
    );
    assert_eq!(
        code(&out["auth_in_clear"]),
        503,
        "AUTH before STARTTLS: {out}"
    );
    assert_eq!(out["tls"]["ok"], true, "{out}");
    assert!(
        out["tls"]["version"]
            .as_str()
            .unwrap()
            .starts_with("TLSv1."),
        "{out}"
    );
    // The server's certificate alone: the CA is the client's trust anchor.
    assert_eq!(out["tls"]["chain"], 1, "{out}");
    let after = lines(&out["after"]);
    assert_has!(after, &"AUTH PLAIN LOGIN".to_string(), "{out}");
    assert_lacks!(after, &"STARTTLS".to_string(), "{out}");
    let log = host.maillog();
    assert_has!(log, "TLS connection established from localhost[127.0.0.1]");
    // Nothing of the instance is amiss (tlsmgr missing, say, disables TLS with a
    // warning).
    assert_lacks!(log, "warning:");
}

/// Verifies the smarthost's certificate for each of `names` with the CA `cafile`, a
/// session each; the outcomes.
fn verify_names(host: &Smarthost, cafile: &str, names: &[&str]) -> Value {
    let mut args = vec![target(host), cafile.to_string()];
    args.extend(names.iter().map(|n| n.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    client(
        r#"
out = []
for name in sys.argv[3:]:
    s = smtp(sys.argv[1])
    out.append(starttls(s, sys.argv[2], name))
    s.close()
print(json.dumps(out))
"#,
        &args,
    )
}

#[test]
fn a_certificate_for_another_name_fails_verification_for_the_smarthosts_name() {
    let Some((host, ca)) = with_cert("tls-other-name", "other.pepsi.test", false) else {
        return;
    };
    let out = verify_names(
        &host,
        ca.cert_path().to_str().unwrap(),
        &[NAME, "other.pepsi.test"],
    );
    assert_eq!(out[0]["ok"], false, "{out}");
    assert_has!(
        out[0]["error"].as_str().unwrap(),
        "Hostname mismatch",
        "{out}"
    );
    // The same certificate verifies for the name it is for: the failure is the name's.
    assert_eq!(out[1]["ok"], true, "{out}");
}

#[test]
fn a_certificate_from_an_unknown_ca_fails_verification() {
    if !tls_peer::available("tls-unknown-ca") {
        return;
    }
    let trusted = TestCa::new("tls-trusted");
    let unknown = TestCa::new("tls-unknown");
    let options = TlsOptions {
        cert: Some(unknown.server_cert(NAME)),
        ..TlsOptions::default()
    };
    let host = Smarthost::start("tls-unknown-ca", &options, &[]);
    let out = verify_names(&host, trusted.cert_path().to_str().unwrap(), &[NAME]);
    assert_eq!(out[0]["ok"], false, "{out}");
    assert_has!(
        out[0]["error"].as_str().unwrap(),
        "unable to get local issuer certificate",
        "{out}"
    );
    let out = verify_names(&host, unknown.cert_path().to_str().unwrap(), &[NAME]);
    assert_eq!(out[0]["ok"], true, "its own CA: {out}");
}

#[test]
fn auth_plain_with_the_right_password_is_accepted_and_the_message_delivered() {
    let Some((host, ca)) = with_cert("tls-auth-plain", NAME, false) else {
        return;
    };
    let out = client(
        r#"
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2], sys.argv[3])
auth = auth_plain(s, sys.argv[4], sys.argv[5])
sent = transaction(s, "a@x.example", ["bob@local.test"], MESSAGE)
s.quit()
print(json.dumps({"tls": tls, "auth": auth, "sent": sent}))
"#,
        &[
            &target(&host),
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    assert_eq!(out["tls"]["ok"], true, "{out}");
    assert_eq!(code(&out["auth"]), 235, "{out}");
    assert_eq!(code(&out["sent"]["data"][0]), 250, "{out}");
    let message = String::from_utf8(host.wait_mailbox("bob", 1, DELIVERY).remove(0)).unwrap();
    let username = host.sasl_username.clone().unwrap();
    assert_eq!(username, format!("{USER}@{NAME}"));
    assert_has!(message, "using TLSv1.");
    assert_has!(message, &format!("(Authenticated sender: {username})"));
    // Postfix's protocol name: ESMTP, with TLS (S), authenticated (A).
    assert_has!(message, "with ESMTPSA id");
    assert_has!(message, "One message.");
    assert_has!(
        host.maillog(),
        &format!("sasl_method=PLAIN, sasl_username={username}")
    );
}

#[test]
fn a_wrong_password_is_refused_with_535_and_login_takes_the_right_one() {
    let Some((host, ca)) = with_cert("tls-auth-wrong", NAME, false) else {
        return;
    };
    let out = client(
        r#"
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2], sys.argv[3])
wrong = auth_plain(s, sys.argv[4], "not " + sys.argv[5])
unknown = auth_login(s, "nobody-" + sys.argv[4], sys.argv[5])
right = auth_login(s, sys.argv[4], sys.argv[5])
s.quit()
print(json.dumps({"tls": tls, "wrong": wrong, "unknown": unknown, "right": right}))
"#,
        &[
            &target(&host),
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    assert_eq!(out["tls"]["ok"], true, "{out}");
    assert_eq!(code(&out["wrong"]), 535, "{out}");
    assert_eq!(code(&out["unknown"]), 535, "{out}");
    assert_eq!(code(&out["right"]), 235, "{out}");
    assert_has!(
        host.maillog(),
        &format!(
            "SASL PLAIN authentication failed: authentication failure, sasl_username={}",
            host.sasl_username.as_deref().unwrap()
        )
    );
}

#[test]
fn another_domain_passes_the_relay_check_only_after_auth() {
    let Some((host, ca)) = with_cert("tls-relay", NAME, false) else {
        return;
    };
    let out = client(
        r#"
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2], sys.argv[3])
s.mail("a@x.example")
before = {r: text(s.rcpt(r)) for r in ("far@elsewhere.test", "bob@local.test")}
s.rset()
auth = auth_plain(s, sys.argv[4], sys.argv[5])
s.mail("a@x.example")
after = text(s.rcpt("far@elsewhere.test"))
s.quit()
print(json.dumps({"tls": tls, "before": before, "auth": auth, "after": after}))
"#,
        &[
            &target(&host),
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    assert_eq!(out["tls"]["ok"], true, "{out}");
    let refused = &out["before"]["far@elsewhere.test"];
    assert_eq!(code(refused), 554, "{out}");
    assert_has!(refused[1].as_str().unwrap(), "Relay access denied", "{out}");
    assert_eq!(code(&out["before"][format!("bob@{DOMAIN}")]), 250, "{out}");
    assert_eq!(code(&out["auth"]), 235, "{out}");
    // Past the relay check, the address meets the error transport: nothing leaves
    // the machine.
    assert_eq!(code(&out["after"]), 550, "{out}");
    assert_has!(
        out["after"][1].as_str().unwrap(),
        "no mail leaves a test instance",
        "{out}"
    );
}

#[test]
fn auth_required_refuses_local_mail_until_auth() {
    if !tls_peer::available("tls-auth-required") {
        return;
    }
    let ca = TestCa::new("tls-auth-required");
    let options = TlsOptions {
        cert: Some(ca.server_cert(NAME)),
        auth: Some((USER, PASSWORD)),
        auth_required: true,
        ..TlsOptions::default()
    };
    let host = Smarthost::start("tls-auth-required", &options, &["bob"]);
    let out = client(
        r#"
s = smtp(sys.argv[1])
tls = starttls(s, sys.argv[2], sys.argv[3])
s.mail("a@x.example")
before = text(s.rcpt("bob@local.test"))
s.rset()
auth = auth_plain(s, sys.argv[4], sys.argv[5])
sent = transaction(s, "a@x.example", ["bob@local.test"], MESSAGE)
s.quit()
print(json.dumps({"tls": tls, "before": before, "auth": auth, "sent": sent}))
"#,
        &[
            &target(&host),
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    assert_eq!(out["tls"]["ok"], true, "{out}");
    assert_eq!(code(&out["before"]), 554, "{out}");
    assert_eq!(code(&out["auth"]), 235, "{out}");
    assert_eq!(code(&out["sent"]["data"][0]), 250, "{out}");
    host.wait_mailbox("bob", 1, DELIVERY);
}

#[test]
fn without_a_certificate_no_starttls_is_offered_and_auth_and_mail_go_in_clear_text() {
    if !tls_peer::available("tls-clear") {
        return;
    }
    let options = TlsOptions {
        auth: Some((USER, PASSWORD)),
        ..TlsOptions::default()
    };
    let host = Smarthost::start("tls-clear", &options, &["bob"]);
    let out = client(
        r#"
s = smtp(sys.argv[1])
offered = keywords(s)
starttls = text(s.docmd("STARTTLS"))
auth = auth_plain(s, sys.argv[2], sys.argv[3])
sent = transaction(s, "a@x.example", ["bob@local.test"], MESSAGE)
s.quit()
print(json.dumps({"offered": offered, "starttls": starttls, "auth": auth, "sent": sent}))
"#,
        &[&target(&host), USER, PASSWORD],
    );
    let offered = lines(&out["offered"]);
    assert_lacks!(offered, &"STARTTLS".to_string(), "{out}");
    assert_has!(offered, &"AUTH PLAIN LOGIN".to_string(), "{out}");
    assert_eq!(code(&out["starttls"]), 502, "{out}");
    assert_eq!(code(&out["auth"]), 235, "{out}");
    assert_eq!(code(&out["sent"]["data"][0]), 250, "{out}");
    let message = String::from_utf8(host.wait_mailbox("bob", 1, DELIVERY).remove(0)).unwrap();
    assert_lacks!(message, "using TLS");
    assert_has!(message, "with ESMTPA id");
    assert_lacks!(host.maillog(), "TLS connection established");
}

#[test]
fn the_wrapper_port_speaks_tls_from_the_first_byte() {
    let Some((host, ca)) = with_cert("tls-wrapper", NAME, true) else {
        return;
    };
    let port = host.wrapper_port.unwrap().to_string();
    let out = client(
        r#"
in_clear = greeting_in_clear(sys.argv[1])
s = wrapped(sys.argv[1], sys.argv[2], sys.argv[3])
tls = tls_facts(s.sock)
offered = keywords(s)
auth = auth_plain(s, sys.argv[4], sys.argv[5])
sent = transaction(s, "a@x.example", ["bob@local.test"], MESSAGE)
s.quit()
print(json.dumps({"in_clear": in_clear, "tls": tls, "offered": offered, "auth": auth,
                  "sent": sent}))
"#,
        &[
            &port,
            ca.cert_path().to_str().unwrap(),
            NAME,
            USER,
            PASSWORD,
        ],
    );
    // It waits for the client's TLS hello: no greeting in clear text.
    assert_eq!(out["in_clear"], Value::Null, "{out}");
    assert_eq!(out["tls"]["ok"], true, "{out}");
    let offered = lines(&out["offered"]);
    assert_lacks!(offered, &"STARTTLS".to_string(), "{out}");
    assert_has!(offered, &"AUTH PLAIN LOGIN".to_string(), "{out}");
    assert_eq!(code(&out["auth"]), 235, "{out}");
    assert_eq!(code(&out["sent"]["data"][0]), 250, "{out}");
    let message = String::from_utf8(host.wait_mailbox("bob", 1, DELIVERY).remove(0)).unwrap();
    assert_has!(message, "using TLSv1.");
    assert_has!(message, "with ESMTPSA id");
}

#[test]
fn a_chain_of_100_intermediate_cas_is_served_whole() {
    if !tls_peer::available("tls-long-chain") {
        return;
    }
    let ca = TestCa::new("tls-long-chain");
    let options = TlsOptions {
        cert: Some(ca.long_chain(NAME, 100)),
        ..TlsOptions::default()
    };
    let host = Smarthost::start("tls-long-chain", &options, &[]);
    let out = verify_names(&host, ca.cert_path().to_str().unwrap(), &[NAME]);
    // OpenSSL's default depth allows 100 intermediates: the chain verifies.
    assert_eq!(out[0]["ok"], true, "{out}");
    assert_eq!(
        out[0]["chain"], 101,
        "the server's and 100 intermediates: {out}"
    );
}

/// `openssl verify -x509_strict -purpose sslserver` of `cert` for `name` (an IP
/// address is checked as one) with `ca` trusted and `untrusted` intermediates: the
/// output when it verifies, the error otherwise.
fn strict_verify(
    ca: &TestCa,
    cert: &std::path::Path,
    untrusted: Option<&std::path::Path>,
    name: &str,
) -> Result<String, String> {
    let check = if name.parse::<std::net::IpAddr>().is_ok() {
        "-verify_ip"
    } else {
        "-verify_hostname"
    };
    let mut cmd = Command::new(tls_peer::OPENSSL);
    cmd.args([
        "verify",
        "-x509_strict",
        "-purpose",
        "sslserver",
        check,
        name,
    ])
    .arg("-CAfile")
    .arg(ca.cert_path());
    if let Some(chain) = untrusted {
        cmd.arg("-untrusted").arg(chain);
    }
    let out = cmd.arg(cert).stdin(Stdio::null()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

#[test]
fn the_test_cas_certificates_pass_openssls_strict_verification() {
    if !tls_peer::ca_available("tls-ca") {
        return;
    }
    let ca = TestCa::new("tls-ca");
    let other = TestCa::new("tls-ca-other");
    let (cert, key) = ca.server_cert(NAME);
    strict_verify(&ca, &cert, None, NAME).unwrap();
    assert_has!(
        strict_verify(&ca, &cert, None, "other.pepsi.test").unwrap_err(),
        "hostname mismatch"
    );
    let (foreign, _) = other.server_cert(NAME);
    assert_has!(
        strict_verify(&ca, &foreign, None, NAME).unwrap_err(),
        "unable to get local issuer certificate"
    );
    let (ip, _) = ca.server_cert("127.0.0.1");
    strict_verify(&ca, &ip, None, "127.0.0.1").unwrap();
    assert!(strict_verify(&ca, &ip, None, "127.0.0.2").is_err());
    // The chain file is the server's certificate then its intermediates: verified as
    // a client gets it, the server's first and the rest untrusted.
    let (chain, _) = ca.long_chain(NAME, 3);
    let text = std::fs::read_to_string(&chain).unwrap();
    assert_eq!(text.matches("-----BEGIN CERTIFICATE-----").count(), 4);
    strict_verify(&ca, &chain, Some(&chain), NAME).unwrap();
    // Without its intermediates the server's certificate does not reach the CA.
    assert!(strict_verify(&ca, &chain, None, NAME).is_err());
    // PKCS#8, readable by its owner alone.
    use std::os::unix::fs::PermissionsExt;
    let pem = std::fs::read_to_string(&key).unwrap();
    assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----\n"), "{pem}");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}
