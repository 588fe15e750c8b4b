//! `pepsi-ingress` against hostile clients: a message smuggled behind a
//! bare line feed, and clients that hold sessions open — idle, or dripping a byte now
//! and then — to lock the MTA in front out.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::time::Duration;

use super::ingress::{open, tcp};
use crate::util::Scenario;
use crate::util::ingress::{data_codes, send_lmtp};
use crate::util::rows::queue_len;

const SEC: Duration = Duration::from_secs(1);

/// Reads one reply line (a single-line reply, or the last line of a multi-line one).
fn reply(r: &mut BufReader<TcpStream>) -> String {
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return String::new();
        }
        if line.as_bytes().get(3) != Some(&b'-') {
            return line;
        }
    }
}

#[test]
fn a_message_smuggled_behind_a_bare_line_feed_is_content_of_the_one_message_stored() {
    for protocol in ["smtp", "lmtp"] {
        let (listen, target) = tcp(protocol);
        let mut o = open(Scenario::new("i-smuggle"), &listen, "");
        let hello = if protocol == "lmtp" { "LHLO" } else { "EHLO" };
        for ending in ["\n.\n", "\r\n.\n", "\n.\r\n"] {
            let before = queue_len(&mut o.c);
            let stream = TcpStream::connect(&target).unwrap();
            stream.set_read_timeout(Some(30 * SEC)).unwrap();
            let mut r = BufReader::new(stream.try_clone().unwrap());
            let mut w = stream;
            assert!(reply(&mut r).starts_with("220"));
            w.write_all(
                format!(
                    "{hello} client.test\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n"
                )
                .as_bytes(),
            )
            .unwrap();
            for _ in 0..4 {
                reply(&mut r);
            }
            // The end a lenient reader takes, a second transaction, the real end.
            w.write_all(
                format!(
                    "Subject: one\r\n\r\nfirst{ending}MAIL FROM:<ceo@example.org>\r\n\
                     RCPT TO:<b@y.example>\r\nDATA\r\nFrom: <ceo@example.org>\r\n\
                     Subject: from the CEO\r\n\r\nPay this invoice.\r\n.\r\nQUIT\r\n"
                )
                .as_bytes(),
            )
            .unwrap();
            let after_data = reply(&mut r);
            assert!(
                after_data.starts_with("250"),
                "{protocol} {ending:?}: {after_data}"
            );
            assert!(reply(&mut r).starts_with("221"), "{protocol} {ending:?}");
            assert_eq!(
                queue_len(&mut o.c) - before,
                1,
                "{protocol} {ending:?}: exactly one message"
            );
            let (from, body): (String, Vec<u8>) =
                o.c.query_one(
                    "SELECT w.mail_from, b.body FROM pepsi.workqueue w JOIN pepsi.workqueue_body b \
                     USING (body_id) ORDER BY w.workqueue_id DESC LIMIT 1",
                    &[],
                )
                .map(|row| (row.get(0), row.get(1)))
                .unwrap();
            assert_eq!(from, "a@x.example");
            let body = String::from_utf8(body).unwrap();
            assert!(body.contains("MAIL FROM:<ceo@example.org>"), "{body:?}");
        }
        assert!(o.daemon.terminate().success(), "{}", o.daemon.log());
    }
}

/// A TCP connection to `127.0.0.1:port` from the loopback address `from`.
fn connect_from(from: Ipv4Addr, port: u16) -> std::io::Result<TcpStream> {
    // SAFETY: a fresh socket, bound and connected with valid addresses, then owned by
    // the stream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let addr = |a: SocketAddrV4| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let local = addr(SocketAddrV4::new(from, 0));
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = addr(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

#[test]
fn idle_and_dripping_clients_cannot_lock_the_trusted_mta_out() {
    let (listen, target) = tcp("lmtp");
    let port: u16 = target.rsplit(':').next().unwrap().parse().unwrap();
    let mut o = open(
        Scenario::new("i-exhaust"),
        &listen,
        "XFORWARD_FROM = 127.0.0.1\nTIMEOUT = 5s\nMAX_CLIENT_SESSIONS = 10\n",
    );
    // 400 connections at once, 10 from each of 40 addresses (127.0.0.2 …): 200 that
    // say nothing, 200 that drip a byte every 100 ms and never end a line.
    let burst: Vec<std::thread::JoinHandle<Vec<(bool, TcpStream)>>> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                (0..50)
                    .map(|i| {
                        let n = t * 50 + i;
                        let from = Ipv4Addr::new(127, 0, 0, 2 + (n / 10) as u8);
                        let s = connect_from(from, port).expect("connect");
                        s.set_read_timeout(Some(10 * SEC)).unwrap();
                        (n % 2 == 0, s)
                    })
                    .collect()
            })
        })
        .collect();
    let conns: Vec<(bool, TcpStream)> = burst.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let mut admitted = Vec::new();
    let mut refused = 0;
    for (dripping, s) in conns {
        let mut r = BufReader::new(s.try_clone().unwrap());
        let first = reply(&mut r);
        if first.starts_with("220") {
            admitted.push((dripping, s));
        } else {
            assert!(first.starts_with("421 4."), "{first:?}");
            refused += 1;
        }
    }
    // The burst held the limit: MAX_SESSIONS 100 less TRUSTED_SESSIONS 20 for others.
    assert_eq!(admitted.len(), 80, "{}", o.daemon.log());
    assert_eq!(refused, 320);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drippers: Vec<TcpStream> = admitted
        .iter()
        .filter(|(d, _)| *d)
        .map(|(_, s)| s.try_clone().unwrap())
        .collect();
    let dripping = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut drippers = drippers;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for s in &mut drippers {
                    let _ = s.write_all(b"X");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // The MTA in front (127.0.0.1, trusted) still delivers, at once.
    let before = queue_len(&mut o.c);
    let sent = send_lmtp(&target, &["r@y.example"]);
    assert_eq!(data_codes(&sent), [250], "{sent}\n{}", o.daemon.log());
    assert_eq!(queue_len(&mut o.c), before + 1);
    // A client over its own limit is refused as such.
    let many: Vec<TcpStream> = (0..11)
        .map(|_| connect_from(Ipv4Addr::new(127, 0, 0, 99), port).unwrap())
        .collect();
    let firsts: Vec<String> = many
        .iter()
        .map(|s| {
            s.set_read_timeout(Some(10 * SEC)).unwrap();
            reply(&mut BufReader::new(s.try_clone().unwrap()))
        })
        .collect();
    assert!(
        firsts.iter().all(|f| f.starts_with("421 4.3.2")),
        "the others' share is full: {firsts:?}"
    );
    drop(many);
    // Neither kind holds its session past TIMEOUT: a byte now and then does not
    // extend a line's deadline.
    crate::util::wait_until(
        20 * SEC,
        "every idle and dripping session timed out",
        || o.daemon.log().matches("; timed out").count() >= 80,
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    dripping.join().unwrap();
    for (_, s) in admitted {
        let mut r = BufReader::new(s);
        let last = reply(&mut r);
        assert!(last.starts_with("421 4.4.2"), "{last:?}");
    }
    // Now one address may have its ten again, and no more.
    let again: Vec<TcpStream> = (0..11)
        .map(|_| connect_from(Ipv4Addr::new(127, 0, 0, 99), port).unwrap())
        .collect();
    let firsts: Vec<String> = again
        .iter()
        .map(|s| {
            s.set_read_timeout(Some(10 * SEC)).unwrap();
            reply(&mut BufReader::new(s.try_clone().unwrap()))
        })
        .collect();
    assert_eq!(
        firsts.iter().filter(|f| f.starts_with("220")).count(),
        10,
        "{firsts:?}"
    );
    assert!(firsts[10].starts_with("421 4.7.0"), "{firsts:?}");
    drop(again);
    assert!(o.daemon.terminate().success(), "{}", o.daemon.log());
}
