//! `pepsi-stage-exec`: pipes the message to an external command, like Postfix
//! `pipe(8)`. Loads headers and body; not fusable by default.
//!
//! `COMMAND` is split on whitespace into argv (no shell). The command's stdin is the
//! header block, a blank line if the block lacks its own, then the body; its environment
//! is only `PEPSI_ID`, `PEPSI_STAGE`, `PEPSI_SENDER`, `PEPSI_RECIPIENTS`
//! (comma-separated), `PEPSI_SENDER_KEY`, `PATH`, `HOME` and `LANG`; its stdout is
//! discarded. It runs through the worker's keeper (`crate::keeper`): as the stage's
//! `USER` (by default `pepsi-exec`) when the dispatcher was started as root, with no
//! descriptor of the worker's, and whatever it leaves behind is killed when it ends.
//! `TIMEOUT` (default 60s) bounds it, after which it and everything it started are
//! killed. Exit 0 advances to `NEXT` (or finishes the message without one); 64–78
//! except 75 is a permanent error; anything else, a signal or the timeout is a host
//! error. At most the last 1 KiB of its stderr goes into `state.last_error`.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision (the exit status mapped to an outcome or an error); running the
//! command is the keeper's; it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use crate::config::{Config, ConfigError, StageSection};
use crate::keeper::client::{Keeper, RunError};
use crate::keeper::wire;
use crate::worker::{Configured, Context, Load, Message, Outcome, Stage, StageError};

/// The stage.
pub struct Exec;

/// How much of the command's stderr is kept.
const STDERR_KEPT: usize = 1024;
/// How long to wait for stderr to close after the command exited.
const STDERR_GRACE: Duration = Duration::from_secs(1);

struct ConfiguredExec {
    argv: Vec<String>,
    timeout: Duration,
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
fn private_user(user: Option<&str>, run_as: &str) -> Result<String, String> {
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    crate::keeper::command_account(user, run_as, as_root).map(Option::unwrap_or_default)
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
        &["COMMAND", "TIMEOUT", "USER"]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &["TIMEOUT"]
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
        let timeout = s.duration("TIMEOUT", Duration::from_secs(60))?;
        if timeout.is_zero() {
            return Err(s.error("TIMEOUT", "must be greater than zero"));
        }
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
            private_user(user, &config.pepsi.run_as)?;
        }
        Ok(())
    }
}

/// Reads a stream to its end, keeping only its last `STDERR_KEPT` bytes (a chatty
/// command must not fill the worker's memory).
fn read_tail(input: &mut impl Read) -> Vec<u8> {
    let mut kept = Vec::with_capacity(2 * STDERR_KEPT);
    let mut chunk = [0u8; 8192];
    loop {
        match input.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                kept.extend_from_slice(&chunk[..n]);
                if kept.len() > STDERR_KEPT {
                    kept.drain(..kept.len() - STDERR_KEPT);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    kept
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

impl ConfiguredExec {
    /// Runs the command on `message` through the keeper: its exit status (`None` when
    /// it was killed at `TIMEOUT`) and the tail of its stderr.
    fn execute(
        &self,
        message: &Message,
        stage: &str,
        run_as: &str,
    ) -> Result<(Option<ExitStatus>, String), StageError> {
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
        let (mut to_command, mut from_command) = (
            std::fs::File::from(to_command),
            std::fs::File::from(from_command),
        );
        // Written from a thread so a command that does not read cannot deadlock us;
        // a command that exits early (or never starts: the reading end goes with the
        // request) makes the write fail, which is fine.
        let text = message_text(message);
        std::thread::spawn(move || {
            let _ = to_command.write_all(&text);
        });
        let (err_tx, err_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = err_tx.send(read_tail(&mut from_command));
        });
        let waited = with_keeper(|keeper| -> Result<Option<i32>, RunError> {
            let user = if keeper.fixed {
                String::new()
            } else {
                private_user(self.user.as_deref(), run_as).map_err(|e| RunError::Start {
                    errno: 0,
                    message: e,
                })?
            };
            keeper.run(&user, &self.argv, &env, command_in, command_err)?;
            if let Some(status) = keeper.wait(Some(self.timeout))? {
                return Ok(Some(status));
            }
            keeper.kill()?;
            // Killed: the keeper reports the end, which comes at once.
            keeper.wait(None)?;
            Ok(None)
        })
        .map_err(|e| StageError::host(format!("cannot start {program}: {e}")))?;
        let err_text = err_rx
            .recv_timeout(STDERR_GRACE)
            .map(|b| tail(&b))
            .unwrap_or_default();
        match waited {
            Ok(Some(raw)) => Ok((Some(ExitStatus::from_raw(raw)), err_text)),
            Ok(None) => Err(StageError::host(with_stderr(
                format!(
                    "{program} timed out after {}s and was killed",
                    self.timeout.as_secs()
                ),
                &err_text,
            ))),
            Err(RunError::Start { message, .. }) => {
                Err(StageError::host(with_stderr(message, &err_text)))
            }
            Err(e @ RunError::Lost(_)) => Err(StageError::host(format!("{program}: {e}"))),
        }
    }
}

fn with_stderr(what: String, stderr: &str) -> String {
    if stderr.is_empty() {
        what
    } else {
        format!("{what}: {stderr}")
    }
}

impl Configured for ConfiguredExec {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let (status, stderr) = self.execute(message, &cx.section.name, &cx.pepsi.run_as)?;
        let Some(status) = status else {
            return Err(StageError::host(format!("{} did not run", self.argv[0])));
        };
        match (status.code(), status.signal()) {
            (Some(0), _) => Ok(match &self.next {
                Some(next) => Outcome::Advance(next.clone()),
                None => Outcome::Finish,
            }),
            (Some(code), _) if (64..=78).contains(&code) && code != 75 => {
                Err(StageError::permanent(with_stderr(
                    format!("{} exited with status {code}", self.argv[0]),
                    &stderr,
                )))
            }
            (Some(code), _) => Err(StageError::host(with_stderr(
                format!("{} exited with status {code}", self.argv[0]),
                &stderr,
            ))),
            (None, signal) => Err(StageError::host(with_stderr(
                format!(
                    "{} was killed by signal {}",
                    self.argv[0],
                    signal.unwrap_or(0)
                ),
                &stderr,
            ))),
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
        let kept = read_tail(&mut stream.as_slice());
        assert_eq!(kept.len(), STDERR_KEPT);
        assert!(kept.ends_with(b"xthe end"));
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
}
