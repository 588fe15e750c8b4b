//! `pepsi-stage-relay-to-internet` (§22): delivers each recipient domain's mail to
//! that domain's mail exchangers, as Postfix's smtp(8) does, with the relay's
//! per-recipient results (§17). Loads headers and body; not fusable by default.
//!
//! A row whose recipients span several destinations (recipient domains) is first split
//! into one row per destination, each run again at this stage: a destination's
//! recipients then share one transaction per exchanger, one retry schedule and, when
//! the destination is suspended, one pause. For one destination: a connection this
//! worker keeps to it is used again (`CONNECTION_CACHE_TIME` idle at most, as Postfix's
//! smtp_connection_cache_time, and `CONNECTION_REUSE_TIME` / `CONNECTION_REUSE_LIMIT`
//! in all); else its exchangers are looked up (`exchangers.rs`, over `dns.rs`) and
//! tried in order, each address of each, until one takes the message
//! (`deliver.rs`). Each connection holds one of the destination's
//! `DESTINATION_CONCURRENCY` slots, across all workers of all stages
//! (`destinations.rs`, schema 21); `DEAD_AFTER` attempts in a row that reach no
//! exchanger (or meet a 421, or 4.7.x for every recipient) suspend the destination for
//! `DEAD_TIME`, and its messages
//! pause meanwhile without connecting. TLS per destination (`policy.rs`): `TLS`
//! (`may` by default) unless `TLS_POLICY` names it.
//!
//! The files: `dns.rs` (the stub resolver), `exchangers.rs` (MX, implicit MX, null
//! MX), `policy.rs` (`TLS_POLICY`), `destinations.rs` (slots, failures, suspensions),
//! `cache.rs` (the connections kept, the janitor that closes idle ones), `deliver.rs`
//! (one destination's delivery), `replies.rs` (what an exchanger's words say). SMTP
//! itself is the relay's (`stages::relay`).
//! Listed in `stages::BUILTINS`; it writes no message to the database (the runtime
//! writes its outcome).

pub mod cache;
pub mod deliver;
pub mod destinations;
pub mod dns;
pub mod exchangers;
pub mod policy;
pub mod replies;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustls::ClientConfig;

use super::read_at_start::ReadAtStart;
use super::relay::DEFAULT_TIMEOUTS;
use super::relay::client::Timeouts;
use crate::config::{Config, ConfigError, Section, StageSection};
use crate::tls::{self, Level};
use crate::worker::{Configured, Context, Load, Message, Outcome, Stage, StageError};
use dns::Resolver;
use exchangers::Families;
use policy::PolicyTable;

/// The stage.
pub struct RelayToInternet;

/// The trust stores of `verify`, read when the worker starts, by file.
static VERIFYING: ReadAtStart<Arc<ClientConfig>> = ReadAtStart::new("CA_FILE");

/// The `TLS_POLICY` files, read when the worker starts.
static POLICIES: ReadAtStart<PolicyTable> = ReadAtStart::new("TLS_POLICY");

/// The system's resolver (`/etc/resolv.conf`), read when the worker starts.
static SYSTEM_RESOLVER: OnceLock<Resolver> = OnceLock::new();

/// A section's settings.
pub struct Settings {
    /// The stage (a split's rows continue here).
    pub stage: String,
    pub next: Option<String>,
    /// `HOSTNAME`, when the section sets it (else `[pepsi] HOSTNAME`).
    pub hostname: Option<String>,
    pub bind: Option<IpAddr>,
    /// `NAMESERVER`'s servers; `None`: the system's.
    pub nameservers: Option<Vec<SocketAddr>>,
    pub port: u16,
    pub mx_limit: usize,
    pub families: Families,
    /// `TLS`: the level of a destination `TLS_POLICY` does not name.
    pub tls: Level,
    pub policy_file: Option<PathBuf>,
    /// The trust store of `verify` (`CA_FILE`, else the system's).
    pub trust: PathBuf,
    pub concurrency: u32,
    pub dead_after: u32,
    pub dead_time: Duration,
    pub timeouts: Timeouts,
    pub cache_time: Duration,
    pub reuse_time: Duration,
    /// 0: no limit.
    pub reuse_limit: u32,
    /// The client configuration of `may` and `encrypt`.
    pub unverified: Arc<ClientConfig>,
}

impl Stage for RelayToInternet {
    fn name(&self) -> &'static str {
        "relay-to-internet"
    }

    fn loads(&self) -> Load {
        Load::Full
    }

    fn fusion_default(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &[
            "HOSTNAME",
            "BIND_ADDRESS",
            "NAMESERVER",
            "PORT",
            "MX_LIMIT",
            "INET_PROTOCOLS",
            "TLS",
            "TLS_POLICY",
            "CA_FILE",
            "DESTINATION_CONCURRENCY",
            "DEAD_AFTER",
            "DEAD_TIME",
            "CONNECT_TIMEOUT",
            "COMMAND_TIMEOUT",
            "DATA_TIMEOUT",
            "DATA_DONE_TIMEOUT",
            "CONNECTION_CACHE_TIME",
            "CONNECTION_REUSE_TIME",
            "CONNECTION_REUSE_LIMIT",
        ]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    /// The timeouts summed are one message's time, its lookups included.
    fn runtime_warning(&self, section: &Section, max_runtime: Duration) -> Option<ConfigError> {
        super::relay::Relay.runtime_warning(section, max_runtime)
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        Ok(Box::new(Settings::of(section)?))
    }

    /// The trust store of `verify` and the `TLS_POLICY` file, as the workers read them,
    /// and a `BIND_ADDRESS` that is no address of this host.
    fn file_errors(&self, section: &Section) -> Vec<ConfigError> {
        let mut errors: Vec<ConfigError> = bind_error(section).into_iter().collect();
        if let Some(Ok(path)) = section
            .get("TLS_POLICY")
            .map(|p| absolute(section, "TLS_POLICY", p))
        {
            match PolicyTable::load(&path) {
                Ok(table) => {
                    if table_needs_trust(&table) || section.get("TLS") == Some("verify") {
                        errors.extend(trust_error(section));
                    }
                }
                Err(e) => errors.push(section.error("TLS_POLICY", e)),
            }
        } else if section.get("TLS") == Some("verify") {
            errors.extend(trust_error(section));
        }
        errors
    }

    /// Reads the system's resolver, the `TLS_POLICY` file and the trust store of
    /// `verify`, once, as the workers' account; opens nothing yet.
    fn start(&self, config: &Config, section: &StageSection) -> Result<(), String> {
        let settings = Settings::of(section).map_err(|e| e.to_string())?;
        let s = &section.section;
        let named = |key: &str, e: String| s.error(key, e).to_string();
        if let Some(e) = bind_error(s) {
            return Err(e.to_string());
        }
        if settings.nameservers.is_none() && SYSTEM_RESOLVER.get().is_none() {
            let _ = SYSTEM_RESOLVER.set(Resolver::system()?);
        }
        let mut verify = settings.tls == Level::Verify;
        if let Some(path) = &settings.policy_file {
            let table = PolicyTable::load(path).map_err(|e| named("TLS_POLICY", e))?;
            verify |= table_needs_trust(&table);
            POLICIES.put(path.clone(), table);
        }
        if verify {
            let roots = tls::roots(Some(&settings.trust)).map_err(|e| named("CA_FILE", e))?;
            let client =
                tls::client_config(Level::Verify, Some(roots)).map_err(|e| named("TLS", e))?;
            VERIFYING.put(settings.trust.clone(), client);
        }
        let worker = crate::worker::runtime::session_settings(config, self)?;
        cache::start(worker);
        Ok(())
    }
}

/// `BIND_ADDRESS` when this host cannot send from it (no interface has it): every
/// connection would fail, and every destination be suspended in turn.
fn bind_error(section: &Section) -> Option<ConfigError> {
    let address: IpAddr = section.get("BIND_ADDRESS")?.parse().ok()?;
    std::net::UdpSocket::bind((address, 0)).err().map(|e| {
        section.error(
            "BIND_ADDRESS",
            format!("{address} is not an address of this host: {e}"),
        )
    })
}

/// Does any line of the table ask for `verify`?
fn table_needs_trust(table: &PolicyTable) -> bool {
    table.levels().any(|l| l == Level::Verify)
}

/// The trust store's problem, if it has one.
fn trust_error(section: &Section) -> Option<ConfigError> {
    let trust = match section.get("CA_FILE") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(tls::SYSTEM_ROOTS),
    };
    tls::roots(Some(&trust))
        .err()
        .map(|e| section.error("CA_FILE", e))
}

/// A key's value as an absolute path.
fn absolute(s: &Section, key: &str, value: &str) -> Result<PathBuf, ConfigError> {
    if Path::new(value).is_absolute() {
        Ok(PathBuf::from(value))
    } else {
        Err(s.error(key, format!("{value:?} is not an absolute path")))
    }
}

impl Settings {
    /// The settings of a section; a bad value names its key.
    pub fn of(section: &StageSection) -> Result<Settings, ConfigError> {
        let s = &section.section;
        let hostname = s.get("HOSTNAME").map(str::to_string);
        if let Some(h) = &hostname {
            if dns::name(h).is_err() {
                return Err(s.error("HOSTNAME", format!("{h:?} is not a host name")));
            }
        }
        let bind = match s.get("BIND_ADDRESS") {
            None => None,
            Some(v) => Some(v.parse::<IpAddr>().map_err(|_| {
                s.error(
                    "BIND_ADDRESS",
                    format!("{v:?} is not an IPv4 or IPv6 address"),
                )
            })?),
        };
        let nameservers = match s.get("NAMESERVER") {
            None => None,
            Some(v) => Some(Resolver::parse_servers(v).map_err(|e| s.error("NAMESERVER", e))?),
        };
        let families = match s.get("INET_PROTOCOLS").unwrap_or("all") {
            "all" => Families::All,
            "ipv4" => Families::Ipv4,
            "ipv6" => Families::Ipv6,
            other => {
                return Err(s.error(
                    "INET_PROTOCOLS",
                    format!("{other:?} is none of all, ipv4, ipv6"),
                ));
            }
        };
        if let (Some(b), Families::Ipv4 | Families::Ipv6) = (bind, families) {
            if b.is_ipv4() != (families == Families::Ipv4) {
                return Err(s.error(
                    "BIND_ADDRESS",
                    format!("{b} is not of INET_PROTOCOLS' family"),
                ));
            }
        }
        let tls = match s.get("TLS") {
            Some(v) => Level::parse(v).map_err(|e| s.error("TLS", e))?,
            None => Level::May,
        };
        let policy_file = match s.get("TLS_POLICY") {
            Some(p) => Some(absolute(s, "TLS_POLICY", p)?),
            None => None,
        };
        let trust = match s.get("CA_FILE") {
            Some(p) => absolute(s, "CA_FILE", p)?,
            None => PathBuf::from(tls::SYSTEM_ROOTS),
        };
        let positive = |key: &str, default: Duration| -> Result<Duration, ConfigError> {
            let d = s.duration(key, default)?;
            if d.is_zero() {
                return Err(s.error(key, "must be greater than zero"));
            }
            Ok(d)
        };
        let timeouts = Timeouts {
            connect: positive("CONNECT_TIMEOUT", DEFAULT_TIMEOUTS.connect)?,
            command: positive("COMMAND_TIMEOUT", DEFAULT_TIMEOUTS.command)?,
            data: positive("DATA_TIMEOUT", DEFAULT_TIMEOUTS.data)?,
            data_done: positive("DATA_DONE_TIMEOUT", DEFAULT_TIMEOUTS.data_done)?,
        };
        let dead_time = positive("DEAD_TIME", Duration::from_secs(300))?;
        if dead_time > Duration::from_secs(86_400) {
            return Err(s.error("DEAD_TIME", "is above the maximum 1d"));
        }
        let unverified = tls::client_config(Level::May, None).map_err(|e| s.error("TLS", e))?;
        Ok(Settings {
            stage: section.name.clone(),
            next: section.next.clone(),
            hostname,
            bind,
            nameservers,
            port: s.number("PORT", 25u16, 1..=u16::MAX)?,
            mx_limit: s.number("MX_LIMIT", 5usize, 1..=100)?,
            families,
            tls,
            policy_file,
            trust,
            concurrency: s.number("DESTINATION_CONCURRENCY", 20u32, 1..=10_000)?,
            dead_after: s.number("DEAD_AFTER", 5u32, 1..=1000)?,
            dead_time,
            timeouts,
            cache_time: positive("CONNECTION_CACHE_TIME", Duration::from_secs(2))?,
            reuse_time: s.duration("CONNECTION_REUSE_TIME", Duration::from_secs(300))?,
            reuse_limit: s.number("CONNECTION_REUSE_LIMIT", 0u32, 0..=u32::MAX)?,
            unverified,
        })
    }

    /// The resolver of this section: `NAMESERVER`'s servers with the system's
    /// timeouts, else the system's.
    pub fn resolver(&self) -> Result<Resolver, StageError> {
        let system = SYSTEM_RESOLVER
            .get()
            .cloned()
            .unwrap_or_else(|| Resolver::from_resolv_conf(""));
        Ok(match &self.nameservers {
            Some(servers) => Resolver {
                servers: servers.clone(),
                ..system
            },
            None => system,
        })
    }

    /// The TLS level of `destination`.
    pub fn level_for(&self, destination: &str) -> Result<Level, StageError> {
        Ok(match &self.policy_file {
            Some(path) => POLICIES.get(path)?.policy(destination, self.tls).level,
            None => self.tls,
        })
    }

    /// The client configuration for `level`.
    pub fn client_config(&self, level: Level) -> Result<Option<Arc<ClientConfig>>, StageError> {
        Ok(match level {
            Level::None => None,
            Level::May | Level::Encrypt => Some(Arc::clone(&self.unverified)),
            Level::Verify => Some((*VERIFYING.get(&self.trust)?).clone()),
        })
    }
}

impl Configured for Settings {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let deadline = Instant::now() + self.timeouts.budget();
        deliver::run(self, message, cx, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw;

    fn section(lines: &[(&str, &str)]) -> StageSection {
        let mut text = String::from("[stage-out]\nPROGRAM = pepsi-stage-relay-to-internet\n");
        for (k, v) in lines {
            text.push_str(&format!("{k} = {v}\n"));
        }
        let sections = raw::parse(Path::new("pepsi.conf"), &text).unwrap();
        StageSection::check(&sections[0]).unwrap()
    }

    #[test]
    fn the_defaults_are_postfixs_may_tls_five_exchangers_twenty_connections_five_failures() {
        let s = Settings::of(&section(&[])).unwrap();
        assert_eq!(s.tls, Level::May);
        assert_eq!(
            (s.port, s.mx_limit, s.concurrency, s.dead_after),
            (25, 5, 20, 5)
        );
        assert_eq!(s.dead_time, Duration::from_secs(300));
        assert_eq!(s.cache_time, Duration::from_secs(2));
        assert_eq!(s.families, Families::All);
        assert!(s.nameservers.is_none() && s.bind.is_none() && s.policy_file.is_none());
        assert_eq!(s.stage, "out");
        let s = Settings::of(&section(&[
            ("NAMESERVER", "127.0.0.1:5353"),
            ("BIND_ADDRESS", "192.0.2.25"),
            ("INET_PROTOCOLS", "ipv4"),
            ("TLS", "encrypt"),
            ("TLS_POLICY", "/etc/pepsi/tls-policy"),
        ]))
        .unwrap();
        assert_eq!(s.nameservers, Some(vec!["127.0.0.1:5353".parse().unwrap()]));
        assert_eq!(s.bind, Some("192.0.2.25".parse().unwrap()));
        assert_eq!(s.tls, Level::Encrypt);
        assert_eq!(
            s.resolver().unwrap().servers,
            s.nameservers.clone().unwrap()
        );
    }

    #[test]
    fn a_bind_address_this_host_does_not_have_is_reported_by_the_check_and_at_start() {
        let ours = section(&[("BIND_ADDRESS", "127.0.0.1")]);
        assert!(RelayToInternet.file_errors(&ours.section).is_empty());
        // TEST-NET-1 (RFC 5737): no interface of a test machine has it.
        let foreign = section(&[("BIND_ADDRESS", "192.0.2.25")]);
        let errors = RelayToInternet.file_errors(&foreign.section);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = errors[0].to_string();
        assert!(
            e.contains("BIND_ADDRESS") && e.contains("not an address of this host"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_value_is_refused_naming_its_key() {
        for (key, value) in [
            ("HOSTNAME", "a b"),
            ("BIND_ADDRESS", "mx.example"),
            ("NAMESERVER", "dns.example"),
            ("PORT", "0"),
            ("MX_LIMIT", "0"),
            ("INET_PROTOCOLS", "ipx"),
            ("TLS", "always"),
            ("TLS_POLICY", "policy"),
            ("CA_FILE", "ca.pem"),
            ("DESTINATION_CONCURRENCY", "0"),
            ("DEAD_AFTER", "1001"),
            ("DEAD_TIME", "2d"),
            ("CONNECT_TIMEOUT", "0"),
            ("CONNECTION_CACHE_TIME", "0"),
        ] {
            let e = match Settings::of(&section(&[(key, value)])) {
                Ok(_) => panic!("{key} = {value} accepted"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(key), "{key} = {value}: {e}");
        }
        let e = Settings::of(&section(&[
            ("BIND_ADDRESS", "::1"),
            ("INET_PROTOCOLS", "ipv4"),
        ]))
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("BIND_ADDRESS"), "{e}");
    }
}
