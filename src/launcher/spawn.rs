//! One worker's start, the mechanism only: `clone(CLONE_PARENT)` from the launcher, so
//! the worker is the dispatcher's child; in the child, a session of its own, the
//! dispatcher's death signal, its stdin, stdout, keeper socket and handed
//! configuration as descriptors 0, 1, 3 and 4 (nothing else), default signal
//! dispositions, then the switch to `WORKER_AS` (groups, then the overflow group as the
//! real group with the account's as effective and saved, then the user), then `execve`.
//! A failed exec is reported through a close-on-exec pipe, as `std` does.
//!
//! Everything the child needs is made before the clone: between the clone and the exec
//! it calls only async-signal-safe functions, on memory allocated before.

use std::ffi::{CString, OsStr};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{CONFIG_FD, DISPATCHER_PID_ENV, Workers};
use crate::keeper::{KEEPER_FD, KEEPER_FD_ENV};
use crate::privilege::SERVICE_PATH;

/// A `SPAWN` order, read.
#[derive(Debug)]
pub struct Request {
    /// The worker's stage.
    pub stage: String,
    /// Does it get a keeper?
    pub keeper: bool,
    /// The program as the configuration names it.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables over the launcher's environment.
    pub env: Vec<(String, String)>,
}

impl Request {
    /// Reads the fields of a `SPAWN` order.
    pub fn parse(fields: &[&[u8]]) -> Result<Request, String> {
        let text = |i: usize| -> Result<String, String> {
            let b = fields
                .get(i)
                .ok_or("an order with fewer fields than it needs")?;
            String::from_utf8(b.to_vec()).map_err(|_| "a field is not UTF-8".to_string())
        };
        let stage = text(1)?;
        let keeper = text(2)? == "1";
        let program = text(3)?;
        if program.is_empty() || program.contains('\0') {
            return Err("an order without a program".into());
        }
        let argc: usize = text(4)?
            .parse()
            .map_err(|_| "an order with a bad argument count".to_string())?;
        let args = (5..5 + argc).map(text).collect::<Result<Vec<_>, _>>()?;
        let mut env = Vec::new();
        for i in 5 + argc..fields.len() {
            let entry = text(i)?;
            let (name, value) = entry
                .split_once('=')
                .ok_or("an environment entry without '='")?;
            env.push((name.to_string(), value.to_string()));
        }
        Ok(Request {
            stage,
            keeper,
            program,
            args,
            env,
        })
    }
}

/// The descriptors a worker gets.
pub struct Child {
    /// Its stdin (descriptor 0).
    pub stdin: OwnedFd,
    /// Its stdout (descriptor 1).
    pub stdout: OwnedFd,
    /// Its handed configuration (descriptor [`CONFIG_FD`]).
    pub config: OwnedFd,
    /// Its keeper's socket (descriptor [`KEEPER_FD`]), when it has one.
    pub keeper: Option<OwnedFd>,
}

/// Why a worker did not start.
#[derive(Debug)]
pub struct Failure {
    /// The errno, or 0.
    pub errno: i32,
    /// What happened.
    pub message: String,
    /// The pid of a child that was made and exited (the dispatcher reaps it).
    pub child: Option<u32>,
}

impl Failure {
    fn before_clone(errno: i32, message: String) -> Failure {
        Failure {
            errno,
            message,
            child: None,
        }
    }
}

/// The environment of a worker: the launcher's, less what it must not inherit, the
/// account's `HOME`, `USER`, `LOGNAME` and `PATH` when it runs as another, then the
/// order's variables, and the dispatcher's pid.
fn environment(
    request: &Request,
    workers: &Workers,
    dispatcher: libc::pid_t,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut env: Vec<(Vec<u8>, Vec<u8>)> = std::env::vars_os()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .filter(|(k, _)| k.as_slice() != KEEPER_FD_ENV.as_bytes())
        .collect();
    let mut set = |k: &str, v: String| {
        env.retain(|(name, _)| name.as_slice() != k.as_bytes());
        env.push((k.as_bytes().to_vec(), v.into_bytes()));
    };
    if let Workers::As { account, .. } = workers {
        set("HOME", account.home.clone());
        set("USER", account.name.clone());
        set("LOGNAME", account.name.clone());
        set("PATH", SERVICE_PATH.to_string());
    }
    for (k, v) in &request.env {
        set(k, v.clone());
    }
    set(DISPATCHER_PID_ENV, dispatcher.to_string());
    env
}

/// Where the program is: as given when it holds a `/`, else the first executable file
/// of that name on `path` (the worker's `PATH`).
fn resolve(program: &str, path: &OsStr) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

fn executable(p: &Path) -> bool {
    let Ok(c) = CString::new(p.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: access with a valid C string.
    p.is_file() && unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0
}

/// Starts one worker as the dispatcher's child. Returns its pid and a pidfd of it.
pub fn spawn(
    request: &Request,
    child: Child,
    workers: &Workers,
    dispatcher: libc::pid_t,
) -> Result<(u32, OwnedFd), Failure> {
    let env = environment(request, workers, dispatcher);
    let path = env
        .iter()
        .find(|(k, _)| k.as_slice() == b"PATH")
        .map(|(_, v)| OsStr::from_bytes(v).to_os_string())
        .unwrap_or_default();
    let program = resolve(&request.program, &path).ok_or_else(|| {
        Failure::before_clone(
            libc::ENOENT,
            format!("{} not found on PATH", request.program),
        )
    })?;
    let c = |b: &[u8]| {
        CString::new(b)
            .map_err(|_| Failure::before_clone(0, "a NUL in an argument or variable".into()))
    };
    let program_c = c(program.as_os_str().as_bytes())?;
    let mut argv_c = vec![c(request.program.as_bytes())?];
    for a in &request.args {
        argv_c.push(c(a.as_bytes())?);
    }
    let env_c = env
        .iter()
        .map(|(k, v)| c(&[k.as_slice(), b"=", v.as_slice()].concat()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|s| s.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = env_c.iter().map(|s| s.as_ptr()).collect();
    envp.push(std::ptr::null());
    let (err_r, err_w) = crate::keeper::wire::pipe()
        .map_err(|e| Failure::before_clone(e.raw_os_error().unwrap_or(0), e.to_string()))?;
    let switch = match workers {
        Workers::AsLauncher => None,
        Workers::As { account, real_gid } => {
            Some((account.uid, account.gid, *real_gid, account.groups.clone()))
        }
    };
    let fds = [
        (child.stdin.as_raw_fd(), 0),
        (child.stdout.as_raw_fd(), 1),
        (child.config.as_raw_fd(), CONFIG_FD),
    ];
    let keeper = child.keeper.as_ref().map(|k| (k.as_raw_fd(), KEEPER_FD));
    // SAFETY: the launcher is single-threaded, so the child of this clone (a fork that
    // leaves the dispatcher its parent) may run the code below, which calls only
    // async-signal-safe functions on memory allocated before.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        let e = io::Error::last_os_error();
        return Err(Failure::before_clone(
            e.raw_os_error().unwrap_or(0),
            format!("clone: {e}"),
        ));
    }
    if pid == 0 {
        // SAFETY: in the child: see above.
        unsafe {
            let errno = child_setup(&fds, keeper, switch.as_ref(), dispatcher)
                .err()
                .unwrap_or_else(|| {
                    libc::execve(program_c.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    *libc::__errno_location()
                });
            let bytes = errno.to_ne_bytes();
            libc::write(err_w.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127);
        }
    }
    let pid = pid as u32;
    drop(err_w);
    drop(child);
    let mut report = Vec::new();
    let _ = std::fs::File::from(err_r).read_to_end(&mut report);
    if report.len() >= 4 {
        let errno = i32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
        return Err(Failure {
            errno,
            message: format!(
                "cannot start {}: {}",
                program.display(),
                io::Error::from_raw_os_error(errno)
            ),
            child: Some(pid),
        });
    }
    match pidfd(pid) {
        Ok(pidfd) => Ok((pid, pidfd)),
        Err(e) => Err(Failure {
            errno: e.raw_os_error().unwrap_or(0),
            message: format!("cannot watch worker {pid}: {e}"),
            child: Some(pid),
        }),
    }
}

/// The child's steps before its exec; an errno when one fails.
///
/// # Safety
/// Only in the child of the launcher's clone: it changes the process's descriptors,
/// signals and credentials.
unsafe fn child_setup(
    fds: &[(i32, i32); 3],
    keeper: Option<(i32, i32)>,
    switch: Option<&(libc::uid_t, libc::gid_t, libc::gid_t, Vec<libc::gid_t>)>,
    dispatcher: libc::pid_t,
) -> Result<(), i32> {
    let errno = || unsafe { *libc::__errno_location() };
    unsafe {
        // Its own session, so that a kill of it reaches whatever it starts; and it dies
        // with the dispatcher, its parent (unless the dispatcher is already gone).
        if libc::setsid() < 0 || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(errno());
        }
        if libc::getppid() != dispatcher {
            return Err(libc::ESRCH);
        }
        // The descriptors, moved out of the way of their targets first (one may sit on
        // another's target number); then every descriptor from 3 up is marked to close
        // at exec; then each is put in place (dup2 leaves the copy open at exec).
        let mut moved = [(0, 0); 4];
        let mut n = 0;
        for (from, to) in fds.iter().copied().chain(keeper) {
            let high = libc::fcntl(from, libc::F_DUPFD_CLOEXEC, 64);
            if high < 0 {
                return Err(errno());
            }
            moved[n] = (high, to);
            n += 1;
        }
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) != 0 {
            return Err(errno());
        }
        for &(from, to) in &moved[..n] {
            if libc::dup2(from, to) < 0 {
                return Err(errno());
            }
        }
        // The launcher ignores SIGCHLD, and Rust programs SIGPIPE; a worker starts with
        // the defaults and no blocked signal.
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        if let Some((uid, gid, real_gid, groups)) = switch {
            // Groups while still root, the user last. The real group differs from the
            // effective one: the exec that follows makes the worker not dumpable.
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setresgid(*real_gid, *gid, *gid) != 0
                || libc::setresuid(*uid, *uid, *uid) != 0
            {
                return Err(errno());
            }
            if *uid != 0 && libc::setuid(0) == 0 {
                return Err(libc::EPERM);
            }
        }
    }
    Ok(())
}

/// A descriptor that becomes readable when `pid` exits.
fn pidfd(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawn_order_is_read_field_by_field() {
        let r = Request::parse(&[
            b"SPAWN",
            b"relay",
            b"1",
            b"pepsi-stage-relay",
            b"1",
            b"worker",
            b"PGAPPNAME=a=b",
        ])
        .unwrap();
        assert_eq!(
            (
                r.stage.as_str(),
                r.keeper,
                r.program.as_str(),
                r.args.as_slice()
            ),
            (
                "relay",
                true,
                "pepsi-stage-relay",
                &["worker".to_string()][..]
            )
        );
        assert_eq!(r.env, [("PGAPPNAME".to_string(), "a=b".to_string())]);
        for bad in [
            &[&b"SPAWN"[..], b"s", b"0", b"", b"0"][..],
            &[b"SPAWN", b"s", b"0", b"p", b"2", b"worker"],
            &[b"SPAWN", b"s", b"0", b"p", b"x"],
            &[b"SPAWN", b"s", b"0", b"p", b"0", b"NOEQUALS"],
            &[b"SPAWN", b"s", b"0", b"p", b"0", b"\xff=1"],
        ] {
            assert!(Request::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_program_name_is_found_on_the_workers_path() {
        assert_eq!(
            resolve("sh", OsStr::new("/nonexistent:/bin")),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(resolve("no-such-program-here", OsStr::new("/bin")), None);
        assert_eq!(resolve("./x", OsStr::new("")), Some(PathBuf::from("./x")));
    }
}
