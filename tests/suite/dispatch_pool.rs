//! A stage's pool and its workers (`src/dispatch/pool.rs`, `process.rs`,
//! `workers.rs`) under `pepsi-dispatch serve`, end to end on real PostgreSQL with the
//! built-in stages and the fault worker (`examples/fault_worker.rs`): a pipeline
//! drained, ids written ahead up to QUEUE_LIMIT, the pool growing to PARALLELISM and
//! shrinking when idle, MAX_MESSAGES recycling, start failures that blame nobody and
//! cool down, the 75 throttle, and retirement on `telemetry_changed`.

use std::time::{Duration, Instant};

use postgres::Client;

use crate::util::rows::{
    count, inject_fault, inject_many, queue_len, wait_count, wait_empty, wait_status,
};
use crate::util::{Scenario, assert_has, row_at, stage, stage_dir, state_of, wait_until};

#[test]
fn a_pipeline_drains_1000_messages_and_every_row_ends_where_its_stages_say() {
    let scenario = Scenario::new("d-drain");
    let out = scenario.dir().path("delivered");
    crate::util::shared_dir(&out);
    let script = scenario.dir().write(
        "deliver.sh",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID\n", out.display()),
    );
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .unwrap();
    let (s, mut c) = scenario
        .timers("")
        .stages(&format!(
            "[stage-a]\nPROGRAM = {{pass}}\nNEXT = b\n\n\
             [stage-b]\nPROGRAM = {{if}}\nFUSION = no\nMATCH = sender-domain is drop.example\nNEXT = c\nELSE_STAGE = d\n\n\
             [stage-c]\nPROGRAM = {{discard}}\nFUSION = no\n\n\
             [stage-d]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            script.display()
        ))
        .connect();
    let keep = inject_many(&mut c, "a", "s@keep.example", 500);
    inject_many(&mut c, "a", "s@drop.example", 500);
    let mut d = s.start();
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
    let (s, mut c) = Scenario::new("d-pipe")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n")
        .connect();
    let log = s.dir.path("batches");
    inject_many(&mut c, "s", "a@x.example", 12);
    let mut d = s.start_with(&[
        ("FAULT_LOG", log.to_str().unwrap()),
        ("FAULT_DELAY_MS", "200"),
    ]);
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
    let (s, mut c) = Scenario::new("d-elastic")
        .timers("WORKER_IDLE_TIMEOUT = 1s")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 3\nQUEUE_LIMIT = 1\n")
        .connect();
    let d = s.start();
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
    let (s, mut c) = Scenario::new("d-recycle")
        .timers("WORKER_IDLE_TIMEOUT = 60s")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\nPARALLELISM = 1\nQUEUE_LIMIT = 4\nMAX_MESSAGES = 10\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    inject_many(&mut c, "s", "a@x.example", 35);
    let mut d = s.start();
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

/// A stage whose worker cannot start blames nobody, observes a cooldown, and recovers
/// once fixed.
fn start_failure_recovers(mode: &str) {
    let (s, mut c) = Scenario::new("d-start")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\n")
        .connect();
    let control = s.dir.write("control", mode);
    let ids = inject_many(&mut c, "s", "a@x.example", 3);
    let d = s.start_with(&[("FAULT_CONTROL", control.to_str().unwrap())]);
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
    // The fix comes through the overlay: its PROGRAM must be under PROGRAM_PATH.
    let (s, mut c) = Scenario::new("d-missing")
        .timers("")
        .stages(&format!(
            "[stage-s]\nPROGRAM = /nonexistent/pepsi-stage-nothing\nNEXT = end\n\n[stage-end]\nPROGRAM = {{discard}}\n\n\
             [pepsi]\nPROGRAM_PATH = {}\n",
            stage_dir().display()
        ))
        .connect();
    let id = inject_many(&mut c, "s", "a@x.example", 1)[0];
    let d = s.start();
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
fn status_75_requeues_the_message_and_halves_the_biggest_stage() {
    let (s, mut c) = Scenario::new("d-75")
        .timers("")
        .stages("[stage-big]\nPROGRAM = {fault}\nPARALLELISM = 4\nQUEUE_LIMIT = 1\n\n[stage-small]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    // About 11 s of work on 4 workers: big still runs 4 when small answers 75.
    for _ in 0..150 {
        inject_fault(&mut c, "big", "slow");
    }
    let d = s.start();
    wait_until(Duration::from_secs(20), "big runs 4 workers", || {
        d.children().len() >= 4
    });
    let id = inject_fault(&mut c, "small", "tempfail-once");
    d.wait_log(
        "stage big runs the most workers (4); its PARALLELISM is capped at 2",
        Duration::from_secs(20),
    );
    assert_has!(
        d.log(),
        "raise PostgreSQL max_connections or lower PARALLELISM"
    );
    // Back to pending, then run again (the fault cleared itself) to completion.
    wait_until(Duration::from_secs(20), "the 75 message completes", || {
        row_at(&mut c, id).is_none()
    });
    assert_has!(
        d.log(),
        &format!("small: message {id}: the database refused")
    );
    // The cap holds: big shrinks to at most 2 workers.
    wait_until(
        Duration::from_secs(20),
        "big drains to the halved cap",
        || d.children().len() <= 2,
    );
}

#[test]
fn telemetry_changed_retires_every_worker_and_keeps_the_stage_table() {
    let (s, mut c) = Scenario::new("d-telemetry")
        .timers("WORKER_IDLE_TIMEOUT = 60s")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    let d = s.start();
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
