//! The TLS benchmark: `cargo bench --bench tls` (release build; as root, for the
//! private Postfix). Prints, measured in one run and never asserted:
//!
//! 1. **The relay over a kept connection**, to one private Postfix (the tests'
//!    `tls_peer::Smarthost`, a certificate from a test CA, delivering into maildirs):
//!    `BENCH_RELAY_MESSAGES` (default 2,000) messages of 4 KiB to one recipient each,
//!    one after the other over one connection (RSET between), as one relay worker
//!    sends them, first in clear text (`TLS = none`), then inside TLS with the
//!    certificate verified (`TLS = verify`); messages/s of each and their ratio
//!    (target ≥ 0.8).
//! 2. **The ingress**, `pepsi-ingress` with an SMTP listener and a certificate, against
//!    a throwaway PostgreSQL (the tests' cluster): sessions/s of `BENCH_CLIENTS`
//!    (default 8) clients each opening session after session for `BENCH_SECONDS`
//!    (default 5) seconds — greeting, EHLO, QUIT in clear; greeting, EHLO, STARTTLS and
//!    its handshake, EHLO, QUIT with TLS — and accepted messages/s over kept sessions,
//!    `BENCH_INGRESS_MESSAGES` (default 4,000) 4 KiB messages, in clear and inside
//!    TLS.
//!
//! The clients are rustls (the crate's own `tls` module, at `encrypt`: no certificate
//! check for the ingress, whose name is 127.0.0.1) and plain sockets.

#[allow(unused_imports, unused_macros)]
#[path = "../tests/util/mod.rs"]
mod util;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pepsi::stages::relay::client::{Target, Timeouts};
use pepsi::stages::relay::secure::{self, Security};
use pepsi::stages::relay::transaction::{Envelope, deliver};
use pepsi::tls::{self, Level};
use rustls::{ClientConfig, ClientConnection, StreamOwned};

use util::ingress::{Ingress, PIPELINE, free_port, section};
use util::scenario::Scenario;
use util::tls_peer::{NAME, Smarthost, TestCa, TlsOptions};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A body of about 4 KiB, whole lines.
fn body() -> Vec<u8> {
    let line = b"The quick brown fox jumps over the lazy dog, again and again.\r\n";
    line.repeat(4096 / line.len())
}

// ---------------------------------------------------------------------------------
// The relay.

/// Sends `n` messages over one connection with `security`; messages/s.
fn relay_run(port: u16, n: u64, security: &Security) -> f64 {
    let target = Target::Tcp {
        host: "127.0.0.1".into(),
        port,
    };
    let timeouts = Timeouts {
        connect: Duration::from_secs(10),
        command: Duration::from_secs(30),
        data: Duration::from_secs(30),
        data_done: Duration::from_secs(30),
    };
    let headers = b"From: <bench@origin.example>\r\nTo: <r@local.test>\r\nSubject: relay\r\n";
    let body = body();
    let rcpt = vec!["r@local.test".to_string()];
    let envelope = Envelope {
        mail_from: "bench@origin.example",
        rcpt_to: &rcpt,
        dsn: None,
        client_ip: None,
        auth_user: None,
        lmtp: false,
    };
    let started = Instant::now();
    let mut c = secure::open(
        &target,
        false,
        "bench.example",
        timeouts,
        Instant::now() + timeouts.budget(),
        security,
    )
    .unwrap_or_else(|e| panic!("cannot open: {}", e.0));
    for i in 0..n {
        c.set_deadline(Instant::now() + timeouts.budget());
        if i > 0 {
            c.reset().unwrap_or_else(|e| panic!("RSET: {}", e.0));
        }
        let results = deliver(&mut c, &envelope, headers, &body)
            .unwrap_or_else(|(e, _)| panic!("message {i}: {}", e.0));
        assert!(
            results.iter().all(|(_, r)| r.kind() == 0),
            "message {i} not taken: {results:?}"
        );
    }
    c.quit();
    n as f64 / started.elapsed().as_secs_f64()
}

fn relay(out: &mut impl Write) {
    let n = env_number("BENCH_RELAY_MESSAGES", 2_000);
    let ca = TestCa::new("bench-relay");
    let host = Smarthost::start(
        "bench-relay",
        &TlsOptions {
            cert: Some(ca.server_cert(NAME)),
            ..TlsOptions::default()
        },
        &["r"],
    );
    let clear = relay_run(host.port, n, &Security::none());
    let roots = tls::roots(Some(&ca.cert_path())).unwrap();
    let verifying = Security {
        level: Level::Verify,
        wrapper: false,
        config: Some(tls::client_config(Level::Verify, Some(roots)).unwrap()),
        name: Some(tls::server_name(NAME).unwrap()),
        auth: None,
    };
    let inside = relay_run(host.port, n, &verifying);
    host.wait_mailbox("r", (2 * n) as usize, Duration::from_secs(300));
    writeln!(
        out,
        "relay, one kept connection to a private Postfix, {n} messages of 4 KiB each way:\n  \
         clear text {clear:.0} messages/s, TLS (verified) {inside:.0} messages/s: ratio {:.2} (target >= 0.80)",
        inside / clear
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------
// The ingress.

/// A client's stream: clear, or TLS after STARTTLS.
enum Io {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
    Gone,
}

impl Read for Io {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Io::Plain(s) => s.read(buf),
            Io::Tls(s) => s.read(buf),
            Io::Gone => Ok(0),
        }
    }
}

impl Write for Io {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Io::Plain(s) => s.write(buf),
            Io::Tls(s) => s.write(buf),
            Io::Gone => Ok(0),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Io::Plain(s) => s.flush(),
            Io::Tls(s) => s.flush(),
            Io::Gone => Ok(()),
        }
    }
}

/// One SMTP session with the ingress.
struct Smtp {
    io: BufReader<Io>,
    line: String,
}

impl Smtp {
    /// Greeting and EHLO; with `tls`, STARTTLS, its handshake and EHLO again.
    fn open(port: u16, tls: Option<&Arc<ClientConfig>>) -> Smtp {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the ingress");
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut s = Smtp {
            io: BufReader::new(Io::Plain(stream)),
            line: String::new(),
        };
        assert_eq!(s.reply(), 220);
        assert_eq!(s.command("EHLO bench.example"), 250);
        if let Some(config) = tls {
            assert_eq!(s.command("STARTTLS"), 220);
            let Io::Plain(stream) = std::mem::replace(s.io.get_mut(), Io::Gone) else {
                unreachable!()
            };
            let conn = tls::client(config, tls::server_name("127.0.0.1").unwrap()).unwrap();
            let mut tls = StreamOwned::new(conn, stream);
            tls::handshake(&mut tls.conn, &mut tls.sock).unwrap();
            s.io = BufReader::new(Io::Tls(Box::new(tls)));
            assert_eq!(s.command("EHLO bench.example"), 250);
        }
        s
    }

    fn reply(&mut self) -> u16 {
        loop {
            self.line.clear();
            let n = self.io.read_line(&mut self.line).expect("a reply");
            assert!(n > 0, "the ingress closed the connection");
            let code = self.line.get(..3).and_then(|c| c.parse().ok()).unwrap_or(0);
            if self.line.as_bytes().get(3) != Some(&b'-') {
                return code;
            }
        }
    }

    fn command(&mut self, line: &str) -> u16 {
        let io = self.io.get_mut();
        io.write_all(format!("{line}\r\n").as_bytes()).unwrap();
        io.flush().unwrap();
        self.reply()
    }

    /// One message, MAIL, RCPT and DATA pipelined: was it accepted?
    fn send(&mut self, data: &[u8]) -> bool {
        let io = self.io.get_mut();
        io.write_all(b"MAIL FROM:<bench@origin.example>\r\nRCPT TO:<r@dest.example>\r\nDATA\r\n")
            .unwrap();
        io.flush().unwrap();
        let ok = self.reply() == 250 && self.reply() == 250;
        if self.reply() != 354 {
            return false;
        }
        let io = self.io.get_mut();
        io.write_all(data).unwrap();
        io.flush().unwrap();
        ok && self.reply() == 250
    }

    fn quit(mut self) {
        let _ = self.command("QUIT");
    }
}

/// Sessions/s of `clients` threads opening sessions for `seconds`.
fn sessions(port: u16, clients: u64, seconds: u64, tls: Option<&Arc<ClientConfig>>) -> f64 {
    let done = AtomicU64::new(0);
    let until = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..clients {
            scope.spawn(|| {
                while Instant::now() < until {
                    Smtp::open(port, tls).quit();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Accepted messages/s of `clients` kept sessions sending `total` messages.
fn messages(port: u16, clients: u64, total: u64, tls: Option<&Arc<ClientConfig>>) -> f64 {
    let tickets = AtomicU64::new(0);
    let mut data = b"From: <bench@origin.example>\r\nSubject: in\r\n\r\n".to_vec();
    data.extend(body());
    data.extend(b".\r\n");
    let sessions: Vec<Smtp> = (0..clients).map(|_| Smtp::open(port, tls)).collect();
    let started = Instant::now();
    let accepted = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for mut s in sessions {
            let (tickets, accepted, data) = (&tickets, &accepted, &data);
            scope.spawn(move || {
                while tickets.fetch_add(1, Ordering::Relaxed) < total {
                    if s.send(data) {
                        accepted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                s.quit();
            });
        }
    });
    accepted.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn ingress(out: &mut impl Write) {
    let clients = env_number("BENCH_CLIENTS", 8);
    let seconds = env_number("BENCH_SECONDS", 5);
    let total = env_number("BENCH_INGRESS_MESSAGES", 4_000);
    let ca = TestCa::new("bench-ingress");
    let (cert, key) = ca.server_cert("127.0.0.1");
    let port = free_port();
    let (s, _c) = Scenario::new("bench-tls")
        .section(
            "pepsi-ingress",
            &section(
                &format!("smtp:127.0.0.1:{port}"),
                &format!(
                    "TLS_CERT = {}\nTLS_KEY = {}\nMAX_CLIENT_SESSIONS = 1000\n",
                    cert.display(),
                    key.display()
                ),
            ),
        )
        .stages(PIPELINE)
        .connect();
    let mut daemon = Ingress::start(&s.conf);
    let config = tls::client_config(Level::Encrypt, None).unwrap();
    let clear_sessions = sessions(port, clients, seconds, None);
    let tls_sessions = sessions(port, clients, seconds, Some(&config));
    let clear_messages = messages(port, clients, total, None);
    let tls_messages = messages(port, clients, total, Some(&config));
    assert!(daemon.terminate().success());
    writeln!(
        out,
        "ingress, SMTP on 127.0.0.1, {clients} clients:\n  \
         sessions/s: clear text {clear_sessions:.0}, with STARTTLS {tls_sessions:.0} (ratio {:.2})\n  \
         accepted 4 KiB messages/s over kept sessions ({total} each way): clear text {clear_messages:.0}, inside TLS {tls_messages:.0} (ratio {:.2})",
        tls_sessions / clear_sessions,
        tls_messages / clear_messages
    )
    .unwrap();
}

fn main() {
    // `cargo bench` passes --bench; a plain `cargo test --benches` run lists nothing.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(
        out,
        "pepsi TLS benchmark (rustls on ring); {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
    .unwrap();
    relay(&mut out);
    out.flush().unwrap();
    ingress(&mut out);
}
