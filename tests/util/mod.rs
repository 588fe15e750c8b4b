//! Helpers shared by the integration tests: the PostgreSQL harness, the programs under
//! test, configuration files and polling with a deadline; a test's opening (database,
//! directory, configuration, client, dispatcher) is [`Scenario`]'s.

#![allow(dead_code)]

pub mod accounts;
pub mod asserts;
pub mod bouncer;
pub mod dispatcher;
pub mod dkim;
pub mod exchangers;
pub mod fairness;
pub mod hostile_dns;
pub mod ingress;
pub mod logged;
pub mod notify;
pub mod nsd;
pub mod peer;
pub mod pg;
pub mod postfix;
pub mod queue;
pub mod quick_start_file;
pub mod replica;
pub mod rows;
pub mod scenario;
pub mod smarthost;
pub mod tls_peer;
pub mod worker;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

// Not every test binary that includes these helpers uses both.
#[allow(unused_imports)]
pub(crate) use asserts::{assert_has, assert_lacks};
pub use pg::TestDb;
// Not every test binary that includes these helpers builds a scenario.
#[allow(unused_imports)]
pub use scenario::Scenario;

/// A program built by this package.
pub fn bin(name: &str) -> PathBuf {
    match name {
        "pepsi-setup" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-setup")),
        "pepsi-dispatch" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-dispatch")),
        "pepsi-failure-bouncer" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-failure-bouncer")),
        "pepsi-queue" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-queue")),
        "pepsi-ingress" => PathBuf::from(env!("CARGO_BIN_EXE_pepsi-ingress")),
        other => panic!("unknown program {other}"),
    }
}

/// The directories `pepsi-t-TAG-…-PID-N` ([`TempDir::new`] of tag `TAG-…`) whose test
/// process `PID` has ended (or waits as a zombie): what a test binary killed at a time
/// limit left behind, with whatever it started still running there.
pub fn stale_dirs(tag: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return Vec::new();
    };
    let prefix = format!("pepsi-t-{tag}-");
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(&prefix)
                && name
                    .rsplit('-')
                    .nth(1)
                    .and_then(|p| p.parse::<u32>().ok())
                    .is_some_and(|pid| !alive(pid))
        })
        .map(|e| e.path())
        .collect()
}

/// Is the process `pid` there, and not a zombie waiting for its parent?
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "PID (COMMAND) STATE …": the command may hold any character but the last ')'.
    stat.rsplit_once(')')
        .is_none_or(|(_, rest)| !rest.trim_start().starts_with('Z'))
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
/// then `extra` (its exec commands run as [`exec_user`], see [`with_exec_user`]).
pub fn write_config(dir: &TempDir, db: &TestDb, extra: &str) -> PathBuf {
    dir.write(
        "pepsi.conf",
        &with_exec_user(&format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n{extra}",
            db.connection()
        )),
    )
}

/// The account the tests' exec commands run as: `nobody` when the tests run as root
/// (a command never runs as root, nor as `RUN_AS`, which the tests set to root), else
/// the tests' own account (a worker that is not root cannot switch).
pub fn exec_user() -> String {
    if is_root() {
        "nobody".to_string()
    } else {
        pepsi::privilege::current_account().expect("the tests' account has a name")
    }
}

/// Is this test process root?
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `text` with `USER = ` [`exec_user`] after every `COMMAND = …` line of a section
/// that names no `USER` of its own: the tests' exec stages run their commands as that
/// account.
pub fn with_exec_user(text: &str) -> String {
    let mut out = String::new();
    let sections = text
        .split_inclusive('\n')
        .fold(Vec::<String>::new(), |mut acc, line| {
            if line.trim_start().starts_with('[') || acc.is_empty() {
                acc.push(String::new());
            }
            acc.last_mut().unwrap().push_str(line);
            acc
        });
    for section in sections {
        let has_user = section.lines().any(|l| l.trim_start().starts_with("USER"));
        for line in section.split_inclusive('\n') {
            out.push_str(line);
            if !has_user && line.trim_start().starts_with("COMMAND") {
                if !line.ends_with('\n') {
                    out.push('\n');
                }
                out.push_str(&format!("USER = {}\n", exec_user()));
            }
        }
    }
    out
}

/// Creates `path` (and its parents) writable by everyone: a folder the tests' exec
/// commands, running as [`exec_user`], write into.
pub fn shared_dir(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o1777)).unwrap();
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

/// Stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// The built-in stage names the unified `pepsi-stage` binary answers to.
pub fn stage_names() -> impl Iterator<Item = &'static str> {
    pepsi::stages::BUILTINS.iter().map(|s| s.name())
}

/// A directory holding `pepsi-stage-NAME` links to the unified stage binary, as the
/// package installs them.
pub fn stage_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pepsi-t-bin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let target = PathBuf::from(env!("CARGO_BIN_EXE_pepsi-stage"));
        for name in stage_names() {
            std::os::unix::fs::symlink(&target, dir.join(format!("pepsi-stage-{name}"))).unwrap();
        }
        dir
    })
}

/// The path of the built-in stage `name`'s command.
pub fn stage(name: &str) -> PathBuf {
    stage_dir().join(format!("pepsi-stage-{name}"))
}

/// Injects a message and returns its id.
pub fn inject(c: &mut postgres::Client, stage: &str, from: &str, to: &[&str]) -> i64 {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, $2, $3, 'Subject: test\r\nFrom: <a@b>\r\n'::bytea, 'Hello.\r\n'::bytea, NULL, NULL, 'a@b', 'test')",
        &[&stage, &from, &to],
    )
    .unwrap()
    .get(0)
}

/// Injects a message and marks it running, as if the dispatcher had claimed it.
pub fn inject_claimed(c: &mut postgres::Client, stage: &str, from: &str, to: &[&str]) -> i64 {
    let id = inject(c, stage, from, to);
    claim(c, &[id]);
    id
}

/// Marks rows running under a fresh claim token each, as the dispatcher's claim does.
pub fn claim(c: &mut postgres::Client, ids: &[i64]) {
    let tokens: Vec<i64> = ids.iter().map(|_| fresh_token()).collect();
    let n = c
        .execute(
            "UPDATE pepsi.workqueue q SET status = 'running', claim = t.token \
               FROM unnest($1::int8[], $2::int8[]) AS t(id, token) \
              WHERE q.workqueue_id = t.id",
            &[&ids, &tokens],
        )
        .unwrap();
    assert_eq!(n as usize, ids.len(), "claim {ids:?}");
}

/// A claim token no other claim of this test run has: random, as the schema's are.
pub fn fresh_token() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.finish() as i64
}

/// The claim tokens rows carry, in the order of `ids` (read as a role that may read
/// them: the dispatcher's, the owner).
pub fn tokens(c: &mut postgres::Client, ids: &[i64]) -> Vec<i64> {
    ids.iter()
        .map(|id| {
            c.query_one(
                "SELECT claim FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[id],
            )
            .unwrap()
            .get(0)
        })
        .collect()
}

/// A row's (stage, status), or None when it is gone.
pub fn row_at(c: &mut postgres::Client, id: i64) -> Option<(String, String)> {
    c.query_opt(
        "SELECT stage, status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

/// A row's state as JSON.
pub fn state_of(c: &mut postgres::Client, id: i64) -> serde_json::Value {
    let text: String = c
        .query_one(
            "SELECT state::text FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    serde_json::from_str(&text).unwrap()
}

/// Seconds from now until a paused row's retry time.
pub fn due_in_secs(c: &mut postgres::Client, id: i64) -> f64 {
    c.query_one(
        "SELECT extract(epoch FROM timeout - now())::float8 FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

/// Installs the schema files up to `version` as that release left the database, with
/// its schema_version row (the starting point of an upgrade test).
pub fn install_schema_upto(c: &mut postgres::Client, version: i32) {
    use pepsi::db::{schema, sql};
    for f in schema::FILES.iter().filter(|f| f.number <= version) {
        c.batch_execute(f.sql).unwrap();
    }
    c.execute(
        sql::WRITE_SCHEMA_VERSION,
        &[&version, &schema::digest(version)],
    )
    .unwrap();
}

/// Runs `pepsi-setup -c conf schema`, which must succeed, and checks that the database
/// is now at this release's version and digest. Returns the version.
#[track_caller]
pub fn upgrade_with_setup(c: &mut postgres::Client, conf: &Path) -> i32 {
    use pepsi::db::{schema, sql};
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (version, digest): (i32, String) = c
        .query_one(sql::READ_SCHEMA_VERSION, &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(version, schema::version());
    assert_eq!(digest, schema::digest(version));
    version
}
