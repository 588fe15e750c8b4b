//! `pepsi-stage-pass`: advances every message to `NEXT` unchanged. For wiring and
//! benchmarks. Metadata only, fusable by default.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision; it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

use crate::config::{ConfigError, StageSection};
use crate::worker::{
    Configured, Context, Load, Message, Outcome, Stage, StageError, required_next,
};

/// The stage.
pub struct Pass;

struct ConfiguredPass {
    next: String,
}

impl Stage for Pass {
    fn name(&self) -> &'static str {
        "pass"
    }

    fn loads(&self) -> Load {
        Load::Metadata
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn delivers(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &[]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &[]
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        Ok(Box::new(ConfiguredPass {
            next: required_next(section)?,
        }))
    }
}

impl Configured for ConfiguredPass {
    fn run(&self, _message: &mut Message, _cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        Ok(Outcome::Advance(self.next.clone()))
    }
}
