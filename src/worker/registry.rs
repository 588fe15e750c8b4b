//! The stage registry: the stages a program is made of, which its `main` hands to
//! `runtime::run` (`pepsi-stage` hands it the built-ins' registry). The worker
//! asks it which stage a `PROGRAM` names: the stage a section runs as, whether a
//! successor can be fused into this process, which keys a per-address setting may
//! override at a stage.
//!
//! Used by `runtime.rs`, `chain.rs` and `settings.rs`. It owns no list of its own: the
//! worker library never names a particular stage (the built-ins live in
//! `src/stages/`, which uses this library, never the reverse).

use super::stage::Stage;

/// The prefix of a built-in stage's program name (`pepsi-stage-NAME`).
pub const PROGRAM_PREFIX: &str = "pepsi-stage-";

/// The stages one program implements, by name (`pass` for `pepsi-stage-pass`).
#[derive(Clone, Copy)]
pub struct Registry {
    stages: &'static [&'static dyn Stage],
}

impl Registry {
    /// A registry of these stages, in the order `list` and `--help` show them.
    pub const fn new(stages: &'static [&'static dyn Stage]) -> Registry {
        Registry { stages }
    }

    /// Every stage, in order.
    pub fn stages(self) -> &'static [&'static dyn Stage] {
        self.stages
    }

    /// The stage of this name.
    pub fn find(self, name: &str) -> Option<&'static dyn Stage> {
        self.stages.iter().copied().find(|s| s.name() == name)
    }

    /// The stage a `PROGRAM` names by its file name (`pepsi-stage-NAME`, on `PATH` or
    /// at any absolute path), whatever binary it resolves to.
    pub fn for_program(self, program: &str) -> Option<&'static dyn Stage> {
        let name = program.rsplit('/').next().unwrap_or(program);
        self.find(name.strip_prefix(PROGRAM_PREFIX)?)
    }
}
