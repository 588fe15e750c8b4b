//! The dispatcher's master keeper: a process forked from `pepsi-dispatch serve` started
//! as root, before it drops its privileges, that keeps root for one purpose — to start,
//! for each worker of a stage whose section sets `COMMAND`, a keeper that runs that
//! command as the stage's `USER` ([`super::serve`]).
//!
//! It takes its orders from the dispatcher alone, over the socket pair made before the
//! fork (`KEEP` and a stage name, with the keeper's end of a new socket pair whose
//! other end the dispatcher hands the worker), and decides what runs itself: the
//! configuration file's `COMMAND` and `USER` for that stage, read from the file at each
//! order (the overlay may set neither, so the file is the whole truth). It never sees a
//! message. It ends when the dispatcher's end closes; keepers it forked end with their
//! workers.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use super::serve::{self, Mandate};
use super::wire::{self, Received};
use super::{KEEP, exec_account};
use crate::config::Config;
use crate::config::graph::STAGE_PREFIX;

/// The dispatcher's handle on its master.
#[derive(Debug)]
pub struct Master {
    control: OwnedFd,
    pid: libc::pid_t,
}

impl Master {
    /// Forks the master. Call it as root, while this process has one thread, before
    /// dropping privileges: the master keeps root.
    pub fn start(config_path: &Path) -> io::Result<Master> {
        let (ours, theirs) = wire::pair()?;
        let path = config_path.to_path_buf();
        // SAFETY: the process is single-threaded here (the caller's promise), so the
        // child may run any code.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            drop(ours);
            let code = run(theirs, &path);
            // SAFETY: ending the forked child without running the parent's exit
            // handlers (its atexit hooks are the parent's business).
            unsafe { libc::_exit(code) };
        }
        drop(theirs);
        Ok(Master { control: ours, pid })
    }

    /// The master's pid.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Has the master start a keeper for a worker of `stage`; returns the worker's end
    /// of the keeper's socket. An error means the master is gone.
    pub fn keeper_for(&self, stage: &str) -> io::Result<OwnedFd> {
        let (worker, keeper) = wire::pair()?;
        wire::send(
            self.control.as_fd(),
            &wire::message(&[KEEP, stage.as_bytes()]),
            &[keeper.as_fd()],
        )?;
        Ok(worker)
    }
}

/// What a keeper for `stage` may run, from the configuration file at `path`: its
/// `COMMAND` as the account [`exec_account`] gives for its `USER`.
pub fn mandate(path: &Path, stage: &str) -> Result<Mandate, String> {
    let config = Config::load(Some(path)).map_err(|errors| {
        format!(
            "{} does not parse: {}",
            path.display(),
            crate::config::raw::join_errors(&errors)
        )
    })?;
    let name = format!("{STAGE_PREFIX}{stage}");
    let section = config
        .stage_sections
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| format!("{} has no [{name}] section", path.display()))?;
    let argv: Vec<String> = section
        .get("COMMAND")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if argv.is_empty() {
        return Err(format!("[{name}] of {} sets no COMMAND", path.display()));
    }
    let account = exec_account(section.get("USER"), &config.pepsi.run_as)
        .map_err(|e| format!("[{name}] {e}"))?;
    Ok(Mandate::Fixed {
        argv,
        account: Some(account),
    })
}

/// The master's life: orders until the dispatcher goes.
fn run(control: OwnedFd, path: &Path) -> i32 {
    // SAFETY: prctl and signal with constant arguments; setsid in a child that leads no
    // group.
    unsafe {
        // Nothing of the dispatcher's but the control socket and the standard streams
        // (its log): the keepers forked from here inherit what this process holds.
        let keep = control.as_raw_fd() as libc::c_uint;
        if keep > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, keep - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, keep + 1, u32::MAX, 0u32);
        // A session of its own: a Ctrl-C at the dispatcher's terminal is the
        // dispatcher's to handle, not a reason for running commands to die.
        libc::setsid();
        libc::prctl(libc::PR_SET_NAME, c"pepsi-keepers".as_ptr());
        // Keepers are reaped by the kernel: the master never waits.
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
    }
    loop {
        let (message, mut fds) = match wire::recv(control.as_fd()) {
            Ok(Received::Message(m, fds)) => (m, fds),
            Ok(Received::Closed) => return 0,
            Err(e) => {
                log::error!("keeper master: cannot read the dispatcher's order: {e}");
                return 70;
            }
        };
        let fields = wire::fields(&message);
        let (Some(&KEEP), Some(stage), Some(socket)) = (fields.first(), fields.get(1), fds.pop())
        else {
            log::error!("keeper master: an order it does not understand; ignored");
            continue;
        };
        let stage = String::from_utf8_lossy(stage).into_owned();
        let (refusal, mandate) = match mandate(path, &stage) {
            Ok(m) => (None, m),
            Err(why) => (Some(why), Mandate::Private),
        };
        // SAFETY: this process is single-threaded; the child runs the keeper and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(control);
            unsafe {
                libc::prctl(libc::PR_SET_NAME, c"pepsi-keeper".as_ptr());
            }
            let code = serve::serve(socket, refusal, mandate);
            // SAFETY: ending the forked child.
            unsafe { libc::_exit(code) };
        }
        if pid < 0 {
            log::error!(
                "keeper master: cannot start a keeper for stage {stage:?}: {}",
                io::Error::last_os_error()
            );
        }
        // The keeper holds its own copy; the worker's end is the dispatcher's.
        drop(socket);
    }
}
