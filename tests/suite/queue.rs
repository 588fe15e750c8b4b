//! `pepsi-queue` against a real database (SPEC §14): every command and its error
//! paths, `--json` read back with serde_json, one NOTIFY per repair command counted by a
//! LISTEN session, held rows left alone by a running dispatcher, the metrics read by
//! `promtool`, and schema 006 itself (the upgrade, a comment on every object).

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use postgres::Client;
use serde_json::Value;

use super::dispatch::conf;
use crate::util::dispatcher::Dispatcher;
use crate::util::{
    TempDir, TestDb, bin, claim, inject, row_at, run, stage, stage_dir, state_of, stderr,
    wait_until, write_config,
};

const STAGES: &str = "[stage-in]\nPROGRAM = /bin/true\nNEXT = relay\n\n\
                      [stage-relay]\nPROGRAM = /bin/true\n";

/// A configuration with the stages `in` → `relay` (programs that are never run).
fn config(dir: &TempDir, db: &TestDb) -> PathBuf {
    write_config(dir, db, STAGES)
}

/// `pepsi-queue -c conf ARGS`, with `input` on its standard input.
fn queue_in(conf: &Path, args: &[OsString], input: &[u8]) -> Output {
    let mut child = Command::new(bin("pepsi-queue"))
        .arg("-c")
        .arg(conf)
        .args(args)
        .env_remove("PEPSI_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pepsi-queue");
    let mut stdin = child.stdin.take().unwrap();
    // A command that does not read its input may have exited already.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().unwrap()
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// `pepsi-queue -c conf ARGS` with empty input.
fn queue(conf: &Path, args: &[&str]) -> Output {
    queue_in(conf, &os(args), b"")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn both(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        stdout(out),
        stderr(out)
    )
}

/// Asserts the exit status.
#[track_caller]
fn expect(out: &Output, code: i32) {
    assert_eq!(out.status.code(), Some(code), "{}", both(out));
}

/// Stdout as one JSON document.
#[track_caller]
fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}):\n{}", both(out)))
}

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// A LISTEN session on `workqueue` and `config_changed`, plus a sentinel.
fn listener(db: &TestDb) -> Client {
    let mut l = db.client();
    l.batch_execute("LISTEN workqueue; LISTEN config_changed; LISTEN sentinel")
        .unwrap();
    l
}

/// The notifications that arrived since the last call, by channel: `writer` sends the
/// sentinel after the command has exited, and notifications arrive in commit order.
fn notified(l: &mut Client, writer: &mut Client) -> Vec<String> {
    use postgres::fallible_iterator::FallibleIterator;
    writer.batch_execute("NOTIFY sentinel").unwrap();
    let mut seen = Vec::new();
    let mut n = l.notifications();
    let mut it = n.timeout_iter(Duration::from_secs(10));
    while let Some(note) = it.next().unwrap() {
        if note.channel() == "sentinel" {
            return seen;
        }
        seen.push(note.channel().to_string());
    }
    panic!("the sentinel never arrived; saw {seen:?}");
}

/// Sets a row's status (and a paused row's retry time) directly.
fn set_status(c: &mut Client, id: i64, status: &str) {
    c.execute(
        "UPDATE pepsi.workqueue SET status = $2::text::pepsi.workqueue_status, \
         timeout = CASE WHEN $2 = 'paused' THEN now() + interval '1 hour' END \
         WHERE workqueue_id = $1",
        &[&id, &status],
    )
    .unwrap();
}

#[test]
fn every_public_schema_object_has_a_comment() {
    let db = TestDb::new();
    let mut c = db.client();
    let missing: Vec<String> = c
        .query(
            "SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc p \
              WHERE p.pronamespace = 'pepsi'::regnamespace \
                AND obj_description(p.oid, 'pg_proc') IS NULL \
             UNION ALL \
             SELECT 'relation ' || c.oid::regclass::text FROM pg_class c \
              WHERE c.relnamespace = 'pepsi'::regnamespace \
                AND obj_description(c.oid, 'pg_class') IS NULL \
             UNION ALL \
             SELECT 'column ' || c.oid::regclass::text || '.' || a.attname \
               FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND c.relkind IN ('r', 'v', 'm', 'p') \
                AND a.attnum > 0 AND NOT a.attisdropped \
                AND col_description(c.oid, a.attnum) IS NULL \
             UNION ALL \
             SELECT 'type ' || t.oid::regtype::text FROM pg_type t \
              WHERE t.typnamespace = 'pepsi'::regnamespace AND t.typrelid = 0 \
                AND t.typcategory <> 'A' AND obj_description(t.oid, 'pg_type') IS NULL \
             UNION ALL \
             SELECT 'trigger ' || tg.tgname FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND NOT tg.tgisinternal \
                AND obj_description(tg.oid, 'pg_trigger') IS NULL \
             UNION ALL \
             SELECT 'schema pepsi' WHERE obj_description('pepsi'::regnamespace, 'pg_namespace') IS NULL",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(missing.is_empty(), "without a COMMENT: {missing:#?}");
    // The check looks where it should: there are functions, tables, columns and
    // indexes, and their comments are there.
    assert!(
        count(
            &mut c,
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pepsi'::regnamespace"
        ) >= 20
    );
    let comment: String = c
        .query_one(
            "SELECT col_description('pepsi.workqueue'::regclass, \
               (SELECT attnum FROM pg_attribute WHERE attrelid = 'pepsi.workqueue'::regclass \
                 AND attname = 'state'))",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(comment.contains("local_origin"), "{comment}");
}

#[test]
fn upgrading_from_schema_5_adds_held_and_the_repair_functions() {
    let db = TestDb::empty();
    let dir = TempDir::new("q-upgrade");
    let mut c = db.client();
    crate::util::install_schema_upto(&mut c, 5);
    let a = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    let b = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    set_status(&mut c, b, "failed");
    let conf = config(&dir, &db);
    crate::util::upgrade_with_setup(&mut c, &conf);
    // The new value and the functions that use it work once the upgrade committed.
    let out = queue(&conf, &["hold", &a.to_string(), &b.to_string()]);
    expect(&out, 0);
    assert_eq!(row_at(&mut c, a).unwrap().1, "held");
    assert_eq!(row_at(&mut c, b).unwrap().1, "held");
    assert_eq!(state_of(&mut c, b)["held_from"], "failed");
    expect(&queue(&conf, &["release", &b.to_string()]), 0);
    assert_eq!(row_at(&mut c, b).unwrap().1, "pending");
    assert_eq!(
        state_of(&mut c, b),
        serde_json::json!({}),
        "the hold's keys are gone"
    );
}

#[test]
fn inject_reads_a_file_splits_the_header_block_and_notifies_once() {
    let db = TestDb::new();
    let dir = TempDir::new("q-inject");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let mut l = listener(&db);
    let file = dir.path("msg.eml");
    std::fs::write(
        &file,
        b"From: =?UTF-8?Q?J=C3=B6rg?= <joerg@x.example>\r\n\
          Subject: =?UTF-8?B?R3LDvMOfZQ==?= from\r\n Bern\r\n\
          To: r@y.example\r\n\r\nHello.\r\n\r\nBye.\r\n",
    )
    .unwrap();
    let out = queue(
        &conf,
        &[
            "inject",
            "--stage",
            "in",
            "--from",
            "<joerg@x.example>",
            "--to",
            "r@y.example",
            "--to=s@y.example",
            "--client-ip",
            "2001:db8::7",
            file.to_str().unwrap(),
        ],
    );
    expect(&out, 0);
    let id: i64 = stdout(&out).trim().parse().expect("the new id on stdout");
    assert_eq!(notified(&mut l, &mut c), ["workqueue"], "one NOTIFY");
    let r = c
        .query_one(
            "SELECT stage, status::text, mail_from, rcpt_to, header_from, subject, headers, \
                    b.body, state::text, sender_key, auth_user \
               FROM pepsi.workqueue q JOIN pepsi.workqueue_body b USING (body_id) \
              WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "in");
    assert_eq!(r.get::<_, String>(1), "pending");
    assert_eq!(r.get::<_, String>(2), "joerg@x.example");
    assert_eq!(r.get::<_, Vec<String>>(3), ["r@y.example", "s@y.example"]);
    assert_eq!(r.get::<_, String>(4), "joerg@x.example");
    assert_eq!(r.get::<_, String>(5), "Grüße from Bern");
    assert_eq!(
        r.get::<_, Vec<u8>>(6),
        b"From: =?UTF-8?Q?J=C3=B6rg?= <joerg@x.example>\r\n\
          Subject: =?UTF-8?B?R3LDvMOfZQ==?= from\r\n Bern\r\nTo: r@y.example\r\n"
    );
    assert_eq!(r.get::<_, Vec<u8>>(7), b"Hello.\r\n\r\nBye.\r\n");
    assert_eq!(r.get::<_, String>(8), "{}");
    assert_eq!(r.get::<_, String>(9), "ip:2001:db8::/64");
    assert_eq!(r.get::<_, Option<String>>(10), None);
}

#[test]
fn inject_sendmail_style_reads_stdin_and_takes_the_null_sender() {
    let db = TestDb::new();
    let dir = TempDir::new("q-sendmail");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let out = queue_in(
        &conf,
        &os(&[
            "inject",
            "--stage",
            "relay",
            "-oi",
            "-f",
            "",
            "--local",
            "--auth-user",
            "Alice",
            "--state",
            r#"{"dsn": {"ret": "HDRS"}}"#,
            "r1@y.example",
            "r2@z.example",
        ]),
        b"Subject: cron\n\nall done\n",
    );
    expect(&out, 0);
    let id: i64 = stdout(&out).trim().parse().unwrap();
    let r = c
        .query_one(
            "SELECT mail_from, rcpt_to, subject, header_from, sender_key FROM pepsi.workqueue \
              WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "", "the null sender");
    assert_eq!(r.get::<_, Vec<String>>(1), ["r1@y.example", "r2@z.example"]);
    assert_eq!(r.get::<_, String>(2), "cron");
    assert_eq!(r.get::<_, Option<String>>(3), None);
    assert_eq!(r.get::<_, String>(4), "user:alice");
    assert_eq!(
        state_of(&mut c, id),
        serde_json::json!({"dsn": {"ret": "HDRS"}, "local_origin": true})
    );
    // `-f <>` and `-fADDRESS` are sendmail's spellings.
    let out = queue_in(
        &conf,
        &os(&["inject", "--stage", "in", "-f<>", "r@y.example"]),
        b"X: 1\n\n",
    );
    expect(&out, 0);
    let out = queue_in(
        &conf,
        &os(&["inject", "--stage", "in", "-fme@x.example", "r@y.example"]),
        b"X: 1\n\n",
    );
    expect(&out, 0);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pepsi.workqueue WHERE mail_from IN ('', 'me@x.example')"
        ),
        3
    );
}

#[test]
fn inject_refuses_bad_input_and_writes_nothing() {
    let db = TestDb::new();
    let dir = TempDir::new("q-inject-bad");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let mut l = listener(&db);
    let good = b"Subject: x\n\nbody\n".as_slice();
    let cases: Vec<(Vec<OsString>, &[u8], i32, &str)> = vec![
        (
            os(&["inject", "--stage", "in", "-f", "a@x.example"]),
            good,
            64,
            "at least one recipient",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "in",
                "-f",
                "a@x.example",
                "r@y.example",
            ]),
            b"Hello, no headers here.\n\nbody\n",
            65,
            "no header block",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "in",
                "-f",
                "a@x.example",
                "r@y.example",
            ]),
            b"",
            65,
            "no header block",
        ),
        (
            {
                let mut a = os(&["inject", "--stage", "in", "-f", "a@x.example"]);
                a.push(OsString::from_vec(b"r\xff@y.example".to_vec()));
                a
            },
            good,
            65,
            "not valid UTF-8",
        ),
        (
            {
                let mut a = os(&["inject", "--stage", "in", "--to", "r@y.example", "--from"]);
                a.push(OsString::from_vec(b"\xc3(@x.example".to_vec()));
                a
            },
            good,
            65,
            "--from: the address",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "in",
                "-f",
                "a@x.example",
                "r y@x.example",
            ]),
            good,
            65,
            "recipient \"r y@x.example\"",
        ),
        (
            os(&["inject", "--stage", "in", "-f", "a@@x", "r@y.example"]),
            good,
            65,
            "sender \"a@@x\"",
        ),
        (
            os(&["inject", "--stage", "in", "-f", "a@x.example", "<>"]),
            good,
            65,
            "a recipient cannot be empty",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "nowhere",
                "-f",
                "a@x.example",
                "r@y.example",
            ]),
            good,
            75,
            "no [stage-nowhere] section",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "in",
                "--from",
                "a@x.example",
                "--to",
                "r@y.example",
                "/nonexistent/message.eml",
            ]),
            good,
            66,
            "/nonexistent/message.eml",
        ),
        (
            os(&[
                "inject",
                "--stage",
                "in",
                "-f",
                "a@x.example",
                "--colour",
                "r@y.example",
            ]),
            good,
            64,
            "unknown option --colour",
        ),
        (
            os(&["inject", "-f", "a@x.example", "r@y.example"]),
            good,
            64,
            "--stage",
        ),
    ];
    for (args, input, code, says) in cases {
        let out = queue_in(&conf, &args, input);
        assert_eq!(out.status.code(), Some(code), "{args:?}\n{}", both(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", both(&out));
        assert!(out.stdout.is_empty(), "{args:?}: {}", both(&out));
    }
    assert_eq!(count(&mut c, "SELECT count(*) FROM pepsi.workqueue"), 0);
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body"),
        0
    );
    assert_eq!(
        notified(&mut l, &mut c),
        Vec::<String>::new(),
        "nothing notified"
    );
}

/// A queue with something in every status, one row at a stage without a section, one
/// old row, and statistics.
fn varied_queue(c: &mut Client) -> Vec<i64> {
    let ids: Vec<i64> = (0..7)
        .map(|i| {
            inject(
                c,
                if i == 6 { "lost" } else { "relay" },
                "a@x.example",
                &["r@y.example", "s@y.example"],
            )
        })
        .collect();
    set_status(c, ids[1], "running");
    set_status(c, ids[2], "paused");
    set_status(c, ids[3], "failed");
    set_status(c, ids[4], "timeout");
    set_status(c, ids[5], "held");
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '3 hours', \
         state = '{\"last_error\": \"connect to mx.y.example: refused\\nagain\"}' \
         WHERE workqueue_id = $1",
        &[&ids[3]],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '7 minutes' WHERE workqueue_id = $1",
        &[&ids[2]],
    )
    .unwrap();
    c.batch_execute(
        "INSERT INTO pepsi.stage_stats (stage, passes, fused_passes, failures, crashes, \
           timeouts, requeues, busy_us, deferrals, senders_served) \
         VALUES ('relay', 40, 3, 2, 1, 1, 5, 2500000, 4, 17); \
         UPDATE pepsi.dispatch_stats SET stages_executed = 37, claims = 12, rows_claimed = 45, \
           worker_starts = 6, updated = now() - interval '30 seconds'",
    )
    .unwrap();
    ids
}

/// A failure that is not the message's own (here a database that does not exist, a
/// schema that is not installed) exits 75, so that a handing-over MTA keeps the
/// message and tries again instead of bouncing it.
#[test]
fn inject_defers_what_is_not_the_messages_fault() {
    let db = TestDb::empty();
    let dir = TempDir::new("q-inject-defer");
    let args = os(&[
        "inject",
        "--stage",
        "in",
        "-f",
        "a@x.example",
        "r@y.example",
    ]);
    let message = b"Subject: x\n\nbody\n".as_slice();
    let no_schema = config(&dir, &db);
    let out = queue_in(&no_schema, &args, message);
    assert_eq!(out.status.code(), Some(75), "{}", both(&out));
    assert!(
        stderr(&out).contains("pepsi-setup schema"),
        "{}",
        both(&out)
    );
    let text = std::fs::read_to_string(&no_schema)
        .unwrap()
        .replace(&db.name, "pepsi_no_such_database");
    let no_database = dir.write("missing.conf", &text);
    let out = queue_in(&no_database, &args, message);
    assert_eq!(out.status.code(), Some(75), "{}", both(&out));
    assert!(out.stdout.is_empty());
}

#[test]
fn status_shows_every_stage_and_status_the_age_shape_unknown_stages_and_statistics() {
    let db = TestDb::new();
    let dir = TempDir::new("q-status");
    let conf = config(&dir, &db);
    let mut c = db.client();
    varied_queue(&mut c);
    let out = queue(&conf, &["status", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert_eq!(j["rows"], 7);
    for (status, n) in [
        ("pending", 2),
        ("running", 1),
        ("paused", 1),
        ("failed", 1),
        ("timeout", 1),
        ("held", 1),
    ] {
        assert_eq!(j["statuses"][status], n, "{status}");
    }
    let stage = |name: &str| -> Value {
        j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("no stage {name} in {j}"))
            .clone()
    };
    let relay = stage("relay");
    assert_eq!(relay["configured"], true);
    assert_eq!(relay["rows"], 6);
    assert_eq!(relay["statuses"]["held"]["rows"], 1);
    assert!(relay["oldest_age_seconds"].as_f64().unwrap() >= 3.0 * 3600.0 - 5.0);
    assert!(
        relay["statuses"]["paused"]["oldest_age_seconds"]
            .as_f64()
            .unwrap()
            >= 420.0
    );
    assert_eq!(
        relay["age_buckets"],
        serde_json::json!([4, 1, 0, 0, 0, 0, 1]),
        "0-5m, 5-10m (7 minutes), …, 160m+ (3 hours)"
    );
    assert_eq!(stage("in")["rows"], 0, "a configured stage without rows");
    assert_eq!(stage("lost")["configured"], false);
    assert_eq!(
        j["unknown_stages"],
        serde_json::json!([{"stage": "lost", "rows": 1}])
    );
    assert_eq!(j["stage_stats"][0]["stage"], "relay");
    assert_eq!(j["stage_stats"][0]["busy_us"], 2_500_000);
    assert_eq!(j["stage_stats"][0]["senders_served"], 17);
    assert_eq!(j["dispatch_stats"]["rows_claimed"], 45);
    assert!(j["dispatch_stats"]["updated_age_seconds"].as_f64().unwrap() >= 29.0);
    assert_eq!(j["dispatcher_running"], false);

    let out = queue(&conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.starts_with("queue: 7 messages ("), "{text}");
    assert!(text.contains("lost (no section)"), "{text}");
    assert!(
        text.contains("without a [stage-NAME] section are never claimed: lost (1)"),
        "{text}"
    );
    assert!(text.contains("0-5m  5-10m  10-20m"), "{text}");
    assert!(text.contains("dispatcher: NOT RUNNING"), "{text}");
    assert!(text.contains("37 stages executed, 12 claims, 45 rows claimed, 6 worker starts"));
}

#[test]
fn list_is_oldest_first_and_filters_and_limits() {
    let db = TestDb::new();
    let dir = TempDir::new("q-list");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let ids = varied_queue(&mut c);
    let other = inject(&mut c, "in", "b@other.example", &["t@y.example"]);

    let out = queue(&conf, &["list", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    let listed: Vec<i64> = j["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_i64().unwrap())
        .collect();
    let mut all = ids.clone();
    all.push(other);
    assert_eq!(listed, all, "every message, oldest (lowest id) first");
    assert_eq!(j["truncated"], false);
    let failed = &j["messages"][3];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["first_recipient"], "r@y.example");
    assert_eq!(failed["recipients"], 2);
    assert_eq!(
        failed["last_error"],
        "connect to mx.y.example: refused\nagain"
    );
    assert_eq!(failed["sender_key"], "from:x.example");

    let ids_of = |args: &[&str]| -> Vec<i64> {
        let mut a = vec!["list", "--json"];
        a.extend_from_slice(args);
        let out = queue(&conf, &a);
        expect(&out, 0);
        json(&out)["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(ids_of(&["--stage", "in"]), [other]);
    assert_eq!(ids_of(&["--status", "held"]), [ids[5]]);
    assert_eq!(ids_of(&["--sender", "from:other.example"]), [other]);
    assert_eq!(
        ids_of(&["--stage", "relay", "--status", "pending"]),
        [ids[0]]
    );
    let out = queue(&conf, &["list", "--limit", "2", "--json"]);
    let j = json(&out);
    assert_eq!(j["messages"].as_array().unwrap().len(), 2);
    assert_eq!(j["truncated"], true);

    let out = queue(&conf, &["list", "--status", "failed"]);
    expect(&out, 0);
    let text = stdout(&out);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().contains("LAST ERROR"), "{text}");
    let line = lines.next().unwrap();
    assert!(line.contains("relay"), "{line}");
    assert!(line.contains("r@y.example (+1 more)"), "{line}");
    assert!(
        line.contains("connect to mx.y.example: refused again"),
        "the error on one line: {line}"
    );
    assert!(line.contains("3h0"), "the age: {line}");
    let out = queue(&conf, &["list", "--limit", "1"]);
    assert!(stdout(&out).contains("more messages than --limit 1"));
    expect(&queue(&conf, &["list", "--status", "stuck"]), 64);
}

/// A stage name and a sender that hold a terminal control (ESC), a line break, a
/// right-to-left override and a line separator, and how the text output shows them.
const ODD_STAGE: &str = "ev\u{1b}[2J\r\nil\u{202e}x\u{2028}y";
const ODD_STAGE_SHOWN: &str = "ev\\u{1b}[2J\\r\\nil\\u{202e}x\\u{2028}y";
const ODD_SENDER: &str = "a\u{1b}[1m\r\n\u{202e}\u{2028}@x";
const ODD_SENDER_SHOWN: &str = "a\\u{1b}[1m\\r\\n\\u{202e}\\u{2028}@x";

/// A row at [`ODD_STAGE`] from [`ODD_SENDER`], set by SQL as any writer of the queue
/// could.
fn odd_row(c: &mut Client) -> i64 {
    let id = inject(c, "in", "a@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET stage = $2, mail_from = $3, \
                state = jsonb_build_object('last_error', $4::text) WHERE workqueue_id = $1",
        &[&id, &ODD_STAGE, &ODD_SENDER, &"boom\u{1b}]0;owned\u{7}"],
    )
    .unwrap();
    id
}

/// Asserts that `text` holds none of the characters the odd values hold raw.
#[track_caller]
fn nothing_raw(text: &str) {
    for c in ['\u{1b}', '\r', '\u{202e}', '\u{2028}', '\u{7}'] {
        assert!(!text.contains(c), "{c:?} raw in:\n{text}");
    }
    assert!(
        !text.lines().any(|l| l.starts_with("il")),
        "a line break of a value made a line:\n{text}"
    );
}

#[test]
fn list_status_and_show_print_senders_and_stages_escaped() {
    let db = TestDb::new();
    let dir = TempDir::new("q-escaped");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let id = odd_row(&mut c);

    let out = queue(&conf, &["list"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&id.to_string()))
        .unwrap_or_else(|| panic!("no line for {id}:\n{text}"));
    assert!(line.contains(ODD_STAGE_SHOWN), "{line}");
    assert!(line.contains(ODD_SENDER_SHOWN), "{line}");
    assert!(line.contains("boom\\u{1b}]0;owned\\u{7}"), "{line}");

    let out = queue(&conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert!(
        text.contains(&format!("{ODD_STAGE_SHOWN} (no section)")),
        "{text}"
    );
    assert!(
        text.contains(&format!("are never claimed: {ODD_STAGE_SHOWN} (1)")),
        "{text}"
    );

    let out = queue(&conf, &["show", &id.to_string()]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert!(
        text.contains(&format!("stage        {ODD_STAGE_SHOWN}\n")),
        "{text}"
    );
    assert!(
        text.contains(&format!("sender       {ODD_SENDER_SHOWN}\n")),
        "{text}"
    );
    assert!(
        text.contains("\"last_error\": \"boom\\u001b]0;owned\\u0007\""),
        "{text}"
    );
    // The header block keeps its line ends (CRLF here) and nothing else raw.
    c.execute(
        "UPDATE pepsi.workqueue_body b SET body = convert_to(E'Hi\\x1b[2J\\r\\nthere\\u202e\\r\\n', 'UTF8') \
           FROM pepsi.workqueue q WHERE q.workqueue_id = $1 AND b.body_id = q.body_id",
        &[&id],
    )
    .unwrap();
    let out = queue(&conf, &["show", &id.to_string(), "--headers", "--body"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("header block:\nSubject: test\r\n"), "{text}");
    assert!(
        text.contains("body:\nHi\\u{1b}[2J\r\nthere\\u{202e}\r\n"),
        "{text}"
    );
    nothing_raw(&text.replace("\r\n", "\n"));

    // The JSON gives the values exactly.
    let j = json(&queue(&conf, &["list", "--json"]));
    assert_eq!(j["messages"][0]["stage"], ODD_STAGE);
    assert_eq!(j["messages"][0]["mail_from"], ODD_SENDER);
}

#[test]
fn requeue_and_inject_refuse_a_stage_that_is_no_stage_name() {
    let db = TestDb::new();
    let dir = TempDir::new("q-stage-name");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let id = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    for stage in ["re\u{1b}[2Jlay", "relay\r\nfake", "a b"] {
        let out = queue(&conf, &["requeue", "--stage", stage, &id.to_string()]);
        expect(&out, 64);
        assert!(
            stderr(&out).contains("a stage name is one or more ASCII letters"),
            "{}",
            both(&out)
        );
        nothing_raw(&stderr(&out));
        let out = queue_in(
            &conf,
            &os(&[
                "inject",
                "--stage",
                stage,
                "-f",
                "a@x.example",
                "r@y.example",
            ]),
            b"Subject: x\n\nbody\n",
        );
        expect(&out, 64);
    }
    assert_eq!(row_at(&mut c, id), Some(("in".into(), "pending".into())));
    assert_eq!(count(&mut c, "SELECT count(*) FROM pepsi.workqueue"), 1);
}

#[test]
fn show_gives_the_row_and_its_state_and_the_content_only_on_request() {
    let db = TestDb::new();
    let dir = TempDir::new("q-show");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let id = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{\"strikes\": 2, \"last_error\": \"boom\"}' \
         WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    let out = queue(&conf, &["show", &id.to_string(), "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert_eq!(j["id"], id);
    assert_eq!(j["stage"], "in");
    assert_eq!(j["rcpt_to"], serde_json::json!(["r@y.example"]));
    assert_eq!(j["state"]["strikes"], 2);
    assert_eq!(j["subject"], "test");
    assert_eq!(j["body_bytes"], 8);
    assert!(j.get("headers").is_none() && j.get("body").is_none(), "{j}");

    let out = queue(
        &conf,
        &["show", &id.to_string(), "--json", "--headers", "--body"],
    );
    let j = json(&out);
    assert_eq!(j["headers"], "Subject: test\r\nFrom: <a@b>\r\n");
    assert_eq!(j["body"], "Hello.\r\n");
    // A body that is not UTF-8 travels as base64.
    c.execute(
        "UPDATE pepsi.workqueue_body SET body = '\\xff00'::bytea \
         WHERE body_id = (SELECT body_id FROM pepsi.workqueue WHERE workqueue_id = $1)",
        &[&id],
    )
    .unwrap();
    let j = json(&queue(
        &conf,
        &["show", &id.to_string(), "--json", "--body"],
    ));
    assert_eq!(j["body_base64"], "/wA=");

    let out = queue(&conf, &["show", &id.to_string()]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("\"strikes\": 2"), "the state, pretty: {text}");
    assert!(
        !text.contains("Subject: test"),
        "no header block unasked: {text}"
    );
    let out = queue(&conf, &["show", &id.to_string(), "--headers"]);
    assert!(stdout(&out).contains("header block:\nSubject: test\r\n"));

    let out = queue(&conf, &["show", "999999"]);
    expect(&out, 65);
    assert!(stderr(&out).contains("message 999999: no such message"));
    expect(&queue(&conf, &["show", "nine"]), 64);
}

#[test]
fn each_repair_command_changes_what_it_may_reports_the_rest_and_notifies_once() {
    let db = TestDb::new();
    let dir = TempDir::new("q-repair");
    let conf = config(&dir, &db);
    let mut c = db.client();
    let mut l = listener(&db);
    let ids: Vec<i64> = (0..5)
        .map(|_| inject(&mut c, "in", "a@x.example", &["r@y.example"]))
        .collect();
    let [a, b, r, f, p] = ids[..] else { panic!() };
    notified(&mut l, &mut c);
    claim(&mut c, &[r]);
    set_status(&mut c, f, "failed");
    set_status(&mut c, p, "paused");
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{\"strikes\": 3, \"failure_class\": \"crashed\", \
         \"last_error\": \"x\"}', hops = 7 WHERE workqueue_id = $1",
        &[&f],
    )
    .unwrap();
    let s = |id: i64| id.to_string();

    // hold: pending, paused and failed rows; the running one and an unknown id are
    // reported; the others changed anyway, with one NOTIFY.
    let out = queue(
        &conf,
        &["hold", &s(a), &s(f), &s(p), &s(r), "999999", "--json"],
    );
    expect(&out, 65);
    let j = json(&out);
    assert_eq!(j["changed"], 3);
    assert_eq!(j["ids"], serde_json::json!([a, f, p]));
    assert_eq!(j["not_found"], serde_json::json!([999999]));
    assert_eq!(
        j["not_eligible"],
        serde_json::json!([{"id": r, "status": "running"}])
    );
    assert!(stderr(&out).contains("is running: it belongs to a worker"));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    for id in [a, f, p] {
        assert_eq!(row_at(&mut c, id).unwrap().1, "held");
    }
    assert_eq!(row_at(&mut c, r).unwrap().1, "running");
    let held: Option<String> = c
        .query_one(
            "SELECT timeout::text FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&p],
        )
        .unwrap()
        .get(0);
    assert_eq!(held, None, "a held row has no retry time");
    assert_eq!(state_of(&mut c, p)["held_from"], "paused");

    // Only a running row left alone: 69, nothing notified.
    let out = queue(&conf, &["hold", &s(r), &s(a)]);
    expect(&out, 69);
    assert!(stderr(&out).contains(&format!("message {a}: is already held")));
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());

    // release: held rows back to pending, started afresh.
    let out = queue(&conf, &["release", &s(f), &s(b)]);
    expect(&out, 69);
    assert!(stdout(&out).contains(&format!("released 1 message: {f}")));
    assert!(stderr(&out).contains(&format!("message {b}: is pending, not held")));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, f).unwrap().1, "pending");
    assert_eq!(state_of(&mut c, f), serde_json::json!({"last_error": "x"}));
    let hops: i32 = c
        .query_one(
            "SELECT hops FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&f],
        )
        .unwrap()
        .get(0);
    assert_eq!(hops, 0);

    // requeue: to a configured stage only; a held row moves too, the running one not.
    let out = queue(&conf, &["requeue", "--stage", "nowhere", &s(b)]);
    expect(&out, 65);
    assert!(stderr(&out).contains("no [stage-nowhere] section"));
    let out = queue(&conf, &["requeue", "--stage", "relay", &s(b), &s(p)]);
    expect(&out, 0);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(
        row_at(&mut c, p).unwrap(),
        ("relay".to_string(), "pending".to_string())
    );
    assert_eq!(row_at(&mut c, b).unwrap().0, "relay");

    // resume by ids: paused, failed, timeout only.
    set_status(&mut c, b, "timeout");
    let out = queue(&conf, &["resume", &s(b), &s(a)]);
    expect(&out, 69);
    assert!(stderr(&out).contains(&format!("message {a}: is held; release it instead")));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, b).unwrap().1, "pending");

    // resume by stage and status.
    set_status(&mut c, b, "failed");
    set_status(&mut c, p, "paused");
    let out = queue(
        &conf,
        &["resume", "--stage", "relay", "--status", "failed", "--json"],
    );
    expect(&out, 0);
    assert_eq!(json(&out)["changed"], 1);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, p).unwrap().1, "paused");
    let out = queue(&conf, &["resume", "--all"]);
    expect(&out, 0);
    assert!(stdout(&out).contains("resumed 1 message"), "{}", both(&out));
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    let out = queue(&conf, &["resume", "--all"]);
    expect(&out, 0);
    assert_eq!(
        notified(&mut l, &mut c),
        Vec::<String>::new(),
        "nothing changed, nothing notified"
    );

    // delete: the body goes with the row; a running row stays. Ids from stdin.
    let bodies = count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body");
    let out = queue_in(
        &conf,
        &os(&["delete", "-"]),
        format!("{a}\n{b} {r}\n").as_bytes(),
    );
    expect(&out, 69);
    assert_eq!(notified(&mut l, &mut c), ["workqueue"]);
    assert_eq!(row_at(&mut c, a), None);
    assert_eq!(row_at(&mut c, b), None);
    assert_eq!(row_at(&mut c, r).unwrap().1, "running");
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.workqueue_body"),
        bodies - 2
    );
    let out = queue(&conf, &["delete", &s(a)]);
    expect(&out, 65);
    assert!(stderr(&out).contains(&format!("message {a}: no such message")));

    // Usage errors.
    for args in [
        &["hold"][..],
        &["hold", "x"],
        &["requeue", &s(p)],
        &["resume"],
        &["resume", "--status", "held"],
        &["release", &s(p), "-v"],
    ] {
        expect(&queue(&conf, args), 64);
    }
}

#[test]
fn held_rows_are_neither_claimed_nor_flipped_nor_bounced_nor_reset() {
    let db = TestDb::new();
    let dir = TempDir::new("q-held");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let held = inject(&mut c, "a", "h@x.example", &["r@y.example"]);
    let held_paused = inject(&mut c, "a", "h@x.example", &["r@y.example"]);
    set_status(&mut c, held_paused, "paused");
    expect(
        &queue(
            &conf,
            &["hold", &held.to_string(), &held_paused.to_string()],
        ),
        0,
    );
    // Even a retry time long past does not make the paused clock flip a held row.
    c.execute(
        "UPDATE pepsi.workqueue SET timeout = now() - interval '1 hour' WHERE workqueue_id = $1",
        &[&held_paused],
    )
    .unwrap();
    // The failure bouncer's move takes failed and timeout rows only.
    let moved = count(
        &mut c,
        "SELECT count(*) FROM pepsi.workqueue_bounce_failed('b', \
         ARRAY['failed', 'timeout']::pepsi.workqueue_status[], 100)",
    );
    assert_eq!(moved, 0);

    // The dispatcher starts (resetting running rows), claims and flips around them.
    let mut d = Dispatcher::start(&conf, &[]);
    let flowing = inject(&mut c, "a", "f@x.example", &["r@y.example"]);
    // Paused before its injection commits, so the dispatcher first sees it paused.
    let mut tx = c.transaction().unwrap();
    let due: i64 = tx
        .query_one(
            "SELECT pepsi.workqueue_inject('a', 'f@x.example', ARRAY['r@y.example'], NULL, NULL)",
            &[],
        )
        .unwrap()
        .get(0);
    tx.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() - interval '1 second' \
         WHERE workqueue_id = $1",
        &[&due],
    )
    .unwrap();
    tx.commit().unwrap();
    wait_until(
        Duration::from_secs(30),
        "the other messages went through",
        || row_at(&mut c, flowing).is_none() && row_at(&mut c, due).is_none(),
    );
    // One more pass of the loop after the flip, to be sure.
    let last = inject(&mut c, "a", "f@x.example", &["r@y.example"]);
    wait_until(
        Duration::from_secs(30),
        "one more message went through",
        || row_at(&mut c, last).is_none(),
    );
    assert_eq!(row_at(&mut c, held).unwrap(), ("a".into(), "held".into()));
    assert_eq!(
        row_at(&mut c, held_paused).unwrap(),
        ("a".into(), "held".into())
    );

    // Released, they go through at once (the release notifies the dispatcher).
    expect(
        &queue(
            &conf,
            &["release", &held.to_string(), &held_paused.to_string()],
        ),
        0,
    );
    wait_until(
        Duration::from_secs(30),
        "the released messages went through",
        || row_at(&mut c, held).is_none() && row_at(&mut c, held_paused).is_none(),
    );
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log());
}

/// The samples of an exposition text: `name{labels}` → value.
fn samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').unwrap();
            (key.to_string(), value.parse().unwrap())
        })
        .collect()
}

/// `promtool check metrics` on `text`: its findings, or `None` when promtool is not
/// installed (outside CI only: under CI a missing promtool fails the test).
fn promtool_check(text: &str) -> Option<Output> {
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                std::env::var_os("CI").is_none(),
                "promtool is not installed (CI is set): apt-get install prometheus"
            );
            eprintln!(
                "promtool is not installed: the exposition format is not checked \
                 (apt-get install prometheus)"
            );
            return None;
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    Some(child.wait_with_output().unwrap())
}

#[test]
fn metrics_pass_promtool_and_match_the_tables() {
    let db = TestDb::new();
    let dir = TempDir::new("q-metrics");
    let conf = config(&dir, &db);
    let mut c = db.client();
    varied_queue(&mut c);
    // A stage name that needs escaping in a label.
    inject(&mut c, "we\"ird\\", "a@x.example", &["r@y.example"]);
    let out = queue(&conf, &["metrics"]);
    expect(&out, 0);
    let text = stdout(&out);
    if let Some(check) = promtool_check(&text) {
        assert!(
            check.status.success() && check.stdout.is_empty() && check.stderr.is_empty(),
            "promtool check metrics:\n{}\n{}\n---\n{text}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    let m = samples(&text);
    // Every stage (configured or with rows) by every status, against the table.
    let statuses: Vec<String> = c
        .query(
            "SELECT s::text FROM unnest(enum_range(NULL::pepsi.workqueue_status)) s",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for stage in ["in", "relay", "lost", "we\\\"ird\\\\"] {
        for status in &statuses {
            let key = format!("pepsi_queue_messages{{stage=\"{stage}\",status=\"{status}\"}}");
            let name = stage.replace("\\\"", "\"").replace("\\\\", "\\");
            let want: i64 = c
                .query_one(
                    "SELECT count(*) FROM pepsi.workqueue WHERE stage = $1 AND status::text = $2",
                    &[&name, status],
                )
                .unwrap()
                .get(0);
            assert_eq!(m.get(&key), Some(&(want as f64)), "{key}\n{text}");
        }
    }
    let oldest = m["pepsi_queue_oldest_age_seconds{stage=\"relay\",status=\"failed\"}"];
    assert!(
        (3.0 * 3600.0 - 5.0..3.0 * 3600.0 + 60.0).contains(&oldest),
        "{oldest}"
    );
    assert_eq!(
        m["pepsi_queue_oldest_age_seconds{stage=\"in\",status=\"pending\"}"],
        0.0
    );
    assert_eq!(m["pepsi_queue_unknown_stage_messages"], 2.0);
    for (name, want) in [
        ("passes", 40.0),
        ("fused_passes", 3.0),
        ("failures", 2.0),
        ("crashes", 1.0),
        ("timeouts", 1.0),
        ("requeues", 5.0),
        ("deferrals", 4.0),
        ("senders_served", 17.0),
        ("busy_seconds", 2.5),
    ] {
        assert_eq!(
            m[&format!("pepsi_stage_{name}_total{{stage=\"relay\"}}")],
            want,
            "{name}"
        );
    }
    for (name, want) in [
        ("stages_executed", 37.0),
        ("claims", 12.0),
        ("rows_claimed", 45.0),
        ("worker_starts", 6.0),
    ] {
        assert_eq!(m[&format!("pepsi_dispatch_{name}_total")], want, "{name}");
    }
    let updated: f64 = c
        .query_one(
            "SELECT extract(epoch FROM updated)::float8 FROM pepsi.dispatch_stats",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(m["pepsi_dispatch_stats_updated_timestamp_seconds"], updated);
    assert!(m["pepsi_dispatch_stats_age_seconds"] >= 29.0);
    assert_eq!(m["pepsi_dispatcher_up"], 0.0);
}

#[test]
fn metrics_show_a_stage_name_escaped_and_pass_promtool() {
    let db = TestDb::new();
    let dir = TempDir::new("q-metrics-escaped");
    let conf = config(&dir, &db);
    let mut c = db.client();
    odd_row(&mut c);
    let out = queue(&conf, &["metrics"]);
    expect(&out, 0);
    let text = stdout(&out);
    if let Some(check) = promtool_check(&text) {
        assert!(
            check.status.success() && check.stdout.is_empty() && check.stderr.is_empty(),
            "promtool check metrics:\n{}\n{}\n---\n{text}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
    // Backslash, double quote and line feed as the format escapes them; the others
    // written out, their backslash escaped, so Prometheus reads `\u{1b}` and so on.
    let label = "stage=\"ev\\\\u{1b}[2J\\\\r\\nil\\\\u{202e}x\\\\u{2028}y\"";
    let m = samples(&text);
    assert_eq!(
        m.get(&format!(
            "pepsi_queue_messages{{{label},status=\"pending\"}}"
        )),
        Some(&1.0),
        "{text}"
    );
    for c in ['\u{1b}', '\r', '\u{202e}', '\u{2028}'] {
        assert!(!text.contains(c), "{c:?} raw in:\n{text}");
    }
    assert!(
        text.lines()
            .all(|l| l.starts_with("# ") || l.starts_with("pepsi_")),
        "every line a comment or a sample:\n{text}"
    );
}

#[test]
fn metrics_output_replaces_the_file_whole_and_says_when_it_cannot() {
    let db = TestDb::new();
    let dir = TempDir::new("q-metrics-file");
    let conf = config(&dir, &db);
    let prom = dir.path("pepsi.prom");
    std::fs::write(&prom, "stale\n").unwrap();
    let out = queue(&conf, &["metrics", "--output", prom.to_str().unwrap()]);
    expect(&out, 0);
    assert!(out.stdout.is_empty(), "{}", both(&out));
    let text = std::fs::read_to_string(&prom).unwrap();
    assert!(text.contains("# TYPE pepsi_dispatcher_up gauge"), "{text}");
    let left: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let out = queue(
        &conf,
        &[
            "metrics",
            "--output",
            dir.path("no/such/dir.prom").to_str().unwrap(),
        ],
    );
    expect(&out, 73);
    assert!(stderr(&out).contains("no/such/dir.prom"), "{}", both(&out));
}

#[test]
fn config_check_is_the_dispatchers_check() {
    let db = TestDb::new();
    let dir = TempDir::new("q-check");
    let good = write_config(
        &dir,
        &db,
        "[stage-in]\nPROGRAM = /bin/true\nNEXT = out\n\n[stage-out]\nPROGRAM = /bin/true\n",
    );
    for conf in [
        good.clone(),
        dir.write("bad.conf", "[stage-a]\nNEXT = nowhere\n"),
    ] {
        let ours = queue(&conf, &["config", "check"]);
        let theirs = run(
            &bin("pepsi-dispatch"),
            &["-c", conf.to_str().unwrap(), "check"],
        );
        assert_eq!(ours.status.code(), theirs.status.code(), "{}", both(&ours));
        assert_eq!(stdout(&ours), stdout(&theirs));
    }
    expect(&queue(&good, &["config", "check"]), 0);
    expect(&queue(&dir.path("bad.conf"), &["config", "check"]), 78);
}

#[test]
fn config_set_and_unset_check_the_resulting_graph_before_writing() {
    let db = TestDb::new();
    let dir = TempDir::new("q-config");
    let conf = conf(
        &dir,
        &db,
        "",
        "[stage-in]\nPROGRAM = {if}\nMATCH = sender-domain is x.example\nNEXT = out\nELSE_STAGE = out\n\n\
         [stage-out]\nPROGRAM = {discard}\n",
    );
    let mut c = db.client();
    let mut l = listener(&db);
    let overlay = |c: &mut Client| -> Vec<(String, String, String)> {
        c.query(
            "SELECT section, key, value FROM pepsi.config_override ORDER BY 1, 2",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
    };

    let out = queue(&conf, &["config", "set", "stage-out", "PARALLELISM", "2"]);
    expect(&out, 0);
    assert_eq!(
        overlay(&mut c),
        [("stage-out".into(), "PARALLELISM".into(), "2".into())]
    );
    assert_eq!(notified(&mut l, &mut c), ["config_changed"]);

    // Refused: a dangling reference, a value that does not parse, a MATCH the if
    // stage's worker would refuse; each lists the problem and writes nothing.
    for (args, says) in [
        (
            &["config", "set", "stage-in", "NEXT", "nowhere"][..],
            "names stage \"nowhere\"",
        ),
        (
            &["config", "set", "stage-out", "QUEUE_LIMIT", "lots"],
            "\"lots\" is not a whole number",
        ),
        (
            &[
                "config",
                "set",
                "stage-in",
                "MATCH",
                "sender-domain is x.example garbage",
            ],
            "MATCH",
        ),
        (&["config", "unset", "stage-in", "NEXT"], "nothing changed"),
        (&["config", "set", "[stage-new]", "NEXT", "out"], "PROGRAM"),
    ] {
        let out = queue(&conf, args);
        let code = if args[1] == "unset" { 65 } else { 78 };
        expect(&out, code);
        assert!(stderr(&out).contains(says), "{args:?}: {}", both(&out));
        assert_eq!(overlay(&mut c).len(), 1, "{args:?} wrote something");
    }
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());

    // A new stage in two steps is refused at the first (no PROGRAM); a PROGRAM first
    // works (a built-in stage program, which [pepsi] PROGRAM_PATH allows), then its
    // NEXT.
    expect(
        &queue(
            &conf,
            &[
                "config",
                "set",
                "stage-new",
                "PROGRAM",
                "pepsi-stage-discard",
            ],
        ),
        0,
    );
    expect(
        &queue(&conf, &["config", "set", "stage-new", "NEXT", "out"]),
        0,
    );
    // Unsetting removes the overlay row: the file's value applies again.
    expect(
        &queue(&conf, &["config", "unset", "stage-out", "PARALLELISM"]),
        0,
    );
    assert_eq!(
        overlay(&mut c),
        [
            ("stage-new".into(), "NEXT".into(), "out".into()),
            (
                "stage-new".into(),
                "PROGRAM".into(),
                "pepsi-stage-discard".into()
            ),
        ]
    );
    // Unsetting the new stage's PROGRAM would leave a section without one.
    let out = queue(&conf, &["config", "unset", "stage-new", "PROGRAM"]);
    expect(&out, 78);
    assert!(stderr(&out).contains("PROGRAM"), "{}", both(&out));
    assert_eq!(notified(&mut l, &mut c), ["config_changed"; 3]);

    for args in [
        &["config", "set", "pepsi", "RUN_AS", "root"][..],
        &["config", "set", "stage-out", "parallelism", "2"],
        &["config", "set", "stage-out", "PARALLELISM"],
        &["config", "frob"],
    ] {
        expect(&queue(&conf, args), 64);
    }
}

#[test]
fn config_set_refuses_a_program_outside_program_path_unless_the_file_names_it() {
    let db = TestDb::new();
    let dir = TempDir::new("q-config-program");
    let bin_dir = stage_dir().display().to_string();
    let with_path = |path: &str| {
        write_config(
            &dir,
            &db,
            &format!("[pepsi]\nPROGRAM_PATH = {path}\n\n{STAGES}"),
        )
    };
    let conf = with_path(&bin_dir);
    let mut c = db.client();
    let mut l = listener(&db);
    let overlay = |c: &mut Client| count(c, "SELECT count(*) FROM pepsi.config_override");
    let discard = stage("discard").display().to_string();
    let outside = [
        ("/tmp/x".to_string(), "it is not under [pepsi] PROGRAM_PATH"),
        (
            "pepsi-stage-discard".to_string(),
            "it is not an absolute path",
        ),
        (format!("{bin_dir}/../x"), "it has a \"..\" component"),
        (format!("{bin_dir}x/pepsi-stage-discard"), "it is not under"),
        (
            format!("{bin_dir}/"),
            "it ends in '/', which names a directory",
        ),
    ];
    for (value, says) in &outside {
        let out = queue(&conf, &["config", "set", "stage-relay", "PROGRAM", value]);
        expect(&out, 78);
        let text = stderr(&out);
        assert!(
            text.contains(&format!(
                "pepsi.config_override: [stage-relay] PROGRAM: {value:?} is refused: {says}"
            )),
            "{value}: {}",
            both(&out)
        );
        assert!(text.contains("nothing changed"), "{}", both(&out));
    }
    assert_eq!(overlay(&mut c), 0, "nothing written");
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
    // The overlay cannot widen PROGRAM_PATH: [pepsi] is not a section it overrides.
    expect(
        &queue(&conf, &["config", "set", "pepsi", "PROGRAM_PATH", "/tmp"]),
        64,
    );
    // Under PROGRAM_PATH, or exactly a program the file names: written.
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-relay", "PROGRAM", &discard],
        ),
        0,
    );
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-in", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    assert_eq!(overlay(&mut c), 2);
    assert_eq!(notified(&mut l, &mut c), ["config_changed"; 2]);
    // With PROGRAM_PATH = none, only what the file names.
    let conf = with_path("none");
    let out = queue(&conf, &["config", "set", "stage-new", "PROGRAM", &discard]);
    expect(&out, 78);
    assert!(
        stderr(&out).contains("[pepsi] PROGRAM_PATH is none"),
        "{}",
        both(&out)
    );
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-new", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    assert_eq!(overlay(&mut c), 3);
}

#[test]
fn usage_schema_and_connection_errors_have_their_own_exits() {
    let db = TestDb::new();
    let dir = TempDir::new("q-errors");
    let conf = config(&dir, &db);
    for args in [
        &[][..],
        &["frobnicate"],
        &["status", "--colour"],
        &["status", "-v"],
        &["list", "--limit", "none"],
    ] {
        let out = queue(&conf, args);
        expect(&out, 64);
        assert!(
            stderr(&out).contains("usage: pepsi-queue"),
            "{}",
            both(&out)
        );
    }
    let help = queue(&conf, &["-h"]);
    expect(&help, 0);
    assert!(stdout(&help).contains("requeue --stage S ID"));

    let empty = TestDb::empty();
    let no_schema = write_config(&dir, &empty, STAGES);
    let out = queue(&no_schema, &["status"]);
    expect(&out, 78);
    assert!(
        stderr(&out).contains("run pepsi-setup schema"),
        "{}",
        both(&out)
    );

    let away = dir.write(
        "away.conf",
        "[pepsi]\nRUN_AS = root\n[pepsi-postgres]\nCONNECTION = host=/nonexistent port=5999 user=x dbname=x\n",
    );
    let out = queue(&away, &["status"]);
    expect(&out, 75);
    assert!(
        stderr(&out).contains("/nonexistent/.s.PGSQL.5999"),
        "{}",
        both(&out)
    );
    let out = queue(&dir.write("broken.conf", "[pepsi\n"), &["status"]);
    expect(&out, 78);
}

#[test]
fn started_as_root_it_works_as_run_as() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: there is no privilege to drop");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let db = TestDb::new();
    let dir = TempDir::new("q-run-as");
    let mode = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    };
    mode(&dir.0, 0o755);
    let conf = config(&dir, &db);
    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("RUN_AS = root", "RUN_AS = nobody");
    std::fs::write(&conf, text).unwrap();
    mode(&conf, 0o644);
    expect(&queue(&conf, &["status"]), 0);
    // A folder only root may write to is closed to the account it switched to.
    let closed = dir.path("closed");
    std::fs::create_dir(&closed).unwrap();
    mode(&closed, 0o700);
    let out = queue(
        &conf,
        &[
            "metrics",
            "--output",
            closed.join("pepsi.prom").to_str().unwrap(),
        ],
    );
    expect(&out, 73);
    assert!(stderr(&out).contains("Permission denied"), "{}", both(&out));

    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("RUN_AS = nobody", "RUN_AS = pepsi-no-such-account");
    std::fs::write(&conf, text).unwrap();
    let out = queue(&conf, &["status"]);
    expect(&out, 78);
    assert!(
        stderr(&out).contains("pepsi-no-such-account"),
        "{}",
        both(&out)
    );
}

#[test]
fn config_unset_may_not_take_the_failure_bouncers_stage_away() {
    let db = TestDb::new();
    let dir = TempDir::new("q-config-bouncer");
    let conf = write_config(
        &dir,
        &db,
        &format!("[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n{STAGES}"),
    );
    let mut c = db.client();
    // The bounce stage exists only in the overlay; its last key unset, it would be gone.
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-bounce", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    let out = queue(&conf, &["config", "unset", "stage-bounce", "PROGRAM"]);
    expect(&out, 78);
    assert!(
        stderr(&out).contains("the failure bouncer would lose its target"),
        "{}",
        both(&out)
    );
    assert!(stderr(&out).contains("BOUNCE_STAGE"), "{}", both(&out));
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.config_override"),
        1,
        "nothing changed"
    );
    // Other changes stay possible while the target is there.
    expect(
        &queue(&conf, &["config", "set", "stage-bounce", "NEXT", "relay"]),
        0,
    );
}
