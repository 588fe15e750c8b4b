//! Hot reload (`src/dispatch/reload.rs`): a stage added through the overlay routes new
//! messages without a restart; a graph that turns invalid stops the dispatcher with 78
//! and its rows back to pending.

use std::time::Duration;

use crate::util::rows::{count, inject_fault, inject_many, wait_empty, wait_status};
use crate::util::{Scenario, assert_has, row_at, stage};

#[test]
fn a_stage_added_through_the_overlay_routes_new_messages_without_restart() {
    let (s, mut c) = Scenario::new("d-reload")
        .timers("STATS_INTERVAL = 1s")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = end\nFUSION = no\n\n[stage-end]\nPROGRAM = {discard}\nFUSION = no\n")
        .connect();
    inject_many(&mut c, "a", "a@x.example", 5);
    let mut d = s.start();
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
    let (s, mut c) = Scenario::new("d-badreload")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nQUEUE_LIMIT = 2\n")
        .connect();
    let held = inject_fault(&mut c, "s", "hang");
    let mut d = s.start();
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-s', 'NEXT', 'nowhere')",
        &[],
    )
    .unwrap();
    let status = d.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(78), "{}", d.log());
    assert_has!(d.log(), "NEXT: names stage \"nowhere\"");
    assert_eq!(row_at(&mut c, held), Some(("s".into(), "pending".into())));
}
