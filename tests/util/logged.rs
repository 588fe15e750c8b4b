//! A program under test as a child process whose stderr is captured line by line, for
//! assertions on its log while it runs; killed when dropped. `Dispatcher` and `Bouncer`
//! are this with their own start-up.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running program with its stderr captured.
pub struct Logged {
    /// Its name, for failure messages.
    name: &'static str,
    child: Child,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Logged {
    /// Starts `cmd` with no stdin or stdout and its stderr captured.
    pub fn spawn(name: &'static str, cmd: &mut Command) -> Logged {
        let mut child = cmd
            .env_remove("PEPSI_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
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
        Logged {
            name,
            child,
            log,
            reader: Some(reader),
        }
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
                    "{}'s log never said {text:?} {n} times; it says:\n{}",
                    self.name,
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

    /// Sends a signal to its process group, as a Ctrl-C at its terminal does.
    pub fn signal_group(&self, signal: i32) {
        // SAFETY: signalling the process group of our own child.
        unsafe { libc::kill(-(self.child.id() as i32), signal) };
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
                    "{} did not exit within {timeout:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
