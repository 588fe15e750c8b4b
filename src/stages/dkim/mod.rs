//! `pepsi-stage-dkim-sign` (§18): signs each message with DKIM (RFC 6376; Ed25519 by
//! RFC 8463) for the domain of its one `From:` address, with the keys `KEY_TABLE`
//! lists for that domain (an RSA and an Ed25519 key: two signatures), and puts the
//! `DKIM-Signature` fields at the top of the header block ([`Message::prepend_headers`]:
//! the body, which a split's rows share, is never rewritten). A message without
//! exactly one `From:` address, or from a domain without a key, goes on unsigned
//! (logged, counted, told in `state.dkim_unsigned`) or, with `REQUIRE = yes`, fails
//! 5.7.0. Loads headers and body, fusable by default.
//!
//! The signing core, everything but the stage: `keys.rs` reads the `KEY_TABLE` and
//! loads each key file (`keyfile.rs`, with the DER of `der.rs`) and answers which keys
//! sign a domain; `from.rs` finds the domain of a message's one `From:` address;
//! `sign.rs` writes the `DKIM-Signature` fields that cover the message exactly as the
//! relay sends it, with the canonicalization of `canon.rs` over the header fields and
//! body `fields.rs` reads. Nothing there reads the database, the configuration file or
//! the clock (the signing time is given), and only `keys.rs` and `keyfile.rs` read
//! files: the key table once, when a worker starts, as the stage's account (and in
//! `pepsi-dispatch check`, as the account that runs it).
//!
//! This file is the stage: its section's keys, the tables its worker read, what it does
//! with each message, and `pepsi-stage-dkim-sign dns`. Listed in `stages::BUILTINS`; it
//! must not write to the database (the runtime writes its outcome) nor know about
//! batches, fusion or the protocol.

pub mod canon;
pub mod der;
pub mod fields;
pub mod from;
pub mod keyfile;
pub mod keys;
pub mod sign;

#[cfg(test)]
mod keys_tests;
#[cfg(test)]
mod sign_tests;
#[cfg(test)]
mod stage_tests;
#[cfg(test)]
mod test_keys;
#[cfg(test)]
mod verify_tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use keys::KeyTable;

use crate::config::{Config, ConfigError, Section, StageGraph, StageSection};
use crate::escape::Visible;
use crate::stages::read_at_start::ReadAtStart;
use crate::worker::{
    Configured, Context, DsnReason, Load, Message, Outcome, Stage, StageError, required_next,
};

/// The stage.
pub struct DkimSign;

/// The enhanced status code of a message `REQUIRE = yes` refuses to pass unsigned.
const UNSIGNED_STATUS: &str = "5.7.0";

/// The state key that tells why a message went on unsigned.
const UNSIGNED_KEY: &str = "dkim_unsigned";

/// The section's settings.
struct ConfiguredDkim {
    key_table: PathBuf,
    subdomains: bool,
    options: sign::Options,
    require: bool,
    next: String,
}

/// The key tables this process read at start.
static TABLES: ReadAtStart<KeyTable> = ReadAtStart::new("KEY_TABLE");

/// Messages this process signed, and passed on unsigned: no single From: address, no
/// key for its domain.
static SIGNED: AtomicU64 = AtomicU64::new(0);
static NO_FROM: AtomicU64 = AtomicU64::new(0);
static NO_KEY: AtomicU64 = AtomicU64::new(0);
/// Messages `REQUIRE` failed for want of a signature.
static REFUSED: AtomicU64 = AtomicU64::new(0);

impl Stage for DkimSign {
    fn name(&self) -> &'static str {
        "dkim-sign"
    }

    fn loads(&self) -> Load {
        Load::Full
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn keys(&self) -> &'static [&'static str] {
        &["KEY_TABLE", "SUBDOMAINS", "HEADERS", "EXPIRE", "REQUIRE"]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let key_table = PathBuf::from(s.required("KEY_TABLE")?);
        if !key_table.is_absolute() {
            return Err(s.error("KEY_TABLE", "must be an absolute path"));
        }
        let defaults = sign::Options::default();
        let headers = match s.get("HEADERS") {
            None => defaults.headers,
            Some(text) => sign::Options::parse_names(text).map_err(|e| s.error("HEADERS", e))?,
        };
        let expire = match s.get("EXPIRE") {
            None => None,
            Some(_) => {
                let d = s.duration("EXPIRE", Duration::ZERO)?;
                if d.as_secs() == 0 {
                    return Err(s.error("EXPIRE", "must be at least a second"));
                }
                Some(d)
            }
        };
        Ok(Box::new(ConfiguredDkim {
            key_table,
            subdomains: s.boolean("SUBDOMAINS", false)?,
            options: sign::Options {
                headers,
                oversign: defaults.oversign,
                expire,
            },
            require: s.boolean("REQUIRE", false)?,
            next: required_next(section)?,
        }))
    }

    fn file_errors(&self, section: &Section) -> Vec<ConfigError> {
        match section.get("KEY_TABLE") {
            Some(path) if Path::new(path).is_absolute() => match KeyTable::load(Path::new(path)) {
                Ok(_) => Vec::new(),
                Err(errors) => errors
                    .into_iter()
                    .map(|e| section.error("KEY_TABLE", e.to_string()))
                    .collect(),
            },
            _ => Vec::new(),
        }
    }

    fn start(&self, _config: &Config, section: &StageSection) -> Result<(), String> {
        let path = PathBuf::from(
            section
                .section
                .required("KEY_TABLE")
                .map_err(|e| e.to_string())?,
        );
        let table = KeyTable::load(&path).map_err(|errors| {
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        })?;
        TABLES.put(path, table);
        Ok(())
    }

    fn summary(&self) -> Option<String> {
        let [signed, no_from, no_key, refused] =
            [&SIGNED, &NO_FROM, &NO_KEY, &REFUSED].map(|n| n.load(Ordering::Relaxed));
        (signed + no_from + no_key + refused > 0).then(|| {
            format!(
                "dkim-sign: {signed} signed, {} passed on unsigned ({no_from} without exactly one From: address, {no_key} from a domain without a key), {refused} failed unsigned (REQUIRE)",
                no_from + no_key
            )
        })
    }

    fn shows(&self) -> &'static [&'static str] {
        &["dns"]
    }

    /// `dns`: the TXT record of every key of every `dkim-sign` section's `KEY_TABLE`,
    /// as zone file lines (strings of at most 255 characters).
    fn show(&self, what: &str, graph: &StageGraph) -> Result<String, String> {
        if what != "dns" {
            return Err(format!("no report {what:?}"));
        }
        let mut out = String::new();
        let mut tables: Vec<&str> = Vec::new();
        for stage in graph.stages() {
            let own =
                crate::stages::for_program(&stage.program).is_some_and(|b| b.name() == self.name());
            let Some(path) = stage.section.get("KEY_TABLE").filter(|_| own) else {
                continue;
            };
            if tables.contains(&path) {
                continue;
            }
            tables.push(path);
            let table = KeyTable::load(Path::new(path)).map_err(|errors| {
                errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            })?;
            for entry in table.entries() {
                let (name, text) = entry.dns_record();
                let strings: Vec<String> = text
                    .as_bytes()
                    .chunks(255)
                    .map(|c| format!("\"{}\"", String::from_utf8_lossy(c)))
                    .collect();
                out.push_str(&format!("{name}. IN TXT ( {} )\n", strings.join(" ")));
            }
        }
        if tables.is_empty() {
            return Err("no stage of the configuration runs pepsi-stage-dkim-sign".to_string());
        }
        Ok(out)
    }
}

impl ConfiguredDkim {
    /// Passes the message on unsigned for `why` (counted in `count`), or fails it 5.7.0
    /// with `REQUIRE`.
    fn unsigned(
        &self,
        message: &mut Message,
        stage: &str,
        why: String,
        count: &AtomicU64,
    ) -> Result<Outcome, StageError> {
        if self.require {
            REFUSED.fetch_add(1, Ordering::Relaxed);
            return Err(
                StageError::permanent(format!("dkim-sign: not signed: {why}")).with_dsn(
                    DsnReason {
                        status: UNSIGNED_STATUS.to_string(),
                        diagnostic: Some(format!(
                            "x-pepsi; {UNSIGNED_STATUS} the message cannot be signed: {why}"
                        )),
                    },
                ),
            );
        }
        count.fetch_add(1, Ordering::Relaxed);
        log::info!(
            "{stage}: message {} passed on unsigned: {}",
            message.id,
            Visible(&why)
        );
        message.state.insert(
            UNSIGNED_KEY.to_string(),
            serde_json::Value::String(crate::db::storable(&why)),
        );
        Ok(Outcome::Advance(self.next.clone()))
    }
}

impl Configured for ConfiguredDkim {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let table = TABLES.get(&self.key_table)?;
        self.sign_with(message, &cx.section.name, &table, SystemTime::now())
    }
}

impl ConfiguredDkim {
    /// Signs `message` with `table`'s keys for its `From:` domain at `now`, or passes
    /// it on unsigned (fails it, with `REQUIRE`).
    fn sign_with(
        &self,
        message: &mut Message,
        stage: &str,
        table: &KeyTable,
        now: SystemTime,
    ) -> Result<Outcome, StageError> {
        let (Some(headers), Some(body)) = (message.headers(), message.body()) else {
            return Err(StageError::host(
                "the message's header block and body were not loaded",
            ));
        };
        let domain = match from::from_domain(headers) {
            Ok(domain) => domain,
            Err(why) => return self.unsigned(message, stage, why.to_string(), &NO_FROM),
        };
        let keys = table.keys_for(&domain, self.subdomains);
        if keys.is_empty() {
            let why = format!("no key for {}", Visible(&domain));
            return self.unsigned(message, stage, why, &NO_KEY);
        }
        let fields = sign::sign(headers, body, &keys, &self.options, now)
            .map_err(|e| StageError::host(format!("dkim-sign: {e}")))?;
        SIGNED.fetch_add(1, Ordering::Relaxed);
        message.prepend_headers(&fields);
        Ok(Outcome::Advance(self.next.clone()))
    }
}
