//! `pepsi-queue` as the queue suites run it (with a configuration, arguments and
//! standard input, its exit status asserted and its `--json` read) and the queues they
//! run it on: the stages `in` → `relay`, a queue with something in every status, and a
//! row whose stage and sender hold characters a terminal would act on.
//!
//! Used by the `queue_*` suites. It runs the program and writes rows; what a command
//! must print or change is for the tests to say.

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use postgres::Client;
use serde_json::Value;

use super::notify::listen;
use super::{TestDb, bin, inject, stderr, stdout};

/// The stages `in` → `relay`, programs that are never run.
pub const STAGES: &str = "[stage-in]\nPROGRAM = /bin/true\nNEXT = relay\n\n\
                          [stage-relay]\nPROGRAM = /bin/true\n";

/// `pepsi-queue -c conf ARGS`, with `input` on its standard input.
pub fn queue_in(conf: &Path, args: &[OsString], input: &[u8]) -> Output {
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

/// Arguments as `OsString`s.
pub fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// `pepsi-queue -c conf ARGS` with empty input.
pub fn queue(conf: &Path, args: &[&str]) -> Output {
    queue_in(conf, &os(args), b"")
}

/// The exit status and both streams, for assertion messages.
pub fn both(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        stdout(out),
        stderr(out)
    )
}

/// Asserts the exit status.
#[track_caller]
pub fn expect(out: &Output, code: i32) {
    assert_eq!(out.status.code(), Some(code), "{}", both(out));
}

/// Stdout as one JSON document.
#[track_caller]
pub fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}):\n{}", both(out)))
}

/// A LISTEN session on `workqueue` and `config_changed`, plus a sentinel.
pub fn listener(db: &TestDb) -> Client {
    listen(db, &["workqueue", "config_changed"])
}

/// Sets a row's status (and a paused row's retry time) directly.
pub fn set_status(c: &mut Client, id: i64, status: &str) {
    c.execute(
        "UPDATE pepsi.workqueue SET status = $2::text::pepsi.workqueue_status, \
         timeout = CASE WHEN $2 = 'paused' THEN now() + interval '1 hour' END \
         WHERE workqueue_id = $1",
        &[&id, &status],
    )
    .unwrap();
}

/// A queue with something in every status, one row at a stage without a section, one
/// old row, and statistics.
pub fn varied_queue(c: &mut Client) -> Vec<i64> {
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

/// A stage name that holds a terminal control (ESC), a line break, a right-to-left
/// override and a line separator.
pub const ODD_STAGE: &str = "ev\u{1b}[2J\r\nil\u{202e}x\u{2028}y";
/// How the text output shows [`ODD_STAGE`].
pub const ODD_STAGE_SHOWN: &str = "ev\\u{1b}[2J\\r\\nil\\u{202e}x\\u{2028}y";
/// A sender that holds the same kinds of characters.
pub const ODD_SENDER: &str = "a\u{1b}[1m\r\n\u{202e}\u{2028}@x";
/// How the text output shows [`ODD_SENDER`].
pub const ODD_SENDER_SHOWN: &str = "a\\u{1b}[1m\\r\\n\\u{202e}\\u{2028}@x";

/// A row at [`ODD_STAGE`] from [`ODD_SENDER`], set by SQL as any writer of the queue
/// could.
pub fn odd_row(c: &mut Client) -> i64 {
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
pub fn nothing_raw(text: &str) {
    for c in ['\u{1b}', '\r', '\u{202e}', '\u{2028}', '\u{7}'] {
        assert!(!text.contains(c), "{c:?} raw in:\n{text}");
    }
    assert!(
        !text.lines().any(|l| l.starts_with("il")),
        "a line break of a value made a line:\n{text}"
    );
}
