//! `pepsi-settings [GLOBAL] COMMAND` (also `pepsi-queue settings COMMAND`): the
//! per-address settings of `pepsi.settings` (§12.5, §20) — list and read them, set and
//! unset one, export them all and import them back, every write checked first by the
//! rules the workers and `pepsi-dispatch check` apply to the rows they read.
//!
//! The files, one concern each:
//! - [`args`] checks the command line into an [`args::Command`] (pure);
//! - [`line`] is the one-setting-a-line format of `export` and `import` (pure);
//! - [`judge`] says what a setting must be: address, value, stage, key, and the
//!   address's settings laid over the stage's section (pure);
//! - [`import`] reads and checks an import file line by line;
//! - [`show`] is `list`, `get` and `export`; [`write`] is `set`, `unset` and `import`.
//!
//! This file opens the `pepsi-queue` [`Session`] (the configuration, `RUN_AS`,
//! `ADMIN_CONNECTION`, the schema check) and runs the command; an import file is read
//! and checked before, with the privileges the program was started with. Exit statuses
//! are `pepsi-queue`'s; it must not print anything itself.

pub mod args;
pub mod fairness;
pub mod import;
pub mod judge;
pub mod line;
pub mod show;
pub mod write;

use std::ffi::OsString;
use std::io::BufReader;

use crate::cli::{Globals, Program};
use crate::config::DbRole;
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, EX_NOINPUT, Failure};
use crate::queue::Session;
use crate::queue::args::Input;

use args::Command;

/// The program's description, under its own name.
pub const PROGRAM: Program = Program {
    name: "pepsi-settings",
    synopsis: "COMMAND [ARGS]",
    about: "Per-address settings of Pepsi's stages (pepsi.settings): the options of a stage that \
            a correspondent's messages run with, where the stage lets them be overridden. \
            Commands (--json on list and get prints one JSON document):\n  \
            list [ADDRESS] [--stage S]     one setting a line, ordered by address, stage and key\n  \
            get ADDRESS                    an address's settings, as the stage sections they are laid over\n  \
            set ADDRESS STAGE KEY VALUE    check the setting with the stage's own rules, then write it\n  \
            unset ADDRESS STAGE KEY        remove a setting\n  \
            export                         every setting, one a line: ADDRESS, STAGE, KEY, VALUE \
            separated by TABs, escaped (\\\\ \\t \\n \\r \\u{X})\n  \
            import [--replace] FILE|-      check every line, then write them all or nothing (merged \
            into the table; --replace makes the table exactly the file)\n  \
            weight PATTERN WEIGHT          a tenant's or sender's fair share, 0.01 to 100 (default \
            1); the dispatcher reads it at once\n  \
            weight --unset PATTERN         remove a weight\n  \
            rate PATTERN N/s|N/min|N/h     the most messages a second each tenant matching PATTERN \
            may start at each stage\n  \
            rate --unset PATTERN           remove a rate\n  \
            weights                        the weights and rates, one a line: PATTERN, WEIGHT, \
            RATE (- for none), when set\n  \
            tenant PATTERN NAME            senders whose key matches PATTERN (* any characters) \
            share one tenant, NAME\n  \
            tenant --unset PATTERN         those senders belong to their default tenants again\n  \
            tenants                        the named tenants, one a line: PATTERN, tenant:NAME, when set\n  \
            tenant-of SENDER_KEY           the tenant a sender key belongs to\n\
            A write applies from each address's next message; nothing restarts or reloads.\n\
            Exit status: 0 done; 64 usage; 65 bad data (a malformed address, a value longer than \
            8192 bytes, an import line that is no setting, a setting to unset that does not exist); \
            66 the import file cannot be read; 70 internal error; 74 standard output cannot be \
            written; 75 the database is unreachable or busy, try again; 77 the database refused for \
            lack of privileges; 78 configuration, schema, or a setting refused (a stage without a \
            section, a key the stage does not let an address override, a value its parser \
            refuses); nothing is written when a command fails.",
};

/// Reads and checks the settings of an import file before anything is connected;
/// the settings, and the name of the input for messages.
fn read_import(input: &Input) -> Result<(Vec<import::Line>, String), Failure> {
    let (read, name) = match input {
        Input::Stdin => (
            import::read(std::io::stdin().lock()),
            "standard input".to_string(),
        ),
        Input::File(path) => {
            let name = Visible(&path.to_string_lossy()).to_string();
            let file = std::fs::File::open(path)
                .map_err(|e| Failure::new(EX_NOINPUT, format!("cannot read {name}: {e}")))?;
            (import::read(BufReader::new(file)), name)
        }
    };
    let (lines, problems) =
        read.map_err(|e| Failure::new(EX_NOINPUT, format!("cannot read {name}: {e}")))?;
    if !problems.is_empty() {
        return Err(Failure::new(
            EX_DATAERR,
            format!(
                "import: {name} is refused; nothing changed:\n{}",
                problems.report()
            ),
        ));
    }
    Ok((lines, name))
}

/// Runs a `pepsi-settings` command; `rest` is the command line after the global
/// options.
pub fn run(globals: &Globals, rest: Vec<OsString>) -> Result<(), Failure> {
    let command = args::parse(rest)?;
    // Read with the privileges the program was started with, before the session
    // switches to RUN_AS: a file only root may read can be imported as root.
    let import = match &command {
        Command::Import { input, .. } => Some(read_import(input)?),
        _ => None,
    };
    // A setting's own data is checked before anything is connected, too.
    let command = match command {
        Command::Set(row) => Command::Set(write::checked(row)?),
        other => other,
    };
    let mut session = Session::open(globals, DbRole::Admin)?;
    match command {
        Command::List {
            address,
            stage,
            json,
        } => show::list(&mut session, address.as_deref(), stage.as_deref(), json),
        Command::Get { address, json } => show::get(&mut session, &address, json),
        Command::Export => show::export(&mut session),
        Command::Set(row) => write::set(&mut session, row),
        Command::Unset {
            address,
            stage,
            key,
        } => write::unset(&mut session, &address, &stage, &key),
        Command::Import { replace, .. } => {
            let (lines, name) = import.unwrap_or_default();
            write::import(&mut session, &lines, replace, &name)
        }
        Command::Weight { pattern, weight } => fairness::set_weight(&mut session, &pattern, weight),
        Command::Rate { pattern, rate } => fairness::set_rate(&mut session, &pattern, rate),
        Command::Tenant { pattern, name } => {
            fairness::set_tenant(&mut session, &pattern, name.as_deref())
        }
        Command::Fairness { tenants, json } => fairness::list(&mut session, tenants, json),
        Command::TenantOf { key } => fairness::tenant_of(&mut session, &key),
    }
}
