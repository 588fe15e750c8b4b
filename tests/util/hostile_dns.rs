//! A hostile DNS server for the tests of the MX resolver: it answers every query with
//! a reply written here byte by byte, well formed but for one hostile part, so that a
//! test sees what the resolver does with exactly that part. Where the resolver must
//! be right about real answers (MX, CNAME, null MX, NXDOMAIN, SERVFAIL, truncation)
//! the tests use a real server instead, [`super::nsd`].
//!
//! [`HostileDns::start`] listens on `127.0.0.1` on one free port, UDP and TCP alike
//! (the TCP messages with their two-byte length), on background threads that stop
//! when the value is dropped. Every reply copies the query's id (but
//! [`Hostile::WrongId`]'s) and its question section, byte for byte, with QR and AA
//! set, RD copied from the query, RCODE 0 (NOERROR), QDCOUNT 1 and no authority or
//! additional records; the variants of [`Hostile`] say what follows. A query whose
//! question cannot be read (no header, a compressed or cut-off name) is counted and
//! not answered. [`HostileDns::start_with`] takes a closure instead, for a reply of a
//! test's own ([`reply_head`] writes the header and question).
//!
//! In the comments, `Q` is the length of the question section (the name, then TYPE and
//! CLASS) and `A = 12 + Q` the offset of the answer section; names are compressed with
//! `C0 0C`, a pointer to the question's name at offset 12, and `Cx xx` is the pointer
//! to the offset that follows it (`0xC000 | offset`, big-endian).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a [`HostileDns`] answers to every query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hostile {
    /// One MX record whose exchange name is a compression pointer to itself. ANCOUNT 1;
    /// the answer, at offset `A`:
    ///
    /// ```text
    /// C0 0C        owner: the question's name
    /// 00 0F 00 01  TYPE MX, CLASS IN
    /// 00 00 01 2C  TTL 300
    /// 00 04        RDLENGTH 4
    /// 00 0A        preference 10
    /// Cx xx        exchange (offset A + 14): a pointer to A + 14, itself
    /// ```
    CompressionLoop,
    /// The two-pointer variant of [`Hostile::CompressionLoop`]: the exchange name of
    /// the first MX record points to the owner name of a second one, which points back.
    /// ANCOUNT 2; the answers, at offset `A`:
    ///
    /// ```text
    /// C0 0C        owner: the question's name
    /// 00 0F 00 01  TYPE MX, CLASS IN
    /// 00 00 01 2C  TTL 300
    /// 00 04        RDLENGTH 4
    /// 00 0A        preference 10
    /// Cx xx        exchange (offset A + 14): a pointer to A + 16, the next owner
    /// Cx xx        owner (offset A + 16): a pointer to A + 14, the exchange above
    /// 00 0F 00 01  TYPE MX, CLASS IN
    /// 00 00 01 2C  TTL 300
    /// 00 04        RDLENGTH 4
    /// 00 14        preference 20
    /// C0 0C        exchange: the question's name
    /// ```
    CompressionCycle,
    /// Over UDP: the header and question with TC set and no records (ANCOUNT 0), so a
    /// client must ask again over TCP. Over TCP: a reply of the largest size a TCP
    /// message can have, 65,535 bytes (length prefix `FF FF`): the header, the
    /// question, then as many junk records as fill it exactly (ANCOUNT their number,
    /// about 4,000), each
    ///
    /// ```text
    /// C0 0C        owner: the question's name
    /// FF 00 00 01  TYPE 65280 (private use, unknown to any client), CLASS IN
    /// 00 00 00 00  TTL 0
    /// 00 04        RDLENGTH 4 (the last record longer, to fill the message)
    /// FF ..        RDATA: bytes FF
    /// ```
    Huge,
    /// A reply whose id is the query's with every bit flipped, which a correct client
    /// ignores, and nothing more: ANCOUNT 1, the answer one MX record that a client
    /// which took the reply would use,
    ///
    /// ```text
    /// C0 0C        owner: the question's name
    /// 00 0F 00 01  TYPE MX, CLASS IN
    /// 00 00 01 2C  TTL 300
    /// 00 14        RDLENGTH 20
    /// 00 0A        preference 10
    /// 08 "wrong-id" 07 "invalid" 00    exchange: wrong-id.invalid.
    /// ```
    ///
    /// Over TCP the connection then stays open, unanswered.
    WrongId,
    /// No reply ever; a TCP connection stays open until the client closes it (or the
    /// server is dropped).
    Silent,
}

/// The transport a query came over, for [`HostileDns::start_with`]'s closure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// What a [`HostileDns`] replies to a query (its bytes, without the TCP length): the
/// messages to send back, in order, each at most 65,535 bytes; none for no reply.
pub type Replier = dyn Fn(&[u8], Transport) -> Vec<Vec<u8>> + Send + Sync;

/// A running hostile DNS server; its threads stop and its port closes when dropped.
pub struct HostileDns {
    addr: SocketAddr,
    queries: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// How often the threads look whether the server is being dropped.
const POLL: Duration = Duration::from_millis(20);

impl HostileDns {
    /// Starts a server that answers every query as `kind` says.
    pub fn start(kind: Hostile) -> HostileDns {
        HostileDns::start_with(move |query, transport| replies(kind, query, transport))
    }

    /// Starts a server that answers every query with what `reply` returns for it.
    pub fn start_with(
        reply: impl Fn(&[u8], Transport) -> Vec<Vec<u8>> + Send + Sync + 'static,
    ) -> HostileDns {
        let reply: Arc<Replier> = Arc::new(reply);
        let (udp, tcp) = bind_pair();
        let addr = udp.local_addr().unwrap();
        let queries = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = vec![
            {
                let (reply, queries, stop) = (reply.clone(), queries.clone(), stop.clone());
                std::thread::spawn(move || serve_udp(udp, &*reply, &queries, &stop))
            },
            {
                let (queries, stop) = (queries.clone(), stop.clone());
                std::thread::spawn(move || serve_tcp(tcp, reply, queries, stop))
            },
        ];
        HostileDns {
            addr,
            queries,
            stop,
            threads,
        }
    }

    /// Where it listens: `127.0.0.1:PORT`, UDP and TCP.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many queries have arrived so far, over UDP and TCP together (answered or
    /// not).
    pub fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }
}

impl Drop for HostileDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A UDP socket and a TCP listener on the same free port of `127.0.0.1`.
pub fn bind_pair() -> (UdpSocket, TcpListener) {
    for _ in 0..100 {
        let udp = UdpSocket::bind("127.0.0.1:0").expect("a free loopback UDP port");
        // The port is free for UDP; for TCP it may not be: then try another.
        if let Ok(tcp) = TcpListener::bind(udp.local_addr().unwrap()) {
            return (udp, tcp);
        }
    }
    panic!("no loopback port free for both UDP and TCP");
}

fn serve_udp(udp: UdpSocket, reply: &Replier, queries: &AtomicUsize, stop: &AtomicBool) {
    udp.set_read_timeout(Some(POLL)).unwrap();
    let mut buf = vec![0u8; 65_535];
    while !stop.load(Ordering::SeqCst) {
        let (n, from) = match udp.recv_from(&mut buf) {
            Ok(got) => got,
            // The timeout, to look at `stop`; or an ICMP "port unreachable" for an
            // earlier reply, which is not ours to mind.
            Err(_) => continue,
        };
        queries.fetch_add(1, Ordering::SeqCst);
        for message in reply(&buf[..n], Transport::Udp) {
            let _ = udp.send_to(&message, from);
        }
    }
}

fn serve_tcp(
    tcp: TcpListener,
    reply: Arc<Replier>,
    queries: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) {
    tcp.set_nonblocking(true).unwrap();
    let mut connections = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match tcp.accept() {
            Ok((stream, _)) => {
                let (reply, queries, stop) = (reply.clone(), queries.clone(), stop.clone());
                connections.push(std::thread::spawn(move || {
                    serve_connection(stream, &*reply, &queries, &stop)
                }));
            }
            Err(_) => std::thread::sleep(POLL),
        }
    }
    for c in connections {
        let _ = c.join();
    }
}

/// Reads length-prefixed queries off one connection and writes the replies, until the
/// client closes it or the server is dropped.
fn serve_connection(
    mut stream: TcpStream,
    reply: &Replier,
    queries: &AtomicUsize,
    stop: &AtomicBool,
) {
    // The accepted socket may inherit the listener's non-blocking mode.
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(POLL)).unwrap();
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 65_537];
    while !stop.load(Ordering::SeqCst) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => return,
        }
        while pending.len() >= 2 {
            let len = usize::from(u16::from_be_bytes([pending[0], pending[1]]));
            if pending.len() < 2 + len {
                break;
            }
            let query: Vec<u8> = pending.drain(..2 + len).skip(2).collect();
            queries.fetch_add(1, Ordering::SeqCst);
            for message in reply(&query, Transport::Tcp) {
                let len = u16::try_from(message.len()).expect("a DNS message over TCP");
                let mut framed = len.to_be_bytes().to_vec();
                framed.extend_from_slice(&message);
                if stream.write_all(&framed).is_err() {
                    return;
                }
            }
        }
    }
}

/// The question section of `query`: its first question (name, TYPE, CLASS), if the
/// query has a header and the name is whole and uncompressed.
pub fn question(query: &[u8]) -> Option<&[u8]> {
    let mut at = 12;
    loop {
        let len = usize::from(*query.get(at)?);
        if len == 0 {
            break;
        }
        if len & 0xC0 != 0 {
            return None;
        }
        at += 1 + len;
    }
    // The root label, then TYPE and CLASS.
    let end = at + 1 + 4;
    (end <= query.len()).then(|| &query[12..end])
}

/// The header and question of a reply to `query`, which a test's own reply continues
/// with its records: the query's id (or `id`), flags QR, AA, RD as in the query, then
/// `flags` (e.g. `0x0200`, TC) or'ed in, RCODE 0 unless `flags` says otherwise;
/// QDCOUNT 1, ANCOUNT `answers`, NSCOUNT and ARCOUNT 0; the question copied from the
/// query. None if the query's question cannot be read.
pub fn reply_head(query: &[u8], id: Option<u16>, flags: u16, answers: u16) -> Option<Vec<u8>> {
    let question = question(query)?;
    let id = id.unwrap_or(u16::from_be_bytes([query[0], query[1]]));
    let flags = 0x8400 | (u16::from(query[2] & 0x01) << 8) | flags;
    let mut head = Vec::with_capacity(12 + question.len());
    for word in [id, flags, 1, answers, 0, 0] {
        head.extend_from_slice(&word.to_be_bytes());
    }
    head.extend_from_slice(question);
    Some(head)
}

/// The TC flag of a header.
const TC: u16 = 0x0200;

/// A record's TYPE, CLASS IN and TTL 300, for an MX record.
const MX_IN_300: [u8; 8] = [0x00, 0x0F, 0x00, 0x01, 0x00, 0x00, 0x01, 0x2C];

/// A compression pointer to `offset`.
fn pointer(offset: usize) -> [u8; 2] {
    assert!(
        offset < 0x4000,
        "a compression pointer reaches 16,383 at most"
    );
    (0xC000 | offset as u16).to_be_bytes()
}

/// `kind`'s replies to `query` (see [`Hostile`]).
fn replies(kind: Hostile, query: &[u8], transport: Transport) -> Vec<Vec<u8>> {
    if question(query).is_none() {
        return Vec::new();
    }
    let head = |id, flags, answers| reply_head(query, id, flags, answers);
    let message = match (kind, transport) {
        (Hostile::Silent, _) => None,
        (Hostile::CompressionLoop, _) => head(None, 0, 1).map(|mut m| {
            m.extend_from_slice(&[0xC0, 0x0C]);
            m.extend_from_slice(&MX_IN_300);
            m.extend_from_slice(&[0x00, 0x04, 0x00, 0x0A]);
            let exchange = m.len();
            m.extend_from_slice(&pointer(exchange));
            m
        }),
        (Hostile::CompressionCycle, _) => head(None, 0, 2).map(|mut m| {
            m.extend_from_slice(&[0xC0, 0x0C]);
            m.extend_from_slice(&MX_IN_300);
            m.extend_from_slice(&[0x00, 0x04, 0x00, 0x0A]);
            let exchange = m.len();
            let owner = exchange + 2;
            m.extend_from_slice(&pointer(owner));
            m.extend_from_slice(&pointer(exchange));
            m.extend_from_slice(&MX_IN_300);
            m.extend_from_slice(&[0x00, 0x04, 0x00, 0x14, 0xC0, 0x0C]);
            m
        }),
        (Hostile::Huge, Transport::Udp) => head(None, TC, 0),
        (Hostile::Huge, Transport::Tcp) => huge(query),
        (Hostile::WrongId, _) => {
            let id = !u16::from_be_bytes([query[0], query[1]]);
            head(Some(id), 0, 1).map(|mut m| {
                m.extend_from_slice(&[0xC0, 0x0C]);
                m.extend_from_slice(&MX_IN_300);
                m.extend_from_slice(&[0x00, 20, 0x00, 0x0A]);
                m.extend_from_slice(b"\x08wrong-id\x07invalid\x00");
                m
            })
        }
    };
    message.into_iter().collect()
}

/// [`Hostile::Huge`]'s TCP reply: 65,535 bytes, junk records after the question.
fn huge(query: &[u8]) -> Option<Vec<u8>> {
    const SIZE: usize = 65_535;
    // Owner, TYPE, CLASS, TTL and RDLENGTH, then the RDATA.
    const FIXED: usize = 12;
    const RDATA: usize = 4;
    let room = SIZE - 12 - question(query)?.len();
    let mut lengths = vec![RDATA; room / (FIXED + RDATA)];
    // What is left over lengthens the last record.
    *lengths.last_mut().unwrap() += room % (FIXED + RDATA);
    let mut m = reply_head(query, None, 0, u16::try_from(lengths.len()).unwrap())?;
    for len in lengths {
        m.extend_from_slice(&[0xC0, 0x0C, 0xFF, 0x00, 0x00, 0x01, 0, 0, 0, 0]);
        m.extend_from_slice(&u16::try_from(len).unwrap().to_be_bytes());
        m.resize(m.len() + len, 0xFF);
    }
    assert_eq!(m.len(), SIZE);
    Some(m)
}
