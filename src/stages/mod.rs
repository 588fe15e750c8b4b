//! The built-in stages (SPEC §12.7), compiled into the one unified `pepsi-stage`
//! binary so that they can be fused. Each file is one stage; [`find`] maps a name
//! (`pass` for `pepsi-stage-pass`) to it, [`for_program`] a `PROGRAM`, and
//! [`check_section`] checks a section with its built-in's own `configure` — the one
//! check the dispatcher (at start, at a reload, in `pepsi-dispatch check`) and the
//! worker share (SPEC §4 "Strictness").

pub mod bounce;
pub mod discard;
pub mod dsn;
pub mod exec;
pub mod if_stage;
pub mod pass;

use crate::config::{ConfigError, StageSection};
use crate::worker::Stage;

/// Every built-in stage.
pub const BUILTINS: &[&dyn Stage] = &[
    &pass::Pass,
    &if_stage::If,
    &discard::Discard,
    &exec::Exec,
    &bounce::Bounce,
];

/// The built-in stage of this name.
pub fn find(name: &str) -> Option<&'static dyn Stage> {
    BUILTINS.iter().copied().find(|s| s.name() == name)
}

/// The built-in a `PROGRAM` names by its file name (`pepsi-stage-NAME`, on `PATH` or
/// at any absolute path), whatever binary it resolves to.
pub fn for_program(program: &str) -> Option<&'static dyn Stage> {
    let name = program.rsplit('/').next().unwrap_or(program);
    find(name.strip_prefix(crate::worker::runtime::PROGRAM_PREFIX)?)
}

/// The keys a `PROGRAM`'s built-in declares; `None` for a program that is not a
/// built-in (its options are its own business).
pub fn program_keys(program: &str) -> Option<&'static [&'static str]> {
    for_program(program).map(|b| b.keys())
}

/// Checks a stage's section exactly as its worker will, with the `configure` of the
/// built-in its `PROGRAM` names; `None` when the program is not a built-in.
pub fn check_section(section: &StageSection) -> Option<Result<(), ConfigError>> {
    for_program(&section.program).map(|b| b.configure(section).map(drop))
}

/// Checks every built-in stage's section of these; every problem.
pub fn check_sections<'a>(
    sections: impl IntoIterator<Item = &'a StageSection>,
) -> Vec<ConfigError> {
    sections
        .into_iter()
        .filter_map(check_section)
        .filter_map(Result::err)
        .collect()
}

/// The names of the built-in stages, in [`BUILTINS`] order, comma-separated.
fn names() -> String {
    BUILTINS
        .iter()
        .map(|s| s.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `pepsi-stage` program's description (the stage name is filled in by [`main`]).
fn program(name: &'static str, synopsis: &'static str) -> crate::cli::Program {
    crate::cli::Program {
        name,
        synopsis,
        about: Box::leak(
            format!(
                "A built-in Pepsi stage. `worker` speaks the worker protocol on stdin/stdout: it prints \
                 `ready`, then answers every message id with one status line, in order, until stdin ends.\n\
                 Built-in stages: {}. `pepsi-stage list` prints their names, one a line \
                 (the links a package installs).",
                names()
            )
            .into_boxed_str(),
        ),
    }
}

/// The entry point of the unified stage binary: picks the stage from argv[0]
/// (`pepsi-stage-NAME`) or from the first argument after the global options.
pub fn main() -> std::process::ExitCode {
    // Started by a worker of this binary as its keeper (SPEC §4 "Containment"), not as
    // a stage.
    if let Some(code) = crate::keeper::client::serve_if_asked() {
        return std::process::ExitCode::from(code.clamp(0, 255) as u8);
    }
    let argv0 = std::env::args().next().unwrap_or_default();
    let invoked = argv0.rsplit('/').next().unwrap_or(&argv0).to_string();
    let prefix = crate::worker::runtime::PROGRAM_PREFIX;
    let (program, from_argv0) = match invoked.strip_prefix(prefix).and_then(find) {
        Some(stage) => (
            program(
                Box::leak(format!("{prefix}{}", stage.name()).into_boxed_str()),
                "worker",
            ),
            Some(stage),
        ),
        None => (program("pepsi-stage", "NAME worker | list"), None),
    };
    let result = crate::cli::start(&program).and_then(|inv| {
        let Some(inv) = inv else { return Ok(()) };
        let stage = match from_argv0 {
            Some(stage) => {
                inv.expect_only(&program, &["worker"])?;
                stage
            }
            None if inv.rest == ["list"] => {
                // One name a line, for scripts (the package's stage links).
                for stage in BUILTINS {
                    println!("{}", stage.name());
                }
                return Ok(());
            }
            None => {
                let name = inv.rest.first().cloned().unwrap_or_default();
                let stage = find(&name).ok_or_else(|| {
                    crate::exit::Failure::usage(format!(
                        "unknown stage {name:?} ({})\nusage: pepsi-stage [GLOBAL OPTIONS] NAME worker\n       pepsi-stage [GLOBAL OPTIONS] list",
                        names()
                    ))
                })?;
                if inv.rest.get(1..) != Some(&["worker".to_string()][..]) {
                    return Err(crate::exit::Failure::usage(
                        "usage: pepsi-stage [GLOBAL OPTIONS] NAME worker",
                    ));
                }
                stage
            }
        };
        crate::worker::runtime::run(&inv.globals, stage)
    });
    crate::exit::finish(program.name, result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::program_path::{BUILTIN_STAGES, STAGE_PROGRAM_PREFIX};

    #[test]
    fn program_path_knows_every_built_in_stage_by_its_program_name() {
        let names: Vec<&str> = BUILTINS.iter().map(|s| s.name()).collect();
        assert_eq!(names, BUILTIN_STAGES);
        assert_eq!(STAGE_PROGRAM_PREFIX, crate::worker::runtime::PROGRAM_PREFIX);
    }
}
