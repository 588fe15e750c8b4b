//! The command line of `pepsi-queue` after the global options: the subcommand and its
//! own options, checked into a [`Command`] before anything is read or connected.
//!
//! Pure: it reads no file and no database. Every mistake is a usage error (exit 64)
//! naming the option or argument, except a recipient or sender of `inject` that is not
//! UTF-8, which is bad data (exit 65): the message it came with is refused, not the
//! command line's shape. Called by `queue::run` only.
//!
//! This file owns the checked [`Command`] and [`parse`], which picks the subcommand;
//! `options` reads the arguments one at a time and checks the values several
//! commands share (ids, statuses, stage names, addresses); `commands` reads each
//! command's own options. None of them touches the help text, which is
//! `queue::PROGRAM`'s.

mod commands;
pub(in crate::queue) mod options;

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;

use crate::exit::Failure;

use commands::{
    parse_config, parse_destinations, parse_ids, parse_inject, parse_list, parse_resume,
    parse_shape, parse_show, parse_trace,
};
use options::{Arg, Args, stage_name, text, unexpected};
pub use options::{ids_from_text, usage};

/// The default `--limit` of `list`.
pub const DEFAULT_LIST_LIMIT: i64 = 1000;

/// Every status a row can have, for `list --status`.
pub const STATUSES: &[&str] = &["pending", "running", "paused", "failed", "timeout", "held"];

/// The statuses `resume` takes.
pub const RESUMABLE: &[&str] = &["paused", "failed", "timeout"];

/// Where `inject` reads the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Standard input (`-`, or no FILE).
    Stdin,
    /// A file.
    File(PathBuf),
}

/// `inject`'s arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inject {
    /// `--stage`: where the message starts.
    pub stage: String,
    /// `--from`/`-f`: the envelope sender as given (`''` and `<>` are the null sender).
    pub from: String,
    /// `--to`, or the positional recipients (sendmail style), as given.
    pub to: Vec<String>,
    /// Where the message comes from.
    pub input: Input,
    /// `--auth-user`: the authenticated submitter.
    pub auth_user: Option<String>,
    /// `--client-ip`: the SMTP client's address.
    pub client_ip: Option<IpAddr>,
    /// `--local`: set `state.local_origin`.
    pub local: bool,
    /// `--state JSON`: the initial `state` (a JSON object).
    pub state: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What `resume` resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResumeWhat {
    /// These ids.
    Ids(Vec<i64>),
    /// Every resumable row at a stage and/or in a status (`None`: any).
    Matching {
        /// `--stage`.
        stage: Option<String>,
        /// `--status`.
        status: Option<String>,
    },
}

/// A repair command that takes ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repair {
    /// `hold`.
    Hold,
    /// `release`.
    Release,
    /// `delete`.
    Delete,
}

/// A checked `pepsi-queue` command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// `status [--json]`.
    Status {
        /// `--json`.
        json: bool,
    },
    /// `list [--stage S] [--status X] [--sender KEY] [--limit N] [--json]`.
    List {
        /// `--stage`.
        stage: Option<String>,
        /// `--status`.
        status: Option<String>,
        /// `--sender`: a sender key.
        sender: Option<String>,
        /// `--limit`.
        limit: i64,
        /// `--json`.
        json: bool,
    },
    /// `show ID [--headers] [--body] [--json]`.
    Show {
        /// The message id.
        id: i64,
        /// `--headers`.
        headers: bool,
        /// `--body`.
        body: bool,
        /// `--json`.
        json: bool,
    },
    /// `shape [--by KEY] [--top N] [--stage S] [--status X] [--json]`: messages by age
    /// and key, like Postfix's `qshape`.
    Shape {
        /// The options.
        options: crate::queue::shape::Options,
        /// `--json`.
        json: bool,
    },
    /// `trace ID | --message-id ID | --remote-id ID [--json]`: what became of a
    /// message.
    Trace {
        /// What to trace by.
        key: crate::queue::trace::TraceKey,
        /// `--json`.
        json: bool,
    },
    /// `inject …`.
    Inject(Box<Inject>),
    /// `resume …`.
    Resume {
        /// What to resume.
        what: ResumeWhat,
        /// `--json`.
        json: bool,
    },
    /// `hold`, `release` or `delete` with ids.
    Repair {
        /// Which.
        repair: Repair,
        /// The ids.
        ids: Vec<i64>,
        /// `--json`.
        json: bool,
    },
    /// `requeue --stage S ID…`.
    Requeue {
        /// The stage the rows go to.
        stage: String,
        /// The ids.
        ids: Vec<i64>,
        /// `--json`.
        json: bool,
    },
    /// `metrics [--output FILE]`.
    Metrics {
        /// `--output`: write this file atomically instead of stdout.
        output: Option<PathBuf>,
    },
    /// `destinations [--json]`: relay-to-internet's destinations in trouble.
    Destinations {
        /// `--json`.
        json: bool,
    },
    /// `destinations lift DESTINATION [--json]`.
    LiftDestination {
        /// The destination, checked and in lower case.
        destination: String,
        /// `--json`.
        json: bool,
    },
    /// `config check [--json]`.
    ConfigCheck {
        /// `--json`: one JSON document instead of lines.
        json: bool,
    },
    /// `config show [--json]`.
    ConfigShow {
        /// `--json`: one JSON document instead of lines.
        json: bool,
    },
    /// `config set SECTION KEY VALUE`.
    ConfigSet {
        /// The section (`stage-NAME`).
        section: String,
        /// The key.
        key: String,
        /// The value (empty unsets the file's key).
        value: String,
    },
    /// `config unset SECTION KEY`.
    ConfigUnset {
        /// The section (`stage-NAME`).
        section: String,
        /// The key.
        key: String,
    },
    /// `settings COMMAND [ARGS]`: the arguments after `settings`, as given, for
    /// `queue::settings` to read.
    Settings(Vec<OsString>),
}

impl Command {
    /// Does the command read ids from standard input (an id argument `-`)?
    pub fn reads_ids_from_stdin(rest: &[OsString]) -> bool {
        matches!(
            rest.first().and_then(|s| s.to_str()),
            Some("resume" | "hold" | "release" | "delete" | "requeue")
        ) && rest.iter().skip(1).any(|a| a == "-")
    }
}

/// Parses the program's part of the command line. `stdin_ids` are the ids read from
/// standard input when an id argument is `-` (see [`Command::reads_ids_from_stdin`]).
pub fn parse(rest: Vec<OsString>, stdin_ids: &[i64]) -> Result<Command, Failure> {
    let mut rest = rest.into_iter();
    let Some(sub) = rest.next() else {
        return Err(usage("missing command"));
    };
    let sub = text("command", sub)?;
    if sub == "settings" {
        return Ok(Command::Settings(rest.collect()));
    }
    let mut args = Args::new(rest.collect());
    match sub.as_str() {
        "status" => {
            let mut json = false;
            while let Some(arg) = args.next()? {
                match arg {
                    Arg::Flag(f) if f == "--json" => json = true,
                    other => return Err(unexpected(&sub, other)),
                }
            }
            Ok(Command::Status { json })
        }
        "list" => parse_list(&mut args),
        "show" => parse_show(&mut args),
        "shape" => parse_shape(&mut args),
        "trace" => parse_trace(&mut args),
        "inject" => parse_inject(&mut args),
        "resume" => parse_resume(&mut args, stdin_ids),
        "hold" | "release" | "delete" => {
            let repair = match sub.as_str() {
                "hold" => Repair::Hold,
                "release" => Repair::Release,
                _ => Repair::Delete,
            };
            let (ids, json) = parse_ids(&sub, &mut args, stdin_ids, |_, _| Ok(false))?;
            Ok(Command::Repair { repair, ids, json })
        }
        "requeue" => {
            let mut stage = None;
            let (ids, json) = parse_ids(&sub, &mut args, stdin_ids, |flag, args| {
                if flag == "--stage" {
                    stage = Some(args.value("--stage")?);
                    Ok(true)
                } else {
                    Ok(false)
                }
            })?;
            let stage = stage_name("requeue", stage)?;
            Ok(Command::Requeue { stage, ids, json })
        }
        "metrics" => {
            let mut output = None;
            while let Some(arg) = args.next()? {
                match arg {
                    Arg::Flag(f) if f == "--output" => {
                        output = Some(PathBuf::from(args.value_os("--output")?));
                    }
                    other => return Err(unexpected(&sub, other)),
                }
            }
            Ok(Command::Metrics { output })
        }
        "destinations" => parse_destinations(&mut args),
        "config" => parse_config(&mut args),
        other => Err(usage(format!(
            "unknown command {other:?} (status, list, show, shape, trace, inject, resume, hold, \
             release, delete, requeue, metrics, destinations, config, settings)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn args(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    fn ok(words: &[&str]) -> Command {
        parse(args(words), &[]).unwrap_or_else(|e| panic!("{words:?}: {e}"))
    }

    fn code(words: &[&str]) -> u8 {
        parse(args(words), &[]).unwrap_err().code
    }

    #[test]
    fn reading_commands_take_their_options() {
        assert_eq!(ok(&["status", "--json"]), Command::Status { json: true });
        assert_eq!(
            ok(&["list", "--stage", "relay", "--status=held", "--limit", "5"]),
            Command::List {
                stage: Some("relay".into()),
                status: Some("held".into()),
                sender: None,
                limit: 5,
                json: false
            }
        );
        assert_eq!(
            ok(&["show", "7", "--body", "--json"]),
            Command::Show {
                id: 7,
                headers: false,
                body: true,
                json: true
            }
        );
        assert_eq!(code(&["list", "--status", "stuck"]), 64);
        assert_eq!(code(&["list", "--limit", "0"]), 64);
        assert_eq!(code(&["show"]), 64);
        assert_eq!(code(&["show", "x1"]), 64);
        assert_eq!(code(&["status", "--verbose-ish"]), 64);
        assert_eq!(code(&["status", "--json=yes"]), 64);
        assert_eq!(code(&["frobnicate"]), 64);
        assert_eq!(code(&[]), 64);
    }

    #[test]
    fn shape_takes_a_key_a_top_and_filters_and_refuses_bad_values_escaped() {
        use crate::queue::shape::{By, Options};
        assert_eq!(
            ok(&["shape"]),
            Command::Shape {
                options: Options::default(),
                json: false
            }
        );
        assert_eq!(
            ok(&[
                "shape",
                "--by=sender",
                "--top",
                "3",
                "--status",
                "paused",
                "--json"
            ]),
            Command::Shape {
                options: Options {
                    by: By::Sender,
                    top: 3,
                    stage: None,
                    status: Some("paused".into())
                },
                json: true
            }
        );
        for (words, shown) in [
            (
                &["shape", "--by", "dom\r\nain\u{202e}"][..],
                "\"dom\\r\\nain\\u{202e}\"",
            ),
            (&["shape", "--top", "0"][..], "\"0\""),
            (&["shape", "--top", "-2"][..], "\"-2\""),
            (&["shape", "--top", "1\u{0}"][..], "\"1\\u{0}\""),
        ] {
            let e = parse(args(words), &[]).unwrap_err();
            assert_eq!(e.code, 64, "{words:?}");
            assert!(e.message.contains(shown), "{}", e.message);
            assert!(
                !e.message.contains(['\r', '\u{202e}', '\0']),
                "{}",
                e.message
            );
        }
        assert_eq!(code(&["shape", "--status", "stuck"]), 64);
        assert_eq!(code(&["shape", "example.org"]), 64);
    }

    #[test]
    fn trace_takes_exactly_one_key_and_a_message_id_gets_its_brackets() {
        use crate::queue::trace::TraceKey;
        let key = |words: &[&str]| match ok(words) {
            Command::Trace { key, .. } => key,
            other => panic!("{other:?}"),
        };
        assert_eq!(key(&["trace", "7"]), TraceKey::Id(7));
        assert_eq!(
            key(&["trace", "--message-id", "m@x"]),
            TraceKey::MessageId("<m@x>".into())
        );
        assert_eq!(
            key(&["trace", "--message-id=<m@x>", "--json"]),
            TraceKey::MessageId("<m@x>".into())
        );
        assert_eq!(
            key(&["trace", "--remote-id", "4F2K"]),
            TraceKey::RemoteId("4F2K".into())
        );
        assert_eq!(code(&["trace"]), 64);
        assert_eq!(code(&["trace", "7", "--remote-id", "x"]), 64);
        assert_eq!(code(&["trace", "x7"]), 64);
    }

    #[test]
    fn inject_takes_to_options_and_a_file_or_sendmail_style_recipients() {
        let Command::Inject(i) = ok(&[
            "inject", "--stage", "in", "--from", "", "--to", "a@x", "--to=b@y", "msg.eml",
        ]) else {
            panic!()
        };
        assert_eq!(i.from, "");
        assert_eq!(i.to, ["a@x", "b@y"]);
        assert_eq!(i.input, Input::File("msg.eml".into()));
        let Command::Inject(i) = ok(&[
            "inject", "--stage", "in", "-oi", "-fme@x", "--", "a@x", "-b@y",
        ]) else {
            panic!()
        };
        assert_eq!(i.from, "me@x");
        assert_eq!(i.to, ["a@x", "-b@y"]);
        assert_eq!(i.input, Input::Stdin);
        let Command::Inject(i) = ok(&[
            "inject",
            "--stage",
            "in",
            "-f",
            "<>",
            "--local",
            "--state",
            r#"{"list_copy": true}"#,
            "--client-ip",
            "2001:db8::1",
            "r@x",
        ]) else {
            panic!()
        };
        assert!(i.local);
        assert_eq!(i.state.unwrap()["list_copy"], true);
        assert_eq!(i.client_ip.unwrap().to_string(), "2001:db8::1");
        let Command::Inject(i) =
            ok(&["inject", "--stage", "in", "-f", "a", "--client-ip", "", "r"])
        else {
            panic!()
        };
        assert_eq!(i.client_ip, None, "empty is none, as pipe(8) gives it");
        assert_eq!(
            code(&["inject", "--stage", "in", "-f", "a@x"]),
            64,
            "no recipient"
        );
        assert_eq!(code(&["inject", "-f", "a@x", "r@x"]), 64, "no stage");
        assert_eq!(code(&["inject", "--stage", "in", "r@x"]), 64, "no sender");
        assert_eq!(
            code(&[
                "inject", "--stage", "in", "-f", "a", "--to", "r", "f1", "f2"
            ]),
            64
        );
        assert_eq!(
            code(&["inject", "--stage", "in", "-f", "a", "--state", "[]", "r"]),
            64
        );
        assert_eq!(
            code(&[
                "inject",
                "--stage",
                "in",
                "-f",
                "a",
                "--client-ip",
                "x",
                "r"
            ]),
            64
        );
    }

    #[test]
    fn a_recipient_that_is_not_utf8_is_bad_data() {
        let mut words = args(&["inject", "--stage", "in", "-f", "a@x"]);
        words.push(OsString::from_vec(b"r\xff@x".to_vec()));
        let err = parse(words, &[]).unwrap_err();
        assert_eq!(err.code, 65);
        assert!(err.message.contains("recipient"), "{}", err.message);
        let mut words = args(&["inject", "--stage", "in", "--to", "r@x", "--from"]);
        words.push(OsString::from_vec(b"\xfe".to_vec()));
        let err = parse(words, &[]).unwrap_err();
        assert_eq!(err.code, 65);
        assert!(err.message.starts_with("--from:"), "{}", err.message);
    }

    #[test]
    fn a_stage_to_move_or_inject_to_must_be_a_stage_name() {
        for stage in [
            "a b",
            "x\u{1b}[2J",
            "a\r\nb",
            "a\u{202e}b",
            "a\u{2028}b",
            "é",
        ] {
            let err = parse(args(&["requeue", "--stage", stage, "5"]), &[]).unwrap_err();
            assert_eq!(err.code, 64, "{stage:?}");
            assert!(
                err.message
                    .contains("a stage name is one or more ASCII letters"),
                "{}",
                err.message
            );
            assert!(
                !err.message
                    .contains(['\u{1b}', '\r', '\u{202e}', '\u{2028}'])
            );
            let err =
                parse(args(&["inject", "--stage", stage, "-f", "a@x", "r@y"]), &[]).unwrap_err();
            assert_eq!(err.code, 64, "{stage:?}");
        }
        assert_eq!(code(&["requeue", "--stage", "", "5"]), 64);
        assert!(parse(args(&["requeue", "--stage", "dkim.sign-2_b", "5"]), &[]).is_ok());
    }

    #[test]
    fn repair_commands_need_ids_and_resume_needs_a_choice() {
        assert_eq!(
            ok(&["hold", "1", "2"]),
            Command::Repair {
                repair: Repair::Hold,
                ids: vec![1, 2],
                json: false
            }
        );
        assert_eq!(
            parse(args(&["delete", "-", "9"]), &[3, 4]).unwrap(),
            Command::Repair {
                repair: Repair::Delete,
                ids: vec![3, 4, 9],
                json: false
            }
        );
        assert_eq!(
            ok(&["requeue", "--stage", "relay", "5", "--json"]),
            Command::Requeue {
                stage: "relay".into(),
                ids: vec![5],
                json: true
            }
        );
        assert_eq!(
            ok(&["resume", "--status", "failed"]),
            Command::Resume {
                what: ResumeWhat::Matching {
                    stage: None,
                    status: Some("failed".into())
                },
                json: false
            }
        );
        assert_eq!(
            ok(&["resume", "--all"]),
            Command::Resume {
                what: ResumeWhat::Matching {
                    stage: None,
                    status: None
                },
                json: false
            }
        );
        assert_eq!(code(&["hold"]), 64);
        assert_eq!(code(&["hold", "0"]), 64);
        assert_eq!(code(&["release", "--stage", "x", "1"]), 64);
        assert_eq!(code(&["requeue", "1"]), 64);
        assert_eq!(code(&["resume"]), 64);
        assert_eq!(code(&["resume", "--status", "held"]), 64);
        assert_eq!(code(&["resume", "--stage", "a", "4"]), 64);
        assert!(Command::reads_ids_from_stdin(&args(&["hold", "-"])));
        assert!(!Command::reads_ids_from_stdin(&args(&["inject", "-"])));
    }

    #[test]
    fn config_commands() {
        assert_eq!(
            ok(&["config", "check"]),
            Command::ConfigCheck { json: false }
        );
        assert_eq!(
            ok(&["config", "check", "--json"]),
            Command::ConfigCheck { json: true }
        );
        assert_eq!(
            code(&["config", "set", "stage-a", "NEXT", "b", "--json"]),
            64
        );
        assert_eq!(
            ok(&["config", "set", "[stage-a]", "NEXT", "b"]),
            Command::ConfigSet {
                section: "stage-a".into(),
                key: "NEXT".into(),
                value: "b".into()
            }
        );
        assert_eq!(
            ok(&["config", "unset", "stage-a", "NEXT"]),
            Command::ConfigUnset {
                section: "stage-a".into(),
                key: "NEXT".into()
            }
        );
        assert_eq!(ok(&["config", "show"]), Command::ConfigShow { json: false });
        assert_eq!(
            ok(&["config", "show", "--json"]),
            Command::ConfigShow { json: true }
        );
        assert_eq!(code(&["config", "show", "stage-a"]), 64);
        assert_eq!(code(&["config", "check", "now"]), 64);
        assert_eq!(code(&["config", "unset", "stage-a", "NEXT", "--json"]), 64);
        assert_eq!(code(&["config", "set", "stage-a", "NEXT"]), 64);
        assert_eq!(code(&["config"]), 64);
        assert_eq!(code(&["config", "frob"]), 64);
        assert_eq!(code(&["metrics", "--output"]), 64);
    }

    #[test]
    fn destinations_list_or_lift_one_checked_in_lower_case() {
        assert_eq!(ok(&["destinations"]), Command::Destinations { json: false });
        assert_eq!(
            ok(&["destinations", "--json"]),
            Command::Destinations { json: true }
        );
        assert_eq!(
            ok(&["destinations", "lift", "Example.ORG", "--json"]),
            Command::LiftDestination {
                destination: "example.org".into(),
                json: true
            }
        );
        assert_eq!(
            ok(&["destinations", "--", "lift", "[192.0.2.1]"]),
            Command::LiftDestination {
                destination: "[192.0.2.1]".into(),
                json: false
            }
        );
        assert_eq!(code(&["destinations", "lift"]), 64);
        assert_eq!(
            code(&["destinations", "lift", "a.example", "b.example"]),
            64
        );
        assert_eq!(code(&["destinations", "lift", "a b"]), 64);
        assert_eq!(code(&["destinations", "lift", "x@example.org"]), 64);
        assert_eq!(code(&["destinations", "--limit", "3"]), 64);
        let e = parse(args(&["destinations", "frob\u{1b}"]), &[]).unwrap_err();
        assert_eq!(e.code, 64);
        assert!(
            e.message
                .starts_with("destinations: unexpected argument \"frob\\u{1b}\""),
            "{}",
            e.message
        );
        assert!(
            !e.message.contains("unknown command"),
            "no commands of its own"
        );
    }
}
