//! Each `pepsi-queue` command's own options, read into its [`Command`]: `list`, `show`,
//! `shape`, `inject`, `resume`, the id lists of the repair commands, `destinations`
//! (and its `lift`), and `config` (`check`, `show`, `set`, `unset`).
//!
//! Owns which options a command takes and how they combine; called by
//! [`super::parse`]. It reads arguments and checks shared values only through
//! [`super::options`] (and `lift`'s destination through the pure
//! `queue::destinations::checked`, `shape`'s key through `queue::shape::By`), and must
//! not touch the help text.

use std::ffi::OsString;
use std::net::IpAddr;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::options::{Arg, Args, address, id, stage_name, status, text, unexpected};
use super::{Command, DEFAULT_LIST_LIMIT, Inject, Input, RESUMABLE, ResumeWhat, STATUSES, usage};
use crate::escape::Visible;
use crate::exit::Failure;
use crate::queue::destinations;
use crate::queue::shape::{self, By};
use crate::queue::trace::{self, TraceKey};

/// `list [--stage S] [--status X] [--sender KEY] [--limit N] [--json]`.
pub(super) fn parse_list(args: &mut Args) -> Result<Command, Failure> {
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

/// `show ID [--headers] [--body] [--json]`.
pub(super) fn parse_show(args: &mut Args) -> Result<Command, Failure> {
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

/// `shape [--by KEY] [--top N] [--stage S] [--status X] [--json]`. A value of `--by`
/// or `--top` comes from the command line, so its usage error shows it escaped.
pub(super) fn parse_shape(args: &mut Args) -> Result<Command, Failure> {
    let (mut options, mut json) = (shape::Options::default(), false);
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--by" => {
                let v = args.value(&f)?;
                options.by = By::from_name(&v).ok_or_else(|| {
                    usage(format!(
                        "--by: unknown key \"{}\" ({})",
                        Visible(&v),
                        By::names()
                    ))
                })?;
            }
            Arg::Flag(f) if f == "--top" => {
                let v = args.value(&f)?;
                options.top = v.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    usage(format!(
                        "--top: \"{}\" is not a positive number",
                        Visible(&v)
                    ))
                })?;
            }
            Arg::Flag(f) if f == "--stage" => options.stage = Some(args.value(&f)?),
            Arg::Flag(f) if f == "--status" => {
                options.status = Some(status(&f, args.value(&f)?, STATUSES)?);
            }
            Arg::Flag(f) if f == "--json" => json = true,
            other => return Err(unexpected("shape", other)),
        }
    }
    Ok(Command::Shape { options, json })
}

/// `trace ID | --message-id ID | --remote-id ID [--json]`: exactly one key.
pub(super) fn parse_trace(args: &mut Args) -> Result<Command, Failure> {
    let (mut key, mut json) = (None, false);
    while let Some(arg) = args.next()? {
        let given = match arg {
            Arg::Flag(f) if f == "--json" => {
                json = true;
                continue;
            }
            Arg::Flag(f) if f == "--message-id" => {
                TraceKey::MessageId(trace::message_id(&args.value(&f)?))
            }
            Arg::Flag(f) if f == "--remote-id" => TraceKey::RemoteId(args.value(&f)?),
            Arg::Operand(o) => TraceKey::Id(id(&o)?),
            other => return Err(unexpected("trace", other)),
        };
        if key.replace(given).is_some() {
            return Err(usage("trace takes one of ID, --message-id and --remote-id"));
        }
    }
    let key = key.ok_or_else(|| usage("trace needs an ID, --message-id ID or --remote-id ID"))?;
    Ok(Command::Trace { key, json })
}

/// `inject`, with `--to` and a FILE or with the recipients as arguments (sendmail style).
pub(super) fn parse_inject(args: &mut Args) -> Result<Command, Failure> {
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
                let value = address(&f, args.value_os(&f)?)?;
                // `-f --to x`: the sender was left out, and the next option is no address.
                if value.starts_with('-') && !value.contains('@') {
                    return Err(usage(format!(
                        "{f} needs the sender's address before {value} ('' for the null sender)"
                    )));
                }
                from = Some(value);
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
            // sendmail's -fADDRESS with an address that is not UTF-8: bad data, as any
            // address that is not (an operand only because it is not text).
            Arg::Operand(o) if o.to_str().is_none() && o.as_bytes().starts_with(b"-f") => {
                let address_part = OsString::from_vec(o.as_bytes()[2..].to_vec());
                from = Some(address("-f", address_part)?);
            }
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
            let recipient = address("recipient", o)?;
            if recipient == "-" {
                return Err(usage(
                    "inject: '-' is no recipient: without --to the arguments are the \
                     recipients and the message is read from standard input; with --to \
                     ADDRESS, give the FILE or - after it",
                ));
            }
            if !recipient.contains('@') && Path::new(&recipient).is_file() {
                log::warn!(
                    "inject: the recipient {:?} is also the name of a file; without --to \
                     the arguments are the recipients and the message is read from \
                     standard input (give the file with --to ADDRESS FILE)",
                    crate::escape::Visible(&recipient)
                );
            }
            to.push(recipient);
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

/// `resume ID…`, or `resume` with `--stage`, `--status` or `--all`.
pub(super) fn parse_resume(args: &mut Args, stdin_ids: &[i64]) -> Result<Command, Failure> {
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
pub(super) fn parse_ids(
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

/// The ids (and `--json`) of a command that may take none.
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

/// `destinations [--json]` and `destinations lift DESTINATION [--json]`. An unknown
/// word is an unexpected argument: `destinations` lists without a command of its own.
pub(super) fn parse_destinations(args: &mut Args) -> Result<Command, Failure> {
    let (mut words, mut json) = (Vec::new(), false);
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Flag(f) if f == "--json" => json = true,
            Arg::Operand(o) => words.push(text("destinations", o)?),
            other => return Err(unexpected("destinations", other)),
        }
    }
    match &words[..] {
        [] => Ok(Command::Destinations { json }),
        [lift, destination] if lift == "lift" => Ok(Command::LiftDestination {
            destination: destinations::checked(destination)?,
            json,
        }),
        [lift] if lift == "lift" => Err(usage(
            "destinations lift needs a DESTINATION (a domain or an address literal)",
        )),
        [lift, ..] if lift == "lift" => Err(usage("destinations lift takes one DESTINATION")),
        [other, ..] => Err(usage(format!(
            "destinations: unexpected argument \"{}\" (destinations lists them; \
             destinations lift DESTINATION lifts a suspension)",
            Visible(other)
        ))),
    }
}

/// `config check [--json]`, `config show [--json]`, `config set SECTION KEY VALUE`,
/// `config unset SECTION KEY`.
pub(super) fn parse_config(args: &mut Args) -> Result<Command, Failure> {
    let mut words = Vec::new();
    let mut json = false;
    while let Some(arg) = args.next()? {
        match arg {
            Arg::Operand(o) => words.push(text("config", o)?),
            // Only `check` and `show` read; `set` and `unset` refuse it below.
            Arg::Flag(f) if f == "--json" => json = true,
            other => return Err(unexpected("config", other)),
        }
    }
    let section = |s: &str| s.trim_start_matches('[').trim_end_matches(']').to_string();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    if json && !matches!(words.first(), Some(&"check" | &"show")) {
        return Err(usage(
            "--json: only config check and config show read; set and unset take no --json",
        ));
    }
    match words[..] {
        ["check"] => Ok(Command::ConfigCheck { json }),
        ["show"] => Ok(Command::ConfigShow { json }),
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
        ["check" | "show", ..] => Err(usage(format!(
            "config {}: takes no argument but --json",
            words[0]
        ))),
        [] => Err(usage("config needs check, show, set or unset")),
        [other, ..] => Err(usage(format!(
            "config: unknown command {other:?} (check, show, set, unset)"
        ))),
    }
}
