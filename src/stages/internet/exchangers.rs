//! Where a domain's mail goes (RFC 5321 §5.1, RFC 7505): its MX records by preference,
//! equal preferences in random order, at most `MX_LIMIT` of them; no MX record → the
//! domain itself (the implicit MX); a null MX (`0 .`) → nowhere (5.1.10); a domain
//! that does not exist → 5.1.2; a failed lookup → try later (4.4.3). Each exchanger's
//! addresses are looked up when it is its turn ([`Route::addresses`]).
//!
//! As Postfix's smtp(8): CNAMEs are followed (an MX target that is an alias still
//! delivers, though RFC 2181 forbids it); an MX target written as an address
//! (`MX 10 192.0.2.1`) is no host name and is skipped with a warning; a domain literal
//! (`user@[192.0.2.1]`) goes to that address without a lookup.
//!
//! Used by `mod.rs`; uses `dns.rs` for the questions. Decides no message's fate: it
//! answers where to go or why nowhere.

use std::net::IpAddr;
use std::time::Instant;

use domain::base::Rtype;

use super::dns::{self, Answer, DnsName, Record, Resolver};

/// How many CNAMEs one name may go through.
const MAX_ALIASES: usize = 8;

/// The address families tried (`INET_PROTOCOLS`), IPv4 first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Families {
    Ipv4,
    Ipv6,
    All,
}

/// One mail exchanger of a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchanger {
    /// Its host name (the domain itself for the implicit MX); for a domain literal,
    /// the address.
    pub name: String,
    /// Its MX preference (0 for the implicit MX and a domain literal).
    pub preference: u16,
    /// The name its addresses are looked up under; `None` for a domain literal.
    lookup: Option<DnsName>,
    /// A domain literal's address.
    literal: Option<IpAddr>,
}

/// Why a domain's mail cannot go anywhere, for good: the recipients fail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nowhere {
    /// The RFC 3463 status (5.1.2, 5.1.10, 5.4.4).
    pub status: &'static str,
    /// What the sender reads.
    pub reason: String,
}

/// Where a domain's mail goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// To these exchangers, in the order to try them.
    Exchangers(Vec<Exchanger>),
    /// Nowhere, for good.
    Nowhere(Nowhere),
}

/// A lookup that went wrong for now (SERVFAIL, a timeout): the mail waits (4.4.3).
pub type Temporary = String;

/// The exchangers of `domain` (lower-case, as the recipient's address has it), at most
/// `limit`.
pub fn route(
    resolver: &Resolver,
    domain: &str,
    limit: usize,
    deadline: Instant,
) -> Result<Route, Temporary> {
    if let Some(literal) = domain_literal(domain) {
        return Ok(match literal {
            Some(address) => Route::Exchangers(vec![Exchanger {
                name: address.to_string(),
                preference: 0,
                lookup: None,
                literal: Some(address),
            }]),
            None => Route::Nowhere(Nowhere {
                status: "5.1.2",
                reason: format!("{domain} is not an address literal this relay can reach"),
            }),
        });
    }
    if !domain.is_ascii() {
        return Ok(Route::Nowhere(Nowhere {
            status: "5.1.2",
            reason:
                "an internationalised domain name (not in ASCII) cannot be looked up by this relay"
                    .into(),
        }));
    }
    let name = match dns::name(domain) {
        Ok(n) => n,
        Err(e) => {
            return Ok(Route::Nowhere(Nowhere {
                status: "5.1.2",
                reason: e,
            }));
        }
    };
    let (canonical, records) = match lookup(resolver, &name, Rtype::MX, deadline)? {
        Found::Records(canonical, records) => (canonical, records),
        Found::NoSuchName => {
            return Ok(Route::Nowhere(Nowhere {
                status: "5.1.2",
                reason: format!(
                    "Host or domain name not found: {domain} does not exist (NXDOMAIN)"
                ),
            }));
        }
    };
    let mut mx: Vec<(u16, DnsName)> = records
        .into_iter()
        .filter_map(|r| match r {
            Record::Mx {
                owner,
                preference,
                exchange,
            } if owner == canonical => Some((preference, exchange)),
            _ => None,
        })
        .collect();
    if mx.is_empty() {
        // No MX record: the domain itself, at preference 0 (RFC 5321 §5.1).
        return Ok(Route::Exchangers(vec![Exchanger {
            name: canonical.to_string(),
            preference: 0,
            lookup: Some(canonical),
            literal: None,
        }]));
    }
    if mx.len() == 1 && mx[0].1.is_root() {
        return Ok(Route::Nowhere(Nowhere {
            status: "5.1.10",
            reason: format!("{domain} accepts no mail: it publishes a null MX (RFC 7505)"),
        }));
    }
    // A null MX among others names no host: left out.
    mx.retain(|(_, exchange)| !exchange.is_root());
    let count = mx.len();
    mx.retain(|(_, exchange)| {
        let numeric = exchange.to_string().parse::<IpAddr>().is_ok();
        if numeric {
            log::warn!(
                "relay-to-internet: {domain}: the MX record names {exchange}, an address, not a host name: skipped"
            );
        }
        !numeric
    });
    if mx.is_empty() {
        return Ok(Route::Nowhere(Nowhere {
            status: "5.4.4",
            reason: format!(
                "{domain}'s {count} MX record(s) name addresses, not host names: no exchanger to try"
            ),
        }));
    }
    Ok(Route::Exchangers(ordered(mx, limit)))
}

/// The exchangers by preference, equal ones in random order, the first `limit`.
fn ordered(mut mx: Vec<(u16, DnsName)>, limit: usize) -> Vec<Exchanger> {
    // A random key each, then a sort by (preference, key): a fair shuffle within each
    // preference.
    let mut keyed: Vec<(u16, u64, DnsName)> = mx
        .drain(..)
        .map(|(p, n)| (p, crate::random::u64(), n))
        .collect();
    keyed.sort_by_key(|(p, key, _)| (*p, *key));
    let mut seen: Vec<DnsName> = Vec::new();
    let mut out = Vec::new();
    for (preference, _, name) in keyed {
        // One exchanger named twice is tried once, at its best preference.
        if seen.contains(&name) {
            continue;
        }
        seen.push(name.clone());
        out.push(Exchanger {
            name: name.to_string(),
            preference,
            lookup: Some(name),
            literal: None,
        });
        if out.len() == limit {
            break;
        }
    }
    out
}

/// `[address]` or `[IPv6:address]`: `Some(Some(address))`; a bracketed domain that is
/// no address: `Some(None)`; no brackets: `None`.
fn domain_literal(domain: &str) -> Option<Option<IpAddr>> {
    let inner = domain.strip_prefix('[')?.strip_suffix(']')?;
    let text = match inner.get(..5) {
        Some(tag) if tag.eq_ignore_ascii_case("ipv6:") => &inner[5..],
        _ => inner,
    };
    Some(text.parse::<IpAddr>().ok())
}

/// What a lookup found, CNAMEs followed.
enum Found {
    /// The name at the end of the CNAME chain and the records of the answers.
    Records(DnsName, Vec<Record>),
    NoSuchName,
}

/// Asks `name`'s records of `rtype`, following CNAMEs, within the answer and with new
/// questions for a chain the answer does not finish.
fn lookup(
    resolver: &Resolver,
    name: &DnsName,
    rtype: Rtype,
    deadline: Instant,
) -> Result<Found, Temporary> {
    let mut current = name.clone();
    let mut aliases = 0;
    loop {
        let records = match resolver.query(&current, rtype, deadline)? {
            Answer::Records(r) => r,
            Answer::NoSuchName => return Ok(Found::NoSuchName),
        };
        let mut end = current.clone();
        while let Some(target) = records.iter().find_map(|r| match r {
            Record::Cname { owner, target } if *owner == end => Some(target.clone()),
            _ => None,
        }) {
            aliases += 1;
            if aliases > MAX_ALIASES {
                return Err(format!("{name}: more than {MAX_ALIASES} CNAMEs (a loop?)"));
            }
            end = target;
        }
        let found = records.iter().any(|r| match r {
            Record::Mx { owner, .. } | Record::A { owner, .. } | Record::Aaaa { owner, .. } => {
                *owner == end
            }
            Record::Cname { .. } => false,
        });
        if found || end == current {
            return Ok(Found::Records(end, records));
        }
        // The chain leads out of what this answer holds: ask its end.
        current = end;
    }
}

/// How an exchanger's address lookup went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addresses {
    /// Its addresses, IPv4 first.
    Found(Vec<IpAddr>),
    /// It has none (NXDOMAIN, or no A/AAAA record): for good.
    None(String),
    /// The lookup failed for now.
    Failed(Temporary),
}

impl Exchanger {
    /// Its addresses of `families`.
    pub fn addresses(
        &self,
        resolver: &Resolver,
        families: Families,
        deadline: Instant,
    ) -> Addresses {
        if let Some(address) = self.literal {
            return Addresses::Found(vec![address]);
        }
        let Some(name) = &self.lookup else {
            return Addresses::None(format!("{} has no address", self.name));
        };
        let mut found = Vec::new();
        let mut failed = None;
        let types: &[Rtype] = match families {
            Families::Ipv4 => &[Rtype::A],
            Families::Ipv6 => &[Rtype::AAAA],
            Families::All => &[Rtype::A, Rtype::AAAA],
        };
        for &rtype in types {
            match lookup(resolver, name, rtype, deadline) {
                Ok(Found::Records(end, records)) => {
                    found.extend(records.iter().filter_map(|r| match r {
                        Record::A { owner, address } if *owner == end => Some(IpAddr::V4(*address)),
                        Record::Aaaa { owner, address } if *owner == end => {
                            Some(IpAddr::V6(*address))
                        }
                        _ => None,
                    }));
                }
                Ok(Found::NoSuchName) => {}
                Err(e) => failed = Some(e),
            }
        }
        found.dedup();
        if !found.is_empty() {
            return Addresses::Found(found);
        }
        match failed {
            Some(e) => Addresses::Failed(e),
            None => Addresses::None(format!(
                "Host or domain name not found: {name} has no address"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn mx(list: &[(u16, &str)]) -> Vec<(u16, DnsName)> {
        list.iter()
            .map(|(p, n)| (*p, DnsName::from_str(n).unwrap()))
            .collect()
    }

    #[test]
    fn exchangers_go_by_preference_equal_ones_shuffled_each_once_at_most_the_limit() {
        let list = mx(&[
            (20, "c.test"),
            (10, "a.test"),
            (10, "b.test"),
            (30, "a.test"),
            (40, "d.test"),
        ]);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..200 {
            let o = ordered(list.clone(), 3);
            let names: Vec<&str> = o.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(names.len(), 3);
            assert!(
                names[..2].contains(&"a.test") && names[..2].contains(&"b.test"),
                "{names:?}"
            );
            assert_eq!(names[2], "c.test");
            assert_eq!(o[0].preference, 10);
            firsts.insert(names[0].to_string());
        }
        assert_eq!(firsts.len(), 2, "equal preferences in random order");
        // a.test is listed twice: once, at its best preference.
        let all = ordered(list, 10);
        assert_eq!(all.len(), 4);
        assert_eq!(all.iter().filter(|e| e.name == "a.test").count(), 1);
    }

    #[test]
    fn domain_literals_are_addresses_in_brackets() {
        assert_eq!(domain_literal("example.com"), None);
        assert_eq!(
            domain_literal("[192.0.2.1]"),
            Some(Some("192.0.2.1".parse().unwrap()))
        );
        assert_eq!(
            domain_literal("[ipv6:2001:db8::1]"),
            Some(Some("2001:db8::1".parse().unwrap()))
        );
        assert_eq!(domain_literal("[mx.example]"), Some(None));
        let resolver = Resolver::from_resolv_conf("");
        let soon = Instant::now() + std::time::Duration::from_secs(1);
        match route(&resolver, "[127.0.0.9]", 5, soon).unwrap() {
            Route::Exchangers(e) => assert_eq!(
                e[0].addresses(&resolver, Families::All, soon),
                Addresses::Found(vec!["127.0.0.9".parse().unwrap()])
            ),
            other => panic!("{other:?}"),
        }
        for bad in [
            "[nonsense]",
            "bad domain.example",
            "é.example",
            "a\r\nRCPT TO:<x@y>.example",
            "a\0b.example",
            "a\u{202e}b.example",
            &"a.".repeat(50_000),
        ] {
            match route(&resolver, bad, 5, soon).unwrap() {
                Route::Nowhere(n) => {
                    assert_eq!(n.status, "5.1.2", "{bad}");
                    // The reason reaches a report's header: shown, never raw.
                    assert!(
                        !n.reason.chars().any(|c| c.is_control() || c == '\u{202e}'),
                        "{:?}",
                        n.reason
                    );
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
