//! `pepsi-stage-exec`: pipes the message to an external command, like Postfix
//! `pipe(8)`. Loads headers and body; not fusable by default.
//!
//! `COMMAND` is split on whitespace into argv (no shell). The command's stdin is the
//! header block, a blank line if the block lacks its own, then the body; its environment
//! carries `PEPSI_ID`, `PEPSI_STAGE`, `PEPSI_SENDER`, `PEPSI_RECIPIENTS`
//! (comma-separated) and `PEPSI_SENDER_KEY`; its stdout is discarded. `TIMEOUT` (default
//! 60s) bounds it, after which its whole process group is killed. Exit 0 advances to
//! `NEXT` (or finishes the message without one); 64–78 except 75 is a permanent error;
//! anything else, a signal or the timeout is a host error. At most the last 1 KiB of its
//! stderr goes into `state.last_error`.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::config::{ConfigError, StageSection};
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
        &["COMMAND", "TIMEOUT"]
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
        Ok(Box::new(ConfiguredExec {
            argv,
            timeout,
            next: section.next.clone(),
        }))
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
    fn execute(
        &self,
        message: &Message,
        stage: &str,
    ) -> Result<(Option<ExitStatus>, String), StageError> {
        let mut cmd = Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..])
            .env("PEPSI_ID", message.id.to_string())
            .env("PEPSI_STAGE", stage)
            .env("PEPSI_SENDER", message.mail_from())
            .env("PEPSI_RECIPIENTS", message.rcpt_to().join(","))
            .env("PEPSI_SENDER_KEY", &message.sender_key)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own process group, so a timeout kills its helpers too.
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; the command dies with this worker.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| StageError::host(format!("cannot start {}: {e}", self.argv[0])))?;
        let pid = child.id() as libc::pid_t;
        let mut stdin = child.stdin.take().expect("stdin was piped");
        let text = message_text(message);
        // Written from a thread so a command that does not read cannot deadlock us;
        // a command that exits early makes the write fail, which is fine.
        std::thread::spawn(move || {
            let _ = stdin.write_all(&text);
        });
        let mut stderr = child.stderr.take().expect("stderr was piped");
        let (err_tx, err_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = err_tx.send(read_tail(&mut stderr));
        });
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = done_tx.send(child.wait());
        });
        let (status, timed_out) = match done_rx.recv_timeout(self.timeout) {
            Ok(status) => (status, false),
            Err(_) => {
                // SAFETY: signalling the command's own process group.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                (
                    done_rx
                        .recv()
                        .unwrap_or_else(|_| Err(std::io::Error::other("lost"))),
                    true,
                )
            }
        };
        let err_text = err_rx
            .recv_timeout(STDERR_GRACE)
            .map(|b| tail(&b))
            .unwrap_or_default();
        let status = status
            .map_err(|e| StageError::host(format!("cannot wait for {}: {e}", self.argv[0])))?;
        if timed_out {
            return Err(StageError::host(with_stderr(
                format!(
                    "{} timed out after {}s and was killed",
                    self.argv[0],
                    self.timeout.as_secs()
                ),
                &err_text,
            )));
        }
        Ok((Some(status), err_text))
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
        let (status, stderr) = self.execute(message, &cx.section.name)?;
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
