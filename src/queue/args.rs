//! The command line of `pepsi-queue` after the global options: the subcommand and its
//! own options, checked into a [`Command`] before anything is read or connected.
//!
//! Pure: it reads no file and no database. Every mistake is a usage error (exit 64)
//! naming the option or argument, except a recipient or sender of `inject` that is not
//! UTF-8, which is bad data (exit 65): the message it came with is refused, not the
//! command line's shape. Called by `queue::run` only.

use std::ffi::{OsStr, OsString};
use std::net::IpAddr;
use std::path::PathBuf;

use crate::config::graph;
use crate::exit::{EX_DATAERR, Failure};

use super::PROGRAM;

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
    /// `config check`.
    ConfigCheck,
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

/// A usage error naming the problem, with the synopsis.
pub fn usage(message: impl std::fmt::Display) -> Failure {
    Failure::usage(format!(
        "{message}\nusage: {} [GLOBAL OPTIONS] {}",
        PROGRAM.name, PROGRAM.synopsis
    ))
}

/// The arguments after the subcommand, one at a time, with `--name=value` split.
struct Args {
    items: std::vec::IntoIter<OsString>,
    /// The value of a `--name=value` just read, until taken.
    inline: Option<OsString>,
    /// `--` was seen: everything after is an operand.
    operands_only: bool,
}

/// One argument.
enum Arg {
    /// An option (`--name`, `-x`), its inline value kept in `Args::inline`.
    Flag(String),
    /// An operand.
    Operand(OsString),
}

impl Args {
    fn new(rest: Vec<OsString>) -> Args {
        Args {
            items: rest.into_iter(),
            inline: None,
            operands_only: false,
        }
    }

    fn next(&mut self) -> Result<Option<Arg>, Failure> {
        if let Some(v) = self.inline.take() {
            return Err(usage(format!(
                "unexpected value {:?} for an option that takes none",
                v.to_string_lossy()
            )));
        }
        let Some(arg) = self.items.next() else {
            return Ok(None);
        };
        if self.operands_only {
            return Ok(Some(Arg::Operand(arg)));
        }
        let Some(text) = arg.to_str() else {
            return Ok(Some(Arg::Operand(arg)));
        };
        if text == "--" {
            self.operands_only = true;
            return self.next();
        }
        if text == "-" || !text.starts_with('-') {
            return Ok(Some(Arg::Operand(arg)));
        }
        if let Some((name, value)) = text.split_once('=').filter(|_| text.starts_with("--")) {
            self.inline = Some(OsString::from(value));
            return Ok(Some(Arg::Flag(name.to_string())));
        }
        Ok(Some(Arg::Flag(text.to_string())))
    }

    /// The value of option `name`, as given.
    fn value_os(&mut self, name: &str) -> Result<OsString, Failure> {
        self.inline
            .take()
            .or_else(|| self.items.next())
            .ok_or_else(|| usage(format!("option {name} needs a value")))
    }

    /// The value of option `name`, which must be UTF-8.
    fn value(&mut self, name: &str) -> Result<String, Failure> {
        text(name, self.value_os(name)?)
    }
}

/// An argument that must be UTF-8.
fn text(what: &str, value: OsString) -> Result<String, Failure> {
    value.into_string().map_err(|v| {
        usage(format!(
            "{what}: {:?} is not valid UTF-8",
            v.to_string_lossy()
        ))
    })
}

/// An address argument of `inject`: not UTF-8 is bad data (exit 65).
fn address(what: &str, value: OsString) -> Result<String, Failure> {
    value.into_string().map_err(|v| {
        Failure::new(
            EX_DATAERR,
            format!(
                "{what}: the address {:?} is not valid UTF-8; nothing was injected",
                v.to_string_lossy()
            ),
        )
    })
}

/// The stage a command moves or puts messages at (`--stage` of `requeue` and
/// `inject`): a stage name the configuration could have a section for, else a usage
/// error (64).
fn stage_name(command: &str, stage: Option<String>) -> Result<String, Failure> {
    let stage = stage
        .filter(|s| !s.is_empty())
        .ok_or_else(|| usage(format!("{command} needs --stage STAGE")))?;
    if !graph::valid_stage_name(&stage) {
        return Err(usage(format!(
            "--stage {stage:?}: {}",
            graph::STAGE_NAME_RULE
        )));
    }
    Ok(stage)
}

/// A message id.
fn id(value: &OsStr) -> Result<i64, Failure> {
    let text = value.to_string_lossy();
    match text.parse::<i64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(usage(format!(
            "{text:?} is not a message id (a positive whole number)"
        ))),
    }
}

/// Ids read from standard input (for an id argument `-`): whitespace-separated.
pub fn ids_from_text(text: &str) -> Result<Vec<i64>, Failure> {
    text.split_whitespace().map(|w| id(OsStr::new(w))).collect()
}

/// Checks a status name against `allowed`.
fn status(option: &str, value: String, allowed: &[&str]) -> Result<String, Failure> {
    if allowed.contains(&value.as_str()) {
        Ok(value)
    } else {
        Err(usage(format!(
            "{option}: unknown status {value:?} ({})",
            allowed.join(", ")
        )))
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
        "config" => parse_config(&mut args),
        other => Err(usage(format!(
            "unknown command {other:?} (status, list, show, inject, resume, hold, release, \
             delete, requeue, metrics, config)"
        ))),
    }
}

/// The error for an argument a command does not take.
fn unexpected(command: &str, arg: Arg) -> Failure {
    match arg {
        Arg::Flag(f) => usage(format!("{command}: unknown option {f}")),
        Arg::Operand(o) => usage(format!(
            "{command}: unexpected argument {:?}",
            o.to_string_lossy()
        )),
    }
}

fn parse_list(args: &mut Args) -> Result<Command, Failure> {
    let (mut stage, mut status_, mut sender, mut limit, mut json) =
        (None, None, None, DEFAULT_LIST_LIMIT, false);
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--stage" => stage = Some(args.value(&f)?),
            Arg::Flag(f) if f == "--status" => {
                status_ = Some(status(&f, args.value(&f)?, STATUSES)?);
            }
            Arg::Flag(f) if f == "--sender" => sender = Some(args.value(&f)?),
            Arg::Flag(f) if f == "--limit" => {
                let v = args.value(&f)?;
                limit = v
                    .parse::<i64>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| usage(format!("--limit: {v:?} is not a positive number")))?;
            }
            Arg::Flag(f) if f == "--json" => json = true,
            other => return Err(unexpected("list", other)),
        }
    }
    Ok(Command::List {
        stage,
        status: status_,
        sender,
        limit,
        json,
    })
}

fn parse_show(args: &mut Args) -> Result<Command, Failure> {
    let (mut the_id, mut headers, mut body, mut json) = (None, false, false, false);
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--headers" => headers = true,
            Arg::Flag(f) if f == "--body" => body = true,
            Arg::Flag(f) if f == "--json" => json = true,
            Arg::Operand(o) if the_id.is_none() => the_id = Some(id(&o)?),
            other => return Err(unexpected("show", other)),
        }
    }
    let id = the_id.ok_or_else(|| usage("show needs a message id"))?;
    Ok(Command::Show {
        id,
        headers,
        body,
        json,
    })
}

fn parse_inject(args: &mut Args) -> Result<Command, Failure> {
    let mut stage = None;
    let mut from = None;
    let mut to = Vec::new();
    let mut operands = Vec::new();
    let mut auth_user = None;
    let mut client_ip = None;
    let mut local = false;
    let mut state = None;
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--stage" => stage = Some(args.value(&f)?),
            Arg::Flag(f) if f == "--from" || f == "-f" => {
                from = Some(address(&f, args.value_os(&f)?)?);
            }
            // sendmail's -fADDRESS.
            Arg::Flag(f) if f.starts_with("-f") && !f.starts_with("--") => {
                from = Some(f[2..].to_string());
            }
            Arg::Flag(f) if f == "--to" => to.push(address(&f, args.value_os(&f)?)?),
            Arg::Flag(f) if f == "--auth-user" => {
                auth_user = Some(args.value(&f)?).filter(|s| !s.is_empty());
            }
            Arg::Flag(f) if f == "--client-ip" => {
                // Empty is none: what an MTA's macro gives for mail submitted locally.
                let v = args.value(&f)?;
                client_ip = match v.as_str() {
                    "" => None,
                    _ => Some(v.parse::<IpAddr>().map_err(|_| {
                        usage(format!("--client-ip: {v:?} is not an IPv4 or IPv6 address"))
                    })?),
                };
            }
            Arg::Flag(f) if f == "--local" => local = true,
            Arg::Flag(f) if f == "--state" => {
                let v = args.value(&f)?;
                match serde_json::from_str::<serde_json::Value>(&v) {
                    Ok(serde_json::Value::Object(map)) => state = Some(map),
                    _ => return Err(usage(format!("--state: {v:?} is not a JSON object"))),
                }
            }
            // sendmail compatibility: a lone dot does not end the message here anyway.
            Arg::Flag(f) if f == "-i" || f == "-oi" => {}
            Arg::Operand(o) => operands.push(o),
            other => return Err(unexpected("inject", other)),
        }
    }
    let stage = stage_name("inject", stage)?;
    let from = from.ok_or_else(|| {
        usage("inject needs the envelope sender: --from ADDRESS or -f ADDRESS ('' for the null sender)")
    })?;
    // With --to, the one operand is the message file; without, every operand is a
    // recipient and the message comes from standard input (sendmail style).
    let input = if to.is_empty() {
        for o in operands {
            to.push(address("recipient", o)?);
        }
        Input::Stdin
    } else {
        match operands.len() {
            0 => Input::Stdin,
            1 if operands[0] == "-" => Input::Stdin,
            1 => Input::File(PathBuf::from(operands.remove(0))),
            _ => {
                return Err(usage(
                    "inject: with --to, give at most one FILE (or - for standard input); \
                     without --to, the arguments are the recipients",
                ));
            }
        }
    };
    if to.is_empty() {
        return Err(usage(
            "inject needs at least one recipient (--to ADDRESS, or recipients as arguments)",
        ));
    }
    Ok(Command::Inject(Box::new(Inject {
        stage,
        from,
        to,
        input,
        auth_user,
        client_ip,
        local,
        state,
    })))
}

fn parse_resume(args: &mut Args, stdin_ids: &[i64]) -> Result<Command, Failure> {
    let (mut stage, mut status_, mut all) = (None, None, false);
    let (ids, json) = parse_ids_or_none("resume", args, stdin_ids, |flag, args| {
        match flag {
            "--stage" => stage = Some(args.value(flag)?),
            "--status" => status_ = Some(status(flag, args.value(flag)?, RESUMABLE)?),
            "--all" => all = true,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let filtered = stage.is_some() || status_.is_some() || all;
    let what = match (ids.is_empty(), filtered) {
        (false, false) => ResumeWhat::Ids(ids),
        (true, true) => ResumeWhat::Matching {
            stage,
            status: status_,
        },
        (true, false) => {
            return Err(usage(
                "resume needs message ids, --stage, --status, or --all (every paused, failed \
                 and timeout message)",
            ));
        }
        (false, true) => {
            return Err(usage(
                "resume takes either message ids or --stage/--status/--all, not both",
            ));
        }
    };
    Ok(Command::Resume { what, json })
}

/// The ids (and `--json`) of a repair command, at least one; `extra` handles the
/// command's own options and answers whether it knew the flag.
fn parse_ids(
    command: &str,
    args: &mut Args,
    stdin_ids: &[i64],
    extra: impl FnMut(&str, &mut Args) -> Result<bool, Failure>,
) -> Result<(Vec<i64>, bool), Failure> {
    let (ids, json) = parse_ids_or_none(command, args, stdin_ids, extra)?;
    if ids.is_empty() {
        return Err(usage(format!(
            "{command} needs message ids (or - to read them from standard input)"
        )));
    }
    Ok((ids, json))
}

fn parse_ids_or_none(
    command: &str,
    args: &mut Args,
    stdin_ids: &[i64],
    mut extra: impl FnMut(&str, &mut Args) -> Result<bool, Failure>,
) -> Result<(Vec<i64>, bool), Failure> {
    let (mut ids, mut json) = (Vec::new(), false);
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--json" => json = true,
            Arg::Flag(f) => {
                if !extra(&f, args)? {
                    return Err(unexpected(command, Arg::Flag(f)));
                }
            }
            Arg::Operand(o) if o == "-" => ids.extend_from_slice(stdin_ids),
            Arg::Operand(o) => ids.push(id(&o)?),
        }
    }
    Ok((ids, json))
}

fn parse_config(args: &mut Args) -> Result<Command, Failure> {
    let mut words = Vec::new();
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Operand(o) => words.push(text("config", o)?),
            other => return Err(unexpected("config", other)),
        }
    }
    let section = |s: &str| s.trim_start_matches('[').trim_end_matches(']').to_string();
    match words.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["check"] => Ok(Command::ConfigCheck),
        ["set", s, key, value] => Ok(Command::ConfigSet {
            section: section(s),
            key: key.to_string(),
            value: value.to_string(),
        }),
        ["unset", s, key] => Ok(Command::ConfigUnset {
            section: section(s),
            key: key.to_string(),
        }),
        ["set", ..] => Err(usage("config set needs SECTION KEY VALUE")),
        ["unset", ..] => Err(usage("config unset needs SECTION KEY")),
        [] => Err(usage("config needs check, set or unset")),
        [other, ..] => Err(usage(format!(
            "config: unknown command {other:?} (check, set, unset)"
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
        assert_eq!(ok(&["config", "check"]), Command::ConfigCheck);
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
        assert_eq!(code(&["config", "set", "stage-a", "NEXT"]), 64);
        assert_eq!(code(&["config"]), 64);
        assert_eq!(code(&["config", "show"]), 64);
        assert_eq!(code(&["metrics", "--output"]), 64);
    }
}
