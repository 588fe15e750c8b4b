//! The names the `pepsi-queue` binary answers to (§20): as `pepsi-settings` it runs the
//! commands of `pepsi-queue settings`, as `pepsi-config` those of `pepsi-queue config`,
//! under any other name it is `pepsi-queue`. The package installs the other names as
//! links to `/usr/bin/pepsi-queue` ([`LINKS`]), so they add no program to it.
//!
//! Owns the choice by `argv[0]` and what each name says of itself (`--help`, `-V`, the
//! usage line of a usage error); the commands are `queue`'s and `queue::settings`'s.
//! Called by `src/bin/pepsi-queue.rs` only.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use crate::cli::{OsInvocation, Program};
use crate::exit::{EX_USAGE, Failure};
use crate::queue::settings;

/// The per-address settings tool.
pub const SETTINGS: &str = "pepsi-settings";

/// The configuration tool.
pub const CONFIG: &str = "pepsi-config";

/// The names installed as links to `pepsi-queue`.
pub const LINKS: &[&str] = &[SETTINGS, CONFIG];

/// `pepsi-config`'s description: the commands of `pepsi-queue config`.
pub const CONFIG_PROGRAM: Program = Program {
    name: CONFIG,
    synopsis: "COMMAND [ARGS]",
    about: "Shows and checks the Pepsi configuration and changes the stage overlay in the database \
            (pepsi.config_override); the commands of pepsi-queue config. Commands:\n  \
            show [--json]                  the stage graph the dispatcher runs, each value with where it comes from\n  \
            check [--json]                 the checks of pepsi-dispatch check\n  \
            set SECTION KEY VALUE          write an overlay row after checking the resulting stage graph\n  \
            unset SECTION KEY              remove an overlay row after checking the result\n\
            Exit status: 0 done; 64 usage; 65 an overlay row to unset that does not exist; 70 \
            internal error; 75 the database is unreachable or busy, try again; 77 the database \
            refused for lack of privileges; 78 configuration, schema, errors found by check, or a \
            change the stage graph refuses.",
};

/// What the binary was started as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Name {
    /// `pepsi-queue` (and any name not below).
    Queue,
    /// `pepsi-settings`.
    Settings,
    /// `pepsi-config`.
    Config,
}

impl Name {
    /// The description the program gives under this name.
    pub fn program(self) -> &'static Program {
        match self {
            Name::Queue => &super::PROGRAM,
            Name::Settings => &settings::PROGRAM,
            Name::Config => &CONFIG_PROGRAM,
        }
    }
}

/// The name `argv[0]` gives: its file name, whatever directory it was started from.
pub fn invoked_as(argv0: &OsStr) -> Name {
    match Path::new(argv0).file_name().and_then(OsStr::to_str) {
        Some(SETTINGS) => Name::Settings,
        Some(CONFIG) => Name::Config,
        _ => Name::Queue,
    }
}

/// A usage error of `pepsi-queue`'s commands with the usage line of `program`, the
/// name the user typed.
fn renamed(failure: Failure, program: &Program) -> Failure {
    let queue = &super::PROGRAM;
    let theirs = format!(
        "\nusage: {} [GLOBAL OPTIONS] {}",
        queue.name, queue.synopsis
    );
    match failure.message.strip_suffix(&theirs) {
        Some(message) if failure.code == EX_USAGE => Failure::usage(format!(
            "{message}\nusage: {} [GLOBAL OPTIONS] {}",
            program.name, program.synopsis
        )),
        _ => failure,
    }
}

/// Runs the program under `name`.
pub fn run(name: Name, invocation: OsInvocation) -> Result<(), Failure> {
    match name {
        Name::Queue => super::run(invocation),
        Name::Settings => settings::run(&invocation.globals, invocation.rest)
            .map_err(|f| renamed(f, name.program())),
        Name::Config => {
            let OsInvocation { globals, rest } = invocation;
            let rest = std::iter::once(OsString::from("config"))
                .chain(rest)
                .collect();
            super::run(OsInvocation { globals, rest }).map_err(|f| renamed(f, name.program()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_is_argv0s_file_name() {
        for (argv0, name) in [
            ("pepsi-settings", Name::Settings),
            ("/usr/bin/pepsi-settings", Name::Settings),
            ("./pepsi-config", Name::Config),
            ("/usr/bin/pepsi-queue", Name::Queue),
            ("pepsi-settings-old", Name::Queue),
            ("", Name::Queue),
        ] {
            assert_eq!(invoked_as(OsStr::new(argv0)), name, "{argv0}");
        }
        assert_eq!(Name::Settings.program().name, SETTINGS);
        assert_eq!(Name::Config.program().name, CONFIG);
        assert_eq!(Name::Queue.program().name, "pepsi-queue");
    }

    #[test]
    fn a_usage_error_names_the_program_that_was_typed() {
        let err = crate::queue::args::usage("config: unknown command \"x\"");
        let err = renamed(err, &CONFIG_PROGRAM);
        assert_eq!(
            err.message,
            "config: unknown command \"x\"\nusage: pepsi-config [GLOBAL OPTIONS] COMMAND [ARGS]"
        );
        let other = renamed(Failure::config("no usage line"), &CONFIG_PROGRAM);
        assert_eq!(other.message, "no usage line");
    }
}
