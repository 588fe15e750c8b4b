//! Who gets a session of `pepsi-ingress` (§16, and what exhausting its sessions would cost): at
//! most `MAX_SESSIONS` in all, of which `TRUSTED_SESSIONS` only for the clients of
//! `XFORWARD_FROM` (the MTA in front), and at most `MAX_CLIENT_SESSIONS` of one other
//! client — an IPv4 address, an IPv6 /64 network, the user of a Unix socket's client.
//! Decided by the acceptor when it accepts, before a session thread exists, and counted
//! at once, so a burst of connections cannot overshoot a limit; a session's [`Ticket`]
//! gives its place back when the session ends.
//!
//! Called by `listen.rs`; [`decide`] is the pure rule.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use crate::config::ingress::IngressOptions;

/// One client, as the limits count it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Client {
    /// An IPv4 address, or an IPv6 address's /64 network.
    Network(IpAddr),
    /// The user of a Unix socket's client (its uid).
    User(u32),
}

impl Client {
    /// The client of a TCP connection from `addr`: IPv4 (an IPv4-mapped IPv6 address
    /// included) by address, IPv6 by /64, as the fairness key counts senders.
    pub fn of_address(addr: IpAddr) -> Client {
        match addr {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Client::Network(IpAddr::V4(v4)),
                None => Client::Network(IpAddr::V6(std::net::Ipv6Addr::from(
                    u128::from(v6) & (u128::MAX << 64),
                ))),
            },
            v4 => Client::Network(v4),
        }
    }
}

impl std::fmt::Display for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Client::Network(IpAddr::V6(n)) => write!(f, "{n}/64"),
            Client::Network(a) => write!(f, "{a}"),
            Client::User(uid) => write!(f, "unix (uid {uid})"),
        }
    }
}

/// Why a connection gets no session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Every session another client may have is taken.
    Busy,
    /// This client has its `MAX_CLIENT_SESSIONS` already.
    ClientBusy,
}

impl Refused {
    /// The reply the connection gets before it is closed.
    pub fn reply(self) -> &'static [u8] {
        match self {
            Refused::Busy => b"421 4.3.2 Too many sessions, try again later\r\n",
            Refused::ClientBusy => {
                b"421 4.7.0 Too many sessions from your address, try again later\r\n"
            }
        }
    }
}

/// The limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `MAX_SESSIONS`.
    pub sessions: usize,
    /// `MAX_CLIENT_SESSIONS`.
    pub per_client: usize,
    /// `TRUSTED_SESSIONS`.
    pub trusted: usize,
}

impl Limits {
    /// The limits of `[pepsi-ingress]`.
    pub fn of(options: &IngressOptions) -> Limits {
        Limits {
            sessions: options.max_sessions,
            per_client: options.max_client_sessions,
            trusted: options.trusted_sessions,
        }
    }
}

/// May a client with `mine` sessions open get one more, while `total` are open? A
/// trusted client may take any of `MAX_SESSIONS`; another only those not kept for the
/// trusted, and no more than its own limit.
pub fn decide(limits: Limits, total: usize, mine: usize, trusted: bool) -> Result<(), Refused> {
    if trusted {
        return if total < limits.sessions {
            Ok(())
        } else {
            Err(Refused::Busy)
        };
    }
    if total >= limits.sessions.saturating_sub(limits.trusted) {
        return Err(Refused::Busy);
    }
    if mine >= limits.per_client {
        return Err(Refused::ClientBusy);
    }
    Ok(())
}

/// The sessions open, in all and per client.
#[derive(Default)]
struct Open {
    total: usize,
    per_client: HashMap<Client, usize>,
}

/// The admission of every listener of the daemon.
pub struct Admission {
    limits: Limits,
    open: Mutex<Open>,
}

impl Admission {
    /// An admission with these limits and no session open.
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            open: Mutex::new(Open::default()),
        })
    }

    /// A session for `client`, counted now, or why not.
    pub fn admit(self: &Arc<Self>, client: Client, trusted: bool) -> Result<Ticket, Refused> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let mine = open.per_client.get(&client).copied().unwrap_or(0);
        decide(self.limits, open.total, mine, trusted)?;
        open.total += 1;
        *open.per_client.entry(client.clone()).or_insert(0) += 1;
        Ok(Ticket {
            admission: self.clone(),
            client,
        })
    }

    /// Sessions open now.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).total
    }
}

/// A session's place; given back when dropped.
pub struct Ticket {
    admission: Arc<Admission>,
    client: Client,
}

impl Ticket {
    /// The client it was given to.
    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut open = self
            .admission
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        open.total -= 1;
        if let Some(n) = open.per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.per_client.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        sessions: 10,
        per_client: 3,
        trusted: 4,
    };

    #[test]
    fn others_stop_short_of_the_trusted_reserve_and_of_their_own_limit() {
        assert_eq!(decide(LIMITS, 0, 0, false), Ok(()));
        assert_eq!(decide(LIMITS, 5, 2, false), Ok(()));
        assert_eq!(decide(LIMITS, 5, 3, false), Err(Refused::ClientBusy));
        assert_eq!(decide(LIMITS, 6, 0, false), Err(Refused::Busy));
        assert_eq!(decide(LIMITS, 6, 9, true), Ok(()), "the reserve is theirs");
        assert_eq!(decide(LIMITS, 9, 9, true), Ok(()));
        assert_eq!(decide(LIMITS, 10, 0, true), Err(Refused::Busy));
    }

    #[test]
    fn a_burst_is_counted_as_it_is_admitted_and_tickets_give_places_back() {
        let a = Admission::new(LIMITS);
        let one = Client::of_address("192.0.2.1".parse().unwrap());
        let mut held: Vec<Ticket> = (0..3)
            .map(|_| a.admit(one.clone(), false).unwrap())
            .collect();
        assert_eq!(a.admit(one.clone(), false).err(), Some(Refused::ClientBusy));
        for n in 2..5 {
            let other = Client::of_address(format!("192.0.2.{n}").parse().unwrap());
            held.push(a.admit(other, false).unwrap());
        }
        assert_eq!(a.open(), 6);
        let late = Client::of_address("198.51.100.7".parse().unwrap());
        assert_eq!(a.admit(late.clone(), false).err(), Some(Refused::Busy));
        let mta = Client::User(107);
        let trusted: Vec<Ticket> = (0..4)
            .map(|_| a.admit(mta.clone(), true).unwrap())
            .collect();
        assert_eq!(a.admit(mta.clone(), true).err(), Some(Refused::Busy));
        drop(trusted);
        held.truncate(2);
        assert_eq!(a.open(), 2);
        assert!(a.admit(late, false).is_ok());
        assert!(a.admit(one, false).is_ok(), "its own places came back");
    }

    #[test]
    fn an_ipv6_client_is_its_64_network_and_a_mapped_address_its_ipv4() {
        let a = Client::of_address("2001:db8:1:2:aaaa::1".parse().unwrap());
        let b = Client::of_address("2001:db8:1:2:bbbb::2".parse().unwrap());
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "2001:db8:1:2::/64");
        assert_eq!(
            Client::of_address("::ffff:192.0.2.9".parse().unwrap()),
            Client::of_address("192.0.2.9".parse().unwrap())
        );
    }
}
