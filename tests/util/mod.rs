//! Helpers shared by the integration tests: the PostgreSQL harness, the programs under
//! test, configuration files and polling with a deadline.

#![allow(dead_code)]

pub mod pg;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub use pg::TestDb;

/// A program built by this package.
pub fn bin(name: &str) -> PathBuf {
    match name {
        "pepsi-setup" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-setup")),
        other => panic!("unknown program {other}"),
    }
}

/// A private temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new empty directory under the system temp dir.
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pepsi-t-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// A path inside it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes a file inside it and returns its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A configuration file for a test database: `[pepsi] RUN_AS = root`, the connection,
/// then `extra`.
pub fn write_config(dir: &TempDir, db: &TestDb, extra: &str) -> PathBuf {
    dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n{extra}",
            db.connection()
        ),
    )
}

/// Runs a program to completion with a config file and arguments.
pub fn run(program: &Path, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env_remove("PEPSI_CONFIG")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()))
}

/// Stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Polls `cond` until it is true or `timeout` passes; then fails naming `what`.
#[track_caller]
pub fn wait_until(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
