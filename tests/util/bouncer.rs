//! `pepsi-failure-bouncer serve` as a child process, with its log captured for
//! assertions.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What `serve` logs (at debug) once its initial sweep is done: it is listening.
pub const SWEPT: &str = "sweep: ";

/// A running `pepsi-failure-bouncer serve`.
pub struct Bouncer {
    child: Child,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Bouncer {
    /// Starts `pepsi-failure-bouncer -c conf -L debug serve ARGS`.
    pub fn serve(conf: &Path, args: &[&str]) -> Bouncer {
        let mut child = Command::new(super::bin("pepsi-failure-bouncer"))
            .arg("-c")
            .arg(conf)
            .args(["-L", "debug", "serve"])
            .args(args)
            .env_remove("PEPSI_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start pepsi-failure-bouncer");
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
        Bouncer {
            child,
            log,
            reader: Some(reader),
        }
    }

    /// Starts `serve` and waits until its first sweep is done (it is listening).
    #[track_caller]
    pub fn ready(conf: &Path, args: &[&str]) -> Bouncer {
        let b = Bouncer::serve(conf, args);
        b.wait_log(SWEPT, Duration::from_secs(20));
        b
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// How often the log says `text`.
    pub fn count(&self, text: &str) -> usize {
        self.log().matches(text).count()
    }

    /// Waits until the log contains `text`.
    #[track_caller]
    pub fn wait_log(&self, text: &str, timeout: Duration) {
        self.wait_log_count(text, 1, timeout);
    }

    /// Waits until the log contains `text` at least `n` times.
    #[track_caller]
    pub fn wait_log_count(&self, text: &str, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.count(text) < n {
            if Instant::now() > deadline {
                panic!(
                    "the bouncer's log never said {text:?} {n} times; it says:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// The exit status if it has exited, without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let status = self.child.try_wait().unwrap()?;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        Some(status)
    }

    /// Waits for the exit, up to `timeout`.
    #[track_caller]
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "pepsi-failure-bouncer did not exit within {timeout:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then the exit status.
    #[track_caller]
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(Duration::from_secs(10))
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
