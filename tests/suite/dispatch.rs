//! `pepsi-dispatch serve` end to end: real PostgreSQL, real worker processes (the
//! built-in stages and the fault-injecting `examples/fault_worker.rs`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use postgres::Client;
use postgres::fallible_iterator::FallibleIterator;

use crate::util::dispatcher::{Dispatcher, alive, fault_worker};
use crate::util::{TempDir, TestDb, row_at, stage, stage_dir, state_of, wait_until, write_config};

const SEC: Duration = Duration::from_secs(1);

/// A configuration: test-friendly `[pepsi-dispatch]` timers overridden by `dispatch`,
/// then `stages` with `{pass}`, `{if}`, `{discard}`, `{exec}`, `{fault}` replaced by the
/// programs.
pub(super) fn conf(dir: &TempDir, db: &TestDb, dispatch: &str, stages: &str) -> PathBuf {
    let mut keys: Vec<(String, String)> = [
        ("POLL_INTERVAL", "1s"),
        ("STATS_INTERVAL", "60s"),
        ("WORKER_IDLE_TIMEOUT", "1s"),
        ("MAX_RUNTIME", "30s"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for line in dispatch.lines().filter(|l| l.contains('=')) {
        let (k, v) = line.split_once('=').unwrap();
        keys.retain(|(key, _)| key != k.trim());
        keys.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut text = String::from("[pepsi-dispatch]\n");
    for (k, v) in keys {
        text.push_str(&format!("{k} = {v}\n"));
    }
    text.push('\n');
    let mut stages = stages.to_string();
    for name in ["pass", "if", "discard", "exec"] {
        stages = stages.replace(&format!("{{{name}}}"), stage(name).to_str().unwrap());
    }
    stages = stages.replace("{fault}", fault_worker().to_str().unwrap());
    text.push_str(&stages);
    write_config(dir, db, &text)
}

pub(super) fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// Waits until `sql` counts `want`: the statistics of the last answers reach the
/// database on the idle flush, a moment after the queue empties.
#[track_caller]
pub(super) fn wait_count(c: &mut Client, sql: &str, want: i64, timeout: Duration) {
    wait_until(timeout, &format!("{sql} gives {want}"), || {
        let rows = c.query(sql, &[]).unwrap();
        rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) == Some(want)
    });
}

pub(super) fn queue_len(c: &mut Client) -> i64 {
    count(c, "SELECT count(*) FROM pepsi.workqueue")
}

/// Injects `n` messages in one transaction (one notification).
pub(super) fn inject_many(c: &mut Client, stage: &str, from: &str, n: i64) -> Vec<i64> {
    c.query(
        "SELECT pepsi.workqueue_inject($1, $2, ARRAY['r@y.example'], 'Subject: x\r\n'::bytea, 'body'::bytea) \
         FROM generate_series(1, $3::int8)",
        &[&stage, &from, &n],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Injects a message with `state.fault` set.
pub(super) fn inject_fault(c: &mut Client, stage: &str, fault: &str) -> i64 {
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, 'f@x.example', ARRAY['r@y.example'], NULL, NULL, NULL, NULL, NULL, NULL, \
         jsonb_build_object('fault', $2::text))",
        &[&stage, &fault],
    )
    .unwrap()
    .get(0)
}

/// Makes a paused row due now (tests do not wait out the real minutes).
pub(super) fn due_now(c: &mut Client, id: i64) {
    c.execute(
        "UPDATE pepsi.workqueue SET timeout = now() WHERE workqueue_id = $1 AND status = 'paused'",
        &[&id],
    )
    .unwrap();
}

#[track_caller]
pub(super) fn wait_status(c: &mut Client, id: i64, want: (&str, &str), timeout: Duration) {
    let want = Some((want.0.to_string(), want.1.to_string()));
    wait_until(timeout, &format!("message {id} is {want:?}"), || {
        row_at(c, id) == want
    });
}

#[track_caller]
pub(super) fn wait_empty(c: &mut Client, timeout: Duration) {
    wait_until(timeout, "the queue is empty", || queue_len(c) == 0);
}

#[test]
fn a_pipeline_drains_1000_messages_and_every_row_ends_where_its_stages_say() {
    let db = TestDb::new();
    let dir = TempDir::new("d-drain");
    let out = dir.path("delivered");
    crate::util::shared_dir(&out);
    let script = dir.write(
        "deliver.sh",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID\n", out.display()),
    );
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .unwrap();
    let conf = conf(
        &dir,
        &db,
        "",
        &format!(
            "[stage-a]\nPROGRAM = {{pass}}\nNEXT = b\n\n\
             [stage-b]\nPROGRAM = {{if}}\nFUSION = no\nMATCH = sender-domain is drop.example\nNEXT = c\nELSE_STAGE = d\n\n\
             [stage-c]\nPROGRAM = {{discard}}\nFUSION = no\n\n\
             [stage-d]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            script.display()
        ),
    );
    let mut c = db.client();
    let keep = inject_many(&mut c, "a", "s@keep.example", 500);
    inject_many(&mut c, "a", "s@drop.example", 500);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_empty(&mut c, Duration::from_secs(120));
    let delivered = std::fs::read_dir(&out).unwrap().count();
    assert_eq!(delivered, 500, "the kept half was delivered by d");
    for id in keep.iter().take(5) {
        assert!(out.join(id.to_string()).exists(), "message {id} delivered");
    }
    wait_count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats",
        3000,
        Duration::from_secs(20),
    );
    assert!(d.terminate().success(), "{}", d.log());
    let passes = |c: &mut Client, s: &str| -> i64 {
        c.query_one(
            "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = $1",
            &[&s],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(passes(&mut c, "a"), 1000);
    assert_eq!(passes(&mut c, "b"), 1000);
    assert_eq!(passes(&mut c, "c"), 500);
    assert_eq!(passes(&mut c, "d"), 500);
}

#[test]
fn a_worker_receives_up_to_queue_limit_ids_before_answering_any() {
    let db = TestDb::new();
    let dir = TempDir::new("d-pipe");
    let log = dir.path("batches");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "s", "a@x.example", 12);
    let mut d = Dispatcher::start(
        &conf,
        &[
            ("FAULT_LOG", log.to_str().unwrap()),
            ("FAULT_DELAY_MS", "200"),
        ],
    );
    wait_empty(&mut c, Duration::from_secs(30));
    let batches: Vec<usize> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| l.trim_start_matches("batch ").parse().unwrap())
        .collect();
    assert_eq!(batches.iter().max(), Some(&4), "batches read: {batches:?}");
    assert_eq!(batches.iter().sum::<usize>(), 12);
    assert!(d.terminate().success());
}

#[test]
fn a_burst_grows_a_stage_to_parallelism_and_idle_workers_stop() {
    let db = TestDb::new();
    let dir = TempDir::new("d-elastic");
    let conf = conf(
        &dir,
        &db,
        "WORKER_IDLE_TIMEOUT = 1s",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 3\nQUEUE_LIMIT = 1\n",
    );
    let mut c = db.client();
    let d = Dispatcher::start(&conf, &[]);
    d.wait_log("serving 1 stages", Duration::from_secs(10));
    assert!(
        d.children().is_empty(),
        "no worker runs before its stage sees traffic"
    );
    for _ in 0..15 {
        inject_fault(&mut c, "s", "slow");
    }
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while queue_len(&mut c) > 0 && Instant::now() < deadline {
        most = most.max(d.children().len());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(queue_len(&mut c), 0);
    assert_eq!(most, 3, "the pool grew to PARALLELISM and no further");
    wait_until(Duration::from_secs(10), "idle workers stop", || {
        d.children().is_empty()
    });
}

#[test]
fn max_messages_10_over_35_messages_starts_4_processes() {
    let db = TestDb::new();
    let dir = TempDir::new("d-recycle");
    let conf = conf(
        &dir,
        &db,
        "WORKER_IDLE_TIMEOUT = 60s",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = end\nPARALLELISM = 1\nQUEUE_LIMIT = 4\nMAX_MESSAGES = 10\n\n[stage-end]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "s", "a@x.example", 35);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_empty(&mut c, Duration::from_secs(30));
    wait_count(
        &mut c,
        "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'",
        35,
        Duration::from_secs(20),
    );
    assert!(d.terminate().success());
    assert_eq!(
        count(&mut c, "SELECT worker_starts FROM pepsi.dispatch_stats"),
        4,
        "{}",
        d.log()
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'"
        ),
        35
    );
}

#[test]
fn a_crash_strikes_the_front_message_and_requeues_its_siblings() {
    let db = TestDb::new();
    let dir = TempDir::new("d-crash");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n",
    );
    let mut c = db.client();
    let poison = inject_fault(&mut c, "s", "crash");
    let siblings = inject_many(&mut c, "s", "a@x.example", 3);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, poison, ("s", "paused"), Duration::from_secs(20));
    let st = state_of(&mut c, poison);
    assert_eq!(st["strikes"], 1);
    assert_eq!(st["strike_stage"], "s");
    assert!(
        st["last_error"]
            .as_str()
            .unwrap()
            .contains("exited with status 3"),
        "{st}"
    );
    for id in &siblings {
        wait_until(Duration::from_secs(20), "the siblings complete", || {
            row_at(&mut c, *id).is_none()
        });
    }
    let due: f64 = c
        .query_one("SELECT extract(epoch FROM timeout - now())::float8 FROM pepsi.workqueue WHERE workqueue_id = $1", &[&poison])
        .unwrap()
        .get(0);
    assert!(
        (40.0..=61.0).contains(&due),
        "strike 1 retries after a minute, due in {due}s"
    );
    due_now(&mut c, poison);
    wait_until(Duration::from_secs(20), "strike 2", || {
        state_of(&mut c, poison)["strikes"] == 2
    });
    due_now(&mut c, poison);
    wait_status(&mut c, poison, ("s", "failed"), Duration::from_secs(20));
    let st = state_of(&mut c, poison);
    assert_eq!(st["strikes"], 3);
    assert_eq!(st["failure_class"], "crashed");
    assert_eq!(st["failed_stage"], "s");
    assert!(d.terminate().success());
    assert_eq!(
        count(
            &mut c,
            "SELECT crashes FROM pepsi.stage_stats WHERE stage = 's'"
        ),
        3
    );
}

/// Records every row that becomes `paused` (each strike pauses), so a test can tell a
/// row that was never struck from one whose pause it missed between two polls.
pub(super) fn record_pauses(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE public.pauses (n serial, id bigint);
         CREATE FUNCTION public.record_pause() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO public.pauses (id) VALUES (NEW.workqueue_id); RETURN NULL; END $$;
         CREATE TRIGGER record_pause AFTER UPDATE ON pepsi.workqueue FOR EACH ROW
           WHEN (NEW.status = 'paused' AND OLD.status IS DISTINCT FROM 'paused')
           EXECUTE FUNCTION public.record_pause();",
    )
    .unwrap();
}

/// How many times a row was paused since [`record_pauses`].
fn pauses_of(c: &mut Client, id: i64) -> i64 {
    c.query_one("SELECT count(*) FROM public.pauses WHERE id = $1", &[&id])
        .unwrap()
        .get(0)
}

#[test]
fn a_crash_inside_a_batch_strikes_nobody_and_the_culprit_run_alone_is_struck() {
    let db = TestDb::new();
    let dir = TempDir::new("d-suspect");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n",
    );
    let mut c = db.client();
    record_pauses(&mut c);
    let front = inject_many(&mut c, "s", "a@x.example", 2);
    let culprit = inject_fault(&mut c, "s", "crash");
    let last = inject_many(&mut c, "s", "a@x.example", 1)[0];
    // The worker answers a batch only after all of it ran, so the crash on the third
    // id leaves four delivered ids unanswered: none of them can be told guilty, so
    // nobody is struck and all four go back as suspects, each then run alone (§8.2
    // "Batches").
    let d = Dispatcher::start(&conf, &[("FAULT_BATCH_ANSWERS", "1")]);
    // Run alone, the culprit crashes its worker again and is struck for it.
    wait_status(&mut c, culprit, ("s", "paused"), Duration::from_secs(60));
    // The innocent ones complete; a strike would have paused them for a minute.
    for id in [front[0], front[1], last] {
        wait_until(
            Duration::from_secs(60),
            "the innocent suspects complete",
            || row_at(&mut c, id).is_none(),
        );
        assert_eq!(pauses_of(&mut c, id), 0, "message {id} was never paused");
    }
    let st = state_of(&mut c, culprit);
    assert_eq!(
        st["strikes"], 1,
        "one strike, for the crash it caused alone: {st}"
    );
    assert_eq!(st["strike_stage"], "s");
    assert_eq!(pauses_of(&mut c, culprit), 1, "struck exactly once");
    assert_eq!(row_at(&mut c, culprit), Some(("s".into(), "paused".into())));
    drop(d);
}

#[test]
fn a_hang_is_killed_at_max_runtime_and_the_third_times_out() {
    let db = TestDb::new();
    let dir = TempDir::new("d-hang");
    let conf = conf(
        &dir,
        &db,
        "MAX_RUNTIME = 3s",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 2\n",
    );
    let mut c = db.client();
    let hang = inject_fault(&mut c, "s", "hang");
    let sibling = inject_many(&mut c, "s", "a@x.example", 1)[0];
    let mut d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, hang, ("s", "paused"), Duration::from_secs(20));
    assert!(
        state_of(&mut c, hang)["last_error"]
            .as_str()
            .unwrap()
            .contains("MAX_RUNTIME")
    );
    wait_until(Duration::from_secs(20), "the sibling completes", || {
        row_at(&mut c, sibling).is_none()
    });
    for strikes in [2, 3] {
        due_now(&mut c, hang);
        wait_until(Duration::from_secs(20), "the next strike", || {
            state_of(&mut c, hang)["strikes"] == strikes
        });
    }
    wait_status(&mut c, hang, ("s", "timeout"), Duration::from_secs(5));
    assert_eq!(state_of(&mut c, hang)["failure_class"], "timed-out");
    wait_until(
        Duration::from_secs(10),
        "the killed workers are gone",
        || d.children().is_empty(),
    );
    assert!(d.terminate().success());
    assert_eq!(
        count(
            &mut c,
            "SELECT timeouts FROM pepsi.stage_stats WHERE stage = 's'"
        ),
        3
    );
}

/// A stage whose worker cannot start blames nobody, observes a cooldown, and recovers
/// once fixed.
fn start_failure_recovers(mode: &str) {
    let db = TestDb::new();
    let dir = TempDir::new("d-start");
    let control = dir.write("control", mode);
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\n",
    );
    let mut c = db.client();
    let ids = inject_many(&mut c, "s", "a@x.example", 3);
    let d = Dispatcher::start(&conf, &[("FAULT_CONTROL", control.to_str().unwrap())]);
    d.wait_log("no worker started for 2s", Duration::from_secs(20));
    d.wait_log("no worker started for 4s", Duration::from_secs(20));
    if mode == "exit78" || mode == "ready78" {
        assert!(d.log().contains("refused to run (exit 78"), "{}", d.log());
    }
    if mode == "ready78" {
        assert!(d.log().contains("before answering anything"), "{}", d.log());
    }
    for id in &ids {
        let st = state_of(&mut c, *id);
        assert!(st.get("strikes").is_none(), "nothing is blamed: {st}");
        assert_ne!(row_at(&mut c, *id).unwrap().1, "failed");
    }
    assert!(
        !d.log().contains("no worker started for 8s")
            || d.log().matches("no worker started").count() <= 3
    );
    std::fs::write(&control, "ok").unwrap();
    wait_empty(&mut c, Duration::from_secs(30));
}

#[test]
fn exit_78_before_ready_blames_nothing_and_the_stage_recovers() {
    start_failure_recovers("exit78");
}

#[test]
fn exit_78_after_ready_but_before_any_answer_blames_nothing() {
    start_failure_recovers("ready78");
}

#[test]
fn death_before_ready_blames_nothing_and_the_stage_recovers() {
    start_failure_recovers("die");
}

#[test]
fn a_missing_program_blames_nothing_and_the_stage_recovers_when_fixed() {
    let db = TestDb::new();
    let dir = TempDir::new("d-missing");
    // The fix comes through the overlay: its PROGRAM must be under PROGRAM_PATH.
    let conf = conf(
        &dir,
        &db,
        "",
        &format!(
            "[stage-s]\nPROGRAM = /nonexistent/pepsi-stage-nothing\nNEXT = end\n\n[stage-end]\nPROGRAM = {{discard}}\n\n\
             [pepsi]\nPROGRAM_PATH = {}\n",
            stage_dir().display()
        ),
    );
    let mut c = db.client();
    let id = inject_many(&mut c, "s", "a@x.example", 1)[0];
    let d = Dispatcher::start(&conf, &[]);
    d.wait_log(
        "cannot start PROGRAM /nonexistent/pepsi-stage-nothing",
        Duration::from_secs(20),
    );
    d.wait_log("no worker started for 2s", Duration::from_secs(20));
    // The log line comes before the coordinator commits the requeue.
    wait_status(&mut c, id, ("s", "pending"), Duration::from_secs(5));
    assert!(state_of(&mut c, id).get("strikes").is_none());
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-s', 'PROGRAM', $1)",
        &[&stage("pass").to_str().unwrap()],
    )
    .unwrap();
    wait_empty(&mut c, Duration::from_secs(30));
    assert!(d.log().contains("stage configuration reloaded"));
}

#[test]
fn a_garbage_status_line_tears_the_worker_down_as_a_crash() {
    let db = TestDb::new();
    let dir = TempDir::new("d-garbage");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n",
    );
    let mut c = db.client();
    let bad = inject_fault(&mut c, "s", "garbage-status");
    let d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, bad, ("s", "paused"), Duration::from_secs(20));
    let st = state_of(&mut c, bad);
    assert_eq!(st["strikes"], 1);
    assert!(
        st["last_error"]
            .as_str()
            .unwrap()
            .contains("unreadable status line"),
        "{st}"
    );
    drop(d);
}

#[test]
fn a_garbage_report_still_completes_the_message() {
    let db = TestDb::new();
    let dir = TempDir::new("d-badreport");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n",
    );
    let mut c = db.client();
    let id = inject_fault(&mut c, "s", "garbage-report");
    let after = inject_many(&mut c, "s", "a@x.example", 2);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_empty(&mut c, Duration::from_secs(20));
    d.wait_log(
        &format!("message {id}: unreadable REPORT"),
        Duration::from_secs(10),
    );
    assert!(!after.is_empty());
    wait_count(
        &mut c,
        "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'",
        3,
        Duration::from_secs(20),
    );
    assert!(d.terminate().success());
    assert_eq!(
        count(
            &mut c,
            "SELECT crashes FROM pepsi.stage_stats WHERE stage = 's'"
        ),
        0
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'"
        ),
        3
    );
}

#[test]
fn status_75_requeues_the_message_and_halves_the_biggest_stage() {
    let db = TestDb::new();
    let dir = TempDir::new("d-75");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-big]\nPROGRAM = {fault}\nPARALLELISM = 4\nQUEUE_LIMIT = 1\n\n[stage-small]\nPROGRAM = {fault}\nPARALLELISM = 1\n",
    );
    let mut c = db.client();
    // About 11 s of work on 4 workers: big still runs 4 when small answers 75.
    for _ in 0..150 {
        inject_fault(&mut c, "big", "slow");
    }
    let d = Dispatcher::start(&conf, &[]);
    wait_until(Duration::from_secs(20), "big runs 4 workers", || {
        d.children().len() >= 4
    });
    let id = inject_fault(&mut c, "small", "tempfail-once");
    d.wait_log(
        "stage big runs the most workers (4); its PARALLELISM is capped at 2",
        Duration::from_secs(20),
    );
    assert!(
        d.log()
            .contains("raise PostgreSQL max_connections or lower PARALLELISM")
    );
    // Back to pending, then run again (the fault cleared itself) to completion.
    wait_until(Duration::from_secs(20), "the 75 message completes", || {
        row_at(&mut c, id).is_none()
    });
    assert!(
        d.log()
            .contains(&format!("small: message {id}: the database refused")),
        "{}",
        d.log()
    );
    // The cap holds: big shrinks to at most 2 workers.
    wait_until(
        Duration::from_secs(20),
        "big drains to the halved cap",
        || d.children().len() <= 2,
    );
}

#[test]
fn status_74_pauses_the_message_for_30_seconds() {
    let db = TestDb::new();
    let dir = TempDir::new("d-74");
    let conf = conf(&dir, &db, "", "[stage-s]\nPROGRAM = {fault}\n");
    let mut c = db.client();
    let id = inject_fault(&mut c, "s", "ioerr");
    let d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, id, ("s", "paused"), Duration::from_secs(20));
    let due: f64 = c
        .query_one("SELECT extract(epoch FROM timeout - now())::float8 FROM pepsi.workqueue WHERE workqueue_id = $1", &[&id])
        .unwrap()
        .get(0);
    assert!((20.0..=31.0).contains(&due), "deferred ~30s, due in {due}s");
    assert!(
        state_of(&mut c, id).get("strikes").is_none(),
        "not the message's fault"
    );
    d.wait_log(
        &format!("s: message {id}: its worker lost the database connection; deferred for 30s"),
        SEC * 5,
    );
}

#[test]
fn a_paused_row_is_retried_within_about_a_second_of_its_due_time() {
    let db = TestDb::new();
    let dir = TempDir::new("d-due");
    let conf = conf(
        &dir,
        &db,
        "POLL_INTERVAL = 60s\nWORKER_IDLE_TIMEOUT = 60s",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let mut d = Dispatcher::start(&conf, &[]);
    d.wait_log("serving 2 stages", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(500));
    // A row paused by someone else, due in 3 s, inserted without a notification.
    let paused: i64 = c
        .query_one(
            "INSERT INTO pepsi.workqueue (stage, status, timeout, mail_from, rcpt_to) \
             VALUES ('s', 'paused', now() + interval '3 seconds', 'a@x.example', ARRAY['r@y.example']) RETURNING workqueue_id",
            &[],
        )
        .unwrap()
        .get(0);
    // A worker's report brings the dispatcher to a claim, which re-reads the due time.
    let other = inject_many(&mut c, "s", "a@x.example", 1)[0];
    wait_until(
        Duration::from_secs(10),
        "the other message completes",
        || row_at(&mut c, other).is_none(),
    );
    let due = Instant::now() + Duration::from_secs_f64(
        c.query_one("SELECT extract(epoch FROM timeout - now())::float8 FROM pepsi.workqueue WHERE workqueue_id = $1", &[&paused])
            .unwrap()
            .get::<_, f64>(0),
    );
    wait_until(Duration::from_secs(10), "the paused row completes", || {
        row_at(&mut c, paused).is_none()
    });
    let late = Instant::now().saturating_duration_since(due);
    assert!(
        late < Duration::from_millis(2500),
        "retried {late:?} after its due time"
    );
    assert!(d.terminate().success());
}

#[test]
fn a_second_dispatcher_exits_1_after_about_10_seconds_and_touches_nothing() {
    let db = TestDb::new();
    let dir = TempDir::new("d-second");
    let conf = conf(&dir, &db, "", "[stage-s]\nPROGRAM = {fault}\n");
    let mut c = db.client();
    let held = inject_fault(&mut c, "s", "hang");
    let first = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    let started = Instant::now();
    let mut second = Dispatcher::start(&conf, &[]);
    let status = second.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", second.log());
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "it waited for the lock"
    );
    assert!(
        second
            .log()
            .contains("another pepsi-dispatch holds the dispatcher lock"),
        "{}",
        second.log()
    );
    assert_eq!(
        row_at(&mut c, held),
        Some(("s".into(), "running".into())),
        "the first's row was not reset"
    );
    drop(first);
}

#[test]
fn after_sigkill_no_worker_survives_and_a_new_dispatcher_finishes_the_rows() {
    let db = TestDb::new();
    let dir = TempDir::new("d-kill9");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nQUEUE_LIMIT = 2\n",
    );
    let mut c = db.client();
    let held = inject_fault(&mut c, "s", "hang");
    let first = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    // The row is claimed a moment before its worker is started.
    wait_until(Duration::from_secs(10), "its worker runs", || {
        !first.children().is_empty()
    });
    let workers = first.children();
    first.signal(libc::SIGKILL);
    wait_until(
        Duration::from_secs(10),
        "the killed dispatcher's workers die with it",
        || workers.iter().all(|&p| !alive(p)),
    );
    drop(first);
    assert_eq!(row_at(&mut c, held), Some(("s".into(), "running".into())));
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{}' WHERE workqueue_id = $1",
        &[&held],
    )
    .unwrap();
    let mut second = Dispatcher::start(&conf, &[]);
    second.wait_log(
        "reset 1 running rows left by a previous dispatcher",
        Duration::from_secs(20),
    );
    wait_empty(&mut c, Duration::from_secs(20));
    assert!(second.terminate().success());
}

#[test]
fn a_ctrl_c_stops_the_dispatcher_and_blames_no_message_in_flight() {
    let db = TestDb::new();
    let dir = TempDir::new("d-ctrlc");
    let conf = conf(&dir, &db, "", "[stage-s]\nPROGRAM = {fault}\n");
    let mut c = db.client();
    let held = inject_fault(&mut c, "s", "hang");
    let mut d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    wait_until(Duration::from_secs(10), "the worker has it", || {
        d.log().contains("is ready")
    });
    let workers = d.children();
    assert_eq!(workers.len(), 1);
    d.signal_group(libc::SIGINT);
    let status = d.wait(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert_eq!(row_at(&mut c, held), Some(("s".into(), "pending".into())));
    let st = state_of(&mut c, held);
    assert!(st.get("strikes").is_none(), "nobody is blamed: {st}");
    assert_eq!(
        count(
            &mut c,
            "SELECT coalesce(sum(crashes), 0)::int8 FROM pepsi.stage_stats"
        ),
        0
    );
    wait_until(Duration::from_secs(10), "the worker is gone", || {
        !alive(workers[0])
    });
}

#[test]
fn sigterm_mid_burst_exits_0_with_no_row_running_and_stats_flushed() {
    let db = TestDb::new();
    let dir = TempDir::new("d-term");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {discard}\nFUSION = no\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "a", "a@x.example", 3000);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_until(Duration::from_secs(30), "the burst is under way", || {
        queue_len(&mut c) < 2800
    });
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'"
        ),
        0
    );
    let deleted = 3000 - queue_len(&mut c);
    let moved = count(
        &mut c,
        "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'b'",
    ) + deleted;
    let passes_a = count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = 'a'",
    );
    let passes_b = count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = 'b'",
    );
    // Every answered pass was flushed; a pass whose answer died with its killed worker
    // is not counted (at most the in-flight capacity of 16 per stage).
    assert!(
        passes_a <= moved && passes_a >= moved - 16,
        "a: {passes_a} passes, {moved} moved"
    );
    assert!(
        passes_b <= deleted && passes_b >= deleted - 16,
        "b: {passes_b} passes, {deleted} deleted"
    );
}

#[test]
fn a_stage_added_through_the_overlay_routes_new_messages_without_restart() {
    let db = TestDb::new();
    let dir = TempDir::new("d-reload");
    let conf = conf(
        &dir,
        &db,
        "STATS_INTERVAL = 1s",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = end\nFUSION = no\n\n[stage-end]\nPROGRAM = {discard}\nFUSION = no\n",
    );
    let mut c = db.client();
    inject_many(&mut c, "a", "a@x.example", 5);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_empty(&mut c, Duration::from_secs(20));
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-a', 'NEXT', 'extra'), ('stage-extra', 'PROGRAM', $1), \
         ('stage-extra', 'NEXT', 'end'), ('stage-extra', 'FUSION', 'no')",
        &[&stage("pass").to_str().unwrap()],
    )
    .unwrap();
    d.wait_log(
        "stage configuration reloaded: 3 stages",
        Duration::from_secs(10),
    );
    inject_many(&mut c, "a", "a@x.example", 5);
    wait_empty(&mut c, Duration::from_secs(20));
    assert!(d.terminate().success());
    assert_eq!(
        count(
            &mut c,
            "SELECT passes FROM pepsi.stage_stats WHERE stage = 'extra'"
        ),
        5
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT passes FROM pepsi.stage_stats WHERE stage = 'a'"
        ),
        10
    );
}

#[test]
fn an_invalid_graph_at_reload_exits_78_with_rows_back_to_pending() {
    let db = TestDb::new();
    let dir = TempDir::new("d-badreload");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nQUEUE_LIMIT = 2\n",
    );
    let mut c = db.client();
    let held = inject_fault(&mut c, "s", "hang");
    let mut d = Dispatcher::start(&conf, &[]);
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-s', 'NEXT', 'nowhere')",
        &[],
    )
    .unwrap();
    let status = d.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(78), "{}", d.log());
    assert!(
        d.log().contains("NEXT: names stage \"nowhere\""),
        "{}",
        d.log()
    );
    assert_eq!(row_at(&mut c, held), Some(("s".into(), "pending".into())));
}

#[test]
fn statistics_are_one_transaction_per_flush_and_nothing_is_written_while_idle() {
    let db = TestDb::new();
    let dir = TempDir::new("d-stats");
    let conf = conf(
        &dir,
        &db,
        "STATS_INTERVAL = 1s\nPOLL_INTERVAL = 60s",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {discard}\nFUSION = no\n",
    );
    let mut c = db.client();
    c.batch_execute(
        "CREATE TABLE stats_writes (txid bigint, tbl text);
         CREATE FUNCTION stats_write() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO stats_writes VALUES (txid_current(), TG_TABLE_NAME); RETURN NULL; END $$;
         CREATE TRIGGER w AFTER INSERT OR UPDATE ON pepsi.stage_stats FOR EACH STATEMENT EXECUTE FUNCTION stats_write();
         CREATE TRIGGER w AFTER INSERT OR UPDATE ON pepsi.dispatch_stats FOR EACH STATEMENT EXECUTE FUNCTION stats_write();",
    )
    .unwrap();
    let mut d = Dispatcher::start(&conf, &[]);
    inject_many(&mut c, "a", "a@x.example", 200);
    wait_empty(&mut c, Duration::from_secs(30));
    wait_until(
        Duration::from_secs(10),
        "the burst's numbers are flushed",
        || {
            count(
                &mut c,
                "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats",
            ) == 400
        },
    );
    let per_tx = c
        .query(
            "SELECT txid, count(DISTINCT tbl) FROM stats_writes GROUP BY txid",
            &[],
        )
        .unwrap();
    assert!(!per_tx.is_empty());
    for row in &per_tx {
        assert_eq!(
            row.get::<_, i64>(1),
            2,
            "each flush writes both tables in one transaction"
        );
    }
    let writes = count(&mut c, "SELECT count(*) FROM stats_writes");
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM stats_writes"),
        writes,
        "an idle dispatcher writes no statistics"
    );
    assert!(d.terminate().success());
}

#[test]
fn an_advance_issues_no_notify() {
    let db = TestDb::new();
    let dir = TempDir::new("d-nonotify");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {pass}\nNEXT = c\nFUSION = no\n\n[stage-c]\nPROGRAM = {discard}\nFUSION = no\n",
    );
    let mut c = db.client();
    let mut listener = db.client();
    listener
        .batch_execute(
            "LISTEN workqueue; LISTEN workqueue_failed; LISTEN config_changed; LISTEN sentinel",
        )
        .unwrap();
    let mut d = Dispatcher::start(&conf, &[]);
    d.wait_log("serving 3 stages", Duration::from_secs(10));
    inject_many(&mut c, "a", "a@x.example", 300);
    wait_empty(&mut c, Duration::from_secs(30));
    c.batch_execute("NOTIFY sentinel").unwrap();
    let mut seen = Vec::new();
    let mut notes = listener.notifications();
    let mut it = notes.timeout_iter(Duration::from_secs(10));
    while let Some(n) = it.next().unwrap() {
        if n.channel() == "sentinel" {
            break;
        }
        seen.push(n.channel().to_string());
    }
    assert_eq!(
        seen,
        vec!["workqueue"],
        "only the injection notified; 900 advances did not"
    );
    assert!(d.terminate().success());
}

#[test]
fn the_claim_never_takes_more_than_free_capacity_even_with_a_deep_backlog() {
    let db = TestDb::new();
    let dir = TempDir::new("d-cap");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\nQUEUE_LIMIT = 3\n",
    );
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, state) \
         SELECT 's', 'a@x.example', ARRAY['r@y.example'], '{\"fault\": \"slow\"}' FROM generate_series(1, 5000)",
        &[],
    )
    .unwrap();
    let mut d = Dispatcher::start(&conf, &[]);
    let running = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'";
    wait_until(Duration::from_secs(20), "the first claim", || {
        count(&mut c, running) > 0
    });
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        most = most.max(count(&mut c, running));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(most > 0, "the stage ran");
    assert!(
        most <= 6,
        "at most QUEUE_LIMIT × PARALLELISM = 6 rows running, saw {most}"
    );
    assert!(d.terminate().success());
}

#[test]
fn the_claim_uses_the_partial_pending_index() {
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, status, timeout, mail_from, rcpt_to) \
         SELECT CASE WHEN g % 10 = 0 THEN 'a' ELSE 'b' END, \
                CASE WHEN g % 3 = 0 THEN 'pending' ELSE 'paused' END::pepsi.workqueue_status, \
                CASE WHEN g % 3 = 0 THEN NULL ELSE now() + interval '1 hour' END, \
                'a@x.example', ARRAY['r@y.example'] FROM generate_series(1, 20000) g",
        &[],
    )
    .unwrap();
    let stages = vec!["a".to_string(), "b".to_string()];
    let caps = vec![4i32, 8];
    // Run: no step reads more rows than are claimed, with statistics that have not seen
    // the rows yet and with current ones (a join of the update with the picked ids was
    // once planned as a walk over every pending row).
    let touches_only_the_claimed = |c: &mut Client, stages: &[String], caps: &[i32], when: &str| {
        let most: i64 = caps.iter().map(|&n| i64::from(n)).sum();
        let mut tx = c.transaction().unwrap();
        let analyzed: Vec<String> = tx
            .query(
                &format!(
                    "EXPLAIN (ANALYZE, TIMING OFF, COSTS OFF) {}",
                    pepsi::db::sql::CLAIM_OLDEST
                ),
                &[&stages, &caps, &100i32],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.rollback().unwrap();
        // Nor does any step filter out more rows than are claimed (a walk of the
        // primary key in id order, filtering by stage, reads as few rows as it returns
        // but skips over all the others).
        for line in analyzed
            .iter()
            .filter(|l| l.contains("Rows Removed by Filter"))
        {
            let removed: i64 = line
                .rsplit(':')
                .next()
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no count in {line:?}"));
            assert!(removed <= most, "{when}: {line}\n{}", analyzed.join("\n"));
        }
        for line in analyzed.iter().filter(|l| l.contains(" on workqueue")) {
            let rows: i64 = line
                .split("actual rows=")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no row count in {line:?}"));
            assert!(rows <= most, "{when}: {line}\n{}", analyzed.join("\n"));
        }
    };
    // A burst just injected into an empty queue, before any ANALYZE.
    let burst = TestDb::new();
    let mut b = burst.client();
    b.execute(
        "SELECT count(pepsi.workqueue_inject('p' || (g % 5 + 1), 'a@x.example', ARRAY['r@y.example'], NULL, NULL)) \
         FROM generate_series(1, 5000) g",
        &[],
    )
    .unwrap();
    let five: Vec<String> = (1..=5).map(|i| format!("p{i}")).collect();
    touches_only_the_claimed(&mut b, &five, &[64; 5], "a fresh burst");
    touches_only_the_claimed(&mut c, &stages, &caps, "before ANALYZE");
    c.batch_execute("ANALYZE pepsi.workqueue").unwrap();
    touches_only_the_claimed(&mut c, &stages, &caps, "after ANALYZE");
    let plan: Vec<String> = c
        .query(
            &format!("EXPLAIN {}", pepsi::db::sql::CLAIM_OLDEST),
            &[&stages, &caps, &100i32],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan = plan.join("\n");
    assert!(plan.contains("workqueue_pending_idx"), "{plan}");
    assert!(!plan.contains("Seq Scan on workqueue q"), "{plan}");
    // And it takes exactly the capacities asked, though thousands wait.
    let rows = c
        .query(pepsi::db::sql::CLAIM_OLDEST, &[&stages, &caps, &100i32])
        .unwrap();
    let claimed: Vec<String> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<String>>(1))
        .collect();
    assert_eq!(claimed.iter().filter(|s| *s == "a").count(), 4);
    assert_eq!(claimed.iter().filter(|s| *s == "b").count(), 8);
}

#[test]
fn rows_at_a_stage_without_a_section_are_left_alone_and_reported() {
    let db = TestDb::new();
    let dir = TempDir::new("d-ghost");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let ghost = inject_many(&mut c, "ghost", "a@x.example", 2);
    let d = Dispatcher::start(&conf, &[]);
    d.wait_log(
        "2 pending rows are at stage \"ghost\", which has no [stage-ghost] section",
        Duration::from_secs(20),
    );
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_until(Duration::from_secs(20), "the known stage drains", || {
        queue_len(&mut c) == 2
    });
    for id in ghost {
        assert_eq!(row_at(&mut c, id), Some(("ghost".into(), "pending".into())));
    }
}

#[test]
fn telemetry_changed_retires_every_worker_and_keeps_the_stage_table() {
    let db = TestDb::new();
    let dir = TempDir::new("d-telemetry");
    let conf = conf(
        &dir,
        &db,
        "WORKER_IDLE_TIMEOUT = 60s",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let d = Dispatcher::start(&conf, &[]);
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    let before = d.children();
    assert_eq!(before.len(), 1, "one idle worker stays (idle timeout 60s)");
    c.batch_execute("NOTIFY telemetry_changed").unwrap();
    wait_until(Duration::from_secs(10), "the worker is retired", || {
        d.children().is_empty()
    });
    d.wait_log(
        "telemetry setting changed: retiring every worker",
        Duration::from_secs(10),
    );
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    let after = d.children();
    assert_eq!(after.len(), 1);
    assert_ne!(after, before, "a fresh worker");
}

#[test]
fn the_stats_tick_collects_orphaned_bodies_after_activity() {
    let db = TestDb::new();
    let dir = TempDir::new("d-gc");
    let conf = conf(
        &dir,
        &db,
        "STATS_INTERVAL = 1s",
        "[stage-s]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    // More orphans than one run collects (10,000): the runs go on without new activity.
    c.execute(
        "INSERT INTO pepsi.workqueue_body (body) \
         SELECT 'left behind by two concurrent deletes' FROM generate_series(1, 10050)",
        &[],
    )
    .unwrap();
    let d = Dispatcher::start(&conf, &[]);
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    wait_until(
        Duration::from_secs(20),
        "every orphaned body is collected",
        || count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body") == 0,
    );
    d.wait_log(
        "body GC removed 10000 unreferenced bodies",
        Duration::from_secs(5),
    );
    drop(d);
}

#[test]
fn after_its_connections_are_killed_the_dispatcher_retakes_the_lock_and_goes_on() {
    let db = TestDb::new();
    let dir = TempDir::new("d-reconnect");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let mut d = Dispatcher::start(&conf, &[]);
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    // As if the database restarted: every session of the dispatcher and its workers.
    let killed = count(
        &mut c,
        "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name LIKE 'pepsi-%'",
    );
    assert!(killed >= 2, "killed {killed} sessions");
    d.wait_log("the dispatcher lock is held again", Duration::from_secs(20));
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    assert!(d.terminate().success(), "{}", d.log());
}

/// The coordinator alone, its events read from a channel.
mod coordinator {
    use std::sync::Arc;
    use std::time::Duration;

    use crossbeam_channel::{Receiver, unbounded};
    use pepsi::dispatch::coordinator::{self, Command};
    use pepsi::dispatch::events::{Event, EventSender};
    use pepsi::dispatch::scheduler::ClaimRequest;
    use pepsi::dispatch::session;
    use std::sync::atomic::AtomicBool;

    use super::{count, inject_many};
    use crate::util::TestDb;

    fn next(events: &Receiver<Event>, what: &str) -> Event {
        events
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no event while waiting for {what}"))
    }

    fn claim(stage: &str, n: i32) -> Command {
        Command::Claim(ClaimRequest::Oldest(vec![(stage.to_string(), n)]))
    }

    #[test]
    fn after_a_reconnect_no_claim_runs_before_the_reconcile_for_it() {
        let db = TestDb::new();
        let mut c = db.client();
        inject_many(&mut c, "s", "a@x.example", 3);
        let (client, _) = session::start(&db.conninfo, |_| true)
            .expect("the session starts")
            .expect("the database is there");
        let poll = mio::Poll::new().unwrap();
        let waker = Arc::new(mio::Waker::new(poll.registry(), mio::Token(0)).unwrap());
        let (tx, events) = unbounded();
        let (commands, rx) = unbounded();
        coordinator::spawn(coordinator::Parts {
            client,
            conninfo: db.conninfo.clone(),
            commands: rx,
            events: EventSender::new(tx, waker),
            max_hops: 100,
            stopping: Arc::new(AtomicBool::new(false)),
        })
        .unwrap();
        // The database drops the coordinator's session while it is idle.
        let killed = count(
            &mut c,
            "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'pepsi-dispatch'",
        );
        assert_eq!(killed, 1);
        // A check finds it gone and re-takes the lock; a claim queued behind it must
        // wait for the loop's reconcile, which would otherwise reset the rows it hands out.
        commands.send(Command::Check).unwrap();
        commands.send(claim("s", 10)).unwrap();
        assert!(matches!(next(&events, "LockLost"), Event::LockLost));
        let Event::LockRegained(generation) = next(&events, "LockRegained") else {
            panic!("expected LockRegained");
        };
        assert!(
            matches!(next(&events, "the refused claim"), Event::ClaimFailed),
            "a claim ran before the reconcile"
        );
        let running = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'";
        assert_eq!(count(&mut c, running), 0);
        // A reconcile for an earlier re-take does not open the gate.
        commands
            .send(Command::Reconcile {
                held: Vec::new(),
                generation: generation - 1,
            })
            .unwrap();
        commands.send(claim("s", 10)).unwrap();
        assert!(matches!(
            next(&events, "the claim refused again"),
            Event::ClaimFailed
        ));
        commands
            .send(Command::Reconcile {
                held: Vec::new(),
                generation,
            })
            .unwrap();
        commands.send(claim("s", 10)).unwrap();
        match next(&events, "the claim after the reconcile") {
            Event::Claimed { claims, .. } => assert_eq!(claims.len(), 3),
            _ => panic!("expected the rows to be claimed"),
        }
        assert_eq!(count(&mut c, running), 3);
        commands.send(Command::Reset).unwrap();
        assert!(matches!(
            next(&events, "the reset"),
            Event::ResetDone(Ok(3))
        ));
    }
}
