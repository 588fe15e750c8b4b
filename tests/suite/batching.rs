//! Under a deep backlog the batches run full: every claim takes the whole capacity a
//! worker's answer freed (a worker answers its batch in one write), and every worker
//! batch is a whole QUEUE_LIMIT. Counted, not timed: the claim tokens the dispatcher
//! stamps, and the batch sizes each worker logs when its input ends. A stage that loads
//! the body batches too, within its content budget, and a slow batch commits as it goes
//! (§12.3).

use std::time::Duration;

use postgres::Client;

use crate::util::dispatcher::Dispatcher;
use crate::util::rows::{count, inject_many, queue_len};
use crate::util::scenario::{Scenario, conf};
use crate::util::smarthost::{Received, Script, Smarthost};
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

/// `[stage-relay]` handing everything to `host`, one worker of QUEUE_LIMIT 4.
fn relay_alone(host: &Smarthost) -> String {
    format!(
        "[stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {}\nPARALLELISM = 1\nQUEUE_LIMIT = 4\n",
        host.address
    )
}

/// Injects a message at `relay` for `to` with `body`; its id.
fn inject_relay(c: &mut Client, to: &str, body: &[u8]) -> i64 {
    c.query_one(
        "SELECT pepsi.workqueue_inject('relay', 'a@origin.example', ARRAY[$1], $2, $3)",
        &[&to, &b"Subject: batch\r\n".as_slice(), &body],
    )
    .unwrap()
    .get(0)
}

/// Calls and rows of the statements whose text contains `marker`, from
/// pg_stat_statements (constants replaced, as it keeps them).
fn statement(c: &mut Client, marker: &str) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8, coalesce(sum(rows), 0)::int8 \
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
              WHERE d.datname = current_database() AND strpos(s.query, $1) > 0",
            &[&marker],
        )
        .unwrap();
    (row.get(0), row.get(1))
}

#[test]
fn a_stage_that_loads_the_body_takes_its_queued_messages_as_one_batch_within_4_mib() {
    // Four messages queued at a relay of one worker: one batch, one load. The load
    // brings the content of the rows while those before them hold less than 4 MiB: the
    // small first, the first 5 MiB one; the second 5 MiB one and the small last are
    // read in their turn. Every message arrives as it was stored.
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("full-batch")
        .timers("")
        .stages(&relay_alone(&host))
        .connect();
    // 5 MiB in lines of 78 characters.
    let big = |fill: u8| {
        let mut line = vec![fill; 76];
        line.extend_from_slice(b"\r\n");
        line.repeat((5 << 20) / 78 + 1)
    };
    let bodies = [
        b"small one\r\n".to_vec(),
        big(b'x'),
        big(b'y'),
        b"small two\r\n".to_vec(),
    ];
    for (i, body) in bodies.iter().enumerate() {
        inject_relay(&mut c, &format!("r{i}@dest.example"), body);
    }
    let loads_before = statement(&mut c, "THEN q.body END");
    let turns_before = statement(&mut c, "b.body FROM pepsi.workqueue q");
    let mut d = s.start();
    wait_until(Duration::from_secs(60), "the relay drained", || {
        queue_len(&mut c) == 0
    });
    // Idle for WORKER_IDLE_TIMEOUT, the worker's input is closed and it logs.
    wait_until(Duration::from_secs(20), "the worker's batch sizes", || {
        batch_sizes(&d.log(), "relay").0 == 4
    });
    assert!(d.terminate().success(), "{}", d.log());
    for (i, body) in bodies.iter().enumerate() {
        let to = format!("r{i}@dest.example");
        let seen = host.seen();
        let got: Vec<&Received> = seen
            .messages
            .iter()
            .filter(|m| m.delivered.contains(&to))
            .collect();
        assert_eq!(got.len(), 1, "{to} delivered once");
        assert!(got[0].data.ends_with(body), "{to}'s body arrived whole");
    }
    let loads = statement(&mut c, "THEN q.body END");
    let turns = statement(&mut c, "b.body FROM pepsi.workqueue q");
    assert_eq!(
        (loads.0 - loads_before.0, loads.1 - loads_before.1),
        (1, 4),
        "one load of the four rows"
    );
    assert_eq!(
        (turns.0 - turns_before.0, turns.1 - turns_before.1),
        (2, 2),
        "the content past 4 MiB read in its turn, one message at a time"
    );
    let (messages, batches, _) = batch_sizes(&d.log(), "relay");
    assert_eq!((messages, batches), (4, 1), "{}", d.log());
}

#[test]
fn a_slow_batch_commits_what_it_ran_before_it_goes_on() {
    // Each message takes the smarthost a second; a batch of three would hold every
    // outcome three seconds. After half a second a batch commits and answers what it
    // ran: by the time the second message's transaction begins, the first is settled.
    let host = Smarthost::start(Script {
        data_delay: Duration::from_secs(1),
        ..Script::default()
    });
    let (s, mut c) = Scenario::new("full-batch-slow")
        .timers("")
        .stages(&relay_alone(&host))
        .connect();
    for i in 0..3 {
        inject_relay(&mut c, &format!("s{i}@dest.example"), b"slow\r\n");
    }
    let mut d = s.start();
    wait_until(Duration::from_secs(30), "the second message's MAIL", || {
        host.commands("MAIL").len() >= 2
    });
    let left = queue_len(&mut c);
    wait_until(Duration::from_secs(30), "the relay drained", || {
        queue_len(&mut c) == 0
    });
    wait_until(Duration::from_secs(20), "the worker's batch sizes", || {
        batch_sizes(&d.log(), "relay").0 == 3
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(
        left, 2,
        "the first outcome was committed before the second began"
    );
    let (messages, batches, _) = batch_sizes(&d.log(), "relay");
    assert_eq!((messages, batches), (3, 1), "one batch: {}", d.log());
    for i in 0..3 {
        assert_eq!(host.deliveries(&format!("s{i}@dest.example")), 1);
    }
}

#[test]
fn hostile_content_read_in_its_turn_arrives_as_content_loaded_with_the_batch() {
    // The same hostile message (bidi in a header, a 100 KB header line, NUL, bare CR and
    // LF, lone dots, 10,000 recipients) first in a batch, loaded with it, and third,
    // behind 5 MiB, read in its turn: both arrive byte for byte the same.
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("full-batch-hostile")
        .timers("")
        .stages(&relay_alone(&host))
        .connect();
    let headers = "From: Alice <alice@origin.example>\r\n\
                   Subject: \u{202e}txt.exe\u{202c} bidi\r\n\
                   X-Long: "
        .to_string()
        + &"x".repeat(100_000)
        + "\r\n";
    let mut body = b"a NUL \0 here, a bare CR \r and a bare LF \n there\r\n.\r\n..\r\n".to_vec();
    body.extend_from_slice(&[b'y'; 100_000]);
    body.extend_from_slice(b"\r\nend\r\n");
    let to: Vec<String> = (0..10_000).map(|i| format!("r{i}@dest.example")).collect();
    let filler = b"filler line\r\n".repeat((5 << 20) / 13 + 1);
    for (from, rcpt, body) in [
        ("first@origin.example", to.clone(), body.as_slice()),
        (
            "filler@origin.example",
            vec!["f@dest.example".to_string()],
            filler.as_slice(),
        ),
        ("third@origin.example", to.clone(), body.as_slice()),
    ] {
        c.execute(
            "SELECT pepsi.workqueue_inject('relay', $1, $2, $3, $4)",
            &[&from, &rcpt, &headers.as_bytes(), &body],
        )
        .unwrap();
    }
    let turns_before = statement(&mut c, "b.body FROM pepsi.workqueue q");
    let mut d = s.start();
    wait_until(Duration::from_secs(120), "the relay drained", || {
        queue_len(&mut c) == 0
    });
    assert!(d.terminate().success(), "{}", d.log());
    let turns = statement(&mut c, "b.body FROM pepsi.workqueue q");
    assert_eq!(turns.1 - turns_before.1, 1, "the third read in its turn");
    let seen = host.seen();
    let from = |sender: &str| {
        let got: Vec<&Received> = seen
            .messages
            .iter()
            .filter(|m| m.mail.contains(sender))
            .collect();
        let delivered: usize = got.iter().map(|m| m.delivered.len()).sum();
        assert_eq!(delivered, 10_000, "{sender}: every recipient once");
        got[0].data.clone()
    };
    let first = from("<first@origin.example>");
    let third = from("<third@origin.example>");
    assert!(
        first == third,
        "the same bytes either way: {} and {} bytes",
        first.len(),
        third.len()
    );
    assert!(
        third.windows(100_000).any(|w| w.iter().all(|&b| b == b'x')),
        "the 100 KB header line arrives whole"
    );
}
