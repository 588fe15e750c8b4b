//! Pepsi's pipeline: the dispatcher, the worker runtime and the built-in stages.
//!
//! Messages live in `pepsi.workqueue`; each row sits at a stage with a status. The
//! programs of this crate share one library:
//!
//! - [`cli`] parses the global options every program takes before its subcommand;
//!   [`logging`] sets up `env_logger` from the level and `-v` it hands over (logging
//!   knows nothing of the command line).
//! - [`config`] reads `pepsi.conf` (raw entries with file and line, then a checked
//!   structure, each fixed key declared once in a table) and builds the stage graph
//!   with the `pepsi.config_override` overlay.
//! - [`check`] is `pepsi-dispatch check` and the checks the dispatcher's start and
//!   reload and `pepsi-queue config` share with it: above the configuration and the
//!   programs whose rules it checks, each stage's own rules read from its declaration.
//! - [`db`] holds the connection helpers, the error classification by SQLSTATE, the
//!   embedded schema with its version check, and every SQL statement as a named constant.
//! - [`setup`] is `pepsi-setup schema`.
//! - [`protocol`] formats and parses the worker protocol's lines, for both ends.
//! - [`worker`] is the worker side of the stdin/stdout protocol (§5, §12): the
//!   runtime every stage program links, with batching, per-address settings, splits and
//!   fusion; [`stages`] are the built-in stages of the unified `pepsi-stage` binary.
//! - [`dispatch`] is `pepsi-dispatch serve`: a mio poll loop thread that owns every
//!   worker process and all pool state; a coordinator thread that owns the claiming
//!   connection (and the advisory lock) and performs every queue write; a listener
//!   thread owning the LISTEN session; a small thread pool for statistics flushes and
//!   the body GC. Threads talk over crossbeam channels and wake the loop with a
//!   `mio::Waker`. Nothing here is async.
//! - [`launcher`] is the dispatcher's process that starts and kills its workers, kept
//!   root when the dispatcher was started as root: workers run under `[pepsi]
//!   WORKER_AS`, not dumpable, with the configuration the dispatcher hands them.
//! - [`keeper`] runs an exec stage's command apart from its worker: as the stage's
//!   `USER`, through a keeper process that the launcher forks per worker (or that a
//!   worker starts for itself when nobody may switch accounts), with a clean
//!   environment, and killing whatever the command leaves behind.
//! - [`bouncer`] is `pepsi-failure-bouncer`: one thread and one connection that move
//!   failed and timed-out rows to the bounce stage, as they fail (LISTEN) or in a
//!   sweep.
//! - [`ingress`] is `pepsi-ingress serve`: mail in over LMTP and SMTP, a thread per
//!   session and one committer thread that queues what the sessions accepted in group
//!   commits and answers each message only once its commit returned.
//! - [`queue`] is `pepsi-queue`, the operator's tool: status, list, show, inject, the
//!   repair commands (each one stored-function call), metrics, the overlay and the
//!   per-address settings; started as `pepsi-settings` or `pepsi-config` (links to it)
//!   it is those tools.
//!
//! Small modules below them all: [`mailbox`] judges an envelope address (the one rule
//! for `inject`, the ingress and whom a bounce may go to) and [`intake`], beside it,
//! what a message must be before it is queued; [`escape`] shows text from messages and
//! the database in log lines, on terminals and in metrics labels with its control and
//! invisible formatting characters escaped; [`conninfo`] reads a connection string's
//! `target_session_attrs` as the programs need it; [`durability`] names the
//! `synchronous_commit` levels a stage or the dispatcher may choose; [`signals`] is the
//! three daemons' signal handling; [`random`] draws from the system's random source;
//! [`tls`] holds what the relay and the ingress share of TLS (rustls: the levels, the
//! trust store, certificates and keys).
//!
//! # Layers
//!
//! The top-level modules form layers, each using only those below it (`tests/layout.rs`
//! holds the order and fails on an import against it): `escape`, `exit`, `logging`,
//! `cli`, `privilege`, `random`, `conninfo`, `durability`, `protocol`, `mailbox`,
//! `signals`, `tls`; then `db`; `intake`; `config`; `keeper`, `launcher`; `worker`, `stages`;
//! `bouncer`, `ingress`; `check`; and the programs on top, `queue`, `dispatch`, `setup`.
//!
//! A `§N` in a comment names a section of `doc/design.md`, the design in the project's
//! own words; `tests/layout.rs` checks that every one resolves.

//! Exit codes are decided only in the binaries' `main`, from the values in [`exit`].
//!
//! # Where things are added
//!
//! - **A key of a fixed section** (`[pepsi]`, `[pepsi-postgres]`, `[pepsi-dispatch]`,
//!   `[pepsi-failure-bouncer]`): one line in the table of `src/config/fixed.rs` (name,
//!   kind with its default, a doc line) under its section; its use: a field of that
//!   section's options in `src/config/mod.rs`, set in `Config::from_sections` through
//!   the line's constant (`fixed::NAME.read(…)`), and the code that needs it; its entry
//!   under FIXED SECTIONS in `packaging/man/pepsi.conf.5`, and its line, commented out at
//!   its default, in `packaging/pepsi.conf` (`tests/man.rs` checks both against the
//!   table). The known keys, the unknown-key warnings and `pepsi-dispatch check`'s
//!   fallbacks follow from the table line; nothing else names the key.
//! - **A migration that adds a function a role calls**: a new file
//!   `schema/NNN_verb_noun.sql` that creates the function with `SET search_path =
//!   pg_catalog, pg_temp` and inserts its grants into `pepsi.role_grants` (never a
//!   `GRANT`: `pepsi-setup` applies that table on every run); one
//!   `migration!("NNN_verb_noun.sql")` line at the end of `FILES` in
//!   `src/db/schema.rs`; and the statement that calls it, a named constant in
//!   `src/db/sql.rs` (the two claim statements live in `src/db/claim_sql.rs`, which
//!   `sql.rs` re-exports), used where it is needed. Released schema files are never edited
//!   (their bytes are in the digest databases store); `src/db/schema.rs` says more.
//! - **A built-in stage**: its file `src/stages/NAME.rs` (a type implementing
//!   `worker::Stage`: loads, fusion default, its keys, its overridable keys,
//!   `configure`, `runtime_warning` when it allows itself time of its own, and the
//!   body: `pepsi-dispatch check` reads a stage's rules from there and names none); in `src/stages/mod.rs` its `pub mod` and its entry in
//!   `BUILTINS`; its name in `BUILTIN_STAGES` of `src/config/program_path.rs` (what the
//!   overlay may name; a unit test compares the two lists); its section in
//!   `packaging/man/pepsi-stage.8` and its keys under BUILT-IN STAGE KEYS in
//!   `packaging/man/pepsi.conf.5` (`tests/man.rs` checks both against the registry);
//!   its name in the pepsi-stage-NAME row of the README's command table. The package's
//!   `pepsi-stage-NAME` link, the worker runtime and the tests' stage links follow from
//!   the registry; nothing else names it.
//! - **A `pepsi-queue` command**: its file `src/queue/NAME.rs` (a `run` on the
//!   [`queue::Session`]); in `src/queue/args.rs` its `Command` variant and its arm of
//!   `parse` (its options, if any, in `src/queue/args/commands.rs`); in
//!   `src/queue/mod.rs` its `pub mod`, its line in `PROGRAM`'s help and its arm of the
//!   command `match`; its statements as named constants in `src/db/sql.rs` (a stored
//!   function it calls: the migration above); its item in `packaging/man/pepsi-queue.8`
//!   (`tests/man.rs` checks every command, option and exit status of the help there);
//!   its row in doc/operating.md's table of pepsi-queue commands and its name in the
//!   README's command table.

pub mod bouncer;
pub mod check;
pub mod cli;
pub mod config;
pub mod conninfo;
pub mod db;
pub mod dispatch;
pub mod durability;
pub mod escape;
pub mod exit;
pub mod ingress;
pub mod intake;
pub mod keeper;
pub mod launcher;
pub mod logging;
pub mod mailbox;
pub mod privilege;
pub mod protocol;
pub mod queue;
pub mod random;
pub mod setup;
pub mod signals;
pub mod stages;
pub mod tls;
pub mod worker;
