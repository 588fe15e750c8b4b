//! `pepsi-setup [GLOBAL] schema`: installs or upgrades the database schema (SPEC §3).
//!
//! Connects with `[pepsi-postgres] CONNECTION` as the invoking user (setup is an
//! administrator's task, so no privilege drop), then applies the missing files.

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
    let mut client = db::connect(&config.postgres.connection, "pepsi-setup").map_err(|e| {
        Failure::general(format!(
            "cannot connect to the database: {}",
            db::describe(&e)
        ))
    })?;
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
