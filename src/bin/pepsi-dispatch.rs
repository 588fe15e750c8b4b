//! `pepsi-dispatch [GLOBAL] serve | check [--overlay SECTION KEY VALUE]`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start(&pepsi::dispatch::PROGRAM).and_then(|inv| match inv {
        None => Ok(()),
        Some(inv) if inv.rest.first().is_some_and(|s| s == "check") => {
            pepsi::check::run(&pepsi::dispatch::PROGRAM, inv)
        }
        Some(inv) => pepsi::dispatch::run(inv),
    });
    pepsi::exit::finish(pepsi::dispatch::PROGRAM.name, result)
}
