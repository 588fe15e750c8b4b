//! This worker's state across messages: its destinations session (`destinations.rs`)
//! and the connections it keeps, each with the slot it holds, for the next message to
//! the same destination (as Postfix's smtp connection cache: by destination, and used
//! only while idle less than `CONNECTION_CACHE_TIME`).
//!
//! A connection idle longer is closed by the janitor, a thread of this worker that
//! looks every quarter second, and its slot given back at once: an idle worker (no
//! message to run, so no code of the stage running) holds no destination's slot
//! beyond the cache time. The janitor and the message's run take turns on the state's
//! one lock; the QUIT of a closed connection is said outside it.
//!
//! Used by `mod.rs` (which starts it) and `deliver.rs`.

use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use super::destinations::{Session, Slot};
use crate::stages::relay::client::Connection;

/// At most this many connections kept idle by one worker; past it the oldest goes.
const MAX_IDLE: usize = 64;

/// How often the janitor looks.
const JANITOR_PERIOD: Duration = Duration::from_millis(250);

/// A connection kept for the next message.
pub struct Idle {
    /// What it may be used for: the section, the destination, the EHLO name and the
    /// TLS level ([`key`]).
    pub key: String,
    pub connection: Connection,
    pub slot: Slot,
    /// The exchanger: `name[address]` for the log, its address and port, and what a
    /// connection to it may be shared by ([`shared_key`]).
    pub peer: Peer,
    /// Since when it is idle.
    pub since: Instant,
    /// Its section's `CONNECTION_CACHE_TIME`.
    pub cache_time: Duration,
}

/// The worker's state.
pub struct State {
    /// The destinations session; `None` before the stage's start.
    pub session: Option<Session>,
    pub idle: Vec<Idle>,
}

static STATE: Mutex<State> = Mutex::new(State {
    session: None,
    idle: Vec::new(),
});

static JANITOR: Once = Once::new();

/// The key of a connection usable for `destination` from `section`.
pub fn key(section: &str, destination: &str, hostname: &str, level: &str) -> String {
    format!("{section}|{destination}|{hostname}|{level}")
}

/// An exchanger a connection goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// `name[address]`, for the log and the replies' texts.
    pub label: String,
    pub address: std::net::SocketAddr,
    /// Who may use a connection to it for another destination ([`shared_key`]).
    pub shared: String,
}

/// The key under which a connection to one exchanger address may serve any destination
/// of `section` with the same EHLO name and TLS level, as Postfix's cache by server
/// address: at `verify` only for the same exchanger name (the certificate was checked
/// against it).
pub fn shared_key(section: &str, hostname: &str, level: &str, exchanger: Option<&str>) -> String {
    format!("{section}|{hostname}|{level}|{}", exchanger.unwrap_or(""))
}

/// The state, locked.
pub fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Prepares the state with the worker's session settings and starts the janitor; once
/// per process (a second section keeps the first's session: they are the same).
pub fn start(settings: postgres::Config) {
    {
        let mut state = lock();
        if state.session.is_none() {
            state.session = Some(Session::new(settings));
        }
    }
    JANITOR.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("relay-to-internet-janitor".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(JANITOR_PERIOD);
                    sweep(false);
                }
            });
        if let Err(e) = spawned {
            log::warn!(
                "relay-to-internet: cannot start the thread that closes idle connections ({e}); they close when the next message comes"
            );
        }
    });
}

/// Closes the connections idle past their cache time (all of them with `all`), and
/// gives their slots back.
pub fn sweep(all: bool) {
    let expired: Vec<Idle> = {
        let mut state = lock();
        let (old, keep): (Vec<Idle>, Vec<Idle>) = std::mem::take(&mut state.idle)
            .into_iter()
            .partition(|i| all || i.since.elapsed() >= i.cache_time);
        state.idle = keep;
        old
    };
    if expired.is_empty() {
        return;
    }
    let mut slots = Vec::new();
    for idle in expired {
        idle.connection.quit();
        slots.push(idle.slot);
    }
    let mut state = lock();
    if let Some(session) = state.session.as_mut() {
        for slot in &slots {
            session.close(slot);
        }
    }
}

impl State {
    /// The kept connection for `key` whose slot is still held (its session alive);
    /// connections whose session is gone are closed.
    pub fn take(&mut self, key: &str) -> Option<Idle> {
        let generation = self.session.as_ref().map_or(0, |s| s.generation);
        let (stale, keep): (Vec<Idle>, Vec<Idle>) = std::mem::take(&mut self.idle)
            .into_iter()
            .partition(|i| i.slot.generation != generation);
        self.idle = keep;
        for idle in stale {
            idle.connection.quit();
        }
        let at = self.idle.iter().position(|i| i.key == key)?;
        Some(self.idle.swap_remove(at))
    }

    /// A kept connection to `address` that `shared` may use, whatever destination it
    /// was opened for.
    pub fn take_address(&mut self, shared: &str, address: std::net::SocketAddr) -> Option<Idle> {
        let generation = self.session.as_ref().map_or(0, |s| s.generation);
        let at = self.idle.iter().position(|i| {
            i.peer.address == address && i.peer.shared == shared && i.slot.generation == generation
        })?;
        Some(self.idle.swap_remove(at))
    }

    /// Keeps a connection for the next message; the oldest goes past [`MAX_IDLE`].
    pub fn keep(&mut self, idle: Idle) {
        self.idle.push(idle);
        if self.idle.len() > MAX_IDLE {
            let oldest = self
                .idle
                .iter()
                .enumerate()
                .min_by_key(|(_, i)| i.since)
                .map(|(at, _)| at)
                .expect("not empty");
            let gone = self.idle.swap_remove(oldest);
            self.release(gone);
        }
    }

    /// Closes a connection and gives its slot back.
    pub fn release(&mut self, idle: Idle) {
        idle.connection.quit();
        self.close_slot(&idle.slot);
    }

    /// Gives a slot back.
    pub fn close_slot(&mut self, slot: &Slot) {
        if let Some(session) = self.session.as_mut() {
            session.close(slot);
        }
    }
}
