//! `pepsi-stage-discard`: deletes the row; the message is done. Metadata only, fusable
//! by default.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision; it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

use crate::config::{ConfigError, StageSection};
use crate::worker::{Configured, Context, Load, Message, Outcome, Stage, StageError};

/// The stage.
pub struct Discard;

struct ConfiguredDiscard;

impl Stage for Discard {
    fn name(&self) -> &'static str {
        "discard"
    }

    fn loads(&self) -> Load {
        Load::Metadata
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn keys(&self) -> &'static [&'static str] {
        &[]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    fn configure(&self, _section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        Ok(Box::new(ConfiguredDiscard))
    }
}

impl Configured for ConfiguredDiscard {
    fn run(&self, _message: &mut Message, _cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        Ok(Outcome::Finish)
    }
}
