//! `[pepsi-ingress]` (§16): where `pepsi-ingress` listens (`LISTEN`), the stage
//! mail enters at, its limits, and whose XFORWARD it believes — read from the file's
//! fixed keys ([`super::fixed`]) into checked values, each problem naming file, line
//! and key. Pure; called by `config/mod.rs`. It binds nothing.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::fixed;
use super::raw::{Origin, Problems, Section};

/// The protocol a listener speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// LMTP (RFC 2033): one reply per recipient after the data.
    Lmtp,
    /// SMTP (RFC 5321).
    Smtp,
}

/// Where a listener listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A Unix socket at this path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

/// One entry of `LISTEN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listen {
    /// The protocol.
    pub protocol: Protocol,
    /// The address.
    pub address: Address,
}

impl std::fmt::Display for Listen {
    /// As it is written in the file.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.protocol, &self.address) {
            (Protocol::Lmtp, Address::Unix(p)) => write!(f, "unix:{}", p.display()),
            (Protocol::Smtp, Address::Unix(p)) => write!(f, "smtp:unix:{}", p.display()),
            (Protocol::Lmtp, Address::Tcp(a)) => write!(f, "lmtp:{a}"),
            (Protocol::Smtp, Address::Tcp(a)) => write!(f, "smtp:{a}"),
        }
    }
}

/// A network whose clients' XFORWARD is believed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trusted {
    /// Clients of a Unix socket.
    Unix,
    /// An address and its prefix length.
    Network(IpAddr, u8),
}

impl Trusted {
    /// Does it hold this client (`None`: a Unix socket's)?
    pub fn holds(&self, client: Option<IpAddr>) -> bool {
        match (self, client) {
            (Trusted::Unix, None) => true,
            (Trusted::Network(net, bits), Some(addr)) => in_network(addr, *net, *bits),
            _ => false,
        }
    }
}

/// Is `addr` in `net/bits` (an IPv4-mapped IPv6 client counts as its IPv4 address)?
fn in_network(addr: IpAddr, net: IpAddr, bits: u8) -> bool {
    let addr = match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    };
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(bits))
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(bits))
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// `[pepsi-ingress]`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngressOptions {
    /// `LISTEN`.
    pub listen: Vec<Listen>,
    /// `STAGE`, with where it is set; `None` when unset (`pepsi-ingress` refuses to run).
    pub stage: Option<(String, Origin)>,
    /// `MAX_MESSAGE_SIZE`, bytes.
    pub max_message_size: u64,
    /// `MAX_RECIPIENTS`.
    pub max_recipients: usize,
    /// `MAX_SESSIONS`.
    pub max_sessions: usize,
    /// `MAX_CLIENT_SESSIONS`.
    pub max_client_sessions: usize,
    /// `TRUSTED_SESSIONS`, below `MAX_SESSIONS`.
    pub trusted_sessions: usize,
    /// `TIMEOUT`.
    pub timeout: Duration,
    /// `MIN_DATA_RATE`, bytes per second.
    pub min_data_rate: u64,
    /// `MAX_ERRORS`.
    pub max_errors: u32,
    /// `XFORWARD_FROM`.
    pub xforward_from: Vec<Trusted>,
    /// `TLS_CERT` and `TLS_KEY`, both or neither.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// `REQUIRE_TLS`: listeners of `LISTEN`.
    pub require_tls: Vec<Listen>,
}

/// Reads one `LISTEN` entry.
fn listen_entry(entry: &str) -> Result<Listen, String> {
    let (protocol, rest) = if let Some(path) = entry.strip_prefix("unix:") {
        (Protocol::Lmtp, format!("unix:{path}"))
    } else if let Some(rest) = entry.strip_prefix("lmtp:") {
        (Protocol::Lmtp, rest.to_string())
    } else if let Some(rest) = entry.strip_prefix("smtp:") {
        (Protocol::Smtp, rest.to_string())
    } else {
        return Err(format!(
            "{entry:?} is not unix:PATH, lmtp:HOST:PORT or smtp:HOST:PORT"
        ));
    };
    let address = match rest.strip_prefix("unix:") {
        Some(path) if path.starts_with('/') => Address::Unix(PathBuf::from(path)),
        Some(_) => return Err(format!("{entry:?}: a Unix socket's path must be absolute")),
        None => {
            let addr = rest
                .to_socket_addrs()
                .map_err(|e| format!("{entry:?}: {e}"))?
                .next()
                .ok_or_else(|| format!("{entry:?}: names no address"))?;
            Address::Tcp(addr)
        }
    };
    Ok(Listen { protocol, address })
}

/// Reads one `XFORWARD_FROM` entry.
fn trusted_entry(entry: &str) -> Result<Trusted, String> {
    if entry == "unix" {
        return Ok(Trusted::Unix);
    }
    let (addr, bits) = match entry.split_once('/') {
        Some((a, b)) => (a, Some(b)),
        None => (entry, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("{entry:?} is not an address, a network or unix"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        None => max,
        Some(b) => b
            .parse::<u8>()
            .ok()
            .filter(|b| *b <= max)
            .ok_or_else(|| format!("{entry:?}: the prefix length must be 0 to {max}"))?,
    };
    Ok(Trusted::Network(addr, bits))
}

/// `TLS_CERT` and `TLS_KEY`: both absolute paths, or neither set.
fn tls_files(section: &Section, f: &[Section], p: &mut Problems) -> Option<(PathBuf, PathBuf)> {
    let path = |key: &str, value: Option<&str>, p: &mut Problems| -> Option<PathBuf> {
        let v = value?;
        if Path::new(v).is_absolute() {
            Some(PathBuf::from(v))
        } else {
            p.push(section.error(key, format!("{v:?} is not an absolute path")));
            None
        }
    };
    let cert = path("TLS_CERT", fixed::TLS_CERT.read(f), p);
    let key = path("TLS_KEY", fixed::TLS_KEY.read(f), p);
    match (cert, key, fixed::TLS_CERT.read(f), fixed::TLS_KEY.read(f)) {
        (Some(c), Some(k), _, _) => Some((c, k)),
        (_, _, Some(_), None) => {
            p.push(section.error("TLS_CERT", "is set without TLS_KEY, its private key"));
            None
        }
        (_, _, None, Some(_)) => {
            p.push(section.error("TLS_KEY", "is set without TLS_CERT, its certificate"));
            None
        }
        _ => None,
    }
}

/// The entries of a list value: separated by commas or blanks.
fn entries(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|e| !e.is_empty())
}

impl IngressOptions {
    /// Reads `[pepsi-ingress]` from the file's sections, recording every problem.
    pub fn read(f: &[Section], p: &mut Problems) -> IngressOptions {
        let section = f
            .iter()
            .find(|s| s.name == fixed::LISTEN.section)
            .cloned()
            .unwrap_or_else(|| Section::new(fixed::LISTEN.section, Origin::Default));
        let mut listen = Vec::new();
        let text = fixed::LISTEN.read(f).unwrap_or_default();
        for entry in entries(text) {
            if let Some(l) = p.ok(listen_entry(entry).map_err(|why| section.error("LISTEN", why))) {
                listen.push(l);
            }
        }
        if entries(text).next().is_none() {
            p.push(section.error("LISTEN", "names no listener"));
        }
        let mut xforward_from = Vec::new();
        for entry in entries(fixed::XFORWARD_FROM.read(f).unwrap_or_default()) {
            if let Some(t) =
                p.ok(trusted_entry(entry).map_err(|why| section.error("XFORWARD_FROM", why)))
            {
                xforward_from.push(t);
            }
        }
        let tls = tls_files(&section, f, p);
        let mut require_tls = Vec::new();
        let required = fixed::REQUIRE_TLS.read(f).unwrap_or("none");
        for entry in entries(required).filter(|_| required.trim() != "none") {
            let parsed = listen_entry(entry).and_then(|l| {
                if !listen.contains(&l) {
                    Err(format!("{entry:?} is not one of LISTEN's listeners"))
                } else if tls.is_none() {
                    Err(format!(
                        "{entry:?}: no STARTTLS without TLS_CERT and TLS_KEY, so no mail at all"
                    ))
                } else {
                    Ok(l)
                }
            });
            if let Some(l) = p.ok(parsed.map_err(|why| section.error("REQUIRE_TLS", why))) {
                require_tls.push(l);
            }
        }
        let max_sessions = fixed::MAX_SESSIONS.read(f, p) as usize;
        let trusted_sessions = fixed::TRUSTED_SESSIONS.read(f, p) as usize;
        if trusted_sessions >= max_sessions {
            p.push(section.error(
                "TRUSTED_SESSIONS",
                format!(
                    "{trusted_sessions} is not below MAX_SESSIONS ({max_sessions}): other clients \
                     would get no session at all"
                ),
            ));
        }
        IngressOptions {
            listen,
            stage: fixed::STAGE
                .value(f)
                .map(|v| (v.text.clone(), v.origin.clone())),
            max_message_size: u64::from(fixed::MAX_MESSAGE_SIZE.read(f, p)),
            max_recipients: fixed::MAX_RECIPIENTS.read(f, p) as usize,
            max_sessions,
            max_client_sessions: fixed::MAX_CLIENT_SESSIONS.read(f, p) as usize,
            trusted_sessions,
            timeout: fixed::TIMEOUT.read(f, p),
            min_data_rate: u64::from(fixed::MIN_DATA_RATE.read(f, p)),
            max_errors: fixed::MAX_ERRORS.read(f, p),
            xforward_from,
            tls,
            require_tls,
        }
    }

    /// Is the XFORWARD of this client (`None`: a Unix socket's) believed?
    pub fn trusts(&self, client: Option<IpAddr>) -> bool {
        self.xforward_from.iter().any(|t| t.holds(client))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<IngressOptions, Vec<String>> {
        let f = super::super::raw::parse(std::path::Path::new("/i.conf"), text).unwrap();
        let mut p = Problems::default();
        let o = IngressOptions::read(&f, &mut p);
        if p.is_empty() {
            Ok(o)
        } else {
            Err(p.0.iter().map(ToString::to_string).collect())
        }
    }

    #[test]
    fn the_defaults_listen_for_lmtp_on_the_loopback_and_trust_nobody() {
        let o = read("").unwrap();
        assert_eq!(o.listen.len(), 1);
        assert_eq!(o.listen[0].to_string(), "lmtp:127.0.0.1:10025");
        assert_eq!(o.stage, None);
        assert_eq!(o.max_message_size, 10_240_000);
        assert_eq!(o.max_recipients, 1000);
        assert_eq!(o.max_sessions, 100);
        assert_eq!(o.max_client_sessions, 50);
        assert_eq!(o.trusted_sessions, 20);
        assert_eq!(o.timeout, Duration::from_secs(300));
        assert_eq!(o.min_data_rate, 500);
        let errs = read("[pepsi-ingress]\nMAX_SESSIONS = 20\n").unwrap_err();
        assert_eq!(
            errs,
            [
                "/i.conf:1: [pepsi-ingress] TRUSTED_SESSIONS: 20 is not below MAX_SESSIONS (20): \
              other clients would get no session at all"
            ]
        );
        assert!(!o.trusts(Some("127.0.0.1".parse().unwrap())));
        assert!(!o.trusts(None));
    }

    #[test]
    fn starttls_needs_a_certificate_and_its_key_and_require_tls_names_listeners() {
        let o = read(
            "[pepsi-ingress]\nLISTEN = smtp:127.0.0.1:10587 lmtp:127.0.0.1:10025\n\
             TLS_CERT = /etc/pepsi/cert.pem\nTLS_KEY = /etc/pepsi/key.pem\n\
             REQUIRE_TLS = smtp:127.0.0.1:10587\n",
        )
        .unwrap();
        assert_eq!(
            o.tls,
            Some(("/etc/pepsi/cert.pem".into(), "/etc/pepsi/key.pem".into()))
        );
        assert_eq!(o.require_tls, vec![o.listen[0].clone()]);
        assert!(
            read("[pepsi-ingress]\nREQUIRE_TLS = none\n")
                .unwrap()
                .require_tls
                .is_empty()
        );
        for (text, says) in [
            ("TLS_CERT = /c.pem\n", "TLS_CERT: is set without TLS_KEY"),
            ("TLS_KEY = /k.pem\n", "TLS_KEY: is set without TLS_CERT"),
            (
                "TLS_CERT = c.pem\nTLS_KEY = /k.pem\n",
                "TLS_CERT: \"c.pem\" is not an absolute path",
            ),
            (
                "TLS_CERT = /c.pem\nTLS_KEY = /k.pem\nREQUIRE_TLS = smtp:127.0.0.1:25\n",
                "is not one of LISTEN's listeners",
            ),
            (
                "REQUIRE_TLS = lmtp:127.0.0.1:10025\n",
                "no STARTTLS without TLS_CERT and TLS_KEY",
            ),
        ] {
            let errs = read(&format!("[pepsi-ingress]\n{text}")).unwrap_err();
            assert!(errs.iter().any(|e| e.contains(says)), "{text}: {errs:?}");
        }
    }

    #[test]
    fn listeners_and_trusted_clients_are_read_and_checked() {
        let o = read(
            "[pepsi-ingress]\nLISTEN = unix:/run/pepsi/ingress, smtp:127.0.0.1:10024 lmtp:[::1]:10025\n\
             STAGE = in\nXFORWARD_FROM = 127.0.0.0/8 ::1 unix\n",
        )
        .unwrap();
        let shown: Vec<String> = o.listen.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "unix:/run/pepsi/ingress",
                "smtp:127.0.0.1:10024",
                "lmtp:[::1]:10025"
            ]
        );
        assert_eq!(o.stage.as_ref().map(|s| s.0.as_str()), Some("in"));
        for (client, trusted) in [
            (Some("127.1.2.3"), true),
            (Some("::ffff:127.0.0.9"), true),
            (Some("::1"), true),
            (Some("192.0.2.1"), false),
            (None, true),
        ] {
            assert_eq!(
                o.trusts(client.map(|c| c.parse().unwrap())),
                trusted,
                "{client:?}"
            );
        }
        let errs = read(
            "[pepsi-ingress]\nLISTEN = tcp:1.2.3.4:5 unix:relative lmtp:nowhere\nXFORWARD_FROM = 10.0.0.0/33 mx\n",
        )
        .unwrap_err();
        assert_eq!(errs.len(), 5, "{errs:#?}");
        let none = read("[pepsi-ingress]\nLISTEN = ,\n").unwrap_err();
        assert_eq!(
            none,
            ["/i.conf:2: [pepsi-ingress] LISTEN: names no listener"]
        );
        assert!(
            errs[0].starts_with("/i.conf:2: [pepsi-ingress] LISTEN: \"tcp:1.2.3.4:5\" is not"),
            "{}",
            errs[0]
        );
        assert!(
            errs[3].contains("XFORWARD_FROM: \"10.0.0.0/33\": the prefix length"),
            "{}",
            errs[3]
        );
    }
}
