//! `pepsi-setup [GLOBAL] schema`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start(&pepsi::setup::PROGRAM)
        .and_then(|inv| inv.map_or(Ok(()), pepsi::setup::run));
    pepsi::exit::finish(pepsi::setup::PROGRAM.name, result)
}
