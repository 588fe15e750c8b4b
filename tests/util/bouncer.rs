//! `pepsi-failure-bouncer serve` as a child process, with its log captured for
//! assertions.

use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use super::logged::Logged;

/// What `serve` logs (at debug) once its initial sweep is done: it is listening.
pub const SWEPT: &str = "sweep: ";

/// A running `pepsi-failure-bouncer serve`: its log, signals and exit are
/// [`Logged`]'s.
pub struct Bouncer(Logged);

impl Bouncer {
    /// Starts `pepsi-failure-bouncer -c conf -L debug serve ARGS`.
    pub fn serve(conf: &Path, args: &[&str]) -> Bouncer {
        let mut cmd = Command::new(super::bin("pepsi-failure-bouncer"));
        cmd.arg("-c")
            .arg(conf)
            .args(["-L", "debug", "serve"])
            .args(args);
        Bouncer(Logged::spawn("pepsi-failure-bouncer", &mut cmd))
    }

    /// Starts `serve` and waits until its first sweep is done (it is listening).
    #[track_caller]
    pub fn ready(conf: &Path, args: &[&str]) -> Bouncer {
        let b = Bouncer::serve(conf, args);
        b.wait_log(SWEPT, Duration::from_secs(20));
        b
    }

    /// SIGTERM, then the exit status.
    #[track_caller]
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(Duration::from_secs(10))
    }
}

impl Deref for Bouncer {
    type Target = Logged;

    fn deref(&self) -> &Logged {
        &self.0
    }
}

impl DerefMut for Bouncer {
    fn deref_mut(&mut self) -> &mut Logged {
        &mut self.0
    }
}
