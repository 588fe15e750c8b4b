//! `pepsi-failure-bouncer [GLOBAL] serve | sweep [--failed-only | --timeout-only]`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start(&pepsi::bouncer::PROGRAM)
        .and_then(|inv| inv.map_or(Ok(()), pepsi::bouncer::run));
    pepsi::exit::finish(pepsi::bouncer::PROGRAM.name, result)
}
