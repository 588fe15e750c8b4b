//! The listeners of `pepsi-ingress`: binding each `[pepsi-ingress] LISTEN` entry (a
//! Unix socket, made connectable by everyone like an SMTP port, or a TCP address), one
//! acceptor thread per listener that starts a session thread per connection admitted
//! ([`super::admission`]: the limits in all, per client and the sessions kept for the
//! trusted MTA; a connection refused gets 421 and is closed), the register of the live
//! sessions' sockets through which a shutdown ends them, and each session's log line.
//!
//! Called by `mod.rs`; the protocol itself is `session.rs`'s.

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rustls::ServerConfig;

use super::admission::{Admission, Client, Ticket};
use super::commit::Committer;
use super::counters::Counters;
use super::session::{self, End, Settings};
use crate::config::ingress::{Address, IngressOptions, Listen};
use crate::exit::Failure;

/// A bound listener.
pub struct Bound {
    /// What `LISTEN` said.
    pub spec: Listen,
    socket: Socket,
}

enum Socket {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

/// Binds every listener; a failure names the entry.
pub fn bind_all(specs: &[Listen]) -> Result<Vec<Bound>, Failure> {
    specs
        .iter()
        .map(|spec| {
            let socket = match &spec.address {
                Address::Unix(path) => bind_unix(path).map(|l| Socket::Unix(l, path.clone())),
                Address::Tcp(addr) => TcpListener::bind(addr).map(Socket::Tcp),
            }
            .map_err(|e| {
                Failure::general(format!("[pepsi-ingress] LISTEN {spec}: cannot listen: {e}"))
            })?;
            Ok(Bound {
                spec: spec.clone(),
                socket,
            })
        })
        .collect()
}

/// Binds a Unix socket at `path`, replacing a socket left by an earlier run (but not
/// one a running server answers on), connectable by everyone.
fn bind_unix(path: &PathBuf) -> std::io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another server answers on this socket",
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// The live sessions' sockets, so that a shutdown can end their waits.
#[derive(Default)]
pub struct Sessions {
    next: AtomicU64,
    fds: Mutex<HashMap<u64, RawFd>>,
}

impl Sessions {
    /// How many sessions are live.
    pub fn count(&self) -> usize {
        self.fds.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Registers a session's socket; returns its key.
    fn add(&self, fd: RawFd) -> u64 {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        self.fds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, fd);
        key
    }

    /// Forgets a session's socket (before it is closed: its number may be reused).
    fn remove(&self, key: u64) {
        self.fds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }

    /// Ends every session's wait for its client: their reads see the end of input.
    pub fn interrupt_all(&self) {
        let fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        for fd in fds.values() {
            // SAFETY: the sockets are open while registered (removed before closing),
            // and the lock is held.
            unsafe { libc::shutdown(*fd, libc::SHUT_RD) };
        }
    }
}

/// What every session of every listener shares.
#[derive(Clone)]
pub struct Shared {
    /// `[pepsi-ingress]`.
    pub options: IngressOptions,
    /// `[pepsi] HOSTNAME`.
    pub hostname: String,
    /// The group commit.
    pub committer: Committer,
    /// The counters.
    pub counters: Arc<Counters>,
    /// Set at shutdown.
    pub stopping: Arc<AtomicBool>,
    /// The live sessions.
    pub sessions: Arc<Sessions>,
    /// Who gets a session.
    pub admission: Arc<Admission>,
    /// The TLS configuration new sessions' STARTTLS uses (SIGHUP replaces it; a
    /// session keeps the one it started with).
    pub tls: Arc<RwLock<Option<Arc<ServerConfig>>>>,
}

/// A running acceptor.
pub struct Acceptor {
    fd: RawFd,
    thread: JoinHandle<()>,
    path: Option<PathBuf>,
}

impl Acceptor {
    /// Stops accepting, waits for the thread and removes a Unix socket's file.
    pub fn stop(self) {
        // SAFETY: the listening socket is open until the thread ends; shutting it down
        // makes its blocked accept return.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        let _ = self.thread.join();
        if let Some(path) = self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Starts the acceptor of a bound listener.
pub fn spawn_acceptor(bound: Bound, shared: Shared) -> std::io::Result<Acceptor> {
    let (fd, path) = match &bound.socket {
        Socket::Unix(l, p) => (l.as_raw_fd(), Some(p.clone())),
        Socket::Tcp(l) => (l.as_raw_fd(), None),
    };
    let thread = std::thread::Builder::new()
        .name(format!("accept {}", bound.spec))
        .spawn(move || accept_loop(bound, shared))?;
    Ok(Acceptor { fd, thread, path })
}

fn accept_loop(bound: Bound, shared: Shared) {
    loop {
        let accepted = match &bound.socket {
            Socket::Unix(l, _) => l.accept().map(|(s, _)| Connection::Unix(s)),
            Socket::Tcp(l) => l.accept().map(|(s, a)| Connection::Tcp(s, a.ip())),
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let conn = match accepted {
            Ok(c) => c,
            Err(e) => {
                log::warn!("{}: accept failed: {e}", bound.spec);
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // Counted here, before the next accept: a burst cannot overshoot a limit.
        let trusted = shared.options.trusts(conn.peer());
        let ticket = match shared.admission.admit(conn.client(), trusted) {
            Ok(t) => t,
            Err(refused) => {
                let _ = conn.writer().write_all(refused.reply());
                continue;
            }
        };
        let shared = shared.clone();
        let protocol = bound.spec.protocol;
        let require_tls = shared.options.require_tls.contains(&bound.spec);
        let started = std::thread::Builder::new()
            .name("session".into())
            .spawn(move || run_session(conn, (protocol, require_tls), &shared, ticket));
        if let Err(e) = started {
            log::error!("cannot start a session thread: {e}");
        }
    }
}

/// An accepted connection.
enum Connection {
    Unix(UnixStream),
    Tcp(TcpStream, IpAddr),
}

impl Connection {
    fn peer(&self) -> Option<IpAddr> {
        match self {
            Connection::Unix(_) => None,
            Connection::Tcp(_, a) => Some(*a),
        }
    }

    /// The client, as the limits count it: its address, or a Unix socket's user.
    fn client(&self) -> Client {
        match self {
            Connection::Tcp(_, a) => Client::of_address(*a),
            Connection::Unix(s) => Client::User(peer_uid(s.as_raw_fd()).unwrap_or(u32::MAX)),
        }
    }

    fn fd(&self) -> RawFd {
        match self {
            Connection::Unix(s) => s.as_raw_fd(),
            Connection::Tcp(s, _) => s.as_raw_fd(),
        }
    }

    /// A writing handle (for the refusal of a session over the limit).
    fn writer(&self) -> Box<dyn Write + '_> {
        match self {
            Connection::Unix(s) => Box::new(s),
            Connection::Tcp(s, _) => Box::new(s),
        }
    }

    /// Sets the session's timeout on writes (a client that takes no reply); reads are
    /// bounded by the session's deadlines ([`Connection::read_timeout`]).
    fn set_timeout(&self, t: Duration) -> std::io::Result<()> {
        match self {
            Connection::Unix(s) => s.set_write_timeout(Some(t)),
            Connection::Tcp(s, _) => {
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    /// Sets how long the next read may wait.
    fn read_timeout(&self, t: Duration) -> std::io::Result<()> {
        match self {
            Connection::Unix(s) => s.set_read_timeout(Some(t)),
            Connection::Tcp(s, _) => s.set_read_timeout(Some(t)),
        }
    }
}

/// The user id of a Unix socket's peer (`SO_PEERCRED`).
fn peer_uid(fd: RawFd) -> Option<u32> {
    // SAFETY: getsockopt fills a ucred of the size given.
    unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        let r = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        );
        (r == 0).then_some(cred.uid)
    }
}

fn run_session(
    conn: Connection,
    (protocol, require_tls): (crate::config::ingress::Protocol, bool),
    shared: &Shared,
    ticket: Ticket,
) {
    let key = shared.sessions.add(conn.fd());
    Counters::bump(&shared.counters.sessions, 1);
    let peer = conn.peer();
    let shown = peer.map_or_else(|| "unix".to_string(), |a| a.to_string());
    let settings = Settings {
        protocol,
        hostname: &shared.hostname,
        max_size: shared.options.max_message_size,
        max_recipients: shared.options.max_recipients,
        max_errors: shared.options.max_errors,
        xforward: shared.options.trusts(peer),
        stopping: &shared.stopping,
        timeout: shared.options.timeout,
        min_data_rate: shared.options.min_data_rate,
        tls: shared.tls.read().unwrap_or_else(|p| p.into_inner()).clone(),
        require_tls,
    };
    let read_timeout = |t: Duration| conn.read_timeout(t);
    let summary = match conn.set_timeout(shared.options.timeout) {
        Err(e) => {
            log::warn!("session from {shown}: cannot set its timeout: {e}");
            None
        }
        Ok(()) => Some(match &conn {
            Connection::Unix(s) => session::serve(
                s,
                s,
                &settings,
                peer,
                &read_timeout,
                &shared.committer,
                &shared.counters,
            ),
            Connection::Tcp(s, _) => session::serve(
                s,
                s,
                &settings,
                peer,
                &read_timeout,
                &shared.committer,
                &shared.counters,
            ),
        }),
    };
    shared.sessions.remove(key);
    drop(conn);
    drop(ticket);
    if let Some(s) = summary {
        let end = match &s.end {
            End::Quit => "quit".to_string(),
            End::Closed => "closed by the client".to_string(),
            End::Timeout => "timed out".to_string(),
            End::TooManyErrors => "too many errors".to_string(),
            End::ShuttingDown => "shutting down".to_string(),
            End::Failed(e) => format!("failed: {e}"),
        };
        let tls = s
            .tls
            .as_ref()
            .map_or_else(String::new, |t| format!(", TLS {t}"));
        log::info!(
            "session from {shown} ({}{tls}): {} accepted ({} recipients), {} deferred, {} refused; {end}",
            s.helo.as_deref().unwrap_or("no HELO"),
            s.accepted,
            s.recipients,
            s.deferred,
            s.refused,
        );
    }
}
