//! The keeper process: runs one worker's commands, one at a time, each in a process
//! group of its own with a clean environment, no descriptor but its stdin, stdout,
//! stderr and the pipe of its recipients (descriptor [`RECIPIENTS_FD`]), and — when the
//! keeper may — as the stage's `USER`; reports each start and exit; kills a command on
//! request; and kills whatever a command left behind when it ends, detached or not
//! (the keeper is a child subreaper, so a process that left its process group or
//! session still becomes its child). When the worker's end of the connection closes,
//! the keeper kills what runs and exits.
//!
//! Runs single-threaded in a process of its own (forked by the dispatcher's master, or
//! started by a worker for itself), so it may fork freely. It never reads the message:
//! the worker passes the command's stdin, stderr and recipients' pipes with the
//! request.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use super::wire::{self, Received};
use super::{
    ALLOWED_ENV, EXIT, KILL, READY, RECIPIENTS_FD, RECIPIENTS_FD_ENV, REFUSED, RUN, START_ERROR,
    STARTED,
};
use crate::privilege::{Passwd, SERVICE_PATH, lookup};

/// What a keeper may run.
#[derive(Clone, Debug)]
pub enum Mandate {
    /// The dispatcher's keeper for a stage: exactly the file's `COMMAND`, as the
    /// account its `USER` names (`None`: as the keeper itself, when it is no root).
    Fixed {
        /// The command, split on whitespace.
        argv: Vec<String>,
        /// The account to switch to.
        account: Option<Passwd>,
    },
    /// A worker's own keeper, running as the worker: the command the worker asks for,
    /// as the account it names when this process may switch to it (root), else only as
    /// itself.
    Private,
}

/// One request: the command, the account asked for (empty: none) and its environment.
struct Request {
    user: String,
    argv: Vec<String>,
    env: Vec<(String, String)>,
}

/// Reads a `RUN` message: `RUN`, user, argc, argv…, `NAME=value`….
fn parse_request(fields: &[&[u8]]) -> Result<Request, String> {
    let text =
        |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| "a field is not UTF-8".to_string());
    let (Some(user), Some(argc)) = (fields.get(1), fields.get(2)) else {
        return Err("a request without its fields".into());
    };
    let argc: usize = text(argc)?
        .parse()
        .map_err(|_| "a request with a bad argument count".to_string())?;
    let argv: Vec<String> = fields
        .get(3..3 + argc)
        .ok_or("a request with fewer arguments than it counts")?
        .iter()
        .map(|b| text(b))
        .collect::<Result<_, _>>()?;
    if argv.is_empty() {
        return Err("a request without a command".into());
    }
    let mut env = Vec::new();
    for entry in &fields[3 + argc..] {
        let entry = text(entry)?;
        let Some((name, value)) = entry.split_once('=') else {
            return Err("an environment entry without '='".into());
        };
        // Only the documented message variables pass; anything else a worker sends
        // (its own configuration, its database settings) is dropped.
        if ALLOWED_ENV.contains(&name) {
            env.push((name.to_string(), value.to_string()));
        }
    }
    Ok(Request {
        user: text(user)?,
        argv,
        env,
    })
}

/// Is `fd` a pipe? A command's stdin and stderr are the worker's pipes, never another
/// kind of descriptor of the worker's (a socket, a file).
fn is_pipe(fd: &OwnedFd) -> bool {
    // SAFETY: fstat on an open descriptor fills our buffer.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd.as_raw_fd(), &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO
    }
}

/// Is this process root?
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The account a request runs as under `mandate`: `Ok(None)` to stay this process's
/// own, or why it may not run.
fn account_for(mandate: &Mandate, request: &Request) -> Result<Option<Passwd>, String> {
    match mandate {
        Mandate::Fixed { argv, account } => {
            if *argv != request.argv {
                return Err(format!(
                    "the command {:?} is not the one the configuration file gives this stage ({:?})",
                    request.argv.join(" "),
                    argv.join(" ")
                ));
            }
            Ok(account.clone())
        }
        Mandate::Private if request.user.is_empty() => Ok(None),
        Mandate::Private if is_root() => lookup(&request.user).map(Some),
        Mandate::Private => {
            if crate::privilege::current_account().as_deref() == Some(request.user.as_str()) {
                Ok(None)
            } else {
                Err(format!(
                    "cannot run as USER {}: the worker is not root and may not switch accounts",
                    request.user
                ))
            }
        }
    }
}

/// Marks every descriptor from 3 up close-on-exec (not closed: `std`'s own pipe that
/// reports a failed exec must live until the exec). Async-signal-safe.
fn cloexec_from_3() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range only changes descriptor flags.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) };
    if r == 0 {
        return;
    }
    // Kernels before 5.11: one descriptor at a time, up to the limit.
    // SAFETY: sysconf and fcntl are async-signal-safe; fcntl on a closed descriptor
    // only fails.
    let max = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(0, 1 << 20) as i32;
    for fd in 3..max {
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

/// Starts the command of `request` as `account`, its stdin and stderr the pipes the
/// worker passed, and the recipients' pipe, when it passed one (a worker of an earlier
/// release does not), as descriptor [`RECIPIENTS_FD`].
fn start(
    request: Request,
    account: Option<Passwd>,
    stdin: OwnedFd,
    stderr: OwnedFd,
    recipients: Option<OwnedFd>,
) -> io::Result<Child> {
    let mut cmd = Command::new(&request.argv[0]);
    let home = account
        .as_ref()
        .map(|a| a.home.clone())
        .or_else(|| std::env::var("HOME").ok())
        .unwrap_or_else(|| "/".to_string());
    cmd.args(&request.argv[1..])
        .env_clear()
        .envs(request.env)
        .env("PATH", SERVICE_PATH)
        .env("HOME", home)
        .current_dir("/")
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        // Its own process group: a kill reaches its helpers too.
        .process_group(0);
    if recipients.is_some() {
        cmd.env(RECIPIENTS_FD_ENV, RECIPIENTS_FD.to_string());
    }
    let recipients_raw = recipients.as_ref().map(|r| r.as_raw_fd());
    let switch = account.map(|a| (a.uid, a.gid, a.groups));
    // SAFETY: only async-signal-safe calls (setgroups, setgid, setuid, prctl, fcntl,
    // close_range, dup2) on memory allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if let Some((uid, gid, groups)) = &switch {
                // Groups and group first, while still root; the user last.
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(*gid) != 0
                    || libc::setuid(*uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                if *uid != 0 && libc::setuid(0) == 0 {
                    return Err(io::Error::from_raw_os_error(libc::EPERM));
                }
            }
            // After the switch, which clears it: the command dies with its keeper.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            cloexec_from_3();
            // After the mark, which would close it at the exec: the recipients'
            // pipe as descriptor 3 (dup2 gives the copy no close-on-exec; a pipe
            // already at 3 loses its mark). Descriptor 3 is never std's own pipe that
            // reports a failed exec: [`hold_recipients_fd`] keeps it taken.
            if let Some(raw) = recipients_raw {
                let r = if raw == RECIPIENTS_FD {
                    libc::fcntl(raw, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, RECIPIENTS_FD)
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn();
    // The command holds its own copy now.
    drop(recipients);
    child
}

/// Keeps descriptor [`RECIPIENTS_FD`] taken in the keeper (by `/dev/null`,
/// close-on-exec, when nothing holds it), so that no descriptor the keeper opens later,
/// such as std's pipe that reports a failed exec, gets the number a command's
/// recipients are moved to.
fn hold_recipients_fd() {
    // SAFETY: fcntl on a descriptor number only reads its flags; open and dup3 make
    // new descriptors that this process owns for its lifetime.
    unsafe {
        if libc::fcntl(RECIPIENTS_FD, libc::F_GETFD) >= 0 {
            return;
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null >= 0 && null != RECIPIENTS_FD {
            libc::dup3(null, RECIPIENTS_FD, libc::O_CLOEXEC);
            libc::close(null);
        }
    }
}

/// This process's children (including the orphans it adopted as a subreaper).
fn children() -> Vec<libc::pid_t> {
    let me = std::process::id();
    let mut out = Vec::new();
    // Every thread's list: orphans are adopted by the process, listed under a thread.
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{me}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<libc::pid_t>().ok()),
                );
            }
        }
    }
    out
}

/// Kills every process this keeper has as a child, with their process groups, and
/// reaps them, until none is left: a command's helpers that outlived it (a detached
/// daemon, a double fork) are orphans adopted here.
fn sweep() {
    for _ in 0..1000 {
        let kids = children();
        if kids.is_empty() {
            return;
        }
        for &pid in &kids {
            // SAFETY: signalling a child and its group; a group that is no more only
            // fails.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
        }
        for &pid in &kids {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
        }
    }
    log::error!("keeper: processes keep appearing; giving up the sweep");
}

/// A command that runs.
struct Running {
    child: Child,
    pidfd: OwnedFd,
}

impl Running {
    /// Kills its process group (the command and the helpers still in it).
    fn kill(&self) {
        // SAFETY: signalling the command's own process group.
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
    }
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

/// Says `message` to the worker; a worker gone is noticed at the next receive.
fn say(sock: BorrowedFd<'_>, fields: &[&[u8]]) {
    let _ = wire::send(sock, &wire::message(fields), &[]);
}

/// How often a keeper reaps the orphans a running command leaves (a command that forks
/// and abandons processes fast would otherwise fill the process table with zombies
/// until it ends).
const REAP_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// What a wait found.
#[derive(Debug, PartialEq, Eq)]
enum Woke {
    /// The worker said something (or went).
    Worker,
    /// The running command ended.
    Command,
    /// Time to reap the orphans that ended.
    Tick,
}

/// Reaps this keeper's children that have ended, but the running command (whose end
/// is read from its own handle): orphans of the command, adopted here.
fn reap_ended_orphans(running: Option<&Running>) {
    let command = running.map(|r| r.child.id() as libc::pid_t);
    for pid in children() {
        if Some(pid) != command {
            let mut status = 0;
            // SAFETY: a non-blocking wait for our own child.
            unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        }
    }
}

/// Waits until the connection or the running command's pidfd is readable, or, while a
/// command runs, [`REAP_EVERY`] has passed.
fn wait_either(sock: BorrowedFd<'_>, running: Option<&Running>) -> io::Result<Woke> {
    let mut fds = [
        libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: running.map_or(-1, |r| r.pidfd.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let tick = if running.is_some() {
        REAP_EVERY.as_millis() as i32
    } else {
        -1
    };
    loop {
        // SAFETY: fds is two valid pollfd entries (a negative fd is ignored).
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, tick) };
        if r == 0 {
            return Ok(Woke::Tick);
        }
        if r > 0 {
            return Ok(if fds[0].revents != 0 && fds[1].revents == 0 {
                Woke::Worker
            } else {
                Woke::Command
            });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Serves the worker at `sock` until it goes; returns the process's exit status. With
/// a `refusal`, says so (`REFUSED`) and ends: the worker refuses to run with it.
pub fn serve(sock: OwnedFd, refusal: Option<String>, mandate: Mandate) -> i32 {
    // The master ignores SIGCHLD so that it never holds zombies; a keeper must wait
    // for its own children.
    // SAFETY: restoring a default disposition; prctl with constant arguments.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
    }
    hold_recipients_fd();
    let sock_fd = sock.as_fd();
    if let Some(why) = refusal {
        say(sock_fd, &[REFUSED, why.as_bytes()]);
        return 0;
    }
    say(sock_fd, &[READY]);
    let mut running: Option<Running> = None;
    loop {
        let woke = match wait_either(sock_fd, running.as_ref()) {
            Ok(w) => w,
            Err(e) => {
                log::error!("keeper: poll failed: {e}");
                break;
            }
        };
        if woke != Woke::Command {
            reap_ended_orphans(running.as_ref());
        }
        if woke == Woke::Tick {
            continue;
        }
        if woke == Woke::Command {
            // The command ended: reap it, then whatever it left behind.
            let Some(mut r) = running.take() else {
                continue;
            };
            let status = r.child.wait().map(|s| {
                use std::os::unix::process::ExitStatusExt;
                s.into_raw()
            });
            r.kill();
            sweep();
            match status {
                Ok(raw) => {
                    log::debug!("keeper: command {} ended, wait status {raw}", r.child.id());
                    say(sock_fd, &[EXIT, raw.to_string().as_bytes()])
                }
                Err(e) => say(sock_fd, &[START_ERROR, b"0", e.to_string().as_bytes()]),
            }
            continue;
        }
        let (message, mut fds) = match wire::recv(sock_fd) {
            Ok(Received::Message(m, fds)) => (m, fds),
            Ok(Received::Closed) => break,
            Err(e) => {
                log::error!("keeper: cannot read the worker's request: {e}");
                break;
            }
        };
        let fields = wire::fields(&message);
        match fields.first().copied() {
            Some(KILL) => {
                if let Some(r) = &running {
                    r.kill();
                }
            }
            Some(RUN)
                if running.is_none() && (2..=3).contains(&fds.len()) && fds.iter().all(is_pipe) =>
            {
                let recipients = (fds.len() == 3).then(|| fds.pop().expect("three descriptors"));
                let stderr = fds.pop().expect("two descriptors");
                let stdin = fds.pop().expect("two descriptors");
                let started = parse_request(&fields).and_then(|request| {
                    let account = account_for(&mandate, &request)?;
                    log::debug!(
                        "keeper: running {:?} as {}",
                        request.argv,
                        account
                            .as_ref()
                            .map_or("the keeper's account", |a| a.name.as_str())
                    );
                    start(request, account, stdin, stderr, recipients)
                        .map_err(|e| format!("{}\0{e}", e.raw_os_error().unwrap_or(0)))
                });
                match started {
                    Ok(child) => match pidfd(child.id()) {
                        Ok(pidfd) => {
                            say(sock_fd, &[STARTED, child.id().to_string().as_bytes()]);
                            running = Some(Running { child, pidfd });
                        }
                        Err(e) => {
                            // Without a way to wait for it alongside the worker, it
                            // does not run at all.
                            let mut child = child;
                            // SAFETY: signalling the command's own process group.
                            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                            let _ = child.wait();
                            sweep();
                            say(
                                sock_fd,
                                &[START_ERROR, b"0", format!("pidfd_open: {e}").as_bytes()],
                            );
                        }
                    },
                    Err(why) => {
                        // An errno from the exec, or 0 and a reason of ours.
                        let (errno, text) = why.split_once('\0').unwrap_or(("0", &why));
                        say(sock_fd, &[START_ERROR, errno.as_bytes(), text.as_bytes()]);
                    }
                }
            }
            _ => {
                say(sock_fd, &[START_ERROR, b"0", b"a request out of turn"]);
            }
        }
    }
    if let Some(r) = &running {
        r.kill();
    }
    sweep();
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(user: &str, argv: &[&str], env: &[&str]) -> Vec<u8> {
        let argc = argv.len().to_string();
        let mut fields: Vec<&[u8]> = vec![RUN, user.as_bytes(), argc.as_bytes()];
        fields.extend(argv.iter().map(|a| a.as_bytes()));
        fields.extend(env.iter().map(|e| e.as_bytes()));
        wire::message(&fields)
    }

    #[test]
    fn a_request_keeps_only_the_message_variables() {
        let m = request(
            "",
            &["/bin/deliver", "-x"],
            &[
                "PEPSI_ID=7",
                "PEPSI_CONFIG=/etc/pepsi/pepsi.conf",
                "LANG=C.UTF-8",
                "PGHOST=/run",
            ],
        );
        let r = parse_request(&wire::fields(&m)).unwrap();
        assert_eq!(r.argv, ["/bin/deliver", "-x"]);
        assert_eq!(
            r.env,
            [
                ("PEPSI_ID".to_string(), "7".to_string()),
                ("LANG".to_string(), "C.UTF-8".to_string())
            ]
        );
        assert!(parse_request(&wire::fields(&request("", &[], &[]))).is_err());
        assert!(parse_request(&wire::fields(b"RUN\0\x005\0a")).is_err());
    }

    #[test]
    fn a_fixed_mandate_runs_only_the_files_command() {
        let fixed = Mandate::Fixed {
            argv: vec!["/bin/deliver".into()],
            account: None,
        };
        let ok = parse_request(&wire::fields(&request("", &["/bin/deliver"], &[]))).unwrap();
        assert_eq!(account_for(&fixed, &ok), Ok(None));
        let other = parse_request(&wire::fields(&request("", &["/bin/sh"], &[]))).unwrap();
        assert!(
            account_for(&fixed, &other)
                .unwrap_err()
                .contains("is not the one the configuration file gives")
        );
    }
}
