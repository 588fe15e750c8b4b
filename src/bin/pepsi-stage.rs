//! The unified binary of the built-in stages: `pepsi-stage-NAME [GLOBAL] worker`
//! (installed as links named after each stage), or `pepsi-stage [GLOBAL] NAME worker |
//! list`. Picks the stage from argv[0] or from the first argument after the global
//! options, then runs the worker runtime with the built-ins' registry
//! (`pepsi::stages::REGISTRY`), or prints one of the stage's reports from the
//! configuration file instead of `worker` (`pepsi-stage-dkim-sign dns`); the exit code
//! is decided here, from `pepsi::exit`.

use std::process::ExitCode;

use pepsi::cli::{Invocation, Program};
use pepsi::exit::{self, Failure};
use pepsi::stages::{self, REGISTRY};
use pepsi::worker::{PROGRAM_PREFIX, Stage, runtime};

fn main() -> ExitCode {
    // Not dumpable, dying with the dispatcher, before anything is read.
    runtime::harden();
    // First thing: started by a worker of this binary as its keeper (§4
    // "Containment"), not as a stage, it serves and exits with the keeper's status.
    if let Some(code) = pepsi::keeper::client::serve_if_asked() {
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    let argv0 = std::env::args().next().unwrap_or_default();
    let (program, named) = invoked_as(&argv0);
    let result = pepsi::cli::start(&program)
        .and_then(|inv| inv.map_or(Ok(()), |inv| run(&program, named, inv)));
    exit::finish(program.name, result)
}

/// What argv[0] makes of this binary: `pepsi-stage-NAME` for a built-in NAME, that
/// stage's program; anything else, `pepsi-stage`, which takes the stage as an argument.
fn invoked_as(argv0: &str) -> (Program, Option<&'static dyn Stage>) {
    let invoked = argv0.rsplit('/').next().unwrap_or(argv0);
    match invoked.strip_prefix(PROGRAM_PREFIX).and_then(stages::find) {
        Some(stage) => (
            program(
                Box::leak(format!("{PROGRAM_PREFIX}{}", stage.name()).into_boxed_str()),
                Box::leak(
                    std::iter::once("worker")
                        .chain(stage.shows().iter().copied())
                        .collect::<Vec<_>>()
                        .join(" | ")
                        .into_boxed_str(),
                ),
            ),
            Some(stage),
        ),
        None => (program("pepsi-stage", "NAME worker | list"), None),
    }
}

/// Runs the program's own part of the command line: `worker` for the stage argv[0]
/// named, or `NAME worker`, or `list`.
fn run(
    program: &Program,
    named: Option<&'static dyn Stage>,
    inv: Invocation,
) -> Result<(), Failure> {
    let stage = match named {
        Some(stage) => {
            if let [what] = &inv.rest[..] {
                if stage.shows().contains(&what.as_str()) {
                    return show(stage, what, &inv);
                }
            }
            inv.expect_only(program, &["worker"])?;
            stage
        }
        None if inv.rest == ["list"] => {
            // One name a line, for scripts (the package's stage links).
            for stage in REGISTRY.stages() {
                println!("{}", stage.name());
            }
            return Ok(());
        }
        None => {
            let name = inv.rest.first().cloned().unwrap_or_default();
            let stage = stages::find(&name).ok_or_else(|| {
                Failure::usage(format!(
                    "unknown stage {name:?} ({})\nusage: pepsi-stage [GLOBAL OPTIONS] NAME worker\n       pepsi-stage [GLOBAL OPTIONS] list",
                    names()
                ))
            })?;
            match inv.rest.get(1..) {
                Some([w]) if w == "worker" => {}
                Some([what]) if stage.shows().contains(&what.as_str()) => {
                    return show(stage, what, &inv);
                }
                _ => {
                    return Err(Failure::usage(
                        "usage: pepsi-stage [GLOBAL OPTIONS] NAME worker",
                    ));
                }
            }
            stage
        }
    };
    runtime::run(&inv.globals, REGISTRY, stage)
}

/// Prints the stage's report `what` for its sections in the configuration file's
/// stage graph (the overlay in the database is not read).
fn show(stage: &dyn Stage, what: &str, inv: &Invocation) -> Result<(), Failure> {
    let config = pepsi::config::Config::load_or_fail(inv.globals.config.as_deref())?;
    let graph = config.file_graph().map_err(|errors| {
        Failure::config(format!(
            "the stage graph is invalid:\n{}",
            pepsi::config::raw::join_errors(&errors)
        ))
    })?;
    let text = stage.show(what, &graph).map_err(Failure::config)?;
    print!("{text}");
    Ok(())
}

/// The names of the built-in stages, in registry order, comma-separated.
fn names() -> String {
    REGISTRY
        .stages()
        .iter()
        .map(|s| s.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The program's description, under the name it was invoked by.
fn program(name: &'static str, synopsis: &'static str) -> Program {
    Program {
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
