//! The launcher: the one process of `pepsi-dispatch serve` that starts and kills stage
//! workers (§4 "Containment", §6, §8), as Postfix's `master` starts its daemons.
//!
//! The dispatcher forks it at start, while it has one thread and, when started as root,
//! before it drops its privileges: the launcher keeps root for one purpose, to start
//! each worker under `[pepsi] WORKER_AS` — an account that reaches only the stage role
//! and cannot read `pepsi.conf` — and, for a stage with a `COMMAND`, the keeper that
//! runs that command as the stage's `USER` ([`crate::keeper`]). It takes its orders from
//! the dispatcher alone, over the socket pair made before the fork ([`Launcher`]), and
//! never sees a message.
//!
//! A worker is started with `clone(CLONE_PARENT)`, so it is the dispatcher's child: the
//! dispatcher reaps it and reads its exit status as before, and it dies with the
//! dispatcher (`PR_SET_PDEATHSIG`). Started as root, its real group is the overflow
//! group (`nogroup`, which owns nothing) and its effective and saved groups
//! `WORKER_AS`'s: the kernel treats it as set-id from its first instruction, so it is not
//! dumpable — no other process of the account, a sibling worker included, can attach to
//! it or take its descriptors (`ptrace`, `pidfd_getfd`, `/proc/PID/fd`), not even in
//! the moment between its exec and its own `PR_SET_DUMPABLE` — and by the same group
//! difference no sibling passes the kernel's same-credentials test for attaching. The
//! dispatcher, running as `RUN_AS`, may not signal another account's process, so a
//! kill of a worker goes through the launcher, which kills only workers it started,
//! by their pidfd, and their sessions. When the dispatcher goes (its end of the socket
//! closes), the launcher kills every worker still running and exits.
//!
//! Not started as root, the launcher does the same without switching accounts.
//!
//! Files: this one, the dispatcher's handle and the order words; [`serve`], the
//! launcher's loop; [`spawn`], one worker's start.

pub mod serve;
pub mod spawn;

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use crate::keeper::wire::{self, Received};
use crate::privilege::Passwd;

/// The dispatcher's order: start a worker (fields: stage, with-keeper `0`/`1`, program,
/// argument count, arguments…, `NAME=value`…; descriptors: its stdin's read end, its
/// stdout's write end, its handed configuration).
pub const SPAWN: &[u8] = b"SPAWN";
/// The dispatcher's order: kill a worker it started and every process of its session
/// (field: its pid). Answered [`KILLED`] once done.
pub const KILL: &[u8] = b"KILL";
/// The dispatcher reaped a worker (field: its pid): forget it. Not answered.
pub const DONE: &[u8] = b"DONE";
/// The launcher's answer: the worker started (field: its pid).
pub const STARTED: &[u8] = b"STARTED";
/// The launcher's answer: the worker could not start (fields: an errno or 0, the
/// reason, and the pid of a child that exists and must be reaped, or empty).
pub const FAILED: &[u8] = b"FAILED";
/// The launcher's answer to a kill.
pub const KILLED: &[u8] = b"KILLED";

/// The descriptor a worker finds its handed configuration on
/// ([`crate::config::handoff`]).
pub const CONFIG_FD: i32 = 4;

/// The environment variable that gives a worker the dispatcher's pid: it re-arms its
/// death signal after its exec (which a set-id start clears) and exits at once when
/// its parent is no longer this process.
pub const DISPATCHER_PID_ENV: &str = "PEPSI_DISPATCHER_PID";

/// How long the dispatcher waits for the launcher's answer before it counts the
/// launcher as gone.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// How the workers are started: as which account.
#[derive(Clone, Debug)]
pub enum Workers {
    /// As the launcher itself (not started as root, or `WORKER_AS = root`).
    AsLauncher,
    /// As this account, with the overflow group as the real group.
    As {
        /// The account.
        account: Passwd,
        /// The real group id (the kernel's overflow group).
        real_gid: libc::gid_t,
    },
}

/// One worker to start.
pub struct Order<'a> {
    /// Its stage.
    pub stage: &'a str,
    /// Does its stage run a `COMMAND`, so that it gets a keeper (started as root only)?
    pub keeper: bool,
    /// The program, looked up on the worker's `PATH` unless it holds a `/`.
    pub program: &'a str,
    /// Its arguments after the program.
    pub args: &'a [String],
    /// Variables set for it, over the launcher's environment.
    pub env: &'a [(String, String)],
    /// The read end of its stdin.
    pub stdin: OwnedFd,
    /// The write end of its stdout.
    pub stdout: OwnedFd,
    /// Its handed configuration.
    pub config: std::os::fd::BorrowedFd<'a>,
}

/// Why a worker did not start.
#[derive(Debug)]
pub enum SpawnError {
    /// The launcher is gone or answered out of turn: nothing can be started any more.
    Lost(String),
    /// This worker could not be started (its program, say); `child` is a child of the
    /// dispatcher's that exists and must be reaped.
    Failed {
        /// What happened.
        message: String,
        /// The pid of a child that exited, when one was made.
        child: Option<u32>,
    },
}

/// The dispatcher's handle on its launcher.
#[derive(Debug)]
pub struct Launcher {
    control: OwnedFd,
    pid: libc::pid_t,
    /// Does it start workers and keepers as other accounts (started as root)?
    pub as_root: bool,
    /// Why it was found gone (an order it did not answer), when it was.
    lost: std::cell::RefCell<Option<String>>,
}

/// How long the dispatcher, on its way out, waits for the launcher to kill what still
/// runs and exit.
const EXIT_WAIT: Duration = Duration::from_secs(2);

impl Drop for Launcher {
    /// The dispatcher is done with it: its end of the socket is shut, so the launcher
    /// kills every worker still running and exits; the dispatcher reaps it (waiting at
    /// most [`EXIT_WAIT`]), so no process of the service outlives the dispatcher's exit.
    fn drop(&mut self) {
        // SAFETY: shutdown of a socket this handle owns.
        unsafe {
            libc::shutdown(self.control.as_fd().as_raw_fd(), libc::SHUT_RDWR);
        }
        let until = std::time::Instant::now() + EXIT_WAIT;
        loop {
            let mut status = 0;
            // SAFETY: waitpid of this process's child with WNOHANG writes only to the
            // status it is given.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            // Reaped, or not (or no longer) this process's child to wait for.
            if r != 0 || std::time::Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Launcher {
    /// Forks the launcher. Call it while this process has one thread, and, when it is
    /// root, before it drops its privileges. `config_path` is the configuration file
    /// the keepers' commands are read from; `workers` how workers are started.
    pub fn start(config_path: &Path, workers: Workers) -> io::Result<Launcher> {
        let (ours, theirs) = wire::pair()?;
        let path = config_path.to_path_buf();
        // SAFETY: getpid and geteuid have no preconditions.
        let (dispatcher, as_root) = unsafe { (libc::getpid(), libc::geteuid() == 0) };
        // SAFETY: the process is single-threaded here (the caller's promise), so the
        // child may run any code.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            drop(ours);
            let code = serve::run(theirs, &path, workers, dispatcher);
            // SAFETY: ending the forked child without running the parent's exit
            // handlers (its atexit hooks are the parent's business).
            unsafe { libc::_exit(code) };
        }
        drop(theirs);
        Ok(Launcher {
            control: ours,
            pid,
            as_root,
            lost: std::cell::RefCell::new(None),
        })
    }

    /// The launcher's pid.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Starts a worker; returns its pid. It is this process's child.
    pub fn spawn(&self, order: Order<'_>) -> Result<u32, SpawnError> {
        let mut fields: Vec<Vec<u8>> = vec![
            SPAWN.to_vec(),
            order.stage.as_bytes().to_vec(),
            if order.keeper {
                b"1".to_vec()
            } else {
                b"0".to_vec()
            },
            order.program.as_bytes().to_vec(),
            order.args.len().to_string().into_bytes(),
        ];
        fields.extend(order.args.iter().map(|a| a.as_bytes().to_vec()));
        fields.extend(
            order
                .env
                .iter()
                .map(|(k, v)| format!("{k}={v}").into_bytes()),
        );
        let refs: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
        let answer = self
            .ask(
                &wire::message(&refs),
                &[order.stdin.as_fd(), order.stdout.as_fd(), order.config],
            )
            .map_err(SpawnError::Lost)?;
        let fields = wire::fields(&answer);
        let text =
            |i: usize| String::from_utf8_lossy(fields.get(i).copied().unwrap_or(b"")).into_owned();
        match fields.first().copied() {
            Some(STARTED) => text(1)
                .parse()
                .map_err(|_| SpawnError::Lost(format!("an unreadable pid {:?}", text(1)))),
            Some(FAILED) => Err(SpawnError::Failed {
                message: text(2),
                child: text(3).parse().ok(),
            }),
            _ => Err(SpawnError::Lost("an answer out of turn".into())),
        }
    }

    /// Kills a worker it started, with every process of its session; returns once it
    /// is done. Call it before reaping the worker, while its pid cannot be reused.
    pub fn kill(&self, pid: u32) -> Result<(), String> {
        let answer = self.ask(&wire::message(&[KILL, pid.to_string().as_bytes()]), &[])?;
        match wire::fields(&answer).first().copied() {
            Some(KILLED) => Ok(()),
            _ => Err("an answer out of turn".into()),
        }
    }

    /// The worker `pid` was reaped: the launcher forgets it.
    pub fn done(&self, pid: u32) {
        // A launcher gone is noticed at the next order that needs an answer.
        let _ = wire::send(
            self.control.as_fd(),
            &wire::message(&[DONE, pid.to_string().as_bytes()]),
            &[],
        );
    }

    /// Why the launcher was found gone, when an order found it so: nothing can be
    /// started or killed any more, and the dispatcher shuts down (a restart makes a
    /// new one).
    pub fn lost(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    /// Sends an order and waits for its answer.
    fn ask(&self, message: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<Vec<u8>, String> {
        let answer = self.exchange(message, fds);
        if let Err(e) = &answer {
            self.lost.borrow_mut().get_or_insert_with(|| e.clone());
        }
        answer
    }

    fn exchange(
        &self,
        message: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Vec<u8>, String> {
        let gone =
            |e: &dyn std::fmt::Display| format!("the launcher (pid {}) is gone: {e}", self.pid);
        wire::send(self.control.as_fd(), message, fds).map_err(|e| gone(&e))?;
        if !wire::wait_readable(self.control.as_fd(), Some(ANSWER_TIMEOUT)).map_err(|e| gone(&e))? {
            return Err(gone(&format!(
                "no answer within {}s",
                ANSWER_TIMEOUT.as_secs()
            )));
        }
        match wire::recv(self.control.as_fd()).map_err(|e| gone(&e))? {
            Received::Message(m, _) => Ok(m),
            Received::Closed => Err(gone(&"it closed its end")),
        }
    }
}

/// The kernel's overflow group id (`nogroup` on Debian): a group that owns nothing,
/// a worker's real group when it runs as another account.
pub fn overflow_gid() -> libc::gid_t {
    std::fs::read_to_string("/proc/sys/kernel/overflowgid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65534)
}
