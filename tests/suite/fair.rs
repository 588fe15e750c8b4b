//! Fair scheduling between senders end to end (§7): a flood does not delay a small
//! sender, senders share a stage's worker time rather than its message count, and
//! `FAIR_SCHEDULING = no` claims strictly in id order. One worker with one slot at the
//! stage, so the order of completions is the order of claims. Real PostgreSQL, real
//! processes (the fault worker, whose messages cost their `state.cost_ms`).

use std::time::Duration;

use postgres::Client;

use crate::util::Scenario;
use crate::util::dispatcher::Dispatcher;
use crate::util::rows::wait_empty;
use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb};

const SEC: Duration = Duration::from_secs(1);

/// Records every finished message (deleted at the end of the stage) in order, and
/// when.
fn record_finishes(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE finished (n bigserial, workqueue_id bigint, sender text, \
                                at timestamptz DEFAULT clock_timestamp());
         CREATE FUNCTION finished() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO finished (workqueue_id, sender) VALUES (OLD.workqueue_id, OLD.sender_key);
               RETURN NULL; END $$;
         CREATE TRIGGER finished AFTER DELETE ON pepsi.workqueue FOR EACH ROW
             EXECUTE FUNCTION finished();",
    )
    .unwrap();
}

/// Injects `n` messages from `sender@domain` at stage `s`, each costing `cost_ms`.
fn inject(c: &mut Client, domain: &str, n: i64, cost_ms: i64) {
    c.execute(
        "SELECT count(pepsi.workqueue_inject('s', 'x@' || $1, ARRAY['r@y.example'], NULL, NULL, \
                NULL, NULL, NULL, NULL, jsonb_build_object('cost_ms', $3::int8))) \
           FROM generate_series(1, $2::int8)",
        &[&domain, &n, &cost_ms],
    )
    .unwrap();
}

fn finished_count(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM finished", &[])
        .unwrap()
        .get(0)
}

const ONE_SLOT: &str = "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 1\n";

#[test]
fn a_small_sender_is_not_delayed_by_a_flood() {
    let (s, mut c) = Scenario::new("f-flood")
        .timers("")
        .stages(ONE_SLOT)
        .connect();
    record_finishes(&mut c);
    inject(&mut c, "a.example", 2000, 5);
    let d = s.start();
    crate::util::wait_until(30 * SEC, "the flood is under way", || {
        finished_count(&mut c) >= 20
    });
    let before: i64 = c
        .query_one("SELECT coalesce(max(n), 0) FROM finished", &[])
        .unwrap()
        .get(0);
    inject(&mut c, "b.example", 10, 5);
    crate::util::wait_until(60 * SEC, "the small sender is done", || {
        c.query_one(
            "SELECT count(*) FROM finished WHERE sender = 'from:b.example'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 10
    });
    let last_b: i64 = c
        .query_one(
            "SELECT max(n) FROM finished WHERE sender = 'from:b.example'",
            &[],
        )
        .unwrap()
        .get(0);
    let a_meanwhile: i64 = c
        .query_one(
            "SELECT count(*) FROM finished WHERE sender = 'from:a.example' AND n > $1 AND n < $2",
            &[&before, &last_b],
        )
        .unwrap()
        .get(0);
    // In id order B would wait for all of A's ~1,980 others; fairly, B's ten alternate
    // with A's next ones (in flight when B arrived, the FIFO reserve, and one each).
    assert!(
        a_meanwhile < 60,
        "{a_meanwhile} of the flood's messages finished before the small sender's last"
    );
    drop(d);
}

#[test]
fn senders_share_a_stages_worker_time_not_its_message_count() {
    let db = TestDb::new();
    let dir = TempDir::new("f-cost");
    // The FIFO reserve would hand slots out by age alone: leave it out here.
    let conf = conf(&dir, &db, "FAIR_FIFO_PERCENT = 0", ONE_SLOT);
    let mut c = db.client();
    record_finishes(&mut c);
    // Interleaved ids, so age favours neither: A's messages cost 4 times C's.
    for _ in 0..60 {
        inject(&mut c, "a.example", 1, 40);
        inject(&mut c, "c.example", 4, 10);
    }
    let d = Dispatcher::start(&conf, &[]);
    crate::util::wait_until(60 * SEC, "a window of 100 messages", || {
        finished_count(&mut c) >= 110
    });
    // Past the first few (whose charges are guesses of the stage's average), over a
    // window in which both senders still wait. What a message costs is what it took
    // here, its sleep and the machine's overhead, which a busy machine makes larger
    // for both (so their ratio smaller than 4): with one slot, the time from the
    // finish before it to its own.
    let (a, cc, a_takes, c_takes): (i64, i64, f64, f64) = {
        let r = c
            .query_one(
                "WITH f AS (SELECT n, sender, \
                                   extract(epoch FROM at - lag(at) OVER (ORDER BY n))::float8 AS took \
                              FROM finished) \
                 SELECT count(*) FILTER (WHERE sender = 'from:a.example'), \
                        count(*) FILTER (WHERE sender = 'from:c.example'), \
                        avg(took) FILTER (WHERE sender = 'from:a.example'), \
                        avg(took) FILTER (WHERE sender = 'from:c.example') \
                   FROM f WHERE n > 10 AND n <= 110",
                &[],
            )
            .unwrap();
        // No message of a sender in the window: no cost either, and the check fails.
        let took = |i: usize| r.get::<_, Option<f64>>(i).unwrap_or(f64::NAN);
        (r.get(0), r.get(1), took(2), took(3))
    };
    // Sharing worker time, the cheap sender gets as many more messages as the costly
    // one's cost more (by the dispatcher's own measure, which leaves out the claim's
    // latency, a little more); sharing the message count, about as many.
    let costs = a_takes / c_takes;
    let ratio = cc as f64 / a.max(1) as f64;
    assert!(
        costs > 1.5 && (0.6 * costs..=2.0 * costs).contains(&ratio),
        "the cheap sender got {cc} messages ({:.1} ms each), the costly one {a} ({:.1} ms \
         each): {ratio:.2} times as many for {costs:.2} times the cost",
        c_takes * 1000.0,
        a_takes * 1000.0
    );
    drop(d);
}

#[test]
fn without_fair_scheduling_the_claim_is_strictly_oldest_first() {
    let (s, mut c) = Scenario::new("f-off")
        .timers("FAIR_SCHEDULING = no")
        .stages(ONE_SLOT)
        .connect();
    record_finishes(&mut c);
    for _ in 0..10 {
        inject(&mut c, "a.example", 5, 0);
        inject(&mut c, "b.example", 1, 0);
    }
    let mut d = s.start();
    wait_empty(&mut c, 60 * SEC);
    let order: Vec<i64> = c
        .query("SELECT workqueue_id FROM finished ORDER BY n", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(order, sorted, "finished in id order");
    assert_eq!(order.len(), 60);
    assert!(d.terminate().success());
}

#[test]
fn the_oldest_rows_are_claimed_within_the_fifo_share_however_many_new_senders_arrive() {
    let db = TestDb::new();
    let dir = TempDir::new("f-fifo");
    // One slot, a tenth of the slots for the oldest rows: an oldest row waits at most
    // ten claims of the stage (the credit accumulates 0.1 a claim).
    let conf = conf(&dir, &db, "FAIR_FIFO_PERCENT = 10", ONE_SLOT);
    let mut c = db.client();
    record_finishes(&mut c);
    // An expensive old sender: by the time the stream arrives it has a lead of several
    // of the stream's messages.
    inject(&mut c, "a.example", 10, 40);
    let d = Dispatcher::start(&conf, &[]);
    crate::util::wait_until(30 * SEC, "the old sender is served four times", || {
        finished_count(&mut c) >= 4
    });
    // A stream of senders new to the stage: each starts ahead of every sender already
    // served, so without the reserve the old sender's rows would wait for all of them.
    c.execute(
        "SELECT count(pepsi.workqueue_inject('s', 'x@n' || g || '.example', ARRAY['r@y.example'], \
                NULL, NULL, NULL, NULL, NULL, NULL, jsonb_build_object('cost_ms', 2))) \
           FROM generate_series(1, 200) g",
        &[],
    )
    .unwrap();
    crate::util::wait_until(60 * SEC, "the old sender's rows are done", || {
        c.query_one(
            "SELECT count(*) FROM finished WHERE sender = 'from:a.example'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 10
    });
    let last_a: i64 = c
        .query_one(
            "SELECT max(n) FROM finished WHERE sender = 'from:a.example'",
            &[],
        )
        .unwrap()
        .get(0);
    // Six rows left, one claim in ten for the oldest: about 60 claims after the first
    // four, with slack for the claims in flight when the stream arrived. Without the
    // reserve they wait for all 200 new senders.
    assert!(
        last_a <= 80,
        "the old sender's last row finished {last_a}th, not within the reserve's share"
    );
    drop(d);
}
