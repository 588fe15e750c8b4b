//! The worker library: everything a stage program needs to speak the worker protocol
//! correctly (§5, §12). A stage implements [`Stage`] (what it loads, its fusion
//! default, how it checks its section) and the [`Configured`] body it returns; the
//! program's `main` hands [`runtime::run`] the [`Registry`] of the stages it implements
//! and the one it was started as; the runtime does the rest: start-up checks, `ready`,
//! reading ids, loading rows with their per-address settings and claim tokens in one
//! SELECT, batching metadata-only stages, lazy splits, fusion, the error model, the
//! one-round-trip guarded writes and the status lines.
//!
//! The worker never talks to the dispatcher except through stdin/stdout lines (and the
//! stage name the dispatcher puts in its environment, which names its sessions). It
//! never names a particular stage: the built-ins live in `src/stages/`, which uses
//! this library, never the reverse; which stages exist is the [`Registry`] it is given.
//!
//! This file is the map and the public face (re-exports) only. The files, each using
//! only those listed after it (no file uses one listed before it, and none uses this
//! one):
//! - `runtime.rs`: [`runtime::run`]: configuration, the pool and its session name,
//!   the schema and section checks, each own stage's `start`, `ready`; then the serve
//!   loop;
//! - `batch.rs`: the serve loop and one batch (`Server`): one SELECT for its ids, load
//!   failures, rows into messages, one status line per id in input order;
//! - `chain.rs`: one message's chain of stages (`Runner`): per-address rows refused,
//!   lazy split, fusion, the cache of stages configured with per-address overrides;
//! - `recipients.rs`: a per-recipient outcome: one outcome per group of recipients
//!   that share a result, through a split whose rows carry the verdict;
//! - `writes.rs`: the guarded writes of a batch's plans and what happens when one
//!   fails;
//! - `errors.rs`: the error model of §12.4: `fate`, the pure decision (fail, retry
//!   with backoff, give up to `BOUNCE_STAGE`), and its application to a plan;
//! - `plan.rs`: what one batch entry writes, under which guard, and what it answers;
//! - `maillog.rs`: the delivery log, a line per record once its write committed;
//! - `record.rs`: what an outcome records of each recipient (`pepsi.history`, the
//!   delivery log);
//! - [`settings`]: per-address settings (§12.5) and what a correspondent may override;
//! - `registry.rs`: [`Registry`], the stages a program is made of, by program name;
//! - `stage.rs`: [`Stage`], [`Configured`], [`Context`], [`Load`];
//! - `outcome.rs`: [`Outcome`], [`Notification`], [`StageError`], [`ErrorClass`], [`DsnReason`];
//! - [`message`]: [`Message`], a loaded row, and the [`SettingRow`]s that came with it;
//! - [`input`]: reading ids from stdin with the greedy batch take of §12.3;
//! - `tally.rs`: the batch sizes logged when input ends.
//!
//! A new built-in stage touches `src/stages/` only (see there); nothing here changes.

mod batch;
mod chain;
mod errors;
pub mod input;
mod maillog;
pub mod message;
mod outcome;
mod plan;
mod recipients;
mod record;
mod registry;
pub mod runtime;
pub mod settings;
mod stage;
mod tally;
mod writes;

pub use message::{Message, SettingRow};
pub use outcome::{
    DsnReason, ErrorClass, Notification, Outcome, RecipientOutcomes, RecipientResult, StageError,
};
pub use registry::{PROGRAM_PREFIX, Registry};
pub use stage::{Configured, Context, Load, Stage, required_next};
