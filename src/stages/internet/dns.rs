//! A stub resolver (RFC 1035 §7.2, RFC 7766 for TCP): asks the name servers of
//! `/etc/resolv.conf`, or those of `NAMESERVER`, one question at a time, and returns
//! the records of the answer section it can use ([`Record`]: MX, A, AAAA, CNAME).
//!
//! Synchronous, on std sockets: a UDP query from a fresh socket on a random port with
//! a random id, answered by the server it was sent to (a connected socket) with the
//! same id and the same question, else ignored (RFC 5452); a truncated answer is asked
//! again over TCP. Each server is tried in turn, `attempts` rounds, each wait bounded
//! by the server timeout and all of them by the caller's deadline. SERVFAIL, REFUSED,
//! a malformed answer or silence move on to the next server; when none answers, the
//! lookup failed for now (the caller defers the mail). The messages are built and
//! parsed by the `domain` crate (see the README): its parser refuses compression
//! pointers that point forward or chain more than 255 times.
//!
//! Answers with records are kept for their smallest TTL (at most [`MAX_CACHE_TTL`]) in
//! this process, by server list, name and type, so a worker that delivers to a
//! destination again soon does not ask again; NXDOMAIN, empty answers and failures are
//! not kept.
//!
//! Used by `exchangers.rs`; it knows nothing of mail.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use domain::base::iana::{Class, Rcode};
use domain::base::{Message, MessageBuilder, Name, ParsedName, Rtype, ToName};
use domain::rdata::{A, Aaaa, Cname, Mx};

/// A domain name as the resolver holds it (compared case-insensitively).
pub type DnsName = Name<Vec<u8>>;

/// glibc's defaults (resolv.conf(5)): 5 s a server, two rounds.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_ATTEMPTS: u32 = 2;
/// At most three servers, as glibc reads them.
const MAX_SERVERS: usize = 3;
/// The largest DNS message (a TCP answer's two-byte length).
const MAX_MESSAGE: usize = 65_535;
/// The longest an answer is kept, whatever its TTL says.
pub const MAX_CACHE_TTL: Duration = Duration::from_secs(300);
/// The most answers kept; past it, the cache starts again empty.
const MAX_CACHED: usize = 10_000;

/// An answer's key in the cache: the servers asked, the name (lower case) and type.
type CacheKey = (Vec<SocketAddr>, String, u16);

/// The answers kept, with when they expire.
static CACHE: Mutex<Option<HashMap<CacheKey, (Answer, Instant)>>> = Mutex::new(None);

/// Where questions go and how long each may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolver {
    /// The servers, asked in this order.
    pub servers: Vec<SocketAddr>,
    /// How long one server gets for one question.
    pub timeout: Duration,
    /// How many rounds over the servers.
    pub attempts: u32,
}

/// One record of an answer this resolver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// An MX record: `owner` is handled by `exchange` at `preference`.
    Mx {
        owner: DnsName,
        preference: u16,
        exchange: DnsName,
    },
    /// An IPv4 address of `owner`.
    A { owner: DnsName, address: Ipv4Addr },
    /// An IPv6 address of `owner`.
    Aaaa { owner: DnsName, address: Ipv6Addr },
    /// `owner` is an alias of `target`.
    Cname { owner: DnsName, target: DnsName },
}

/// A server's final answer to a question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// NOERROR: the records of the answer section (none: the name exists without
    /// records of that type).
    Records(Vec<Record>),
    /// NXDOMAIN: the name does not exist.
    NoSuchName,
}

impl Resolver {
    /// The system's resolver: the `nameserver` lines and `options timeout: attempts:`
    /// of `/etc/resolv.conf`; no server named is the local host's (as glibc).
    pub fn system() -> Result<Resolver, String> {
        let path = "/etc/resolv.conf";
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Resolver::from_resolv_conf(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Resolver::from_resolv_conf(""))
            }
            Err(e) => Err(format!("cannot read {path}: {e}")),
        }
    }

    /// A resolver from the text of a resolv.conf; what it does not understand it
    /// leaves alone, as glibc does.
    pub fn from_resolv_conf(text: &str) -> Resolver {
        let mut servers = Vec::new();
        let mut timeout = DEFAULT_TIMEOUT;
        let mut attempts = DEFAULT_ATTEMPTS;
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    // An IPv6 address may carry a zone (`fe80::1%eth0`), which a socket
                    // address does not take from text: such a server is skipped.
                    if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) {
                        if servers.len() < MAX_SERVERS {
                            servers.push(SocketAddr::new(ip, 53));
                        }
                    }
                }
                Some("options") => {
                    for option in words {
                        if let Some(n) = option.strip_prefix("timeout:") {
                            if let Ok(n) = n.parse::<u64>() {
                                timeout = Duration::from_secs(n.clamp(1, 30));
                            }
                        } else if let Some(n) = option.strip_prefix("attempts:") {
                            if let Ok(n) = n.parse::<u32>() {
                                attempts = n.clamp(1, 5);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        if servers.is_empty() {
            servers.push(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 53));
        }
        Resolver {
            servers,
            timeout,
            attempts,
        }
    }

    /// The servers of `NAMESERVER`: addresses separated by commas or spaces, each
    /// `address`, `address:port` or `[ipv6]:port`, with the system's timeouts.
    pub fn parse_servers(text: &str) -> Result<Vec<SocketAddr>, String> {
        let mut servers = Vec::new();
        for word in text.split([',', ' ', '\t']).filter(|w| !w.is_empty()) {
            let server = if let Ok(ip) = word.parse::<IpAddr>() {
                SocketAddr::new(ip, 53)
            } else {
                word.parse::<SocketAddr>().map_err(|_| {
                    format!("{word:?} is not an address, address:port or [ipv6]:port")
                })?
            };
            if server.port() == 0 {
                return Err(format!("{word:?}: port 0"));
            }
            servers.push(server);
        }
        if servers.is_empty() {
            return Err("names no server".into());
        }
        if servers.len() > MAX_SERVERS {
            return Err(format!(
                "names {} servers, at most {MAX_SERVERS}",
                servers.len()
            ));
        }
        Ok(servers)
    }

    /// Asks `name`'s records of type `rtype`: the first final answer of a server, or
    /// why none came before `deadline` (a temporary failure).
    pub fn query(&self, name: &DnsName, rtype: Rtype, deadline: Instant) -> Result<Answer, String> {
        let key = (
            self.servers.clone(),
            name.to_string().to_ascii_lowercase(),
            rtype.to_int(),
        );
        {
            let cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((answer, until)) = cache.as_ref().and_then(|c| c.get(&key)) {
                if *until > Instant::now() {
                    return Ok(answer.clone());
                }
            }
        }
        let (answer, ttl) = self.ask_servers(name, rtype, deadline)?;
        if !ttl.is_zero() {
            let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
            let map = cache.get_or_insert_with(HashMap::new);
            if map.len() >= MAX_CACHED {
                map.clear();
            }
            map.insert(key, (answer.clone(), Instant::now() + ttl));
        }
        Ok(answer)
    }

    /// [`Resolver::query`] without the cache: the answer and how long it may be kept.
    fn ask_servers(
        &self,
        name: &DnsName,
        rtype: Rtype,
        deadline: Instant,
    ) -> Result<(Answer, Duration), String> {
        let mut last = String::from("no server was asked");
        for _ in 0..self.attempts {
            for &server in &self.servers {
                let left = deadline.saturating_duration_since(Instant::now());
                if left < Duration::from_millis(1) {
                    return Err(format!("{rtype} {name}: {last}; out of time"));
                }
                let until = Instant::now() + self.timeout.min(left);
                match ask(server, name, rtype, until) {
                    Ok(answer) => return Ok(answer),
                    Err(e) => last = format!("{server}: {e}"),
                }
            }
        }
        Err(format!("{rtype} {name}: {last}"))
    }
}

/// A question as a message: a random id, recursion desired.
fn question(name: &DnsName, rtype: Rtype, id: u16) -> Result<Vec<u8>, String> {
    let mut builder = MessageBuilder::new_vec();
    builder.header_mut().set_id(id);
    builder.header_mut().set_rd(true);
    let mut q = builder.question();
    q.push((name, rtype, Class::IN))
        .map_err(|e| format!("cannot ask {name}: {e}"))?;
    Ok(q.finish())
}

/// One server's answer, and how long it may be kept: over UDP, then TCP when the UDP
/// answer is truncated.
fn ask(
    server: SocketAddr,
    name: &DnsName,
    rtype: Rtype,
    until: Instant,
) -> Result<(Answer, Duration), String> {
    let id = crate::random::u64() as u16;
    let query = question(name, rtype, id)?;
    let reply = udp(server, &query, id, name, rtype, until)?;
    let reply = match reply {
        Some(reply) => reply,
        None => tcp(server, &query, id, name, rtype, until)?,
    };
    interpret(&reply, name)
}

/// What is left until `until`, at least a millisecond (a zero timeout means none).
fn left(until: Instant) -> Result<Duration, String> {
    let left = until.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        return Err("no answer in time".into());
    }
    Ok(left)
}

/// The UDP exchange: the answer, or `None` when it was truncated.
fn udp(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    name: &DnsName,
    rtype: Rtype,
    until: Instant,
) -> Result<Option<Vec<u8>>, String> {
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).map_err(|e| format!("UDP socket: {e}"))?;
    // Connected: datagrams from any other address are dropped by the kernel.
    socket.connect(server).map_err(|e| format!("UDP: {e}"))?;
    socket.send(query).map_err(|e| format!("UDP: {e}"))?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        socket
            .set_read_timeout(Some(left(until)?))
            .map_err(|e| format!("UDP: {e}"))?;
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if timed_out(&e) => return Err("no answer in time".into()),
            Err(e) => return Err(format!("UDP: {e}")),
        };
        let reply = &buf[..n];
        // Not the answer to this question (a late answer to an earlier one, or a
        // forgery): keep waiting for the real one.
        if !answers(reply, id, name, rtype) {
            continue;
        }
        let truncated = Message::from_slice(reply).is_ok_and(|m| m.header().tc());
        return Ok((!truncated).then(|| reply.to_vec()));
    }
}

/// The TCP exchange (RFC 7766): the query and the answer, each after its length.
fn tcp(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    name: &DnsName,
    rtype: Rtype,
    until: Instant,
) -> Result<Vec<u8>, String> {
    let mut stream =
        TcpStream::connect_timeout(&server, left(until)?).map_err(|e| format!("TCP: {e}"))?;
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    stream
        .set_write_timeout(Some(left(until)?))
        .and_then(|_| stream.write_all(&framed))
        .map_err(|e| format!("TCP: {e}"))?;
    let mut length = [0u8; 2];
    read_full(&mut stream, &mut length, until)?;
    let mut reply = vec![0u8; u16::from_be_bytes(length) as usize];
    read_full(&mut stream, &mut reply, until)?;
    if !answers(&reply, id, name, rtype) {
        return Err("the TCP answer is not to the question asked".into());
    }
    Ok(reply)
}

/// Reads exactly `buf.len()` bytes, all of them before `until` (a server sending a
/// byte at a time cannot stretch the wait).
fn read_full(stream: &mut TcpStream, buf: &mut [u8], until: Instant) -> Result<(), String> {
    let mut filled = 0;
    while filled < buf.len() {
        stream
            .set_read_timeout(Some(left(until)?))
            .map_err(|e| format!("TCP: {e}"))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err("TCP: the server closed the connection".into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err("no answer in time".into()),
            Err(e) => return Err(format!("TCP: {e}")),
        }
    }
    Ok(())
}

/// Did a read end because its timeout passed (a socket's read timeout reads as either
/// kind)?
fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Is `reply` a response with this id to exactly this question?
fn answers(reply: &[u8], id: u16, name: &DnsName, rtype: Rtype) -> bool {
    let Ok(message) = Message::from_slice(reply) else {
        return false;
    };
    let header = message.header();
    if header.id() != id || !header.qr() {
        return false;
    }
    match message.sole_question() {
        Ok(q) => q.qname() == name && q.qtype() == rtype && q.qclass() == Class::IN,
        Err(_) => false,
    }
}

/// The answer a reply gives: NOERROR's records, NXDOMAIN, or an error for any other
/// code and for a malformed answer section; with how long it may be kept (the smallest
/// TTL of the records used, at most [`MAX_CACHE_TTL`]; zero for no record).
fn interpret(reply: &[u8], name: &DnsName) -> Result<(Answer, Duration), String> {
    let message = Message::from_slice(reply).map_err(|_| "a malformed answer".to_string())?;
    match message.header().rcode() {
        Rcode::NOERROR => {}
        Rcode::NXDOMAIN => return Ok((Answer::NoSuchName, Duration::ZERO)),
        other => return Err(format!("{other} for {name}")),
    }
    let section = message
        .answer()
        .map_err(|e| format!("a malformed answer: {e}"))?;
    let mut records = Vec::new();
    let mut ttl = MAX_CACHE_TTL;
    for record in section {
        let record = record.map_err(|e| format!("a malformed answer: {e}"))?;
        if record.class() != Class::IN {
            continue;
        }
        let bad = |e: &dyn std::fmt::Display| format!("a malformed record: {e}");
        let owner = record.owner().to_name::<Vec<u8>>();
        let parsed = match record.rtype() {
            Rtype::MX => record
                .to_record::<Mx<ParsedName<&[u8]>>>()
                .map_err(|e| bad(&e))?
                .map(|r| Record::Mx {
                    owner,
                    preference: r.data().preference(),
                    exchange: r.data().exchange().to_name(),
                }),
            Rtype::A => record
                .to_record::<A>()
                .map_err(|e| bad(&e))?
                .map(|r| Record::A {
                    owner,
                    address: r.data().addr(),
                }),
            Rtype::AAAA => record
                .to_record::<Aaaa>()
                .map_err(|e| bad(&e))?
                .map(|r| Record::Aaaa {
                    owner,
                    address: r.data().addr(),
                }),
            Rtype::CNAME => record
                .to_record::<Cname<ParsedName<&[u8]>>>()
                .map_err(|e| bad(&e))?
                .map(|r| Record::Cname {
                    owner,
                    target: r.data().cname().to_name(),
                }),
            _ => None,
        };
        if parsed.is_some() {
            ttl = ttl.min(Duration::from_secs(record.ttl().as_secs().into()));
        }
        records.extend(parsed);
    }
    if records.is_empty() {
        ttl = Duration::ZERO;
    }
    Ok((Answer::Records(records), ttl))
}

/// A domain name from text (letters, digits, `-`, `_` and dots; no escapes), or why
/// it is none.
pub fn name(text: &str) -> Result<DnsName, String> {
    let text = text.strip_suffix('.').unwrap_or(text);
    let valid = !text.is_empty()
        && text.len() <= 253
        && text.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !valid {
        return Err(format!("{text:?} is not a domain name"));
    }
    DnsName::from_str(text).map_err(|e| format!("{text:?} is not a domain name: {e}"))
}

#[cfg(test)]
#[path = "dns_tests.rs"]
mod tests;
