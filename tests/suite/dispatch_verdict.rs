//! What a worker's end means for its messages (`src/dispatch/verdict.rs`), end to end:
//! a crash strikes the front message and requeues the rest, a crash inside a batch
//! strikes nobody until the culprit runs alone, a hang is killed at MAX_RUNTIME, an
//! unreadable status line is a crash while an unreadable report is not, and 74
//! defers without a strike.

use std::time::Duration;

use crate::util::rows::{
    count, due_now, inject_fault, inject_many, pauses_of, record_pauses, wait_count, wait_empty,
    wait_status,
};
use crate::util::{Scenario, assert_has, row_at, state_of, wait_until};

const SEC: Duration = Duration::from_secs(1);

#[test]
fn a_crash_strikes_the_front_message_and_requeues_its_siblings() {
    let (s, mut c) = Scenario::new("d-crash")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n")
        .connect();
    let poison = inject_fault(&mut c, "s", "crash");
    let siblings = inject_many(&mut c, "s", "a@x.example", 3);
    let mut d = s.start();
    wait_status(&mut c, poison, ("s", "paused"), Duration::from_secs(20));
    let st = state_of(&mut c, poison);
    assert_eq!(st["strikes"], 1);
    assert_eq!(st["strike_stage"], "s");
    assert_has!(
        st["last_error"].as_str().unwrap(),
        "exited with status 3",
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

#[test]
fn a_crash_inside_a_batch_strikes_nobody_and_the_culprit_run_alone_is_struck() {
    let (s, mut c) = Scenario::new("d-suspect")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n")
        .connect();
    record_pauses(&mut c);
    let front = inject_many(&mut c, "s", "a@x.example", 2);
    let culprit = inject_fault(&mut c, "s", "crash");
    let last = inject_many(&mut c, "s", "a@x.example", 1)[0];
    // The worker answers a batch only after all of it ran, so the crash on the third
    // id leaves four delivered ids unanswered: none of them can be told guilty, so
    // nobody is struck and all four go back as suspects, each then run alone (§8.2
    // "Batches").
    let d = s.start_with(&[("FAULT_BATCH_ANSWERS", "1")]);
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
    let (s, mut c) = Scenario::new("d-hang")
        .timers("MAX_RUNTIME = 3s")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 2\n")
        .connect();
    let hang = inject_fault(&mut c, "s", "hang");
    let sibling = inject_many(&mut c, "s", "a@x.example", 1)[0];
    let mut d = s.start();
    wait_status(&mut c, hang, ("s", "paused"), Duration::from_secs(20));
    assert_has!(
        state_of(&mut c, hang)["last_error"].as_str().unwrap(),
        "MAX_RUNTIME"
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

#[test]
fn a_garbage_status_line_tears_the_worker_down_as_a_crash() {
    let (s, mut c) = Scenario::new("d-garbage")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    let bad = inject_fault(&mut c, "s", "garbage-status");
    let d = s.start();
    wait_status(&mut c, bad, ("s", "paused"), Duration::from_secs(20));
    let st = state_of(&mut c, bad);
    assert_eq!(st["strikes"], 1);
    assert_has!(
        st["last_error"].as_str().unwrap(),
        "unreadable status line",
        "{st}"
    );
    drop(d);
}

#[test]
fn a_garbage_report_still_completes_the_message() {
    let (s, mut c) = Scenario::new("d-badreport")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\n")
        .connect();
    let id = inject_fault(&mut c, "s", "garbage-report");
    let after = inject_many(&mut c, "s", "a@x.example", 2);
    let mut d = s.start();
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
fn status_74_pauses_the_message_for_30_seconds() {
    let (s, mut c) = Scenario::new("d-74")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let id = inject_fault(&mut c, "s", "ioerr");
    let d = s.start();
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
