//! `pepsi-ingress [GLOBAL] serve`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = pepsi::cli::start(&pepsi::ingress::PROGRAM).and_then(|inv| match inv {
        None => Ok(()),
        Some(inv) => pepsi::ingress::run(inv),
    });
    pepsi::exit::finish(pepsi::ingress::PROGRAM.name, result)
}
