//! Recovery from short and long faults (§6 "Outage" and "Hops", §8.3 "Backoff",
//! §8.4 "Early resume", §11): the loop limit, poison values in paused rows, overload
//! back-off, cooldowns that end when the database is back, early resume of deferred
//! rows, a database that is away at start or for a while, connection errors that say
//! where and why, the service account's environment, journal priorities and the name
//! of a lock holder. Real PostgreSQL, real processes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use postgres::Client;

use crate::util::Scenario;
use crate::util::dispatcher::Dispatcher;
use crate::util::rows::{count, inject_fault, inject_many, wait_count, wait_empty};
use crate::util::scenario::conf;
use crate::util::{
    TempDir, TestDb, assert_has, assert_lacks, bin, row_at, run, state_of, stderr, wait_until,
};

const SEC: Duration = Duration::from_secs(1);

/// The fault worker's start-up control file, set to `mode`.
fn control(dir: &TempDir, mode: &str) -> PathBuf {
    dir.write("control", mode)
}

/// How often the log says `text`.
fn occurrences(log: &str, text: &str) -> usize {
    log.matches(text).count()
}

/// Records every claim of a row (every change to `running`) with when.
fn record_claims(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE claims_seen (workqueue_id bigint, at timestamptz DEFAULT clock_timestamp());
         CREATE FUNCTION claim_seen() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO claims_seen (workqueue_id) VALUES (NEW.workqueue_id); RETURN NULL; END $$;
         CREATE TRIGGER claim_seen AFTER UPDATE OF status ON pepsi.workqueue FOR EACH ROW
             WHEN (NEW.status = 'running' AND OLD.status IS DISTINCT FROM NEW.status)
             EXECUTE FUNCTION claim_seen();",
    )
    .unwrap();
}

#[test]
fn a_loop_between_two_stages_fails_the_message_as_looped_at_max_hops() {
    let (s, mut c) = Scenario::new("r-loop")
        .timers("MAX_HOPS = 10")
        .stages(
            "[stage-loop1]\nPROGRAM = {pass}\nNEXT = loop2\nFUSION = no\n\n\
         [stage-loop2]\nPROGRAM = {pass}\nNEXT = loop1\nFUSION = no\n\n\
         [stage-r1]\nPROGRAM = {fault}\nNEXT = r2\n\n[stage-r2]\nPROGRAM = {fault}\n",
        )
        .connect();
    c.batch_execute(
        "CREATE TABLE hops_at_end (workqueue_id bigint, hops int);
         CREATE FUNCTION hops_at_end() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO hops_at_end VALUES (OLD.workqueue_id, OLD.hops); RETURN NULL; END $$;
         CREATE TRIGGER hops_at_end AFTER DELETE ON pepsi.workqueue FOR EACH ROW
             EXECUTE FUNCTION hops_at_end();",
    )
    .unwrap();
    let looping = inject_many(&mut c, "loop1", "a@x.example", 1)[0];
    // A retry at one stage is not a hop: claimed twice at r1 and once at r2, two hops.
    let retried = inject_fault(&mut c, "r1", "tempfail-once");
    let mut d = s.start();
    wait_until(20 * SEC, "the looping message fails", || {
        row_at(&mut c, looping).is_some_and(|r| r.1 == "failed")
    });
    let st = state_of(&mut c, looping);
    assert_eq!(st["failure_class"], "looped", "{st}");
    assert_has!(st["last_error"].as_str().unwrap(), "MAX_HOPS (10)", "{st}");
    let hops = |c: &mut Client, table: &str, id: i64| -> i32 {
        c.query_one(
            &format!("SELECT hops FROM {table} WHERE workqueue_id = $1"),
            &[&id],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(
        hops(&mut c, "pepsi.workqueue", looping),
        11,
        "ten hops ran, the eleventh failed it"
    );
    wait_until(20 * SEC, "the retried message completes", || {
        row_at(&mut c, retried).is_none()
    });
    assert_eq!(hops(&mut c, "hops_at_end", retried), 2);
    assert!(d.terminate().success(), "{}", d.log());
    assert_has!(d.log(), "looped", "the loop is a warning in the log");
}

#[test]
fn a_paused_row_due_at_infinity_or_never_stops_no_claim() {
    let (s, mut c) = Scenario::new("r-inf")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {discard}\n")
        .connect();
    // Rows stored before schema 3's check could hold anything.
    c.batch_execute("ALTER TABLE pepsi.workqueue DROP CONSTRAINT workqueue_paused_timeout_check")
        .unwrap();
    let stuck = inject_many(&mut c, "a", "a@x.example", 2);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = 'infinity' WHERE workqueue_id = $1",
        &[&stuck[0]],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = NULL WHERE workqueue_id = $1",
        &[&stuck[1]],
    )
    .unwrap();
    inject_many(&mut c, "a", "a@x.example", 50);
    let mut d = s.start();
    // Everything but the row due at infinity drains, the one without a due time too.
    wait_until(30 * SEC, "all but one drained", || {
        count(&mut c, "SELECT count(*) FROM pepsi.workqueue") == 1
    });
    assert_eq!(
        row_at(&mut c, stuck[0]),
        Some(("a".into(), "paused".into()))
    );
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn a_worker_answering_75_makes_its_stage_back_off_instead_of_hammering() {
    let (s, mut c) = Scenario::new("r-75")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    record_claims(&mut c);
    let id = inject_fault(&mut c, "s", "tempfail");
    let d = s.start();
    // Without a back-off the same id went out again within milliseconds, dozens of
    // times. With it, each 75 holds the stage's next claim back for 100 ms, doubling:
    // the gaps between the claims are at least those waits (a busy machine only makes
    // them longer).
    let claims = 5;
    wait_until(60 * SEC, "five claims of the message", || {
        count(
            &mut c,
            &format!("SELECT count(*) FROM claims_seen WHERE workqueue_id = {id}"),
        ) >= claims
    });
    let at: Vec<f64> = c
        .query(
            "SELECT extract(epoch FROM at)::float8 FROM claims_seen \
              WHERE workqueue_id = $1 ORDER BY at",
            &[&id],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut wait = 0.1;
    for (k, pair) in at.windows(2).take(claims as usize - 1).enumerate() {
        let gap = pair[1] - pair[0];
        // A tenth less, for the clocks' granularity.
        assert!(
            gap >= 0.9 * wait,
            "claim {} came {gap:.3} s after the one before, within its {wait} s back-off: {at:?}\n{}",
            k + 2,
            d.log()
        );
        wait *= 2.0;
    }
    // And the log says so, each wait twice the one before.
    let log = d.log();
    let said: Vec<usize> = [100, 200, 400, 800]
        .iter()
        .map(|ms| {
            log.find(&format!("backing off for {ms} ms"))
                .unwrap_or_else(|| panic!("no {ms} ms back-off in the log:\n{log}"))
        })
        .collect();
    assert!(said.is_sorted(), "the back-offs in order:\n{log}");
    drop(d);
}

#[test]
fn a_worker_exiting_75_before_ready_is_overload_not_a_start_failure() {
    let (s, mut c) = Scenario::new("r-75start")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let ctl = control(&s.dir, "exit75");
    inject_many(&mut c, "s", "a@x.example", 5);
    let mut d = s.start_with(&[("FAULT_CONTROL", ctl.to_str().unwrap())]);
    d.wait_log("exit 75", 20 * SEC);
    std::thread::sleep(2 * SEC);
    std::fs::write(&ctl, "ok").unwrap();
    wait_empty(&mut c, 20 * SEC);
    assert!(d.terminate().success());
    let log = d.log();
    assert_lacks!(
        log,
        "no worker started for",
        "an overloaded start is not a start failure"
    );
    assert!(log.contains("backing off"), "{log}");
}

#[test]
fn a_cooldown_for_a_worker_that_cannot_reach_the_database_ends_when_claims_succeed() {
    let (s, mut c) = Scenario::new("r-74start")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let ctl = control(&s.dir, "exit74");
    inject_many(&mut c, "s", "a@x.example", 5);
    let mut d = s.start_with(&[("FAULT_CONTROL", ctl.to_str().unwrap())]);
    // Several start failures in a row: a growing cooldown would be at 8 s and more.
    wait_until(30 * SEC, "four start failures", || {
        occurrences(&d.log(), "no worker started for") >= 4
    });
    std::fs::write(&ctl, "ok").unwrap();
    wait_empty(&mut c, 20 * SEC);
    assert!(d.terminate().success());
    let log = d.log();
    for long in ["for 4s", "for 8s", "for 16s"] {
        assert_lacks!(
            log,
            &format!("no worker started {long}"),
            "the cooldown grew although the dispatcher's claims succeeded"
        );
    }
    assert_has!(log, "the database answers the dispatcher again");
}

#[test]
fn an_outside_kill_before_ready_cools_the_stage_for_at_most_2_seconds() {
    let (s, mut c) = Scenario::new("r-kill")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    let ctl = control(&s.dir, "slowready");
    inject_many(&mut c, "s", "a@x.example", 3);
    let mut d = s.start_with(&[("FAULT_CONTROL", ctl.to_str().unwrap())]);
    for round in 1..=3 {
        let mut killed = false;
        wait_until(20 * SEC, "a starting worker to kill", || {
            for pid in d.children() {
                // SAFETY: killing a child of our child by pid.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                killed = true;
            }
            killed
        });
        wait_until(20 * SEC, "the start failure is seen", || {
            occurrences(&d.log(), "no worker started for") >= round
        });
    }
    std::fs::write(&ctl, "ok").unwrap();
    wait_empty(&mut c, 20 * SEC);
    assert!(d.terminate().success());
    let log = d.log();
    assert!(!log.contains("no worker started for 4s"), "{log}");
    assert!(!log.contains("no worker started for 8s"), "{log}");
}

#[test]
fn a_message_deferred_for_74_is_resumed_within_seconds_not_30() {
    let (s, mut c) = Scenario::new("r-74")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let id = inject_fault(&mut c, "s", "ioerr-once");
    let mut d = s.start();
    // Deferred, then put back to pending by the early resume (which alone logs this
    // line), not by the paused-row flip 30 s later: what happened, not how fast.
    d.wait_log("deferred for 30s", 60 * SEC);
    d.wait_log(
        "1 messages deferred for a lost database connection back to pending early",
        60 * SEC,
    );
    wait_until(60 * SEC, "the message completes", || {
        row_at(&mut c, id).is_none()
    });
    wait_count(
        &mut c,
        "SELECT coalesce(sum(deferrals), 0)::int8 FROM pepsi.stage_stats",
        1,
        20 * SEC,
    );
    assert!(d.terminate().success());
}

/// The test cluster's socket directory and a connection string that reaches the same
/// database through a directory of our own, where the socket appears only as a
/// symbolic link we can take away and put back: the database, as far as Pepsi can
/// tell, goes away and comes back. `None` on a server that is not reached by a socket.
pub(super) fn linked_connection(db: &TestDb, dir: &TempDir) -> Option<(PathBuf, PathBuf, String)> {
    let mut host = None;
    let mut rest = Vec::new();
    for part in db.conninfo.split_whitespace() {
        match part.strip_prefix("host=") {
            Some(h) if h.starts_with('/') => host = Some(PathBuf::from(h)),
            _ => rest.push(part),
        }
    }
    let host = host?;
    let port = rest
        .iter()
        .find_map(|p| p.strip_prefix("port="))
        .unwrap_or("5432")
        .to_string();
    let socket = host.join(format!(".s.PGSQL.{port}"));
    let linked = dir.path("sock");
    std::fs::create_dir_all(&linked).unwrap();
    let link = linked.join(format!(".s.PGSQL.{port}"));
    let conninfo = format!("host={} {}", linked.display(), rest.join(" "));
    Some((socket, link, conninfo))
}

/// A configuration whose CONNECTION is `conninfo`.
fn conf_with_connection(dir: &TempDir, db: &TestDb, conninfo: &str, stages: &str) -> PathBuf {
    let conf = conf(dir, db, "", stages);
    let text = std::fs::read_to_string(&conf).unwrap().replace(
        &format!("CONNECTION = {}", db.conninfo),
        &format!("CONNECTION = {conninfo}"),
    );
    std::fs::write(&conf, text).unwrap();
    conf
}

#[test]
fn started_with_the_database_away_the_dispatcher_waits_and_then_serves() {
    let db = TestDb::new();
    let dir = TempDir::new("r-away");
    let Some((socket, link, conninfo)) = linked_connection(&db, &dir) else {
        eprintln!("the test server is not reached by a socket; skipping");
        return;
    };
    let conf = conf_with_connection(
        &dir,
        &db,
        &conninfo,
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "a", "a@x.example", 20);
    let mut d = Dispatcher::start(&conf, &[]);
    d.wait_log("the database is not available", 20 * SEC);
    std::thread::sleep(3 * SEC);
    assert!(d.try_wait().is_none(), "it waits:\n{}", d.log());
    assert_has!(
        d.log(),
        &format!("socket {}", link.display()),
        "the wait names the socket"
    );
    std::os::unix::fs::symlink(&socket, &link).unwrap();
    wait_empty(&mut c, 60 * SEC);
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn the_dispatcher_rides_out_a_20_second_database_outage() {
    let db = TestDb::new();
    let dir = TempDir::new("r-outage");
    let Some((socket, link, conninfo)) = linked_connection(&db, &dir) else {
        eprintln!("the test server is not reached by a socket; skipping");
        return;
    };
    std::os::unix::fs::symlink(&socket, &link).unwrap();
    let conf = conf_with_connection(
        &dir,
        &db,
        &conninfo,
        "[stage-a]\nPROGRAM = {fault}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "a", "a@x.example", 200);
    let mut d = Dispatcher::start(&conf, &[("FAULT_DELAY_MS", "50")]);
    wait_until(20 * SEC, "the drain is under way", || {
        count(
            &mut c,
            "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'a'",
        ) < 190
    });
    // The database goes away for Pepsi: no new connection, every session ended.
    std::fs::remove_file(&link).unwrap();
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
        &[],
    )
    .unwrap();
    std::thread::sleep(20 * SEC);
    assert!(
        d.try_wait().is_none(),
        "it rides the outage out:\n{}",
        d.log()
    );
    std::os::unix::fs::symlink(&socket, &link).unwrap();
    wait_empty(&mut c, 120 * SEC);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'"
        ),
        0
    );
    assert!(d.terminate().success(), "{}", d.log());
    // One line a minute at most while the database is away, not one per attempt.
    assert!(
        occurrences(&d.log(), "the database connection is lost") <= 2,
        "{}",
        d.log()
    );
    // Once back, no pooled connection from before the outage is tried and fails: the
    // statistics flushes and the reload after the reconnect all work the first time.
    let log = d.log();
    let back = log
        .find("the dispatcher lock is held again")
        .unwrap_or_else(|| panic!("the lock is re-taken:\n{log}"));
    let after = &log[back..];
    for failure in [
        "statistics flush failed",
        "background job",
        "retrying the reload",
    ] {
        assert_lacks!(after, failure, "{failure} after the reconnect");
    }
}

#[test]
fn a_connect_error_names_the_socket_the_user_and_the_reason() {
    let dir = TempDir::new("r-conn");
    let conf = dir.write(
        "pepsi.conf",
        "[pepsi]\nRUN_AS = root\n[pepsi-postgres]\nCONNECTION = host=/nonexistent/pepsi port=5999 user=mail dbname=q\n",
    );
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    // A database out of reach: 75, to be tried again.
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let err = stderr(&out);
    assert_has!(
        err,
        "socket /nonexistent/pepsi/.s.PGSQL.5999 as user mail (database q)"
    );
    assert!(err.contains("No such file or directory"), "{err}");
}

#[test]
fn pepsi_setup_switches_to_run_as_before_connecting() {
    let db = TestDb::empty();
    let dir = TempDir::new("r-setup");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = pepsi-no-such-account\n[pepsi-postgres]\nCONNECTION = {}\n",
            db.connection()
        ),
    );
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Not root: nothing to switch; setup runs as the invoking user.
        assert!(out.status.success(), "{}", stderr(&out));
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_has!(stderr(&out), "pepsi-no-such-account");
    let installed: bool = db
        .client()
        .query_one("SELECT to_regclass('pepsi.workqueue') IS NOT NULL", &[])
        .unwrap()
        .get(0);
    assert!(!installed, "nothing was installed as root");
}

#[test]
fn under_systemd_a_log_line_carries_its_priority_and_stays_one_line() {
    let dir = TempDir::new("r-journal");
    let conf = dir.write(
        "pepsi.conf",
        "[pepsi]\nRUN_AS = root\n[pepsi-dispatch]\nMAX_RUNTIME = soon\nPOLL_INTERVAL = never\n",
    );
    let out = std::process::Command::new(bin("pepsi-dispatch"))
        .args(["-c", conf.to_str().unwrap(), "serve"])
        .env("JOURNAL_STREAM", "8:12345")
        .env_remove("PEPSI_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    let error: Vec<&&str> = lines.iter().filter(|l| l.starts_with("<3>")).collect();
    assert_eq!(error.len(), 1, "one journal entry for the error:\n{err}");
    assert_has!(
        error[0],
        "MAX_RUNTIME",
        "both problems on the one line:\n{err}"
    );
    assert_has!(
        error[0],
        "POLL_INTERVAL",
        "both problems on the one line:\n{err}"
    );
    for line in &lines {
        assert!(line.starts_with('<'), "every line has a priority: {line:?}");
    }
}

#[test]
fn a_second_dispatcher_names_the_holder_of_the_lock() {
    let s = Scenario::new("r-holder")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {discard}\n")
        .build();
    let mut first = s.start();
    first.wait_log("serving", 20 * SEC);
    let mut c = s.client();
    let holder: i32 = c
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'pepsi-dispatch' AND backend_type = 'client backend' \
             ORDER BY backend_start LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    let mut second = s.start();
    let status = second.wait(30 * SEC);
    assert_eq!(status.code(), Some(1), "{}", second.log());
    let log = second.log();
    assert!(log.contains(&format!("pid {holder} ")), "{log}");
    assert!(log.contains("\"pepsi-dispatch\""), "{log}");
    assert!(first.terminate().success());
}

#[test]
fn workers_of_a_dispatcher_that_switched_accounts_get_the_accounts_environment_and_commands_a_clean_one()
 {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: no account switch to test");
        return;
    }
    let db = TestDb::new();
    let dir = TempDir::new("r-env");
    // Everything the account must reach: the configuration, the stage program, the
    // command and the folder it writes to.
    let open = |p: &std::path::Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open(&dir.0, 0o755);
    let out = dir.path("out");
    std::fs::create_dir(&out).unwrap();
    open(&out, 0o1777);
    let script = dir.write(
        "env.sh",
        &format!(
            "#!/bin/sh\ncat >/dev/null\nprintf '%s\\n' \"HOME=$HOME\" \"USER=$USER\" \"LOGNAME=$LOGNAME\" \"PATH=$PATH\" > {}/env\nsleep 2\n",
            out.display()
        ),
    );
    open(&script, 0o755);
    let conf = crate::util::scenario::switched_accounts(&dir, &db, &script);
    let mut c = db.client();
    inject_many(&mut c, "e", "a@x.example", 1);
    let mut d = Dispatcher::start(
        &conf,
        &[("HOME", "/root"), ("PATH", "/root/bin:/usr/bin:/bin")],
    );
    // The worker, while its command sleeps: its account's environment (WORKER_AS),
    // not root's.
    let deadline = Instant::now() + 30 * SEC;
    while !out.join("env").exists() {
        if Instant::now() > deadline {
            let states: Vec<String> = c
                .query("SELECT state::text FROM pepsi.workqueue", &[])
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            panic!("the command did not run: {states:?}\n{}", d.log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let workers = d.children();
    assert_eq!(workers.len(), 1, "{}", d.log());
    let worker = std::fs::read(format!("/proc/{}/environ", workers[0])).unwrap();
    let worker: Vec<String> = worker
        .split(|&b| b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    let account = crate::util::accounts::worker_account();
    for want in [
        "HOME=/nonexistent".to_string(),
        format!("USER={account}"),
        format!("LOGNAME={account}"),
        "PATH=/usr/local/bin:/usr/bin:/bin".to_string(),
    ] {
        assert!(worker.contains(&want), "{want}: {worker:?}");
    }
    wait_empty(&mut c, 30 * SEC);
    assert!(d.terminate().success(), "{}", d.log());
    // The command: its USER's home and the system's PATH, nothing of the worker's.
    let env = std::fs::read_to_string(out.join("env")).unwrap();
    assert_eq!(
        env,
        "HOME=/usr/sbin\nUSER=\nLOGNAME=\nPATH=/usr/local/bin:/usr/bin:/bin\n"
    );
}
