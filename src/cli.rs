//! The global command-line options shared by every Pepsi program (§1).
//!
//! `PROGRAM [GLOBAL] SUBCOMMAND [ARGS]`: the global options come first; the first
//! argument that is not one of them starts the program's own part. A global option
//! found after that point is a usage error (exit 64), so `pepsi-setup schema -v` is
//! rejected rather than silently ignored. Each program checks its own part with
//! [`Invocation::expect_only`] or reads it itself after [`Invocation::reject_globals`].
//!
//! Called by every program's `main` ([`start`] or [`start_os`], which also set up
//! [`crate::logging`] from `-L` and `-v`). It only reads the command line: it opens no
//! file and reads no configuration (`-c` is a path handed on).

use std::ffi::OsString;
use std::path::PathBuf;

use log::LevelFilter;

use crate::exit::Failure;

/// What a program says about itself in `--help`.
pub struct Program {
    /// The command name, e.g. `pepsi-dispatch`.
    pub name: &'static str,
    /// The synopsis after the global options, e.g. `serve`.
    pub synopsis: &'static str,
    /// One paragraph on what the program does and its own arguments.
    pub about: &'static str,
}

/// The global options.
#[derive(Clone, Debug)]
pub struct Globals {
    /// `-c FILE`: the configuration file, before `$PEPSI_CONFIG` and the default path.
    pub config: Option<PathBuf>,
    /// `-L LEVEL`: the log level (default info).
    pub log_level: LevelFilter,
    /// `-v`: log messages from all sources, not only Pepsi's own modules.
    pub verbose: bool,
}

/// A parsed command line.
#[derive(Debug)]
pub enum Parsed {
    /// Run with these globals and the program's own arguments.
    Run(Invocation),
    /// `-h`: print the usage and exit 0.
    Help(String),
    /// `-V`: print the version and exit 0.
    Version(String),
}

/// Globals plus the program's own arguments (subcommand first).
#[derive(Debug)]
pub struct Invocation {
    /// The global options.
    pub globals: Globals,
    /// Everything after the global options.
    pub rest: Vec<String>,
}

const GLOBAL_FLAGS: &[&str] = &[
    "-c",
    "--config",
    "-L",
    "--log",
    "-v",
    "--verbose",
    "-h",
    "--help",
    "-V",
    "--version",
];

/// The usage text of a program.
pub fn usage(program: &Program) -> String {
    format!(
        "usage: {} [-c FILE] [-L LEVEL] [-v] [-h] [-V] {}\n\n{}\n\n\
         global options (before the subcommand):\n  \
         -c, --config FILE   read FILE instead of $PEPSI_CONFIG or /etc/pepsi/pepsi.conf\n  \
         -L, --log LEVEL     error, warn, info (default), debug or trace\n  \
         -v, --verbose       log messages from all sources, not only Pepsi's own\n  \
         -h, --help          print this help and exit\n  \
         -V, --version       print the version and exit\n",
        program.name, program.synopsis, program.about
    )
}

fn usage_error(program: &Program, message: String) -> Failure {
    Failure::usage(format!(
        "{message}\nusage: {} [GLOBAL OPTIONS] {}",
        program.name, program.synopsis
    ))
}

/// Globals plus the program's own arguments as the system passed them, for a program
/// whose arguments may carry data that need not be UTF-8 (`pepsi-queue inject`'s
/// addresses): it decides itself what such an argument means.
#[derive(Debug)]
pub struct OsInvocation {
    /// The global options.
    pub globals: Globals,
    /// Everything after the global options, as given.
    pub rest: Vec<OsString>,
}

/// A parsed command line whose own part is kept as given.
#[derive(Debug)]
pub enum ParsedOs {
    /// Run with these globals and the program's own arguments.
    Run(OsInvocation),
    /// `-h`: print the usage and exit 0.
    Help(String),
    /// `-V`: print the version and exit 0.
    Version(String),
}

/// Parses the command line (without `argv[0]`), keeping the program's own part as given.
/// The global options themselves must be UTF-8, except the `-c` path.
pub fn parse_os<I>(program: &Program, args: I) -> Result<ParsedOs, Failure>
where
    I: IntoIterator<Item = OsString>,
{
    let mut args = args.into_iter();
    let mut globals = Globals {
        config: None,
        log_level: LevelFilter::Info,
        verbose: false,
    };
    let mut rest = Vec::new();
    while let Some(arg) = args.next() {
        // An argument that is not UTF-8 is no global option: the program's part starts.
        let Some(text) = arg.to_str().map(str::to_string) else {
            rest.push(arg);
            rest.extend(args.by_ref());
            break;
        };
        let (flag, inline) = match text.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(OsString::from(v))),
            _ => (text.clone(), None),
        };
        let mut value = |name: &str| -> Result<OsString, Failure> {
            match inline.clone().or_else(|| args.next()) {
                Some(v) => Ok(v),
                None => Err(usage_error(program, format!("option {name} needs a value"))),
            }
        };
        match flag.as_str() {
            "-c" | "--config" => globals.config = Some(PathBuf::from(value(&flag)?)),
            "-L" | "--log" => {
                let level = value(&flag)?;
                let level = level.to_string_lossy();
                globals.log_level = parse_level(&level).ok_or_else(|| {
                    usage_error(
                        program,
                        format!("unknown log level {level:?} (error, warn, info, debug or trace)"),
                    )
                })?;
            }
            "-v" | "--verbose" => globals.verbose = true,
            "-h" | "--help" => return Ok(ParsedOs::Help(usage(program))),
            "-V" | "--version" => {
                return Ok(ParsedOs::Version(format!(
                    "{} {}",
                    program.name,
                    env!("CARGO_PKG_VERSION")
                )));
            }
            "--" => {
                rest.extend(args.by_ref());
                break;
            }
            _ => {
                rest.push(arg);
                rest.extend(args.by_ref());
                break;
            }
        }
    }
    let invocation = OsInvocation { globals, rest };
    invocation.reject_globals(program)?;
    Ok(ParsedOs::Run(invocation))
}

/// Parses the command line (without `argv[0]`); the program's own part must be UTF-8.
pub fn parse<I>(program: &Program, args: I) -> Result<Parsed, Failure>
where
    I: IntoIterator<Item = OsString>,
{
    match parse_os(program, args)? {
        ParsedOs::Help(text) => Ok(Parsed::Help(text)),
        ParsedOs::Version(text) => Ok(Parsed::Version(text)),
        ParsedOs::Run(OsInvocation { globals, rest }) => {
            let rest = rest
                .into_iter()
                .map(|a| {
                    a.into_string().map_err(|a| {
                        usage_error(program, format!("argument {a:?} is not valid UTF-8"))
                    })
                })
                .collect::<Result<Vec<String>, Failure>>()?;
            Ok(Parsed::Run(Invocation { globals, rest }))
        }
    }
}

/// Parses a log level name.
pub fn parse_level(name: &str) -> Option<LevelFilter> {
    match name.to_ascii_lowercase().as_str() {
        "error" => Some(LevelFilter::Error),
        "warn" | "warning" => Some(LevelFilter::Warn),
        "info" => Some(LevelFilter::Info),
        "debug" => Some(LevelFilter::Debug),
        "trace" => Some(LevelFilter::Trace),
        _ => None,
    }
}

/// Fails with exit 64 when one of `args` is a global option.
fn reject_global_flags<'a>(
    program: &Program,
    args: impl IntoIterator<Item = &'a str>,
) -> Result<(), Failure> {
    for arg in args {
        let flag = arg.split_once('=').map_or(arg, |(f, _)| f);
        if GLOBAL_FLAGS.contains(&flag) {
            return Err(usage_error(
                program,
                format!("global option {flag} must come before the subcommand"),
            ));
        }
    }
    Ok(())
}

impl OsInvocation {
    /// Fails with exit 64 when a global option follows the subcommand.
    pub fn reject_globals(&self, program: &Program) -> Result<(), Failure> {
        reject_global_flags(program, self.rest.iter().filter_map(|a| a.to_str()))
    }
}

impl Invocation {
    /// Fails with exit 64 when a global option follows the subcommand.
    pub fn reject_globals(&self, program: &Program) -> Result<(), Failure> {
        reject_global_flags(program, self.rest.iter().map(String::as_str))
    }

    /// Fails with exit 64 unless the program's part is exactly `words`.
    pub fn expect_only(&self, program: &Program, words: &[&str]) -> Result<(), Failure> {
        if self
            .rest
            .iter()
            .map(String::as_str)
            .eq(words.iter().copied())
        {
            return Ok(());
        }
        let message = match self.rest.first() {
            None => "missing subcommand".to_string(),
            Some(first) if first.as_str() != words.first().copied().unwrap_or("") => {
                format!("unknown subcommand {first:?}")
            }
            Some(_) => format!(
                "unexpected argument {:?}",
                self.rest.get(words.len()).map_or("", String::as_str)
            ),
        };
        Err(usage_error(program, message))
    }
}

/// Runs the common start of every program: parse the command line, print help or
/// version, else set up logging. Returns `None` when the program should exit 0 now.
pub fn start(program: &Program) -> Result<Option<Invocation>, Failure> {
    match parse(program, std::env::args_os().skip(1))? {
        Parsed::Help(text) => {
            print!("{text}");
            Ok(None)
        }
        Parsed::Version(text) => {
            println!("{text}");
            Ok(None)
        }
        Parsed::Run(invocation) => {
            crate::logging::init(invocation.globals.log_level, invocation.globals.verbose);
            Ok(Some(invocation))
        }
    }
}

/// Like [`start`], keeping the program's own arguments as given ([`parse_os`]).
pub fn start_os(program: &Program) -> Result<Option<OsInvocation>, Failure> {
    match parse_os(program, std::env::args_os().skip(1))? {
        ParsedOs::Help(text) => {
            print!("{text}");
            Ok(None)
        }
        ParsedOs::Version(text) => {
            println!("{text}");
            Ok(None)
        }
        ParsedOs::Run(invocation) => {
            crate::logging::init(invocation.globals.log_level, invocation.globals.verbose);
            Ok(Some(invocation))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Program = Program {
        name: "pepsi-test",
        synopsis: "run",
        about: "A test program.",
    };

    fn run(args: &[&str]) -> Result<Parsed, Failure> {
        parse(&P, args.iter().map(OsString::from))
    }

    #[test]
    fn globals_before_the_subcommand_are_read() {
        let Parsed::Run(inv) = run(&["-c", "/x.conf", "-L", "debug", "-v", "run"]).unwrap() else {
            panic!("expected run");
        };
        assert_eq!(inv.globals.config, Some(PathBuf::from("/x.conf")));
        assert_eq!(inv.globals.log_level, LevelFilter::Debug);
        assert!(inv.globals.verbose);
        assert_eq!(inv.rest, vec!["run"]);
        inv.expect_only(&P, &["run"]).unwrap();
    }

    #[test]
    fn long_forms_with_equals_are_read() {
        let Parsed::Run(inv) = run(&["--config=/y.conf", "--log=warn", "run"]).unwrap() else {
            panic!("expected run");
        };
        assert_eq!(inv.globals.config, Some(PathBuf::from("/y.conf")));
        assert_eq!(inv.globals.log_level, LevelFilter::Warn);
    }

    #[test]
    fn a_global_flag_after_the_subcommand_is_a_usage_error() {
        for trailing in ["-v", "--verbose", "-c", "--config=/x", "-h", "-V", "-L"] {
            let err = run(&["run", trailing]).unwrap_err();
            assert_eq!(err.code, crate::exit::EX_USAGE, "{trailing}");
            assert!(
                err.message.contains("before the subcommand"),
                "{}",
                err.message
            );
        }
    }

    #[test]
    fn a_subcommand_argument_that_is_not_utf8_is_kept_as_given_or_refused() {
        use std::os::unix::ffi::OsStringExt;
        let raw = OsString::from_vec(b"\xffx@y".to_vec());
        let args = vec![OsString::from("-v"), OsString::from("inject"), raw.clone()];
        let ParsedOs::Run(inv) = parse_os(&P, args.clone()).unwrap() else {
            panic!("expected run");
        };
        assert!(inv.globals.verbose);
        assert_eq!(inv.rest, vec![OsString::from("inject"), raw]);
        let err = parse(&P, args).unwrap_err();
        assert_eq!(err.code, crate::exit::EX_USAGE);
        assert!(err.message.contains("not valid UTF-8"), "{}", err.message);
        let trailing = vec![OsString::from("inject"), OsString::from("--config=/x")];
        assert_eq!(parse_os(&P, trailing).unwrap_err().code, 64);
    }

    #[test]
    fn help_and_version_win() {
        assert!(matches!(run(&["-h"]).unwrap(), Parsed::Help(_)));
        assert!(matches!(run(&["-V"]).unwrap(), Parsed::Version(_)));
    }

    #[test]
    fn bad_level_and_missing_value_are_usage_errors() {
        assert_eq!(run(&["-L", "loud", "run"]).unwrap_err().code, 64);
        assert_eq!(run(&["-c"]).unwrap_err().code, 64);
    }

    #[test]
    fn expect_only_names_the_problem() {
        let Parsed::Run(inv) = run(&["walk"]).unwrap() else {
            panic!()
        };
        let err = inv.expect_only(&P, &["run"]).unwrap_err();
        assert!(err.message.contains("unknown subcommand \"walk\""));
        let Parsed::Run(inv) = run(&["run", "extra"]).unwrap() else {
            panic!()
        };
        let err = inv.expect_only(&P, &["run"]).unwrap_err();
        assert!(err.message.contains("unexpected argument \"extra\""));
        let Parsed::Run(inv) = run(&[]).unwrap() else {
            panic!()
        };
        assert!(
            inv.expect_only(&P, &["run"])
                .unwrap_err()
                .message
                .contains("missing")
        );
    }
}
