//! What a stage body returns (§12.4, §13.2): its [`Outcome`] (advance, finish,
//! pause, split, bounce), the [`Notification`] a bounce carries, and its
//! [`StageError`] with the [`ErrorClass`] that says how the runtime handles it and the
//! [`DsnReason`] the sender reads should the row fail with it.
//!
//! Vocabulary only, shared by the stages (which return these), `stage.rs` (whose
//! `Configured::run` names them), `chain.rs` (which acts on an outcome), `errors.rs`
//! (which decides an error's fate) and `plan.rs` (a bounce's write). A leaf: it uses no
//! other file of the worker and must not touch the database or decide anything.

use std::fmt;
use std::time::Duration;

use crate::db::{self, ErrorKind};
use crate::escape::Visible;

/// What a stage decided for a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Move the row to this stage, pending (or run that stage here, when fused).
    Advance(String),
    /// The message is done: delete the row.
    Finish,
    /// Leave the row paused at this stage and retry it after the delay.
    Pause(Duration),
    /// Split the recipients into these groups; every group continues at the stage as
    /// its own pending row (the first on this row).
    Split {
        /// The recipient groups, which together are exactly the row's recipients.
        groups: Vec<Vec<String>>,
        /// The stage every group continues at.
        stage: String,
    },
    /// The message is done and this delivery status notification takes its place, as a
    /// new pending row (§13.2); both in one write.
    Bounce(Box<Notification>),
    /// Each recipient has its own result (done, deferred, failed): recipients that
    /// differ are split apart so each group gets its own outcome (§12.5, §17).
    Recipients(RecipientOutcomes),
}

/// A delivery status notification that replaces a failed message (§13.2): a new
/// message from the null sender to the failed message's sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The stage it goes to, pending.
    pub stage: String,
    /// Its one recipient: the failed message's envelope sender.
    pub recipient: String,
    /// Its `From:`, as extracted metadata.
    pub header_from: String,
    /// Its `Subject:`, as extracted metadata.
    pub subject: String,
    /// Its header block.
    pub headers: Vec<u8>,
    /// Its body.
    pub body: Vec<u8>,
}

/// The class of a stage error (§12.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The message itself is at fault: fail it at once.
    Permanent,
    /// The host is at fault (the default): pause and retry with backoff.
    Host,
    /// The database connection broke: answer 74, nothing committed.
    Connection,
    /// The database refused a connection for overload: answer 75.
    Overload,
}

/// An error a stage returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageError {
    /// How it is handled.
    pub class: ErrorClass,
    /// What happened (goes to `state.last_error` and the log).
    pub message: String,
    /// What the sender reads when the row fails with this error (§13.2), as the
    /// stage chose it; `None` leaves the status to the failure class.
    pub dsn: Option<DsnReason>,
}

/// The status and diagnostic a stage gives the sender of a message that fails with its
/// error: written as `state.dsn_status` and `state.dsn_diagnostic` when the row fails
/// (never while it is retried), for the bounce stage's report. Unlike the error's
/// message, which stays in `state.last_error`, this reaches the sender: a stage sets it
/// deliberately, with nothing of the host in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DsnReason {
    /// An RFC 3463 status, `5.x.x` or `4.x.x`.
    pub status: String,
    /// A `Diagnostic-Code` (`type; text`), if any.
    pub diagnostic: Option<String>,
}

impl StageError {
    /// A host error: a helper that cannot start, an unreadable file, a service down.
    pub fn host(message: impl Into<String>) -> StageError {
        StageError {
            class: ErrorClass::Host,
            message: db::storable(&message.into()),
            dsn: None,
        }
    }

    /// A host error for a delivery deferred for `reason` (a smarthost's 4xx, a
    /// connection that failed). Should the message expire deferred, its notification
    /// tells this reason (as Postfix's does: "connect to …: Connection refused"), with
    /// the status the reason gives (`452 4.2.2 …`), else 4.4.7.
    pub fn deferred(reason: impl Into<String>) -> StageError {
        let reason = reason.into();
        let dsn = DsnReason {
            status: enhanced(&reason, '4').unwrap_or(EXPIRED).to_string(),
            diagnostic: Some(format!("x-pepsi; {reason}")),
        };
        StageError::host(reason).with_dsn(dsn)
    }

    /// A permanent error: input the stage cannot parse, a construct it rejects.
    pub fn permanent(message: impl Into<String>) -> StageError {
        StageError {
            class: ErrorClass::Permanent,
            message: db::storable(&message.into()),
            dsn: None,
        }
    }

    /// This error with the status and diagnostic its sender reads should the row fail
    /// with it ([`DsnReason`]).
    pub fn with_dsn(mut self, reason: DsnReason) -> StageError {
        self.dsn = Some(reason);
        self
    }

    /// A database error, classified by SQLSTATE: connection and overload errors keep
    /// their own class, everything else is a host error.
    pub fn from_db(err: &postgres::Error) -> StageError {
        let class = match db::classify(err) {
            ErrorKind::Connection => ErrorClass::Connection,
            ErrorKind::Overload => ErrorClass::Overload,
            ErrorKind::Transient | ErrorKind::Other => ErrorClass::Host,
        };
        StageError {
            class,
            message: format!("database: {}", db::describe(err)),
            dsn: None,
        }
    }
}

/// The message for a log line: escaped ([`Visible`]), since it can quote a program's
/// output or a correspondent's setting.
/// The status of a message that expired while deferred, when its reason gives none.
const EXPIRED: &str = "4.4.7";

/// The first enhanced status code of class `class` (`2.0.0`, `4.2.2`) among the words
/// of `text`, as a reply quotes it (`452 4.2.2 mailbox full`).
pub fn enhanced(text: &str, class: char) -> Option<&str> {
    text.split_whitespace().find(|word| {
        let mut parts = word.split('.');
        parts
            .next()
            .is_some_and(|c| c.len() == 1 && c.starts_with(class))
            && parts.clone().count() == 2
            && parts.all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()))
    })
}

impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Visible(&self.message).fmt(f)
    }
}

/// What became of one recipient at a stage that hands each recipient its own result
/// (a relay: the smarthost answers per recipient). Carried by [`Outcome::Recipients`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecipientResult {
    /// Done here: it goes on to the outcome's `next` stage, or is finished.
    Done,
    /// A host error for this recipient alone (§12.4): it stays at the stage and is
    /// retried with backoff; the text goes to `state.last_error`.
    Deferred(String),
    /// A permanent failure for this recipient alone.
    Failed {
        /// What happened, for `state.last_error` and the log.
        error: String,
        /// Its enhanced status code (`5.1.1`), for `state.dsn_status`.
        status: String,
        /// Its `Diagnostic-Code` (`smtp; 550 5.1.1 …`), for `state.dsn_diagnostic`;
        /// already fit for a DSN header.
        diagnostic: Option<String>,
    },
}

impl RecipientResult {
    /// The kind of result, to group recipients that share one: 0 done, 1 deferred, 2
    /// failed.
    pub fn kind(&self) -> u8 {
        match self {
            RecipientResult::Done => 0,
            RecipientResult::Deferred(_) => 1,
            RecipientResult::Failed { .. } => 2,
        }
    }
}

/// The per-recipient outcome of [`Outcome::Recipients`]: every recipient of the row,
/// each with its result, and where the done ones go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecipientOutcomes {
    /// The stage done recipients advance to; `None` finishes them.
    pub next: Option<String>,
    /// Each recipient of the row (exactly as in `rcpt_to`) with its result.
    pub results: Vec<(String, RecipientResult)>,
    /// Where the message was handed, for the delivery log (`host[address]:port`).
    pub relay: Option<String>,
    /// The reply that accepted the message for the done recipients (`250 2.0.0 Ok:
    /// queued as 4F2K…`), for the delivery log.
    pub accepted: Option<String>,
}
