//! `pepsi-dispatch check` and the configuration checks the dispatcher shares with it
//! (§4 "Strictness").
//!
//! `check` runs every check without starting anything: the file (syntax, values,
//! unknown keys), the overlay read from the database (with `--overlay` rows laid over
//! it as if written), the stage graph and its cycles, every built-in stage's section
//! (with the same `configure` its worker runs), each `PROGRAM` executable by the
//! `[pepsi] RUN_AS` account, `[pepsi-failure-bouncer] BOUNCE_STAGE` naming a stage of
//! the graph, `[pepsi-ingress] STAGE` an entry stage of it, and the schema version — through the dispatcher's connection
//! (`DISPATCH_CONNECTION`, else `CONNECTION`), and through the workers' too when that
//! is another. It prints every problem, one a line, and exits 0 (warnings allowed) or
//! 78.
//!
//! It also lists the overlay rows the dispatcher leaves out ([`refused_rows`]: a
//! `PROGRAM` outside `[pepsi] PROGRAM_PATH` that the file does not name), as errors,
//! and the `pepsi.settings` rows the workers ignore (a key the stage does not let a
//! correspondent override), as warnings: the workers run without them, so they stop
//! nothing.
//!
//! The dispatcher calls [`at_start`] once its stage graph is built (a bad built-in
//! section is a start error, exit 1) and `reload.rs` calls [`log_refused_rows`],
//! [`builtin_errors`] and [`graph_warnings`] for a new graph. `pepsi-queue config
//! check` runs [`check`], and `pepsi-queue config set|unset` [`dispatchable_graph`]
//! before it writes the overlay.
//!
//! It lives beside the configuration it checks and on top of it: it uses the other
//! files of `config` (the fixed values it falls back to where the file is wrong come
//! from [`fixed`]'s table), the stages' own checks, the database, the failure
//! bouncer's, the ingress's and the keeper's rules, and [`account`] for what
//! the `RUN_AS` account may run; no other file of `config` uses it. It decides nothing about
//! messages and changes nothing: it reads the file and the database, and writes only
//! to stdout.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use crate::db::Client;

use crate::bouncer;
use crate::cli::{Invocation, Program};
use crate::config::graph::{self, OverrideRow, ProgramPath};
use crate::config::raw::{self, join_errors};
use crate::config::{Config, ConfigError, DbRole, Section, StageGraph, StageSection, fixed, keys};
use crate::db::{self, ErrorKind, schema};
use crate::exit::Failure;
use crate::ingress;
use crate::privilege::SERVICE_PATH;
use crate::stages;
use account::{Access, Account, program_runs};

mod account;
mod address_settings;
mod as_worker;
mod findings;

use findings::Findings;

/// The overlay rows laid over the file's stage sections would leave out (see
/// [`graph::LaidOver::refused`]): each an error naming the row, its value and why.
pub fn refused_rows(
    stage_sections: &[Section],
    programs: &ProgramPath,
    overlay: &[OverrideRow],
) -> Vec<ConfigError> {
    graph::lay_over(stage_sections, overlay, programs).refused
}

/// Logs the overlay rows the dispatcher leaves out, as errors: the stage graph is
/// built without them, so a stage may run a program other than the overlay says.
pub fn log_refused_rows(
    stage_sections: &[Section],
    programs: &ProgramPath,
    overlay: &[OverrideRow],
) {
    for e in refused_rows(stage_sections, programs, overlay) {
        log::error!("{e}; this overlay row is ignored");
    }
}

/// Warnings about the stage graph with its overlay: overlay rows that are ignored,
/// unknown keys of built-in stages' sections, and the cycles of `graph` when it is
/// valid.
pub fn graph_warnings(
    stage_sections: &[Section],
    programs: &ProgramPath,
    overlay: &[OverrideRow],
    graph: Option<&StageGraph>,
) -> Vec<ConfigError> {
    let laid = graph::lay_over(stage_sections, overlay, programs);
    let mut warnings = laid.warnings;
    warnings.extend(keys::unknown_keys(
        laid.sections.values(),
        stages::program_keys,
    ));
    warnings.extend(keys::ignored_keys(
        laid.sections.values(),
        stages::ignored_keys,
    ));
    if let Some(graph) = graph {
        warnings.extend(graph.cycle_warnings());
    }
    warnings
}

/// Every problem of the built-in stages' sections, each checked exactly as its worker
/// will check it.
pub fn builtin_errors(graph: &StageGraph) -> Vec<ConfigError> {
    stages::check_sections(graph.stages())
}

/// The stage graph the dispatcher would run with this file and overlay, checked as it
/// checks a new graph at a reload: the graph itself (§4), then every built-in stage's
/// section as its workers will check it. Every problem when the dispatcher would refuse
/// it (the rows it leaves out are not among them: see [`refused_rows`]).
/// `pepsi-queue config set|unset` runs this before it writes the overlay.
pub fn dispatchable_graph(
    stage_sections: &[Section],
    programs: &ProgramPath,
    overlay: &[OverrideRow],
) -> Result<StageGraph, Vec<ConfigError>> {
    let graph = StageGraph::build(stage_sections, overlay, programs)?;
    let errors = builtin_errors(&graph);
    if errors.is_empty() {
        Ok(graph)
    } else {
        Err(errors)
    }
}

/// The dispatcher's start-up check of a built stage graph: logs the warnings (and the
/// overlay rows left out, as errors), and refuses to start (exit 1, like every start
/// error) when a built-in stage's section is invalid — its workers would refuse to run
/// and its mail would stall.
pub fn at_start(
    config: &Config,
    overlay: &[OverrideRow],
    graph: &StageGraph,
) -> Result<(), Failure> {
    let programs = &config.pepsi.program_path;
    log_refused_rows(&config.stage_sections, programs, overlay);
    for w in graph_warnings(&config.stage_sections, programs, overlay, Some(graph)) {
        log::warn!("{w}");
    }
    let errors = builtin_errors(graph);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(Failure::general(format!(
            "invalid stage configuration:\n{}",
            join_errors(&errors)
        )))
    }
}

/// The `--overlay SECTION KEY VALUE` rows of a `check` command line; a usage error
/// shows `program`'s synopsis.
fn parse_arguments(program: &Program, rest: &[String]) -> Result<Vec<OverrideRow>, Failure> {
    let usage = |message: String| {
        Failure::usage(format!(
            "{message}\nusage: {} [GLOBAL OPTIONS] {}",
            program.name, program.synopsis
        ))
    };
    let mut rows = Vec::new();
    let mut args = rest.iter().skip(1);
    while let Some(arg) = args.next() {
        if arg != "--overlay" {
            return Err(usage(format!("unexpected argument {arg:?}")));
        }
        let mut value = || args.next().cloned();
        match (value(), value(), value()) {
            (Some(section), Some(key), Some(value)) => rows.push(OverrideRow {
                section,
                key,
                value,
            }),
            _ => {
                return Err(usage(
                    "--overlay needs SECTION KEY VALUE (an empty VALUE unsets the key)".into(),
                ));
            }
        }
    }
    Ok(rows)
}

/// Lays the command line's rows over the database's, as writing them would: a row for
/// the same section and key replaces the stored one.
fn with_rows(mut overlay: Vec<OverrideRow>, extra: Vec<OverrideRow>) -> Vec<OverrideRow> {
    for row in extra {
        overlay.retain(|r| !(r.section == row.section && r.key == row.key));
        overlay.push(row);
    }
    overlay
}

/// Runs `pepsi-dispatch check [--overlay SECTION KEY VALUE]…`; `program` is
/// `pepsi-dispatch`'s description, for a usage error.
pub fn run(program: &Program, invocation: Invocation) -> Result<(), Failure> {
    let extra = parse_arguments(program, &invocation.rest)?;
    check(invocation.globals.config.as_deref(), extra, false)
}

/// Runs every check on the configuration found from `explicit` (the search order of
/// §4), with `extra` overlay rows laid over the database's as if written; prints every
/// problem. `pepsi-dispatch check` and `pepsi-queue config check`.
pub fn check(explicit: Option<&Path>, extra: Vec<OverrideRow>, json: bool) -> Result<(), Failure> {
    let path = raw::search(explicit);
    let mut found = Findings::default();
    let sections = match raw::read_all(&path) {
        // Lines the parse could not take are reported; the checks below run on the rest.
        Ok(read) => {
            found.add_errors(read.errors);
            read.sections
        }
        Err(errors) => {
            // Without the file nothing else can be checked.
            found.add_errors(errors);
            return found.finish(&path, json);
        }
    };
    let config = Config::from_sections(path.clone(), sections.clone());
    match &config {
        Ok(c) => found.add_warnings(c.warnings.clone()),
        Err(errors) => {
            found.add_errors(errors.clone());
            found.add_warnings(keys::fixed_warnings(&sections));
        }
    }
    // The fixed values as the dispatcher would read them, the defaults where the file
    // is wrong (its errors are reported above): each key's text, else its default.
    let run_as = fixed::RUN_AS
        .text(&sections)
        .unwrap_or_default()
        .to_string();
    let worker_as = fixed::WORKER_AS
        .text(&sections)
        .unwrap_or_default()
        .to_string();
    let reserved = crate::keeper::Reserved {
        run_as: &run_as,
        worker_as: &worker_as,
    };
    // A PROGRAM_PATH in error (reported above) allows nothing, so that no overlay row
    // passes here that the dispatcher might refuse.
    let programs = match &config {
        Ok(c) => c.pepsi.program_path.clone(),
        Err(_) => ProgramPath::parse(fixed::PROGRAM_PATH.text(&sections).unwrap_or_default())
            .unwrap_or_else(|_| ProgramPath::none()),
    };
    // The dispatcher's connection and the workers' (each its own key, else
    // CONNECTION), as serve and the workers will connect.
    let connection = fixed::CONNECTION.text(&sections).unwrap_or_default();
    let own = |role: DbRole| match role.fixed_key().text(&sections) {
        Some(own) => (role.key(), own.to_string()),
        None => (fixed::CONNECTION.name, connection.to_string()),
    };
    let dispatch = own(DbRole::Dispatch);
    let worker = own(DbRole::Worker);
    let max_runtime = match &config {
        Ok(c) => Some(c.dispatch.max_runtime),
        Err(_) => None,
    };
    let stage_sections: Vec<Section> = sections
        .iter()
        .filter(|s| s.name.starts_with(graph::STAGE_PREFIX))
        .cloned()
        .collect();

    // Started as root, the dispatcher runs its workers as WORKER_AS and exec commands
    // as their stages' USER through its launcher; otherwise everything as its own
    // account (§4 "Containment").
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    let account = match Account::lookup(&run_as) {
        Ok(a) => Some(a),
        Err(e) => {
            found.errors.push(format!("[pepsi] RUN_AS: {e}"));
            None
        }
    };
    let workers_as = if as_root {
        match crate::privilege::worker_account(&run_as, &worker_as) {
            Ok(a) => a.and_then(|a| Account::lookup(&a.name).ok()),
            Err(e) => {
                found.errors.push(e);
                None
            }
        }
    } else {
        None
    };
    // Running as an account of their own without a connection of their own, the
    // workers log in as that account's role (see `PostgresOptions::worker_connection`).
    let worker = match (&workers_as, fixed::WORKER_CONNECTION.text(&sections)) {
        (Some(w), None) => (
            DbRole::Worker.key(),
            crate::conninfo::with_user(connection, &w.name),
        ),
        _ => worker,
    };
    // The workers' database checks, as the workers will connect: as WORKER_AS, in a
    // child that switches to it now, while this process is still root.
    let workers_database = |found: &mut Findings| {
        as_worker::worker_database(
            &worker,
            &stage_sections,
            &programs,
            &extra,
            max_runtime,
            found,
        );
    };
    let worker_findings = workers_as
        .as_ref()
        .map(|w| as_worker::in_account(&w.name, workers_database));
    // Started as root, check switches to RUN_AS as the dispatcher does, before it
    // connects: the database sees the account the dispatcher connects as (peer
    // authentication with the default CONNECTION), and the kernel answers the file
    // checks below for that account.
    let mut switched = false;
    if account.is_some() {
        match crate::privilege::drop_to(&run_as) {
            Ok(to) => switched = to.is_some(),
            Err(e) => found.errors.push(format!("[pepsi] RUN_AS: {}", e.message)),
        }
    }
    // The PATH a bare PROGRAM is looked up on: the dispatcher's own, or after its switch
    // to RUN_AS the service PATH it gives its workers (root's is not theirs).
    let program_path: OsString = if switched {
        SERVICE_PATH.into()
    } else {
        std::env::var_os("PATH").unwrap_or_default()
    };
    if let Some(account) = &account {
        if let Err(e) = account.may(&path, Access::Read) {
            found.errors.push(format!(
                "{}: cannot be read as RUN_AS {} ({e}); reloads read it as that account",
                path.display(),
                account.name
            ));
        }
    }
    // The workers' account must not read the file: its connection strings (with
    // their passwords) would reach a compromised stage program.
    if let Some(w) = &workers_as {
        if w.may(&path, Access::Read).is_ok() {
            found.warnings.push(format!(
                "{}: can be read by WORKER_AS {}: every connection string it holds reaches \
                 a compromised stage program (make it root:{} 0640)",
                path.display(),
                w.name,
                account
                    .as_ref()
                    .map_or(run_as.as_str(), |a| a.name.as_str())
            ));
        }
    }

    let (overlay, mut client) = read_database(&dispatch, &mut found);
    if let Some(c) = client.as_mut() {
        check_schemas(c, &mut found);
    }
    if let Some(theirs) = worker_findings {
        // The workers' database was checked as WORKER_AS, settings included.
        found.errors.extend(theirs.errors);
        found.unreachable += theirs.unreachable;
        found.warnings.extend(theirs.warnings);
        client = None;
    } else if worker.1 != dispatch.1 {
        // The workers connect as another role: they must reach the database, see the
        // schema and read the overlay too, or every stage would refuse to start. The
        // settings are the workers' to read: checked on their connection.
        workers_database(&mut found);
        client = None;
    }
    let overlay = with_rows(overlay, extra.clone());

    let graph = match StageGraph::build(&stage_sections, &overlay, &programs) {
        Ok(g) => Some(g),
        Err(errors) => {
            found.add_errors(errors);
            None
        }
    };
    found.add_warnings(graph_warnings(
        &stage_sections,
        &programs,
        &overlay,
        graph.as_ref(),
    ));
    // Every section that checks on its own is checked further, so a bad MATCH is
    // reported beside a dangling NEXT elsewhere.
    let laid = graph::lay_over(&stage_sections, &overlay, &programs);
    // A row the dispatcher leaves out is an error: the overlay says one thing and the
    // dispatcher runs another.
    found.add_errors(laid.refused.iter().cloned().map(|mut e| {
        e.message.push_str("; the dispatcher ignores this row");
        e
    }));
    let checked = checked_sections(&laid);
    let section_errors = stages::check_sections(&checked);
    // A USER its stage's own check refused (root, no account name) is reported once,
    // by that check, not again as an account that cannot run the command.
    let user_refused = |name: &str| {
        section_errors
            .iter()
            .any(|e| e.section.as_deref() == Some(name) && e.key.as_deref() == Some("USER"))
    };
    let user_refused: Vec<String> = checked
        .iter()
        .map(|s| s.section.name.clone())
        .filter(|name| user_refused(name))
        .collect();
    found.add_errors(section_errors);
    // The failure bouncer's target must be a stage of this graph, or the messages it
    // moves would never be claimed.
    let bounce_stage = sections
        .iter()
        .find(|s| s.name == bouncer::SECTION)
        .and_then(|s| s.value(bouncer::KEY));
    if let Some(value) = bounce_stage {
        found.add_errors(bouncer::bounce_stage_error(
            &value.text,
            &value.origin,
            &laid.sections,
        ));
    }
    // pepsi-ingress queues its mail at [pepsi-ingress] STAGE: an entry stage of this
    // graph, or it refuses to start. Its other values were checked with the file.
    if let (Ok(config), Some(graph)) = (&config, &graph) {
        if let Some((stage, origin)) = &config.ingress.stage {
            if let Some(problem) = ingress::stage_problem(config, graph, stage) {
                found.add_errors([ConfigError::at(origin.clone(), problem)]);
            }
        }
    }
    // Its certificate and key, read here as the account running the check: a pair that
    // does not read keeps pepsi-ingress from starting (and a SIGHUP from renewing it).
    if let Ok(config) = &config {
        let section = sections.iter().find(|s| s.name == "pepsi-ingress");
        if let (Some((cert, key)), Some(section)) = (&config.ingress.tls, section) {
            if let Err(e) = crate::tls::server_config(cert, key) {
                found.add_errors([section.error("TLS_CERT", e)]);
            }
        }
    }
    // The workers' account starts the programs: WORKER_AS when it is one of its own.
    let runner = workers_as.as_ref().or(account.as_ref());
    let runner_who = match (&workers_as, &account) {
        (Some(w), _) => format!("WORKER_AS {}", w.name),
        (None, Some(a)) => format!("RUN_AS {}", a.name),
        (None, None) => String::new(),
    };
    for stage in &checked {
        if let Err(e) = program_runs(&stage.program, runner, &runner_who, &program_path) {
            found.add_errors([stage.section.error("PROGRAM", e)]);
        }
        // The time a stage allows itself on one message, against MAX_RUNTIME: its own
        // rule, declared with it.
        if let (Some(builtin), Some(limit)) = (stages::for_program(&stage.program), max_runtime) {
            found.add_warnings(builtin.runtime_warning(&stage.section, limit));
        }
        // The files the stage's workers read at start (keys, secrets), read here as
        // the account running the check: a problem would keep every worker from starting.
        if let Some(builtin) = stages::for_program(&stage.program) {
            found.add_errors(builtin.file_errors(&stage.section));
        }
        if let Some(command) = stage
            .section
            .get("COMMAND")
            .filter(|_| !user_refused.contains(&stage.section.name))
        {
            let user = stage.section.get("USER");
            match crate::keeper::command_account(user, reserved, as_root) {
                Err(e) => found.add_errors([stage.section.error("USER", e)]),
                // The command as its account will start it, on the PATH commands get.
                Ok(runner) => {
                    let (runner, who) = match runner {
                        Some(name) => (Account::lookup(&name).ok(), format!("USER {name}")),
                        None => (None, String::new()),
                    };
                    if let Some(program) = command.split_whitespace().next() {
                        if let Err(e) =
                            program_runs(program, runner.as_ref(), &who, OsStr::new(SERVICE_PATH))
                        {
                            found.add_errors([stage.section.error("COMMAND", e)]);
                        }
                    }
                }
            }
        }
    }
    if let Some(mut client) = client {
        address_settings::check_settings(
            &mut client,
            &laid.sections,
            &checked,
            graph.as_ref(),
            max_runtime,
            &mut found,
        );
    }
    found.finish(&path, json)
}

/// The stage sections of `laid` that pass their common check, as the dispatcher runs
/// them (a section that fails it is reported by the graph's own check).
fn checked_sections(laid: &graph::LaidOver) -> Vec<StageSection> {
    laid.sections
        .values()
        .filter(|s| s.name.len() > graph::STAGE_PREFIX.len())
        .filter_map(|s| StageSection::check(s).ok())
        .collect()
}

/// Reports every schema a Pepsi session resolves names through in which a Pepsi role
/// (a group role, or the session's own login) other than the schema's owner may create
/// objects (§4 "Containment"): an operator or function planted there would run in
/// other roles' sessions. Each is an error with the statement that closes it.
fn check_schemas(client: &mut Client, found: &mut Findings) {
    let roles: Vec<&str> = DbRole::ALL.iter().map(|r| r.group_role()).collect();
    match client.query(db::sql::CREATABLE_SCHEMAS, &[&roles]) {
        Ok(rows) => {
            for row in rows {
                let (schema, role): (String, String) = (row.get(0), row.get(1));
                let text = format!(
                    "database: role {role} may create objects in schema {schema}, which \
                     sessions resolve names through (an operator or function planted \
                     there would run in other roles' sessions); run REVOKE CREATE ON \
                     SCHEMA {schema} FROM {} as its owner or a superuser",
                    if schema == "public" { "PUBLIC" } else { &role }
                );
                if !found.errors.contains(&text) {
                    found.errors.push(text);
                }
            }
        }
        Err(e) => found.errors.push(format!(
            "database: cannot check who may create in the schemas sessions use: {}",
            db::describe(&e)
        )),
    }
}

/// Connects with `(key, conninfo)`, checks the schema and reads the overlay; a problem
/// is an error and leaves the overlay empty (the file alone is checked). Errors say
/// `database:`, or `database (KEY):` for a program's own connection key. The
/// connection, when the schema is this release's, for the checks that need the stage
/// graph first.
fn read_database(
    (key, connection): &(&str, String),
    found: &mut Findings,
) -> (Vec<OverrideRow>, Option<Client>) {
    let label = if *key == fixed::CONNECTION.name {
        "database".to_string()
    } else {
        format!("database ({key})")
    };
    if connection.parse::<postgres::Config>().is_err() {
        found.errors.push(format!(
            "{label}: not checked, [pepsi-postgres] {key} is invalid"
        ));
        return (Vec::new(), None);
    }
    let mut client = match db::connect(connection, "pepsi-dispatch check") {
        Ok(c) => c,
        Err(e) => {
            let error = format!(
                "{label}: {e}; the schema, pepsi.config_override and pepsi.settings are not checked"
            );
            match e.kind {
                ErrorKind::Connection | ErrorKind::Overload => found.unreachable(error),
                _ => found.errors.push(error),
            }
            return (Vec::new(), None);
        }
    };
    // Only a schema of this release has the tables as this program reads them.
    let schema_ok = match schema::check(&mut client) {
        Ok(()) => true,
        Err(schema::SchemaError::Mismatch(m)) => {
            found.errors.push(format!("{label}: {m}"));
            false
        }
        Err(schema::SchemaError::Db(e)) => {
            found.database_error(format!("{label}: cannot check the schema"), &e);
            return (Vec::new(), None);
        }
    };
    let overlay = match db::read_overlay(&mut client) {
        Ok(rows) => rows,
        Err(e) => {
            found.database_error(format!("{label}: cannot read pepsi.config_override"), &e);
            Vec::new()
        }
    };
    (overlay, schema_ok.then_some(client))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Program = Program {
        name: "pepsi-dispatch",
        synopsis: "check [--overlay SECTION KEY VALUE]",
        about: "",
    };

    #[test]
    fn overlay_arguments_replace_stored_rows_and_may_unset() {
        let args: Vec<String> = ["check", "--overlay", "stage-x", "MATCH", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let extra = parse_arguments(&P, &args).unwrap();
        let stored = vec![OverrideRow {
            section: "stage-x".into(),
            key: "MATCH".into(),
            value: "sender is a".into(),
        }];
        let rows = with_rows(stored, extra);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].value, "");
        let short: Vec<String> = ["check", "--overlay", "stage-x", "MATCH"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(parse_arguments(&P, &short).unwrap_err().code, 64);
        let other: Vec<String> = ["check", "--now"].iter().map(|s| s.to_string()).collect();
        assert_eq!(parse_arguments(&P, &other).unwrap_err().code, 64);
    }
}
