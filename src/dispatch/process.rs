//! One worker process, the mechanism only: starting `PROGRAM worker` through the
//! launcher ([`crate::launcher`]), which makes it this process's child, with piped
//! stdin/stdout (stderr inherited) as the leader of its own session, dying with the
//! dispatcher, under `[pepsi] WORKER_AS`, with its handed configuration; the
//! non-blocking pipes registered with mio, the queue of claims handed to it in order,
//! writing ids (with their claim tokens) in one buffer, reading status lines until
//! `WouldBlock`, and killing (through the launcher: its whole session, helpers and their
//! children included) and reaping. It decides nothing: what to do with a line or a
//! death is decided by the worker handlers ([`super::workers`], which also start each
//! process) and the pool decisions, and the table that holds every process is
//! [`super::pools`]'s. It touches no state but its own process's.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::rc::Rc;
use std::time::{Duration, Instant};

use mio::unix::pipe::{Receiver, Sender};
use mio::{Interest, Registry, Token};

use super::claim::Claim;
use super::worker_view::{Phase, WorkerView};
use crate::config::Config;
use crate::config::handoff::for_workers;
use crate::config::raw::{HANDED_PREFIX, ORIGIN_ENV};
use crate::launcher::{CONFIG_FD, Launcher, Order, SpawnError};
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
    /// The configuration the worker is handed: its descriptor and the file it was made
    /// from (§4 "Containment"; [`crate::config::handoff`]).
    pub handoff: &'a Handoff,
    /// Does its stage run a `COMMAND` (a keeper of the launcher's, started as root)?
    pub keeper: bool,
}

/// The configuration the workers are handed: a sealed memory file of the text
/// [`crate::config::handoff::for_workers`] makes, and the file it was made from.
#[derive(Debug)]
pub struct Handoff {
    /// The memory file.
    pub fd: OwnedFd,
    /// The file it was made from, which the workers' messages name.
    pub origin: PathBuf,
}

impl Handoff {
    /// What the workers of `config` are handed when they run as `workers_as` (see
    /// [`crate::config::handoff`]): made from `[pepsi-dispatch] CONFIG_FILE` (read
    /// now) when it is set, else from the text `config` was read from.
    pub fn of(
        config: &Config,
        config_file: Option<&Path>,
        workers_as: Option<&str>,
    ) -> io::Result<Handoff> {
        let own;
        let (source, origin) = match config_file {
            Some(file) => {
                own = Config::load(Some(file)).map_err(|errors| {
                    io::Error::other(format!(
                        "[pepsi-dispatch] CONFIG_FILE {}: {}",
                        file.display(),
                        crate::config::raw::join_errors(&errors)
                    ))
                })?;
                (&own, file)
            }
            None => (config, config.path.as_path()),
        };
        let made = (!source.postgres.sets_worker_connection())
            .then(|| source.postgres.worker_connection(workers_as))
            .filter(|_| workers_as.is_some());
        Handoff::new(&for_workers(&source.source, made.as_deref()), origin)
    }

    /// A sealed memory file holding `text`, made from `origin`.
    pub fn new(text: &str, origin: &Path) -> io::Result<Handoff> {
        // SAFETY: memfd_create with a valid C string and flags.
        let fd = unsafe {
            libc::memfd_create(
                c"pepsi.conf for workers".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor, ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut file = std::fs::File::from(fd);
        file.write_all(text.as_bytes())?;
        let fd = OwnedFd::from(file);
        // Sealed: nobody, the worker included, changes what the next worker reads.
        let seals =
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our descriptor.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Handoff {
            fd,
            origin: origin.to_path_buf(),
        })
    }
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
    /// The launcher that started it, which kills it.
    launcher: Rc<Launcher>,
    /// Reaped already.
    reaped: bool,
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
        launcher: &Rc<Launcher>,
        registry: &Registry,
        (out_token, in_token): (Token, Token),
    ) -> Result<WorkerProc, SpawnError> {
        let io = |e: io::Error| SpawnError::Failed {
            message: e.to_string(),
            child: None,
        };
        let (stdin_r, stdin_w) = crate::keeper::wire::pipe().map_err(io)?;
        let (stdout_r, stdout_w) = crate::keeper::wire::pipe().map_err(io)?;
        // The worker finds its configuration at the descriptor the launcher gives it,
        // and names the file it was made from in its messages; libpq takes PGAPPNAME as
        // the default application_name, so the sessions of a worker on any libpq-based
        // library carry the name the dispatcher terminates them by; the worker library
        // reads it itself (§4 "Containment").
        let mut env = vec![
            (
                "PEPSI_CONFIG".to_string(),
                format!("{HANDED_PREFIX}{CONFIG_FD}"),
            ),
            (
                ORIGIN_ENV.to_string(),
                launch.handoff.origin.display().to_string(),
            ),
            (protocol::WORKER_STAGE_ENV.to_string(), stage.to_string()),
            (protocol::SESSION_NAME_ENV.to_string(), session.to_string()),
        ];
        // The database hosts this dispatcher found unresponsive: a new worker does not
        // spend its first seconds on one (§8.4).
        let unresponsive = crate::db::watch::hint();
        if !unresponsive.is_empty() {
            env.push((crate::db::watch::HINT_ENV.to_string(), unresponsive));
        }
        if launch.keeper && launcher.as_root {
            env.push((
                crate::keeper::KEEPER_FD_ENV.to_string(),
                crate::keeper::KEEPER_FD.to_string(),
            ));
        }
        let pid = launcher.spawn(Order {
            stage,
            keeper: launch.keeper,
            program: launch.program,
            args: &["worker".to_string()],
            env: &env,
            stdin: stdin_r,
            stdout: stdout_w,
            config: launch.handoff.fd.as_fd(),
        })?;
        let stdin = Sender::from(stdin_w);
        let mut stdout = Receiver::from(stdout_r);
        let setup = || -> io::Result<Sender> {
            // The launcher's pipes are blocking.
            stdin.set_nonblocking(true)?;
            stdout.set_nonblocking(true)?;
            let mut stdin = stdin;
            registry.register(&mut stdout, out_token, Interest::READABLE)?;
            registry.register(&mut stdin, in_token, Interest::WRITABLE)?;
            Ok(stdin)
        };
        let stdin = match setup() {
            Ok(s) => s,
            Err(e) => {
                // The worker exists: it goes, and is reaped, before the start fails.
                let _ = launcher.kill(pid);
                reap_now(pid);
                launcher.done(pid);
                return Err(io(e));
            }
        };
        let now = Instant::now();
        Ok(WorkerProc {
            serial,
            stage: stage.to_string(),
            pid,
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
            launcher: launcher.clone(),
            reaped: false,
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
    /// The launcher does it (the worker may run as another account); a launcher that
    /// is gone is an error the caller makes fatal.
    pub fn kill(&mut self) -> Result<(), String> {
        if self.reaped {
            return Ok(());
        }
        self.launcher.kill(self.pid)
    }

    /// Gives the process up unreaped (it could not be killed: the launcher is gone); it
    /// dies with the dispatcher.
    pub fn abandon(&mut self) {
        self.reaped = true;
    }

    /// Deregisters the pipes and reaps the process, killing it if it does not exit on
    /// its own within `grace` (it closed its stdout, so it normally has).
    pub fn reap(&mut self, registry: &Registry, grace: Duration) -> Option<ExitStatus> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = registry.deregister(&mut stdin);
        }
        let _ = registry.deregister(&mut self.stdout);
        if self.reaped {
            return None;
        }
        let deadline = Instant::now() + grace;
        let status = loop {
            match try_reap(self.pid) {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Ok(None) => match self.launcher.kill(self.pid) {
                    Ok(()) => break reap_now(self.pid),
                    Err(e) => {
                        // It dies with the dispatcher, which shuts down on this.
                        log::error!("worker {} (pid {}): {e}", self.serial, self.pid);
                        self.reaped = true;
                        return None;
                    }
                },
                Err(_) => break None,
            }
        };
        self.reaped = true;
        self.launcher.done(self.pid);
        status
    }

    /// When the front message's MAX_RUNTIME runs out.
    pub fn front_deadline(&self, max_runtime: Duration) -> Option<Instant> {
        self.queue.front()?.head_since.map(|t| t + max_runtime)
    }
}

/// Reaps a child that has exited: `Ok(None)` while it runs.
fn try_reap(pid: u32) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    // SAFETY: waitpid on our own child with WNOHANG.
    let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
    match r {
        0 => Ok(None),
        r if r > 0 => Ok(Some(ExitStatus::from_raw(status))),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Reaps the child of a start that failed at its exec (it has exited).
pub fn reap_failed_start(pid: u32) {
    reap_now(pid);
}

/// Reaps a child, waiting for its end (it was killed).
fn reap_now(pid: u32) -> Option<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        if r > 0 {
            return Some(ExitStatus::from_raw(status));
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return None;
        }
    }
}

/// Describes how a process ended.
pub fn describe_exit(status: Option<ExitStatus>) -> String {
    match status {
        None => "ended (status unknown)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            (None, None) => "ended".into(),
        },
    }
}
