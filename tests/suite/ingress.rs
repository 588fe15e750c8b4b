//! `pepsi-ingress` (§16) from the outside: a real daemon on loopback ports or a
//! Unix socket, driven by Python's `smtplib` (an implementation of LMTP and SMTP that is
//! not ours) or by raw bytes where no library would send them, and judged by the rows
//! it leaves at its entry stage `in` (no dispatcher runs, so they stay pending there).
//! What it must do: one row per message whatever the recipients, the envelope, DSN
//! parameters and the bytes of the message stored as sent, pipelined commands answered
//! in order, concurrent sessions committed in groups, 451 and never 250 while the
//! database is away, size limits both ways, garbage and stalled clients survived, no
//! 250 lost to a kill -9, and SMTP with XFORWARD only for trusted clients. The outage
//! with a really stopped PostgreSQL is in `tests/faults.rs`, which owns its cluster.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;
use serde_json::{Value, json};

use super::recovery::linked_connection;
use crate::util::ingress::{
    Ingress, PIPELINE, Raw, data_codes, drain, free_port, python, python_child, queued_id, section,
    send_lmtp, wait_child,
};
use crate::util::rows::{count, queue_len};
use crate::util::scenario::Builder;
use crate::util::{Scenario, assert_has, assert_lacks, wait_until};

const SEC: Duration = Duration::from_secs(1);
/// The longest a client script may run.
const SCRIPT: Duration = Duration::from_secs(120);

/// Opens a scenario whose `[pepsi-ingress]` section is `LISTEN = listen`,
/// `STAGE = in` and `extra`, with the pipeline `in` → `out`, and starts the daemon.
pub(super) fn open(builder: Builder, listen: &str, extra: &str) -> Opening {
    let (s, c) = builder
        .section("pepsi-ingress", &section(listen, extra))
        .stages(PIPELINE)
        .connect();
    let daemon = Ingress::start(&s.conf);
    Opening { daemon, c, _s: s }
}

/// A started ingress test; the daemon stops before its database is dropped.
pub(super) struct Opening {
    pub(super) daemon: Ingress,
    pub(super) c: Client,
    _s: Scenario,
}

/// A listener on a free loopback port: its `LISTEN` entry (`PROTOCOL:127.0.0.1:PORT`)
/// and the client's target (`127.0.0.1:PORT`).
pub(super) fn tcp(protocol: &str) -> (String, String) {
    let target = format!("127.0.0.1:{}", free_port());
    (format!("{protocol}:{target}"), target)
}

/// A row as the tests look at it.
#[derive(Debug)]
struct Row {
    id: i64,
    stage: String,
    status: String,
    mail_from: String,
    rcpt_to: Vec<String>,
    headers: Vec<u8>,
    body: Vec<u8>,
    client_ip: Option<String>,
    auth_user: Option<String>,
    subject: Option<String>,
    state: Value,
}

/// Every row of the queue, oldest first, with its body.
fn rows(c: &mut Client) -> Vec<Row> {
    c.query(
        "SELECT w.workqueue_id, w.stage, w.status::text, w.mail_from, w.rcpt_to, \
                coalesce(w.headers, ''::bytea), coalesce(b.body, ''::bytea), host(w.client_ip), \
                w.auth_user, w.subject, w.state::text \
           FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id) \
          ORDER BY w.workqueue_id",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| Row {
        id: r.get(0),
        stage: r.get(1),
        status: r.get(2),
        mail_from: r.get(3),
        rcpt_to: r.get(4),
        headers: r.get(5),
        body: r.get(6),
        client_ip: r.get(7),
        auth_user: r.get(8),
        subject: r.get(9),
        state: serde_json::from_str(r.get::<_, &str>(10)).unwrap(),
    })
    .collect()
}

/// A reply's `[code, text]` as the client scripts give it.
fn reply(v: &Value) -> (u64, &str) {
    (v[0].as_u64().unwrap(), v[1].as_str().unwrap())
}

/// The ids in the replies after a transaction's data, which must all be 250.
#[track_caller]
fn queued_ids(transaction: &Value) -> Vec<i64> {
    transaction["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let (code, text) = reply(r);
            assert_eq!(code, 250, "{transaction}");
            queued_id(text).unwrap_or_else(|| panic!("no id in {text:?}"))
        })
        .collect()
}

/// The bytes in hexadecimal, as the client scripts take a message on their command
/// line.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn an_lmtp_message_for_three_recipients_is_one_row_with_one_body_and_three_250_replies() {
    let builder = Scenario::new("i-three");
    let path = builder.dir().path("lmtp.sock");
    let mut t = open(builder, &format!("unix:{}", path.display()), "");
    let sock = path.to_str().unwrap();
    let out = python(
        r#"
l = lmtp(sys.argv[1])
msg = b"From: a@x.example\r\nSubject: three\r\n\r\nHello.\r\n"
out = transaction(l, "a@x.example", ["r1@y.example", "r2@y.example", "r3@z.example"], msg)
l.quit()
print(json.dumps(out))
"#,
        &[sock],
        SCRIPT,
    );
    assert_eq!(reply(&out["mail"]).0, 250, "{out}");
    assert_eq!(
        data_codes(&out),
        [250, 250, 250],
        "one reply per recipient: {out}"
    );
    let ids = queued_ids(&out);
    assert!(ids.iter().all(|&id| id == ids[0]), "{out}");
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0];
    assert_eq!(row.id, ids[0]);
    assert_eq!((row.stage.as_str(), row.status.as_str()), ("in", "pending"));
    assert_eq!(row.mail_from, "a@x.example");
    assert_eq!(
        row.rcpt_to,
        ["r1@y.example", "r2@y.example", "r3@z.example"]
    );
    assert_eq!(row.body, b"Hello.\r\n");
    assert_eq!(row.client_ip, None, "a Unix socket's client has no address");
    assert_eq!(
        count(&mut t.c, "SELECT count(*) FROM pepsi.workqueue_body"),
        1,
        "one body, not one per recipient"
    );
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn the_null_sender_stays_the_null_sender() {
    let (listen, target) = tcp("lmtp");
    let mut t = open(Scenario::new("i-null"), &listen, "");
    let out = python(
        r#"
l = lmtp(sys.argv[1])
msg = b"From: MAILER-DAEMON@x.example\r\nSubject: bounce\r\n\r\nA bounce.\r\n"
out = transaction(l, "", ["r@y.example"], msg)
l.quit()
print(json.dumps(out))
"#,
        &[&target],
        SCRIPT,
    );
    assert_eq!(
        reply(&out["mail"]).0,
        250,
        "MAIL FROM:<> is accepted: {out}"
    );
    let id = queued_ids(&out)[0];
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].id, id);
    assert_eq!(rows[0].mail_from, "", "stored as the null sender");
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn dsn_parameters_land_in_state_dsn_exactly_as_the_bounce_stage_reads_them() {
    let (listen, target) = tcp("lmtp");
    let mut t = open(Scenario::new("i-dsn"), &listen, "");
    let out = python(
        r#"
l = lmtp(sys.argv[1])
msg = b"From: a@x.example\r\nSubject: dsn\r\n\r\nBody.\r\n"
out = transaction(l, "a@x.example", ["r@y.example", "plain@y.example"], msg,
                  ["RET=HDRS", "ENVID=E1"], [["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;x@y"]])
l.quit()
print(json.dumps(out))
"#,
        &[&target],
        SCRIPT,
    );
    assert_eq!(data_codes(&out), [250, 250], "{out}");
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1);
    // The recipient without parameters has no entry.
    assert_eq!(
        rows[0].state["dsn"],
        json!({"ret": "HDRS", "envid": "E1",
               "rcpt": {"r@y.example": {"notify": "SUCCESS,FAILURE", "orcpt": "rfc822;x@y"}}}),
        "{}",
        rows[0].state
    );
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn an_8bit_message_and_an_smtputf8_message_are_stored_byte_for_byte_as_sent() {
    let (listen, target) = tcp("lmtp");
    let mut t = open(Scenario::new("i-8bit"), &listen, "");
    // Octets beyond ASCII in the header block and the body, not all of them UTF-8, and
    // body lines a client must dot-stuff (one of them a lone dot).
    let headers_8bit: &[u8] = b"From: Ren\xc3\xa9 <a@x.example>\r\nSubject: caf\xc3\xa9 8bit\r\n\
                                X-Latin1: \xe9t\xe9 \xff\x80\r\n";
    let body_8bit: &[u8] = b"Line one \xe2\x82\xac \xfe\xff\x80\r\n.leading dot\r\n..two dots\r\n\
                             .\r\n.\xc3\xa9\r\n\r\n  indented\r\nlast\r\n";
    let headers_utf8 = "From: Jörg <jörg@bücher.example>\r\nTo: δοκιμή@παράδειγμα.example\r\n\
                        Subject: Grüße aus Köln\r\n"
        .as_bytes();
    let body_utf8 = "Grüße.\r\n.Punkt am Anfang\r\n".as_bytes();
    let message = |h: &[u8], b: &[u8]| hex(&[h, b"\r\n", b].concat());
    let out = python(
        r#"
l = lmtp(sys.argv[1])
out = {}
out["8bit"] = transaction(l, "a@x.example", ["r@y.example"], bytes.fromhex(sys.argv[2]),
                          ["BODY=8BITMIME"])
out["utf8"] = transaction(l, "jörg@bücher.example", ["δοκιμή@παράδειγμα.example"],
                          bytes.fromhex(sys.argv[3]), ["SMTPUTF8", "BODY=8BITMIME"])
l.quit()
print(json.dumps(out))
"#,
        &[
            &target,
            &message(headers_8bit, body_8bit),
            &message(headers_utf8, body_utf8),
        ],
        SCRIPT,
    );
    let id_8bit = queued_ids(&out["8bit"])[0];
    let id_utf8 = queued_ids(&out["utf8"])[0];
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 2);
    let (r8, ru) = (&rows[0], &rows[1]);
    assert_eq!((r8.id, ru.id), (id_8bit, id_utf8));
    assert_eq!(
        r8.headers,
        headers_8bit,
        "{:?}",
        String::from_utf8_lossy(&r8.headers)
    );
    assert_eq!(
        r8.body,
        body_8bit,
        "dot-stuffing undone, octets kept: {:?}",
        String::from_utf8_lossy(&r8.body)
    );
    assert_eq!(ru.mail_from, "jörg@bücher.example");
    assert_eq!(ru.rcpt_to, ["δοκιμή@παράδειγμα.example"]);
    assert_eq!(ru.headers, headers_utf8);
    assert_eq!(ru.body, body_utf8);
    assert_eq!(ru.subject.as_deref(), Some("Grüße aus Köln"));
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn twenty_pipelined_commands_in_one_write_are_answered_in_order_and_the_message_queued() {
    let port = free_port();
    let mut t = open(
        Scenario::new("i-pipe"),
        &format!("lmtp:127.0.0.1:{port}"),
        "",
    );
    let mut raw = Raw::connect(port, 30 * SEC);
    // LHLO, MAIL, 17 RCPT (the ninth refused, so that the order shows) and DATA.
    let rcpts: Vec<String> = (0..17)
        .map(|i| {
            if i == 8 {
                "not an address".to_string()
            } else {
                format!("r{i}@y.example")
            }
        })
        .collect();
    let mut burst = String::from("LHLO client.example\r\nMAIL FROM:<a@x.example>\r\n");
    for r in &rcpts {
        burst.push_str(&format!("RCPT TO:<{r}>\r\n"));
    }
    burst.push_str("DATA\r\n");
    assert_eq!(burst.matches("\r\n").count(), 20);
    raw.send(burst.as_bytes());
    let (code, lhlo) = raw.reply();
    assert_eq!(code, 250);
    assert!(lhlo.lines().any(|l| l == "PIPELINING"), "{lhlo}");
    assert_eq!(raw.reply().0, 250, "MAIL");
    let codes: Vec<u16> = (0..17).map(|_| raw.reply().0).collect();
    let mut want = vec![250u16; 17];
    want[8] = 553;
    assert_eq!(codes, want, "the RCPT replies, in order");
    assert_eq!(raw.reply().0, 354, "DATA");
    raw.send(b"From: a@x.example\r\nSubject: pipelined\r\n\r\nBody.\r\n.\r\n");
    let ids: Vec<i64> = (0..16)
        .map(|_| {
            let (code, text) = raw.reply();
            assert_eq!(code, 250, "{text}");
            queued_id(&text).unwrap()
        })
        .collect();
    assert_eq!(raw.command("QUIT").0, 221);
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1);
    assert!(ids.iter().all(|&id| id == rows[0].id), "{ids:?}");
    let accepted: Vec<&String> = rcpts
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 8)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(rows[0].rcpt_to.iter().collect::<Vec<_>>(), accepted);
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn fifty_concurrent_clients_of_twenty_messages_each_get_1000_rows_in_fewer_than_1000_commits() {
    let (listen, target) = tcp("lmtp");
    let mut t = open(Scenario::new("i-burst"), &listen, "");
    let out = python(
        r#"
import threading

target = sys.argv[1]
clients, each = 50, 20
codes = [[] for _ in range(clients)]
errors = []


def client(n):
    try:
        l = lmtp(target, timeout=60)
        for i in range(each):
            msg = ("From: c%d@x.example\r\nSubject: %d/%d\r\n\r\nBody.\r\n" % (n, n, i)).encode()
            t = transaction(l, "c%d@x.example" % n, ["r@y.example"], msg)
            codes[n].append(t["data"][0][0] if t["data"] else t["mail"][0])
        l.quit()
    except Exception as e:
        errors.append(repr(e))


threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
for th in threads:
    th.start()
for th in threads:
    th.join()
print(json.dumps({"codes": codes, "errors": errors}))
"#,
        &[&target],
        SCRIPT,
    );
    assert_eq!(out["errors"], json!([]), "{out}");
    let codes = out["codes"].as_array().unwrap();
    assert_eq!(codes.len(), 50);
    for (n, client) in codes.iter().enumerate() {
        assert_eq!(client, &json!(vec![250; 20]), "client {n}: {client}");
    }
    assert_eq!(
        count(
            &mut t.c,
            "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'in' AND status = 'pending'"
        ),
        1000
    );
    // The counters are written at shutdown.
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
    let stats = t
        .c
        .query_one(
            "SELECT sessions, accepted, recipients, deferred, refused, commits FROM pepsi.ingress_stats",
            &[],
        )
        .unwrap();
    let get = |i: usize| stats.get::<_, i64>(i);
    assert_eq!(
        (get(0), get(1), get(2), get(3), get(4)),
        (50, 1000, 1000, 0, 0)
    );
    let commits = get(5);
    println!("group commit: 1000 messages of 50 concurrent sessions in {commits} commits");
    assert!(
        (1..1000).contains(&commits),
        "{commits} commits for 1000 messages: no group commit"
    );
}

#[test]
fn with_the_database_away_a_message_gets_451_and_once_it_is_back_250() {
    let (listen, target) = tcp("lmtp");
    let builder = Scenario::new("i-away");
    let (s, mut c) = builder
        .section("pepsi-ingress", &section(&listen, ""))
        .stages(PIPELINE)
        .connect();
    // The database goes away for the daemon alone (its socket is a link we take away),
    // not for the tests beside it; tests/faults.rs stops a cluster of its own.
    let Some((socket, link, conninfo)) = linked_connection(&s.db, &s.dir) else {
        eprintln!("note: the test server is not reached by a socket; skipping");
        return;
    };
    std::os::unix::fs::symlink(&socket, &link).unwrap();
    let text = std::fs::read_to_string(&s.conf).unwrap().replace(
        &format!("CONNECTION = {}", s.db.conninfo),
        &format!("CONNECTION = {conninfo}"),
    );
    std::fs::write(&s.conf, text).unwrap();
    let mut daemon = Ingress::start(&s.conf);
    assert_eq!(data_codes(&send_lmtp(&target, &["r@y.example"])), [250]);

    std::fs::remove_file(&link).unwrap();
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
        &[],
    )
    .unwrap();
    let away = send_lmtp(&target, &["r1@y.example", "r2@y.example"]);
    assert_eq!(data_codes(&away), [451, 451], "{away}");
    for r in away["data"].as_array().unwrap() {
        assert!(reply(r).1.starts_with("4.3.0 "), "{away}");
    }
    assert_eq!(queue_len(&mut c), 1, "nothing stored while it is away");
    assert!(daemon.try_wait().is_none(), "it exited:\n{}", daemon.log());

    std::os::unix::fs::symlink(&socket, &link).unwrap();
    let back = Instant::now();
    let mut tries = 0;
    wait_until(15 * SEC, "a message is accepted again", || {
        tries += 1;
        data_codes(&send_lmtp(&target, &["r@y.example"])) == [250]
    });
    println!(
        "ingress: accepting again {:?} after the database came back ({tries} tries)",
        back.elapsed()
    );
    assert_eq!(queue_len(&mut c), 2, "the deferred messages left no row");
    assert!(daemon.terminate().success(), "{}", daemon.log());
    let log = daemon.log();
    assert!(log.contains("deferring mail (451)"), "{log}");
    assert!(log.contains("the database is back"), "{log}");
}

#[test]
fn a_size_over_the_limit_is_refused_at_mail_and_at_the_end_of_the_data_and_the_session_goes_on() {
    let (listen, target) = tcp("lmtp");
    let limit = 10_000;
    let mut t = open(
        Scenario::new("i-size"),
        &listen,
        &format!("MAX_MESSAGE_SIZE = {limit}\n"),
    );
    let out = python(
        r#"
l = lmtp(sys.argv[1])
limit = int(sys.argv[2])
out = {"ehlo_size": l.esmtp_features.get("size")}
out["size"] = text(l.mail("a@x.example", ["SIZE=%d" % (limit + 1)]))
big = b"From: a@x.example\r\nSubject: big\r\n\r\n" + (b"x" * 70 + b"\r\n") * (limit // 72 + 10)
out["big"] = transaction(l, "a@x.example", ["r1@y.example", "r2@y.example"], big)
small = b"From: a@x.example\r\nSubject: small\r\n\r\nSmall.\r\n"
out["small"] = transaction(l, "a@x.example", ["r@y.example"], small, ["SIZE=%d" % len(small)])
l.quit()
print(json.dumps(out))
"#,
        &[&target, &limit.to_string()],
        SCRIPT,
    );
    assert_eq!(out["ehlo_size"], json!(limit.to_string()), "{out}");
    let (code, text) = reply(&out["size"]);
    assert_eq!(code, 552, "{out}");
    assert!(text.starts_with("5.3.4 "), "{out}");
    assert_eq!(reply(&out["big"]["mail"]).0, 250, "no SIZE=: {out}");
    assert_eq!(data_codes(&out["big"]), [552, 552], "{out}");
    for r in out["big"]["data"].as_array().unwrap() {
        assert!(reply(r).1.starts_with("5.3.4 "), "{out}");
    }
    let id = queued_ids(&out["small"])[0];
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1, "only the small one: {rows:?}");
    assert_eq!(rows[0].id, id);
    assert_eq!(rows[0].subject.as_deref(), Some("small"));
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn a_garbage_command_and_a_100_kb_line_get_500_and_the_session_still_works() {
    let port = free_port();
    let mut t = open(
        Scenario::new("i-garbage"),
        &format!("lmtp:127.0.0.1:{port}"),
        "",
    );
    let mut raw = Raw::connect(port, 30 * SEC);
    assert_eq!(raw.command("LHLO client.example").0, 250);
    raw.send(b"\x00\x01\xff\xfe\x80\x1b[31m\x7f garbage\r\n");
    let (code, text) = raw.reply();
    assert_eq!(code, 500, "{text}");
    raw.send(&[vec![b'X'; 100 * 1024], b"\r\n".to_vec()].concat());
    let (code, text) = raw.reply();
    assert_eq!((code, &text[..5]), (500, "5.5.2"), "{text}");
    assert_eq!(raw.command("NOOP").0, 250);
    assert_eq!(raw.command("MAIL FROM:<a@x.example>").0, 250);
    assert_eq!(raw.command("RCPT TO:<r@y.example>").0, 250);
    assert_eq!(raw.command("DATA").0, 354);
    raw.send(b"From: a@x.example\r\nSubject: after garbage\r\n\r\nStill works.\r\n.\r\n");
    let (code, text) = raw.reply();
    assert_eq!(code, 250, "{text}");
    assert_eq!(raw.command("QUIT").0, 221);
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1);
    assert_eq!(Some(rows[0].id), queued_id(&text));
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn a_client_that_stops_mid_data_gets_421_after_the_timeout_while_another_is_served() {
    let port = free_port();
    // Long enough that the other client is served before it ends, however busy the
    // machine: that it is served meanwhile is what is checked.
    let timeout = 8 * SEC;
    let mut t = open(
        Scenario::new("i-stall"),
        &format!("lmtp:127.0.0.1:{port}"),
        &format!("TIMEOUT = {}s\n", timeout.as_secs()),
    );
    let mut stuck = Raw::connect(port, 30 * SEC);
    assert_eq!(stuck.command("LHLO stuck.example").0, 250);
    assert_eq!(stuck.command("MAIL FROM:<a@x.example>").0, 250);
    assert_eq!(stuck.command("RCPT TO:<r@y.example>").0, 250);
    assert_eq!(stuck.command("DATA").0, 354);
    stuck.send(b"From: a@x.example\r\nSubject: stuck\r\n\r\nHalf a mess");
    let stalled = Instant::now();

    // Another client meanwhile, served as usual.
    let mut other = Raw::connect(port, 30 * SEC);
    assert_eq!(other.command("LHLO other.example").0, 250);
    assert_eq!(other.command("MAIL FROM:<b@x.example>").0, 250);
    assert_eq!(other.command("RCPT TO:<r@y.example>").0, 250);
    assert_eq!(other.command("DATA").0, 354);
    other.send(b"From: b@x.example\r\nSubject: other\r\n\r\nServed.\r\n.\r\n");
    let (code, text) = other.reply();
    assert_eq!(code, 250, "{text}");
    assert_lacks!(
        t.daemon.log(),
        "timed out",
        "served while the stalled session waited ({:?} in)",
        stalled.elapsed()
    );
    assert_eq!(other.command("QUIT").0, 221);

    let (code, text) = stuck
        .try_reply()
        .unwrap_or_else(|e| panic!("no reply to the stalled client: {e}"));
    let waited = stalled.elapsed();
    assert_eq!((code, &text[..5]), (421, "4.4.2"), "{text}");
    // Not before the timeout (less what the data took to send); after it, with a
    // margin of several seconds for a busy machine.
    assert!(
        waited >= timeout - SEC && waited < timeout + 10 * SEC,
        "421 after {waited:?}, TIMEOUT is {timeout:?}"
    );
    assert!(stuck.closed(), "the connection is closed after the 421");
    let rows = rows(&mut t.c);
    assert_eq!(rows.len(), 1, "nothing of the stalled message: {rows:?}");
    assert_eq!(rows[0].subject.as_deref(), Some("other"));
    t.daemon.wait_log("timed out", 5 * SEC);
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}

#[test]
fn a_shutdown_tells_a_waiting_client_and_one_in_mid_data_421_and_stores_nothing_half_sent() {
    let port = free_port();
    let mut t = open(
        Scenario::new("i-stop"),
        &format!("lmtp:127.0.0.1:{port}"),
        "",
    );
    let mut idle = Raw::connect(port, 30 * SEC);
    assert_eq!(idle.command("LHLO idle.example").0, 250);
    let mut half = Raw::connect(port, 30 * SEC);
    assert_eq!(half.command("LHLO half.example").0, 250);
    assert_eq!(half.command("MAIL FROM:<a@x.example>").0, 250);
    assert_eq!(half.command("RCPT TO:<r@y.example>").0, 250);
    assert_eq!(half.command("DATA").0, 354);
    half.send(b"From: a@x.example\r\nSubject: half\r\n\r\nHalf a mess");

    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
    for (who, client) in [("idle", &mut idle), ("mid-data", &mut half)] {
        let (code, text) = client
            .try_reply()
            .unwrap_or_else(|e| panic!("no reply to the {who} client at shutdown: {e}"));
        assert_eq!((code, &text[..5]), (421, "4.3.2"), "{who}: {text}");
        assert!(client.closed(), "{who}: closed after the 421");
    }
    assert!(
        rows(&mut t.c).is_empty(),
        "nothing of the half-sent message"
    );
}

#[test]
fn a_kill_9_during_a_burst_loses_no_message_that_was_answered_250() {
    let (listen, target) = tcp("lmtp");
    let mut t = open(Scenario::new("i-kill"), &listen, "");
    const CLIENTS: usize = 8;
    let mut py = python_child(
        r#"
import threading

target, clients = sys.argv[1], int(sys.argv[2])
lock = threading.Lock()


def say(line):
    with lock:
        print(line, flush=True)


def client(n):
    try:
        l = lmtp(target, timeout=30)
        i = 0
        while True:
            msg = ("From: c%d@x.example\r\nSubject: %d/%d\r\n\r\nBody.\r\n" % (n, n, i)).encode()
            t = transaction(l, "c%d@x.example" % n, ["r@y.example"], msg)
            code, reply = t["data"][0] if t["data"] else t["mail"]
            say(("queued %s" if code == 250 else "reply %s") % reply)
            i += 1
    except Exception as e:
        say("ended %r" % (e,))


threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
for th in threads:
    th.start()
for th in threads:
    th.join()
say("done")
"#,
        &[&target, &CLIENTS.to_string()],
    );
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = lines.clone();
    let stdout = py.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            sink.lock().unwrap().push(line);
        }
    });
    let stderr = drain(py.stderr.take().unwrap());
    let queued = |lines: &Mutex<Vec<String>>| {
        lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("queued "))
            .count()
    };
    wait_until(60 * SEC, "200 messages are answered 250", || {
        queued(&lines) >= 200
    });
    t.daemon.signal(libc::SIGKILL);
    t.daemon.wait(10 * SEC);
    let status = wait_child(&mut py, 60 * SEC, "the clients after the kill");
    reader.join().unwrap();
    let lines = lines.lock().unwrap().clone();
    assert!(status.success(), "{lines:?}\n{}", stderr.join().unwrap());
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("reply "))
            .collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "nothing but 250 before the kill"
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("ended ")).count(),
        CLIENTS,
        "every client saw its connection end: {lines:?}"
    );
    let ids: Vec<i64> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("queued "))
        .map(|r| queued_id(r).unwrap_or_else(|| panic!("no id in {r:?}")))
        .collect();
    let answered: HashSet<i64> = ids.iter().copied().collect();
    assert_eq!(answered.len(), ids.len(), "an id answered twice");
    let stored: HashSet<i64> =
        t.c.query("SELECT workqueue_id FROM pepsi.workqueue", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
    let lost: Vec<&i64> = answered.difference(&stored).collect();
    assert!(lost.is_empty(), "answered 250 but not stored: {lost:?}");
    // Beyond the 250s, at most the message each client had in flight: committed, its
    // answer killed on the way.
    assert!(
        stored.len() <= answered.len() + CLIENTS,
        "{} rows for {} answers of {CLIENTS} clients",
        stored.len(),
        answered.len()
    );
    println!(
        "kill -9: {} answered 250, {} stored",
        answered.len(),
        stored.len()
    );
}

#[test]
fn smtp_offers_its_extensions_and_xforward_only_to_a_trusted_client() {
    let (listen, target) = tcp("smtp");
    let mut t = open(
        Scenario::new("i-smtp"),
        &listen,
        "XFORWARD_FROM = 127.0.0.1\n",
    );
    let script = r#"
s = smtp(sys.argv[1], source_address=(sys.argv[2], 0))
out = {"features": sorted(s.esmtp_features)}
out["xforward"] = text(s.docmd("XFORWARD", "ADDR=192.0.2.7 LOGIN=alice NAME=mx.example"))
msg = ("From: a@x.example\r\nSubject: first from %s\r\n\r\nBody.\r\n" % sys.argv[2]).encode()
out["first"] = transaction(s, "a@x.example", ["r@y.example"], msg)
# Two recipients, one reply after the data: sendmail reads one, and NOOP gets its own.
msg = ("From: a@x.example\r\nSubject: second from %s\r\n\r\nBody.\r\n" % sys.argv[2]).encode()
out["sendmail"] = s.sendmail("a@x.example", ["r1@y.example", "r2@y.example"], msg)
out["noop"] = text(s.noop())
s.quit()
print(json.dumps(out))
"#;
    let trusted = python(script, &[&target, "127.0.0.1"], SCRIPT);
    let untrusted = python(script, &[&target, "127.0.0.2"], SCRIPT);
    for out in [&trusted, &untrusted] {
        let features: Vec<&str> = out["features"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        for ext in [
            "pipelining",
            "size",
            "8bitmime",
            "smtputf8",
            "enhancedstatuscodes",
            "dsn",
        ] {
            assert!(features.contains(&ext), "{ext} is not offered: {out}");
        }
        assert_eq!(data_codes(&out["first"]), [250], "{out}");
        assert_eq!(out["sendmail"], json!({}), "{out}");
        assert_eq!(
            reply(&out["noop"]),
            (250, "2.0.0 Ok"),
            "one reply after the data: {out}"
        );
    }
    assert_has!(
        trusted["features"].as_array().unwrap(),
        &json!("xforward"),
        "{trusted}"
    );
    assert_eq!(reply(&trusted["xforward"]).0, 250, "{trusted}");
    assert_lacks!(
        untrusted["features"].as_array().unwrap(),
        &json!("xforward"),
        "{untrusted}"
    );
    let (code, text) = reply(&untrusted["xforward"]);
    assert_eq!((code, &text[..5]), (550, "5.7.0"), "{untrusted}");

    let rows = rows(&mut t.c);
    let seen: Vec<(&str, Option<&str>, Option<&str>, usize)> = rows
        .iter()
        .map(|r| {
            (
                r.subject.as_deref().unwrap(),
                r.client_ip.as_deref(),
                r.auth_user.as_deref(),
                r.rcpt_to.len(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            // XFORWARD honoured, for its transaction only.
            ("first from 127.0.0.1", Some("192.0.2.7"), Some("alice"), 1),
            ("second from 127.0.0.1", Some("127.0.0.1"), None, 2),
            // Refused: the real client stays.
            ("first from 127.0.0.2", Some("127.0.0.2"), None, 1),
            ("second from 127.0.0.2", Some("127.0.0.2"), None, 2),
        ]
    );
    assert!(t.daemon.terminate().success(), "{}", t.daemon.log());
}
