//! The worker's side of the keeper: the connection (the one the dispatcher handed it,
//! or a keeper of its own), a command run through it, its wait with a deadline and its
//! kill. An exec stage holds one [`Keeper`] per worker process and runs one command at
//! a time through it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::wire::{self, Received};
use super::{
    EXIT, KEEPER_FD, KEEPER_FD_ENV, KILL, READY, REFUSED, RUN, SERVE_FD_ENV, START_ERROR, STARTED,
};

/// How long a keeper may take to greet.
const GREETING: Duration = Duration::from_secs(10);

/// Why a command did not run to an exit status.
#[derive(Debug)]
pub enum RunError {
    /// It could not be started (the errno of the failed start, 0 when the keeper
    /// refused it for a reason of its own).
    Start {
        /// The errno, or 0.
        errno: i32,
        /// What happened.
        message: String,
    },
    /// The keeper is gone or said something out of turn.
    Lost(String),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Start { message, .. } => f.write_str(message),
            RunError::Lost(m) => write!(f, "the command's keeper is gone: {m}"),
        }
    }
}

/// An answer of the keeper: its name and its other fields.
type Answer = (&'static [u8], Vec<Vec<u8>>);

/// A connection to a keeper.
#[derive(Debug)]
pub struct Keeper {
    sock: OwnedFd,
    /// Does it run the file's command as the file's `USER` (the dispatcher's keeper),
    /// rather than what this worker asks for?
    pub fixed: bool,
}

/// Reads the keeper's greeting: ready, or why it refuses.
fn greeting(sock: &OwnedFd) -> Result<(), String> {
    if !wire::wait_readable(sock.as_fd(), Some(GREETING)).map_err(|e| e.to_string())? {
        return Err(format!(
            "the command's keeper did not answer within {}s",
            GREETING.as_secs()
        ));
    }
    match wire::recv(sock.as_fd()).map_err(|e| e.to_string())? {
        Received::Message(m, _) => {
            let fields = wire::fields(&m);
            match fields.first().copied() {
                Some(READY) => Ok(()),
                Some(REFUSED) => {
                    Err(String::from_utf8_lossy(fields.get(1).unwrap_or(&&b""[..])).into_owned())
                }
                _ => Err("the command's keeper greeted with something else".into()),
            }
        }
        Received::Closed => Err("the command's keeper closed its connection".into()),
    }
}

impl Keeper {
    /// The keeper the dispatcher handed this worker (descriptor [`KEEPER_FD`], named by
    /// `PEPSI_KEEPER_FD`), once it has greeted; `Ok(None)` when there is none. A keeper
    /// that refuses (the stage's `USER` does not exist, say) is an error with its
    /// reason: the worker refuses to run.
    pub fn inherited() -> Result<Option<Keeper>, String> {
        let Ok(value) = std::env::var(KEEPER_FD_ENV) else {
            return Ok(None);
        };
        if value != KEEPER_FD.to_string() {
            return Err(format!("{KEEPER_FD_ENV}={value:?} is not {KEEPER_FD}"));
        }
        // SAFETY: fstat on a descriptor number only reads; the stat buffer is ours.
        let is_socket = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(KEEPER_FD, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK
        };
        if !is_socket {
            return Err(format!(
                "{KEEPER_FD_ENV}: descriptor {KEEPER_FD} is no socket"
            ));
        }
        // SAFETY: descriptor 3 is the open socket the dispatcher passed, owned by this
        // process from now on; it must not reach the children this worker starts.
        let sock = unsafe {
            libc::fcntl(KEEPER_FD, libc::F_SETFD, libc::FD_CLOEXEC);
            OwnedFd::from_raw_fd(KEEPER_FD)
        };
        greeting(&sock)?;
        Ok(Some(Keeper { sock, fixed: true }))
    }

    /// A keeper of this worker's own: this very program started again as a keeper
    /// (`PEPSI_KEEPER_SERVE_FD`), running as this worker. It ends when the worker does.
    pub fn private() -> Result<Keeper, String> {
        let (ours, theirs) = wire::pair().map_err(|e| e.to_string())?;
        let raw = theirs.as_raw_fd();
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0("pepsi-keeper")
            .env_clear()
            .env(SERVE_FD_ENV, KEEPER_FD.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: dup2 and fcntl are async-signal-safe; the keeper finds its end as
        // descriptor 3, without close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                if raw == KEEPER_FD {
                    if libc::fcntl(raw, libc::F_SETFD, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                } else if libc::dup2(raw, KEEPER_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn()
            .map_err(|e| format!("cannot start the command's keeper: {e}"))?;
        drop(theirs);
        greeting(&ours)?;
        Ok(Keeper {
            sock: ours,
            fixed: false,
        })
    }

    /// Starts a command: `argv` as `user` (empty: the keeper's own account; ignored by
    /// a fixed keeper, which runs its own), with `env`, the given stdin and stderr, and
    /// the read end of its recipients' pipe (its descriptor [`super::RECIPIENTS_FD`]);
    /// returns its pid. A request too large to pass is refused as exec refuses an
    /// environment too large: `E2BIG`.
    pub fn run(
        &self,
        user: &str,
        argv: &[String],
        env: &[(&str, String)],
        pipes: [OwnedFd; 3],
    ) -> Result<u32, RunError> {
        let argc = argv.len().to_string();
        let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut fields: Vec<&[u8]> = vec![RUN, user.as_bytes(), argc.as_bytes()];
        fields.extend(argv.iter().map(|a| a.as_bytes()));
        fields.extend(env.iter().map(|e| e.as_bytes()));
        let message = wire::message(&fields);
        let too_big = || RunError::Start {
            errno: libc::E2BIG,
            message: format!(
                "cannot start {}: the message's environment is too large ({} bytes)",
                argv[0],
                message.len()
            ),
        };
        // The keeper would read a longer message cut short.
        if message.len() > wire::MAX_MESSAGE {
            return Err(too_big());
        }
        let fds: Vec<_> = pipes.iter().map(|p| p.as_fd()).collect();
        if let Err(e) = wire::send(self.sock.as_fd(), &message, &fds) {
            return Err(if e.raw_os_error() == Some(libc::EMSGSIZE) {
                // As exec itself would say: the environment does not fit.
                too_big()
            } else {
                RunError::Lost(e.to_string())
            });
        }
        // The command holds its own copies now.
        drop(pipes);
        match self.receive(None)? {
            Some((STARTED, fields)) => {
                String::from_utf8_lossy(fields.first().unwrap_or(&Vec::new()))
                    .parse()
                    .map_err(|_| RunError::Lost("a start without a pid".into()))
            }
            Some((START_ERROR, fields)) => Err(start_error(&argv[0], &fields)),
            other => Err(RunError::Lost(format!("unexpected answer {other:?}"))),
        }
    }

    /// Waits up to `timeout` (forever for `None`) for the running command to end:
    /// its raw wait status, or `None` when the time ran out.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<i32>, RunError> {
        match self.receive(timeout)? {
            None => Ok(None),
            Some((EXIT, fields)) => String::from_utf8_lossy(fields.first().unwrap_or(&Vec::new()))
                .parse()
                .map(Some)
                .map_err(|_| RunError::Lost("an exit without a status".into())),
            Some((START_ERROR, fields)) => Err(RunError::Lost(
                String::from_utf8_lossy(fields.get(1).unwrap_or(&Vec::new())).into_owned(),
            )),
            other => Err(RunError::Lost(format!("unexpected answer {other:?}"))),
        }
    }

    /// Has the keeper kill the running command and everything it started.
    pub fn kill(&self) -> Result<(), RunError> {
        wire::send(self.sock.as_fd(), KILL, &[]).map_err(|e| RunError::Lost(e.to_string()))
    }

    /// The next message from the keeper within `timeout`: its name and other fields.
    fn receive(&self, timeout: Option<Duration>) -> Result<Option<Answer>, RunError> {
        let lost = |e: io::Error| RunError::Lost(e.to_string());
        if !wire::wait_readable(self.sock.as_fd(), timeout).map_err(lost)? {
            return Ok(None);
        }
        match wire::recv(self.sock.as_fd()).map_err(lost)? {
            Received::Closed => Err(RunError::Lost("it closed the connection".into())),
            Received::Message(m, _) => {
                let fields = wire::fields(&m);
                let name = [STARTED, START_ERROR, EXIT]
                    .into_iter()
                    .find(|n| fields.first() == Some(n))
                    .ok_or_else(|| RunError::Lost("an answer it does not know".into()))?;
                Ok(Some((
                    name,
                    fields[1..].iter().map(|f| f.to_vec()).collect(),
                )))
            }
        }
    }
}

/// A start error's fields (errno, reason) as a [`RunError`].
fn start_error(program: &str, fields: &[Vec<u8>]) -> RunError {
    let errno = fields
        .first()
        .and_then(|f| String::from_utf8_lossy(f).parse().ok())
        .unwrap_or(0);
    let why = String::from_utf8_lossy(fields.get(1).map_or(&[][..], Vec::as_slice)).into_owned();
    RunError::Start {
        errno,
        message: format!("cannot start {program}: {why}"),
    }
}

/// Serves as a worker's private keeper when this process was started as one
/// (`PEPSI_KEEPER_SERVE_FD`); `None` otherwise. Called first thing by the stage
/// binary's `main`.
pub fn serve_if_asked() -> Option<i32> {
    let value = std::env::var(SERVE_FD_ENV).ok()?;
    if value != KEEPER_FD.to_string() {
        eprintln!("pepsi-keeper: {SERVE_FD_ENV}={value:?} is not {KEEPER_FD}");
        return Some(70);
    }
    // SAFETY: descriptor 3 is the socket the worker passed; ours from now on, and kept
    // from the commands this keeper starts.
    let sock = unsafe {
        libc::fcntl(KEEPER_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        OwnedFd::from_raw_fd(KEEPER_FD)
    };
    Some(super::serve::serve(
        sock,
        None,
        super::serve::Mandate::Private,
    ))
}
