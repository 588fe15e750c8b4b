//! The unified binary of the built-in stages: `pepsi-stage-NAME [GLOBAL] worker`
//! (installed as links named after each stage), or `pepsi-stage [GLOBAL] NAME worker`.

use std::process::ExitCode;

fn main() -> ExitCode {
    pepsi::stages::main()
}
