//! The worker library: everything a stage program needs to speak the worker protocol
//! correctly (SPEC §5, §12). A stage implements [`Stage`] (what it loads, its fusion
//! default, how it checks its section) and the [`Configured`] body it returns; the
//! [`runtime`] does the rest: start-up checks, `ready`, reading ids, loading rows with
//! their per-address settings and claim tokens in one SELECT, batching metadata-only
//! stages, lazy splits, fusion, the error model, the one-round-trip guarded writes and
//! the status lines (its files are listed in [`runtime`]).
//!
//! The worker never talks to the dispatcher except through stdin/stdout lines (and the
//! stage name the dispatcher puts in its environment, which names its sessions).

mod batch;
mod chain;
mod errors;
pub mod input;
pub mod message;
pub mod runtime;
pub mod settings;
mod startup;
mod tally;
mod writes;

use std::fmt;
use std::time::Duration;

pub use message::Message;

use crate::config::{ConfigError, PepsiOptions, StageSection};
use crate::db::{self, ErrorKind};
use crate::escape::Visible;

/// What a stage needs loaded besides the row's metadata (envelope, From:, Subject:,
/// state). Ordered: a stage may run on a row loaded with at least what it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Load {
    /// Metadata only: such a stage is batched (§12.3).
    Metadata,
    /// Metadata, the header block and the body.
    Full,
}

/// What a stage decided for a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Move the row to this stage, pending (or run that stage here, when fused).
    Advance(String),
    /// The message is done: delete the row.
    Finish,
    /// Leave the row paused at this stage and retry it after the delay.
    Pause(Duration),
    /// Split the recipients into these groups; every group continues at the stage as
    /// its own pending row (the first on this row).
    Split {
        /// The recipient groups, which together are exactly the row's recipients.
        groups: Vec<Vec<String>>,
        /// The stage every group continues at.
        stage: String,
    },
    /// The message is done and this delivery status notification takes its place, as a
    /// new pending row (§13.2); both in one write.
    Bounce(Box<Notification>),
}

/// A delivery status notification that replaces a failed message (§13.2): a new
/// message from the null sender to the failed message's sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The stage it goes to, pending.
    pub stage: String,
    /// Its one recipient: the failed message's envelope sender.
    pub recipient: String,
    /// Its `From:`, as extracted metadata.
    pub header_from: String,
    /// Its `Subject:`, as extracted metadata.
    pub subject: String,
    /// Its header block.
    pub headers: Vec<u8>,
    /// Its body.
    pub body: Vec<u8>,
}

/// The class of a stage error (§12.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The message itself is at fault: fail it at once.
    Permanent,
    /// The host is at fault (the default): pause and retry with backoff.
    Host,
    /// The database connection broke: answer 74, nothing committed.
    Connection,
    /// The database refused a connection for overload: answer 75.
    Overload,
}

/// An error a stage returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageError {
    /// How it is handled.
    pub class: ErrorClass,
    /// What happened (goes to `state.last_error` and the log).
    pub message: String,
}

impl StageError {
    /// A host error: a helper that cannot start, an unreadable file, a service down.
    pub fn host(message: impl Into<String>) -> StageError {
        StageError {
            class: ErrorClass::Host,
            message: crate::db::storable(&message.into()),
        }
    }

    /// A permanent error: input the stage cannot parse, a construct it rejects.
    pub fn permanent(message: impl Into<String>) -> StageError {
        StageError {
            class: ErrorClass::Permanent,
            message: crate::db::storable(&message.into()),
        }
    }

    /// A database error, classified by SQLSTATE: connection and overload errors keep
    /// their own class, everything else is a host error.
    pub fn from_db(err: &postgres::Error) -> StageError {
        let class = match db::classify(err) {
            ErrorKind::Connection => ErrorClass::Connection,
            ErrorKind::Overload => ErrorClass::Overload,
            ErrorKind::Transient | ErrorKind::Other => ErrorClass::Host,
        };
        StageError {
            class,
            message: format!("database: {}", db::describe(err)),
        }
    }
}

/// The message for a log line: escaped ([`Visible`]), since it can quote a program's
/// output or a correspondent's setting.
impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Visible(&self.message).fmt(f)
    }
}

/// What a stage body may use besides the message.
pub struct Context<'a> {
    /// The stage's effective section (with per-address overrides applied).
    pub section: &'a StageSection,
    /// The worker's database connection, for stages that query the database.
    pub client: &'a mut postgres::Client,
    /// `[pepsi]`: the system's own options (its host name, for a report).
    pub pepsi: &'a PepsiOptions,
}

/// A stage program: the static description the runtime and fusion need.
pub trait Stage: Sync {
    /// The built-in name: `pass` for `pepsi-stage-pass`.
    fn name(&self) -> &'static str;
    /// What the stage loads.
    fn loads(&self) -> Load;
    /// Whether `FUSION` defaults to yes for this program.
    fn fusion_default(&self) -> bool;
    /// The keys of its own a section of this program may set, besides the keys every
    /// stage section has ([`crate::config::graph::STAGE_KEYS`]); any other key draws an
    /// "unknown key" warning.
    fn keys(&self) -> &'static [&'static str];
    /// The keys of its section a per-address setting (`pepsi.settings`, SPEC §12.5) may
    /// override for a correspondent, besides `MAX_LIFETIME`, which every stage allows.
    /// Whatever a stage declares, the keys of [`settings::NEVER_OVERRIDABLE`] and every
    /// `*_STAGE` key stay the section's: a correspondent never chooses what runs or
    /// where mail goes (SPEC §4 "Least privilege"). A row naming any other key is
    /// ignored.
    fn overridable(&self) -> &'static [&'static str];
    /// Checks a section of this program and returns the body configured by it: the one
    /// check of a section of this kind, used by the dispatcher (at start, at a reload,
    /// by `pepsi-dispatch check`) and by the worker (its own section at start, a
    /// successor before fusing into it, a section with per-address overrides).
    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError>;
    /// Prepares this process to run `section`, a stage it was started for, once: after
    /// the section is checked and before `ready`. An error refuses to run (exit 78,
    /// with the error as the cause). Most stages need nothing.
    fn start(
        &self,
        _config: &crate::config::Config,
        _section: &StageSection,
    ) -> Result<(), String> {
        Ok(())
    }
}

/// A stage configured by one (effective) section.
pub trait Configured {
    /// The data-dependent fusion gate: may this message be fused into this stage?
    fn fusion_gate(&self, _message: &Message) -> bool {
        true
    }

    /// Runs the stage on a message.
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError>;
}

/// `NEXT` of a section, required by stages that always advance.
pub fn required_next(section: &StageSection) -> Result<String, ConfigError> {
    section.section.required("NEXT").map(str::to_string)
}
