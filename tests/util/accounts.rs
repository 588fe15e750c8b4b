//! System accounts the tests that switch accounts run their programs as (they run as
//! root: CI does): made with `useradd` the first time a test asks, kept after (a
//! machine the tests run on is theirs), named `pepsi-t-…` so they are told from any
//! other.

use std::process::Command;
use std::sync::Mutex;

/// One `useradd` at a time: two tests may ask for the same account at once.
static MAKING: Mutex<()> = Mutex::new(());

/// The account `name`, made when missing: a system account with a group of its own
/// and no home or login, a member of `groups` too. Returns its name.
pub fn account(name: &str, groups: &[&str]) -> String {
    let _one = MAKING.lock().unwrap_or_else(|p| p.into_inner());
    if pepsi::privilege::lookup(name).is_err() {
        let mut cmd = Command::new("useradd");
        cmd.args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
        ]);
        if !groups.is_empty() {
            cmd.args(["--groups", &groups.join(",")]);
        }
        let out = cmd.arg(name).output().expect("useradd runs");
        assert!(
            out.status.success() || pepsi::privilege::lookup(name).is_ok(),
            "useradd {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    name.to_string()
}

/// The account the tests' workers run as when the dispatcher switches accounts: a
/// member of `nogroup`, which the test cluster's socket directory admits.
pub fn worker_account() -> String {
    account("pepsi-t-worker", &["nogroup"])
}

/// The user id of an account.
pub fn uid_of(name: &str) -> u32 {
    pepsi::privilege::lookup(name)
        .expect("the account exists")
        .uid
}
