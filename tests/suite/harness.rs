//! The test harness on a server that outlives the run (`DATABASE_URL`,
//! `tests/util/pg.rs`): a run leaves no database behind, also when it panics, and
//! drops what an earlier run that was killed left. And the harness's text assertions
//! (`tests/util/asserts.rs`): what they report when they fail.

use std::panic::catch_unwind;
use std::process::Command;

use crate::util::pg::{self, TestDb};
use crate::util::{assert_has, assert_lacks};

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

/// What a failed [`assert_has!`] or [`assert_lacks!`] said.
fn failure(check: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let payload = catch_unwind(check).expect_err("the assertion fails");
    payload
        .downcast_ref::<String>()
        .cloned()
        .expect("a formatted message")
}

#[test]
fn a_failed_text_assertion_names_the_needle_the_context_and_the_whole_text_escaped() {
    let text = "first line\nforged\u{202e}line\r\n";
    // Holding, and lacking: no panic.
    assert_has!(text, "first line");
    assert_lacks!(text, "absent", "context {}", 1);

    let said = failure(|| assert_has!(text, "absent", "context {}", 7));
    assert_has!(said, "lacks \"absent\"");
    assert_has!(said, "\ncontext 7\n");
    // A right-to-left override or a carriage return reaches no terminal as it is.
    assert_has!(said, r#""first line\nforged\u{202e}line\r\n""#);
    assert_lacks!(said, ['\u{202e}', '\r']);

    // Plain text is shown as it is; a list item is looked for in the list.
    let said = failure(|| assert_lacks!("one\ntwo", "two"));
    assert_has!(
        said,
        "holds \"two\"\n--- the text ---\none\ntwo\n--- end ---"
    );
    let said = failure(|| assert_has!(vec!["a".to_string()], &"b".to_string()));
    assert_has!(said, "lacks \"b\"");
    assert_has!(said, "\"a\"");
}
