//! The LISTEN session: a thread owning its own connection (the sync client exposes no
//! file descriptor to register with mio), forwarding every notification on
//! `workqueue`, `config_changed` and `telemetry_changed` to the loop.
//!
//! After every (re)connect it reports `ListenerUp`, because notifications sent while it
//! was away are lost and the loop must catch up with a claim (§6).
//!
//! Started by `run` (the module's root); it talks to the loop only through events and
//! writes nothing to the database.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;

use super::events::{Event, EventSender};
use crate::db::reconnect::Reconnect;
use crate::db::{self, sql};

/// How long one wait for notifications lasts before the stop flag is checked.
const WAIT: Duration = Duration::from_millis(500);
/// The longest wait between reconnection attempts (the first ten seconds of an
/// outage are tried every 250 ms, [`Reconnect`]).
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Starts the listener thread.
pub fn spawn(conninfo: String, events: EventSender, stop: Arc<AtomicBool>) -> std::io::Result<()> {
    let watcher = events.clone();
    super::events::spawn_watched("listener", watcher, move || run(&conninfo, &events, &stop))
}

fn run(conninfo: &str, events: &EventSender, stop: &AtomicBool) {
    let mut waits = Reconnect::new(RETRY_MAX);
    let mut said = crate::logging::Every::minute();
    while !stop.load(Ordering::Relaxed) {
        let connected = db::connect(conninfo, "pepsi-dispatch listener").and_then(|mut c| {
            c.batch_execute(sql::LISTEN_DISPATCHER)
                .map(|()| c)
                .map_err(|e| db::ConnectError {
                    kind: db::classify(&e),
                    message: db::describe(&e),
                })
        });
        let mut client = match connected {
            Ok(c) => c,
            Err(e) => {
                // An outage is said once a minute, not at every attempt.
                if said.due() {
                    log::warn!("LISTEN session: {e}; retrying (said once a minute)");
                }
                std::thread::sleep(waits.after_failure());
                continue;
            }
        };
        said.reset();
        waits.reset();
        log::debug!("LISTEN session connected");
        if !events.send(Event::ListenerUp) {
            return;
        }
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let mut notes = client.notifications();
            let mut it = notes.timeout_iter(WAIT);
            let mut failed = None;
            loop {
                match it.next() {
                    Ok(Some(n)) => {
                        if !events.send(Event::Notify(n.channel().to_string())) {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            drop(it);
            drop(notes);
            if let Some(e) = failed {
                log::warn!("LISTEN session lost: {}; reconnecting", db::describe(&e));
                events.send(Event::ListenerLost);
                break;
            }
            if client.is_closed() {
                log::warn!("LISTEN session closed; reconnecting");
                events.send(Event::ListenerLost);
                break;
            }
        }
    }
}
