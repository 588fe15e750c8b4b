//! The claim floors and the claims' plans (schema 13): a claim reads each
//! stage from its floor and answers where the next may start; a row moved back below
//! a floor is still claimed within one poll interval; and the claim functions keep
//! their plans on the pending indexes after the table was emptied, vacuumed (which
//! truncates it) and analyzed, then loaded with 10,000 rows.

use std::time::Duration;

use postgres::{Client, GenericClient};

use super::fair_sql::{add, assert_reads_at_most, nested_plans};
use crate::util::rows::inject_many;
use crate::util::{Scenario, TestDb, row_at, wait_until};
use pepsi::db::sql;

/// What a claim may take beyond the interval it is due in, on a busy machine.
const MARGIN: Duration = Duration::from_secs(5);

/// The oldest-first claim of `cap` rows at `stage` from `floor`: the ids taken.
fn claim_oldest(c: &mut Client, stage: &str, cap: i32, floor: Option<i64>) -> Vec<i64> {
    let rows = c
        .query(
            sql::CLAIM_OLDEST,
            &[&vec![stage], &vec![cap], &100i32, &vec![floor]],
        )
        .unwrap();
    let mut ids: Vec<i64> = rows.iter().filter_map(|r| r.get(0)).collect();
    ids.sort_unstable();
    ids
}

/// The fair claim of `cap` rows at `stage` from `floor` (no fifo, no leads): the ids
/// taken and the next floor it answers.
fn claim_fair(
    c: &mut Client,
    stage: &str,
    cap: i32,
    floor: Option<i64>,
) -> (Vec<i64>, Option<i64>) {
    claim_fair_walking(c, stage, cap, floor, None)
}

/// [`claim_fair`], saying whether the stage may walk its senders (`None`: yes).
fn claim_fair_walking(
    c: &mut impl GenericClient,
    stage: &str,
    cap: i32,
    floor: Option<i64>,
    walk: Option<bool>,
) -> (Vec<i64>, Option<i64>) {
    let none_t: Vec<String> = Vec::new();
    let none_f: Vec<f64> = Vec::new();
    let rows = c
        .query(
            sql::CLAIM_FAIR,
            &[
                &vec![stage],
                &vec![cap],
                &vec![0i32],
                &vec![1000.0f64],
                &vec![None::<String>],
                &none_t,
                &none_t,
                &none_f,
                &100i32,
                &vec![floor],
                &walk.map(|w| vec![w]),
                &None::<Vec<i64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<f64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
            ],
        )
        .unwrap();
    let mut ids: Vec<i64> = rows.iter().filter_map(|r| r.get(0)).collect();
    ids.sort_unstable();
    let next = rows
        .iter()
        .find(|r| r.get::<_, Option<i64>>(0).is_none())
        .and_then(|r| r.get::<_, Option<i64>>(7));
    (ids, next)
}

#[test]
fn a_claim_reads_from_its_floor_and_answers_where_the_next_may_start() {
    let db = TestDb::new();
    let mut c = db.client();
    let ids = add(&mut c, "a", "x@a.example", 10);
    // From the floor: the rows below it are not read.
    assert_eq!(claim_oldest(&mut c, "a", 3, Some(ids[5])), ids[5..8]);
    // Without one, the oldest.
    assert_eq!(claim_oldest(&mut c, "a", 2, None), ids[0..2]);
    // The fair claim: all from the floor fit, so all are taken and the next floor is
    // just past the highest.
    let (took, next) = claim_fair(&mut c, "a", 5, Some(ids[8]));
    assert_eq!(took, ids[8..10]);
    assert_eq!(next, Some(ids[9] + 1));
    // More than fit: the next floor is the lowest read and left (one sender, so the
    // oldest are taken).
    let more = add(&mut c, "b", "x@b.example", 8);
    let (took, next) = claim_fair(&mut c, "b", 3, None);
    assert_eq!(took, more[0..3]);
    assert_eq!(next, Some(more[3]));
    // Nothing read from the floor: no next floor (the dispatcher keeps its own).
    let (took, next) = claim_fair(&mut c, "a", 5, Some(ids[9] + 1));
    assert!(took.is_empty());
    assert_eq!(next, Some(ids[9] + 1), "the floor asked, unmoved");
    let (took, next) = claim_fair(&mut c, "c", 5, None);
    assert!(took.is_empty() && next.is_none());
    // The rows below the floor were there all along: a claim without it takes them.
    assert_eq!(claim_oldest(&mut c, "a", 10, None), ids[2..5]);
}

#[test]
fn a_stage_whose_walk_is_paused_finds_its_senders_among_its_oldest_rows_from_the_floor() {
    let db = TestDb::new();
    let mut c = db.client();
    // One sender's 600 rows, then another's 3: more than the 512 a claim reads from
    // the floor, so finding the second sender takes the walk over the senders.
    let flood = add(&mut c, "a", "flood@x.example", 600);
    let quiet = add(&mut c, "a", "quiet@y.example", 3);
    let mut tx = c.transaction().unwrap();
    let (took, _) = claim_fair_walking(&mut tx, "a", 8, None, Some(true));
    assert!(
        quiet.iter().all(|id| took.contains(id)),
        "the walk finds the quiet sender behind the flood: {took:?}"
    );
    tx.rollback().unwrap();
    let (took, next) = claim_fair_walking(&mut c, "a", 8, None, Some(false));
    assert_eq!(
        took,
        flood[0..8],
        "paused, the window is the senders among the oldest rows: the flood alone"
    );
    assert_eq!(next, Some(flood[8]));
    // From a floor past the flood, the quiet sender is among the oldest rows again.
    let (took, _) = claim_fair_walking(&mut c, "a", 8, Some(flood[599]), Some(false));
    assert_eq!(
        took,
        [flood[599]]
            .iter()
            .chain(&quiet)
            .copied()
            .collect::<Vec<_>>()
    );
}

#[test]
fn the_claims_plans_stay_on_the_pending_indexes_after_the_table_was_emptied_vacuumed_and_analyzed()
{
    let db = TestDb::new();
    let mut c = db.client();
    // No autovacuum or autoanalyze to correct the statistics behind the test's back.
    c.batch_execute("ALTER TABLE pepsi.workqueue SET (autovacuum_enabled = off)")
        .unwrap();
    add(&mut c, "a", "x@a.example", 3000);
    c.batch_execute("DELETE FROM pepsi.workqueue").unwrap();
    // Alone: VACUUM refuses to run inside the implicit transaction of a batch.
    c.batch_execute("VACUUM pepsi.workqueue").unwrap();
    c.batch_execute("ANALYZE pepsi.workqueue").unwrap();
    let pages: i64 = c
        .query_one("SELECT pg_relation_size('pepsi.workqueue') / 8192", &[])
        .unwrap()
        .get(0);
    assert_eq!(pages, 0, "the vacuum truncated the table");
    let claims = "BEGIN;\n\
         SELECT * FROM pepsi.workqueue_claim_oldest('{a,b}', '{16,16}', NULL, 100);\n\
         SELECT * FROM pepsi.workqueue_claim_oldest('{a,b}', '{16,16}', '{5000,9000}', 100);\n\
         SELECT * FROM pepsi.workqueue_claim_fair('{a,b}', '{16,16}', '{2,2}', '{1000,1000}', \
                '{NULL,NULL}', '{}', '{}', '{}', 100, NULL);\n\
         SELECT * FROM pepsi.workqueue_claim_fair('{a,b}', '{16,16}', '{2,2}', '{1000,1000}', \
                '{NULL,NULL}', '{}', '{}', '{}', 100, '{5000,9000}');\n\
         ROLLBACK;\n";
    // One session: seven rounds of calls on the empty table (PL/pgSQL caches generic
    // plans after five), then 10,000 rows over 40 senders (20 of them one tenant's,
    // shared.example, so that its senders are walked) and paused rows, unseen by the
    // statistics, and two more rounds, whose every nested plan is logged.
    let script = format!(
        "SET auto_explain.log_min_duration = -1;\n{}\
         INSERT INTO pepsi.workqueue (stage, status, timeout, mail_from, rcpt_to) \
         SELECT CASE WHEN g % 10 = 0 THEN 'b' ELSE 'a' END, \
                CASE WHEN g % 50 = 0 THEN 'paused' ELSE 'pending' END::pepsi.workqueue_status, \
                CASE WHEN g % 50 = 0 THEN now() + interval '1 hour' END, \
                'x@s' || (g % 40) || CASE WHEN g % 40 < 20 THEN '.shared.example' \
                                          ELSE '.example' END, ARRAY['r@y.example'] \
           FROM generate_series(1, 10000) g;\n\
         SET auto_explain.log_min_duration = 0;\n{}",
        claims.repeat(7),
        claims.repeat(2)
    );
    let plans = nested_plans(&db, &script);
    assert_eq!(
        plans.matches("WITH RECURSIVE walk").count(),
        12,
        "every call's nested statements are logged (the walk of the tenants and the \
         one of each tenant's senders, at both stages without floors and at `a` from its \
         floor, twice; `b` has fewer than 512 rows from its floor):\n{plans}"
    );
    assert_eq!(
        plans.matches("array_agg(x.workqueue_id").count(),
        8,
        "the rows from the floor, read where the first 65 do not fit the cap:\n{plans}"
    );
    assert!(plans.contains("workqueue_pending_idx"), "{plans}");
    assert!(plans.contains("workqueue_pending_tenant_idx"), "{plans}");
    assert!(plans.contains("workqueue_paused_idx"), "{plans}");
    assert!(!plans.contains("Bitmap Heap Scan on workqueue"), "{plans}");
    // No sequential scan (checked there too), and no node reads more than the senders'
    // window of candidates (40 senders × 16) and its probes, of 10,000 rows.
    assert_reads_at_most(&plans, 700.0, 600.0, "after 10,000 rows");
}

#[test]
fn a_row_moved_back_below_the_floor_is_claimed_within_one_poll_interval() {
    let poll = Duration::from_secs(4);
    let (s, mut c) = Scenario::new("d-floor")
        .timers("POLL_INTERVAL = 4s\nWORKER_IDLE_TIMEOUT = 60s")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    // The oldest rows of all, out of the way: two failed, one held for an hour, one
    // paused until a few seconds after the burst.
    let old = add(&mut c, "s", "x@a.example", 4);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed' WHERE workqueue_id = ANY ($1)",
        &[&old[0..3].to_vec()],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '6 seconds' \
         WHERE workqueue_id = $1",
        &[&old[3]],
    )
    .unwrap();
    let mut d = s.start();
    d.wait_log("serving 2 stages", Duration::from_secs(10));
    // A burst through both stages moves their floors past the old rows.
    let burst = inject_many(&mut c, "s", "y@b.example", 60);
    wait_until(Duration::from_secs(30), "the burst completes", || {
        burst.iter().all(|&id| row_at(&mut c, id).is_none())
    });
    std::thread::sleep(Duration::from_millis(1500));
    // Within one poll interval, plus a margin for a busy machine: a row the floors
    // skipped would not be claimed at all.
    let gone_within = |c: &mut Client, id: i64, what: &str| {
        wait_until(poll + MARGIN, what, || {
            row_at(c, id).is_none_or(|(_, status)| status != "pending")
        });
    };
    // Resumed by another session (which notifies).
    c.query_one("SELECT pepsi.workqueue_resume(ARRAY[$1::int8])", &[&old[0]])
        .unwrap();
    gone_within(&mut c, old[0], "a resumed row is claimed");
    // Requeued by another session (which notifies).
    c.query(
        "SELECT * FROM pepsi.workqueue_requeue(ARRAY[$1::int8], 's')",
        &[&old[1]],
    )
    .unwrap();
    gone_within(&mut c, old[1], "a requeued row is claimed");
    // Put back to pending by hand, with no notification at all: the heartbeat's claim
    // goes without floors.
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'pending' WHERE workqueue_id = $1",
        &[&old[2]],
    )
    .unwrap();
    gone_within(&mut c, old[2], "a row set pending by hand is claimed");
    // The paused row, flipped by the dispatcher when due.
    wait_until(Duration::from_secs(15), "the paused row completes", || {
        row_at(&mut c, old[3]).is_none()
    });
    assert!(d.terminate().success());
}
