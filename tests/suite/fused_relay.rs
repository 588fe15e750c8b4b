//! A relay fused behind a metadata-only stage (§12.6 and its amendment): `if → relay` is
//! one claim, one read of the body and one write per message; a failure of the relay
//! is handled at the relay, and a retry resumes there.

use std::time::Duration;

use postgres::Client;

use crate::util::rows::{due_now, wait_count, wait_empty, wait_status};
use crate::util::scenario::Scenario;
use crate::util::smarthost::{Script, Smarthost};
use crate::util::wait_until;

const WAIT: Duration = Duration::from_secs(30);

const HEADERS: &[u8] = b"From: Alice <alice@origin.example>\r\n\
To: a@dest.example\r\n\
Subject: Fused\r\n";

/// `[stage-in]`, an `if` that sends everything through `[stage-hop]` (a `pass`: the
/// body is read after two metadata-only stages) on to `[stage-relay]` (whose `extra`
/// lines are added), which hands it to `host`.
fn stages(host: &Smarthost, extra: &str) -> String {
    format!(
        "[stage-in]\nPROGRAM = {{if}}\nMATCH = sender-domain is origin.example\n\
         NEXT = hop\nELSE_STAGE = relay\n\n\
         [stage-hop]\nPROGRAM = {{pass}}\nNEXT = relay\n\n\
         [stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {}\n{extra}\n\
         [stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = relay\n\n\
         [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
        host.address
    )
}

/// Injects a message at `in` for `to`, with body `body`.
fn inject(c: &mut Client, to: &str, body: &[u8]) -> i64 {
    c.query_one(
        "SELECT pepsi.workqueue_inject('in', 'alice@origin.example', ARRAY[$1], $2, $3)",
        &[&to, &HEADERS, &body],
    )
    .unwrap()
    .get(0)
}

/// Rows the dispatcher claimed, from its statistics.
fn rows_claimed(c: &mut Client) -> i64 {
    c.query_one("SELECT rows_claimed FROM pepsi.dispatch_stats", &[])
        .unwrap()
        .get(0)
}

/// (passes, fused passes) of `stage`, from the dispatcher's statistics.
fn passes(c: &mut Client, stage: &str) -> (i64, i64) {
    c.query_opt(
        "SELECT passes, fused_passes FROM pepsi.stage_stats WHERE stage = $1",
        &[&stage],
    )
    .unwrap()
    .map_or((0, 0), |r| (r.get(0), r.get(1)))
}

/// Rows of message content the workers read in this database: every statement that
/// reads the body (`sql::LOAD_FULL`, `sql::LOAD_CONTENT`, by their texts' ends as
/// pg_stat_statements keeps them, constants replaced), from pg_stat_statements.
fn bodies_read(c: &mut Client) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(rows), 0)::int8 FROM pg_stat_statements s \
         JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = current_database() \
           AND (s.query LIKE '%b.body FROM pepsi.workqueue q%' OR s.query LIKE '%THEN q.body END%')",
        &[],
    )
    .expect("pg_stat_statements must be loaded (the throwaway test cluster preloads it)")
    .get(0)
}

/// Runs `n` messages through `in → relay` with `extra` in `[stage-relay]`; returns
/// (rows claimed, bodies read, relay's passes and fused passes) once every message
/// reached the smarthost byte for byte and the dispatcher ended.
fn run(tag: &str, extra: &str, n: usize) -> (i64, i64, (i64, i64)) {
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new(tag)
        .timers("")
        .stages(&stages(&host, extra))
        .connect();
    let bodies_before = bodies_read(&mut c);
    for i in 0..n {
        inject(
            &mut c,
            &format!("r{i}@dest.example"),
            format!("body {i}\r\n").as_bytes(),
        );
    }
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    for i in 0..n {
        let seen = host.seen();
        let got = seen
            .messages
            .iter()
            .find(|m| m.delivered == [format!("r{i}@dest.example")])
            .unwrap_or_else(|| panic!("message {i} reached the smarthost"));
        assert_eq!(
            got.data,
            [HEADERS, b"\r\n", format!("body {i}\r\n").as_bytes()].concat(),
            "message {i} arrived byte for byte"
        );
    }
    wait_count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats",
        3 * n as i64,
        WAIT,
    );
    assert!(d.terminate().success(), "{}", d.log());
    (
        rows_claimed(&mut c),
        bodies_read(&mut c) - bodies_before,
        passes(&mut c, "relay"),
    )
}

#[test]
fn if_then_relay_is_one_claim_and_one_read_of_the_body_per_message() {
    let n = 40;
    let (claimed, bodies, relay) = run("fused-relay", "", n);
    assert_eq!(claimed, n as i64, "one claim per message");
    assert_eq!(bodies, n as i64, "the body read once per message");
    assert_eq!(
        relay,
        (n as i64, n as i64),
        "relay ran in the pass of in, every time"
    );
    // The same chain with the relay kept in its own workers: a claim at each stage.
    let (claimed, bodies, relay) = run("fused-relay-off", "FUSION = no\n", n);
    assert_eq!(claimed, 2 * n as i64, "a claim at each stage");
    assert_eq!(bodies, n as i64, "the body read once per message");
    assert_eq!(relay, (n as i64, 0));
}

#[test]
fn a_failure_in_the_fused_relay_is_handled_at_the_relay_and_retried_there() {
    let host = Smarthost::start(
        Script::default().rcpt("later@dest.example", &["451 4.3.0 Try again later"]),
    );
    let (s, mut c) = Scenario::new("fused-relay-retry")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let id = inject(&mut c, "later@dest.example", b"retried\r\n");
    let mut d = s.start();
    // Deferred by the smarthost inside the pass of `in`: written at `relay`.
    wait_status(&mut c, id, ("relay", "paused"), WAIT);
    let trail: String = c
        .query_one(
            "SELECT trail FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    let stages: Vec<&str> = trail.lines().filter_map(|l| l.split(' ').next()).collect();
    assert_eq!(
        stages,
        ["in", "hop", "relay"],
        "one pass ran them all: {trail:?}"
    );
    assert_eq!(host.deliveries("later@dest.example"), 0);
    due_now(&mut c, id);
    wait_empty(&mut c, WAIT);
    assert_eq!(host.deliveries("later@dest.example"), 1);
    wait_until(WAIT, "the statistics count both passes of relay", || {
        passes(&mut c, "relay").0 == 2
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(
        passes(&mut c, "in"),
        (1, 0),
        "in ran once: the retry began at relay"
    );
    assert_eq!(passes(&mut c, "hop"), (1, 1));
    assert_eq!(
        passes(&mut c, "relay"),
        (2, 1),
        "fused once, then claimed there"
    );
    assert_eq!(rows_claimed(&mut c), 2, "claimed at in, then at relay");
}

#[test]
fn a_slow_destination_stops_a_batch_from_fusing_into_the_relay_after_two_seconds() {
    // Each message takes the smarthost a second: a batch of six, fused all the way, would
    // hold its first answer six seconds. Only what starts within the batch's first two
    // seconds (`chain::LATE_LOAD_BUDGET`) is relayed in the pass of `in`: the first and at
    // most the second; the others are written on to `relay`, whose own workers send them.
    let host = Smarthost::start(Script {
        data_delay: Duration::from_secs(1),
        ..Script::default()
    });
    let (s, mut c) = Scenario::new("fused-relay-slow")
        .timers("")
        .stages(&stages(&host, "").replace(
            "[stage-in]\n",
            "[stage-in]\nPARALLELISM = 1\nQUEUE_LIMIT = 16\n",
        ))
        .connect();
    let n = 6;
    for i in 0..n {
        inject(&mut c, &format!("s{i}@dest.example"), b"slow\r\n");
    }
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    for i in 0..n {
        assert_eq!(host.deliveries(&format!("s{i}@dest.example")), 1, "s{i}");
    }
    wait_count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = 'relay'",
        n,
        WAIT,
    );
    assert!(d.terminate().success(), "{}", d.log());
    let (passes, fused) = passes(&mut c, "relay");
    assert_eq!(passes, n);
    assert!(fused <= 2, "{fused} of {n} relayed in the pass of in");
    assert_eq!(
        rows_claimed(&mut c),
        2 * n - fused,
        "the others claimed at relay"
    );
}

#[test]
fn hostile_content_and_10000_recipients_arrive_from_a_fused_relay_as_from_the_relay_alone() {
    // The body read in the middle of a pass must be the body the relay's own load
    // reads: the same message injected at `in` (fused) and at `relay` (its own
    // workers) arrives the same, whatever bytes it holds, for every recipient.
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("fused-relay-hostile")
        .timers("")
        .stages(&stages(&host, ""))
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
    for (stage, from) in [
        ("in", "alice@origin.example"),
        ("relay", "bob@origin.example"),
    ] {
        c.execute(
            "SELECT pepsi.workqueue_inject($1, $2, $3, $4, $5)",
            &[&stage, &from, &to, &headers.as_bytes(), &body],
        )
        .unwrap();
    }
    let mut d = s.start();
    wait_empty(&mut c, Duration::from_secs(120));
    let seen = host.seen();
    let from = |sender: &str| {
        let got: Vec<_> = seen
            .messages
            .iter()
            .filter(|m| m.mail.contains(sender))
            .collect();
        let delivered: usize = got.iter().map(|m| m.delivered.len()).sum();
        assert_eq!(delivered, 10_000, "{sender}: every recipient once");
        got[0].data.clone()
    };
    let fused = from("<alice@origin.example>");
    let alone = from("<bob@origin.example>");
    // (The relay writes bare CRs and LFs as line ends, and stuffs dots, either way.)
    assert!(
        fused == alone,
        "the same bytes either way: {} and {} bytes",
        fused.len(),
        alone.len()
    );
    assert!(
        fused.windows(100_000).any(|w| w.iter().all(|&b| b == b'x')),
        "the 100 KB header line arrives whole"
    );
    drop(seen);
    wait_count(
        &mut c,
        "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = 'relay'",
        2,
        WAIT,
    );
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(passes(&mut c, "relay"), (2, 1), "one fused, one on its own");
}
