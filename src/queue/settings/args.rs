//! The command line of `pepsi-settings` (and of `pepsi-queue settings`) after the
//! global options: the command and its own arguments, checked into a [`Command`]
//! before anything is read or connected.
//!
//! Pure: it reads no file and no database. Every mistake is a usage error (exit 64)
//! naming the argument. It owns which arguments each command takes; the arguments are
//! read one at a time by `queue::args::options`, as `pepsi-queue`'s are, and what a
//! setting's address, stage, key and value may be is `judge.rs`'s. Called by
//! `settings::run` only.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::exit::Failure;
use crate::queue::args::Input;
use crate::queue::args::options::{Arg, Args, text, unexpected, usage};
use crate::worker::settings::SettingRow;

use super::fairness;

/// The commands, as an unknown one lists them.
pub const COMMANDS: &str =
    "list, get, set, unset, export, import, weight, rate, weights, tenant, tenants, tenant-of";

/// A checked `pepsi-settings` command.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// `list [ADDRESS] [--stage S] [--json]`.
    List {
        /// The address whose settings are listed (every address's when `None`).
        address: Option<String>,
        /// `--stage`: only the settings of this stage.
        stage: Option<String>,
        /// `--json`.
        json: bool,
    },
    /// `get ADDRESS [--json]`.
    Get {
        /// The address.
        address: String,
        /// `--json`.
        json: bool,
    },
    /// `set ADDRESS STAGE KEY VALUE`.
    Set(SettingRow),
    /// `unset ADDRESS STAGE KEY`.
    Unset {
        /// The address.
        address: String,
        /// The stage.
        stage: String,
        /// The key.
        key: String,
    },
    /// `export`.
    Export,
    /// `import [--replace] FILE|-`.
    Import {
        /// Where the settings are read.
        input: Input,
        /// `--replace`: the table becomes exactly the file (else the file's settings
        /// are merged into it).
        replace: bool,
    },
    /// `weight PATTERN WEIGHT` (`Some`) or `weight --unset PATTERN` (`None`).
    Weight {
        /// The tenant-key or sender-key pattern, checked.
        pattern: String,
        /// The weight, checked.
        weight: Option<f64>,
    },
    /// `rate PATTERN N/s|N/min|N/h` (`Some`, messages a second) or `rate --unset
    /// PATTERN` (`None`).
    Rate {
        /// The tenant-key pattern, checked.
        pattern: String,
        /// The rate, checked.
        rate: Option<f64>,
    },
    /// `tenant PATTERN NAME` (`Some`) or `tenant --unset PATTERN` (`None`).
    Tenant {
        /// The sender-key pattern, checked.
        pattern: String,
        /// The tenant's name, checked.
        name: Option<String>,
    },
    /// `weights [--json]` (`tenants` false) or `tenants [--json]`.
    Fairness {
        /// `tenants` rather than `weights`.
        tenants: bool,
        /// `--json`.
        json: bool,
    },
    /// `tenant-of SENDER_KEY`.
    TenantOf {
        /// The sender key.
        key: String,
    },
}

/// `weight` or `tenant`: `PATTERN VALUE` or `--unset PATTERN`, both checked.
fn pattern_and<T>(
    command: &str,
    args: &mut Args,
    value: impl Fn(&str, &str) -> Result<T, Failure>,
) -> Result<(String, Option<T>), Failure> {
    let mut unset = false;
    let given = given(command, args, |flag, _| {
        unset |= flag == "--unset";
        Ok(flag == "--unset")
    })?;
    no_json(command, &given)?;
    match (&given.operands[..], unset) {
        ([p], true) => Ok((fairness::pattern(command, p)?, None)),
        ([p, v], false) => Ok((fairness::pattern(command, p)?, Some(value(command, v)?))),
        _ => Err(usage(format!(
            "{command} needs PATTERN {} (or --unset PATTERN)",
            match command {
                "weight" => "WEIGHT",
                "rate" => "N/s|N/min|N/h",
                _ => "NAME",
            }
        ))),
    }
}

/// The operands and the flags a command was given, after its own options were taken.
struct Given {
    operands: Vec<String>,
    json: bool,
}

/// Reads the arguments of `command`: its operands (UTF-8) and `--json`; `own` takes the
/// command's own options and answers whether it knew the flag.
fn given(
    command: &str,
    args: &mut Args,
    mut own: impl FnMut(&str, &mut Args) -> Result<bool, Failure>,
) -> Result<Given, Failure> {
    let mut out = Given {
        operands: Vec::new(),
        json: false,
    };
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Operand(o) => out.operands.push(text(command, o)?),
            Arg::Flag(f) if f == "--json" => out.json = true,
            Arg::Flag(f) => {
                if !own(&f, args)? {
                    return Err(unexpected(command, Arg::Flag(f)));
                }
            }
        }
    }
    Ok(out)
}

/// Refuses `--json` for a command that writes.
fn no_json(command: &str, given: &Given) -> Result<(), Failure> {
    if given.json {
        return Err(usage(format!(
            "{command}: --json is taken by list and get, which read; {command} takes none"
        )));
    }
    Ok(())
}

/// Parses the command and its arguments.
pub fn parse(rest: Vec<OsString>) -> Result<Command, Failure> {
    let mut rest = rest.into_iter();
    let Some(command) = rest.next() else {
        return Err(usage(format!("settings: missing command ({COMMANDS})")));
    };
    let command = text("command", command)?;
    let mut args = Args::new(rest.collect());
    let no_options = |_: &str, _: &mut Args| Ok(false);
    match command.as_str() {
        "list" => {
            let mut stage = None;
            let given = given("list", &mut args, |flag, args| {
                if flag == "--stage" {
                    stage = Some(args.value(flag)?);
                    return Ok(true);
                }
                Ok(false)
            })?;
            let address = match &given.operands[..] {
                [] => None,
                [address] => Some(address.clone()),
                [_, extra, ..] => {
                    return Err(usage(format!(
                        "list takes at most one ADDRESS; unexpected argument {extra:?}"
                    )));
                }
            };
            Ok(Command::List {
                address,
                stage,
                json: given.json,
            })
        }
        "get" => {
            let given = given("get", &mut args, no_options)?;
            match &given.operands[..] {
                [address] => Ok(Command::Get {
                    address: address.clone(),
                    json: given.json,
                }),
                _ => Err(usage("get needs ADDRESS")),
            }
        }
        "set" => {
            let given = given("set", &mut args, no_options)?;
            no_json("set", &given)?;
            match &given.operands[..] {
                [address, stage, key, value] => Ok(Command::Set(SettingRow {
                    address: address.clone(),
                    stage: stage.clone(),
                    key: key.clone(),
                    value: value.clone(),
                })),
                _ => Err(usage(
                    "set needs ADDRESS STAGE KEY VALUE (put -- before a VALUE that starts with -)",
                )),
            }
        }
        "unset" => {
            let given = given("unset", &mut args, no_options)?;
            no_json("unset", &given)?;
            match &given.operands[..] {
                [address, stage, key] => Ok(Command::Unset {
                    address: address.clone(),
                    stage: stage.clone(),
                    key: key.clone(),
                }),
                _ => Err(usage("unset needs ADDRESS STAGE KEY")),
            }
        }
        "export" => {
            let given = given("export", &mut args, no_options)?;
            if given.json {
                return Err(usage(
                    "export: --json is not taken; export writes the import format (list --json \
                     gives every setting as JSON)",
                ));
            }
            if let Some(extra) = given.operands.first() {
                return Err(usage(format!("export: unexpected argument {extra:?}")));
            }
            Ok(Command::Export)
        }
        "import" => {
            let mut replace = false;
            let mut file = None;
            while let Some(arg) = args.next()? {
                match arg {
                    Arg::Flag(f) if f == "--replace" => replace = true,
                    // A FILE need not be UTF-8.
                    Arg::Operand(o) if file.is_none() => file = Some(o),
                    other => return Err(unexpected("import", other)),
                }
            }
            let input = match file {
                None => return Err(usage("import needs FILE (or - for standard input)")),
                Some(f) if f == "-" => Input::Stdin,
                Some(f) => Input::File(PathBuf::from(f)),
            };
            Ok(Command::Import { input, replace })
        }
        "weight" => {
            let (pattern, weight) = pattern_and("weight", &mut args, fairness::weight)?;
            Ok(Command::Weight { pattern, weight })
        }
        "rate" => {
            let (pattern, rate) = pattern_and("rate", &mut args, fairness::rate)?;
            Ok(Command::Rate { pattern, rate })
        }
        "tenant" => {
            let (pattern, name) = pattern_and("tenant", &mut args, fairness::tenant_name)?;
            Ok(Command::Tenant { pattern, name })
        }
        "weights" | "tenants" => {
            let given = given(&command, &mut args, no_options)?;
            if let Some(extra) = given.operands.first() {
                return Err(usage(format!("{command}: unexpected argument {extra:?}")));
            }
            Ok(Command::Fairness {
                tenants: command == "tenants",
                json: given.json,
            })
        }
        "tenant-of" => {
            let given = given("tenant-of", &mut args, no_options)?;
            no_json("tenant-of", &given)?;
            match &given.operands[..] {
                [key] => Ok(Command::TenantOf { key: key.clone() }),
                _ => Err(usage(
                    "tenant-of needs SENDER_KEY (from:DOMAIN, ip:ADDRESS, user:LOGIN …)",
                )),
            }
        }
        other => Err(usage(format!(
            "settings: unknown command {other:?} ({COMMANDS})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    fn ok(words: &[&str]) -> Command {
        parse(args(words)).unwrap_or_else(|e| panic!("{words:?}: {e}"))
    }

    fn code(words: &[&str]) -> u8 {
        parse(args(words)).unwrap_err().code
    }

    #[test]
    fn reading_commands_take_an_address_a_stage_and_json() {
        assert_eq!(
            ok(&["list"]),
            Command::List {
                address: None,
                stage: None,
                json: false
            }
        );
        assert_eq!(
            ok(&["list", "A@x", "--stage=route", "--json"]),
            Command::List {
                address: Some("A@x".into()),
                stage: Some("route".into()),
                json: true
            }
        );
        assert_eq!(
            ok(&["get", "--json", "a@x"]),
            Command::Get {
                address: "a@x".into(),
                json: true
            }
        );
        assert_eq!(code(&["list", "a@x", "b@x"]), 64);
        assert_eq!(code(&["list", "--stage"]), 64);
        assert_eq!(code(&["get"]), 64);
        assert_eq!(code(&["get", "a@x", "--stage", "s"]), 64);
    }

    #[test]
    fn writing_commands_take_exactly_their_operands_and_no_json() {
        assert_eq!(
            ok(&["set", "a@x", "route", "MATCH", "sender is b@y"]),
            Command::Set(SettingRow {
                address: "a@x".into(),
                stage: "route".into(),
                key: "MATCH".into(),
                value: "sender is b@y".into(),
            })
        );
        let Command::Set(row) = ok(&["set", "a@x", "s", "K", "--", "-1"]) else {
            panic!()
        };
        assert_eq!(row.value, "-1", "-- before a value that starts with -");
        assert_eq!(code(&["set", "a@x", "s", "K", "-1"]), 64);
        assert_eq!(code(&["set", "a@x", "s", "K"]), 64);
        assert_eq!(code(&["set", "a@x", "s", "K", "v", "w"]), 64);
        assert_eq!(code(&["set", "a@x", "s", "K", "v", "--json"]), 64);
        assert_eq!(
            ok(&["unset", "a@x", "s", "K"]),
            Command::Unset {
                address: "a@x".into(),
                stage: "s".into(),
                key: "K".into()
            }
        );
        assert_eq!(code(&["unset", "a@x", "s"]), 64);
        assert_eq!(ok(&["export"]), Command::Export);
        assert_eq!(code(&["export", "--json"]), 64);
        assert_eq!(code(&["export", "file"]), 64);
        assert_eq!(
            ok(&["import", "-"]),
            Command::Import {
                input: Input::Stdin,
                replace: false
            }
        );
        assert_eq!(
            ok(&["import", "--replace", "s.tsv"]),
            Command::Import {
                input: Input::File("s.tsv".into()),
                replace: true
            }
        );
        assert_eq!(code(&["import"]), 64);
        assert_eq!(code(&["import", "a", "b"]), 64);
        assert_eq!(code(&["import", "--json", "a"]), 64);
    }

    #[test]
    fn an_unknown_or_missing_command_lists_the_commands() {
        let err = parse(args(&["frob"])).unwrap_err();
        assert_eq!(err.code, 64);
        assert!(
            err.message
                .contains(&format!("unknown command \"frob\" ({COMMANDS})")),
            "{}",
            err.message
        );
        assert_eq!(code(&[]), 64);
    }

    #[test]
    fn an_argument_that_is_not_utf8_is_a_usage_error() {
        use std::os::unix::ffi::OsStringExt;
        let mut words = args(&["set"]);
        words.push(OsString::from_vec(b"a\xff@x".to_vec()));
        words.extend(args(&["s", "K", "v"]));
        assert_eq!(parse(words).unwrap_err().code, 64);
        let mut words = args(&["import"]);
        words.push(OsString::from_vec(b"file\xff".to_vec()));
        assert!(parse(words).is_ok(), "a file name need not be UTF-8");
    }
}
