//! `pepsi-setup [GLOBAL] schema`: installs or upgrades the database schema (SPEC §3).
//!
//! Started as root it switches to the `[pepsi] RUN_AS` account first, like every Pepsi
//! program (so a `CONNECTION` using peer authentication connects as that account, the
//! one that owns the schema), then connects with `[pepsi-postgres] CONNECTION` and
//! applies the missing files.

use crate::cli::{Invocation, Program};
use crate::config::Config;
use crate::db::{self, schema};
use crate::exit::Failure;

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-setup",
    synopsis: "schema",
    about: "Installs or upgrades the Pepsi database schema. Idempotent: a second run does nothing.\n\
            Refuses (exit 78) a schema that is newer than this release or built from other files.",
};

/// Runs `pepsi-setup`.
pub fn run(invocation: Invocation) -> Result<(), Failure> {
    invocation.expect_only(&PROGRAM, &["schema"])?;
    let config = Config::load_or_fail(invocation.globals.config.as_deref())?;
    crate::privilege::drop_to(&config.pepsi.run_as)?;
    let mut client = db::connect(&config.postgres.connection, "pepsi-setup")
        .map_err(|e| Failure::general(e.message))?;
    match schema::install(&mut client) {
        Ok(schema::Installed::Fresh(v)) => log::info!("schema installed at version {v}"),
        Ok(schema::Installed::Upgraded(a, b)) => {
            log::info!("schema upgraded from version {a} to {b}")
        }
        Ok(schema::Installed::UpToDate(v)) => log::info!("schema is up to date (version {v})"),
        Err(schema::SchemaError::Mismatch(m)) => return Err(Failure::config(m.to_string())),
        Err(e) => return Err(Failure::general(e.to_string())),
    }
    Ok(())
}
