//! The launcher's life: orders from the dispatcher until it goes, then every worker it
//! started killed. Single-threaded in a process of its own (forked by the dispatcher),
//! so it may fork freely; it holds a pidfd of every worker it started and kills only
//! those. It reads the configuration file only for a keeper's mandate (the file's
//! `COMMAND` and `USER` of a stage, [`crate::keeper::mandate`]).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use super::spawn::{self, Child};
use super::{DONE, FAILED, KILL, KILLED, SPAWN, STARTED, Workers};
use crate::keeper::serve::{self as keeper, Mandate};
use crate::keeper::wire::{self, Received};

/// The workers started and not yet reaped, by pid, each with its pidfd.
type Table = HashMap<u32, OwnedFd>;

/// The launcher's life: returns its exit status.
pub fn run(control: OwnedFd, path: &Path, workers: Workers, dispatcher: libc::pid_t) -> i32 {
    // SAFETY: close_range, setsid, prctl and signal with constant arguments, in a child
    // that leads no group and runs one thread.
    unsafe {
        // Nothing of the dispatcher's but the control socket and the standard streams
        // (its log): the workers and keepers forked from here inherit what this
        // process holds.
        let keep = control.as_raw_fd() as libc::c_uint;
        if keep > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, keep - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, keep + 1, u32::MAX, 0u32);
        // A session of its own: a Ctrl-C at the dispatcher's terminal is the
        // dispatcher's to handle, not a reason for workers to lose their launcher.
        libc::setsid();
        libc::prctl(libc::PR_SET_NAME, c"pepsi-launcher".as_ptr());
        // Keepers are reaped by the kernel: the launcher never waits. (Workers are
        // the dispatcher's children, never the launcher's.)
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
    }
    let mut table = Table::new();
    let code = loop {
        let (message, fds) = match wire::recv(control.as_fd()) {
            Ok(Received::Message(m, fds)) => (m, fds),
            Ok(Received::Closed) => break 0,
            Err(e) => {
                log::error!("launcher: cannot read the dispatcher's order: {e}");
                break 70;
            }
        };
        let fields = wire::fields(&message);
        let answer = match fields.first().copied() {
            Some(SPAWN) => Some(start(&fields, fds, path, &workers, dispatcher, &mut table)),
            Some(KILL) => {
                if let Some(pid) = pid_field(&fields) {
                    kill(&table, pid);
                }
                Some(wire::message(&[KILLED]))
            }
            Some(DONE) => {
                if let Some(pid) = pid_field(&fields) {
                    table.remove(&pid);
                }
                None
            }
            _ => {
                log::error!("launcher: an order it does not understand; ignored");
                None
            }
        };
        if let Some(answer) = answer {
            if let Err(e) = wire::send(control.as_fd(), &answer, &[]) {
                log::error!("launcher: cannot answer the dispatcher: {e}");
                break 70;
            }
        }
    };
    // The dispatcher is gone: so are its workers, every one still running.
    for (&pid, pidfd) in &table {
        if !exited(pidfd.as_fd()) {
            kill(&table, pid);
        }
    }
    code
}

/// The pid of a `KILL` or `DONE` order.
fn pid_field(fields: &[&[u8]]) -> Option<u32> {
    std::str::from_utf8(fields.get(1)?).ok()?.parse().ok()
}

/// Starts the worker a `SPAWN` order asks for; the answer to send back.
fn start(
    fields: &[&[u8]],
    mut fds: Vec<OwnedFd>,
    path: &Path,
    workers: &Workers,
    dispatcher: libc::pid_t,
    table: &mut Table,
) -> Vec<u8> {
    let failed = |errno: i32, why: &str, child: Option<u32>| {
        let child = child.map(|c| c.to_string()).unwrap_or_default();
        wire::message(&[
            FAILED,
            errno.to_string().as_bytes(),
            why.as_bytes(),
            child.as_bytes(),
        ])
    };
    let request = match spawn::Request::parse(fields) {
        Ok(r) => r,
        Err(why) => return failed(0, &why, None),
    };
    if fds.len() != 3 {
        return failed(0, "an order without its three descriptors", None);
    }
    let config = fds.pop().expect("three");
    let stdout = fds.pop().expect("three");
    let stdin = fds.pop().expect("three");
    // A stage that runs a command gets a keeper of its own, which runs exactly the
    // file's COMMAND as the file's USER (started as root only: otherwise the worker
    // starts a keeper of its own, as itself).
    // SAFETY: geteuid has no preconditions.
    let keeper = if request.keeper && unsafe { libc::geteuid() } == 0 {
        match start_keeper(path, &request.stage) {
            Ok(sock) => Some(sock),
            Err(e) => return failed(e.raw_os_error().unwrap_or(0), &e.to_string(), None),
        }
    } else {
        None
    };
    let child = Child {
        stdin,
        stdout,
        config,
        keeper,
    };
    match spawn::spawn(&request, child, workers, dispatcher) {
        Ok((pid, pidfd)) => {
            table.insert(pid, pidfd);
            wire::message(&[STARTED, pid.to_string().as_bytes()])
        }
        Err(spawn::Failure {
            errno,
            message,
            child,
        }) => failed(errno, &message, child),
    }
}

/// Forks a keeper for a worker of `stage`: returns the worker's end of its socket.
fn start_keeper(path: &Path, stage: &str) -> io::Result<OwnedFd> {
    let (worker, theirs) = wire::pair()?;
    let (refusal, mandate) = match crate::keeper::mandate::mandate(path, stage) {
        Ok(m) => (None, m),
        Err(why) => (Some(why), Mandate::Private),
    };
    // SAFETY: this process is single-threaded; the child runs the keeper and exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        drop(worker);
        // SAFETY: prctl with a constant name.
        unsafe { libc::prctl(libc::PR_SET_NAME, c"pepsi-keeper".as_ptr()) };
        let code = keeper::serve(theirs, refusal, mandate);
        // SAFETY: ending the forked child.
        unsafe { libc::_exit(code) };
    }
    // The keeper holds its own copy.
    drop(theirs);
    Ok(worker)
}

/// Has the process of this pidfd exited?
fn exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

/// Kills a worker of the table and every process of its session: the session first,
/// found while the worker (its leader, whose pid is the session's id) is alive or a
/// zombie not yet reaped — the dispatcher reaps only after this answer — then the
/// worker by its pidfd. A pid not in the table is not this launcher's to kill.
fn kill(table: &Table, pid: u32) {
    let Some(pidfd) = table.get(&pid) else {
        log::warn!("launcher: asked to kill pid {pid}, which it did not start; ignored");
        return;
    };
    kill_session(pid);
    // SAFETY: pidfd_send_signal on our pidfd; the worst case is ESRCH.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
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
