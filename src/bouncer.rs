//! `pepsi-failure-bouncer [GLOBAL] serve | sweep [--failed-only | --timeout-only]`
//! (§13.1): moves rows that ended `failed` or `timeout` to `[pepsi-failure-bouncer]
//! BOUNCE_STAGE` as `pending`, so that the dispatcher runs the bounce stage and the
//! sender hears what became of the message.
//!
//! It is not a stage and speaks no worker protocol. It owns one connection of its own
//! (`application_name` `pepsi-failure-bouncer`) and writes the queue only through one
//! stored-function call per batch ([`sql::BOUNCE_FAILED`]), which locks the rows it
//! moves (two bouncers never move a row twice), leaves rows already at the bounce stage
//! alone and notifies `workqueue` once per call. `sweep` moves everything stuck and
//! exits. `serve` LISTENs on `workqueue_failed` and sweeps at start, at every
//! notification, once a minute as a safety net and after every reconnect (notifications
//! sent while it was away are lost); it rides out database outages and stops on SIGINT
//! or SIGTERM once the call in progress has finished (`bouncer/service.rs`). One thread,
//! no async runtime.
//!
//! Called by `src/bin/pepsi-failure-bouncer.rs`; `pepsi-dispatch check` borrows
//! [`bounce_stage_error`]. This file decides nothing about a message beyond "failed
//! here, so to the bounce stage": what the bounce stage does with it is
//! `pepsi-stage-bounce`'s business.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::db::Client;
use postgres::types::Type;

use crate::cli::{Invocation, Program};
use crate::config::graph::{self, ProgramPath, STAGE_PREFIX};
use crate::config::{Config, ConfigError, DbRole, Origin, Section};
use crate::db::{self, ErrorKind, schema, sql};
use crate::escape::Visible;
use crate::exit::Failure;

mod service;
use service::Service;

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-failure-bouncer",
    synopsis: "serve | sweep [--failed-only | --timeout-only]",
    about: "Moves messages that ended failed or timeout to the stage [pepsi-failure-bouncer] BOUNCE_STAGE \
            (pending), so the dispatcher runs the bounce stage and the sender hears about it. A message \
            already at the bounce stage is left alone.\n\
            serve: runs until SIGINT or SIGTERM: moves each message as it fails (LISTEN workqueue_failed), \
            and everything already stuck at start, after every reconnect and once a minute; rides out \
            database outages.\n\
            sweep: moves everything stuck once and exits (an operator run, a cron job).\n\
            --failed-only / --timeout-only (after the subcommand) restrict either to one of the two states.\n\
            Exit status: 0 done (or stopped by a signal), 1 an error (configuration file, RUN_AS, a database \
            that cannot be reached by sweep or refuses at start), 64 a usage error, 78 BOUNCE_STAGE unset or \
            naming no [stage-*] section, or a schema mismatch.",
};

/// The configuration section the bouncer reads.
pub const SECTION: &str = "pepsi-failure-bouncer";
/// The one key of [`SECTION`].
pub const KEY: &str = "BOUNCE_STAGE";

/// Rows moved per call at most: one call is one short transaction, so a backlog of
/// thousands never holds thousands of row locks (nor a SIGTERM) for long.
pub const BATCH: i32 = 500;

/// The subcommand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Run until a signal, moving rows as they fail.
    Serve,
    /// Move everything stuck once and exit.
    Sweep,
}

/// Which terminal states a run bounces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Both `failed` and `timeout` (the default).
    All,
    /// `--failed-only`.
    FailedOnly,
    /// `--timeout-only`.
    TimeoutOnly,
}

impl Scope {
    /// The statuses handed to the move, as `pepsi.workqueue_status` labels.
    pub fn statuses(self) -> &'static [&'static str] {
        match self {
            Scope::All => &["failed", "timeout"],
            Scope::FailedOnly => &["failed"],
            Scope::TimeoutOnly => &["timeout"],
        }
    }

    /// In words, for the log.
    fn describe(self) -> &'static str {
        match self {
            Scope::All => "failed and timed-out",
            Scope::FailedOnly => "failed (not timed-out)",
            Scope::TimeoutOnly => "timed-out (not failed)",
        }
    }
}

/// The bouncer's own part of the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Args {
    /// `serve` or `sweep`.
    pub command: Command,
    /// `--failed-only`, `--timeout-only` or neither.
    pub scope: Scope,
}

/// Reads `serve|sweep [--failed-only|--timeout-only]` (the global options are already
/// taken off); anything else is a usage error (exit 64).
pub fn parse_arguments(rest: &[String]) -> Result<Args, Failure> {
    let usage = |message: &str| {
        Failure::usage(format!(
            "{message}\nusage: {} [GLOBAL OPTIONS] {}",
            PROGRAM.name, PROGRAM.synopsis
        ))
    };
    let command = match rest.first().map(String::as_str) {
        Some("serve") => Command::Serve,
        Some("sweep") => Command::Sweep,
        Some(other) => {
            return Err(usage(&format!(
                "unknown subcommand {other:?} (serve or sweep)"
            )));
        }
        None => return Err(usage("missing subcommand (serve or sweep)")),
    };
    let mut scope = Scope::All;
    for arg in &rest[1..] {
        let wanted = match arg.as_str() {
            "--failed-only" => Scope::FailedOnly,
            "--timeout-only" => Scope::TimeoutOnly,
            other => return Err(usage(&format!("unexpected argument {other:?}"))),
        };
        if scope != Scope::All && scope != wanted {
            return Err(usage(
                "--failed-only and --timeout-only exclude each other (give neither to bounce both)",
            ));
        }
        scope = wanted;
    }
    Ok(Args { command, scope })
}

/// The problem with `BOUNCE_STAGE` = `stage` (set at `origin`) in a stage graph whose
/// `[stage-*]` sections, the overlay laid over the file's, are `sections`: none when
/// it names one of them; otherwise an error naming the key's file and line and the
/// stage, since rows moved to a stage without a section are never claimed.
pub fn bounce_stage_error(
    stage: &str,
    origin: &Origin,
    sections: &BTreeMap<String, Section>,
) -> Option<ConfigError> {
    let has = |name: &str| sections.contains_key(&format!("{STAGE_PREFIX}{name}"));
    if !stage.is_empty() && has(stage) {
        return None;
    }
    let mut message = format!(
        "names stage {stage:?}, which has no [stage-{stage}] section (in the file or \
         pepsi.config_override): failed messages moved there would never be claimed"
    );
    // The section's name where the stage's name belongs is an easy slip.
    if let Some(bare) = stage.strip_prefix(STAGE_PREFIX).filter(|b| has(b)) {
        message.push_str(&format!("; did you mean {bare}?"));
    }
    Some(ConfigError {
        origin: origin.clone(),
        section: Some(SECTION.to_string()),
        key: Some(KEY.to_string()),
        message,
    })
}

/// One row a move took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    /// Its `workqueue_id`.
    pub id: i64,
    /// The stage it failed at (where it was).
    pub stage: String,
    /// The status it had: `failed` or `timeout`.
    pub status: String,
}

/// What a sweep moved, by the status the rows had.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Rows that were `failed`.
    pub failed: u64,
    /// Rows that were `timeout`.
    pub timeout: u64,
}

impl Totals {
    /// Every row moved.
    pub fn moved(&self) -> u64 {
        self.failed + self.timeout
    }

    fn add(&mut self, row: &Moved) {
        if row.status == "timeout" {
            self.timeout += 1;
        } else {
            self.failed += 1;
        }
    }

    /// One line for the log.
    fn summary(&self, bounce_stage: &str) -> String {
        if self.moved() == 0 {
            return format!("nothing to move to bounce stage {bounce_stage}");
        }
        format!(
            "moved {} message{} to bounce stage {bounce_stage} ({} failed, {} timeout)",
            self.moved(),
            if self.moved() == 1 { "" } else { "s" },
            self.failed,
            self.timeout
        )
    }
}

/// One call of the move, one round trip: up to `limit` rows of `scope` not at
/// `bounce_stage` go there as pending, oldest first, with one NOTIFY on `workqueue`
/// when any moved. A transient serialization failure or deadlock is re-run.
pub fn move_batch(
    client: &mut Client,
    bounce_stage: &str,
    scope: Scope,
    limit: i32,
) -> Result<Vec<Moved>, postgres::Error> {
    let statuses = scope.statuses();
    let rows = db::retry_transient(|| {
        client.query_typed(
            sql::BOUNCE_FAILED,
            &[
                (&bounce_stage, Type::TEXT),
                (&statuses, Type::TEXT_ARRAY),
                (&limit, Type::INT4),
            ],
        )
    })?;
    Ok(rows
        .iter()
        .map(|r| Moved {
            id: r.get(0),
            stage: r.get(1),
            status: r.get(2),
        })
        .collect())
}

/// Moves every row of `scope` to `bounce_stage`, one [`BATCH`] per call, until a call
/// moves fewer than a batch (or `stop` is set: the call in progress is finished, no
/// other is started). Logs each moved row and adds it to `totals`, so that what was
/// moved before an error is still told.
pub fn sweep(
    client: &mut Client,
    bounce_stage: &str,
    scope: Scope,
    stop: &AtomicBool,
    totals: &mut Totals,
) -> Result<(), postgres::Error> {
    loop {
        let moved = move_batch(client, bounce_stage, scope, BATCH)?;
        for row in &moved {
            // The stage is the row's own: any text a writer of the queue put there.
            log::info!(
                "message {} (failed at stage {}, {}) moved to bounce stage {}",
                row.id,
                Visible(&row.stage),
                row.status,
                Visible(bounce_stage)
            );
            totals.add(row);
        }
        // Fewer than a batch: nothing was left when the call ran. (A concurrent
        // bouncer can make a call come short while rows remain; that one carries on.)
        if moved.len() < BATCH as usize || stop.load(Ordering::Relaxed) {
            return Ok(());
        }
    }
}

/// Why a session could not be set up.
enum Trouble {
    /// The database is away or refuses for now: `serve` waits and tries again, `sweep`
    /// exits 1.
    Away(String),
    /// Something waiting does not fix: stop with this failure.
    Fatal(Failure),
}

impl Trouble {
    /// A statement's failure: the connection's (`Away`) or its own (`Fatal`, exit 1).
    fn from_db(what: &str, e: &postgres::Error) -> Trouble {
        let text = format!("{what}: {}", db::describe(e));
        match db::classify(e) {
            ErrorKind::Connection | ErrorKind::Overload => Trouble::Away(text),
            _ => Trouble::Fatal(Failure::general(text)),
        }
    }

    /// As a failure of `sweep`: the database's absence is an error too.
    fn into_failure(self) -> Failure {
        match self {
            Trouble::Away(message) => Failure::general(message),
            Trouble::Fatal(failure) => failure,
        }
    }
}

/// `BOUNCE_STAGE`, which the bouncer cannot run without (exit 78).
fn required_stage(config: &Config) -> Result<(String, Origin), Failure> {
    match (&config.bouncer.bounce_stage, &config.bouncer.origin) {
        (Some(stage), Some(origin)) => Ok((stage.clone(), origin.clone())),
        (Some(stage), None) => Ok((stage.clone(), Origin::Default)),
        (None, _) => Err(Failure::config(format!(
            "{}: [{SECTION}] {KEY} is required but not set: it names the [stage-NAME] section \
             failed messages are moved to",
            config.path.display()
        ))),
    }
}

/// What a run needs to know, read once at start.
struct Target {
    /// `[pepsi-postgres] ADMIN_CONNECTION`, else `CONNECTION`.
    conninfo: String,
    /// The key it comes from, for messages.
    conninfo_key: String,
    /// `BOUNCE_STAGE`.
    stage: String,
    /// Where `BOUNCE_STAGE` is set.
    origin: Origin,
    /// The file's `[stage-*]` sections, for the check against the graph.
    stage_sections: Vec<Section>,
    /// The file's `[pepsi] PROGRAM_PATH`, under which the overlay is laid over them.
    programs: ProgramPath,
}

impl Target {
    /// Connects (with the bouncer's name and bounds) and checks the schema: a mismatch
    /// exits 78 (§3).
    fn open(&self) -> Result<Client, Trouble> {
        let mut pg = db::connection_config(&self.conninfo, PROGRAM.name).map_err(|e| {
            Trouble::Fatal(Failure::general(format!(
                "{}: {}",
                self.conninfo_key,
                db::describe(&e)
            )))
        })?;
        db::append_options(&mut pg, sql::BOUNCER_TIMEOUTS_OPTION);
        let mut client = db::open(&pg).map_err(|e| match e.kind {
            ErrorKind::Connection | ErrorKind::Overload => Trouble::Away(e.message),
            _ => Trouble::Fatal(Failure::general(e.message)),
        })?;
        match schema::check(&mut client) {
            Ok(()) => Ok(client),
            Err(schema::SchemaError::Mismatch(m)) => Err(Trouble::Fatal(Failure::config(format!(
                "refusing to run: {m}"
            )))),
            Err(schema::SchemaError::Db(e)) => Err(Trouble::from_db("cannot check the schema", &e)),
        }
    }

    /// Checks that `BOUNCE_STAGE` names a `[stage-*]` section of the stage graph (the
    /// file's sections with `pepsi.config_override` laid over them): exit 78 otherwise.
    fn check_stage(&self, client: &mut Client) -> Result<(), Trouble> {
        let overlay = db::read_overlay(client)
            .map_err(|e| Trouble::from_db("cannot read pepsi.config_override", &e))?;
        let laid = graph::lay_over(&self.stage_sections, &overlay, &self.programs);
        match bounce_stage_error(&self.stage, &self.origin, &laid.sections) {
            None => Ok(()),
            Some(e) => Err(Trouble::Fatal(Failure::config(format!(
                "refusing to run: {e}"
            )))),
        }
    }
}

/// Runs `pepsi-failure-bouncer`.
pub fn run(invocation: Invocation) -> Result<(), Failure> {
    let args = parse_arguments(&invocation.rest)?;
    let config = Config::load_or_fail(invocation.globals.config.as_deref())?;
    let (stage, origin) = required_stage(&config)?;
    // Before any connection: a CONNECTION using peer authentication connects as the
    // service account, not as root.
    crate::privilege::drop_to(&config.pepsi.run_as)?;
    let target = Target {
        conninfo: config.postgres.connection_for(DbRole::Admin).to_string(),
        conninfo_key: config.postgres.key_for(DbRole::Admin),
        stage,
        origin,
        stage_sections: config.stage_sections.clone(),
        programs: config.pepsi.program_path.clone(),
    };
    match args.command {
        Command::Sweep => sweep_once(&target, args.scope),
        Command::Serve => {
            // Before the first connection attempt, so a signal also ends the wait for
            // a database that is away.
            let stop = crate::signals::stop_flag()?;
            let hup = crate::signals::hup_flag()?;
            Service::new(target, args.scope, stop, hup).serve()
        }
    }
}

/// `sweep`: connect, check, move everything, say how much; exit 0.
fn sweep_once(target: &Target, scope: Scope) -> Result<(), Failure> {
    let mut client = target.open().map_err(Trouble::into_failure)?;
    target
        .check_stage(&mut client)
        .map_err(Trouble::into_failure)?;
    let mut totals = Totals::default();
    // Nothing sets it: a signal ends a sweep the default way, and the call it kills is
    // rolled back whole.
    let never = AtomicBool::new(false);
    sweep(&mut client, &target.stage, scope, &never, &mut totals).map_err(|e| {
        Failure::general(format!(
            "cannot move {} messages to bounce stage {}: {} ({} moved before the error)",
            scope.describe(),
            target.stage,
            db::describe(&e),
            totals.moved()
        ))
    })?;
    log::info!("sweep done: {}", totals.summary(&target.stage));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Result<Args, Failure> {
        parse_arguments(&words.iter().map(|w| w.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn subcommands_and_scopes_are_read() {
        assert_eq!(
            args(&["serve"]).unwrap(),
            Args {
                command: Command::Serve,
                scope: Scope::All
            }
        );
        assert_eq!(
            args(&["sweep", "--timeout-only"]).unwrap(),
            Args {
                command: Command::Sweep,
                scope: Scope::TimeoutOnly
            }
        );
        assert_eq!(
            args(&["serve", "--failed-only", "--failed-only"])
                .unwrap()
                .scope,
            Scope::FailedOnly
        );
        assert_eq!(Scope::All.statuses(), ["failed", "timeout"]);
        assert_eq!(Scope::FailedOnly.statuses(), ["failed"]);
        assert_eq!(Scope::TimeoutOnly.statuses(), ["timeout"]);
    }

    #[test]
    fn bad_arguments_are_usage_errors_that_say_what_is_wrong() {
        for (words, says) in [
            (&[][..], "missing subcommand"),
            (&["bounce"][..], "unknown subcommand \"bounce\""),
            (&["--failed-only", "sweep"][..], "unknown subcommand"),
            (&["sweep", "--once"][..], "unexpected argument \"--once\""),
            (
                &["sweep", "--failed-only", "--timeout-only"][..],
                "exclude each other",
            ),
        ] {
            let err = args(words).unwrap_err();
            assert_eq!(err.code, crate::exit::EX_USAGE, "{words:?}");
            assert!(err.message.contains(says), "{words:?}: {}", err.message);
            assert!(err.message.contains("usage: pepsi-failure-bouncer"));
        }
    }

    #[test]
    fn a_bounce_stage_without_a_section_is_named_with_its_origin() {
        let origin = Origin::File {
            path: std::path::Path::new("/etc/pepsi/pepsi.conf").into(),
            line: 12,
        };
        let mut sections = BTreeMap::new();
        sections.insert(
            "stage-bounce".to_string(),
            Section::new("stage-bounce", Origin::Override),
        );
        assert_eq!(bounce_stage_error("bounce", &origin, &sections), None);
        let e = bounce_stage_error("bounces", &origin, &sections).unwrap();
        assert!(
            e.to_string().starts_with(
                "/etc/pepsi/pepsi.conf:12: [pepsi-failure-bouncer] BOUNCE_STAGE: names stage \"bounces\", which has no [stage-bounces] section"
            ),
            "{e}"
        );
        let e = bounce_stage_error("stage-bounce", &origin, &sections).unwrap();
        assert!(e.to_string().ends_with("did you mean bounce?"), "{e}");
    }

    #[test]
    fn totals_count_by_status_and_say_so() {
        let mut t = Totals::default();
        assert_eq!(t.summary("b"), "nothing to move to bounce stage b");
        for status in ["failed", "timeout", "failed"] {
            t.add(&Moved {
                id: 1,
                stage: "a".into(),
                status: status.into(),
            });
        }
        assert_eq!(
            t.summary("b"),
            "moved 3 messages to bounce stage b (2 failed, 1 timeout)"
        );
    }
}
