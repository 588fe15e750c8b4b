//! The signing stage (§18): `pepsi-stage-dkim-sign` workers run by the dispatcher sign
//! what `pepsi-stage-relay` then hands to a scripted smarthost (`util::smarthost`),
//! and dkimpy, an implementation independent of Pepsi's, checks the signatures of the
//! message as the smarthost took it, with the records `pepsi-stage-dkim-sign dns`
//! prints as its only DNS. Also: the write that prepends header fields, a message that
//! cannot be signed (passed on, or failed with `REQUIRE`), and key problems at worker
//! start and in `pepsi-dispatch check`.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use pepsi::db::sql;
use postgres::Client;
use postgres::error::SqlState;
use serde_json::{Value, json};

use super::roles::worker_login;
use crate::util::dkim::{all_verify, key_table, make_key, published, verify};
use crate::util::rows::wait_empty;
use crate::util::scenario::Scenario;
use crate::util::smarthost::{Script, Smarthost};
use crate::util::{
    TempDir, TestDb, assert_has, bin, run, stage, state_of, stderr, stdout, wait_until,
};

const WAIT: Duration = Duration::from_secs(30);

/// `[stage-sign]` (dkim-sign with `KEY_TABLE = keys` and `extra`) to `[stage-relay]`,
/// which hands everything to `host`.
fn pipeline(keys: &std::path::Path, host: &Smarthost, extra: &str) -> String {
    format!(
        "[stage-sign]\nPROGRAM = {{dkim-sign}}\nKEY_TABLE = {}\nNEXT = relay\n{extra}\n\
         [stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {}\n\n\
         [stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = relay\n\n\
         [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
        keys.display(),
        host.address
    )
}

/// Injects a message (header block, body) at `stage` from `from` to `to`.
fn inject(
    c: &mut Client,
    stage: &str,
    from: &str,
    to: &[&str],
    headers: &[u8],
    body: &[u8],
) -> i64 {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, $2, $3, $4, $5)",
        &[&stage, &from, &to, &headers, &body],
    )
    .unwrap()
    .get(0)
}

/// The data the smarthost took for `rcpt`, the last one.
fn delivered(host: &Smarthost, rcpt: &str) -> Vec<u8> {
    let seen = host.seen();
    seen.messages
        .iter()
        .rev()
        .find(|m| m.delivered.iter().any(|d| d == rcpt))
        .unwrap_or_else(|| panic!("nothing delivered to {rcpt}"))
        .data
        .clone()
}

/// `message` with the first occurrence of `from` replaced by `to`.
fn altered(message: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = message
        .windows(from.len())
        .position(|w| w == from)
        .unwrap_or_else(|| panic!("{:?} not in the message", String::from_utf8_lossy(from)));
    [&message[..at], to, &message[at + from.len()..]].concat()
}

/// The keys of `example.org` (RSA-2048 as PKCS#1, and Ed25519: every message from it is
/// signed twice) and of `rsa.example` (RSA-2048 as PKCS#8), in `dir`'s KEY_TABLE.
fn keys(dir: &TempDir) -> std::path::PathBuf {
    let rsa = make_key(dir, "org-rsa.pem", "rsa2048-pkcs1");
    let ed = make_key(dir, "org-ed.pem", "ed25519");
    let other = make_key(dir, "other.pem", "rsa2048");
    key_table(
        dir,
        &[
            ("example.org", "r2026", "rsa-sha256", &rsa),
            ("example.org", "e2026", "ed25519-sha256", &ed),
            ("rsa.example", "s1", "rsa-sha256", &other),
        ],
    )
}

#[test]
fn signed_mail_verifies_where_it_arrives_and_breaks_when_altered() {
    let dir = TempDir::new("dkim-e2e");
    let table = keys(&dir);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("dkim-e2e")
        .timers("")
        .stages(&pipeline(&table, &host, ""))
        .connect();
    let records = published(&s.conf);
    assert_eq!(records.as_object().unwrap().len(), 3, "{records}");
    // Folded and odd header fields, 8-bit body bytes, trailing blank lines, bare LF
    // line ends, a header block without its last line end, an empty body.
    let cases: [(&str, &[u8], &[u8]); 5] = [
        (
            "folded",
            b"From: Alice  Example <alice@example.org>\r\nTo: b@dest.example,\r\n\t c@dest.example\r\nSubject:   many   spaces\t \r\nX-Empty:\r\nMIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nDATE: Fri, 04 Dec 2026 10:00:00 +0000\r\n",
            b"8-bit: \xc3\xa9t\xc3\xa9  \r\nline with trailing blanks   \r\n\r\n\r\n\r\n",
        ),
        ("lf", b"From: alice@example.org\nSubject: bare LF\n", b"one\ntwo\n\n"),
        ("unended", b"From: alice@example.org\r\nSubject: no last line end", b"body\r\n"),
        ("empty", b"From: alice@example.org\r\nSubject: no body\r\n", b""),
        ("rsa-only", b"From: Bob <bob@rsa.example>\r\nSubject: one key\r\n", b"Hi.\r\n"),
    ];
    for (tag, headers, body) in cases {
        let from = if tag == "rsa-only" {
            "bob@rsa.example"
        } else {
            "alice@example.org"
        };
        inject(
            &mut c,
            "sign",
            from,
            &[&format!("{tag}@dest.example")],
            headers,
            body,
        );
    }
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    for (tag, _, body) in cases {
        let rcpt = format!("{tag}@dest.example");
        let data = delivered(&host, &rcpt);
        let n = if tag == "rsa-only" { 1 } else { 2 };
        assert_eq!(
            verify(&data, &records),
            vec![Value::Bool(true); n],
            "{tag}: {}",
            String::from_utf8_lossy(&data)
        );
        // One body byte changed, a second From: added, a signed header changed: each
        // must break every signature.
        let mut changed = data.clone();
        if body.is_empty() {
            changed.extend_from_slice(b"x\r\n");
        } else {
            let last = changed.len() - 3;
            changed[last] ^= 0x01;
        }
        let added = [b"From: mallory@evil.example\r\n".as_slice(), &data].concat();
        let subject = altered(&data, b"Subject:", b"Subject: Re:");
        for (what, message) in [("body", changed), ("from", added), ("subject", subject)] {
            let verdicts = verify(&message, &records);
            assert!(
                verdicts.len() == n && verdicts.iter().all(|v| v != &Value::Bool(true)),
                "{tag}, {what} altered: {verdicts:?}"
            );
        }
    }
    assert!(d.try_wait().is_none(), "the dispatcher runs on");
}

#[test]
fn a_message_that_cannot_be_signed_goes_on_unsigned_or_fails_with_require() {
    let dir = TempDir::new("dkim-unsigned");
    let table = keys(&dir);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("dkim-unsigned")
        .timers("")
        .stages(&pipeline(&table, &host, "PARALLELISM = 1\n"))
        .stages(&format!(
            "[stage-strict]\nPROGRAM = {{dkim-sign}}\nREQUIRE = yes\nNEXT = relay\nKEY_TABLE = {}\n\n",
            table.display()
        ))
        .connect();
    let many: String = (0..10_000).map(|i| format!("u{i}@example.org, ")).collect();
    let many = format!("From: {}\r\nSubject: many\r\n", many.trim_end_matches(", "));
    let unsigned: [(&str, Vec<u8>); 5] = [
        ("nokey", b"From: carol@elsewhere.example\r\n".to_vec()),
        (
            "twofrom",
            b"From: alice@example.org\r\nFrom: bob@example.org\r\n".to_vec(),
        ),
        ("nofrom", b"Subject: no from\r\n".to_vec()),
        ("many", many.into_bytes()),
        ("nul", b"From: alice@exa\0mple.org\r\n".to_vec()),
    ];
    let mut ids = Vec::new();
    for (tag, headers) in &unsigned {
        let rcpt = format!("{tag}@dest.example");
        ids.push(inject(
            &mut c,
            "sign",
            "alice@example.org",
            &[&rcpt],
            headers,
            b"x\r\n",
        ));
    }
    let strict = inject(
        &mut c,
        "strict",
        "carol@elsewhere.example",
        &["strict@dest.example"],
        b"From: carol@elsewhere.example\r\n",
        b"x\r\n",
    );
    let mut d = s.start();
    wait_until(
        WAIT,
        "the unsigned delivered and the strict one failed",
        || {
            unsigned
                .iter()
                .all(|(tag, _)| host.deliveries(&format!("{tag}@dest.example")) == 1)
                && pepsi_status(&mut c, strict).as_deref() == Some("failed")
        },
    );
    for (tag, _) in &unsigned {
        let data = delivered(&host, &format!("{tag}@dest.example"));
        assert!(verify(&data, &json!({})).is_empty(), "{tag}: not signed");
    }
    let state = state_of(&mut c, strict);
    assert_eq!(state["dsn_status"], "5.7.0", "{state}");
    assert_has!(
        state["last_error"].as_str().unwrap(),
        "no key for elsewhere.example"
    );
    assert_eq!(host.deliveries("strict@dest.example"), 0);
    d.wait_log(
        "passed on unsigned: no key for elsewhere.example",
        Duration::from_secs(5),
    );
    // A worker tells what it counted when its input ends (the dispatcher stops it).
    d.signal(libc::SIGTERM);
    d.wait(Duration::from_secs(20));
    assert_has!(d.log(), "dkim-sign: 0 signed, 5 passed on unsigned");
}

/// The status of row `id`, if it is still there.
fn pepsi_status(c: &mut Client, id: i64) -> Option<String> {
    c.query_opt(
        "SELECT status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .map(|r| r.get(0))
}

#[test]
fn signing_fused_between_stages_and_on_a_message_for_several_recipients_verifies() {
    let dir = TempDir::new("dkim-fused");
    let table = keys(&dir);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("dkim-fused")
        .timers("")
        .stages("[stage-in]\nPROGRAM = {if}\nMATCH = sender-domain is example.org\nNEXT = sign\nELSE_STAGE = relay\n\n")
        // if → sign → relay in one pass for one recipient (the relay sends the fields
        // the signer added in memory); for two, the pass stops after signing (a
        // rewritten message with several recipients is written before it goes on).
        .stages(
            &pipeline(&table, &host, "FUSION = yes\n")
                .replace("[stage-relay]\n", "[stage-relay]\nFUSION = yes\n"),
        )
        .connect();
    let records = published(&s.conf);
    let headers = b"From: alice@example.org\r\nTo: many\r\nSubject: fused\r\n";
    inject(
        &mut c,
        "in",
        "alice@example.org",
        &["one@dest.example"],
        headers,
        b"1\r\n",
    );
    inject(
        &mut c,
        "in",
        "alice@example.org",
        &["two@dest.example", "three@dest.example"],
        headers,
        b"2\r\n",
    );
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    for rcpt in ["one@dest.example", "two@dest.example", "three@dest.example"] {
        let data = delivered(&host, rcpt);
        assert!(
            all_verify(&data, &records, 2),
            "{rcpt}: {}",
            String::from_utf8_lossy(&data)
        );
        let signatures = data
            .split(|&b| b == b'\n')
            .filter(|l| l.starts_with(b"DKIM-Signature:"))
            .count();
        assert_eq!(signatures, 2, "signed once, by each key: {rcpt}");
    }
    // The signer's body is read within the pass of `in` for both messages; the relay
    // runs there for one recipient, and is a claim of its own after the rewrite for two.
    let stats = "SELECT (SELECT rows_claimed FROM pepsi.dispatch_stats), \
                 (SELECT passes FROM pepsi.stage_stats WHERE stage = 'sign'), \
                 (SELECT fused_passes FROM pepsi.stage_stats WHERE stage = 'sign'), \
                 (SELECT passes FROM pepsi.stage_stats WHERE stage = 'relay'), \
                 (SELECT fused_passes FROM pepsi.stage_stats WHERE stage = 'relay')";
    crate::util::wait_until(WAIT, "the statistics count every pass", || {
        let r = c.query_one(stats, &[]).unwrap();
        r.get::<_, Option<i64>>(3) == Some(2)
    });
    assert!(d.terminate().success(), "{}", d.log());
    let r = c.query_one(stats, &[]).unwrap();
    let figures: Vec<Option<i64>> = (0..5).map(|i| r.get(i)).collect();
    assert_eq!(
        figures,
        [Some(3), Some(2), Some(2), Some(2), Some(1)],
        "claims, sign's passes and fused passes, relay's passes and fused passes"
    );
}

#[test]
fn a_key_problem_keeps_the_workers_from_starting_and_check_names_the_line() {
    let dir = TempDir::new("dkim-keys");
    let good = make_key(&dir, "good.pem", "ed25519");
    let small = make_key(&dir, "small.pem", "rsa1024");
    let open = make_key(&dir, "open.pem", "rsa2048");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let table = key_table(
        &dir,
        &[
            ("example.org", "e", "ed25519-sha256", &good),
            ("small.example", "s", "rsa-sha256", &small),
            ("open.example", "o", "rsa-sha256", &open),
            ("gone.example", "g", "rsa-sha256", &dir.path("missing.pem")),
            ("wrong.example", "w", "rsa-sha256", &good),
        ],
    );
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("dkim-keys")
        .timers("")
        .stages(&pipeline(&table, &host, ""))
        .connect();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    assert!(!out.status.success());
    let report = stdout(&out) + &stderr(&out);
    let t = table.display();
    for (line, what) in [
        (3, "2048 to 4096 bits"),
        (4, "world-readable"),
        (5, "missing.pem"),
        (6, "holds an Ed25519 key, not one for rsa-sha256"),
    ] {
        assert_has!(report, &format!("{t} line {line}"), "{what}: {report}");
        assert_has!(report, what, "line {line}: {report}");
    }
    // A worker refuses to run (78) with the same lines; the message waits, unharmed.
    let id = inject(
        &mut c,
        "sign",
        "alice@example.org",
        &["r@dest.example"],
        b"From: alice@example.org\r\n",
        b"x\r\n",
    );
    let w = std::process::Command::new(stage("dkim-sign"))
        .args(["-c", s.conf.to_str().unwrap(), "worker"])
        .env("PEPSI_WORKER_STAGE", "sign")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(w.status.code(), Some(78), "{}", stderr(&w));
    assert_has!(stderr(&w), &format!("{t} line 4"));
    assert_eq!(pepsi_status(&mut c, id).as_deref(), Some("pending"));
    assert_eq!(host.deliveries("r@dest.example"), 0);
}

/// The server's message of a refused statement.
fn db_message(err: &postgres::Error) -> String {
    err.as_db_error()
        .map_or_else(|| err.to_string(), |e| e.message().to_string())
}

/// A worker's write may put header fields before a row's header block, and nothing
/// else: the fields arrive in front of the stored block, in the same write; fields that
/// are not header fields (an empty line that would start the body early, a NUL, no
/// line end, no field name, not base64) fail the whole write and leave the row as it
/// was; fields on a row not marked rewritten are refused too.
#[test]
fn a_write_prepends_header_fields_and_refuses_anything_else() {
    let db = TestDb::new();
    let mut owner = db.client();
    let id = crate::util::inject(&mut owner, "s", "a@x.example", &["r@y.example"]);
    owner
        .execute(
            "UPDATE pepsi.workqueue SET status = 'running', claim = 42 WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap();
    let mut w = db.client_as(&worker_login());
    let write = |w: &mut Client, fields: Option<&[u8]>, rewritten: bool| {
        let mut row = json!({"id": id, "claimed": "s", "claim": 42, "stage": "t",
                             "status": "pending", "delay_ms": null, "state": {},
                             "rewritten": rewritten, "mail_from": "a@x.example",
                             "rcpt_to": ["r@y.example"], "header_from": "a@b",
                             "subject": "test"});
        if let Some(fields) = fields {
            row["prepend_headers"] = json!(STANDARD.encode(fields));
        }
        w.query(sql::WRITE_OUTCOMES, &[&json!([row]).to_string()])
    };
    let headers = |c: &mut Client| -> (Vec<u8>, String) {
        let row = c
            .query_one(
                "SELECT headers, stage FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    let stored = b"Subject: test\r\nFrom: <a@b>\r\n".to_vec();
    let refused: [(&[u8], &str); 7] = [
        (b"X-A: 1\r\n\r\nInjected body\r\n", "hold an empty line"),
        (b"X-A: 1\n\nInjected body\n", "hold an empty line"),
        (b"X-A: 1", "do not end with a line end"),
        (b"X-A: 1\0\r\n", "hold a NUL"),
        (b" X-A: 1\r\n", "do not start with a field name"),
        (b"no colon here\r\n", "do not start with a field name"),
        (b"", "are empty"),
    ];
    for (fields, why) in refused {
        let err = write(&mut w, Some(fields), true).unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PARAMETER_VALUE),
            "{err}"
        );
        assert_has!(db_message(&err), why);
        assert_eq!(headers(&mut owner), (stored.clone(), "s".to_string()));
    }
    let err = write(&mut w, Some(b"X-A: 1\r\n"), false).unwrap_err();
    assert_has!(db_message(&err), "not rewritten");
    let not_base64 = json!([{"id": id, "claimed": "s", "claim": 42, "stage": "t",
                             "status": "pending", "delay_ms": null, "state": {},
                             "rewritten": true, "mail_from": "a@x.example",
                             "rcpt_to": ["r@y.example"], "prepend_headers": "%%%"}]);
    let err = w
        .query(sql::WRITE_OUTCOMES, &[&not_base64.to_string()])
        .unwrap_err();
    assert_has!(db_message(&err), "are not base64");
    assert_eq!(headers(&mut owner), (stored.clone(), "s".to_string()));
    let signature = b"DKIM-Signature: v=1; a=ed25519-sha256;\r\n\tb=abc\r\n";
    assert_eq!(write(&mut w, Some(signature), true).unwrap().len(), 1);
    let mut expected = signature.to_vec();
    expected.extend_from_slice(&stored);
    assert_eq!(headers(&mut owner), (expected, "t".to_string()));
}

#[test]
fn the_overlay_cannot_point_a_stage_at_other_keys_or_secrets() {
    // An overlay writer who could name a key table or secrets file of its own would
    // sign mail with its key, or forge SRS addresses the forwarder turns back for anyone.
    let dir = TempDir::new("dkim-overlay");
    let table = keys(&dir);
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("dkim-overlay")
        .timers("")
        .stages(&pipeline(&table, &host, ""))
        .connect();
    let conf = s.conf.to_str().unwrap();
    let mine = dir.write("mine", "example.org x ed25519-sha256 /tmp/attacker.pem\n");
    for (key, value) in [
        ("KEY_TABLE", mine.to_str().unwrap()),
        ("SECRETS_FILE", "/tmp/known"),
    ] {
        let out = run(
            &bin("pepsi-queue"),
            &["-c", conf, "config", "set", "stage-sign", key, value],
        );
        assert_eq!(out.status.code(), Some(78), "{key}: {}", stderr(&out));
        assert_has!(stderr(&out), &format!("{key} is refused"));
    }
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing written");
    // A row planted behind the tool's back is reported and left out.
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-sign', 'KEY_TABLE', $1)",
        &[&mine.to_str().unwrap()],
    )
    .unwrap();
    let out = run(&bin("pepsi-dispatch"), &["-c", conf, "check"]);
    assert_eq!(out.status.code(), Some(78));
    assert_has!(stdout(&out), "[stage-sign] KEY_TABLE: KEY_TABLE is refused");
    // The workers sign with the file's keys: the message verifies with its records.
    let records = published(&s.conf);
    inject(
        &mut c,
        "sign",
        "alice@example.org",
        &["r@dest.example"],
        b"From: alice@example.org\r\nSubject: planted\r\n",
        b"x\r\n",
    );
    let _d = s.start();
    wait_until(WAIT, "delivered", || host.deliveries("r@dest.example") == 1);
    assert!(all_verify(&delivered(&host, "r@dest.example"), &records, 2));
}
