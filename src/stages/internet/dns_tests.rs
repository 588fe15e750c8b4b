//! The resolver against servers on loopback sockets of these tests, which answer what
//! each test hands them (real UDP and TCP, hostile answers included). The resolver
//! against a real name server (NSD) is in `tests/suite/relay_to_internet.rs`.

use std::net::{TcpListener, UdpSocket};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

use domain::base::MessageBuilder;

use super::*;

/// How a test server answers a query (the query's bytes in, the replies out, sent in
/// this order; none sends nothing).
type Answerer = Arc<dyn Fn(&[u8], bool) -> Vec<Vec<u8>> + Send + Sync>;

/// A server on 127.0.0.1, UDP and TCP on one port, answering with `answer` (told
/// whether the query came over TCP); counts the queries.
fn server(answer: Answerer) -> (SocketAddr, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    loop {
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = udp.local_addr().unwrap();
        let Ok(tcp) = TcpListener::bind(addr) else {
            continue;
        };
        let (a, c) = (Arc::clone(&answer), Arc::clone(&count));
        thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                c.fetch_add(1, Ordering::SeqCst);
                for reply in a(&buf[..n], false) {
                    let _ = udp.send_to(&reply, from);
                }
            }
        });
        let (a, c) = (Arc::clone(&answer), Arc::clone(&count));
        thread::spawn(move || {
            for stream in tcp.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut len = [0u8; 2];
                if stream.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut query = vec![0u8; u16::from_be_bytes(len) as usize];
                if stream.read_exact(&mut query).is_err() {
                    continue;
                }
                c.fetch_add(1, Ordering::SeqCst);
                if let Some(reply) = a(&query, true).pop() {
                    let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
                    framed.extend_from_slice(&reply);
                    let _ = stream.write_all(&framed);
                }
            }
        });
        return (addr, count);
    }
}

fn dn(s: &str) -> DnsName {
    DnsName::from_str(s).unwrap()
}

/// A reply to `query` with its id and question, `rcode`, `tc`, and these MX records of
/// the question's name.
fn reply(query: &[u8], rcode: Rcode, tc: bool, mx: &[(u16, &str)]) -> Vec<u8> {
    let q = Message::from_slice(query).unwrap();
    let question = q.sole_question().unwrap();
    let mut b = MessageBuilder::new_vec();
    b.header_mut().set_id(q.header().id());
    b.header_mut().set_qr(true);
    b.header_mut().set_rcode(rcode);
    b.header_mut().set_tc(tc);
    let mut qb = b.question();
    qb.push(question).unwrap();
    let mut ab = qb.answer();
    let owner = question.qname().to_name::<Vec<u8>>();
    for (p, name) in mx {
        ab.push((&owner, Class::IN, 60u32, Mx::new(*p, dn(name))))
            .unwrap();
    }
    ab.finish()
}

fn resolver(servers: Vec<SocketAddr>) -> Resolver {
    Resolver {
        servers,
        timeout: Duration::from_millis(500),
        attempts: 1,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn mx_of(answer: Answer) -> Vec<(u16, String)> {
    match answer {
        Answer::Records(r) => r
            .into_iter()
            .filter_map(|r| match r {
                Record::Mx {
                    preference,
                    exchange,
                    ..
                } => Some((preference, exchange.to_string())),
                _ => None,
            })
            .collect(),
        Answer::NoSuchName => panic!("NXDOMAIN"),
    }
}

#[test]
fn a_truncated_udp_answer_is_asked_again_over_tcp() {
    let (addr, count) = server(Arc::new(|q: &[u8], tcp: bool| {
        vec![if tcp {
            reply(
                q,
                Rcode::NOERROR,
                false,
                &[(10, "mx1.a.test"), (20, "mx2.a.test")],
            )
        } else {
            reply(q, Rcode::NOERROR, true, &[])
        }]
    }));
    let answer = resolver(vec![addr])
        .query(&dn("a.test"), Rtype::MX, soon())
        .unwrap();
    assert_eq!(
        mx_of(answer),
        vec![
            (10, "mx1.a.test".to_string()),
            (20, "mx2.a.test".to_string())
        ]
    );
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "one over UDP, one over TCP"
    );
}

#[test]
fn an_answer_with_another_id_or_question_is_ignored_and_the_real_one_taken() {
    let (addr, _) = server(Arc::new(|q: &[u8], _| {
        let mut wrong_id = reply(q, Rcode::NOERROR, false, &[(1, "evil.test")]);
        wrong_id[0] ^= 0xff;
        let mut other = MessageBuilder::new_vec();
        other
            .header_mut()
            .set_id(Message::from_slice(q).unwrap().header().id());
        other.header_mut().set_qr(true);
        let mut other = other.question();
        other
            .push((dn("other.test"), Rtype::MX, Class::IN))
            .unwrap();
        vec![
            wrong_id,
            other.finish(),
            reply(q, Rcode::NOERROR, false, &[(5, "mx.a.test")]),
        ]
    }));
    let answer = resolver(vec![addr])
        .query(&dn("a.test"), Rtype::MX, soon())
        .unwrap();
    assert_eq!(mx_of(answer), vec![(5, "mx.a.test".to_string())]);
}

#[test]
fn servfail_moves_on_to_the_next_server_and_nxdomain_is_final() {
    let (failing, _) = server(Arc::new(|q: &[u8], _| {
        vec![reply(q, Rcode::SERVFAIL, false, &[])]
    }));
    let (nx, nx_count) = server(Arc::new(|q: &[u8], _| {
        vec![reply(q, Rcode::NXDOMAIN, false, &[])]
    }));
    let answer = resolver(vec![failing, nx])
        .query(&dn("gone.test"), Rtype::MX, soon())
        .unwrap();
    assert_eq!(answer, Answer::NoSuchName);
    assert_eq!(nx_count.load(Ordering::SeqCst), 1);
    let e = resolver(vec![failing])
        .query(&dn("a.test"), Rtype::MX, soon())
        .unwrap_err();
    assert!(e.contains("SERVFAIL"), "{e}");
}

#[test]
fn a_silent_server_costs_its_timeout_and_the_deadline_bounds_every_round() {
    let (silent, count) = server(Arc::new(|_: &[u8], _| Vec::new()));
    let r = Resolver {
        servers: vec![silent],
        timeout: Duration::from_secs(2),
        attempts: 5,
    };
    let started = Instant::now();
    let e = r
        .query(
            &dn("a.test"),
            Rtype::MX,
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
    assert!(
        e.contains("no answer in time") || e.contains("out of time"),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(count.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_compression_loop_in_an_answer_is_a_malformed_answer_not_a_hang() {
    for looped in [
        // The exchange is a pointer to itself.
        |at: usize| vec![0xc0 | (at >> 8) as u8, at as u8],
        // A label, then a pointer back to that label.
        |at: usize| vec![1, b'x', 0xc0 | (at >> 8) as u8, at as u8],
    ] {
        let (addr, _) = server(Arc::new(move |q: &[u8], _| {
            let mut r = reply(q, Rcode::NOERROR, false, &[]);
            // One answer: the question's name (a pointer to offset 12), MX, IN, TTL,
            // RDLENGTH, preference, then the looping exchange.
            r[7] = 1;
            let at = r.len() + 14;
            let exchange = looped(at);
            r.extend_from_slice(&[0xc0, 12, 0, 15, 0, 1, 0, 0, 0, 60]);
            r.extend_from_slice(&((2 + exchange.len()) as u16).to_be_bytes());
            r.extend_from_slice(&[0, 10]);
            r.extend_from_slice(&exchange);
            vec![r]
        }));
        let e = resolver(vec![addr])
            .query(&dn("a.test"), Rtype::MX, soon())
            .unwrap_err();
        assert!(e.contains("malformed"), "{e}");
    }
}

#[test]
fn resolv_conf_gives_servers_timeout_and_attempts_and_nameserver_parses_ports() {
    let r = Resolver::from_resolv_conf(
        "# comment\nsearch example.com\nnameserver 192.0.2.53\nnameserver ::1\nnameserver fe80::1%eth0\nnameserver 10.0.0.1\nnameserver 10.0.0.2\noptions timeout:2 attempts:3 rotate\n",
    );
    assert_eq!(
        r.servers,
        vec![
            "192.0.2.53:53".parse().unwrap(),
            "[::1]:53".parse().unwrap(),
            "10.0.0.1:53".parse().unwrap()
        ]
    );
    assert_eq!((r.timeout, r.attempts), (Duration::from_secs(2), 3));
    assert_eq!(
        Resolver::from_resolv_conf("").servers,
        vec!["127.0.0.1:53".parse().unwrap()]
    );
    assert_eq!(
        Resolver::parse_servers("127.0.0.1:5353, [::1]:53 192.0.2.1").unwrap(),
        vec![
            "127.0.0.1:5353".parse().unwrap(),
            "[::1]:53".parse().unwrap(),
            "192.0.2.1:53".parse().unwrap()
        ]
    );
    for bad in [
        "",
        "dns.example",
        "127.0.0.1:0",
        "1.1.1.1 2.2.2.2 3.3.3.3 4.4.4.4",
    ] {
        assert!(Resolver::parse_servers(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn names_are_letters_digits_hyphens_and_underscores_only() {
    assert!(name("Example.COM.").is_ok());
    assert!(name("_dmarc.example.com").is_ok());
    for bad in [
        "",
        ".",
        "a..b",
        "a b.example",
        "a\\065.example",
        "é.example",
        &"a".repeat(64),
    ] {
        assert!(name(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn answers_with_records_are_kept_for_their_ttl_and_nxdomain_is_asked_again() {
    let (addr, count) = server(Arc::new(|q: &[u8], _| {
        let name = Message::from_slice(q)
            .unwrap()
            .sole_question()
            .unwrap()
            .qname()
            .to_string();
        vec![if name.starts_with("gone") {
            reply(q, Rcode::NXDOMAIN, false, &[])
        } else {
            reply(q, Rcode::NOERROR, false, &[(10, "mx.kept.test")])
        }]
    }));
    let r = resolver(vec![addr]);
    for _ in 0..3 {
        let answer = r.query(&dn("KEPT.test"), Rtype::MX, soon()).unwrap();
        assert_eq!(mx_of(answer), vec![(10, "mx.kept.test".to_string())]);
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "asked once, then kept");
    for _ in 0..2 {
        assert_eq!(
            r.query(&dn("gone.test"), Rtype::MX, soon()).unwrap(),
            Answer::NoSuchName
        );
    }
    assert_eq!(count.load(Ordering::SeqCst), 3, "NXDOMAIN is not kept");
}
