//! `pepsi-stage-relay` (§17): hands each message to `SMARTHOST` over SMTP or LMTP
//! (`PROTOCOL`). Loads headers and body; not fusable by default.
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
//! the dispatcher's `MAX_RUNTIME`): no wait of its transaction goes beyond it. There is
//! no TLS: a `SMARTHOST` that is not a unix socket or a loopback address needs
//! `REQUIRE_TLS = no` written out.
//!
//! The files: `client.rs` (the connection), `transaction.rs` (one message's commands
//! and results), `reply.rs` (reading replies from the network, the enhanced codes).
//! Listed in `stages::BUILTINS`; it must not write to the database (the runtime writes
//! its outcome) nor know about batches, fusion or the protocol.

pub mod client;
pub mod reply;
pub mod transaction;
#[cfg(test)]
mod wire_tests;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use client::{Connection, Target, Timeouts};
use transaction::Envelope;

use crate::config::raw::show_duration;
use crate::config::{ConfigError, Section, StageSection};
use crate::escape::Visible;
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
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &[
            "SMARTHOST",
            "PROTOCOL",
            "HOSTNAME",
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
        match s.optional_boolean("REQUIRE_TLS")? {
            Some(true) => {
                return Err(s.error(
                    "REQUIRE_TLS",
                    "this relay does not speak TLS: use a unix socket or a loopback smarthost (a local MTA that does TLS), or write REQUIRE_TLS = no",
                ));
            }
            None if !target.is_local() => {
                return Err(s.error(
                    "SMARTHOST",
                    format!(
                        "{target} is not a unix socket or a loopback address, and this relay does not speak TLS: mail would cross the network in clear; write REQUIRE_TLS = no to allow it"
                    ),
                ));
            }
            _ => {}
        }
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
        }))
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
        Connection::open(&self.target, self.lmtp, hostname, self.timeouts, deadline)
            .map_err(|e| format!("smarthost {}: {}", self.target, e.0))
    }
}

impl Configured for ConfiguredRelay {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        // One deadline for the whole message, the connection's opening included.
        let deadline = Instant::now() + self.timeouts.budget();
        let hostname = self.hostname.as_deref().unwrap_or(&cx.pepsi.hostname);
        let key = format!("{}|{}|{hostname}", self.target, self.lmtp);
        let mut slot = CONNECTION.lock().unwrap_or_else(|p| p.into_inner());
        let mut connection = self
            .connection(&key, hostname, slot.take(), deadline)
            .map_err(StageError::deferred)?;
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
        let results = match transaction::deliver(&mut connection, &envelope, headers, body) {
            Ok(results) => {
                connection.messages += 1;
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
        log::info!(
            "relay: message {} to {}: {} delivered, {} deferred, {} refused",
            message.id,
            self.target,
            count(0),
            count(1),
            count(2)
        );
        Ok(Outcome::Recipients(RecipientOutcomes {
            next: self.next.clone(),
            results,
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

    #[test]
    fn a_smarthost_beyond_this_host_needs_require_tls_no_written_out() {
        assert!(
            Relay
                .configure(&section(&[("SMARTHOST", "127.0.0.1:25")]))
                .is_ok()
        );
        assert!(
            Relay
                .configure(&section(&[
                    ("SMARTHOST", "unix:/run/lmtp"),
                    ("PROTOCOL", "lmtp")
                ]))
                .is_ok()
        );
        assert!(error(&[("SMARTHOST", "mx.example:25")]).contains("REQUIRE_TLS = no"));
        assert!(error(&[("SMARTHOST", "127.0.0.1:25"), ("REQUIRE_TLS", "yes")]).contains("TLS"));
        assert!(
            Relay
                .configure(&section(&[
                    ("SMARTHOST", "mx.example:25"),
                    ("REQUIRE_TLS", "no")
                ]))
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
