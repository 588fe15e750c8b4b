//! What a stage is to the runtime: the [`Stage`] a program implements (what it loads,
//! its fusion default, its keys, how it checks its section), the [`Configured`] body
//! that section gives, the [`Context`] a body runs with, and [`Load`].
//!
//! Implemented by every stage (the built-ins in `src/stages/`, or any program linking
//! this library); used by `registry.rs` (the list of them a program is made of),
//! `chain.rs` (configure and run them), `batch.rs` and `runtime.rs`. Vocabulary only:
//! it must not touch the database, the protocol or the configuration file.

use super::message::Message;
use super::outcome::{Outcome, StageError};
use std::time::Duration;

use crate::config::{Config, ConfigError, PepsiOptions, Section, StageGraph, StageSection};

/// What a stage needs loaded besides the row's metadata (envelope, From:, Subject:,
/// state). Ordered: a stage may run on a row loaded with at least what it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Load {
    /// Metadata only.
    Metadata,
    /// Metadata, the header block and the body.
    Full,
}

/// What a stage body may use besides the message.
pub struct Context<'a> {
    /// The stage's effective section (with per-address overrides applied).
    pub section: &'a StageSection,
    /// The worker's database connection, for stages that query the database.
    pub client: &'a mut crate::db::Client,
    /// `[pepsi]`: the system's own options (its host name, for a report).
    pub pepsi: &'a PepsiOptions,
    /// The events counted of this message ([`Context::count`]).
    pub counted: Vec<&'static str>,
}

impl Context<'_> {
    /// Counts `event` of this message: it reaches `pepsi.stage_events` under the
    /// stage's name (schema 20) and `pepsi-queue metrics`. A name of lower-case letters,
    /// digits, dots and dashes, at most 32 bytes (the dispatcher drops any other).
    pub fn count(&mut self, event: &'static str) {
        self.counted.push(event);
    }
}

/// A stage program: the static description the runtime and fusion need.
pub trait Stage: Sync {
    /// The built-in name: `pass` for `pepsi-stage-pass`.
    fn name(&self) -> &'static str;
    /// What the stage loads.
    fn loads(&self) -> Load;
    /// Whether `FUSION` defaults to yes for this program.
    fn fusion_default(&self) -> bool;
    /// Whether a message this stage finishes was delivered (a relay, `exec`) rather
    /// than dropped (`discard`, a `pass` or `if` without `NEXT`, a bounce of a
    /// bounce): what the delivery log and `pepsi.history` call it.
    fn delivers(&self) -> bool {
        true
    }
    /// The keys of its own a section of this program may set, besides the keys every
    /// stage section has ([`crate::config::graph::STAGE_KEYS`]); any other key draws an
    /// "unknown key" warning.
    fn keys(&self) -> &'static [&'static str];
    /// The keys every stage section may set that this program does not read, each with
    /// why (`NEXT` of `discard`): `pepsi-dispatch check` warns about one that is set.
    fn ignored(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }
    /// The keys of its section a per-address setting (`pepsi.settings`, §12.5) may
    /// override for a correspondent, besides `MAX_LIFETIME`, which every stage allows.
    /// Whatever a stage declares, the keys of `settings::NEVER_OVERRIDABLE` and every
    /// `*_STAGE` key stay the section's: a correspondent never chooses what runs or
    /// where mail goes (§4 "Least privilege"). A row naming any other key is
    /// ignored.
    fn overridable(&self) -> &'static [&'static str];
    /// Checks a section of this program and returns the body configured by it: the one
    /// check of a section of this kind, used by the dispatcher (at start, at a reload,
    /// by `pepsi-dispatch check`) and by the worker (its own section at start, a
    /// successor before fusing into it, a section with per-address overrides).
    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError>;
    /// What `[pepsi-dispatch] MAX_RUNTIME` (`max_runtime`) does to a section of this
    /// program: a warning when the time the stage allows itself on one message (a
    /// command's `TIMEOUT`, a relay's timeouts summed) is not below it, so a worker
    /// killed at MAX_RUNTIME strikes the message before the stage's own timeout would
    /// make it a host error. `pepsi-dispatch check` asks for the file's sections and for
    /// a section with an address's settings laid over; a bad value is `configure`'s to
    /// report, not this. Most stages allow themselves no time of their own.
    fn runtime_warning(&self, _section: &Section, _max_runtime: Duration) -> Option<ConfigError> {
        None
    }
    /// Every problem of the files a section of this program names (keys, secrets),
    /// read as [`Self::start`] will read them but by the account that asks: for
    /// `pepsi-dispatch check`, which cannot start the stage. Each problem names the key
    /// and, for a file of lines, the line. A bad value is `configure`'s to report, not
    /// this. Most stages read no file of their own.
    fn file_errors(&self, _section: &Section) -> Vec<ConfigError> {
        Vec::new()
    }
    /// What this stage counted in this process that its messages' outcomes do not
    /// show (messages passed on unsigned, by reason), as one line the worker logs when
    /// its input ends; `None` when there is nothing to tell.
    fn summary(&self) -> Option<String> {
        None
    }
    /// The reports this program prints from the configuration besides running
    /// (`dns` for `dkim-sign`: the records to publish), by name.
    fn shows(&self) -> &'static [&'static str] {
        &[]
    }
    /// Prints the report `what` (one of [`Self::shows`]) for the sections of this
    /// program in `config`'s stage graph.
    fn show(&self, _what: &str, _graph: &StageGraph) -> Result<String, String> {
        Err("this stage prints no reports".to_string())
    }
    /// Prepares this process to run `section`, a stage it was started for or may fuse
    /// into, once: after the section is checked and before `ready`. An error refuses to
    /// run (exit 78, with the error as the cause) a stage the worker was started for,
    /// and keeps a successor from being fused into (a warning). Most stages need
    /// nothing.
    fn start(&self, _config: &Config, _section: &StageSection) -> Result<(), String> {
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
