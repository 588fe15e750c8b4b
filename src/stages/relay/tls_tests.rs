//! STARTTLS and AUTH against hostile and broken peers (§21), on a unix socket with a
//! rustls server of its own in the peer's thread (a certificate made with the `openssl`
//! command): a handshake that stops half-way ends at the command timeout, garbage
//! instead of a TLS record fails the connection, bytes sent after the 220 to STARTTLS
//! are refused, `may` tries again in clear text, and the password never goes out in
//! clear. Interoperation with a real MTA is the Postfix suite's (tests/).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::client::{Connection, Target, Timeouts};
use super::secure::{Credentials, Security};
use crate::tls::{self, Level};

/// A self-signed certificate and its key for `peer.test`, made once per test process.
fn certificate() -> (PathBuf, PathBuf) {
    static MADE: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    MADE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pepsi-relay-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let out = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
            ])
            .args(["-nodes", "-days", "2", "-subj", "/CN=peer.test"])
            .args(["-addext", "subjectAltName=DNS:peer.test", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("the openssl command (apt install openssl)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (cert, key)
    })
    .clone()
}

/// What the peer does after it answered STARTTLS with 220.
#[derive(Clone, Copy)]
enum After {
    /// Nothing at all: the handshake stops at the client's first flight.
    Silence,
    /// Bytes that are no TLS record.
    Garbage,
    /// A handshake, then EHLO (offering AUTH) and one AUTH command answered so.
    Tls { auth_reply: &'static str },
}

/// The peer's side of one connection: greeting, EHLO offering STARTTLS (or not),
/// STARTTLS answered 220 (with `extra` bytes right after it), then `after`. Returns
/// every line it read, in clear and inside TLS.
fn serve(stream: UnixStream, starttls: bool, extra: &str, after: After) -> Vec<String> {
    let mut lines = Vec::new();
    let mut input = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    let line = |input: &mut BufReader<UnixStream>, lines: &mut Vec<String>| {
        let mut l = String::new();
        input.read_line(&mut l).ok()?;
        (!l.is_empty()).then(|| {
            lines.push(l.trim_end().to_string());
            l
        })
    };
    let _ = out.write_all(b"220 peer ESMTP\r\n");
    if line(&mut input, &mut lines).is_none() {
        return lines;
    }
    let offer = if starttls {
        "250-peer\r\n250 STARTTLS\r\n"
    } else {
        "250-peer\r\n250 AUTH PLAIN\r\n"
    };
    let _ = out.write_all(offer.as_bytes());
    let Some(l) = line(&mut input, &mut lines) else {
        return lines;
    };
    if !l.starts_with("STARTTLS") {
        let _ = out.write_all(b"250 ok\r\n");
        while line(&mut input, &mut lines).is_some() {
            let _ = out.write_all(b"250 ok\r\n");
        }
        return lines;
    }
    let _ = out.write_all(format!("220 go ahead\r\n{extra}").as_bytes());
    match after {
        After::Silence => {
            let mut sink = [0u8; 4096];
            while matches!(input.read(&mut sink), Ok(n) if n > 0) {}
        }
        After::Garbage => {
            // The client's first flight, then an answer that is no TLS record.
            let mut sink = [0u8; 4096];
            let _ = input.read(&mut sink);
            let _ = out.write_all(b"this is no TLS record at all\r\n");
            while matches!(input.read(&mut sink), Ok(n) if n > 0) {}
        }
        After::Tls { auth_reply } => {
            let (cert, key) = certificate();
            let config = tls::server_config(&cert, &key).unwrap();
            let conn = rustls::ServerConnection::new(config).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, out);
            let read_line = |tls: &mut rustls::StreamOwned<_, UnixStream>| {
                let mut l = Vec::new();
                let mut b = [0u8; 1];
                while tls.read(&mut b).ok()? == 1 {
                    l.push(b[0]);
                    if b[0] == b'\n' {
                        return Some(String::from_utf8_lossy(&l).trim_end().to_string());
                    }
                }
                None
            };
            while let Some(l) = read_line(&mut tls) {
                lines.push(format!("tls: {l}"));
                let reply = if l.starts_with("EHLO") {
                    "250-peer\r\n250 AUTH PLAIN LOGIN\r\n"
                } else if l.starts_with("AUTH") {
                    auth_reply
                } else {
                    "250 ok\r\n"
                };
                if tls.write_all(reply.as_bytes()).is_err() {
                    break;
                }
            }
        }
    }
    lines
}

/// A peer on a fresh unix socket serving `connections` connections in turn, the
/// first as `first`, the others without STARTTLS.
fn peer(
    starttls: bool,
    extra: &'static str,
    first: After,
    connections: usize,
) -> (Target, std::thread::JoinHandle<Vec<Vec<String>>>) {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "pepsi-relay-tls-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let target = Target::Unix(path.clone());
    let thread = std::thread::spawn(move || {
        let mut all = Vec::new();
        for n in 0..connections {
            let (stream, _) = listener.accept().unwrap();
            all.push(serve(stream, starttls && n == 0, extra, first));
        }
        let _ = std::fs::remove_file(&path);
        all
    });
    (target, thread)
}

fn quick(command: Duration) -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(5),
        command,
        data: Duration::from_secs(5),
        data_done: Duration::from_secs(5),
    }
}

fn security(level: Level, auth: bool) -> Security {
    Security {
        level,
        wrapper: false,
        config: Some(tls::client_config(level, None).unwrap()),
        name: Some(tls::server_name("peer.test").unwrap()),
        auth: auth.then(|| {
            Arc::new(Credentials {
                user: "relay@example.net".into(),
                password: "Hunter2-secret".into(),
            })
        }),
    }
}

fn open(target: &Target, command: Duration, security: &Security) -> Result<Connection, String> {
    let t = quick(command);
    super::secure::open(
        target,
        false,
        "me.test",
        t,
        Instant::now() + t.budget(),
        security,
    )
    .map_err(|e| e.0)
}

#[test]
fn a_handshake_that_stops_half_way_ends_at_the_command_timeout() {
    let (target, server) = peer(true, "", After::Silence, 1);
    let started = Instant::now();
    let e = open(
        &target,
        Duration::from_millis(700),
        &security(Level::Encrypt, false),
    )
    .err()
    .unwrap();
    assert!(e.contains("TLS handshake failed"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    drop(server);
}

#[test]
fn garbage_instead_of_a_tls_record_fails_the_connection_and_may_goes_on_in_clear_text() {
    let (target, server) = peer(true, "", After::Garbage, 1);
    let e = open(
        &target,
        Duration::from_secs(5),
        &security(Level::Encrypt, false),
    )
    .err()
    .unwrap();
    assert!(e.contains("TLS handshake failed"), "{e}");
    server.join().unwrap();
    // `may`: the same failure, then a new connection in clear text.
    let (target, server) = peer(true, "", After::Garbage, 2);
    let c = open(
        &target,
        Duration::from_secs(5),
        &security(Level::May, false),
    )
    .unwrap();
    assert!(c.tls.is_none());
    drop(c);
    let lines = server.join().unwrap();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[1].iter().all(|l| !l.starts_with("STARTTLS")),
        "{lines:?}"
    );
}

#[test]
fn bytes_sent_after_the_220_to_starttls_are_refused_not_read_as_encrypted() {
    let (target, server) = peer(true, "250 injected\r\n", After::Silence, 1);
    let e = open(
        &target,
        Duration::from_secs(5),
        &security(Level::Encrypt, false),
    )
    .err()
    .unwrap();
    assert!(e.contains("sent more after its reply to STARTTLS"), "{e}");
    drop(server);
}

#[test]
fn without_starttls_encrypt_refuses_and_may_goes_on_in_clear_without_ever_sending_auth() {
    let (target, server) = peer(false, "", After::Silence, 1);
    let e = open(
        &target,
        Duration::from_secs(5),
        &security(Level::Encrypt, false),
    )
    .err()
    .unwrap();
    assert!(e.contains("does not offer STARTTLS"), "{e}");
    drop(server);
    // `may` with a login: the peer offers AUTH in clear text; the relay refuses to
    // send it, and the password never goes out.
    let (target, server) = peer(false, "", After::Silence, 1);
    let e = open(&target, Duration::from_secs(5), &security(Level::May, true))
        .err()
        .unwrap();
    assert!(e.contains("never sent in clear text"), "{e}");
    let lines = server.join().unwrap();
    assert!(lines[0].iter().all(|l| !l.starts_with("AUTH")), "{lines:?}");
}

#[test]
fn inside_tls_auth_plain_logs_in_and_a_refusal_says_so_without_the_password() {
    let (target, server) = peer(
        true,
        "",
        After::Tls {
            auth_reply: "235 2.7.0 ok\r\n",
        },
        1,
    );
    let c = open(
        &target,
        Duration::from_secs(5),
        &security(Level::Encrypt, true),
    )
    .unwrap();
    let tls = c.tls.clone().unwrap();
    assert!(tls.version.starts_with("TLSv1."), "{tls:?}");
    assert!(!tls.verified);
    drop(c);
    let lines = server.join().unwrap();
    let auth: Vec<&String> = lines[0].iter().filter(|l| l.contains("AUTH")).collect();
    assert_eq!(auth.len(), 1, "{lines:?}");
    assert!(
        auth[0].starts_with("tls: AUTH PLAIN "),
        "inside TLS: {lines:?}"
    );
    let (target, server) = peer(
        true,
        "",
        After::Tls {
            auth_reply: "535 5.7.8 Error: authentication failed\r\n",
        },
        1,
    );
    let e = open(
        &target,
        Duration::from_secs(5),
        &security(Level::Encrypt, true),
    )
    .err()
    .unwrap();
    assert!(e.starts_with(super::secure::LOGIN_REFUSED), "{e}");
    assert!(e.contains("535") && !e.contains("relay@example.net"), "{e}");
    assert!(!e.contains("Hunter2"), "{e}");
    drop(server);
}
