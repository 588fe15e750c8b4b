//! `pepsi-queue [GLOBAL] COMMAND`: the operator's tool (see `pepsi::queue`).

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start_os(&pepsi::queue::PROGRAM)
        .and_then(|inv| inv.map_or(Ok(()), pepsi::queue::run));
    pepsi::exit::finish(pepsi::queue::PROGRAM.name, result)
}
