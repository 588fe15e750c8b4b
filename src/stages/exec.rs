//! `pepsi-stage-exec`: pipes the message to an external command, like Postfix
//! `pipe(8)`. Loads headers and body; not fusable by default.
//!
//! `COMMAND` is split on whitespace into argv (no shell). The command's stdin is the
//! header block, a blank line if the block lacks its own, then the body; its recipients
//! come one per line on descriptor 3, a pipe (`PEPSI_RECIPIENTS_FD=3`), which has no
//! size limit; its environment is only `PEPSI_ID`, `PEPSI_STAGE`, `PEPSI_SENDER`,
//! `PEPSI_RECIPIENTS` (comma-separated), `PEPSI_SENDER_KEY`, `PEPSI_RECIPIENTS_FD`,
//! `PATH`, `HOME` and `LANG`; its stdout is discarded. It runs through the worker's
//! keeper (`crate::keeper`): as the stage's `USER` (by default `pepsi-exec`) when the
//! dispatcher was started as root, with no descriptor of the worker's, and whatever it
//! leaves behind is killed when it ends. `TIMEOUT` (default 60s) bounds it, after
//! which it and everything it started are killed. Exit 0 advances to `NEXT` (or
//! finishes the message without one); 64–78 except 75 is a permanent error whose
//! sender reads the status Postfix's `pipe(8)` gives that exit, or the status and
//! diagnostic of the first line of its stderr when that line starts with one
//! (`sysexits.rs`); anything else, a signal or the timeout is a host error. At most
//! the last 1 KiB of its stderr goes into `state.last_error`.
//!
//! `RECIPIENT_LIMIT` (default unlimited) splits a row with more recipients into rows of
//! at most that many at this stage, before anything runs: each group is then its own
//! invocation with its own outcome. A row the system refuses to start the command for
//! (`E2BIG`: `PEPSI_RECIPIENTS` beyond the 128 KiB of one variable, above all) is split
//! in two the same way, and one with a single recipient fails with 5.3.4: never a host
//! error retried for days.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision (the exit
//! status mapped to an outcome or an error); running the command is the keeper's; it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use super::sysexits;
use crate::config::raw::show_duration;
use crate::config::{Config, ConfigError, Section, StageSection};
use crate::escape::Visible;
use crate::keeper::Reserved;
use crate::keeper::client::{Keeper, RunError};
use crate::keeper::wire;
use crate::worker::{Configured, Context, DsnReason, Load, Message, Outcome, Stage, StageError};

/// How long a command may run when the section says nothing (`TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The stage.
pub struct Exec;

/// The status of a message whose envelope the system refuses to pass to the command
/// even alone (RFC 3463: message too big for system).
const TOO_BIG_STATUS: &str = "5.3.4";
/// How much of the command's stderr is kept.
const STDERR_KEPT: usize = 1024;
/// How much of the start of the command's stderr is kept for its first line.
const STDERR_HEAD: usize = 512;
/// How long to wait for stderr to close after the command exited.
const STDERR_GRACE: Duration = Duration::from_secs(1);

struct ConfiguredExec {
    argv: Vec<String>,
    timeout: Duration,
    /// `RECIPIENT_LIMIT`: the most recipients of one invocation (`None`: unlimited).
    recipient_limit: Option<usize>,
    next: Option<String>,
    /// `USER`, when the section sets it.
    user: Option<String>,
}

/// This worker's keeper, made at start (or at the first command of a worker that runs
/// this stage fused into another's pass).
static KEEPER: Mutex<Option<Keeper>> = Mutex::new(None);

/// The account a private keeper (one this worker started, running as the worker) is
/// asked to run the command as, by [`crate::keeper::command_account`]'s rules for
/// this process: empty to stay the worker's.
fn private_user(user: Option<&str>, reserved: Reserved<'_>) -> Result<String, String> {
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    crate::keeper::command_account(user, reserved, as_root).map(Option::unwrap_or_default)
}

/// The keeper to run through: the process's, made now if it has none (a keeper handed
/// over by the dispatcher is adopted; otherwise one of the worker's own is started).
fn with_keeper<T>(run: impl FnOnce(&Keeper) -> T) -> Result<T, String> {
    let mut keeper = KEEPER.lock().unwrap_or_else(|p| p.into_inner());
    if keeper.is_none() {
        *keeper = Some(match Keeper::inherited()? {
            Some(k) => k,
            None => Keeper::private()?,
        });
    }
    Ok(run(keeper.as_ref().expect("made above")))
}

impl Stage for Exec {
    fn name(&self) -> &'static str {
        "exec"
    }

    fn loads(&self) -> Load {
        Load::Full
    }

    fn fusion_default(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &["COMMAND", "RECIPIENT_LIMIT", "TIMEOUT", "USER"]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &["TIMEOUT"]
    }

    /// A command allowed as long as MAX_RUNTIME would never get to its own `TIMEOUT`.
    fn runtime_warning(&self, section: &Section, max_runtime: Duration) -> Option<ConfigError> {
        let timeout = section.duration("TIMEOUT", DEFAULT_TIMEOUT).ok()?;
        (timeout >= max_runtime).then(|| {
            section.error(
                "TIMEOUT",
                format!(
                    "{} is not below [pepsi-dispatch] MAX_RUNTIME ({}): a command still running at MAX_RUNTIME has its worker killed and its message struck, before TIMEOUT would make it a host error",
                    show_duration(timeout),
                    show_duration(max_runtime)
                ),
            )
        })
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let argv: Vec<String> = s
            .required("COMMAND")?
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if argv.is_empty() {
            return Err(s.error("COMMAND", "is empty"));
        }
        let timeout = s.duration("TIMEOUT", DEFAULT_TIMEOUT)?;
        if timeout.is_zero() {
            return Err(s.error("TIMEOUT", "must be greater than zero"));
        }
        let recipient_limit = match s.get("RECIPIENT_LIMIT") {
            None => None,
            Some(_) => Some(s.number("RECIPIENT_LIMIT", 1, 1..=u32::MAX)? as usize),
        };
        let user = s.get("USER").map(str::to_string);
        if let Some(u) = &user {
            // An account name as adduser takes it; root never.
            let name_ok = u.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && u.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-".contains(c));
            if !name_ok || u.len() > 32 {
                return Err(s.error("USER", format!("{u:?} is not an account name")));
            }
            if u == "root" {
                return Err(s.error("USER", "root is refused: a command never runs as root"));
            }
        }
        Ok(Box::new(ConfiguredExec {
            argv,
            timeout,
            recipient_limit,
            next: section.next.clone(),
            user,
        }))
    }

    /// Makes the worker's keeper now, so that a keeper that refuses (the stage's `USER`
    /// does not exist, or is `RUN_AS`) or a `USER` this worker cannot switch to stops
    /// the stage at start, with the reason, rather than failing every message.
    fn start(&self, config: &Config, section: &StageSection) -> Result<(), String> {
        let user = section.section.get("USER");
        let fixed = with_keeper(|k| k.fixed)?;
        if !fixed {
            private_user(user, Reserved::of(&config.pepsi))?;
        }
        Ok(())
    }
}

/// Reads a stream to its end, keeping only its first `STDERR_HEAD` bytes (where the
/// line that may give the sender a status is) and its last `STDERR_KEPT` bytes (a
/// chatty command must not fill the worker's memory).
fn read_stderr(input: &mut impl Read) -> (Vec<u8>, Vec<u8>) {
    let mut head = Vec::new();
    let mut kept = Vec::with_capacity(2 * STDERR_KEPT);
    let mut chunk = [0u8; 8192];
    loop {
        match input.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                let room = STDERR_HEAD.saturating_sub(head.len()).min(n);
                head.extend_from_slice(&chunk[..room]);
                kept.extend_from_slice(&chunk[..n]);
                if kept.len() > STDERR_KEPT {
                    kept.drain(..kept.len() - STDERR_KEPT);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    (head, kept)
}

/// The last `STDERR_KEPT` bytes of the command's stderr, as text.
fn tail(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(STDERR_KEPT);
    String::from_utf8_lossy(&bytes[start..]).trim().to_string()
}

/// The message as the command reads it.
fn message_text(message: &Message) -> Vec<u8> {
    let headers = message.headers().unwrap_or_default();
    let body = message.body().unwrap_or_default();
    let mut text = Vec::with_capacity(headers.len() + body.len() + 2);
    text.extend_from_slice(headers);
    let ended = headers.is_empty() || headers.ends_with(b"\n\n") || headers.ends_with(b"\r\n\r\n");
    if !ended {
        if !headers.ends_with(b"\n") {
            text.extend_from_slice(b"\r\n");
        }
        text.extend_from_slice(if headers.ends_with(b"\r\n") || !headers.ends_with(b"\n") {
            b"\r\n"
        } else {
            b"\n"
        });
    }
    text.extend_from_slice(body);
    text
}

/// How a run of the command ended, when it did not time out.
enum Ran {
    /// It exited or was killed by a signal: its status, the first bytes of its stderr
    /// and the tail kept for `last_error`.
    Ended {
        status: ExitStatus,
        head: Vec<u8>,
        tail: String,
    },
    /// The system refused its argument list or environment as too large (`E2BIG`):
    /// it never ran.
    TooBig(String),
}

impl ConfiguredExec {
    /// Runs the command on `message` through the keeper: how it ended, or a host error
    /// (it could not start, or was killed at `TIMEOUT`).
    fn execute(
        &self,
        message: &Message,
        stage: &str,
        reserved: Reserved<'_>,
    ) -> Result<Ran, StageError> {
        let env: Vec<(&str, String)> = [
            ("PEPSI_ID", message.id.to_string()),
            ("PEPSI_STAGE", stage.to_string()),
            ("PEPSI_SENDER", message.mail_from().to_string()),
            ("PEPSI_RECIPIENTS", message.rcpt_to().join(",")),
            ("PEPSI_SENDER_KEY", message.sender_key.clone()),
        ]
        .into_iter()
        .chain(std::env::var("LANG").ok().map(|l| ("LANG", l)))
        .collect();
        let program = &self.argv[0];
        let host = |e: std::io::Error| StageError::host(format!("cannot start {program}: {e}"));
        let (command_in, to_command) = wire::pipe().map_err(host)?;
        let (from_command, command_err) = wire::pipe().map_err(host)?;
        let (recipients_in, to_recipients) = wire::pipe().map_err(host)?;
        let (mut to_command, mut from_command, mut to_recipients) = (
            std::fs::File::from(to_command),
            std::fs::File::from(from_command),
            std::fs::File::from(to_recipients),
        );
        // Written from threads so a command that does not read cannot deadlock us;
        // a command that exits early (or never starts: the reading ends go with the
        // request) makes the write fail, which is fine.
        let text = message_text(message);
        std::thread::spawn(move || {
            let _ = to_command.write_all(&text);
        });
        let mut list = message.rcpt_to().join("\n");
        list.push('\n');
        std::thread::spawn(move || {
            let _ = to_recipients.write_all(list.as_bytes());
        });
        let (err_tx, err_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = err_tx.send(read_stderr(&mut from_command));
        });
        let waited = with_keeper(|keeper| -> Result<Option<i32>, RunError> {
            let user = if keeper.fixed {
                String::new()
            } else {
                private_user(self.user.as_deref(), reserved).map_err(|e| RunError::Start {
                    errno: 0,
                    message: e,
                })?
            };
            keeper.run(
                &user,
                &self.argv,
                &env,
                [command_in, command_err, recipients_in],
            )?;
            if let Some(status) = keeper.wait(Some(self.timeout))? {
                return Ok(Some(status));
            }
            keeper.kill()?;
            // Killed: the keeper reports the end, which comes at once.
            keeper.wait(None)?;
            Ok(None)
        })
        .map_err(|e| StageError::host(format!("cannot start {program}: {e}")))?;
        let (head, tail_bytes) = err_rx.recv_timeout(STDERR_GRACE).unwrap_or_default();
        let err_text = tail(&tail_bytes);
        match waited {
            Ok(Some(raw)) => Ok(Ran::Ended {
                status: ExitStatus::from_raw(raw),
                head,
                tail: err_text,
            }),
            Ok(None) => Err(StageError::host(with_stderr(
                format!(
                    "{program} timed out after {}s and was killed",
                    self.timeout.as_secs()
                ),
                &err_text,
            ))),
            Err(RunError::Start { errno, message }) if errno == libc::E2BIG => {
                Ok(Ran::TooBig(message))
            }
            Err(RunError::Start { message, .. }) => {
                Err(StageError::host(with_stderr(message, &err_text)))
            }
            Err(e @ RunError::Lost(_)) => Err(StageError::host(format!("{program}: {e}"))),
        }
    }

    /// The outcome of a command that ran: exit 0 advances; a permanent exit status fails
    /// the message with the status Postfix's `pipe(8)` gives it, or the one the first
    /// line of its stderr gives; anything else is a host error.
    fn decide(&self, status: ExitStatus, head: &[u8], stderr: &str) -> Result<Outcome, StageError> {
        let program = &self.argv[0];
        match (status.code(), status.signal()) {
            (Some(0), _) => Ok(match &self.next {
                Some(next) => Outcome::Advance(next.clone()),
                None => Outcome::Finish,
            }),
            (Some(code), _) if sysexits::permanent_status(code).is_some() => {
                let error = StageError::permanent(with_stderr(
                    format!("{program} exited with status {code}"),
                    stderr,
                ));
                Err(with_reason(
                    error,
                    sysexits::reason(head, '5', sysexits::permanent_status(code)),
                ))
            }
            (Some(code), _) => Err(with_reason(
                StageError::host(with_stderr(
                    format!("{program} exited with status {code}"),
                    stderr,
                )),
                sysexits::reason(head, '4', None),
            )),
            (None, signal) => Err(with_reason(
                StageError::host(with_stderr(
                    format!("{program} was killed by signal {}", signal.unwrap_or(0)),
                    stderr,
                )),
                sysexits::reason(head, '4', None),
            )),
        }
    }
}

/// `error` with the sender's status and diagnostic, when there is one.
fn with_reason(error: StageError, reason: Option<DsnReason>) -> StageError {
    match reason {
        Some(r) => error.with_dsn(r),
        None => error,
    }
}

fn with_stderr(what: String, stderr: &str) -> String {
    if stderr.is_empty() {
        what
    } else {
        format!("{what}: {stderr}")
    }
}

/// The recipients in groups of at most `limit`, in their order.
fn groups_of(recipients: &[String], limit: usize) -> Vec<Vec<String>> {
    recipients
        .chunks(limit.max(1))
        .map(<[String]>::to_vec)
        .collect()
}

/// A message the system would not start the command for (`E2BIG`: its environment, the
/// recipients above all, too large): split in two, each half at this stage again, or,
/// with one recipient, failed with 5.3.4, never retried as a host error.
fn too_big(message: &Message, stage: &str, why: String) -> Result<Outcome, StageError> {
    let rcpt = message.rcpt_to();
    if rcpt.len() > 1 {
        log::info!(
            "{stage}: message {}: {}; splitting its {} recipients in two",
            message.id,
            Visible(&why),
            rcpt.len()
        );
        return Ok(Outcome::Split {
            groups: groups_of(rcpt, rcpt.len().div_ceil(2)),
            stage: stage.to_string(),
        });
    }
    Err(StageError::permanent(why).with_dsn(DsnReason {
        status: TOO_BIG_STATUS.to_string(),
        diagnostic: Some(format!(
            "{}; {TOO_BIG_STATUS} the envelope is too large for the delivery command",
            sysexits::DIAGNOSTIC_TYPE
        )),
    }))
}

impl Configured for ConfiguredExec {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let stage = &cx.section.name;
        let rcpt = message.rcpt_to();
        if let Some(limit) = self.recipient_limit.filter(|l| rcpt.len() > *l) {
            // Each group its own invocation and outcome: the first stays on this row,
            // the others become rows of their own, all pending at this stage.
            let groups = groups_of(rcpt, limit);
            log::info!(
                "{stage}: message {}: {} recipients, RECIPIENT_LIMIT {limit}: split into {} rows",
                message.id,
                rcpt.len(),
                groups.len()
            );
            return Ok(Outcome::Split {
                groups,
                stage: stage.clone(),
            });
        }
        match self.execute(message, stage, Reserved::of(cx.pepsi))? {
            Ran::TooBig(why) => too_big(message, stage, why),
            Ran::Ended { status, head, tail } => self.decide(status, &head, &tail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn with(headers: &[u8], body: &[u8]) -> Vec<u8> {
        let mut m = Message::new(
            1,
            "x".into(),
            String::new(),
            vec!["r@x".into()],
            None,
            None,
            Map::new(),
            String::new(),
        );
        m.set_content(Some(headers.to_vec()), Some(body.to_vec()));
        message_text(&m)
    }

    #[test]
    fn the_header_block_is_separated_from_the_body_once() {
        assert_eq!(with(b"A: 1\r\n", b"body"), b"A: 1\r\n\r\nbody");
        assert_eq!(with(b"A: 1\r\n\r\n", b"body"), b"A: 1\r\n\r\nbody");
        assert_eq!(with(b"A: 1\n", b"body"), b"A: 1\n\nbody");
        assert_eq!(with(b"A: 1", b"body"), b"A: 1\r\n\r\nbody");
        assert_eq!(with(b"", b"body"), b"body");
    }

    #[test]
    fn stderr_is_cut_to_its_last_kilobyte() {
        let long = vec![b'x'; 5000];
        assert_eq!(tail(&long).len(), STDERR_KEPT);
        assert_eq!(tail(b"  oops\n"), "oops");
        let mut stream: Vec<u8> = vec![b'x'; 100_000];
        stream.extend_from_slice(b"the end");
        stream.splice(0..0, b"5.1.1 first\n".iter().copied());
        let (head, kept) = read_stderr(&mut stream.as_slice());
        assert_eq!(kept.len(), STDERR_KEPT);
        assert!(kept.ends_with(b"xthe end"));
        assert_eq!(head.len(), STDERR_HEAD);
        assert!(head.starts_with(b"5.1.1 first\nxx"));
    }

    #[test]
    fn a_blank_command_is_a_configuration_error() {
        use crate::config::raw::{self, Origin};
        let mut sections = raw::parse(
            std::path::Path::new("pepsi.conf"),
            "[stage-x]\nPROGRAM = p\nCOMMAND = /bin/true\n",
        )
        .unwrap();
        let mut section = sections.remove(0);
        let ok = StageSection::check(&section).unwrap();
        assert!(Exec.configure(&ok).is_ok());
        section.set("COMMAND", " \t ", Origin::Address("r@y.example".into()));
        let blank = StageSection::check(&section).unwrap();
        let err = Exec.configure(&blank).err().expect("refused");
        assert!(err.to_string().contains("COMMAND: is empty"), "{err}");
    }

    fn section(text: &str) -> StageSection {
        use crate::config::raw;
        let mut sections = raw::parse(std::path::Path::new("pepsi.conf"), text).unwrap();
        StageSection::check(&sections.remove(0)).unwrap()
    }

    #[test]
    fn recipient_limit_is_a_positive_number_and_unlimited_without_it() {
        let base = "[stage-x]\nPROGRAM = p\nCOMMAND = /bin/true\n";
        for (line, ok) in [
            ("", true),
            ("RECIPIENT_LIMIT = 1\n", true),
            ("RECIPIENT_LIMIT = 50\n", true),
            ("RECIPIENT_LIMIT = 0\n", false),
            ("RECIPIENT_LIMIT = -3\n", false),
            ("RECIPIENT_LIMIT = many\n", false),
        ] {
            let result = Exec.configure(&section(&format!("{base}{line}")));
            assert_eq!(result.is_ok(), ok, "{line:?}");
        }
    }

    #[test]
    fn recipients_are_grouped_in_order_by_the_limit() {
        let r: Vec<String> = ["a@x", "b@x", "c@x", "d@x", "e@x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            groups_of(&r, 2),
            [vec!["a@x", "b@x"], vec!["c@x", "d@x"], vec!["e@x"]]
        );
        assert_eq!(groups_of(&r, 1).len(), 5);
        assert_eq!(groups_of(&r, 5), vec![r]);
    }

    fn message_to(n: usize) -> Message {
        Message::new(
            9,
            "x".into(),
            "a@x.example".into(),
            (0..n).map(|i| format!("r{i}@y.example")).collect(),
            None,
            None,
            Map::new(),
            String::new(),
        )
    }

    #[test]
    fn an_envelope_too_large_splits_in_two_or_fails_with_5_3_4() {
        let split = too_big(&message_to(5), "x", "too large".into()).unwrap();
        let Outcome::Split { groups, stage } = split else {
            panic!("{split:?}")
        };
        assert_eq!(stage, "x");
        assert_eq!(groups.iter().map(Vec::len).collect::<Vec<_>>(), [3, 2]);
        let err = too_big(&message_to(1), "x", "too large".into()).unwrap_err();
        assert_eq!(err.class, crate::worker::ErrorClass::Permanent);
        let reason = err.dsn.unwrap();
        assert_eq!(reason.status, "5.3.4");
        assert!(reason.diagnostic.unwrap().starts_with("x-pepsi; 5.3.4 "));
    }

    #[test]
    fn a_permanent_exit_carries_its_status_and_any_other_none() {
        let exec = ConfiguredExec {
            argv: vec!["/bin/x".into()],
            timeout: Duration::from_secs(1),
            recipient_limit: None,
            next: None,
            user: None,
        };
        let exit = |code: i32| ExitStatus::from_raw(code << 8);
        let err = exec.decide(exit(67), b"", "").unwrap_err();
        assert_eq!(err.class, crate::worker::ErrorClass::Permanent);
        assert_eq!(err.dsn.unwrap().status, "5.1.1");
        let err = exec
            .decide(
                exit(77),
                b"5.7.1 relaying denied\n",
                "5.7.1 relaying denied",
            )
            .unwrap_err();
        let reason = err.dsn.unwrap();
        assert_eq!(reason.status, "5.7.1");
        assert_eq!(
            reason.diagnostic.as_deref(),
            Some("x-pepsi; 5.7.1 relaying denied")
        );
        let err = exec.decide(exit(75), b"", "").unwrap_err();
        assert_eq!(
            (err.class, err.dsn),
            (crate::worker::ErrorClass::Host, None)
        );
        let err = exec.decide(exit(1), b"4.2.2 full\n", "").unwrap_err();
        assert_eq!(err.class, crate::worker::ErrorClass::Host);
        assert_eq!(err.dsn.unwrap().status, "4.2.2");
        assert_eq!(exec.decide(exit(0), b"", ""), Ok(Outcome::Finish));
    }
}
