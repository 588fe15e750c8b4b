//! The guarantees that close the holes of §6 "Claim tokens" and §8.2 "Bounded
//! waits" and "Batches": a stale write never lands on a later claim, one locked row
//! stalls nothing else, a killed worker (one written in Python on libpq too) takes its
//! database sessions and its helpers with it, a dead helper thread stops the
//! dispatcher cleanly, a worker's REPORT cannot corrupt the statistics, a lost
//! dispatcher lock kills every worker, and an upgrade keeps the rows in flight. End to
//! end, against a real PostgreSQL and real processes.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use postgres::{Client, GenericClient};

use pepsi::db::sql;
use pepsi::protocol::session_pattern;

use crate::util::Scenario;
use crate::util::dispatcher::{Dispatcher, alive};
use crate::util::rows::{
    count, inject_fault, inject_many, queue_len, record_pauses, wait_count, wait_empty, wait_status,
};
use crate::util::scenario::conf;
use crate::util::worker::{Worker, code};
use crate::util::{TempDir, TestDb, inject, row_at, stage, state_of, wait_until};

/// Counts the rows that are `running`.
const RUNNING: &str = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'";

/// Claims row `id` at `stage` the way the dispatcher does ([`sql::CLAIM_OLDEST`], one
/// slot) and returns the claim token it was stamped with.
#[track_caller]
fn claim_token(c: &mut impl GenericClient, stage: &str, id: i64) -> i64 {
    let stages = vec![stage.to_string()];
    let caps = vec![1i32];
    let rows = c
        .query(
            sql::CLAIM_OLDEST,
            &[&stages, &caps, &100i32, &None::<Vec<i64>>],
        )
        .unwrap();
    let claimed: Vec<(Option<i64>, Option<i64>)> = rows
        .iter()
        .map(|r| (r.get("workqueue_id"), r.get("claim")))
        .collect();
    match claimed.as_slice() {
        [(Some(got), Some(token))] if *got == id => *token,
        other => panic!("expected the claim to take message {id}, it took {other:?}"),
    }
}

/// Locks row `id` in `tx` as an operator's `SELECT … FOR UPDATE` would.
fn lock_row(tx: &mut postgres::Transaction<'_>, id: i64) {
    tx.query_one(
        "SELECT workqueue_id FROM pepsi.workqueue WHERE workqueue_id = $1 FOR UPDATE",
        &[&id],
    )
    .unwrap();
}

#[test]
fn a_stale_outcome_from_an_earlier_claim_cannot_land() {
    let (s, mut c) = Scenario::new("g-stale")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\nFUSION = no\n")
        .connect();
    let id = inject(&mut c, "a", "s@x.example", &["r@y.example"]);
    let first = claim_token(&mut c, "a", id);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    // Another session holds the row, so the first claim's worker loads it but its
    // guarded write waits for the lock: a statement still executing on the server.
    let mut locker = s.client();
    let mut tx = locker.transaction().unwrap();
    lock_row(&mut tx, id);
    w.send(&[id]);
    wait_until(
        Duration::from_secs(60),
        "the worker's write waits for the row lock",
        || {
            count(
                &mut c,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                   AND wait_event_type = 'Lock' AND query LIKE '%pepsi.workqueue%'",
            ) == 1
        },
    );
    // Meanwhile the row is requeued (as after its worker was killed) and claimed again,
    // at the same stage, and the second claim's outcome starts to differ.
    let ids = vec![id];
    let stages = vec!["a"];
    let tokens = vec![first];
    let requeued = tx.query(sql::REQUEUE, &[&ids, &stages, &tokens]).unwrap();
    assert_eq!(
        requeued.len(),
        1,
        "the first claim's token requeues the row"
    );
    let second = claim_token(&mut tx, "a", id);
    assert_ne!(second, first, "every claim stamps a fresh token");
    tx.execute(
        "UPDATE pepsi.workqueue SET state = state || '{\"second\": true}' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    tx.commit().unwrap();
    // The first claim's write now matches nothing: the row is taken away, answered 0.
    assert_eq!(code(&w.status()), 0);
    let (at, status, claim): (String, String, i64) = c
        .query_one(
            "SELECT stage, status::text, claim FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!(
        (at.as_str(), status.as_str(), claim),
        ("a", "running", second),
        "the stale outcome did not land on the second claim"
    );
    // The second claim's worker (the same process will do) writes its own outcome.
    assert_eq!(code(&w.run(&[id])[0]), 0);
    assert_eq!(row_at(&mut c, id), Some(("b".into(), "pending".into())));
    assert_eq!(
        state_of(&mut c, id)["second"],
        true,
        "exactly as the second claim's worker left it"
    );
}

#[test]
fn a_row_locked_by_another_session_stops_no_other_claims() {
    let (s, mut c) = Scenario::new("g-locked")
        .timers("")
        .stages(
            "[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n\
         [stage-b]\nPROGRAM = {pass}\nNEXT = c\nFUSION = no\n\n\
         [stage-c]\nPROGRAM = {discard}\nFUSION = no\n",
        )
        .connect();
    let at_a = inject_many(&mut c, "a", "s@x.example", 50);
    inject_many(&mut c, "b", "s@x.example", 50);
    // The oldest pending row at a, the first one every claim of a picks, is locked
    // before the dispatcher starts.
    let held = at_a[0];
    let mut locker = s.client();
    let mut tx = locker.transaction().unwrap();
    lock_row(&mut tx, held);
    let locked_at = Instant::now();
    let mut d = s.start();
    wait_until(
        Duration::from_secs(40),
        "every row but the locked one drains",
        || queue_len(&mut c) == 1,
    );
    assert_eq!(row_at(&mut c, held), Some(("a".into(), "pending".into())));
    // Held for a minute in all, far past any lock or statement timeout: the dispatcher
    // keeps running all along.
    while locked_at.elapsed() < Duration::from_secs(60) {
        assert!(
            d.try_wait().is_none(),
            "the dispatcher exited while a row was locked:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(row_at(&mut c, held), Some(("a".into(), "pending".into())));
    tx.rollback().unwrap();
    wait_empty(&mut c, Duration::from_secs(60));
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
}

#[test]
fn a_hung_worker_inside_a_statement_is_killed_and_its_session_terminated() {
    let (s, mut c) = Scenario::new("g-dbsleep")
        .timers("MAX_RUNTIME = 3s")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    let id = inject_fault(&mut c, "s", "db-sleep");
    let d = s.start();
    let mut session = None;
    wait_until(
        Duration::from_secs(60),
        "a worker session sleeps inside a statement",
        || {
            session = c
                .query(
                    "SELECT application_name FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid() \
                       AND application_name LIKE 'pepsi-worker:%' AND state = 'active' \
                       AND query LIKE '%pg_sleep%'",
                    &[],
                )
                .unwrap()
                .first()
                .map(|r| r.get::<_, String>(0));
            session.is_some()
        },
    );
    let session = session.unwrap();
    let worker = d
        .worker_named(&session)
        .unwrap_or_else(|| panic!("no worker was given the session name {session:?}"));
    // Killed at MAX_RUNTIME and struck as a hang.
    wait_status(&mut c, id, ("s", "paused"), Duration::from_secs(60));
    let st = state_of(&mut c, id);
    assert_eq!(st["strikes"], 1, "{st}");
    // The server would run the sleeping statement for an hour: the dispatcher ends it
    // (at once; the deadline is a busy machine's).
    let pattern = session_pattern(&session);
    wait_until(
        Duration::from_secs(10),
        "no session of the killed worker remains",
        || {
            c.query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                &[&pattern],
            )
            .unwrap()
            .get::<_, i64>(0)
                == 0
        },
    );
    wait_until(
        Duration::from_secs(10),
        "the worker process is gone",
        || !alive(worker),
    );
    drop(d);
}

/// The Python interpreter the foreign-worker test runs its worker with.
const PYTHON: &str = "/usr/bin/python3";

/// A stage worker written in Python on psycopg2 (so on libpq), knowing nothing of
/// Pepsi's session names: it connects with the conninfo in `$FOREIGN_WORKER_DB`, sets
/// no `application_name`, says ready, and sleeps an hour inside a statement for every
/// id it reads.
const PSYCOPG2_WORKER: &str = r#"import os
import sys

import psycopg2

conn = psycopg2.connect(os.environ["FOREIGN_WORKER_DB"])
conn.autocommit = True
print("ready", flush=True)
while True:
    line = sys.stdin.readline()
    if not line:
        break
    with conn.cursor() as cur:
        cur.execute("SELECT pg_sleep(3600)")
    print("0", flush=True)
"#;

/// Can [`PYTHON`] import psycopg2? Outside CI a missing module is a note and the test
/// passes without running; under CI (`CI` set) it fails the test.
fn psycopg2_available() -> bool {
    let probe = std::process::Command::new(PYTHON)
        .args(["-c", "import psycopg2"])
        .output();
    if probe.is_ok_and(|out| out.status.success()) {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none_or(|v| v.is_empty()),
        "{PYTHON} cannot import psycopg2, and CI is set: the worker written in Python must run (apt-get install python3-psycopg2)"
    );
    eprintln!(
        "note: {PYTHON} cannot import psycopg2; the worker written in Python was not run (apt-get install python3-psycopg2)"
    );
    false
}

#[test]
fn a_python_worker_killed_at_max_runtime_leaves_no_database_session_behind() {
    if !psycopg2_available() {
        return;
    }
    let db = TestDb::new();
    let dir = TempDir::new("g-psycopg2");
    let script = dir.write("worker.py", &format!("#!{PYTHON}\n{PSYCOPG2_WORKER}"));
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let conf = conf(
        &dir,
        &db,
        "MAX_RUNTIME = 2s",
        &format!(
            "[stage-s]\nPROGRAM = {}\nPARALLELISM = 1\n",
            script.display()
        ),
    );
    let mut c = db.client();
    let id = inject(&mut c, "s", "a@x.example", &["r@y.example"]);
    let d = Dispatcher::start(&conf, &[("FOREIGN_WORKER_DB", db.connection())]);
    // The worker's session, found by what it runs (its name is the dispatcher's doing).
    let sleeping = "SELECT application_name FROM pg_stat_activity \
                    WHERE datname = current_database() AND pid <> pg_backend_pid() \
                      AND query = 'SELECT pg_sleep(3600)'";
    let mut session = None;
    wait_until(
        Duration::from_secs(30),
        "the Python worker sleeps inside a statement",
        || {
            session = c
                .query(sleeping, &[])
                .unwrap()
                .first()
                .map(|r| r.get::<_, String>(0));
            session.is_some()
        },
    );
    let session = session.unwrap();
    // Killed at MAX_RUNTIME and struck as a hang; its sessions are terminated before
    // the strike is written.
    wait_status(&mut c, id, ("s", "paused"), Duration::from_secs(30));
    let st = state_of(&mut c, id);
    assert_eq!(st["strikes"], 1, "{st}");
    assert!(
        st["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("MAX_RUNTIME")),
        "{st}"
    );
    // The server would run the statement for an hour: the dispatcher ends it too (at
    // once; the deadline is a busy machine's).
    wait_until(
        Duration::from_secs(10),
        &format!("no session of the killed worker remains (it was named {session:?})"),
        || c.query(sleeping, &[]).unwrap().is_empty(),
    );
    drop(d);
}

#[test]
fn a_dead_coordinator_thread_makes_the_dispatcher_exit_70_with_no_row_running() {
    let (s, mut c) = Scenario::new("g-panic")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\nQUEUE_LIMIT = 2\n")
        .connect();
    inject_many(&mut c, "s", "a@x.example", 300);
    let mut d = Dispatcher::start(
        &s.conf,
        &[
            ("PEPSI_FAULT_COORDINATOR_PANIC", "3"),
            ("FAULT_DELAY_MS", "300"),
        ],
    );
    // Every worker seen until the exit.
    let mut workers = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        workers.extend(d.children());
        if let Some(status) = d.try_wait() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "pepsi-dispatch did not exit within 60s; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(70), "{}", d.log());
    assert!(!workers.is_empty(), "workers ran before the thread died");
    assert_eq!(count(&mut c, RUNNING), 0, "no row is left running");
    wait_until(Duration::from_secs(10), "no worker survives", || {
        workers.iter().all(|&p| !alive(p))
    });
}

#[test]
fn a_report_naming_an_unknown_stage_or_absurd_microseconds_changes_no_statistics() {
    let (s, mut c) = Scenario::new("g-report")
        .timers("MAX_RUNTIME = 30s")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n")
        .connect();
    let max_runtime_us: i64 = 30_000_000;
    // Without a NEXT the fault worker deletes the rows. Two absurd reports or more in
    // one flush would overflow a 64-bit sum.
    let n = 6;
    for _ in 0..n / 2 {
        inject_fault(&mut c, "s", "report-unknown");
        inject_fault(&mut c, "s", "report-huge");
    }
    let mut d = s.start();
    wait_empty(&mut c, Duration::from_secs(60));
    // The idle flush writes the burst's numbers.
    wait_count(
        &mut c,
        "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'",
        n,
        Duration::from_secs(30),
    );
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pepsi.stage_stats WHERE stage = 'nosuch-stage'"
        ),
        0,
        "a stage that is not in the graph gets no statistics row"
    );
    let (passes, busy_us, crashes): (i64, i64, i64) = c
        .query_one(
            "SELECT passes, busy_us, crashes FROM pepsi.stage_stats WHERE stage = 's'",
            &[],
        )
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!(passes, n, "every message counts once");
    assert!(
        (0..=n * max_runtime_us).contains(&busy_us),
        "busy time {busy_us} µs is at most MAX_RUNTIME per message"
    );
    assert_eq!(crashes, 0);
}

/// An exec stage `x` whose command leaves a grandchild: it starts a background `sleep`,
/// writes its pid to `grandchild.ID` and its own to `command.ID`, reads the message and
/// becomes a `sleep` itself. Returns the configuration.
fn exec_with_grandchild(dir: &TempDir, db: &TestDb, dispatch: &str) -> PathBuf {
    // The command (running as the tests' exec account) writes its pids there.
    crate::util::shared_dir(&dir.0);
    let d = dir.0.display();
    let script = dir.write(
        "grandchild.sh",
        &format!(
            "#!/bin/sh\n\
             sleep 300 </dev/null >/dev/null 2>&1 &\n\
             echo $! > {d}/grandchild.$PEPSI_ID\n\
             echo $$ > {d}/command.$PEPSI_ID\n\
             cat >/dev/null\n\
             exec sleep 300\n"
        ),
    );
    let made_executable = std::process::Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .unwrap();
    assert!(made_executable.success());
    conf(
        dir,
        db,
        dispatch,
        &format!(
            "[stage-x]\nPROGRAM = {{exec}}\nCOMMAND = {}\nTIMEOUT = 60s\nPARALLELISM = 1\n",
            script.display()
        ),
    )
}

/// The pid a test script wrote to `file`, once it is there.
#[track_caller]
fn pid_in(file: &Path) -> u32 {
    let mut pid = None;
    wait_until(
        Duration::from_secs(60),
        &format!("{} names a pid", file.display()),
        || {
            pid = std::fs::read_to_string(file)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            pid.is_some()
        },
    );
    pid.unwrap()
}

/// Kills the `sleep` processes a test script left behind when the test ends, so a
/// failed test leaves nothing running for five minutes.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // Only what is still our script or its `sleep` (a pid is reused once reaped).
            let is_ours = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                [&b"sleep"[..], b"grandchild.sh"]
                    .iter()
                    .any(|name| c.windows(name.len()).any(|w| w == *name))
            });
            if alive(pid) && is_ours {
                // SAFETY: signalling a process this test started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
    }
}

#[test]
fn an_exec_grandchild_is_killed_with_its_worker_at_shutdown() {
    let db = TestDb::new();
    let dir = TempDir::new("g-grand-term");
    let conf = exec_with_grandchild(&dir, &db, "MAX_RUNTIME = 300s");
    let mut c = db.client();
    let id = inject_many(&mut c, "x", "a@x.example", 1)[0];
    let mut d = Dispatcher::start(&conf, &[]);
    let grandchild = pid_in(&dir.path(&format!("grandchild.{id}")));
    let command = pid_in(&dir.path(&format!("command.{id}")));
    let _reaper = Reaper(vec![grandchild, command]);
    assert!(alive(grandchild));
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
    wait_until(
        Duration::from_secs(5),
        "the command and its grandchild are gone with the worker",
        || !alive(grandchild) && !alive(command),
    );
}

#[test]
fn an_exec_grandchild_is_killed_with_its_worker_at_max_runtime() {
    let db = TestDb::new();
    let dir = TempDir::new("g-grand-hang");
    // TIMEOUT = 60s: the dispatcher's kill at MAX_RUNTIME comes first.
    let conf = exec_with_grandchild(&dir, &db, "MAX_RUNTIME = 3s");
    let mut c = db.client();
    let id = inject_many(&mut c, "x", "a@x.example", 1)[0];
    let d = Dispatcher::start(&conf, &[]);
    let grandchild = pid_in(&dir.path(&format!("grandchild.{id}")));
    let command = pid_in(&dir.path(&format!("command.{id}")));
    let _reaper = Reaper(vec![grandchild, command]);
    wait_status(&mut c, id, ("x", "paused"), Duration::from_secs(60));
    assert_eq!(state_of(&mut c, id)["strikes"], 1);
    wait_until(
        Duration::from_secs(5),
        "the command and its grandchild are gone with the worker",
        || !alive(grandchild) && !alive(command),
    );
    drop(d);
}

/// Terminates the session that holds the dispatcher lock (the coordinator's) and
/// returns how many were terminated.
fn terminate_lock_holder(c: &mut Client) -> i64 {
    c.query_one(
        "SELECT count(pg_terminate_backend(a.pid))::int8 FROM pg_stat_activity a \
         WHERE a.datname = current_database() AND a.application_name = 'pepsi-dispatch' \
           AND EXISTS (SELECT 1 FROM pg_locks l \
                        WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)",
        &[],
    )
    .unwrap()
    .get(0)
}

#[test]
fn losing_the_dispatcher_lock_kills_every_worker_and_the_pipeline_goes_on() {
    let (s, mut c) = Scenario::new("g-locklost")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 3\nQUEUE_LIMIT = 2\n")
        .connect();
    record_pauses(&mut c);
    // About 30 s of work for three workers.
    inject_many(&mut c, "s", "a@x.example", 600);
    let mut d = s.start_with(&[("FAULT_DELAY_MS", "300")]);
    wait_until(Duration::from_secs(60), "three workers are busy", || {
        d.children().len() >= 3
    });
    let workers = d.children();
    assert_eq!(
        terminate_lock_holder(&mut c),
        1,
        "the coordinator's session"
    );
    // Left alone they would run until the backlog drains, well beyond this.
    wait_until(
        Duration::from_secs(10),
        "every worker that ran when the lock was lost is killed",
        || workers.iter().all(|&p| !alive(p)),
    );
    wait_empty(&mut c, Duration::from_secs(120));
    assert_eq!(count(&mut c, RUNNING), 0);
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM public.pauses"),
        0,
        "no message is struck for the lost lock"
    );
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
}

#[test]
fn upgrading_from_schema_1_keeps_rows_in_flight() {
    let s = Scenario::new("g-upgrade")
        .empty()
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n")
        .build();
    let mut c = s.client();
    // A database as release 1 left it, with rows pending and in flight.
    crate::util::install_schema_upto(&mut c, 1);
    let ids = inject_many(&mut c, "a", "a@x.example", 20);
    let in_flight = ids[..8].to_vec();
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY ($1)",
        &[&in_flight],
    )
    .unwrap();
    crate::util::upgrade_with_setup(&mut c, &s.conf);
    let rows: Vec<(i64, String, i64)> = c
        .query(
            "SELECT workqueue_id, status::text, claim FROM pepsi.workqueue ORDER BY workqueue_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let want: Vec<(i64, String, i64)> = ids
        .iter()
        .map(|&id| {
            let status = if in_flight.contains(&id) {
                "running"
            } else {
                "pending"
            };
            (id, status.to_string(), 0)
        })
        .collect();
    assert_eq!(rows, want, "every row kept, unclaimed under the new tokens");
    // The start-up reset returns the in-flight rows to pending; all of them drain.
    let mut d = s.start();
    wait_empty(&mut c, Duration::from_secs(60));
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
}
