//! `pepsi-stage-srs` (§19): the Sender Rewriting Scheme, so that mail Pepsi forwards
//! passes SPF where it arrives and its bounces find their way back. `MODE = forward`
//! rewrites the envelope sender of mail whose sender's domain is not in
//! `LOCAL_DOMAINS` to an address at `SRS_DOMAIN`; `MODE = reverse` turns recipients at
//! `SRS_DOMAIN` back into the addresses they stand for, and fails one that does not
//! turn back (5.1.1). Metadata only, fusable by default.
//!
//! The files: `scheme.rs` (the addresses, byte-compatible with postsrsd 1.10) and
//! `secrets.rs` (the secrets file, read once when a worker starts, as the stage's
//! account). This file is the stage: its section's keys and what it does with each
//! message. Listed in `stages::BUILTINS`; it must not write to the database (the
//! runtime writes its outcome) nor know about batches, fusion or the protocol.

pub mod scheme;
pub mod secrets;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod postsrsd_tests;
#[cfg(test)]
mod scheme_tests;
#[cfg(test)]
mod stage_tests;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use scheme::Srs;

use crate::config::raw::show_duration;
use crate::config::{Config, ConfigError, Section, StageSection};
use crate::escape::Visible;
use crate::mailbox;
use crate::stages::read_at_start::ReadAtStart;
use crate::worker::{
    Configured, Context, DsnReason, Load, Message, Outcome, Stage, StageError, required_next,
};

/// The stage.
pub struct SrsStage;

/// `MAX_AGE` when the section does not set it: libsrs2's and postsrsd's 21 days.
pub const DEFAULT_MAX_AGE: Duration =
    Duration::from_secs(scheme::DEFAULT_MAX_AGE_DAYS as u64 * 86_400);

/// The longest `MAX_AGE`: the timestamp counts days modulo 1024, so an older one could
/// not be told from a newer one.
const MAX_AGE_DAYS: u64 = 1000;

/// The enhanced status code of a recipient whose SRS address does not reverse.
const INVALID_STATUS: &str = "5.1.1";

/// Which way a section rewrites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The envelope sender of mail from elsewhere, to an address at `SRS_DOMAIN`.
    Forward,
    /// Recipients at `SRS_DOMAIN`, back to the address they stand for.
    Reverse,
}

/// The section's settings.
struct ConfiguredSrs {
    mode: Mode,
    domain: String,
    secrets_file: PathBuf,
    /// Lower-case; the sender domains forward mode leaves alone.
    local_domains: Vec<String>,
    max_age_days: u32,
    next: String,
    /// The scheme with the secrets read at start, made at the first message.
    scheme: OnceLock<Srs>,
}

/// The secrets files this process read at start, each file's secrets (the first
/// signing).
static SECRETS: ReadAtStart<Vec<Vec<u8>>> = ReadAtStart::new("SECRETS_FILE");

/// A domain as `LOCAL_DOMAINS` and `SRS_DOMAIN` take it: what `mailbox::check` takes
/// after `x@`, lower-cased.
fn domain_name(text: &str) -> Result<String, String> {
    mailbox::check(&format!("x@{text}"))
        .map(|()| text.to_ascii_lowercase())
        .map_err(|e| format!("{text:?} is not a domain ({e})"))
}

/// The domain of an address (after its last `@`), lower-cased.
fn domain_of(address: &str) -> Option<String> {
    address
        .rsplit_once('@')
        .map(|(_, d)| d.to_ascii_lowercase())
}

impl Stage for SrsStage {
    fn name(&self) -> &'static str {
        "srs"
    }

    fn loads(&self) -> Load {
        Load::Metadata
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn keys(&self) -> &'static [&'static str] {
        &[
            "MODE",
            "SRS_DOMAIN",
            "SECRETS_FILE",
            "LOCAL_DOMAINS",
            "MAX_AGE",
        ]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let mode = match s.required("MODE")? {
            "forward" => Mode::Forward,
            "reverse" => Mode::Reverse,
            other => {
                return Err(s.error("MODE", format!("{other:?} is neither forward nor reverse")));
            }
        };
        let domain =
            domain_name(s.required("SRS_DOMAIN")?).map_err(|e| s.error("SRS_DOMAIN", e))?;
        let secrets_file = PathBuf::from(s.required("SECRETS_FILE")?);
        if !secrets_file.is_absolute() {
            return Err(s.error("SECRETS_FILE", "must be an absolute path"));
        }
        let local_domains = s
            .get("LOCAL_DOMAINS")
            .unwrap_or("")
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|d| !d.is_empty())
            .map(domain_name)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| s.error("LOCAL_DOMAINS", e))?;
        let max_age = s.duration("MAX_AGE", DEFAULT_MAX_AGE)?;
        let days = max_age.as_secs() / 86_400;
        if max_age.as_secs() % 86_400 != 0 || !(1..=MAX_AGE_DAYS).contains(&days) {
            return Err(s.error(
                "MAX_AGE",
                format!(
                    "{} is not a whole number of days from 1d to {MAX_AGE_DAYS}d (an SRS timestamp counts days)",
                    show_duration(max_age)
                ),
            ));
        }
        Ok(Box::new(ConfiguredSrs {
            mode,
            domain,
            secrets_file,
            local_domains,
            max_age_days: u32::try_from(days).unwrap_or(u32::MAX),
            next: required_next(section)?,
            scheme: OnceLock::new(),
        }))
    }

    fn file_errors(&self, section: &Section) -> Vec<ConfigError> {
        match section.get("SECRETS_FILE") {
            Some(path) if Path::new(path).is_absolute() => secrets::load(Path::new(path))
                .err()
                .map(|e| section.error("SECRETS_FILE", e))
                .into_iter()
                .collect(),
            _ => Vec::new(),
        }
    }

    fn start(&self, _config: &Config, section: &StageSection) -> Result<(), String> {
        let path = PathBuf::from(
            section
                .section
                .required("SECRETS_FILE")
                .map_err(|e| e.to_string())?,
        );
        let secrets = secrets::load(&path)?;
        SECRETS.put(path, secrets);
        Ok(())
    }
}

impl ConfiguredSrs {
    /// The scheme with the secrets read at start, made once.
    fn scheme(&self) -> Result<&Srs, StageError> {
        if let Some(srs) = self.scheme.get() {
            return Ok(srs);
        }
        let secrets = SECRETS.get(&self.secrets_file)?;
        let srs = Srs::new(secrets.to_vec(), &self.domain, self.max_age_days)
            .map_err(StageError::host)?;
        Ok(self.scheme.get_or_init(|| srs))
    }

    /// Forward mode: the sender of mail from elsewhere rewritten to `SRS_DOMAIN`. A
    /// sender that cannot be (an address too long for one) goes on as it is, as
    /// postsrsd leaves it: the message is delivered, only its SPF check may fail.
    fn forward(&self, message: &mut Message, stage: &str, srs: &Srs, now: SystemTime) -> Outcome {
        let sender = message.mail_from().to_string();
        let local = domain_of(&sender).is_none_or(|d| self.local_domains.contains(&d));
        if sender.is_empty() || local {
            return Outcome::Advance(self.next.clone());
        }
        match srs.forward(&sender, now) {
            Ok(Some(rewritten)) => message.set_mail_from(rewritten),
            Ok(None) => {}
            Err(e) => log::warn!(
                "{stage}: message {}: the sender <{}> is not rewritten: {e}",
                message.id,
                Visible(&sender)
            ),
        }
        Outcome::Advance(self.next.clone())
    }

    /// Reverse mode: each recipient at `SRS_DOMAIN` back to the address it stands for;
    /// one that does not reverse (a hash no secret gives, an expired timestamp, not an
    /// SRS address) fails alone with 5.1.1. When some do and some do not, the message
    /// is split here first (each part comes back to this stage all one way), so the
    /// rewritten recipients travel on a row of their own; when none does, the message
    /// fails, its error naming each recipient's reason, its notification a generic one
    /// (the reasons are the forwarder's business, not the sender's).
    fn reverse(
        &self,
        message: &mut Message,
        stage: &str,
        srs: &Srs,
        now: SystemTime,
    ) -> Result<Outcome, StageError> {
        let mut rewritten = Vec::with_capacity(message.rcpt_to().len());
        let mut kept = Vec::new();
        let mut refused = Vec::new();
        for rcpt in message.rcpt_to() {
            match srs.reverse(rcpt, now) {
                Ok(Some(original)) => {
                    kept.push(rcpt.clone());
                    rewritten.push(original);
                }
                Ok(None) => {
                    kept.push(rcpt.clone());
                    rewritten.push(rcpt.clone());
                }
                Err(e) => refused.push((rcpt.clone(), e.to_string())),
            }
        }
        if refused.is_empty() {
            if rewritten.as_slice() != message.rcpt_to() {
                message.set_rcpt_to(rewritten);
            }
            return Ok(Outcome::Advance(self.next.clone()));
        }
        if !kept.is_empty() {
            let refused = refused.into_iter().map(|(r, _)| r).collect();
            return Ok(Outcome::Split {
                groups: vec![kept, refused],
                stage: stage.to_string(),
            });
        }
        let reasons: Vec<String> = refused
            .iter()
            .map(|(rcpt, why)| format!("<{}>: {why}", Visible(rcpt)))
            .collect();
        Err(StageError::permanent(format!(
            "srs: no recipient reverses: {}",
            reasons.join("; ")
        ))
        .with_dsn(DsnReason {
            status: INVALID_STATUS.to_string(),
            diagnostic: Some(format!(
                "x-pepsi; {INVALID_STATUS} not a valid address of this forwarder (a wrong hash, an expired timestamp or no SRS address)"
            )),
        }))
    }
}

impl Configured for ConfiguredSrs {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let srs = self.scheme()?;
        let (stage, now) = (&cx.section.name, SystemTime::now());
        match self.mode {
            Mode::Forward => Ok(self.forward(message, stage, srs, now)),
            Mode::Reverse => self.reverse(message, stage, srs, now),
        }
    }
}
