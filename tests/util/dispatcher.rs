//! `pepsi-dispatch serve` as a child process, with its log captured for assertions and
//! its worker processes visible through /proc.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// A running dispatcher.
pub struct Dispatcher {
    child: Child,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Dispatcher {
    /// Starts `pepsi-dispatch -c conf serve` with extra environment.
    pub fn start(conf: &Path, env: &[(&str, &str)]) -> Dispatcher {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pepsi-dispatch"));
        cmd.arg("-c").arg(conf).arg("-L").arg("debug").arg("serve");
        // Its own process group, as under a shell's job control.
        cmd.process_group(0);
        cmd.env_remove("PEPSI_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start pepsi-dispatch");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Dispatcher {
            child,
            log,
            reader: Some(reader),
        }
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything logged so far (the dispatcher's and its workers' stderr).
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log contains `text`.
    #[track_caller]
    pub fn wait_log(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(text) {
            if Instant::now() > deadline {
                panic!("the log never said {text:?}; it says:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a signal.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Sends a signal to its process group, as a Ctrl-C at its terminal does.
    pub fn signal_group(&self, signal: i32) {
        // SAFETY: signalling the process group of our own child.
        unsafe { libc::kill(-(self.child.id() as i32), signal) };
    }

    /// Waits for the exit, up to `timeout`.
    #[track_caller]
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "pepsi-dispatch did not exit within {timeout:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if it has exited, without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let status = self.child.try_wait().unwrap()?;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        Some(status)
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(Duration::from_secs(30))
    }

    /// The dispatcher's child processes (its workers).
    pub fn children(&self) -> Vec<u32> {
        children_of(self.child.id())
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

/// Is a process alive (and not a zombie)?
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => !status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => false,
    }
}
