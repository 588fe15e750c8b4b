//! The dispatcher's work off the loop (`src/dispatch/background.rs`, `stats.rs`):
//! statistics in one transaction per flush and none while idle, the body GC after
//! activity, and rows at a stage without a section left alone and reported.

use std::time::Duration;

use crate::util::rows::{count, inject_many, queue_len, wait_empty};
use crate::util::{Scenario, row_at, wait_until};

#[test]
fn statistics_are_one_transaction_per_flush_and_nothing_is_written_while_idle() {
    let (s, mut c) = Scenario::new("d-stats")
        .timers("STATS_INTERVAL = 1s\nPOLL_INTERVAL = 60s")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n[stage-b]\nPROGRAM = {discard}\nFUSION = no\n")
        .connect();
    c.batch_execute(
        "CREATE TABLE stats_writes (txid bigint, tbl text);
         CREATE FUNCTION stats_write() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO stats_writes VALUES (txid_current(), TG_TABLE_NAME); RETURN NULL; END $$;
         CREATE TRIGGER w AFTER INSERT OR UPDATE ON pepsi.stage_stats FOR EACH STATEMENT EXECUTE FUNCTION stats_write();
         CREATE TRIGGER w AFTER INSERT OR UPDATE ON pepsi.dispatch_stats FOR EACH STATEMENT EXECUTE FUNCTION stats_write();",
    )
    .unwrap();
    let mut d = s.start();
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
fn the_stats_tick_collects_orphaned_bodies_after_activity() {
    let (s, mut c) = Scenario::new("d-gc")
        .timers("STATS_INTERVAL = 1s")
        .stages("[stage-s]\nPROGRAM = {discard}\n")
        .connect();
    // More orphans than one run collects (10,000): the runs go on without new activity.
    c.execute(
        "INSERT INTO pepsi.workqueue_body (body) \
         SELECT 'left behind by two concurrent deletes' FROM generate_series(1, 10050)",
        &[],
    )
    .unwrap();
    let d = s.start();
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
fn rows_at_a_stage_without_a_section_are_left_alone_and_reported() {
    let (s, mut c) = Scenario::new("d-ghost")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    let ghost = inject_many(&mut c, "ghost", "a@x.example", 2);
    let d = s.start();
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
