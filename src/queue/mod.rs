//! `pepsi-queue [GLOBAL] COMMAND`: the operator's tool (§14) — look at the queue,
//! inject mail, repair messages, export metrics and change the stage overlay, without
//! writing SQL.
//!
//! The files, one concern each:
//! - [`args`] checks the command line into a [`args::Command`] (pure);
//! - this file opens the [`Session`] every command but `config check` needs — the
//!   configuration, the switch to `RUN_AS`, one connection, the schema check — and
//!   maps database errors to exit statuses;
//! - [`status`] reads the queue's shape and the statistics in one snapshot, which
//!   `status` prints and [`metrics`] turns into the Prometheus text format;
//! - [`list`] is `list` and `show`; [`shape`] is `shape`, the queue by age and by
//!   recipient domain, sender domain or stage (Postfix `qshape`); [`trace`] is
//!   `trace`, what became of a message (its stages, splits and outcomes); [`inject`] and
//!   [`message`] are `inject`; [`repair`] is `resume`, `hold`, `release`, `delete` and
//!   `requeue`; [`overlay`] is `config set|unset` and [`effective`] `config show`;
//!   [`settings`] is `settings`, the per-address settings (§20); [`destinations`] is
//!   `destinations` and its `lift`, relay-to-internet's destinations in trouble (§22);
//!   [`format`](mod@format) lays out text for people;
//! - [`multicall`] picks the program by the name the binary was started as:
//!   `pepsi-settings` (the commands of `settings`), `pepsi-config` (those of
//!   `config`), or `pepsi-queue`.
//!
//! Every write is one stored-function call (one round trip, one NOTIFY on `workqueue`
//! when something changed), or for `config set|unset` one short transaction that
//! checks the resulting stage graph before it writes. Nothing here is async, and the
//! exit status is decided by the [`Failure`] a command returns.

pub mod args;
pub mod destinations;
pub mod effective;
#[cfg(test)]
mod effective_tests;
pub mod format;
pub mod horizon;
pub mod inject;
pub mod list;
pub mod metrics;
pub mod multicall;
pub mod overlay;
pub mod repair;
pub mod settings;
pub mod shape;
pub mod status;
pub mod tenants;
pub mod trace;

use std::collections::BTreeSet;
use std::io::{Read, Write};

use crate::db::Client;
use postgres::error::SqlState;

use crate::cli::{Globals, OsInvocation, Program};
use crate::config::graph::{self, OverrideRow};
use crate::config::raw::join_errors;
use crate::config::{Config, DbRole};
use crate::db::{self, ErrorKind, schema, sql};
use crate::exit::{self, Failure};

use args::{Command, Repair};

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-queue",
    synopsis: "COMMAND [ARGS]",
    about: "The Pepsi operator's tool. Commands (--json on status, list, show, shape, trace, the repair commands, destinations, config check and config show prints one JSON document):\n  \
            status                         rows per stage and status, ages, unknown stages, statistics\n  \
            list [--stage S] [--status X] [--sender KEY] [--limit N]\n                                 \
            one line per message, oldest first (like mailq)\n  \
            show ID [--headers] [--body]   a message's columns and state\n  \
            shape [--by recipient-domain|sender|stage] [--top N] [--stage S] [--status X]\n                                 \
            messages by age and key, the top N (20) keys (like qshape)\n  \
            trace ID | --message-id ID | --remote-id ID\n                                 \
            what became of a message: its stages, splits and each recipient's outcome\n  \
            inject --stage S --from A --to B [--to C ...] [FILE|-]\n  \
            inject --stage S -f A B [C ...]  read a message (sendmail style) and queue it\n         \
            [--auth-user L] [--client-ip IP] [--local] [--state JSON]\n  \
            resume ID... | resume [--stage S] [--status paused|failed|timeout] | resume --all\n  \
            hold ID...                     set messages aside (status held)\n  \
            release ID...                  held messages back to pending\n  \
            delete ID...                   delete messages\n  \
            requeue --stage S ID...        move messages to stage S as pending\n  \
            metrics [--output FILE]        Prometheus text format (FILE written atomically)\n  \
            destinations [--json] | destinations lift DEST [--json]\n                                 \
            relay-to-internet's destinations in trouble, suspended first; lift ends DEST's \
            suspension and forgets its failures\n  \
            config check [--json]          the checks of pepsi-dispatch check\n  \
            config show [--json]           the stage graph the dispatcher runs, each value with its origin\n  \
            config set SECTION KEY VALUE   write pepsi.config_override after checking the result\n  \
            config unset SECTION KEY       remove an overlay row after checking the result\n  \
            settings COMMAND [ARGS]        per-address settings: the commands of pepsi-settings\n\
            An id argument - reads ids from standard input. Running messages are never touched.\n\
            Exit status: 0 done; 64 usage; 65 bad data (an unknown id, a message without a header \
            block, a malformed address, an unknown stage, a destination to lift that is not in \
            trouble); 66 the message file cannot be read; 69 a \
            message in a status the command does not touch; 70 internal error; 73 the output file \
            cannot be written; 75 the database is unreachable or busy, try again; 77 the database \
            refused for lack of privileges; 78 configuration, schema, or a change the stage graph \
            refuses.",
};

/// What every command but `config check` works with.
pub struct Session {
    /// The configuration file, checked.
    pub config: Config,
    /// The connection.
    pub client: Client,
}

impl Session {
    /// Loads the configuration, switches to `RUN_AS` when started as root, connects
    /// with `role`'s connection (`ADMIN_CONNECTION`, or `INJECT_CONNECTION` for
    /// `inject`; each else `CONNECTION`) and checks the schema.
    pub fn open(globals: &Globals, role: DbRole) -> Result<Session, Failure> {
        let config = Config::load(globals.config.as_deref()).map_err(|errors| {
            Failure::config(format!("configuration error:\n{}", join_errors(&errors)))
        })?;
        for w in &config.warnings {
            log::warn!("{w}");
        }
        crate::privilege::drop_to(&config.pepsi.run_as).map_err(|f| Failure::config(f.message))?;
        let mut pg = db::connection_config(config.postgres.connection_for(role), PROGRAM.name)
            .map_err(|e| Failure::config(format!("{}: {e}", config.postgres.key_for(role))))?;
        db::append_options(&mut pg, sql::QUEUE_TIMEOUTS_OPTION);
        let mut client = db::open(&pg).map_err(|e| match e.kind {
            ErrorKind::Connection | ErrorKind::Overload | ErrorKind::Transient => {
                Failure::new(exit::EX_TEMPFAIL, e.message)
            }
            ErrorKind::Other => Failure::config(e.message),
        })?;
        match schema::check(&mut client) {
            Ok(()) => {}
            Err(schema::SchemaError::Mismatch(m)) => return Err(Failure::config(m.to_string())),
            Err(schema::SchemaError::Db(e)) => return Err(db_failure("checking the schema", &e)),
        }
        Ok(Session { config, client })
    }

    /// The stages that have a section: the file's `[stage-*]` sections with the
    /// overlay laid over them, as the dispatcher builds its graph (valid or not).
    pub fn configured_stages(&mut self) -> Result<BTreeSet<String>, Failure> {
        let overlay = db::read_overlay(&mut self.client)
            .map_err(|e| db_failure("reading pepsi.config_override", &e))?;
        Ok(configured_stages(&self.config, &overlay))
    }
}

/// The stage names with a section, file and overlay together.
pub fn configured_stages(config: &Config, overlay: &[OverrideRow]) -> BTreeSet<String> {
    config
        .lay_over(overlay)
        .sections
        .keys()
        .filter_map(|name| name.strip_prefix(graph::STAGE_PREFIX))
        .filter(|name| !name.is_empty())
        .map(str::to_string)
        .collect()
}

/// A database error as an exit: the connection broke, the server is overloaded or a
/// row stayed locked → 75 (try again); refused for privileges → 77; a value it refuses
/// → 65; anything else → 70.
/// `doing` says what was being done.
pub fn db_failure(doing: &str, e: &postgres::Error) -> Failure {
    let text = format!("database error while {doing}: {}", db::describe(e));
    let code = match db::classify(e) {
        ErrorKind::Connection | ErrorKind::Overload | ErrorKind::Transient => exit::EX_TEMPFAIL,
        ErrorKind::Other => match e.code() {
            Some(c) if c == &SqlState::LOCK_NOT_AVAILABLE || c == &SqlState::QUERY_CANCELED => {
                exit::EX_TEMPFAIL
            }
            Some(c) if c == &SqlState::INSUFFICIENT_PRIVILEGE => exit::EX_NOPERM,
            // A value the database refuses (class 22 data exception, class 23 integrity
            // constraint): the input was wrong.
            Some(c) if c.code().starts_with("22") || c.code().starts_with("23") => exit::EX_DATAERR,
            _ => exit::EX_SOFTWARE,
        },
    };
    Failure::new(code, text)
}

/// Writes a command's output to stdout in one piece. A reader that went away (`| head`)
/// is no error; any other write error is 74.
pub fn emit(bytes: &[u8]) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::new(
            exit::EX_IOERR,
            format!("cannot write to standard output: {e}"),
        )),
    }
}

/// A JSON document on one line of stdout.
pub fn emit_json(value: &serde_json::Value) -> Result<(), Failure> {
    let mut text = value.to_string();
    text.push('\n');
    emit(text.as_bytes())
}

/// The ids of an id argument `-`: standard input, whitespace-separated.
fn stdin_ids() -> Result<Vec<i64>, Failure> {
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text).map_err(|e| {
        Failure::new(
            exit::EX_DATAERR,
            format!("cannot read message ids from standard input: {e}"),
        )
    })?;
    args::ids_from_text(&text)
}

/// Runs `pepsi-queue`.
pub fn run(invocation: OsInvocation) -> Result<(), Failure> {
    let OsInvocation { globals, rest } = invocation;
    let from_stdin = if Command::reads_ids_from_stdin(&rest) {
        stdin_ids()?
    } else {
        Vec::new()
    };
    let command = args::parse(rest, &from_stdin)?;
    match command {
        // pepsi-settings: it opens its own session, after reading an import file.
        Command::Settings(rest) => settings::run(&globals, rest),
        // Exactly `pepsi-dispatch check`: it reports a file that does not even parse,
        // so it needs no session.
        Command::ConfigCheck { json } => {
            crate::check::check(globals.config.as_deref(), Vec::new(), json)
        }
        Command::Inject(what) => {
            // The message is read and checked before anything is connected: a message
            // refused leaves no trace.
            let prepared = inject::prepare(&what)?;
            Session::open(&globals, DbRole::Inject)
                .and_then(|mut session| inject::run(&mut session, prepared))
                .map_err(inject::for_the_sender)
        }
        command => {
            let mut session = Session::open(&globals, DbRole::Admin)?;
            match command {
                Command::Status { json } => status::run(&mut session, json),
                Command::List {
                    stage,
                    status,
                    sender,
                    limit,
                    json,
                } => list::list(
                    &mut session,
                    &list::Filter {
                        stage,
                        status,
                        sender,
                        limit,
                    },
                    json,
                ),
                Command::Show {
                    id,
                    headers,
                    body,
                    json,
                } => list::show(&mut session, id, headers, body, json),
                Command::Shape { options, json } => shape::run(&mut session, &options, json),
                Command::Trace { key, json } => trace::run(&mut session, &key, json),
                Command::Resume { what, json } => repair::resume(&mut session, what, json),
                Command::Repair { repair, ids, json } => {
                    let action = match repair {
                        Repair::Hold => repair::Action::Hold,
                        Repair::Release => repair::Action::Release,
                        Repair::Delete => repair::Action::Delete,
                    };
                    repair::by_ids(&mut session, action, &ids, json)
                }
                Command::Requeue { stage, ids, json } => {
                    repair::by_ids(&mut session, repair::Action::Requeue(stage), &ids, json)
                }
                Command::Metrics { output } => metrics::run(&mut session, output.as_deref()),
                Command::Destinations { json } => destinations::run(&mut session, json),
                Command::LiftDestination { destination, json } => {
                    destinations::lift(&mut session, &destination, json)
                }
                Command::ConfigShow { json } => effective::run(&mut session, json),
                Command::ConfigSet {
                    section,
                    key,
                    value,
                } => overlay::change(&mut session, &section, &key, Some(&value)),
                Command::ConfigUnset { section, key } => {
                    overlay::change(&mut session, &section, &key, None)
                }
                Command::ConfigCheck { .. } | Command::Inject(_) | Command::Settings(_) => {
                    unreachable!("handled above")
                }
            }
        }
    }
}
