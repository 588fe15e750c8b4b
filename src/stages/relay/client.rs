//! One connection to the smarthost (RFC 5321, RFC 2033): where it goes ([`Target`]),
//! connecting with a timeout, the greeting, EHLO or LHLO and what the smarthost offers
//! ([`Offers`]), sending command lines and reading replies, each bounded by a timeout,
//! RSET between messages and QUIT.
//!
//! Blocking std sockets (TCP or a unix socket). Used by `transaction.rs` (the commands
//! of one message) and `mod.rs` (keeping the connection across messages); it decides
//! nothing about a message.

use std::io::{BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::reply::{Broken, Reply, read_reply};
use super::stream::{Socket, Timed, Transport};
use crate::tls::Negotiated;

/// Where the smarthost listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `host:port` or `[ipv6]:port`.
    Tcp {
        /// The host name or address, without brackets.
        host: String,
        /// The port.
        port: u16,
    },
    /// `unix:/path`.
    Unix(PathBuf),
    /// One address of a mail exchanger (relay-to-internet), connected to from `bind`
    /// when set (`BIND_ADDRESS`).
    Address {
        /// The exchanger's address and port.
        address: SocketAddr,
        /// The local address to connect from.
        bind: Option<IpAddr>,
    },
}

impl Target {
    /// Parses `SMARTHOST`: `host:port`, `[ipv6]:port` or `unix:/path`.
    pub fn parse(text: &str) -> Result<Target, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err("a unix socket must be an absolute path (unix:/path)".into());
            }
            return Ok(Target::Unix(PathBuf::from(path)));
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (addr, port) = rest
                .split_once("]:")
                .ok_or("an IPv6 address is written [address]:port")?;
            addr.parse::<std::net::Ipv6Addr>()
                .map_err(|_| format!("{addr:?} is not an IPv6 address"))?;
            (addr, port)
        } else {
            text.rsplit_once(':')
                .ok_or("is not host:port, [ipv6]:port or unix:/path")?
        };
        let valid_host = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-:".contains(c));
        if !valid_host || (host.contains(':') && !text.starts_with('[')) {
            return Err(format!("{host:?} is not a host name or address"));
        }
        let port: u16 = port
            .parse()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("{port:?} is not a port number"))?;
        Ok(Target::Tcp {
            host: host.to_string(),
            port,
        })
    }

    /// Does the connection stay on this host (a unix socket, a loopback address or
    /// `localhost`), so that it needs no TLS?
    pub fn is_local(&self) -> bool {
        match self {
            Target::Unix(_) => true,
            Target::Address { address, .. } => address.ip().is_loopback(),
            Target::Tcp { host, .. } => {
                host.eq_ignore_ascii_case("localhost")
                    || host.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
            }
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
            Target::Address { address, .. } => write!(f, "{address}"),
            Target::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Target::Tcp { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

/// The RFC 5321 §4.5.3.2 timeouts, shortened: a message's whole transaction (its
/// connection, if one is opened for it, included) must end within their sum, its
/// [`Timeouts::budget`], which `pepsi-dispatch check` wants below `MAX_RUNTIME`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Establishing the connection.
    pub connect: Duration,
    /// The greeting and each command's reply (EHLO, MAIL, RCPT, DATA, RSET).
    pub command: Duration,
    /// Each write of the message data.
    pub data: Duration,
    /// The reply to the data's final dot.
    pub data_done: Duration,
}

impl Timeouts {
    /// One message's time: every wait of its transaction ends by then.
    pub fn budget(&self) -> Duration {
        self.connect + self.command + self.data + self.data_done
    }
}

/// `timeout`, cut short to what is left before `deadline`; an error when nothing is.
fn within(deadline: Instant, timeout: Duration) -> Result<Duration, Broken> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        return Err(Broken(
            "the message's time ran out (the sum of the relay's timeouts)".into(),
        ));
    }
    Ok(timeout.min(left))
}

/// Connects to a unix socket within `timeout` (a listener whose backlog is full makes
/// `connect` block): the connect runs on a thread of its own, left to finish alone.
fn connect_unix(path: &std::path::Path, timeout: Duration) -> Result<UnixStream, Broken> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(UnixStream::connect(&p));
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(Broken(format!("cannot connect to {}: {e}", path.display()))),
        Err(_) => Err(Broken(format!(
            "cannot connect to {}: timed out",
            path.display()
        ))),
    }
}

/// Connects to `address` from the local address `bind` (any when `None`) within
/// `timeout`: std connects only from an address the kernel picks, so the socket is
/// made, bound and connected here (non-blocking, then waited for with `poll`).
fn connect_from(
    address: SocketAddr,
    bind: Option<IpAddr>,
    timeout: Duration,
) -> Result<TcpStream, Broken> {
    use std::os::fd::FromRawFd;
    let failed = |what: &str| {
        Broken(format!(
            "cannot connect to {address}: {what}: {}",
            std::io::Error::last_os_error()
        ))
    };
    let Some(local) = bind else {
        let s = TcpStream::connect_timeout(&address, timeout)
            .map_err(|e| Broken(format!("cannot connect to {address}: {e}")))?;
        let _ = s.set_nodelay(true);
        return Ok(s);
    };
    if local.is_ipv4() != address.is_ipv4() {
        return Err(Broken(format!(
            "cannot connect to {address} from {local}: not the same address family"
        )));
    }
    let family = if address.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: a plain socket(2); the descriptor is owned by the stream made below (or
    // closed by it on the error paths).
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(failed("socket"));
    }
    // SAFETY: fd is a fresh socket nobody else owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (from, from_len) = sockaddr(SocketAddr::new(local, 0));
    // SAFETY: `from` is a valid sockaddr of `from_len` bytes.
    if unsafe { libc::bind(fd, (&raw const from).cast(), from_len) } != 0 {
        return Err(failed(&format!("bind to {local}")));
    }
    let (to, to_len) = sockaddr(address);
    // SAFETY: `to` is a valid sockaddr of `to_len` bytes.
    let r = unsafe { libc::connect(fd, (&raw const to).cast(), to_len) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(failed("connect"));
    }
    if r != 0 {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n == 0 {
            return Err(Broken(format!("cannot connect to {address}: timed out")));
        }
        if n < 0 {
            return Err(failed("poll"));
        }
        if let Some(e) = stream.take_error().ok().flatten() {
            return Err(Broken(format!("cannot connect to {address}: {e}")));
        }
    }
    stream
        .set_nonblocking(false)
        .map_err(|e| Broken(format!("cannot connect to {address}: {e}")))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A socket address as the C library takes it, with its length.
fn sockaddr(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match address {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// What the smarthost offers in its EHLO or LHLO reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offers {
    /// PIPELINING (RFC 2920).
    pub pipelining: bool,
    /// DSN (RFC 3461).
    pub dsn: bool,
    /// SMTPUTF8 (RFC 6531).
    pub smtputf8: bool,
    /// 8BITMIME (RFC 6152).
    pub eightbit: bool,
    /// SIZE (RFC 1870): `Some(0)` without a limit.
    pub size: Option<u64>,
    /// The XFORWARD attributes offered (upper-case), empty when not offered.
    pub xforward: Vec<String>,
    /// STARTTLS (RFC 3207).
    pub starttls: bool,
    /// The SASL mechanisms of AUTH (RFC 4954, upper-case), empty when not offered.
    pub auth: Vec<String>,
}

impl Offers {
    /// Reads the keywords of an EHLO or LHLO reply (its first line is the greeting).
    pub fn parse(reply: &Reply) -> Offers {
        let mut offers = Offers::default();
        for line in reply.lines.iter().skip(1) {
            let mut words = line.split_ascii_whitespace();
            let Some(keyword) = words.next() else {
                continue;
            };
            match keyword.to_ascii_uppercase().as_str() {
                "PIPELINING" => offers.pipelining = true,
                "DSN" => offers.dsn = true,
                "SMTPUTF8" => offers.smtputf8 = true,
                "8BITMIME" => offers.eightbit = true,
                "SIZE" => {
                    offers.size = Some(words.next().and_then(|n| n.parse().ok()).unwrap_or(0));
                }
                "XFORWARD" => {
                    offers.xforward = words.map(|w| w.to_ascii_uppercase()).collect();
                }
                "STARTTLS" => offers.starttls = true,
                // `AUTH=PLAIN LOGIN` is how servers written before RFC 4954 say it.
                "AUTH" | "AUTH=" => {
                    offers.auth.extend(words.map(|w| w.to_ascii_uppercase()));
                }
                k if k.starts_with("AUTH=") => {
                    offers.auth.push(k["AUTH=".len()..].to_string());
                    offers.auth.extend(words.map(|w| w.to_ascii_uppercase()));
                }
                _ => {}
            }
        }
        offers
    }
}

/// An open session with the smarthost, greeted and past EHLO or LHLO (and STARTTLS
/// and AUTH, when `secure.rs` opened it).
pub struct Connection {
    io: BufReader<Transport>,
    timeouts: Timeouts,
    /// When the current message's time is up: no wait goes beyond it.
    deadline: Instant,
    /// What the smarthost offers (after STARTTLS, what it offers then).
    pub offers: Offers,
    /// When it was opened (`CONNECTION_REUSE_TIME`).
    pub opened: Instant,
    /// Messages sent over it so far (`CONNECTION_REUSE_LIMIT`).
    pub messages: u32,
    /// What its TLS session negotiated; `None` in clear text.
    pub tls: Option<Negotiated>,
    /// The greeting's text (the host's name first, by custom).
    pub greeting: String,
    /// The reply that accepted the last message's data (the last one, over LMTP).
    pub last_reply: Option<String>,
}

/// Connects to a TCP target, trying each of its addresses in turn.
/// All of them within `timeout`: a host with many addresses that do not answer
/// cannot take a multiple of it (and the message's time with it).
fn connect_tcp(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, Broken> {
    let until = Instant::now() + timeout;
    let addresses: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| Broken(format!("cannot resolve {host}: {e}")))?
        .collect();
    let mut last = Broken(format!("{host} has no address"));
    for address in addresses {
        let left = until.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            break;
        }
        match TcpStream::connect_timeout(&address, left) {
            Ok(s) => {
                // Commands go out whole; no need to wait for more of them.
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Broken(format!("cannot connect to {address}: {e}")),
        }
    }
    Err(last)
}

impl Connection {
    /// Connects, reads the greeting and says EHLO (LHLO for `lmtp`) as `hostname`; a
    /// smarthost that does not recognise EHLO in SMTP (500, 501, 502, 504) is greeted
    /// with HELO and offers nothing; any other refusal fails the connection. In clear
    /// text: `secure.rs` opens one with TLS and AUTH from the same steps.
    pub fn open(
        target: &Target,
        lmtp: bool,
        hostname: &str,
        timeouts: Timeouts,
        deadline: Instant,
    ) -> Result<Connection, Broken> {
        let mut c = Connection::connect(target, timeouts, deadline)?;
        c.greeting()?;
        c.hello(lmtp, hostname)?;
        Ok(c)
    }

    /// Connects, within the connect timeout; nothing read or said yet.
    pub fn connect(
        target: &Target,
        timeouts: Timeouts,
        deadline: Instant,
    ) -> Result<Connection, Broken> {
        let connect = within(deadline, timeouts.connect)?;
        let socket = match target {
            Target::Tcp { host, port } => Socket::Tcp(connect_tcp(host, *port, connect)?),
            Target::Unix(path) => Socket::Unix(connect_unix(path, connect)?),
            Target::Address { address, bind } => {
                Socket::Tcp(connect_from(*address, *bind, connect)?)
            }
        };
        let wait = within(deadline, timeouts.command)?;
        Ok(Connection {
            io: BufReader::new(Transport::Plain(Timed::new(socket, Instant::now() + wait))),
            timeouts,
            deadline,
            offers: Offers::default(),
            opened: Instant::now(),
            messages: 0,
            tls: None,
            greeting: String::new(),
            last_reply: None,
        })
    }

    /// Reads the greeting, which must be 2xx.
    pub fn greeting(&mut self) -> Result<(), Broken> {
        let greeting = self.reply()?;
        if !greeting.is_ok() {
            return Err(Broken(format!("the smarthost greeted with {greeting}")));
        }
        self.greeting = greeting.text;
        Ok(())
    }

    /// EHLO (LHLO for `lmtp`), or HELO to a smarthost that does not know EHLO; what it
    /// offers.
    pub fn hello(&mut self, lmtp: bool, hostname: &str) -> Result<(), Broken> {
        let hello = if lmtp { "LHLO" } else { "EHLO" };
        let reply = self.command(&format!("{hello} {hostname}"))?;
        if reply.is_ok() {
            self.offers = Offers::parse(&reply);
        } else if lmtp || !matches!(reply.code, 500 | 501 | 502 | 504) {
            // Only a smarthost that does not know EHLO is greeted with HELO: a 4xx is
            // a failure of this connection, not a lack of extensions for its life.
            return Err(Broken(format!("the smarthost refused {hello}: {reply}")));
        } else {
            let helo = self.command(&format!("HELO {hostname}"))?;
            if !helo.is_ok() {
                return Err(Broken(format!("the smarthost refused HELO: {helo}")));
            }
            self.offers = Offers::default();
        }
        Ok(())
    }

    /// The stream, to move into a TLS session (`secure.rs`): only when no byte the
    /// smarthost sent is still unread (RFC 3207 §5: what came before the handshake
    /// must not be read as if it came inside it).
    pub fn take_transport(&mut self) -> Result<Transport, Broken> {
        if !self.io.buffer().is_empty() {
            return Err(Broken(
                "the smarthost sent more after its reply to STARTTLS: refusing to read it as if it were encrypted".into(),
            ));
        }
        Ok(std::mem::replace(self.io.get_mut(), Transport::Gone))
    }

    /// Puts the stream (now inside TLS) back, with what it negotiated.
    pub fn put_transport(&mut self, transport: Transport, tls: Negotiated) {
        self.io = BufReader::new(transport);
        self.tls = Some(tls);
    }

    /// Sets when the stream's current wait ends: `timeout` from now, cut short by the
    /// message's deadline.
    pub fn arm(&mut self, timeout: Duration) -> Result<(), Broken> {
        let wait = within(self.deadline, timeout)?;
        if let Some(t) = self.io.get_mut().timed() {
            t.until = Instant::now() + wait;
        }
        Ok(())
    }

    /// Gives the next message its time: no wait goes beyond `deadline`.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
    }

    /// Sends bytes (command lines or data), each write bounded by `timeout` and all of
    /// them by the message's deadline.
    pub fn send(&mut self, bytes: &[u8], timeout: Duration) -> Result<(), Broken> {
        for chunk in bytes.chunks(64 * 1024) {
            self.arm(timeout)?;
            self.io.get_mut().write_all(chunk)?;
        }
        self.arm(timeout)?;
        self.io.get_mut().flush()?;
        Ok(())
    }

    /// Reads one reply within the command timeout; a 421 closes the session.
    pub fn reply(&mut self) -> Result<Reply, Broken> {
        self.reply_within(self.timeouts.command)
    }

    /// Reads one reply within `timeout` (the whole reply, however it trickles in); a
    /// 421 closes the session.
    pub fn reply_within(&mut self, timeout: Duration) -> Result<Reply, Broken> {
        self.arm(timeout)?;
        let reply = read_reply(&mut self.io)?;
        if reply.code == 421 {
            return Err(Broken(format!("the smarthost closed the session: {reply}")));
        }
        Ok(reply)
    }

    /// Sends one command line and reads its reply.
    pub fn command(&mut self, line: &str) -> Result<Reply, Broken> {
        self.send(format!("{line}\r\n").as_bytes(), self.timeouts.command)?;
        self.reply()
    }

    /// The timeouts the connection was opened with.
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// RSET before the next message; an error means the session is gone.
    pub fn reset(&mut self) -> Result<(), Broken> {
        let reply = self.command("RSET")?;
        if reply.is_ok() {
            Ok(())
        } else {
            Err(Broken(format!("the smarthost refused RSET: {reply}")))
        }
    }

    /// Says QUIT and closes, without waiting long for the answer.
    pub fn quit(mut self) {
        self.timeouts.command = self.timeouts.command.min(Duration::from_secs(5));
        self.deadline = Instant::now() + self.timeouts.command;
        let _ = self.command("QUIT");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smarthosts_are_host_port_bracketed_ipv6_or_a_unix_path() {
        assert_eq!(
            Target::parse("127.0.0.1:25"),
            Ok(Target::Tcp {
                host: "127.0.0.1".into(),
                port: 25
            })
        );
        assert_eq!(
            Target::parse("[::1]:10025").unwrap().to_string(),
            "[::1]:10025"
        );
        assert_eq!(
            Target::parse("unix:/run/lmtp").unwrap(),
            Target::Unix("/run/lmtp".into())
        );
        for bad in [
            "mx.example",
            "::1:25",
            "[::1]25",
            "[nope]:25",
            "a b:25",
            "h:0",
            "h:x",
            "unix:rel",
            ":25",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_loopback_and_unix_sockets_are_local() {
        for local in [
            "127.0.0.1:25",
            "127.3.2.1:25",
            "[::1]:25",
            "localhost:25",
            "unix:/s",
        ] {
            assert!(Target::parse(local).unwrap().is_local(), "{local}");
        }
        for remote in [
            "10.0.0.1:25",
            "mx.example:25",
            "[2001:db8::1]:25",
            "localhost.example:25",
        ] {
            assert!(!Target::parse(remote).unwrap().is_local(), "{remote}");
        }
    }

    #[test]
    fn the_ehlo_reply_says_what_is_offered() {
        let reply = Reply {
            code: 250,
            text: String::new(),
            lines: [
                "mx hello",
                "PIPELINING",
                "size 1000",
                "DSN",
                "8BITMIME",
                "XFORWARD NAME addr LOGIN",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        };
        let o = Offers::parse(&reply);
        assert!(o.pipelining && o.dsn && o.eightbit && !o.smtputf8);
        assert_eq!(o.size, Some(1000));
        assert_eq!(o.xforward, vec!["NAME", "ADDR", "LOGIN"]);
        let plain = Offers::parse(&Reply {
            code: 250,
            text: String::new(),
            lines: vec!["PIPELINING".into(), "SIZE".into()],
        });
        assert!(!plain.pipelining, "the first line is the greeting");
        assert_eq!(plain.size, Some(0));
    }
}
