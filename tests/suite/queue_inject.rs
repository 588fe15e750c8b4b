//! `pepsi-queue inject` (`src/queue/inject.rs`, `src/intake.rs`) against a real
//! database: a message file or sendmail-style standard input split into its header
//! block and body, one NOTIFY, bad input refused with nothing written, and a failure
//! that is not the message's own deferred (75).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use crate::util::notify::notified;
use crate::util::queue::{STAGES, both, expect, listener, os, queue, queue_in};
use crate::util::rows::count;
use crate::util::{Scenario, assert_has, state_of, stderr, stdout};

#[test]
fn inject_reads_a_file_splits_the_header_block_and_notifies_once() {
    let (s, mut c) = Scenario::new("q-inject").stages(STAGES).connect();
    let mut l = listener(&s.db);
    let file = s.dir.path("msg.eml");
    std::fs::write(
        &file,
        b"From: =?UTF-8?Q?J=C3=B6rg?= <joerg@x.example>\r\n\
          Subject: =?UTF-8?B?R3LDvMOfZQ==?= from\r\n Bern\r\n\
          To: r@y.example\r\n\r\nHello.\r\n\r\nBye.\r\n",
    )
    .unwrap();
    let out = queue(
        &s.conf,
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
    let (s, mut c) = Scenario::new("q-sendmail").stages(STAGES).connect();
    let out = queue_in(
        &s.conf,
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
        &s.conf,
        &os(&["inject", "--stage", "in", "-f<>", "r@y.example"]),
        b"X: 1\n\n",
    );
    expect(&out, 0);
    let out = queue_in(
        &s.conf,
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
    let (s, mut c) = Scenario::new("q-inject-bad").stages(STAGES).connect();
    let mut l = listener(&s.db);
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
        // The sender left out: the next option is not taken as the address.
        (
            os(&["inject", "--stage", "in", "-f", "--to", "r@y.example"]),
            good,
            64,
            "-f needs the sender's address before --to",
        ),
        // sendmail's -fADDRESS not UTF-8: bad data, as any address.
        (
            {
                let mut a = os(&["inject", "--stage", "in"]);
                a.push(OsString::from_vec(b"-fa\xff@x.example".to_vec()));
                a.push(OsString::from("r@y.example"));
                a
            },
            good,
            65,
            "-f: the address",
        ),
        // Without --to, '-' is no recipient.
        (
            os(&["inject", "--stage", "in", "-f", "a@x.example", "-"]),
            good,
            64,
            "'-' is no recipient",
        ),
    ];
    for (args, input, code, says) in cases {
        let out = queue_in(&s.conf, &args, input);
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

#[test]
fn inject_warns_when_a_recipient_is_the_name_of_a_file() {
    let (s, mut c) = Scenario::new("q-inject-file").stages(STAGES).connect();
    let file = s.dir.write("message.eml", "Subject: x\n\nbody\n");
    let out = queue_in(
        &s.conf,
        &os(&[
            "inject",
            "--stage",
            "in",
            "-f",
            "a@x.example",
            file.to_str().unwrap(),
        ]),
        b"Subject: x\n\nbody\n",
    );
    // Refused as an address all the same, after the warning that explains why.
    assert_eq!(out.status.code(), Some(65), "{}", both(&out));
    assert_has!(stderr(&out), "is also the name of a file", "{}", both(&out));
    assert_eq!(count(&mut c, "SELECT count(*) FROM pepsi.workqueue"), 0);
}

/// A failure that is not the message's own (here a database that does not exist, a
/// schema that is not installed) exits 75, so that a handing-over MTA keeps the
/// message and tries again instead of bouncing it.
#[test]
fn inject_defers_what_is_not_the_messages_fault() {
    let s = Scenario::new("q-inject-defer")
        .empty()
        .stages(STAGES)
        .build();
    let args = os(&[
        "inject",
        "--stage",
        "in",
        "-f",
        "a@x.example",
        "r@y.example",
    ]);
    let message = b"Subject: x\n\nbody\n".as_slice();
    let no_schema = &s.conf;
    let out = queue_in(no_schema, &args, message);
    assert_eq!(out.status.code(), Some(75), "{}", both(&out));
    assert_has!(stderr(&out), "pepsi-setup schema", "{}", both(&out));
    let text = std::fs::read_to_string(no_schema)
        .unwrap()
        .replace(&s.db.name, "pepsi_no_such_database");
    let no_database = s.dir.write("missing.conf", &text);
    let out = queue_in(&no_database, &args, message);
    assert_eq!(out.status.code(), Some(75), "{}", both(&out));
    assert!(out.stdout.is_empty());
}
