//! The messages other threads send to the loop thread (among them what a reload read),
//! the sender that wakes the poller after each one (send first, then wake, so the loop
//! never sleeps past it), and the watch on every helper thread: one that dies tells the
//! loop, which shuts down with exit 70 (EX_SOFTWARE) instead of freezing with a claim
//! forever in flight. Vocabulary and the sender only: used by every thread, it uses no
//! file of the dispatcher that uses it back.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use super::claim::Claim;
use super::scheduler::Window;
use super::stats::Deltas;
use super::weights::WeightRow;
use crate::config::graph::OverrideRow;
use crate::config::{Config, ConfigError};
use crate::db::horizon::Holder;
use crate::exit::Failure;

/// Something the loop must learn about.
#[derive(Debug)]
pub enum Event {
    /// A claim finished: the rows, the seconds until the earliest paused row is due
    /// (negative when overdue), if any, and where a fair claim's sender windows ended.
    /// (What it asked of each stage the loop remembers itself.)
    Claimed {
        /// The claimed rows.
        claims: Vec<Claim>,
        /// Seconds until the earliest paused row is due.
        next_paused: Option<f64>,
        /// A fair claim's windows: per stage asked, the last tenant considered when its
        /// window was full and more wait, else `None`; per tenant whose walk of its
        /// senders stopped short or had a start, the same of its senders (§7). Empty
        /// for an oldest-first claim.
        windows: Vec<Window>,
        /// Per stage asked, where its next pick may start (`None`: the claim read no
        /// row there), as `floors.rs` takes it.
        floors: Vec<(String, Option<i64>)>,
        /// A fair claim's sweeps: per stage asked, where its next read of the rows it
        /// takes its senders from may start (schema 18). Empty for an oldest-first
        /// claim.
        sweeps: Vec<(String, Option<i64>)>,
        /// How long the statement took (a slow one pauses the senders' walks).
        took: Duration,
    },
    /// A claim could not be made (database trouble); nothing was claimed.
    ClaimFailed,
    /// Due paused rows were flipped to pending.
    Flipped {
        /// How many.
        count: i64,
        /// Seconds until the next paused row is due.
        next_paused: Option<f64>,
    },
    /// The paused-row flip failed; try again later.
    FlipFailed,
    /// A row was paused by the dispatcher (strike or deferral); it is due in this many
    /// seconds.
    Paused(f64),
    /// Rows deferred for 74 went back to pending early: this many.
    Resumed(u64),
    /// A body GC run ended; `more` when it hit its limit or failed, so the next
    /// statistics tick runs it again even without new activity.
    BodyGcDone {
        /// Run again.
        more: bool,
    },
    /// The coordinator lost its connection and with it the advisory lock.
    LockLost,
    /// The coordinator has its connection and the lock again, for the n-th time; the
    /// loop answers with a [`Command::Reconcile`](super::coordinator::Command) of the
    /// same number.
    LockRegained(u64),
    /// The coordinator cannot go on (lock not regained in time, or taken by another).
    Fatal(Failure),
    /// The coordinator finished the shutdown reset.
    ResetDone(Result<u64, String>),
    /// A notification arrived on this channel.
    Notify(String),
    /// The LISTEN session is (re)connected: catch up with a claim.
    ListenerUp,
    /// The LISTEN session was lost: the database may have restarted.
    ListenerLost,
    /// A reload's inputs were read.
    ReloadRead(Box<ReloadInput>),
    /// A statistics flush ended; on failure the deltas come back to be retried.
    Flushed(Result<(), (String, Box<Deltas>)>),
    /// Rows wait at stages that have no section: (stage, count).
    UnknownStages(Vec<(String, i64)>),
    /// Who holds the database's oldest snapshot, oldest first; or why they could not
    /// be read.
    Horizon(Result<Vec<Holder>, String>),
    /// A helper thread died (it panicked).
    ThreadDied {
        /// The thread's name.
        thread: String,
        /// The panic message.
        why: String,
    },
}

/// What a reload read off the loop, on the thread pool (§9): the overlay and the
/// configuration file.
#[derive(Debug)]
pub struct ReloadInput {
    /// `pepsi.config_override`, or why it cannot be read right now.
    pub overlay: Result<Vec<OverrideRow>, String>,
    /// `pepsi.fair_weights` (pattern, weight, rate), or why it cannot be read right now.
    pub weights: Result<Vec<WeightRow>, String>,
    /// The configuration file.
    pub file: ReloadFile,
}

/// The configuration file as a reload read it.
#[derive(Debug)]
pub enum ReloadFile {
    /// It was read and parses.
    Parsed(Box<Config>),
    /// It cannot be opened right now (replaced, briefly missing): why.
    Unreadable(String),
    /// It does not parse.
    Invalid(Vec<ConfigError>),
}

/// Sends events to the loop and wakes it.
#[derive(Clone)]
pub struct EventSender {
    tx: Sender<Event>,
    waker: Arc<mio::Waker>,
}

impl EventSender {
    /// A sender over `tx` that wakes `waker`.
    pub fn new(tx: Sender<Event>, waker: Arc<mio::Waker>) -> EventSender {
        EventSender { tx, waker }
    }

    /// Sends an event, then wakes the loop. Fails only when the loop is gone.
    pub fn send(&self, event: Event) -> bool {
        if self.tx.send(event).is_err() {
            return false;
        }
        if let Err(e) = self.waker.wake() {
            log::error!("cannot wake the dispatcher loop: {e}");
        }
        true
    }
}

/// Starts a helper thread whose death by panic is sent to the loop as
/// [`Event::ThreadDied`] (the panic message also goes to stderr through the hook).
pub fn spawn_watched(
    name: &str,
    events: EventSender,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    let thread = name.to_string();
    std::thread::Builder::new()
        .name(thread.clone())
        .spawn(move || {
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                let why = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                events.send(Event::ThreadDied { thread, why });
            }
        })
        .map(|_| ())
}
