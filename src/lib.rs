//! Pepsi's pipeline: the dispatcher, the worker runtime and the built-in stages.
//!
//! Messages live in `pepsi.workqueue`; each row sits at a stage with a status. The
//! programs of this crate share one library:
//!
//! - [`cli`] parses the global options every program takes before its subcommand;
//!   [`logging`] sets up `env_logger` from them.
//! - [`config`] reads `pepsi.conf` (raw entries with file and line, then a checked
//!   structure) and builds the stage graph with the `pepsi.config_override` overlay.
//! - [`db`] holds the connection helpers, the error classification by SQLSTATE, the
//!   embedded schema with its version check, and every SQL statement as a named constant.
//! - [`setup`] is `pepsi-setup schema`.
//! - [`protocol`] formats and parses the worker protocol's lines, for both ends.
//! - [`worker`] is the worker side of the stdin/stdout protocol (SPEC §5, §12): the
//!   runtime every stage program links, with batching, per-address settings, splits and
//!   fusion; [`stages`] are the built-in stages of the unified `pepsi-stage` binary.
//! - [`dispatch`] is `pepsi-dispatch serve`: a mio poll loop thread that owns every
//!   worker process and all pool state; a coordinator thread that owns the claiming
//!   connection (and the advisory lock) and performs every queue write; a listener
//!   thread owning the LISTEN session; a small thread pool for statistics flushes and
//!   the body GC. Threads talk over crossbeam channels and wake the loop with a
//!   `mio::Waker`. Nothing here is async.
//! - [`keeper`] runs an exec stage's command apart from its worker: as the stage's
//!   `USER`, through a keeper process that the dispatcher's root-kept master forks per
//!   worker (or that a worker starts for itself when nobody may switch accounts), with a
//!   clean environment, and killing whatever the command leaves behind.
//! - [`bouncer`] is `pepsi-failure-bouncer`: one thread and one connection that move
//!   failed and timed-out rows to the bounce stage, as they fail (LISTEN) or in a
//!   sweep.
//! - [`queue`] is `pepsi-queue`, the operator's tool: status, list, show, inject, the
//!   repair commands (each one stored-function call), metrics and the overlay.
//!
//! Two small pure modules are shared by all of them: [`mailbox`] judges an envelope
//! address (the one rule for `inject` and for whom a bounce may go to), and [`escape`]
//! shows text from messages and the database in log lines, on terminals and in metrics
//! labels with its control and invisible formatting characters escaped.
//!
//! Exit codes are decided only in the binaries' `main`, from the values in [`exit`].

pub mod bouncer;
pub mod cli;
pub mod config;
pub mod db;
pub mod dispatch;
pub mod escape;
pub mod exit;
pub mod keeper;
pub mod logging;
pub mod mailbox;
pub mod privilege;
pub mod protocol;
pub mod queue;
pub mod setup;
pub mod stages;
pub mod worker;
