//! Every database wait bounded on the client's side (§8.4 "A server that hangs"):
//! a server that accepts connections and never answers (a frozen primary, a paused
//! virtual machine, a partition) must not hold any session of ours longer than a
//! deadline of our own, because the server's own timeouts run on the server.
//!
//! One watchdog thread per process, started with the first connection, looks every
//! [`TICK`] at what this module was told:
//! - a connection attempt to one host ([`attempt`]) that has not ended within its
//!   `connect_timeout` — socket, startup and authentication together — has its socket
//!   shut down, so the client library's connect returns an error and the next host of
//!   a multi-host string is tried;
//! - a session ([`register`]) whose statement has waited longer than its
//!   `statement_timeout` and the [`GRACE`] (the server should have ended it by then)
//!   has its socket shut down: the call returns a connection error, and the session is
//!   abandoned as lost. Nothing leaks: the socket stays the client's, which closes it
//!   when it is dropped.
//! - a wait longer than [`SUSPECT_AFTER`] (a statement, or a connection attempt) makes
//!   it ask the host whether it answers at all: a probe opens a connection of its own
//!   and sends the 8-byte SSL request, which any live server answers with one byte at
//!   once. A host that does not answer within [`PROBE_WAIT`] is unresponsive: every
//!   session to it is shut down (idle ones too: they would hang at their next use, and
//!   a LISTEN session would never hear another notification), attempts to it end, and
//!   new connections skip it ([`unresponsive`]) until a probe, repeated every
//!   [`PROBE_EVERY`], is answered again. A statement that hangs while its host answers
//!   (one stopped backend, a frozen disk) is ended by its own deadline.
//!
//! The shut-down socket is found by what it is connected to: the socket files and TCP
//! addresses of the host, among the descriptors that appeared since the attempt began
//! (`/proc/self/fd`). Connection attempts are therefore made one at a time per process
//! ([`attempt`] holds a lock for the attempt's life; each is bounded).
//!
//! The dispatcher hands the hosts it found unresponsive to the workers it starts
//! ([`HINT_ENV`], [`hint`]), so that a new worker does not spend its first seconds on a
//! host the dispatcher already left.
//!
//! The files: this one (the state, the interface, the watchdog), `host.rs` (hosts and
//! how a socket is recognised as leading to one), `probe.rs` (the probe).
//!
//! Used by `hosts.rs` (attempts and skipping), `client.rs` (sessions and their
//! statements) and the dispatcher (the hint). Touches nothing but sockets of this
//! process that lead to a database host, and the state below.

mod host;
mod probe;

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use host::Host;
use host::{Matcher, host_of_key, inode_of, new_sockets_to, sockets};
pub use probe::probe_host;

/// How long a statement may run past its `statement_timeout` before the session is
/// abandoned: the server's own cancel, and its answer, have had that long to come.
pub const GRACE: Duration = Duration::from_secs(2);
/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(100);
/// A wait longer than this has its host probed.
pub const SUSPECT_AFTER: Duration = Duration::from_millis(500);
/// How long a probe waits for the server's first byte.
pub const PROBE_WAIT: Duration = Duration::from_secs(2);
/// A host is probed at most this often (an unresponsive one this often until it answers).
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// The hosts the dispatcher found unresponsive, one per line, given to the workers it
/// starts.
pub const HINT_ENV: &str = "PEPSI_UNRESPONSIVE_HOSTS";

// ---------------------------------------------------------------------------------
// The state.

/// A registered session.
#[derive(Debug)]
pub struct Session {
    /// Its key in the registry.
    id: u64,
    /// Its socket and the socket's inode (checked before a shutdown: the descriptor
    /// number is the client's, still open while the session is registered).
    fd: RawFd,
    inode: u64,
    host: Host,
    /// `statement_timeout` plus [`GRACE`]; `None`: only a host that stops answering
    /// ends its waits.
    budget: Option<Duration>,
    /// Since when a statement waits, in milliseconds since [`epoch`] plus one; 0 when
    /// none does.
    armed: AtomicU64,
    /// Set when the watchdog shut the socket down.
    abandoned: AtomicBool,
    /// The program's name for the session (`application_name`), for the log.
    name: String,
}

impl Session {
    /// Marks a statement as waiting until the returned guard is dropped.
    pub fn arm(self: &Arc<Session>) -> Armed {
        self.armed.store(now_ms() + 1, Ordering::Release);
        Armed {
            session: self.clone(),
        }
    }

    /// Whether the watchdog has shut this session's socket down.
    pub fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }
}

/// A statement waiting; dropping it says the wait is over.
pub struct Armed {
    session: Arc<Session>,
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.session.armed.store(0, Ordering::Release);
    }
}

/// One connection attempt to one host.
#[derive(Debug)]
struct Attempt {
    host: Host,
    started: Instant,
    limit: Duration,
    /// The sockets that existed when it began.
    before: HashSet<u64>,
    /// Set when the watchdog ended it.
    fired: AtomicBool,
}

#[derive(Debug, Default)]
struct HostState {
    /// Since when it does not answer, and why it was found so.
    unresponsive: Option<(Instant, String)>,
    /// A probe is running.
    probing: bool,
    /// When the last probe started.
    last_probe: Option<Instant>,
}

#[derive(Debug, Default)]
struct Watch {
    /// Registered sessions, weakly: one its client dropped is gone at the next look
    /// (its socket's inode is checked before any shutdown, so a descriptor number the
    /// process reused is never touched).
    sessions: HashMap<u64, std::sync::Weak<Session>>,
    attempts: HashMap<u64, Arc<Attempt>>,
    hosts: HashMap<Host, HostState>,
    next_id: u64,
}

/// The process's state, and the watchdog thread started with it.
fn state() -> &'static Mutex<Watch> {
    static STATE: OnceLock<Mutex<Watch>> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut watch = Watch::default();
        // The dispatcher's view, when it started this process.
        if let Some(hint) = std::env::var_os(HINT_ENV) {
            for key in hint.as_bytes().split(|&b| b == b'\n') {
                if let Some(host) = host_of_key(OsStr::from_bytes(key)) {
                    watch.hosts.entry(host).or_default().unresponsive =
                        Some((Instant::now(), "the dispatcher found it unresponsive".into()));
                }
            }
        }
        let spawned = std::thread::Builder::new()
            .name("db-watchdog".into())
            .spawn(watchdog);
        if let Err(e) = spawned {
            log::error!("cannot start the database watchdog thread: {e}; database waits are bounded by the server alone");
        }
        Mutex::new(watch)
    })
}

fn lock() -> MutexGuard<'static, Watch> {
    state().lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's clock origin for [`Session::armed`].
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

// ---------------------------------------------------------------------------------
// The interface.

/// Why connections skip `host`, when it is unresponsive.
pub fn unresponsive(host: &Host) -> Option<String> {
    let w = lock();
    let (since, why) = w.hosts.get(host)?.unresponsive.as_ref()?;
    Some(format!(
        "not answering for {:.1}s ({why}); skipped until a probe is answered",
        since.elapsed().as_secs_f64()
    ))
}

/// The hosts found unresponsive, for [`HINT_ENV`] (one per line); empty when none.
pub fn hint() -> String {
    let w = lock();
    let mut keys: Vec<String> = w
        .hosts
        .iter()
        .filter(|(_, s)| s.unresponsive.is_some())
        .map(|(h, _)| h.key())
        .filter(|k| !k.contains('\n'))
        .collect();
    keys.sort();
    keys.join("\n")
}

/// The lock that makes connection attempts one at a time, so that a new socket to a
/// host is the attempt's own.
fn attempt_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A connection attempt in progress (see [`attempt`]).
pub struct AttemptGuard {
    id: u64,
    attempt: Arc<Attempt>,
    matcher: Matcher,
    _one_at_a_time: MutexGuard<'static, ()>,
}

/// Begins a connection attempt to `host`, bounded by `limit` as a whole; the attempt
/// lasts until the guard is dropped. Waits for any other attempt of this process.
pub fn attempt(host: &Host, limit: Duration) -> AttemptGuard {
    let one_at_a_time = attempt_lock();
    let matcher = Matcher::of(host);
    let before = sockets().into_iter().map(|(_, inode)| inode).collect();
    let attempt = Arc::new(Attempt {
        host: host.clone(),
        started: Instant::now(),
        limit,
        before,
        fired: AtomicBool::new(false),
    });
    let mut w = lock();
    w.next_id += 1;
    let id = w.next_id;
    w.attempts.insert(id, attempt.clone());
    drop(w);
    AttemptGuard {
        id,
        attempt,
        matcher,
        _one_at_a_time: one_at_a_time,
    }
}

impl AttemptGuard {
    /// Whether the watchdog ended the attempt (it did not end within its limit, or its
    /// host stopped answering).
    pub fn fired(&self) -> bool {
        self.attempt.fired.load(Ordering::Acquire)
    }

    /// After a successful connect: the session's socket, to [`register`].
    pub fn socket(&self) -> Option<(RawFd, u64)> {
        let mut found = new_sockets_to(&self.attempt.before, &self.matcher);
        if found.len() > 1 {
            log::warn!(
                "{} sockets to {} appeared during one connection attempt; its statements are bounded by the server alone",
                found.len(),
                self.attempt.host.key()
            );
            return None;
        }
        found.pop()
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        lock().attempts.remove(&self.id);
    }
}

/// Registers a connected session: its socket, its host, and `statement_timeout`
/// (`None` when the session has none).
pub fn register(
    (fd, inode): (RawFd, u64),
    host: &Host,
    statement_timeout: Option<Duration>,
    name: &str,
) -> Arc<Session> {
    let mut w = lock();
    w.next_id += 1;
    let session = Arc::new(Session {
        id: w.next_id,
        fd,
        inode,
        host: host.clone(),
        budget: statement_timeout.map(|t| t + GRACE),
        armed: AtomicU64::new(0),
        abandoned: AtomicBool::new(false),
        name: name.to_string(),
    });
    w.sessions.insert(session.id, Arc::downgrade(&session));
    session
}

/// `statement_timeout` as the last `-c statement_timeout=…` of a connection's options
/// sets it (PostgreSQL's units; a bare number is milliseconds); `None` when none does
/// or it is 0 (no timeout).
pub fn statement_timeout(options: &str) -> Option<Duration> {
    let mut found = None;
    for word in options.split_whitespace() {
        let setting = word.trim_start_matches('-');
        let setting = setting.strip_prefix('c').unwrap_or(setting);
        let Some(value) = setting
            .strip_prefix("statement_timeout=")
            .or_else(|| setting.strip_prefix("statement-timeout="))
        else {
            continue;
        };
        found = Some(value.to_string());
    }
    let value = found?;
    let value = value.trim_matches(|c| c == '\'' || c == '"');
    let digits = value
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(digits);
    let number: f64 = number.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => number,
        "s" => number * 1e3,
        "min" => number * 60e3,
        "h" => number * 3600e3,
        "d" => number * 86400e3,
        "us" => number / 1e3,
        _ => return None,
    };
    (ms >= 1.0).then(|| Duration::from_secs_f64(ms / 1e3))
}

// ---------------------------------------------------------------------------------
// The watchdog.

fn watchdog() {
    loop {
        std::thread::sleep(TICK);
        let now = Instant::now();
        let now_ms = now_ms();
        let mut w = lock();
        let mut probe: HashSet<Host> = HashSet::new();
        for a in w.attempts.values() {
            if a.fired.load(Ordering::Acquire) {
                continue;
            }
            let waited = now.duration_since(a.started);
            if waited >= a.limit {
                log::warn!(
                    "database host {}: no connection within connect_timeout ({:.0}s); trying the next host",
                    a.host.key(),
                    a.limit.as_secs_f64()
                );
                end_attempt(a);
            } else if waited >= SUSPECT_AFTER {
                probe.insert(a.host.clone());
            }
        }
        w.sessions.retain(|_, s| s.strong_count() > 0);
        for s in w.sessions.values().filter_map(std::sync::Weak::upgrade) {
            let armed = s.armed.load(Ordering::Acquire);
            if armed == 0 || s.abandoned() {
                continue;
            }
            let waited = Duration::from_millis(now_ms.saturating_sub(armed - 1));
            if s.budget.is_some_and(|b| waited >= b) {
                log::warn!(
                    "database host {}: a statement of {} got no answer within its statement_timeout and {}s more ({:.1}s); its session is abandoned as lost",
                    s.host.key(),
                    s.name,
                    GRACE.as_secs(),
                    waited.as_secs_f64()
                );
                shut_down(&s);
                probe.insert(s.host.clone());
            } else if waited >= SUSPECT_AFTER {
                probe.insert(s.host.clone());
            }
        }
        for (host, state) in &w.hosts {
            if state.unresponsive.is_some() {
                probe.insert(host.clone());
            }
        }
        for host in probe {
            let state = w.hosts.entry(host.clone()).or_default();
            if state.probing || state.last_probe.is_some_and(|t| now - t < PROBE_EVERY) {
                continue;
            }
            state.probing = true;
            state.last_probe = Some(now);
            let spawned = std::thread::Builder::new().name("db-probe".into()).spawn({
                let host = host.clone();
                move || {
                    let answered = probe_host(&host, PROBE_WAIT);
                    probed(&host, answered);
                }
            });
            if spawned.is_err() {
                state.probing = false;
            }
        }
    }
}

/// A probe's result: a host that did not answer becomes unresponsive (its sessions and
/// attempts end); one that answers again is no longer.
fn probed(host: &Host, answered: bool) {
    let mut w = lock();
    let state = w.hosts.entry(host.clone()).or_default();
    state.probing = false;
    if answered {
        if let Some((since, _)) = state.unresponsive.take() {
            log::warn!(
                "database host {} no longer hangs: a new connection was answered or refused (after {:.1}s)",
                host.key(),
                since.elapsed().as_secs_f64()
            );
        }
        return;
    }
    if state.unresponsive.is_none() {
        state.unresponsive = Some((
            Instant::now(),
            format!(
                "it accepted no connection or did not answer one within {}s",
                PROBE_WAIT.as_secs()
            ),
        ));
        log::warn!(
            "database host {} does not answer (a new connection got no answer within {}s); abandoning every session to it, and skipping it until it answers",
            host.key(),
            PROBE_WAIT.as_secs()
        );
    }
    for s in w.sessions.values().filter_map(std::sync::Weak::upgrade) {
        if s.host == *host && !s.abandoned() {
            shut_down(&s);
        }
    }
    for a in w.attempts.values() {
        if a.host == *host && !a.fired.load(Ordering::Acquire) {
            end_attempt(a);
        }
    }
}

/// Shuts a session's socket down (the watchdog holds the state's lock, so the client
/// has not dropped the session: its descriptor is still its socket).
fn shut_down(s: &Session) {
    s.abandoned.store(true, Ordering::Release);
    if inode_of(s.fd) == Some(s.inode) {
        // SAFETY: the descriptor is the session's open socket (checked just above);
        // shutdown ends its traffic and leaves the descriptor to its owner.
        unsafe { libc::shutdown(s.fd, libc::SHUT_RDWR) };
    }
}

/// Ends an attempt: shuts down every socket to its host that appeared since it began.
fn end_attempt(a: &Attempt) {
    a.fired.store(true, Ordering::Release);
    let matcher = Matcher::of(&a.host);
    for (fd, inode) in new_sockets_to(&a.before, &matcher) {
        if inode_of(fd) == Some(inode) {
            // SAFETY: as in `shut_down`; the attempt's socket, or one of another
            // attempt to the same unanswering host.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_timeout_is_read_from_the_last_option_in_postgresql_units() {
        let t = |o: &str| statement_timeout(o);
        assert_eq!(
            t("-c lock_timeout=2s -c statement_timeout=10s"),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            t("-c statement_timeout=5min -c statement_timeout=1500"),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(t("--statement-timeout=1h"), Some(Duration::from_secs(3600)));
        assert_eq!(t("-cstatement_timeout=2s"), Some(Duration::from_secs(2)));
        assert_eq!(t("-c statement_timeout=0"), None);
        assert_eq!(t("-c lock_timeout=2s"), None);
        assert_eq!(t("-c statement_timeout=soon"), None);
    }
}
