//! Under a deep backlog the batches run full: every claim takes the whole capacity a
//! worker's answer freed (a worker answers its batch in one write), and every worker
//! batch is a whole QUEUE_LIMIT. Counted, not timed: the claim tokens the dispatcher
//! stamps, and the batch sizes each worker logs when its input ends.

use std::time::Duration;

use crate::util::dispatcher::Dispatcher;
use crate::util::rows::{count, inject_many, queue_len};
use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb, wait_until};

/// One class count of a worker's `input ended after N messages in B batches (sizes
/// 1: a, 2-3: b, 4-7: c, 8-15: d, 16-31: e, 32+: f)` lines, summed over `stage`'s lines:
/// (messages, batches, class counts).
fn batch_sizes(log: &str, stage: &str) -> (u64, u64, Vec<u64>) {
    let mut sums = (0, 0, vec![0; 6]);
    let marker = format!("{stage}: input ended after ");
    for line in log.lines() {
        let Some((_, tail)) = line.split_once(&marker) else {
            continue;
        };
        let (totals, sizes) = tail.split_once(" (sizes ").expect("the sizes");
        let totals: Vec<u64> = totals
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        sums.0 += totals[0];
        sums.1 += totals[1];
        let classes = sizes
            .trim_end_matches(')')
            .split(", ")
            .map(|c| c.split_once(": ").unwrap().1.parse::<u64>().unwrap());
        for (sum, n) in sums.2.iter_mut().zip(classes) {
            *sum += n;
        }
    }
    sums
}

#[test]
fn under_a_deep_backlog_every_claim_and_every_worker_batch_is_full() {
    const MESSAGES: i64 = 800;
    let db = TestDb::new();
    let dir = TempDir::new("batching");
    // Two workers of 8 at s (capacity 16); s's worker runs the discard fused.
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-s]\nPROGRAM = {pass}\nNEXT = d\nPARALLELISM = 2\nQUEUE_LIMIT = 8\n\n\
         [stage-d]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    // Every claim of a row at s, by the transaction of the claim that took it (each
    // claim is a statement of its own; every row gets a token of its own).
    c.batch_execute(
        "CREATE TABLE claimed (claim_tx int8, stage text);
         CREATE FUNCTION record_claim() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO claimed VALUES (txid_current(), NEW.stage); RETURN NULL; END $$;
         CREATE TRIGGER record_claim AFTER UPDATE OF claim ON pepsi.workqueue FOR EACH ROW
             WHEN (NEW.claim IS DISTINCT FROM OLD.claim AND NEW.status = 'running')
             EXECUTE FUNCTION record_claim();",
    )
    .unwrap();
    inject_many(&mut c, "s", "a@x.example", MESSAGES);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_until(Duration::from_secs(60), "the backlog drained", || {
        queue_len(&mut c) == 0
    });
    // Idle for WORKER_IDLE_TIMEOUT, the workers' input is closed and they log.
    wait_until(
        Duration::from_secs(20),
        "every worker's batch sizes",
        || batch_sizes(&d.log(), "s").0 == MESSAGES as u64,
    );
    assert!(d.terminate().success());

    let sizes: Vec<(i64, i64)> = c
        .query(
            "SELECT n, count(*) FROM (SELECT count(*) AS n FROM claimed WHERE stage = 's' GROUP BY claim_tx) t \
             GROUP BY n ORDER BY n",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM claimed WHERE stage = 's'"),
        MESSAGES,
        "each row claimed once"
    );
    // The first claim takes the whole capacity; every later one what a whole batch's
    // answer (or two) freed: never a part of a batch.
    assert_eq!(
        sizes.last().map(|s| s.0),
        Some(16),
        "rows per claim by count: {sizes:?}"
    );
    assert!(
        sizes.iter().all(|&(n, _)| n == 8 || n == 16),
        "every claim takes whole batches (8 or 16 rows), by count: {sizes:?}"
    );
    let (messages, batches, classes) = batch_sizes(&d.log(), "s");
    assert_eq!(
        (messages, batches, classes[3]),
        (MESSAGES as u64, MESSAGES as u64 / 8, MESSAGES as u64 / 8),
        "every worker batch is a whole QUEUE_LIMIT of 8: {classes:?}"
    );
}
