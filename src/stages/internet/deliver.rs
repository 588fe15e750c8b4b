//! One message's delivery (§22): the split by destination, then one destination's
//! recipients to its exchangers, each recipient with its own result.
//!
//! In order: a connection this worker keeps for the destination (no lookup at all);
//! else the destination's exchangers, each address of each, every connection on a
//! slot of the destination (waiting up to `CONNECT_TIMEOUT` for one while all are
//! taken, then pausing the message a few seconds). A 2xx or 5xx recipient is settled
//! where it was answered; when an exchanger defers every recipient (a 4xx to MAIL, a
//! 421, a dropped connection), the next exchanger is asked, as Postfix does; a 4xx for
//! some recipients only defers those. An exchanger that greets with this host's own
//! name is this host: the mail would loop, and fails 5.4.6. Attempts that reach no
//! exchanger at all, or meet a 421 or a 4.7.x deferral of every recipient ("slow
//! down"), count against the destination (`destinations.rs`); an exchanger that answers
//! for a recipient clears the count. A suspended
//! destination's message pauses, without a connection and without a strike.
//!
//! The replies' texts are the relay's (`stages::relay::transaction`), which call the
//! peer "the smarthost"; here they name the exchanger instead, `name[address]`.
//! Used by `mod.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::Settings;
use super::cache::{self, Idle, Peer};
use super::destinations::{Opened, Slot};
use super::exchangers::{self, Addresses, Route};
use super::replies::{greeted_as, relabel, says_421, says_slow_down};
use crate::escape::Visible;
use crate::stages::relay::client::{Connection, Target};
use crate::stages::relay::reply::printable;
use crate::stages::relay::secure::{self, Security};
use crate::stages::relay::transaction::{self, Envelope};
use crate::tls::{self, Level};
use crate::worker::{Context, Message, Outcome, RecipientOutcomes, RecipientResult, StageError};

/// How long a message waits between two asks for a slot while all are taken.
const SLOT_POLL: Duration = Duration::from_millis(100);

/// How long a message that found no free slot in time pauses.
const BUSY_PAUSE: Duration = Duration::from_secs(5);

/// The longest reason kept for a recipient's result.
const MAX_REASON: usize = 900;

/// The recipients by destination (the domain after the last `@`, in lower case), in
/// the order they first appear; `None` for an address without a domain.
pub fn by_destination(recipients: &[String]) -> Vec<(Option<String>, Vec<String>)> {
    let mut groups: Vec<(Option<String>, Vec<String>)> = Vec::new();
    // Each destination's group, by name: 10,000 recipients in as many domains are
    // grouped in one pass, not compared pairwise.
    let mut index: HashMap<Option<String>, usize> = HashMap::new();
    for r in recipients {
        let destination = r
            .rsplit_once('@')
            .map(|(_, d)| d.to_ascii_lowercase())
            .filter(|d| !d.is_empty());
        match index.get(&destination) {
            Some(&at) => groups[at].1.push(r.clone()),
            None => {
                index.insert(destination.clone(), groups.len());
                groups.push((destination, vec![r.clone()]));
            }
        }
    }
    groups
}

/// Runs the stage on a message.
pub fn run(
    s: &Settings,
    message: &mut Message,
    cx: &mut Context<'_>,
    deadline: Instant,
) -> Result<Outcome, StageError> {
    let recipients = message.rcpt_to().to_vec();
    let mut groups = by_destination(&recipients);
    if groups.len() > 1 {
        cx.count("split");
        return Ok(Outcome::Split {
            groups: groups.into_iter().map(|(_, g)| g).collect(),
            stage: s.stage.clone(),
        });
    }
    let Some((destination, _)) = groups.pop() else {
        return Err(StageError::permanent("the message has no recipient"));
    };
    let mut d = Delivery::new(s, recipients, deadline);
    let Some(destination) = destination else {
        d.fail_all("5.1.3", "the recipient's address has no domain");
        return Ok(d.outcome());
    };
    let hostname = s
        .hostname
        .as_deref()
        .unwrap_or(&cx.pepsi.hostname)
        .to_string();
    let level = s.level_for(&destination)?;
    let key = cache::key(&s.stage, &destination, &hostname, level.name());
    let mail = Mail {
        id: message.id,
        envelope_from: message.mail_from(),
        dsn: message.state.get("dsn"),
        headers: message.headers().unwrap_or_default(),
        body: message.body().unwrap_or_default(),
    };
    d.kept(&key, &mail, cx);
    if !d.pending.is_empty() {
        d.route(&destination, &hostname, level, &key, &mail, cx)?;
    }
    if let Some(pause) = d.paused {
        return Ok(Outcome::Pause(pause));
    }
    log::info!(
        "relay-to-internet: message {} to {}: {}",
        mail.id,
        Visible(&destination),
        d.summary()
    );
    Ok(d.outcome())
}

/// What is sent: the message as loaded (borrowed, not copied).
struct Mail<'m> {
    id: i64,
    envelope_from: &'m str,
    dsn: Option<&'m serde_json::Value>,
    headers: &'m [u8],
    body: &'m [u8],
}

/// One destination's delivery in progress.
struct Delivery<'a> {
    s: &'a Settings,
    deadline: Instant,
    /// The row's recipients, in order (the outcome lists them so).
    recipients: Vec<String>,
    /// Settled results.
    settled: HashMap<String, RecipientResult>,
    /// Recipients not settled yet.
    pending: Vec<String>,
    /// The last reason a recipient was deferred, by recipient.
    deferred: HashMap<String, String>,
    /// Why the last attempt failed.
    last: Option<String>,
    /// Connection attempts that failed; sessions opened.
    failed_attempts: u32,
    sessions: u32,
    /// An exchanger said "slow down" (a 421, or 4.7.x to every recipient).
    slow_down: bool,
    /// The destination is suspended or busy: the message pauses this long.
    paused: Option<Duration>,
    /// Exchangers without an address (for good), and lookups that failed for now.
    no_address: Vec<String>,
    lookup_failed: Option<String>,
    /// The destination's failures were counted before: an answer clears them.
    had_failures: bool,
    /// Where the message went, for the log.
    via: Option<String>,
    /// The reply that took the message, for the delivery log.
    accepted: Option<String>,
}

impl<'a> Delivery<'a> {
    fn new(s: &'a Settings, recipients: Vec<String>, deadline: Instant) -> Delivery<'a> {
        Delivery {
            s,
            deadline,
            pending: recipients.clone(),
            recipients,
            settled: HashMap::new(),
            deferred: HashMap::new(),
            last: None,
            failed_attempts: 0,
            sessions: 0,
            slow_down: false,
            paused: None,
            no_address: Vec::new(),
            lookup_failed: None,
            had_failures: false,
            via: None,
            accepted: None,
        }
    }

    /// Fails every pending recipient with `status` and `reason`.
    fn fail_all(&mut self, status: &str, reason: &str) {
        let reason = printable(reason, MAX_REASON);
        for r in std::mem::take(&mut self.pending) {
            self.settled.insert(
                r,
                RecipientResult::Failed {
                    error: reason.clone(),
                    status: status.to_string(),
                    diagnostic: Some(format!("x-pepsi; {reason}")),
                },
            );
        }
    }

    /// Defers every pending recipient, each with its own last reason or `reason`.
    fn defer_all(&mut self, reason: &str) {
        for r in std::mem::take(&mut self.pending) {
            let why = self
                .deferred
                .get(&r)
                .cloned()
                .unwrap_or_else(|| reason.to_string());
            self.settled
                .insert(r, RecipientResult::Deferred(printable(&why, MAX_REASON)));
        }
    }

    /// The outcome: each recipient's result, in the row's order.
    fn outcome(mut self) -> Outcome {
        if !self.pending.is_empty() {
            let why = self.last.clone().unwrap_or_else(|| {
                "4.4.1 no exchanger could be reached in the message's time".to_string()
            });
            self.defer_all(&why);
        }
        let results = self
            .recipients
            .iter()
            .map(|r| {
                // An address listed twice gets its one result twice.
                let result = self
                    .settled
                    .get(r)
                    .cloned()
                    .unwrap_or_else(|| RecipientResult::Deferred("4.4.1 not tried".into()));
                (r.clone(), result)
            })
            .collect();
        Outcome::Recipients(RecipientOutcomes {
            next: self.s.next.clone(),
            results,
            relay: self.via.as_ref().map(|v| format!("{v}:{}", self.s.port)),
            accepted: self.accepted.clone(),
        })
    }

    /// How it went, for the log.
    fn summary(&self) -> String {
        let count = |kind: u8| {
            self.settled.values().filter(|r| r.kind() == kind).count()
                + if kind == 1 { self.pending.len() } else { 0 }
        };
        format!(
            "via {}: {} delivered, {} deferred, {} refused",
            self.via.as_deref().unwrap_or("no exchanger"),
            count(0),
            count(1),
            count(2)
        )
    }

    /// Uses the connection this worker keeps for `key`, if any.
    fn kept(&mut self, key: &str, mail: &Mail<'_>, cx: &mut Context<'_>) {
        let idle = cache::lock().take(key);
        let Some(mut idle) = idle else { return };
        let c = &idle.connection;
        let worn = c.opened.elapsed() >= self.s.reuse_time
            || (self.s.reuse_limit > 0 && c.messages >= self.s.reuse_limit);
        if worn {
            cache::lock().release(idle);
            return;
        }
        idle.connection.set_deadline(self.deadline);
        if let Err(e) = idle.connection.reset() {
            log::info!(
                "relay-to-internet: the kept connection to {} is gone ({}); opening another",
                idle.peer.label,
                Visible(&e.0)
            );
            cache::lock().release(idle);
            return;
        }
        cx.count("connection-reused");
        let Idle {
            key,
            connection,
            slot,
            peer,
            ..
        } = idle;
        self.transact(&key, connection, slot, peer, mail);
    }

    /// Looks the destination's exchangers up and tries them in order.
    fn route(
        &mut self,
        destination: &str,
        hostname: &str,
        level: Level,
        key: &str,
        mail: &Mail<'_>,
        cx: &mut Context<'_>,
    ) -> Result<(), StageError> {
        let resolver = self.s.resolver()?;
        let list = match exchangers::route(&resolver, destination, self.s.mx_limit, self.deadline) {
            Err(temporary) => {
                cx.count("dns-failed");
                self.last = Some(format!(
                    "4.4.3 the lookup of {destination}'s mail exchangers failed: {temporary}"
                ));
                return Ok(());
            }
            Ok(Route::Nowhere(nowhere)) => {
                cx.count("no-route");
                self.fail_all(nowhere.status, &nowhere.reason);
                return Ok(());
            }
            Ok(Route::Exchangers(list)) => list,
        };
        let config = self.s.client_config(level)?;
        let mut slot: Option<Slot> = None;
        'exchangers: for mx in &list {
            let addresses = match mx.addresses(&resolver, self.s.families, self.deadline) {
                Addresses::Found(a) => a,
                Addresses::None(why) => {
                    self.no_address.push(why);
                    continue;
                }
                Addresses::Failed(why) => {
                    self.lookup_failed = Some(why);
                    continue;
                }
            };
            // A name TLS cannot carry: clear text at `may` (which allows it), else this
            // exchanger cannot be used.
            let (name, exchanger_level) = match level {
                Level::None => (None, Level::None),
                _ => match tls::server_name(&mx.name) {
                    Ok(n) => (Some(n), level),
                    Err(_) if level == Level::May => (None, Level::None),
                    // The policy wants TLS: the mail waits (a policy problem is never
                    // a bounce).
                    Err(e) => {
                        self.lookup_failed =
                            Some(format!("TLS = {} with {}: {e}", level.name(), mx.name));
                        continue;
                    }
                },
            };
            let security = Security {
                level: exchanger_level,
                wrapper: false,
                config: config.clone(),
                name,
                auth: None,
            };
            let verified = (level == Level::Verify).then_some(mx.name.as_str());
            let shared = cache::shared_key(&self.s.stage, hostname, level.name(), verified);
            for ip in addresses {
                if self.pending.is_empty() || Instant::now() >= self.deadline {
                    break 'exchangers;
                }
                let address = SocketAddr::new(ip, self.s.port);
                let peer = Peer {
                    label: format!("{}[{ip}]", mx.name),
                    address,
                    shared: shared.clone(),
                };
                // A connection to this very address, kept for another destination: it
                // serves this one now, on a slot of this destination.
                if slot.is_none() {
                    if let Some((c, moved)) = self.shared(&peer, destination, cx)? {
                        self.sessions += 1;
                        self.transact(key, c, moved, peer, mail);
                        continue;
                    }
                }
                let held = match slot.take() {
                    Some(held) => held,
                    None => match self.take_slot(destination)? {
                        Some(held) => held,
                        None => break 'exchangers,
                    },
                };
                let target = Target::Address {
                    address,
                    bind: self.s.bind,
                };
                let opened = secure::open(
                    &target,
                    false,
                    hostname,
                    self.s.timeouts,
                    self.deadline,
                    &security,
                );
                let connection = match opened {
                    Ok(c) => c,
                    Err(e) => {
                        self.failed_attempts += 1;
                        self.slow_down |= says_421(&e.0);
                        let why = relabel(&e.0, &peer.label);
                        log::info!("relay-to-internet: message {}: {}", mail.id, Visible(&why));
                        self.last = Some(format!("4.4.1 {why}"));
                        slot = Some(held);
                        continue;
                    }
                };
                self.sessions += 1;
                cx.count("connection-opened");
                count_tls(&connection, cx);
                if greeted_as(&connection.greeting, hostname) {
                    connection.quit();
                    cache::lock().close_slot(&held);
                    self.fail_all(
                        "5.4.6",
                        &format!(
                            "mail for {destination} loops back to myself: {} greeted with this host's own name {hostname}",
                            peer.label
                        ),
                    );
                    break 'exchangers;
                }
                self.transact(key, connection, held, peer, mail);
            }
        }
        if let Some(held) = slot {
            cache::lock().close_slot(&held);
        }
        self.after(destination, cx);
        Ok(())
    }

    /// Takes a slot of the destination, waiting up to `CONNECT_TIMEOUT` while all are
    /// taken; `None` when the message pauses instead (suspended, or still busy).
    fn take_slot(&mut self, destination: &str) -> Result<Option<Slot>, StageError> {
        let until = (Instant::now() + self.s.timeouts.connect).min(self.deadline);
        loop {
            let start = crate::random::u64() as u32;
            let opened = {
                let mut state = cache::lock();
                let Some(session) = state.session.as_mut() else {
                    return Err(StageError::host("relay-to-internet was not started"));
                };
                session.open(destination, self.s.concurrency, start)
            };
            match opened.map_err(StageError::host)? {
                Opened::Slot(slot, had_failures) => {
                    self.had_failures = had_failures;
                    return Ok(Some(slot));
                }
                Opened::Suspended(left) => {
                    log::info!(
                        "relay-to-internet: {} is suspended for {}s more: the message waits",
                        Visible(destination),
                        left.as_secs()
                    );
                    self.last = Some(format!(
                        "4.4.1 {destination} is suspended after failed connections"
                    ));
                    self.pause(left);
                    return Ok(None);
                }
                Opened::Busy if Instant::now() + SLOT_POLL < until => {
                    std::thread::sleep(SLOT_POLL);
                }
                Opened::Busy => {
                    self.last = Some(format!(
                        "4.4.5 all {} connections to {destination} are in use",
                        self.s.concurrency
                    ));
                    self.pause(BUSY_PAUSE);
                    return Ok(None);
                }
            }
        }
    }

    /// Pauses the message — unless some of its recipients are settled already, in
    /// which case the others are deferred (the outcome must carry the settled ones).
    fn pause(&mut self, wait: Duration) {
        if self.settled.is_empty() {
            self.paused = Some(wait);
        }
    }

    /// A kept connection to `peer`'s address that this destination may share, after a
    /// successful RSET, on a slot of this destination that replaced the other's; `None`
    /// when there is none, or no slot of this destination is free (the connection is
    /// kept as it was).
    fn shared(
        &mut self,
        peer: &Peer,
        destination: &str,
        cx: &mut Context<'_>,
    ) -> Result<Option<(Connection, Slot)>, StageError> {
        let Some(mut idle) = cache::lock().take_address(&peer.shared, peer.address) else {
            return Ok(None);
        };
        let c = &idle.connection;
        let worn = c.opened.elapsed() >= self.s.reuse_time
            || (self.s.reuse_limit > 0 && c.messages >= self.s.reuse_limit);
        if worn {
            cache::lock().release(idle);
            return Ok(None);
        }
        idle.connection.set_deadline(self.deadline);
        if idle.connection.reset().is_err() {
            cache::lock().release(idle);
            return Ok(None);
        }
        let start = crate::random::u64() as u32;
        let moved = {
            let mut state = cache::lock();
            let Some(session) = state.session.as_mut() else {
                return Err(StageError::host("relay-to-internet was not started"));
            };
            session.reassign(&idle.slot, destination, self.s.concurrency, start)
        };
        match moved {
            Err(e) => {
                cache::lock().release(idle);
                Err(StageError::host(e))
            }
            Ok(Opened::Slot(slot, had_failures)) => {
                self.had_failures = had_failures;
                cx.count("connection-shared");
                Ok(Some((idle.connection, slot)))
            }
            Ok(Opened::Busy | Opened::Suspended(_)) => {
                idle.since = Instant::now();
                cache::lock().keep(idle);
                Ok(None)
            }
        }
    }

    /// An exchanger of the destination answered for a recipient (not a "slow down"):
    /// the failures counted against the destination are forgotten.
    fn succeeded(&mut self, destination: &str) {
        if self.had_failures {
            self.had_failures = false;
            if let Some(session) = cache::lock().session.as_mut() {
                session.succeeded(destination);
            }
        }
    }

    /// One transaction on an open connection, which is kept for the next message when
    /// it is still usable, else closed with its slot.
    fn transact(&mut self, key: &str, mut c: Connection, slot: Slot, peer: Peer, mail: &Mail<'_>) {
        let pending = self.pending.clone();
        let envelope = Envelope {
            mail_from: mail.envelope_from,
            rcpt_to: &pending,
            dsn: mail.dsn,
            client_ip: None,
            auth_user: None,
            lmtp: false,
        };
        self.via = Some(peer.label.clone());
        let label = peer.label.clone();
        let results = match transaction::deliver(&mut c, &envelope, mail.headers, mail.body) {
            Ok(results) => {
                c.messages += 1;
                if let Some(reply) = c.last_reply.take() {
                    self.accepted = Some(reply);
                }
                cache::lock().keep(Idle {
                    key: key.to_string(),
                    connection: c,
                    slot,
                    peer,
                    since: Instant::now(),
                    cache_time: self.s.cache_time,
                });
                results
            }
            Err((broken, partial)) => {
                drop(c);
                cache::lock().close_slot(&slot);
                self.slow_down |= says_421(&broken.0);
                let why = format!("4.4.2 {}", relabel(&broken.0, &label));
                self.last = Some(why);
                partial
            }
        };
        let all_deferred = results
            .iter()
            .all(|(_, r)| matches!(r, RecipientResult::Deferred(_)));
        // Every recipient deferred with a 4.7.x status (a rate limit, "too many
        // connections", "try again later"): the exchanger asks for less.
        self.slow_down |= all_deferred
            && !results.is_empty()
            && results.iter().all(|(_, r)| match r {
                RecipientResult::Deferred(text) => says_slow_down(text),
                _ => false,
            });
        for (address, result) in results {
            match result {
                RecipientResult::Deferred(text) => {
                    let text = relabel(&text, &label);
                    self.deferred.insert(address.clone(), text.clone());
                    self.last = Some(text);
                    if !all_deferred {
                        let why = self.deferred[&address].clone();
                        self.settled.insert(address, RecipientResult::Deferred(why));
                    }
                }
                RecipientResult::Failed {
                    error,
                    status,
                    diagnostic,
                } => {
                    let error = relabel(&error, &label);
                    self.settled.insert(
                        address,
                        RecipientResult::Failed {
                            error,
                            status,
                            diagnostic,
                        },
                    );
                }
                RecipientResult::Done => {
                    self.settled.insert(address, RecipientResult::Done);
                }
            }
        }
        // What is settled leaves the pending, in one pass (a row may hold thousands).
        let settled = &self.settled;
        self.pending.retain(|p| !settled.contains_key(p));
    }

    /// After the exchangers: counts the attempt against the destination when no
    /// exchanger was reached (or one said 421), and settles what is still pending.
    fn after(&mut self, destination: &str, cx: &mut Context<'_>) {
        if self.paused.is_some() {
            return;
        }
        let answered = self
            .settled
            .values()
            .any(|r| !matches!(r, RecipientResult::Deferred(_)));
        if self.sessions > 0 && answered && !self.slow_down {
            self.succeeded(destination);
        }
        if (self.sessions == 0 && self.failed_attempts > 0) || self.slow_down {
            let why = self.last.clone().unwrap_or_default();
            let suspended = {
                let mut state = cache::lock();
                state
                    .session
                    .as_mut()
                    .map(|s| s.failed(destination, &why, self.s.dead_after, self.s.dead_time))
            };
            match suspended {
                Some(Ok(Some(left))) => {
                    cx.count("destination-suspended");
                    log::warn!(
                        "relay-to-internet: {} suspended for {}s: {}",
                        Visible(destination),
                        left.as_secs(),
                        Visible(&why)
                    );
                }
                Some(Err(e)) => log::warn!(
                    "relay-to-internet: cannot count the failure of {}: {}",
                    Visible(destination),
                    Visible(&e)
                ),
                _ => {}
            }
        }
        if self.pending.is_empty() {
            return;
        }
        if self.sessions == 0 && self.failed_attempts == 0 {
            if let Some(why) = self.lookup_failed.clone() {
                self.last = Some(format!("4.4.3 {why}"));
            } else if let Some(why) = self.no_address.first().cloned() {
                self.fail_all("5.4.4", &why);
            }
        }
    }
}

/// Counts how the connection is protected, as the relay does.
fn count_tls(c: &Connection, cx: &mut Context<'_>) {
    match &c.tls {
        Some(t) => cx.count(if t.verified {
            "tls-verified"
        } else {
            "tls-unverified"
        }),
        None => cx.count("no-tls"),
    }
}

#[cfg(test)]
#[path = "deliver_tests.rs"]
mod tests;
