//! The arguments of a `pepsi-queue` command one at a time (`--name=value` split, `--`
//! ending the options), and the checks of values several commands share: UTF-8 text,
//! addresses, stage names, message ids, statuses, and the usage error itself.
//!
//! Owns the lexing and those checks; called by [`super`], [`super::commands`] and
//! `queue::settings::args` (the commands of `pepsi-settings`). It knows no command's
//! options and must not decide which options a command takes.

use std::ffi::{OsStr, OsString};

use crate::config::graph;
use crate::exit::{EX_DATAERR, Failure};
use crate::queue::PROGRAM;

/// A usage error naming the problem, with the synopsis.
pub fn usage(message: impl std::fmt::Display) -> Failure {
    Failure::usage(format!(
        "{message}\nusage: {} [GLOBAL OPTIONS] {}",
        PROGRAM.name, PROGRAM.synopsis
    ))
}

/// The arguments after the subcommand, one at a time, with `--name=value` split.
pub(in crate::queue) struct Args {
    items: std::vec::IntoIter<OsString>,
    /// The value of a `--name=value` just read, until taken.
    inline: Option<OsString>,
    /// `--` was seen: everything after is an operand.
    operands_only: bool,
}

/// One argument.
pub(in crate::queue) enum Arg {
    /// An option (`--name`, `-x`), its inline value kept in `Args::inline`.
    Flag(String),
    /// An operand.
    Operand(OsString),
}

impl Args {
    /// The arguments after the subcommand.
    pub(in crate::queue) fn new(rest: Vec<OsString>) -> Args {
        Args {
            items: rest.into_iter(),
            inline: None,
            operands_only: false,
        }
    }

    /// The next argument, or None at the end; a `--name=value` value left untaken is
    /// a usage error.
    pub(in crate::queue) fn next(&mut self) -> Result<Option<Arg>, Failure> {
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
    pub(in crate::queue) fn value_os(&mut self, name: &str) -> Result<OsString, Failure> {
        self.inline
            .take()
            .or_else(|| self.items.next())
            .ok_or_else(|| usage(format!("option {name} needs a value")))
    }

    /// The value of option `name`, which must be UTF-8.
    pub(in crate::queue) fn value(&mut self, name: &str) -> Result<String, Failure> {
        text(name, self.value_os(name)?)
    }
}

/// An argument that must be UTF-8.
pub(in crate::queue) fn text(what: &str, value: OsString) -> Result<String, Failure> {
    value.into_string().map_err(|v| {
        usage(format!(
            "{what}: {:?} is not valid UTF-8",
            v.to_string_lossy()
        ))
    })
}

/// An address argument of `inject`: not UTF-8 is bad data (exit 65).
pub(super) fn address(what: &str, value: OsString) -> Result<String, Failure> {
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
pub(super) fn stage_name(command: &str, stage: Option<String>) -> Result<String, Failure> {
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
pub(super) fn id(value: &OsStr) -> Result<i64, Failure> {
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
pub(super) fn status(option: &str, value: String, allowed: &[&str]) -> Result<String, Failure> {
    if allowed.contains(&value.as_str()) {
        return Ok(value);
    }
    let known = super::STATUSES.contains(&value.as_str());
    Err(usage(match (known, value.as_str()) {
        (true, "held") if !allowed.contains(&"held") => format!(
            "{option}: held messages are not taken here ({}); release them with pepsi-queue release ID…",
            allowed.join(", ")
        ),
        (true, _) => format!(
            "{option}: {value} messages are not taken here ({})",
            allowed.join(", ")
        ),
        (false, _) => format!(
            "{option}: unknown status {value:?} ({})",
            allowed.join(", ")
        ),
    }))
}

/// The error for an argument a command does not take.
pub(in crate::queue) fn unexpected(command: &str, arg: Arg) -> Failure {
    match arg {
        Arg::Flag(f) => usage(format!("{command}: unknown option {f}")),
        Arg::Operand(o) => usage(format!(
            "{command}: unexpected argument {:?}",
            o.to_string_lossy()
        )),
    }
}
