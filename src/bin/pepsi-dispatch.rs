//! `pepsi-dispatch [GLOBAL] serve`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start(&pepsi::dispatch::PROGRAM)
        .and_then(|inv| inv.map_or(Ok(()), pepsi::dispatch::run));
    pepsi::exit::finish(pepsi::dispatch::PROGRAM.name, result)
}
