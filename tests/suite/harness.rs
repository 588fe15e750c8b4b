//! The test harness on a server that outlives the run (`DATABASE_URL`,
//! `tests/util/pg.rs`): a run leaves no database behind, also when it panics, and
//! drops what an earlier run that was killed left.

use std::process::Command;

use crate::util::pg::{self, TestDb};

/// Set in the child run of [`a_run_on_an_external_server_leaves_no_database_behind`]:
/// the test binary run again, as a run against an external server that fails.
const CHILD: &str = "PEPSI_TEST_HARNESS_CHILD";

/// The child's part: makes a test database on the server `DATABASE_URL` names, never
/// drops it, and fails.
fn fail_holding_a_database() -> ! {
    let db = TestDb::new();
    std::mem::forget(db);
    panic!("a test that fails holding a database it never drops");
}

/// The names of the server's test databases of run `pid`.
fn databases_of(c: &mut postgres::Client, pid: u32) -> Vec<String> {
    c.query(
        "SELECT datname::text FROM pg_catalog.pg_database ORDER BY 1",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| r.get::<_, String>(0))
    .filter(|n| pg::test_database_run(n) == Some(pid))
    .collect()
}

#[test]
fn a_run_on_an_external_server_leaves_no_database_behind() {
    if std::env::var_os(CHILD).is_some() {
        fail_holding_a_database();
    }
    let db = TestDb::new();
    let mut c = db.client();
    // What a run killed long ago left: its process is gone (no pid reaches 4194303
    // with the default pid_max, and a larger pid_max leaves this one free).
    let stale = 4_194_303;
    assert!(databases_of(&mut c, stale).is_empty());
    c.batch_execute(&format!("CREATE DATABASE pepsi_t{stale}_0"))
        .unwrap();
    c.batch_execute(&format!("CREATE DATABASE pepsi_template_{stale}"))
        .unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "suite::harness::a_run_on_an_external_server_leaves_no_database_behind",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("DATABASE_URL", pg::base_conninfo())
        .env_remove("PEPSI_TEST_DATABASE_URL")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("a test that fails holding a database"),
        "the child run failed as it should: {text}"
    );
    assert!(text.contains("1 failed"), "{text}");
    let left: Vec<String> = c
        .query(
            "SELECT datname::text FROM pg_catalog.pg_database ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        // Test databases of runs that are over (other runs may be going on).
        .filter(|n| pg::test_database_run(n).is_some_and(|pid| !pg::process_alive(pid)))
        .collect();
    assert!(
        left.is_empty(),
        "databases of the child run and of the killed one are dropped: {left:?}"
    );
}
