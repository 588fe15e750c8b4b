//! The worker runtime's top (SPEC §5, §12): the public entry points every stage program
//! uses ([`run`], [`PROGRAM_PREFIX`], [`backoff`]) and the one `Worker` state that the
//! other runtime files extend. `stages::main` calls [`run`] and reads [`PROGRAM_PREFIX`].
//!
//! The runtime is cut by concern, one file each, all `impl Worker` blocks or free
//! functions beside this one:
//! - `startup.rs`: [`run`] — configuration, the pool and its session name, the schema
//!   and section checks, `ready`;
//! - `batch.rs`: the serve loop and one batch — one SELECT for its ids, load failures,
//!   rows into messages, one status line per id in input order;
//! - `chain.rs`: one message's chain of stages — lazy split, fusion, the cache of
//!   stages configured with per-address overrides;
//! - `errors.rs`: the error model of §12.4 — fail, retry with backoff, give up;
//! - `writes.rs`: the guarded writes and what happens when one fails.
//!
//! Per batch of ids: one SELECT loads the rows with their per-address settings and the
//! claim token each was claimed under; each row runs its chain of stages in this process
//! (the claimed stage, then any fused successors); then one UPDATE writes every
//! update-shaped outcome and one DELETE every finished message, each guarded by
//! `status = 'running' AND stage = <claimed stage> AND claim = <token>`; then one status
//! line per id, in input order. Stages that load headers and body get batches of one.
//!
//! This file holds state and wiring only: no SQL, no protocol lines, no decisions.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::Stage;
use super::chain::Ready;
use crate::config::{Config, StageGraph};
use crate::db::pool::Pool;
use crate::stages;

pub use super::errors::backoff;
pub use super::startup::run;

/// The prefix of a built-in stage's program name.
pub const PROGRAM_PREFIX: &str = "pepsi-stage-";

/// Everything a running worker owns: its configuration, its pool, the stage it was
/// started as, and the caches fusion and per-address settings need.
pub(super) struct Worker {
    /// The loaded configuration.
    pub(super) config: Config,
    /// The stage graph with the `pepsi.config_override` overlay, read at start.
    pub(super) graph: StageGraph,
    /// The worker's connections (one serves the loop; a stage may borrow another).
    pub(super) pool: Pool,
    /// The built-in this process was started as.
    pub(super) own: &'static dyn Stage,
    /// This binary, canonical, to tell which successors can run in this process.
    pub(super) exe: Option<PathBuf>,
    /// Per program: does it resolve to this very binary?
    pub(super) same_binary: HashMap<String, bool>,
    /// Stages configured per (stage, per-address overrides).
    pub(super) configured: HashMap<(String, String), Result<Ready, String>>,
    /// The `pepsi.settings` rows (address, stage, key) already warned about as
    /// ignored, so a busy address warns once per worker process.
    pub(super) ignored_settings: HashSet<(String, String, String)>,
    /// The largest batch a metadata-only stage takes (its greatest `QUEUE_LIMIT`).
    pub(super) batch_max: usize,
}

/// The built-in named by a program (by its file name), whatever binary it resolves to.
pub(super) fn builtin_by_name(program: &str) -> Option<&'static dyn Stage> {
    stages::for_program(program)
}

impl Worker {
    /// A worker for the built-in `own` with a checked configuration and a pool.
    pub(super) fn new(
        config: Config,
        graph: StageGraph,
        pool: Pool,
        own: &'static dyn Stage,
    ) -> Worker {
        let batch_max = graph
            .stages()
            .filter(|s| builtin_by_name(&s.program).is_some_and(|b| b.name() == own.name()))
            .map(|s| s.queue_limit as usize)
            .max()
            .unwrap_or(1)
            .max(1);
        Worker {
            config,
            graph,
            pool,
            own,
            exe: std::env::current_exe()
                .ok()
                .and_then(|p| std::fs::canonicalize(p).ok()),
            same_binary: HashMap::new(),
            configured: HashMap::new(),
            ignored_settings: HashSet::new(),
            batch_max,
        }
    }
}
