//! One worker process, the mechanism only: starting `PROGRAM [-c FILE] worker` with
//! piped stdin/stdout (stderr inherited) as the leader of its own session, dying with
//! the dispatcher (`PR_SET_PDEATHSIG`), the non-blocking pipes registered with mio, the
//! queue of claims handed to it in order, writing ids (with their claim tokens) in one
//! buffer, reading status lines until `WouldBlock`, and killing (its whole session, helpers and their children
//! included) and reaping. It decides nothing: what to do with a line or a death is
//! decided by the worker handlers ([`super::workers`], which also start each process)
//! and the pool decisions, and the table that holds every process is
//! [`super::pools`]'s. It touches no state but its own process's.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use mio::unix::pipe::{Receiver, Sender};
use mio::{Interest, Registry, Token};

use super::claim::Claim;
use super::worker_view::{Phase, WorkerView};
use crate::protocol;

/// A line longer than this is garbage (the protocol's lines are short).
const MAX_LINE: usize = 64 * 1024;

/// A claim handed to the worker.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The claim.
    pub claim: Claim,
    /// Has it been queued for the worker's stdin?
    pub written: bool,
    /// Where its line ends in the byte stream to the worker: it reached the pipe
    /// once that many bytes were written (see [`WorkerProc::delivered`]).
    end: u64,
    /// When it reached the head of the queue (written and first): MAX_RUNTIME counts
    /// from here.
    pub head_since: Option<Instant>,
}

/// How a stage's workers are started.
pub struct Launch<'a> {
    /// `PROGRAM`.
    pub program: &'a str,
    /// `CONFIG_FILE`, passed as `-c FILE`.
    pub config_file: Option<&'a Path>,
    /// Without `CONFIG_FILE`, the worker gets `PEPSI_CONFIG` set to this (the file the
    /// dispatcher read).
    pub inherited_config: &'a Path,
    /// Environment replacing what was inherited (the service account's HOME, USER,
    /// LOGNAME and PATH after a switch from root).
    pub env: &'a [(&'static str, String)],
    /// The worker's end of its keeper's socket, for a stage that runs a `COMMAND`
    /// (SPEC §4 "Containment"): handed over as descriptor 3, named by
    /// `PEPSI_KEEPER_FD`, and closed here once the worker has it.
    pub keeper: Option<std::os::fd::OwnedFd>,
}

/// One running worker process.
pub struct WorkerProc {
    /// A serial number never reused: a late event of a dead worker is ignored.
    pub serial: u64,
    /// The stage it serves.
    pub stage: String,
    /// Its pid.
    pub pid: u32,
    /// The `application_name` it was given for its database sessions (`PGAPPNAME`):
    /// they are terminated by it when it is killed.
    pub session: String,
    /// Where it is in its life.
    pub phase: Phase,
    /// The ids handed to it, oldest first; the front is the one being worked on.
    pub queue: VecDeque<Slot>,
    /// How many ids it was ever handed (MAX_MESSAGES).
    pub assigned_total: u64,
    /// When it was started.
    pub started: Instant,
    /// When its queue last became empty.
    pub idle_since: Instant,
    /// When its stdin was closed.
    pub closing_since: Option<Instant>,
    /// How many ids it answered.
    pub answered: u64,
    /// Retire it as soon as it is ready (a reload while it was starting).
    pub retire_on_ready: bool,
    /// It runs a suspect of an earlier crash alone: no other id until that answers.
    pub isolated: bool,
    /// A doubtful REPORT of it was logged already (said once per worker).
    pub report_warned: bool,
    /// Token of its stdout.
    pub out_token: Token,
    /// Token of its stdin.
    pub in_token: Token,
    child: Child,
    stdin: Option<Sender>,
    stdout: Receiver,
    write_buf: Vec<u8>,
    /// Bytes ever queued for, and ever written to, its stdin.
    queued_bytes: u64,
    sent_bytes: u64,
    read_buf: Vec<u8>,
    /// Claims that reached the head of the queue since the last [`Self::take_started`].
    started_heads: Vec<Claim>,
}

/// What a read found.
#[derive(Debug, Default)]
pub struct ReadOutcome {
    /// Complete lines.
    pub lines: Vec<String>,
    /// The worker closed its stdout.
    pub eof: bool,
    /// A line exceeded [`MAX_LINE`].
    pub overlong: bool,
}

impl WorkerProc {
    /// Starts a worker, its database sessions named `session`, and registers its pipes.
    pub fn spawn(
        serial: u64,
        stage: &str,
        session: &str,
        launch: &Launch<'_>,
        registry: &Registry,
        (out_token, in_token): (Token, Token),
    ) -> io::Result<WorkerProc> {
        let mut cmd = Command::new(launch.program);
        match launch.config_file {
            Some(file) => {
                cmd.arg("-c").arg(file);
            }
            // Without CONFIG_FILE the worker searches as usual; $PEPSI_CONFIG points
            // that search at the file the dispatcher itself read.
            None => {
                cmd.env("PEPSI_CONFIG", launch.inherited_config);
            }
        }
        cmd.envs(launch.env.iter().map(|(k, v)| (k, v)));
        // libpq takes PGAPPNAME as the default application_name, so the sessions of a
        // worker on any libpq-based library carry the name the dispatcher terminates
        // them by; the worker library reads it itself (§4 "Containment").
        let keeper = launch.keeper.as_ref().map(|k| {
            use std::os::fd::AsRawFd;
            k.as_raw_fd()
        });
        if keeper.is_some() {
            cmd.env(
                crate::keeper::KEEPER_FD_ENV,
                crate::keeper::KEEPER_FD.to_string(),
            );
        }
        cmd.arg("worker")
            .env(protocol::WORKER_STAGE_ENV, stage)
            .env(protocol::SESSION_NAME_ENV, session)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: setsid and prctl are async-signal-safe. The worker leads its own
        // session, so every process it starts (an exec stage's command, in its own
        // process group, and whatever that forks) can be found and killed with it; a
        // Ctrl-C at the dispatcher's terminal is the dispatcher's to handle. It dies
        // with the dispatcher, so a restarted dispatcher never races an orphaned worker.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() == -1 {
                    return Err(io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The keeper's socket as descriptor 3, without close-on-exec (dup2
                // clears it; a socket that is 3 already keeps it, so clear it there).
                let target = crate::keeper::KEEPER_FD;
                let failed = match keeper {
                    Some(fd) if fd == target => libc::fcntl(fd, libc::F_SETFD, 0) != 0,
                    Some(fd) => libc::dup2(fd, target) < 0,
                    None => false,
                };
                if failed {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let stdin = Sender::from(child.stdin.take().expect("piped"));
        let mut stdout = Receiver::from(child.stdout.take().expect("piped"));
        // mio's From does not make the pipes non-blocking.
        stdin.set_nonblocking(true)?;
        stdout.set_nonblocking(true)?;
        let mut stdin = stdin;
        registry.register(&mut stdout, out_token, Interest::READABLE)?;
        registry.register(&mut stdin, in_token, Interest::WRITABLE)?;
        let now = Instant::now();
        Ok(WorkerProc {
            serial,
            stage: stage.to_string(),
            pid: child.id(),
            session: session.to_string(),
            phase: Phase::Starting,
            queue: VecDeque::new(),
            assigned_total: 0,
            started: now,
            idle_since: now,
            closing_since: None,
            answered: 0,
            retire_on_ready: false,
            isolated: false,
            report_warned: false,
            out_token,
            in_token,
            child,
            stdin: Some(stdin),
            stdout,
            write_buf: Vec::new(),
            queued_bytes: 0,
            sent_bytes: 0,
            read_buf: Vec::new(),
            started_heads: Vec::new(),
        })
    }

    /// What the pool decisions need to know of it.
    pub fn view(&self) -> WorkerView {
        WorkerView {
            serial: self.serial,
            phase: self.phase,
            retire_on_ready: self.retire_on_ready,
            isolated: self.isolated,
            assigned_total: self.assigned_total,
            queued: self.queue.len(),
        }
    }

    /// Hands a claim to the worker; its id is written at once when the worker is ready.
    pub fn assign(&mut self, claim: Claim) {
        self.queue.push_back(Slot {
            claim,
            written: false,
            end: 0,
            head_since: None,
        });
        self.assigned_total += 1;
    }

    /// Queues every unwritten id for writing and writes what the pipe takes.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.phase == Phase::Starting {
            return Ok(());
        }
        let now = Instant::now();
        for slot in self.queue.iter_mut().filter(|s| !s.written) {
            // The id with its claim token: the worker's proof of the claim, which its
            // role cannot read from the queue (§6 "Claim tokens").
            let line = protocol::format_assignment(protocol::Assignment {
                id: slot.claim.id,
                token: slot.claim.token,
            });
            self.write_buf.extend_from_slice(line.as_bytes());
            self.queued_bytes += line.len() as u64;
            slot.written = true;
            slot.end = self.queued_bytes;
        }
        if let Some(front) = self.queue.front_mut() {
            if front.written && front.head_since.is_none() {
                front.head_since = Some(now);
                self.started_heads.push(front.claim.clone());
            }
        }
        let Some(stdin) = self.stdin.as_mut() else {
            self.write_buf.clear();
            return Ok(());
        };
        while !self.write_buf.is_empty() {
            match stdin.write(&self.write_buf) {
                Ok(n) => {
                    self.write_buf.drain(..n);
                    self.sent_bytes += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads until the pipe would block.
    pub fn read(&mut self) -> ReadOutcome {
        let mut out = ReadOutcome::default();
        let mut chunk = [0u8; 8192];
        loop {
            match self.stdout.read(&mut chunk) {
                Ok(0) => {
                    out.eof = true;
                    break;
                }
                Ok(n) => self.read_buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    out.eof = true;
                    break;
                }
            }
        }
        while let Some(end) = self.read_buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.read_buf.drain(..=end).collect();
            out.lines
                .push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
        }
        if self.read_buf.len() > MAX_LINE {
            out.overlong = true;
        }
        out
    }

    /// Did the slot's whole line reach the worker's stdin pipe? An id still in the
    /// buffer when the pipe broke was never read, so the worker's death is not its fault.
    pub fn delivered(&self, slot: &Slot) -> bool {
        slot.written && slot.end <= self.sent_bytes
    }

    /// The front id was answered: pops it and starts the next one's clock.
    pub fn pop_front(&mut self) -> Option<Slot> {
        let slot = self.queue.pop_front();
        self.answered += 1;
        self.isolated = false;
        let now = Instant::now();
        match self.queue.front_mut() {
            Some(next) if next.written => {
                next.head_since = Some(now);
                self.started_heads.push(next.claim.clone());
            }
            Some(_) => {}
            None => self.idle_since = now,
        }
        slot
    }

    /// Closes the worker's stdin: it answers what it has and exits.
    pub fn close_stdin(&mut self, registry: &Registry) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = registry.deregister(&mut stdin);
        }
        self.phase = Phase::Closing;
        self.closing_since = Some(Instant::now());
    }

    /// The claims that reached the head of the queue (their MAX_RUNTIME and measured
    /// time started) since the last call.
    pub fn take_started(&mut self) -> Vec<Claim> {
        std::mem::take(&mut self.started_heads)
    }

    /// Kills the worker and every process of its session (SIGKILL): its helpers and
    /// their children too, whatever process group they put themselves in. Call it
    /// before [`Self::reap`], while the worker's pid (the session id) cannot be reused.
    pub fn kill(&mut self) {
        kill_session(self.pid);
        let _ = self.child.kill();
    }

    /// Deregisters the pipes and reaps the process, killing it if it does not exit on
    /// its own within `grace` (it closed its stdout, so it normally has).
    pub fn reap(&mut self, registry: &Registry, grace: Duration) -> Option<ExitStatus> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = registry.deregister(&mut stdin);
        }
        let _ = registry.deregister(&mut self.stdout);
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    return self.child.wait().ok();
                }
                Err(_) => return None,
            }
        }
    }

    /// When the front message's MAX_RUNTIME runs out.
    pub fn front_deadline(&self, max_runtime: Duration) -> Option<Instant> {
        self.queue.front()?.head_since.map(|t| t + max_runtime)
    }
}

/// SIGKILLs every process whose session is `sid` (scanning `/proc`). A process that
/// started its own session escapes; nothing of Pepsi's does.
pub fn kill_session(sid: u32) {
    let Ok(sid) = libc::pid_t::try_from(sid) else {
        return;
    };
    // SAFETY: signalling a process group by id; the worst case is ESRCH.
    unsafe { libc::kill(-sid, libc::SIGKILL) };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if session_of(pid) == Some(sid) {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The session id of a process, from `/proc/PID/stat` (field 6, after the command
/// name in parentheses, which may itself hold spaces and parentheses).
fn session_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    // state, ppid, pgrp, session
    after.split_whitespace().nth(3)?.parse().ok()
}

/// Describes how a process ended.
pub fn describe_exit(status: Option<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        None => "ended (status unknown)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            (None, None) => "ended".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_of_this_process_is_read_from_proc() {
        let pid = std::process::id() as libc::pid_t;
        // SAFETY: getsid of ourselves.
        let sid = unsafe { libc::getsid(0) };
        assert_eq!(session_of(pid), Some(sid));
        assert_eq!(session_of(-1), None);
    }
}
