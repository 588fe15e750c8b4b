//! Seeing the mail (schema 22, `[pepsi] DELIVERY_LOG`, `pepsi-queue trace`): through
//! the Postfix loop of doc/postfix.md, the delivery log's line for a delivered
//! recipient names the reinjection server's reply with Postfix's queue id, and
//! `pflogsumm --syslog-name=pepsi` run on Pepsi's log counts exactly the delivered and
//! bounced recipients `pepsi.history` holds; `trace` by id, by Message-ID and by the
//! downstream queue id finds the same message, shows both parts of a split one and the
//! discard of a discarded one. Without Postfix: the JSON form, the history's upkeep.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::postfix::{PIPELINE, ROUND, message, open_configured};
use crate::util::postfix::{DOMAIN, POSTMASTER};
use crate::util::queue::queue as pepsi_queue;
use crate::util::rows::count;
use crate::util::scenario::add_to_pepsi;
use crate::util::{Scenario, assert_has, wait_until};

/// The lines of the delivery log file, once it has `n` (waits up to a minute).
fn log_lines(path: &std::path::Path, n: usize) -> Vec<String> {
    let deadline = Instant::now() + ROUND;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() >= n || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `pflogsumm`'s "Grand Totals" count of `what` (delivered, bounced, deferred).
fn grand_total(report: &str, what: &str) -> u64 {
    report
        .lines()
        .find_map(|l| {
            let mut words = l.split_whitespace();
            let n = words.next()?.parse::<u64>().ok()?;
            (words.next()? == what && words.next().is_none()).then_some(n)
        })
        .unwrap_or_else(|| panic!("no {what} count in pflogsumm's report:\n{report}"))
}

/// Runs `pepsi-queue trace ARGS --json` and returns the messages it found.
fn trace(conf: &std::path::Path, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["trace"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = pepsi_queue(conf, &all);
    assert!(
        out.status.success(),
        "trace {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["messages"].as_array().unwrap().clone()
}

#[test]
fn the_postfix_loops_delivery_log_names_postfixs_queue_id_and_pflogsumm_counts_what_the_history_holds()
 {
    let dir = crate::util::TempDir::new("dl-log");
    let logfile = dir.path("pepsi.log");
    let Some(mut l) = open_configured(
        "dl-loop",
        &["alice", "sender"],
        "smtpd_reject_unlisted_recipient = no\n",
        "  -o receive_override_options=no_header_body_checks,no_milters\n  \
         -o smtpd_recipient_restrictions=reject_unlisted_recipient,permit_mynetworks,reject\n",
        PIPELINE,
        &format!("DELIVERY_LOG = {}\n", logfile.display()),
    ) else {
        return;
    };
    // alice gets it, ghost is refused on the way back (550 5.1.1) and split off, the
    // sender gets a notification; a message from spam.test is discarded by `drop`.
    let sender = format!("sender@{DOMAIN}");
    let sent = message(
        "Sender <sender@local.test>",
        "alice@local.test, ghost@local.test",
        "traced",
        "traced",
        "",
        b"Hello, both of you.\r\n",
    );
    l.submit(
        &sender,
        &[&format!("alice@{DOMAIN}"), &format!("ghost@{DOMAIN}")],
        &sent,
        &[],
    );
    let spam = message(
        "s@spam.test",
        "alice@local.test",
        "spam",
        "spam",
        "",
        b"x\r\n",
    );
    l.submit("s@spam.test", &[&format!("alice@{DOMAIN}")], &spam, &[]);
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.postfix.wait_mailbox("sender", 1, ROUND);
    l.settle(&["alice", "sender", POSTMASTER]);

    let delivered = count(
        &mut l.c,
        "SELECT count(*) FROM pepsi.history WHERE event = 'delivered'",
    );
    let bounced = count(
        &mut l.c,
        "SELECT count(*) FROM pepsi.history WHERE event = 'bounced'",
    );
    // alice, and the notification to the sender; ghost.
    assert_eq!((delivered, bounced), (2, 1), "the history's outcomes");
    let lines = log_lines(&logfile, 4);
    let text = lines.join("\n");

    // alice's line: Postfix's shape, and the reinjection server's reply with the queue
    // id Postfix gave the message.
    let alice = lines
        .iter()
        .find(|l| l.contains("to=<alice@local.test>") && l.contains("status=sent"))
        .unwrap_or_else(|| panic!("no line for alice:\n{text}"));
    assert!(alice.contains(" pepsi/reinject["), "{alice}");
    assert!(alice.contains(", relay="), "{alice}");
    assert!(
        alice.contains(", dsn=2.0.0, status=sent (250 2.0.0 Ok: queued as "),
        "{alice}"
    );
    let queue_id = alice
        .split("queued as ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap()
        .to_string();
    let postfix_log = l.postfix.maillog();
    assert_has!(
        postfix_log,
        &format!("{queue_id}: to=<alice@local.test>"),
        "the queue id names Postfix's delivery of alice's copy"
    );
    assert_has!(text, "to=<ghost@local.test>", "ghost has a line");
    assert_has!(text, "status=bounced (", "ghost's is a bounce");
    assert_has!(text, "status=discarded", "the spam's discard has a line");
    assert_has!(
        text,
        "sender non-delivery notification: ",
        "the notification's line"
    );

    // pflogsumm counts exactly what the history holds.
    let out = Command::new("pflogsumm")
        .args(["--syslog-name=pepsi", "--smtpd-stats"])
        .arg(&logfile)
        .output();
    let report = match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "pflogsumm: {e}");
            eprintln!("pflogsumm cannot run here ({e}); skipping its count");
            return;
        }
    };
    assert_eq!(
        grand_total(&report, "delivered"),
        delivered as u64,
        "{report}"
    );
    assert_eq!(grand_total(&report, "bounced"), bounced as u64, "{report}");

    // trace by id, by Message-ID and by Postfix's queue id: one and the same message.
    let id: i64 =
        l.c.query_one(
            "SELECT workqueue_id FROM pepsi.history \
              WHERE event = 'delivered' AND recipient = 'alice@local.test' \
                AND message_id = '<traced@ext.test>'",
            &[],
        )
        .unwrap()
        .get(0);
    let by_id = trace(&l.s.conf, &[&id.to_string()]);
    let by_message_id = trace(&l.s.conf, &["--message-id", "traced@ext.test"]);
    let by_remote = trace(&l.s.conf, &["--remote-id", &queue_id]);
    assert_eq!(by_id.len(), 1);
    assert_eq!(by_id, by_message_id, "by Message-ID: the same message");
    assert_eq!(
        by_id, by_remote,
        "by the next hop's queue id: the same message"
    );
    let events: Vec<(String, String)> = by_id[0]["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["to"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert!(
        events.contains(&("split".into(), String::new())),
        "{events:?}"
    );
    assert!(events.contains(&("delivered".into(), "alice@local.test".into())));
    assert!(events.contains(&("bounced".into(), "ghost@local.test".into())));
    assert!(
        events.contains(&("returned".into(), sender.clone())),
        "{events:?}"
    );
    // The split part is found from its own id too.
    let part = by_id[0]["history"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "split")
        .unwrap()["id"]
        .as_i64()
        .unwrap();
    assert_ne!(part, id);
    assert_eq!(trace(&l.s.conf, &[&part.to_string()]), by_id);
    // The text form says the same, for people.
    let out = pepsi_queue(&l.s.conf, &["trace", &id.to_string()]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert_has!(shown, "split from", "the split");
    assert_has!(shown, "delivered <alice@local.test>", "alice");
    assert_has!(
        shown,
        &format!("next hop's queue id: {queue_id}"),
        "Postfix's id"
    );

    // The discarded message shows its discard.
    let spam = trace(&l.s.conf, &["--message-id", "<spam@ext.test>"]);
    assert_eq!(spam.len(), 1);
    let history = spam[0]["history"].as_array().unwrap();
    assert_eq!(history.len(), 1, "{history:?}");
    assert_eq!(history[0]["event"], "discarded");
    assert_eq!(history[0]["stage"], "drop");
}

/// Injects a message with this Message-ID and subject at `stage`; returns its id.
fn inject_with_id(c: &mut postgres::Client, stage: &str, message_id: &str, subject: &str) -> i64 {
    let headers = format!("Subject: {subject}\r\nMessage-ID: {message_id}\r\n");
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, 'a@x.example', ARRAY['b@y.example'], $2::bytea, \
                'x\r\n'::bytea, NULL, NULL, 'a@x.example', $3)",
        &[&stage, &headers.as_bytes(), &subject],
    )
    .unwrap()
    .get(0)
}

#[test]
fn json_lines_parse_and_trace_finds_a_message_still_queued_and_one_gone() {
    let s = Scenario::new("dl-json")
        .pepsi("LOG_FORMAT = json\n")
        .timers("")
        .stages(
            "[stage-in]\nPROGRAM = {pass}\nNEXT = hold\n\n\
             [stage-hold]\nPROGRAM = {if}\nMATCH = subject is wait\nNEXT = parked\nELSE_STAGE = route\n\n\
             [stage-route]\nPROGRAM = {if}\nMATCH = subject is deliver\nNEXT = deliver\nELSE_STAGE = out\n\n\
             [stage-deliver]\nPROGRAM = {exec}\nCOMMAND = /bin/true\n\n\
             [stage-parked]\nPROGRAM = {exec}\nCOMMAND = /bin/false\n\n\
             [stage-out]\nPROGRAM = {discard}\n",
        )
        .build();
    let logfile = s.dir.path("pepsi.json");
    add_to_pepsi(&s.conf, &format!("DELIVERY_LOG = {}\n", logfile.display()));
    let mut c = s.client();
    let gone = inject_with_id(&mut c, "in", "<gone@x.example>", "go");
    let waiting = inject_with_id(&mut c, "in", "<wait@x.example>", "wait");
    let delivered = inject_with_id(&mut c, "in", "<deliver@x.example>", "deliver");
    let d = s.start();
    let lines = log_lines(&logfile, 3);
    let records: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let of = |id: i64| records.iter().find(|r| r["id"] == id).cloned().unwrap();
    let discard = of(gone);
    assert_eq!(discard["event"], "discarded");
    assert_eq!(discard["message_id"], "<gone@x.example>");
    assert_eq!(discard["stage"], "out");
    // A stage that delivers itself is its own relay.
    let sent = of(delivered);
    assert_eq!(
        (
            &sent["event"],
            &sent["status"],
            &sent["relay"],
            &sent["stage"]
        ),
        (
            &"delivered".into(),
            &"sent".into(),
            &"deliver".into(),
            &"deliver".into()
        )
    );
    let deferred = of(waiting);
    assert_eq!(deferred["event"], "deferred");
    assert_eq!(deferred["status"], "deferred");
    assert_eq!(deferred["stage"], "parked");
    // The message gone: its history, with every stage it passed.
    let found = trace(&s.conf, &[&gone.to_string()]);
    assert_eq!(found.len(), 1);
    assert!(found[0]["rows"].as_array().unwrap().is_empty());
    let passed: Vec<&str> = found[0]["history"][0]["trail"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["stage"].as_str().unwrap())
        .collect();
    assert_eq!(
        passed,
        ["in", "hold", "route", "out"],
        "every stage it passed"
    );
    // The message still queued: its row, where it is and how it got there, and its
    // deferral.
    wait_until(Duration::from_secs(30), "the parked row paused", || {
        count(
            &mut c,
            &format!(
                "SELECT count(*) FROM pepsi.workqueue WHERE workqueue_id = {waiting} AND status = 'paused'"
            ),
        ) == 1
    });
    let found = trace(&s.conf, &["--message-id", "<wait@x.example>"]);
    assert_eq!(found.len(), 1);
    let row = &found[0]["rows"][0];
    assert_eq!(
        (row["id"].as_i64(), row["stage"].as_str()),
        (Some(waiting), Some("parked"))
    );
    assert_eq!(row["status"], "paused");
    let passed: Vec<&str> = row["trail"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["stage"].as_str().unwrap())
        .collect();
    assert_eq!(
        passed,
        ["in", "hold", "parked"],
        "the passes, the failed one too"
    );
    assert_eq!(found[0]["history"][0]["event"], "deferred");
    drop(d);
    // Nothing found: exit 65, saying so, escaped.
    let out = pepsi_queue(&s.conf, &["trace", "--remote-id", "NOPE\u{1b}[31m"]);
    assert_eq!(out.status.code(), Some(65));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains('\u{1b}'), "escaped: {err}");
}

#[test]
fn the_history_keeps_its_days_and_drops_those_past_the_retention() {
    let (_s, mut c) = Scenario::new("dl-keep").connect();
    let dropped: i32 = c
        .query_one("SELECT pepsi.history_maintain(7)", &[])
        .unwrap()
        .get(0);
    assert_eq!(dropped, 0);
    let days = count(
        &mut c,
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'pepsi.history'::regclass",
    );
    assert_eq!(
        days, 4,
        "today, the next two days and the default partition"
    );
    // A day long past, made by hand as the upkeep makes them, and an old row that
    // landed in the default partition.
    c.batch_execute(
        "CREATE TABLE pepsi.history_20200101 PARTITION OF pepsi.history \
           FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00'); \
         INSERT INTO pepsi.history (at, workqueue_id, origin, event, stage, mail_from) \
           VALUES ('2020-01-01 12:00+00', 1, 1, 'delivered', 's', ''), \
                  ('2019-06-01 12:00+00', 2, 2, 'delivered', 's', ''), \
                  (now(), 3, 3, 'delivered', 's', '')",
    )
    .unwrap();
    let dropped: i32 = c
        .query_one("SELECT pepsi.history_maintain(7)", &[])
        .unwrap()
        .get(0);
    assert_eq!(dropped, 1, "the day of 2020-01-01");
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.history"),
        1,
        "only today's row is left"
    );
    // A retention it cannot keep is refused, naming it.
    let err = c
        .query_one("SELECT pepsi.history_maintain(0)", &[])
        .unwrap_err();
    let text = err
        .as_db_error()
        .map(|e| e.message().to_string())
        .unwrap_or_default();
    assert!(text.contains("retention 0"), "{err:?}");
}

#[test]
fn trace_shows_hostile_history_values_escaped_and_gives_them_exactly_in_json() {
    let (s, mut c) = Scenario::new("dl-hostile").connect();
    // What a peer's reply, a correspondent's address or a compromised worker's record
    // may hold: line breaks, ESC, NUL-free controls, a right-to-left override, quotes.
    let hostile = "x\r\nForged: line\u{1b}[31m\u{202e}\"q\"";
    c.execute(
        "INSERT INTO pepsi.history (workqueue_id, origin, event, stage, mail_from, recipient, \
                                    message_id, relay, reply, remote_id, dsn, trail) \
         VALUES (7, 7, 'bounced', $1, $1, $1, '<h@x>', $1, $1, 'R7', $1, $2)",
        &[&hostile, &format!("{hostile} 1 2\nbad\n")],
    )
    .unwrap();
    let out = pepsi_queue(&s.conf, &["trace", "7"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for raw in ['\r', '\u{1b}', '\u{202e}'] {
        assert!(!text.contains(raw), "shown raw: {text:?}");
    }
    assert!(!text.contains("\nForged"), "no forged line: {text}");
    assert_has!(text, "x\\r\\nForged: line\\u{1b}[31m\\u{202e}", "escaped");
    let json = trace(&s.conf, &["--remote-id", "R7"]);
    assert_eq!(json[0]["history"][0]["reply"], hostile, "exact in JSON");
    assert_eq!(json[0]["history"][0]["to"], hostile);
}

#[test]
fn the_message_id_is_taken_only_from_a_clean_message_id_field() {
    let (_s, mut c) = Scenario::new("dl-mid").connect();
    let id = |c: &mut postgres::Client, headers: &[u8]| -> Option<String> {
        c.query_one("SELECT pepsi.header_message_id($1)", &[&headers])
            .unwrap()
            .get(0)
    };
    assert_eq!(
        id(&mut c, b"Subject: a\r\nMessage-ID: <a@b>\r\n").as_deref(),
        Some("<a@b>")
    );
    assert_eq!(
        id(&mut c, b"message-id:\r\n  <Folded@Y>\r\n").as_deref(),
        Some("<Folded@Y>")
    );
    assert_eq!(
        id(&mut c, b"X-Message-ID: <no@x>\r\n"),
        None,
        "another field"
    );
    assert_eq!(id(&mut c, b"Message-ID: <a\x1b[31m@b>\r\n"), None, "ESC");
    assert_eq!(
        id(&mut c, b"Message-ID: <a\r\nForged: x@b>\r\n"),
        None,
        "CR/LF"
    );
    assert_eq!(id(&mut c, b"Message-ID: <a\0b@c>\r\n"), None, "NUL");
    assert_eq!(
        id(&mut c, "Message-ID: <a\u{202e}@b>\r\n".as_bytes()),
        None,
        "bidi"
    );
    assert_eq!(
        id(&mut c, b"Message-ID: <\xff\xfe@b>\r\n"),
        None,
        "not UTF-8"
    );
    let long = format!("Message-ID: <{}@b>\r\n", "x".repeat(300));
    assert_eq!(id(&mut c, long.as_bytes()), None, "over 250 characters");
    // A 100 KB header block: the field past the first 64 KiB is not looked for.
    let mut big = format!("X-Pad: {}\r\n", "p".repeat(100_000)).into_bytes();
    big.extend_from_slice(b"Message-ID: <late@b>\r\n");
    assert_eq!(id(&mut c, &big), None);
    let mut early = b"Message-ID: <early@b>\r\n".to_vec();
    early.extend_from_slice(format!("X-Pad: {}\r\n", "p".repeat(100_000)).as_bytes());
    assert_eq!(id(&mut c, &early).as_deref(), Some("<early@b>"));
}

#[test]
fn a_message_to_10000_recipients_leaves_one_record_and_one_line_each() {
    let s = Scenario::new("dl-many")
        .timers("")
        .stages("[stage-out]\nPROGRAM = {discard}\n")
        .build();
    let logfile = s.dir.path("pepsi.log");
    add_to_pepsi(&s.conf, &format!("DELIVERY_LOG = {}\n", logfile.display()));
    let mut c = s.client();
    let rcpts: Vec<String> = (0..10_000).map(|i| format!("r{i}@y.example")).collect();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('out', 'a@x.example', $1, \
                    'Message-ID: <many@x.example>\r\n'::bytea, 'x\r\n'::bytea, NULL, NULL, \
                    'a@x.example', 'many')",
            &[&rcpts],
        )
        .unwrap()
        .get(0);
    let _d = s.start();
    let lines = log_lines(&logfile, 10_000);
    assert_eq!(lines.len(), 10_000, "a line per recipient");
    assert!(
        lines
            .iter()
            .all(|l| l.contains(": to=<r") && l.contains("status=discarded"))
    );
    assert_eq!(
        count(
            &mut c,
            &format!("SELECT count(DISTINCT recipient) FROM pepsi.history WHERE origin = {id}")
        ),
        10_000
    );
}
