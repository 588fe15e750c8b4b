//! `pepsi-stage-relay` (§17): hands each message to `SMARTHOST` over SMTP or LMTP
//! (`PROTOCOL`). Loads headers and body; fusable by default (a filter's workers hand the
//! message on themselves, §12.6).
//!
//! One connection per worker, kept open across messages and batches (RSET between
//! messages; a connection lost while idle is opened again) until
//! `CONNECTION_REUSE_TIME` has passed since it was opened or it carried
//! `CONNECTION_REUSE_LIMIT` messages, like Postfix's smtp_connection_reuse_time_limit
//! and smtp_connection_reuse_count_limit. Results are per recipient
//! ([`Outcome::Recipients`]): a 2xx recipient is done (to `NEXT`, or finished), a 4xx
//! one is a host error for it alone, a 5xx one fails with its own `state.dsn_status`
//! and `state.dsn_diagnostic`; the worker runtime splits a mixed result. A connection
//! that fails (refused, a timeout, dropped, 421) is a host error for every recipient
//! without a reply yet; so is a protocol error (a reply no command may get there: only
//! `354` to DATA lets the data go) and a refused XFORWARD, which drop the connection.
//! Each message has one deadline, the four timeouts summed (4 min by default, below
//! the dispatcher's `MAX_RUNTIME`): no wait of its transaction goes beyond it.
//!
//! TLS (§21) as Postfix's levels, `TLS = none | may | encrypt | verify`, `none` by
//! default for a unix socket or a loopback smarthost and `verify` for any other;
//! `TLS_WRAPPER` for a port that speaks TLS from its first byte (465, where it is the
//! default). `AUTH_FILE` logs in (PLAIN, else LOGIN) inside TLS only; a refused login
//! defers the message, and the worker tries again at most once a minute (a smarthost
//! that counts failed logins is not hammered), saying so each time. The trust store
//! (for `verify`) and the login are read when the worker starts.
//!
//! The files: `client.rs` (the connection), `stream.rs` (its socket, in clear or in
//! TLS), `secure.rs` (STARTTLS and AUTH), `auth_file.rs` (`AUTH_FILE`),
//! `transaction.rs` (one message's commands and results), `reply.rs` (reading replies
//! from the network, the enhanced codes).
//! Listed in `stages::BUILTINS`; it must not write to the database (the runtime writes
//! its outcome) nor know about batches, fusion or the protocol.

pub mod auth_file;
pub mod client;
pub mod reply;
pub mod secure;
pub mod stream;
#[cfg(test)]
mod tls_tests;
pub mod transaction;
#[cfg(test)]
mod wire_tests;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use client::{Connection, Target, Timeouts};
use rustls::ClientConfig;
use secure::{Credentials, Security};
use transaction::Envelope;

use super::read_at_start::ReadAtStart;
use crate::config::raw::show_duration;
use crate::config::{Config, ConfigError, Section, StageSection};
use crate::escape::Visible;
use crate::tls::{self, Level};
use crate::worker::{
    Configured, Context, Load, Message, Outcome, RecipientOutcomes, Stage, StageError,
};

/// The stage.
pub struct Relay;

/// The timeouts' defaults: their sum (4 min), one message's whole time, is well below
/// the dispatcher's `MAX_RUNTIME` (5 min), past which a worker is killed and its message
/// struck.
pub const DEFAULT_TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_secs(30),
    command: Duration::from_secs(60),
    data: Duration::from_secs(60),
    data_done: Duration::from_secs(90),
};

/// A section's relay timeouts summed (one message's time); `None` when a value is bad
/// (the section's own check says so).
fn budget_of(s: &Section) -> Option<Duration> {
    let d = |key: &str, default: Duration| s.duration(key, default).ok();
    Some(
        Timeouts {
            connect: d("CONNECT_TIMEOUT", DEFAULT_TIMEOUTS.connect)?,
            command: d("COMMAND_TIMEOUT", DEFAULT_TIMEOUTS.command)?,
            data: d("DATA_TIMEOUT", DEFAULT_TIMEOUTS.data)?,
            data_done: d("DATA_DONE_TIMEOUT", DEFAULT_TIMEOUTS.data_done)?,
        }
        .budget(),
    )
}

/// A section's TLS and AUTH settings.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TlsSettings {
    level: Level,
    wrapper: bool,
    /// The name the certificate must bear (`TLS_NAME`, else the smarthost's host).
    name: String,
    /// The trust store's file (`CA_FILE`, else the system's bundle).
    trust: PathBuf,
    auth_file: Option<PathBuf>,
}

impl TlsSettings {
    /// The settings of section `s` for `target` (§21). `REQUIRE_TLS` is gone: an error
    /// names what replaces it.
    fn of(s: &Section, target: &Target) -> Result<TlsSettings, ConfigError> {
        if let Some(v) = s.get("REQUIRE_TLS") {
            let was = match s.optional_boolean("REQUIRE_TLS") {
                Ok(Some(false)) => "TLS = none",
                _ => "TLS = verify",
            };
            return Err(s.error(
                "REQUIRE_TLS",
                format!(
                    "REQUIRE_TLS is replaced by TLS = none | may | encrypt | verify (REQUIRE_TLS = {v} is {was})"
                ),
            ));
        }
        let port = match target {
            Target::Tcp { port, .. } => Some(*port),
            Target::Address { address, .. } => Some(address.port()),
            Target::Unix(_) => None,
        };
        let wrapper = s
            .optional_boolean("TLS_WRAPPER")?
            .unwrap_or(port == Some(465));
        let level = match s.get("TLS") {
            Some(v) => Level::parse(v).map_err(|e| s.error("TLS", e))?,
            None if wrapper => Level::Verify,
            None if target.is_local() => Level::None,
            None => Level::Verify,
        };
        if level != Level::None && port.is_none() {
            return Err(s.error(
                "TLS",
                "a unix socket stays on this host: TLS = none (or leave TLS out)",
            ));
        }
        if wrapper && level < Level::Encrypt {
            return Err(s.error(
                "TLS_WRAPPER",
                format!(
                    "a port that speaks TLS from its first byte needs TLS = encrypt or verify, not {}",
                    level.name()
                ),
            ));
        }
        let name = match (s.get("TLS_NAME"), target) {
            (Some(n), _) => n.to_string(),
            (None, Target::Tcp { host, .. }) => host.clone(),
            (None, Target::Address { address, .. }) => address.ip().to_string(),
            (None, Target::Unix(_)) => String::new(),
        };
        if level != Level::None {
            tls::server_name(&name).map_err(|e| s.error("TLS_NAME", e))?;
        }
        let absolute = |key: &str| -> Result<Option<PathBuf>, ConfigError> {
            match s.get(key) {
                None => Ok(None),
                Some(p) if Path::new(p).is_absolute() => Ok(Some(PathBuf::from(p))),
                Some(p) => Err(s.error(key, format!("{p:?} is not an absolute path"))),
            }
        };
        let trust = absolute("CA_FILE")?.unwrap_or_else(|| PathBuf::from(tls::SYSTEM_ROOTS));
        let auth_file = absolute("AUTH_FILE")?;
        // Below verify, whoever intercepts the connection is taken for the smarthost
        // and would be handed the password.
        if auth_file.is_some() && level != Level::Verify {
            return Err(s.error(
                "AUTH_FILE",
                format!(
                    "AUTH sends a password, which goes only to a smarthost whose certificate is verified: set TLS = verify (with CA_FILE or TLS_NAME for a certificate of your own), not {}",
                    level.name()
                ),
            ));
        }
        Ok(TlsSettings {
            level,
            wrapper,
            name,
            trust,
            auth_file,
        })
    }
}

/// The client configurations for `verify`, made when the worker starts, by trust
/// store file.
static VERIFYING: ReadAtStart<Arc<ClientConfig>> = ReadAtStart::new("CA_FILE");

/// The logins, read when the worker starts, by `AUTH_FILE`.
static LOGINS: ReadAtStart<Credentials> = ReadAtStart::new("AUTH_FILE");

/// The refused logins of the last minute (the connection's key, when): the next try
/// on that key waits until the minute is over.
static REFUSED_LOGIN: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());

/// How long after a refused login the worker does not log in again.
const LOGIN_PAUSE: Duration = Duration::from_secs(60);

/// The section's settings.
struct ConfiguredRelay {
    target: Target,
    lmtp: bool,
    /// `HOSTNAME`, when the section sets it (else `[pepsi] HOSTNAME`).
    hostname: Option<String>,
    timeouts: Timeouts,
    reuse_time: Duration,
    /// 0: no limit.
    reuse_limit: u32,
    next: Option<String>,
    tls: TlsSettings,
    /// The client configuration of `may` and `encrypt` (which read no file).
    unverified: Option<Arc<ClientConfig>>,
}

/// The connection this worker keeps, with what it was opened for (smarthost,
/// protocol, name): a section with other settings opens its own.
struct Kept {
    key: String,
    connection: Connection,
}

/// This worker's connection to the smarthost, kept across messages and batches.
static CONNECTION: Mutex<Option<Kept>> = Mutex::new(None);

impl Stage for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn loads(&self) -> Load {
        Load::Full
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn keys(&self) -> &'static [&'static str] {
        &[
            "SMARTHOST",
            "PROTOCOL",
            "HOSTNAME",
            "TLS",
            "TLS_WRAPPER",
            "TLS_NAME",
            "CA_FILE",
            "AUTH_FILE",
            "REQUIRE_TLS",
            "CONNECT_TIMEOUT",
            "COMMAND_TIMEOUT",
            "DATA_TIMEOUT",
            "DATA_DONE_TIMEOUT",
            "CONNECTION_REUSE_TIME",
            "CONNECTION_REUSE_LIMIT",
        ]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    /// The timeouts summed are one message's time: not below MAX_RUNTIME, a slow
    /// smarthost gets the worker killed and the message struck.
    fn runtime_warning(&self, section: &Section, max_runtime: Duration) -> Option<ConfigError> {
        let budget = budget_of(section)?;
        (budget >= max_runtime).then(|| {
            let key = ["DATA_DONE_TIMEOUT", "DATA_TIMEOUT", "COMMAND_TIMEOUT"]
                .into_iter()
                .find(|k| section.get(k).is_some())
                .unwrap_or("CONNECT_TIMEOUT");
            section.error(
                key,
                format!(
                    "CONNECT_TIMEOUT + COMMAND_TIMEOUT + DATA_TIMEOUT + DATA_DONE_TIMEOUT ({}), one message's time, is not below [pepsi-dispatch] MAX_RUNTIME ({}): a message still being relayed at MAX_RUNTIME has its worker killed and is struck, before the timeouts would make it a host error",
                    show_duration(budget),
                    show_duration(max_runtime)
                ),
            )
        })
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let target =
            Target::parse(s.required("SMARTHOST")?).map_err(|e| s.error("SMARTHOST", e))?;
        let lmtp = match s.get("PROTOCOL").unwrap_or("smtp") {
            "smtp" => false,
            "lmtp" => true,
            other => return Err(s.error("PROTOCOL", format!("{other:?} is neither smtp nor lmtp"))),
        };
        let tls = TlsSettings::of(s, &target)?;
        let unverified = match tls.level {
            Level::May | Level::Encrypt => {
                Some(tls::client_config(tls.level, None).map_err(|e| s.error("TLS", e))?)
            }
            Level::None | Level::Verify => None,
        };
        let hostname = s.get("HOSTNAME").map(str::to_string);
        if let Some(h) = &hostname {
            let ok = !h.is_empty()
                && h.len() <= 253
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-[]:".contains(c));
            if !ok {
                return Err(s.error("HOSTNAME", format!("{h:?} is not a host name")));
            }
        }
        let positive = |key: &str, default: u64| -> Result<Duration, ConfigError> {
            let d = s.duration(key, Duration::from_secs(default))?;
            if d.is_zero() {
                return Err(s.error(key, "must be greater than zero"));
            }
            Ok(d)
        };
        let timeouts = Timeouts {
            connect: positive("CONNECT_TIMEOUT", DEFAULT_TIMEOUTS.connect.as_secs())?,
            command: positive("COMMAND_TIMEOUT", DEFAULT_TIMEOUTS.command.as_secs())?,
            data: positive("DATA_TIMEOUT", DEFAULT_TIMEOUTS.data.as_secs())?,
            data_done: positive("DATA_DONE_TIMEOUT", DEFAULT_TIMEOUTS.data_done.as_secs())?,
        };
        Ok(Box::new(ConfiguredRelay {
            target,
            lmtp,
            hostname,
            timeouts,
            reuse_time: s.duration("CONNECTION_REUSE_TIME", Duration::from_secs(300))?,
            reuse_limit: s.number("CONNECTION_REUSE_LIMIT", 0u32, 0..=u32::MAX)?,
            next: section.next.clone(),
            tls,
            unverified,
        }))
    }

    /// The trust store of `verify` and the `AUTH_FILE`, as the workers read them.
    fn file_errors(&self, section: &Section) -> Vec<ConfigError> {
        let Ok(target) = Target::parse(section.get("SMARTHOST").unwrap_or_default()) else {
            return Vec::new();
        };
        let Ok(tls) = TlsSettings::of(section, &target) else {
            return Vec::new();
        };
        let mut errors = Vec::new();
        if tls.level == Level::Verify {
            if let Err(e) = tls::roots(Some(&tls.trust)) {
                errors.push(section.error("CA_FILE", e));
            }
        }
        if let Some(Err(e)) = tls.auth_file.as_deref().map(auth_file::load) {
            errors.push(section.error("AUTH_FILE", e));
        }
        errors
    }

    /// Reads the trust store of `verify` and the login, once, as the workers' account.
    fn start(&self, _config: &Config, section: &StageSection) -> Result<(), String> {
        let s = &section.section;
        let target = Target::parse(s.required("SMARTHOST").map_err(|e| e.to_string())?)?;
        let tls = TlsSettings::of(s, &target).map_err(|e| e.to_string())?;
        let named = |key: &str, e: String| s.error(key, e).to_string();
        if tls.level == Level::Verify {
            let roots = tls::roots(Some(&tls.trust)).map_err(|e| named("CA_FILE", e))?;
            let config =
                tls::client_config(Level::Verify, Some(roots)).map_err(|e| named("TLS", e))?;
            VERIFYING.put(tls.trust.clone(), config);
        }
        if let Some(path) = &tls.auth_file {
            let login = auth_file::load(path).map_err(|e| named("AUTH_FILE", e))?;
            LOGINS.put(path.clone(), login);
        }
        Ok(())
    }
}

impl ConfiguredRelay {
    /// The kept connection if it was opened for these settings and may carry another
    /// message (after a successful RSET); else a new one. Old ones are closed.
    fn connection(
        &self,
        key: &str,
        hostname: &str,
        kept: Option<Kept>,
        deadline: Instant,
    ) -> Result<Connection, String> {
        if let Some(k) = kept {
            let worn = k.connection.opened.elapsed() >= self.reuse_time
                || (self.reuse_limit > 0 && k.connection.messages >= self.reuse_limit);
            if k.key != key || worn {
                k.connection.quit();
            } else {
                let mut c = k.connection;
                c.set_deadline(deadline);
                match c.reset() {
                    Ok(()) => return Ok(c),
                    Err(e) => log::info!(
                        "relay: the kept connection to {} is gone ({}); opening another",
                        self.target,
                        Visible(&e.0)
                    ),
                }
            }
        }
        let security = self.security()?;
        secure::open(
            &self.target,
            self.lmtp,
            hostname,
            self.timeouts,
            deadline,
            &security,
        )
        .map_err(|e| {
            if e.0.starts_with(secure::LOGIN_REFUSED) {
                let mut refused = REFUSED_LOGIN.lock().unwrap_or_else(|p| p.into_inner());
                refused.retain(|(k, at)| k != key && at.elapsed() < LOGIN_PAUSE);
                refused.push((key.to_string(), Instant::now()));
            }
            format!("smarthost {}: {}", self.target, e.0)
        })
    }

    /// What the connection's security is, from the section and what the worker read
    /// at start.
    fn security(&self) -> Result<Security, String> {
        let config = match self.tls.level {
            Level::None => None,
            Level::Verify => Some(
                (*VERIFYING
                    .get(&self.tls.trust)
                    .map_err(|e| e.message.clone())?)
                .clone(),
            ),
            Level::May | Level::Encrypt => self.unverified.clone(),
        };
        let name = match self.tls.level {
            Level::None => None,
            _ => Some(tls::server_name(&self.tls.name)?),
        };
        let auth = match &self.tls.auth_file {
            Some(path) => Some(LOGINS.get(path).map_err(|e| e.message.clone())?),
            None => None,
        };
        Ok(Security {
            level: self.tls.level,
            wrapper: self.tls.wrapper,
            config,
            name,
            auth,
        })
    }

    /// A login refused less than a minute ago on a connection like this one: why the
    /// message waits without trying again.
    fn login_paused(&self, key: &str) -> Option<String> {
        let refused = REFUSED_LOGIN.lock().unwrap_or_else(|p| p.into_inner());
        let (_, at) = refused.iter().find(|(k, _)| k == key)?;
        let left = LOGIN_PAUSE.checked_sub(at.elapsed())?;
        Some(format!(
            "smarthost {}: {} {}s ago; not logging in again for {}s",
            self.target,
            secure::LOGIN_REFUSED,
            at.elapsed().as_secs(),
            left.as_secs() + 1
        ))
    }
}

impl Configured for ConfiguredRelay {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        // One deadline for the whole message, the connection's opening included.
        let deadline = Instant::now() + self.timeouts.budget();
        let hostname = self.hostname.as_deref().unwrap_or(&cx.pepsi.hostname);
        let key = format!("{}|{}|{hostname}|{:?}", self.target, self.lmtp, self.tls);
        if let Some(why) = self.login_paused(&key) {
            return Err(StageError::deferred(why));
        }
        let mut slot = CONNECTION.lock().unwrap_or_else(|p| p.into_inner());
        let mut connection = self
            .connection(&key, hostname, slot.take(), deadline)
            .map_err(StageError::deferred)?;
        let negotiated = connection.tls.clone();
        let envelope = Envelope {
            mail_from: message.mail_from(),
            rcpt_to: message.rcpt_to(),
            dsn: message.state.get("dsn"),
            client_ip: message.client_ip.as_deref(),
            auth_user: message.auth_user.as_deref(),
            lmtp: self.lmtp,
        };
        let headers = message.headers().unwrap_or_default();
        let body = message.body().unwrap_or_default();
        let mut accepted = None;
        let results = match transaction::deliver(&mut connection, &envelope, headers, body) {
            Ok(results) => {
                connection.messages += 1;
                accepted = connection.last_reply.take();
                *slot = Some(Kept { key, connection });
                results
            }
            Err((broken, partial)) => {
                let why = format!("smarthost {}: {}", self.target, broken.0);
                if partial.is_empty() {
                    return Err(StageError::deferred(why));
                }
                log::warn!("relay: message {}: {}", message.id, Visible(&why));
                partial
            }
        };
        let count = |kind: u8| results.iter().filter(|(_, r)| r.kind() == kind).count();
        let tls = match &negotiated {
            Some(t) => format!("{} TLS, {t}", t.trust()),
            None => "no TLS".to_string(),
        };
        // For the metrics (pepsi.stage_events): how this message went.
        match &negotiated {
            Some(t) => {
                cx.count(if t.verified {
                    "tls-verified"
                } else {
                    "tls-unverified"
                });
                cx.count(match t.version.as_str() {
                    "TLSv1.3" => "tlsv1.3",
                    "TLSv1.2" => "tlsv1.2",
                    _ => "tls-other",
                });
            }
            None => cx.count("no-tls"),
        }
        log::info!(
            "relay: message {} to {} ({tls}): {} delivered, {} deferred, {} refused",
            message.id,
            self.target,
            count(0),
            count(1),
            count(2)
        );
        Ok(Outcome::Recipients(RecipientOutcomes {
            next: self.next.clone(),
            results,
            relay: Some(self.target.to_string()),
            accepted,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw;

    fn section(lines: &[(&str, &str)]) -> StageSection {
        let mut text = String::from("[stage-r]\nPROGRAM = pepsi-stage-relay\n");
        for (k, v) in lines {
            text.push_str(&format!("{k} = {v}\n"));
        }
        let sections = raw::parse(std::path::Path::new("pepsi.conf"), &text).unwrap();
        StageSection::check(&sections[0]).unwrap()
    }

    fn error(lines: &[(&str, &str)]) -> String {
        match Relay.configure(&section(lines)) {
            Ok(_) => panic!("{lines:?} accepted"),
            Err(e) => e.to_string(),
        }
    }

    fn tls_of(lines: &[(&str, &str)]) -> Result<TlsSettings, String> {
        let s = section(lines);
        let target = Target::parse(s.section.get("SMARTHOST").unwrap()).unwrap();
        TlsSettings::of(&s.section, &target).map_err(|e| e.to_string())
    }

    #[test]
    fn tls_is_none_on_this_host_verify_beyond_it_and_wrapper_mode_on_port_465() {
        let level = |lines: &[(&str, &str)]| tls_of(lines).unwrap().level;
        assert_eq!(level(&[("SMARTHOST", "127.0.0.1:25")]), Level::None);
        assert_eq!(level(&[("SMARTHOST", "[::1]:25")]), Level::None);
        assert_eq!(level(&[("SMARTHOST", "mx.example:587")]), Level::Verify);
        assert_eq!(
            level(&[("SMARTHOST", "mx.example:587"), ("TLS", "may")]),
            Level::May
        );
        let wrapped = tls_of(&[("SMARTHOST", "smtp.example.net:465")]).unwrap();
        assert!(wrapped.wrapper && wrapped.level == Level::Verify);
        assert_eq!(wrapped.name, "smtp.example.net");
        let named = tls_of(&[
            ("SMARTHOST", "192.0.2.7:587"),
            ("TLS_NAME", "relay.example.net"),
            ("CA_FILE", "/etc/pepsi/ca.pem"),
        ])
        .unwrap();
        assert_eq!(named.name, "relay.example.net");
        assert_eq!(named.trust, PathBuf::from("/etc/pepsi/ca.pem"));
        assert_eq!(
            tls_of(&[("SMARTHOST", "mx.example:25")]).unwrap().trust,
            PathBuf::from(tls::SYSTEM_ROOTS)
        );
    }

    #[test]
    fn require_tls_is_refused_naming_tls_and_bad_tls_settings_name_their_key() {
        let e = tls_of(&[("SMARTHOST", "mx.example:25"), ("REQUIRE_TLS", "no")]).unwrap_err();
        assert!(e.contains("REQUIRE_TLS") && e.contains("TLS = none"), "{e}");
        for (lines, key) in [
            (
                vec![("SMARTHOST", "mx.example:25"), ("TLS", "always")],
                "TLS",
            ),
            (vec![("SMARTHOST", "unix:/run/s"), ("TLS", "may")], "TLS"),
            (
                vec![("SMARTHOST", "mx.example:465"), ("TLS", "may")],
                "TLS_WRAPPER",
            ),
            (
                vec![("SMARTHOST", "mx.example:25"), ("TLS_NAME", "a b")],
                "TLS_NAME",
            ),
            (
                vec![("SMARTHOST", "mx.example:25"), ("CA_FILE", "ca.pem")],
                "CA_FILE",
            ),
            (
                vec![
                    ("SMARTHOST", "127.0.0.1:25"),
                    ("AUTH_FILE", "/etc/pepsi/auth"),
                ],
                "AUTH_FILE",
            ),
            (
                vec![
                    ("SMARTHOST", "mx.example:587"),
                    ("TLS", "encrypt"),
                    ("AUTH_FILE", "/etc/pepsi/auth"),
                ],
                "AUTH_FILE",
            ),
        ] {
            let e = tls_of(&lines).unwrap_err();
            assert!(
                e.contains(&format!("{key}:")) || e.contains(key),
                "{lines:?}: {e}"
            );
        }
        // AUTH over TLS is fine.
        assert!(
            tls_of(&[
                ("SMARTHOST", "mx.example:587"),
                ("AUTH_FILE", "/etc/pepsi/relay-auth")
            ])
            .is_ok()
        );
    }

    #[test]
    fn bad_settings_are_refused_with_their_key() {
        assert!(error(&[]).contains("SMARTHOST"));
        assert!(error(&[("SMARTHOST", "nowhere")]).contains("SMARTHOST"));
        assert!(error(&[("SMARTHOST", "[::1]:25"), ("PROTOCOL", "http")]).contains("PROTOCOL"));
        assert!(error(&[("SMARTHOST", "[::1]:25"), ("HOSTNAME", "a b")]).contains("HOSTNAME"));
        assert!(
            error(&[("SMARTHOST", "[::1]:25"), ("CONNECT_TIMEOUT", "0")])
                .contains("CONNECT_TIMEOUT")
        );
        assert!(
            error(&[("SMARTHOST", "[::1]:25"), ("CONNECTION_REUSE_LIMIT", "-1")])
                .contains("CONNECTION_REUSE_LIMIT")
        );
    }
}
