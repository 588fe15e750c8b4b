//! `pepsi-dispatch serve` as a child process, with its log captured for assertions and
//! its worker processes visible through /proc.

use std::ops::{Deref, DerefMut};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use super::logged::Logged;

/// The fault-injecting test worker (`examples/fault_worker.rs`), built on demand when
/// only the test target was built.
pub fn fault_worker() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let target = Path::new(env!("CARGO_BIN_EXE_pepsi-stage"))
        .parent()
        .unwrap();
    let path = target.join("examples").join("fault_worker");
    BUILT.call_once(|| {
        let profile_release = target.file_name().is_some_and(|n| n == "release");
        let mut cmd = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        cmd.args(["build", "--quiet", "--example", "fault_worker"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo build --example fault_worker");
        assert!(status.success(), "cannot build the fault worker");
    });
    path
}

/// A running dispatcher: its log, signals and exit are [`Logged`]'s.
pub struct Dispatcher(Logged);

impl Dispatcher {
    /// Starts `pepsi-dispatch -c conf serve` with extra environment.
    pub fn start(conf: &Path, env: &[(&str, &str)]) -> Dispatcher {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pepsi-dispatch"));
        cmd.arg("-c").arg(conf).arg("-L").arg("debug").arg("serve");
        // Its own process group, as under a shell's job control.
        cmd.process_group(0);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Dispatcher(Logged::spawn("pepsi-dispatch", &mut cmd))
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(Duration::from_secs(30))
    }

    /// The dispatcher's workers: its child processes but the launcher it starts
    /// (`pepsi-launcher`).
    pub fn children(&self) -> Vec<u32> {
        children_of(self.pid())
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .map_or(true, |comm| comm.trim_end() != "pepsi-launcher")
            })
            .collect()
    }

    /// The dispatcher's launcher.
    pub fn launcher(&self) -> Option<u32> {
        children_of(self.pid()).into_iter().find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == "pepsi-launcher")
        })
    }

    /// The pid of the worker whose database sessions are named `session`.
    pub fn worker_named(&self, session: &str) -> Option<u32> {
        self.children()
            .into_iter()
            .find(|&pid| session_name_of(pid).as_deref() == Some(session))
    }
}

impl Deref for Dispatcher {
    type Target = Logged;

    fn deref(&self) -> &Logged {
        &self.0
    }
}

impl DerefMut for Dispatcher {
    fn deref_mut(&mut self) -> &mut Logged {
        &mut self.0
    }
}

/// The processes whose parent is `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{child}/status")) else {
            continue;
        };
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<u32>().ok());
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        if ppid == Some(pid) && !zombie {
            out.push(child);
        }
    }
    out
}

/// The name the dispatcher gave a worker's database sessions: `PGAPPNAME` in the
/// environment it started the worker with (`/proc/PID/environ`, readable by its user).
pub fn session_name_of(pid: u32) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{}=", pepsi::protocol::SESSION_NAME_ENV);
    environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(key.as_bytes()))
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// Is a process alive (and not a zombie)?
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => !status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => false,
    }
}
