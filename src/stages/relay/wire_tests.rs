//! The relay's transactions against a scripted peer on a unix socket: a thread that
//! answers each command as the test says, so that what goes over the wire, and what
//! becomes of each recipient and of the connection, is checked without a database.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::client::{Connection, Target, Timeouts};
use super::transaction::{Envelope, Results, deliver};
use crate::worker::RecipientResult;

/// The peer's side: reads lines, writes replies.
pub struct Peer {
    input: BufReader<UnixStream>,
    out: UnixStream,
    /// Every line read.
    pub lines: Vec<String>,
}

impl Peer {
    /// Reads one line (without its line end); `None` at end of file.
    pub fn line(&mut self) -> Option<String> {
        let mut raw = Vec::new();
        if self.input.read_until(b'\n', &mut raw).ok()? == 0 {
            return None;
        }
        let l = String::from_utf8_lossy(&raw).trim_end().to_string();
        self.lines.push(l.clone());
        Some(l)
    }

    /// Writes a reply (CRLF added).
    pub fn say(&mut self, reply: &str) {
        let _ = self.out.write_all(format!("{reply}\r\n").as_bytes());
    }

    /// Reads a line and answers it with `reply`.
    pub fn expect(&mut self, prefix: &str, reply: &str) {
        let l = self.line().unwrap_or_default();
        assert!(l.starts_with(prefix), "expected {prefix}, got {l:?}");
        self.say(reply);
    }

    /// Reads the data up to the final dot.
    pub fn data(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Some(l) = self.line() {
            if l == "." {
                break;
            }
            lines.push(l);
        }
        lines
    }
}

/// A listening peer: its socket and the thread that runs the script.
pub struct Scripted {
    pub target: Target,
    thread: Option<JoinHandle<Vec<String>>>,
}

impl Scripted {
    /// Every line the peer read, once its script is done.
    pub fn finish(mut self) -> Vec<String> {
        self.thread.take().unwrap().join().unwrap()
    }
}

/// Listens on a fresh unix socket; `script` runs on the first connection, after the
/// greeting.
pub fn peer(script: impl FnOnce(&mut Peer) + Send + 'static) -> Scripted {
    static N: AtomicU32 = AtomicU32::new(0);
    let path: PathBuf = std::env::temp_dir().join(format!(
        "pepsi-relay-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let target = Target::Unix(path.clone());
    let thread = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let _ = std::fs::remove_file(&path);
        let mut p = Peer {
            input: BufReader::new(stream.try_clone().unwrap()),
            out: stream,
            lines: Vec::new(),
        };
        p.say("220 peer ESMTP");
        script(&mut p);
        p.lines
    });
    Scripted {
        target,
        thread: Some(thread),
    }
}

/// Short timeouts: a test that would hang fails fast.
pub fn quick() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(5),
        command: Duration::from_secs(5),
        data: Duration::from_secs(5),
        data_done: Duration::from_secs(5),
    }
}

/// The EHLO reply with these keywords.
pub fn ehlo(keywords: &[&str]) -> String {
    let mut lines = vec!["peer hello".to_string()];
    lines.extend(keywords.iter().map(|k| k.to_string()));
    let n = lines.len();
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| format!("250{}{l}", if i + 1 == n { ' ' } else { '-' }))
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// Opens a connection to `s` and runs one transaction from a@x to `to`.
pub fn send(
    s: &Scripted,
    lmtp: bool,
    to: &[&str],
) -> (Option<Connection>, Result<Results, String>) {
    send_with(s, lmtp, to, quick())
}

/// As [`send`], with these timeouts (their sum the message's time).
pub fn send_with(
    s: &Scripted,
    lmtp: bool,
    to: &[&str],
    timeouts: Timeouts,
) -> (Option<Connection>, Result<Results, String>) {
    let deadline = std::time::Instant::now() + timeouts.budget();
    let mut c = match Connection::open(&s.target, lmtp, "me.test", timeouts, deadline) {
        Ok(c) => c,
        Err(b) => return (None, Err(format!("open: {}", b.0))),
    };
    let rcpt: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    let e = Envelope {
        mail_from: "a@x",
        rcpt_to: &rcpt,
        dsn: None,
        client_ip: Some("192.0.2.1"),
        auth_user: None,
        lmtp,
    };
    match deliver(&mut c, &e, b"Subject: t\r\n", b"body\r\n") {
        Ok(r) => (Some(c), Ok(r)),
        Err((b, r)) if r.is_empty() => (None, Err(b.0)),
        // Results that stand, the connection dropped.
        Err((_, r)) => (None, Ok(r)),
    }
}

/// A host error for the message, or every recipient deferred, mentioning `what`.
fn all_deferred(r: &Result<Results, String>, what: &str) -> bool {
    match r {
        Err(why) => why.contains(what),
        Ok(r) => r
            .iter()
            .all(|(_, r)| matches!(r, RecipientResult::Deferred(w) if w.contains(what))),
    }
}

fn done(r: &RecipientResult) -> bool {
    matches!(r, RecipientResult::Done)
}

#[test]
fn a_250_to_data_delivers_nobody_and_drops_the_connection() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING"]));
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "250 ok");
        p.expect("DATA", "250 2.0.0 queued");
        p.line();
    });
    let (c, r) = send(&s, false, &["b@y"]);
    assert!(c.is_none(), "the connection is dropped");
    assert!(all_deferred(&r, "DATA"), "{r:?}");
    s.finish();
}

#[test]
fn a_250_to_data_without_pipelining_delivers_nobody() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&[]));
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "250 ok");
        p.expect("DATA", "250 2.0.0 queued");
        p.line();
    });
    let (c, r) = send(&s, false, &["b@y"]);
    assert!(c.is_none());
    assert!(all_deferred(&r, "DATA"), "{r:?}");
    s.finish();
}

#[test]
fn a_3xx_to_mail_or_rcpt_is_a_protocol_error_not_a_bounce() {
    for (mail, rcpt) in [("354 what", "250 ok"), ("250 ok", "354 go ahead")] {
        let s = peer(move |p| {
            p.expect("EHLO", &ehlo(&[]));
            p.expect("MAIL", mail);
            if mail.starts_with('2') {
                p.expect("RCPT", rcpt);
            }
            p.line();
        });
        let (c, r) = send(&s, false, &["b@y"]);
        assert!(c.is_none(), "{mail} {rcpt}");
        assert!(r.is_err(), "{mail} {rcpt}: {r:?}");
        s.finish();
    }
}

#[test]
fn a_good_transaction_delivers_and_keeps_the_connection() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING"]));
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "250 ok");
        p.expect("RCPT", "550 5.1.1 unknown");
        p.expect("DATA", "354 go");
        let data = p.data();
        assert_eq!(data, ["Subject: t", "", "body"]);
        p.say("250 queued");
    });
    let (c, r) = send(&s, false, &["b@y", "c@y"]);
    let r = r.unwrap();
    assert!(c.is_some());
    assert!(done(&r[0].1));
    assert!(matches!(r[1].1, RecipientResult::Failed { .. }));
    drop(c);
    s.finish();
}

/// Reads every line until the client hangs up.
fn rest(p: &mut Peer) {
    while p.line().is_some() {}
}

#[test]
fn a_refused_xforward_defers_the_message_and_never_ends_an_opened_data_phase() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING", "XFORWARD ADDR"]));
        p.expect("XFORWARD", "550 5.7.1 not for you");
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "250 ok");
        p.expect("DATA", "354 go");
        rest(p);
    });
    let (c, r) = send(&s, false, &["b@y"]);
    let kept = c.is_some();
    drop(c);
    let lines = s.finish();
    assert!(!kept, "the connection is dropped");
    assert!(all_deferred(&r, "XFORWARD"), "no bounce: {r:?}");
    assert_eq!(
        lines.last().unwrap(),
        "DATA",
        "nothing after DATA: {lines:?}"
    );
}

#[test]
fn a_refused_sender_with_354_to_data_drops_the_connection_inside_the_data() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING"]));
        p.expect("MAIL", "550 5.7.1 no such sender");
        p.expect("RCPT", "503 5.5.1 need MAIL");
        p.expect("DATA", "354 go");
        rest(p);
    });
    let (c, r) = send(&s, false, &["b@y"]);
    let kept = c.is_some();
    drop(c);
    let lines = s.finish();
    assert!(
        !kept,
        "the connection is dropped, not reused inside the data"
    );
    let r = r.unwrap();
    assert!(
        matches!(&r[0].1, RecipientResult::Failed { status, .. } if status == "5.7.1"),
        "{r:?}"
    );
    assert_eq!(lines.last().unwrap(), "DATA", "{lines:?}");
}

#[test]
fn lmtp_with_354_for_no_recipient_sends_no_dot_and_drops_the_connection() {
    let s = peer(|p| {
        p.expect("LHLO", &ehlo(&["PIPELINING"]));
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "550 5.1.1 unknown");
        p.expect("DATA", "354 go");
        rest(p);
    });
    let (c, r) = send(&s, true, &["b@y"]);
    let kept = c.is_some();
    drop(c);
    let lines = s.finish();
    assert!(!kept);
    let r = r.unwrap();
    assert!(
        matches!(&r[0].1, RecipientResult::Failed { status, .. } if status == "5.1.1"),
        "{r:?}"
    );
    assert_eq!(lines.last().unwrap(), "DATA", "no dot: {lines:?}");
}

#[test]
fn a_4xx_to_ehlo_fails_the_connection_instead_of_falling_back_to_helo() {
    let s = peer(|p| {
        p.expect("EHLO", "451 4.3.2 busy");
        rest(p);
    });
    let (c, r) = send(&s, false, &["b@y"]);
    drop(c);
    let lines = s.finish();
    assert!(r.unwrap_err().contains("451"));
    assert_eq!(lines, ["EHLO me.test"], "no HELO");
}

#[test]
fn a_smarthost_that_does_not_know_ehlo_is_greeted_with_helo() {
    let s = peer(|p| {
        p.expect("EHLO", "502 5.5.2 what?");
        p.expect("HELO", "250 hi");
        p.expect("MAIL", "250 ok");
        p.expect("RCPT", "250 ok");
        p.expect("DATA", "354 go");
        p.data();
        p.say("250 queued");
        rest(p);
    });
    let (c, r) = send(&s, false, &["b@y"]);
    drop(c);
    s.finish();
    assert!(done(&r.unwrap()[0].1));
}

#[test]
fn six_thousand_recipients_over_a_unix_socket_are_pipelined_in_windows_and_delivered() {
    const N: usize = 6000;
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING"]));
        p.expect("MAIL", "250 ok");
        for _ in 0..N {
            // One blocking write per command, as it is read.
            p.expect("RCPT", "250 2.1.5 ok");
        }
        p.expect("DATA", "354 go");
        p.data();
        p.say("250 queued");
        rest(p);
    });
    let to: Vec<String> = (0..N)
        .map(|i| format!("recipient-number-{i}@destination.example"))
        .collect();
    let to: Vec<&str> = to.iter().map(String::as_str).collect();
    let (c, r) = send(&s, false, &to);
    drop(c);
    s.finish();
    let r = r.unwrap();
    assert_eq!(r.len(), N);
    assert!(r.iter().all(|(_, r)| done(r)));
}

#[test]
fn a_message_gets_the_sum_of_the_timeouts_whatever_each_wait_takes() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&[]));
        // Each reply comes within the command timeout, all of them not within the
        // message's time.
        while let Some(l) = p.line() {
            std::thread::sleep(Duration::from_millis(700));
            p.say(if l == "DATA" { "354 go" } else { "250 ok" });
        }
    });
    let t = Duration::from_secs(1);
    let timeouts = Timeouts {
        connect: t,
        command: t,
        data: t,
        data_done: t,
    };
    let to = ["a@y", "b@y", "c@y", "d@y", "e@y", "f@y"];
    let started = std::time::Instant::now();
    let (c, r) = send_with(&s, false, &to, timeouts);
    assert!(c.is_none(), "the connection is dropped");
    assert!(r.is_err(), "a host error for the message: {r:?}");
    assert!(
        started.elapsed() < Duration::from_millis(4500),
        "{:?}",
        started.elapsed()
    );
    s.finish();
}

#[test]
fn an_address_with_a_line_break_is_never_sent_and_fails_alone() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&["PIPELINING"]));
        while let Some(l) = p.line() {
            if l == "DATA" {
                p.say("354 go");
                p.data();
                p.say("250 queued");
            } else {
                p.say("250 ok");
            }
        }
    });
    let (c, r) = send(&s, false, &["good@y", "evil@y>\r\nRCPT TO:<victim@z"]);
    assert!(c.is_some());
    let r = r.unwrap();
    assert!(done(&r[0].1), "{r:?}");
    assert!(
        matches!(&r[1].1, RecipientResult::Failed { status, .. } if status == "5.1.3"),
        "{r:?}"
    );
    drop(c);
    let lines = s.finish();
    assert!(lines.iter().all(|l| !l.contains("victim")), "{lines:?}");
    assert!(lines.iter().any(|l| l == "RCPT TO:<good@y>"), "{lines:?}");
}

#[test]
fn a_reply_dripped_a_byte_at_a_time_ends_at_the_command_timeout() {
    let s = peer(|p| {
        p.expect("EHLO", &ehlo(&[]));
        let _ = p.line();
        // "250 ok" a byte every 200 ms, forever: each read gets a byte in time.
        for b in b"250 ok and so on and so on".iter().cycle() {
            if p.out.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let t = Timeouts {
        command: Duration::from_secs(1),
        ..quick()
    };
    let started = std::time::Instant::now();
    let (c, r) = send_with(&s, false, &["a@y"], t);
    assert!(c.is_none(), "the connection is dropped");
    assert!(
        all_deferred(&r, "timed out") || all_deferred(&r, "in time"),
        "{r:?}"
    );
    // It returned at all: without the reply's own deadline the drip never ends (the
    // bound is far above the 1 s it takes, no speed figure).
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    drop(s);
}

#[test]
fn connecting_to_a_unix_socket_whose_backlog_is_full_times_out() {
    use std::os::unix::ffi::OsStrExt;
    // A listener with a backlog of 0 that never accepts: one connection fills it.
    let path = std::env::temp_dir().join(format!("pepsi-relay-full-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    assert_eq!(unsafe { libc::bind(fd, (&raw const addr).cast(), len) }, 0);
    assert_eq!(unsafe { libc::listen(fd, 0) }, 0);
    let _first = UnixStream::connect(&path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let target = Target::Unix(path.clone());
    std::thread::spawn(move || {
        let t = quick();
        let t = Timeouts {
            connect: Duration::from_secs(1),
            ..t
        };
        let r = Connection::open(
            &target,
            false,
            "me.test",
            t,
            std::time::Instant::now() + t.budget(),
        );
        let _ = tx.send(r.err().map(|b| b.0));
    });
    let r = rx.recv_timeout(Duration::from_secs(5));
    unsafe { libc::close(fd) };
    let _ = std::fs::remove_file(&path);
    let why = r.expect("connect returned within its timeout").unwrap();
    assert!(why.contains("timed out"), "{why}");
}
