//! A stage program run as the dispatcher runs it: `PROGRAM -c FILE worker` with stdin
//! and stdout as pipes, the test playing the dispatcher's part: it hands each id with
//! the claim token its row carries, read with the configuration's owner connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// How long a test waits for one line.
const LINE_TIMEOUT: Duration = Duration::from_secs(30);

/// A running worker.
pub struct Worker {
    /// The configuration's `CONNECTION`, where the tokens are read.
    owner: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Worker {
    /// Starts `program -c conf worker`.
    pub fn start(program: &Path, conf: &Path) -> Worker {
        let mut child = Command::new(program)
            .arg("-c")
            .arg(conf)
            .arg("worker")
            .env_remove("PEPSI_CONFIG")
            // Started by hand, so it names its sessions after its pid.
            .env_remove(pepsi::protocol::SESSION_NAME_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let owner = pepsi::config::Config::load(Some(conf))
            .map(|c| c.postgres.connection.clone())
            .unwrap_or_default();
        Worker {
            owner,
            stdin: child.stdin.take(),
            child,
            lines: rx,
            stderr: Some(stderr),
        }
    }

    /// Starts a worker and waits for its `ready`.
    pub fn ready(program: &Path, conf: &Path) -> Worker {
        let mut w = Worker::start(program, conf);
        match w.next_line() {
            Some(line) if line == "ready" => w,
            other => {
                let (status, err) = w.finish();
                panic!("expected ready, got {other:?}; exit {status:?}; stderr:\n{err}")
            }
        }
    }

    /// The worker's process id (its database sessions are named after it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, or None at end of output.
    pub fn next_line(&mut self) -> Option<String> {
        match self.lines.recv_timeout(LINE_TIMEOUT) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => {
                panic!("no line from the worker within {LINE_TIMEOUT:?}")
            }
        }
    }

    /// The next status line, which must exist.
    #[track_caller]
    pub fn status(&mut self) -> String {
        match self.next_line() {
            Some(l) => l,
            None => {
                let (status, err) = self.finish();
                panic!("the worker ended ({status:?}) instead of answering; stderr:\n{err}")
            }
        }
    }

    /// Writes ids in one buffer, each with the claim token its row carries (0 for a
    /// row that does not exist), as the dispatcher hands them.
    pub fn send(&mut self, ids: &[i64]) {
        let mut c = postgres::Client::connect(&self.owner, postgres::NoTls)
            .expect("connect to read the claim tokens");
        let tokens: std::collections::HashMap<i64, i64> = c
            .query(
                "SELECT workqueue_id, claim FROM pepsi.workqueue WHERE workqueue_id = ANY ($1)",
                &[&ids],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let with_tokens: Vec<(i64, i64)> = ids
            .iter()
            .map(|id| (*id, tokens.get(id).copied().unwrap_or(0)))
            .collect();
        self.send_with_tokens(&with_tokens);
    }

    /// Writes ids with the claim tokens given, in one buffer.
    pub fn send_with_tokens(&mut self, assignments: &[(i64, i64)]) {
        let text: String = assignments
            .iter()
            .map(|&(id, token)| {
                pepsi::protocol::format_assignment(pepsi::protocol::Assignment { id, token })
            })
            .collect();
        let stdin = self.stdin.as_mut().expect("stdin is open");
        stdin.write_all(text.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// Sends ids and returns their status lines.
    pub fn run(&mut self, ids: &[i64]) -> Vec<String> {
        self.send(ids);
        ids.iter().map(|_| self.status()).collect()
    }

    /// Closes stdin and waits for the exit; returns the status and stderr.
    pub fn finish(&mut self) -> (ExitStatus, String) {
        self.stdin.take();
        let status = self.child.wait().unwrap();
        let err = self
            .stderr
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default();
        (status, err)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status part of a status line.
pub fn code(line: &str) -> u8 {
    line.split(' ').next().unwrap().parse().unwrap()
}

/// The stages named by a status line's REPORT.
pub fn report_stages(line: &str) -> Vec<String> {
    let Some((_, report)) = line.split_once(' ') else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(report).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| e[0].as_str().unwrap().to_string())
        .collect()
}
