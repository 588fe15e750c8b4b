//! Shutdown (`src/dispatch/shutdown.rs`): a Ctrl-C or SIGTERM stops the dispatcher
//! with exit 0, blames no message in flight, leaves no row running and flushes the
//! statistics.

use std::time::Duration;

use crate::util::dispatcher::alive;
use crate::util::rows::{count, inject_fault, inject_many, queue_len, wait_status};
use crate::util::{Scenario, row_at, state_of, wait_until};

#[test]
fn a_ctrl_c_stops_the_dispatcher_and_blames_no_message_in_flight() {
    let (s, mut c) = Scenario::new("d-ctrlc")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let held = inject_fault(&mut c, "s", "hang");
    let mut d = s.start();
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
    let (s, mut c) = Scenario::new("d-term")
        .timers("")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {discard}\nFUSION = no\n")
        .connect();
    inject_many(&mut c, "a", "a@x.example", 3000);
    let mut d = s.start();
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
