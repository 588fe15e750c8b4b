//! `pepsi-queue [GLOBAL] COMMAND`: the operator's tool (see `pepsi::queue`), which is
//! also `pepsi-settings` and `pepsi-config` when started under those names (the links
//! the package installs; see `pepsi::queue::multicall`).

use std::process::ExitCode;

use pepsi::queue::multicall;

fn main() -> ExitCode {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = multicall::invoked_as(&argv0);
    let program = name.program();
    let result = pepsi::cli::start_os(program)
        .and_then(|inv| inv.map_or(Ok(()), |inv| multicall::run(name, inv)));
    pepsi::exit::finish(program.name, result)
}
