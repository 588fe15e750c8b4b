//! The bounce stage (§13.2): failed messages driven through `pepsi-stage-bounce`
//! as the dispatcher drives it, every delivery status notification read back from the
//! database and parsed by an independent MIME parser (`mail-parser`, which the program
//! does not use).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mail_parser::{MessageParser, MimeHeaders};
use postgres::Client;
use serde_json::{Value, json};

use crate::util::rows::queue_len;
use crate::util::scenario::{Builder, Scenario};
use crate::util::worker::{Worker, code};
use crate::util::{
    TempDir, TestDb, assert_has, assert_lacks, claim, row_at, stage, state_of, write_config,
};

const HOST: &str = "mx.test.example";

/// `b` with `[pepsi] HOSTNAME`, the bounce stage (to `deliver`, a discard) and `extra`
/// sections; `{NAME}` stands for a built-in stage program.
pub(super) fn with_bounce(b: Builder, extra: &str) -> Builder {
    b.pepsi(&format!("HOSTNAME = {HOST}\n")).stages(&format!(
        "[stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = deliver\n{extra}\n\
         [stage-deliver]\nPROGRAM = {{discard}}\n"
    ))
}

/// [`with_bounce`] with an exec stage `relay` running `relay` (with `relay_lines` in its
/// section), the failure bouncer moving failed messages to `bounce`, and the reports
/// handed to `deliver` (an exec stage, `deliver-bounce`) instead of the discard.
pub(super) fn with_exec_relay_and_reports(
    b: Builder,
    relay: &std::path::Path,
    relay_lines: &str,
    deliver: &std::path::Path,
) -> Scenario {
    let s = with_bounce(
        b,
        &format!(
            "\n[stage-relay]\nPROGRAM = {{exec}}\nCOMMAND = {}\n{relay_lines}\n\
             [stage-deliver-bounce]\nPROGRAM = {{exec}}\nCOMMAND = {}\n\n\
             [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
            relay.display(),
            deliver.display()
        ),
    )
    .build();
    // Reports go to the folder instead of the default discard.
    let text = std::fs::read_to_string(&s.conf)
        .unwrap()
        .replace("NEXT = deliver\n", "NEXT = deliver-bounce\n");
    std::fs::write(&s.conf, text).unwrap();
    s
}

/// [`with_bounce`] on a new scenario.
fn scenario(tag: &str, extra: &str) -> Builder {
    with_bounce(Scenario::new(tag), extra)
}

/// A message as accepted: its envelope, header block, body and state.
struct Original<'a> {
    from: &'a str,
    to: &'a [&'a str],
    headers: Option<&'a [u8]>,
    body: Option<&'a [u8]>,
    state: Value,
}

pub(super) const HEADERS: &[u8] = b"From: Alice <alice@origin.example>\r\n\
To: bob@dest.example\r\n\
Subject: Quarterly figures\r\n\
Message-ID: <q4.figures@origin.example>\r\n\
Date: Wed, 02 Dec 2026 10:00:00 +0000\r\n";
pub(super) const BODY: &[u8] = b"The figures are attached.\r\n\r\n-- \r\nAlice\r\n";

impl Original<'_> {
    fn simple(state: Value) -> Original<'static> {
        Original {
            from: "alice@origin.example",
            to: &["bob@dest.example"],
            headers: Some(HEADERS),
            body: Some(BODY),
            state,
        }
    }
}

/// Inserts the message at the bounce stage, claimed (running), arrived an hour ago.
fn at_bounce(c: &mut Client, m: &Original<'_>) -> i64 {
    let to: Vec<String> = m.to.iter().map(|s| s.to_string()).collect();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('bounce', $1, $2, $3, $4, NULL, NULL, NULL, NULL, $5::text::jsonb)",
            &[&m.from, &to, &m.headers, &m.body, &m.state.to_string()],
        )
        .unwrap()
        .get(0);
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '1 hour' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    claim(c, &[id]);
    id
}

/// A DSN row as stored.
pub(super) struct Stored {
    id: i64,
    stage: String,
    status: String,
    mail_from: String,
    rcpt_to: Vec<String>,
    header_from: Option<String>,
    subject: Option<String>,
    state: Value,
    pub(super) raw: Vec<u8>,
}

/// The DSN made of message `original`, if any.
pub(super) fn dsn_of(c: &mut Client, original: i64) -> Option<Stored> {
    let rows = c
        .query(
            "SELECT q.workqueue_id, q.stage, q.status::text, q.mail_from, q.rcpt_to, q.header_from, \
                    q.subject, q.state::text, q.headers, b.body \
               FROM pepsi.workqueue q LEFT JOIN pepsi.workqueue_body b USING (body_id) \
              WHERE q.state ->> 'dsn_of' = $1::int8::text",
            &[&original],
        )
        .unwrap();
    assert!(rows.len() <= 1, "one report per failed message");
    rows.first().map(|r| {
        let headers: Vec<u8> = r.get(8);
        let body: Vec<u8> = r.get(9);
        let mut raw = headers;
        raw.extend_from_slice(b"\r\n");
        raw.extend_from_slice(&body);
        Stored {
            id: r.get(0),
            stage: r.get(1),
            status: r.get(2),
            mail_from: r.get(3),
            rcpt_to: r.get(4),
            header_from: r.get(5),
            subject: r.get(6),
            state: serde_json::from_str(&r.get::<_, String>(7)).unwrap(),
            raw,
        }
    })
}

/// Runs the bounce stage on these rows; every answer must be 0.
pub(super) fn bounce(conf: &std::path::Path, ids: &[i64]) {
    let mut w = Worker::ready(&stage("bounce"), conf);
    for line in w.run(ids) {
        assert_eq!(code(&line), 0, "{line}");
    }
    let (status, stderr) = w.finish();
    assert!(status.success(), "{stderr}");
}

/// Moves every failed or timeout row to the bounce stage, as the failure bouncer does;
/// how many moved.
pub(super) fn move_failed(c: &mut Client) -> usize {
    let statuses = vec!["failed".to_string(), "timeout".to_string()];
    c.query(
        pepsi::db::sql::BOUNCE_FAILED,
        &[&"bounce", &statuses, &100i32],
    )
    .unwrap()
    .len()
}

/// A report, parsed.
pub(super) struct Parsed {
    /// The top-level header fields, raw.
    pub(super) top: Vec<(String, String)>,
    /// Per part: its content type, its transfer encoding and its raw contents.
    parts: Vec<(String, String, Vec<u8>)>,
    /// The per-message fields of the delivery-status part.
    per_message: Vec<(String, String)>,
    /// The per-recipient field groups.
    pub(super) per_recipient: Vec<Vec<(String, String)>>,
}

impl Parsed {
    pub(super) fn top(&self, name: &str) -> Option<&str> {
        field(&self.top, name)
    }

    fn types(&self) -> Vec<&str> {
        self.parts.iter().map(|(t, _, _)| t.as_str()).collect()
    }

    pub(super) fn human(&self) -> String {
        String::from_utf8(self.parts[0].2.clone()).unwrap()
    }
}

pub(super) fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The fields of a header-style block, by the independent parser.
fn fields_of(block: &[u8]) -> Vec<(String, String)> {
    let mut text = block.to_vec();
    text.extend_from_slice(b"\r\n");
    let m = MessageParser::default()
        .parse_headers(&text)
        .unwrap_or_else(|| panic!("fields: {}", String::from_utf8_lossy(block)));
    m.headers_raw()
        .map(|(n, v)| (n.to_string(), v.trim().to_string()))
        .collect()
}

/// Parses a report with the independent parser and checks its structure: a
/// `multipart/report; report-type=delivery-status` of a text part, a delivery-status
/// part and at most one more; every line within RFC 5322's 998 octets.
pub(super) fn parse(raw: &[u8]) -> Parsed {
    for line in raw.split(|&b| b == b'\n') {
        assert!(line.len() <= 999, "a line of {} octets", line.len());
    }
    let m = MessageParser::default().parse(raw).expect("a MIME message");
    let ct = m.root_part().content_type().expect("a content type");
    assert_eq!(
        (ct.ctype(), ct.subtype()),
        ("multipart", Some("report")),
        "{}",
        String::from_utf8_lossy(raw)
    );
    assert_eq!(ct.attribute("report-type"), Some("delivery-status"));
    let top: Vec<(String, String)> = m
        .headers_raw()
        .map(|(n, v)| (n.to_string(), v.trim().to_string()))
        .collect();
    let ids = m.root_part().sub_parts().expect("parts").to_vec();
    let parts: Vec<(String, String, Vec<u8>)> = ids
        .iter()
        .map(|&i| {
            let p = &m.parts[i as usize];
            let ct = p.content_type().expect("each part has a content type");
            let kind = format!("{}/{}", ct.ctype(), ct.subtype().unwrap_or(""));
            let cte = p.content_transfer_encoding().unwrap_or("").to_string();
            (
                kind.to_lowercase(),
                cte.to_lowercase(),
                p.contents().to_vec(),
            )
        })
        .collect();
    assert!(
        (2..=3).contains(&parts.len()),
        "{:?}",
        parts.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    assert!(parts[0].0 == "text/plain", "{}", parts[0].0);
    assert!(
        ["message/delivery-status", "message/global-delivery-status"].contains(&&*parts[1].0),
        "{}",
        parts[1].0
    );
    let report = parts[1].2.clone();
    let text = String::from_utf8(report).unwrap().replace("\r\n", "\n");
    let mut groups = text
        .trim_end()
        .split("\n\n")
        .map(|g| fields_of(g.replace('\n', "\r\n").as_bytes()));
    let per_message = groups.next().unwrap();
    let per_recipient = groups.collect();
    Parsed {
        top,
        parts,
        per_message,
        per_recipient,
    }
}

/// An RFC 5322 date, as seconds since 1970, by the independent parser.
fn epoch_of(date: &str) -> i64 {
    mail_parser::DateTime::parse_rfc822(date)
        .unwrap_or_else(|| panic!("not an RFC 5322 date: {date}"))
        .to_timestamp()
}

fn now_epoch() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn a_report_has_every_field_and_replaces_the_failed_message() {
    let (s, mut c) = scenario("bounce-fields", "").connect();
    let id = at_bounce(
        &mut c,
        &Original {
            from: "alice@origin.example",
            to: &["bob@dest.example", "Carol@Dest.example"],
            headers: Some(HEADERS),
            body: Some(BODY),
            state: json!({
                "failure_class": "permanent",
                "failed_stage": "relay",
                "last_error": "relay: /var/lib/pepsi/secret.key: permission denied on db01.internal",
                "dsn": {"envid": "ENV-42", "rcpt": {
                    "bob@dest.example": {"orcpt": "rfc822;Bob@Dest.Example"},
                    "carol@dest.example": {"notify": "FAILURE,DELAY"}
                }}
            }),
        },
    );
    let arrived: i64 = c
        .query_one(
            "SELECT extract(epoch FROM arrived)::int8 FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    bounce(&s.conf, &[id]);
    assert_eq!(row_at(&mut c, id), None, "the original is gone");
    let dsn = dsn_of(&mut c, id).expect("a report");
    assert_eq!(
        (dsn.stage.as_str(), dsn.status.as_str()),
        ("deliver", "pending")
    );
    assert_eq!(dsn.mail_from, "", "from the null sender");
    assert_eq!(dsn.rcpt_to, ["alice@origin.example"]);
    assert_eq!(
        dsn.header_from.as_deref(),
        Some("MAILER-DAEMON@mx.test.example")
    );
    assert_eq!(
        dsn.subject.as_deref(),
        Some("Undelivered Mail Returned to Sender")
    );
    assert!(dsn.state["dsn_created"].is_string(), "{}", dsn.state);
    assert_eq!(dsn.state["dsn_of"], json!(id));

    let p = parse(&dsn.raw);
    assert_eq!(p.top("From"), Some("MAILER-DAEMON@mx.test.example"));
    assert_eq!(p.top("To"), Some("<alice@origin.example>"));
    assert_eq!(
        p.top("Subject"),
        Some("Undelivered Mail Returned to Sender")
    );
    assert!((epoch_of(p.top("Date").unwrap()) - now_epoch()).abs() < 60);
    let message_id = p.top("Message-ID").unwrap();
    assert!(message_id.starts_with('<') && message_id.ends_with("@mx.test.example>"));
    assert_eq!(p.top("Auto-Submitted"), Some("auto-replied"));
    assert_eq!(p.top("In-Reply-To"), Some("<q4.figures@origin.example>"));
    assert_eq!(p.top("References"), Some("<q4.figures@origin.example>"));
    assert_eq!(p.top("MIME-Version"), Some("1.0"));
    assert_eq!(
        p.types(),
        ["text/plain", "message/delivery-status", "message/rfc822"]
    );

    assert_eq!(
        field(&p.per_message, "Reporting-MTA"),
        Some("dns; mx.test.example")
    );
    assert_eq!(
        field(&p.per_message, "Original-Envelope-Id"),
        Some("ENV-42")
    );
    assert!((epoch_of(field(&p.per_message, "Arrival-Date").unwrap()) - arrived).abs() <= 1);
    assert_eq!(p.per_recipient.len(), 2);
    let bob = &p.per_recipient[0];
    assert_eq!(
        field(bob, "Original-Recipient"),
        Some("rfc822;Bob@Dest.Example")
    );
    assert_eq!(
        field(bob, "Final-Recipient"),
        Some("rfc822; bob@dest.example")
    );
    assert_eq!(field(bob, "Action"), Some("failed"));
    assert_eq!(field(bob, "Status"), Some("5.0.0"));
    assert_eq!(field(bob, "Diagnostic-Code"), None, "no stage gave one");
    assert!((epoch_of(field(bob, "Last-Attempt-Date").unwrap()) - now_epoch()).abs() < 60);
    let carol = &p.per_recipient[1];
    assert_eq!(field(carol, "Original-Recipient"), None);
    assert_eq!(
        field(carol, "Final-Recipient"),
        Some("rfc822; Carol@Dest.example")
    );
    assert_eq!(field(carol, "Status"), Some("5.0.0"));

    let human = p.human();
    assert!(human.contains("bob@dest.example") && human.contains("Carol@Dest.example"));
    for secret in [
        "secret.key",
        "db01",
        "/var/lib",
        "permission denied",
        "relay",
    ] {
        assert_lacks!(human, secret, "the human part names {secret:?}");
        assert_lacks!(
            String::from_utf8_lossy(&dsn.raw[..dsn.raw.len() - p.parts[2].2.len()]),
            secret,
            "the report names {secret:?}"
        );
    }

    let original = MessageParser::default().parse(&p.parts[2].2).unwrap();
    assert_eq!(original.subject(), Some("Quarterly figures"));
    assert_eq!(original.message_id(), Some("q4.figures@origin.example"));
    let mut whole = HEADERS.to_vec();
    whole.extend_from_slice(b"\r\n");
    whole.extend_from_slice(BODY);
    assert_eq!(p.parts[2].2, whole, "the original, byte for byte");
}

#[test]
fn ret_and_the_size_limit_choose_the_whole_message_or_its_header() {
    let (sc, mut c) = scenario("bounce-ret", "BOUNCE_SIZE_LIMIT = 400\n").connect();
    let big = [b"x".repeat(100), b"\r\n".to_vec()].concat().repeat(5);
    let cases = [
        ("small, no RET", json!({}), BODY.to_vec(), "message/rfc822"),
        (
            "large, no RET",
            json!({}),
            big.clone(),
            "text/rfc822-headers",
        ),
        (
            "large, RET=FULL",
            json!({"dsn": {"ret": "FULL"}}),
            big.clone(),
            "message/rfc822",
        ),
        (
            "small, RET=HDRS",
            json!({"dsn": {"ret": "HDRS"}}),
            BODY.to_vec(),
            "text/rfc822-headers",
        ),
    ];
    for (what, state, body, kind) in cases {
        let mut s = state;
        s["failure_class"] = json!("permanent");
        let id = at_bounce(
            &mut c,
            &Original {
                body: Some(&body),
                ..Original::simple(s)
            },
        );
        bounce(&sc.conf, &[id]);
        let p = parse(&dsn_of(&mut c, id).expect(what).raw);
        assert_eq!(p.parts[2].0, kind, "{what}");
        let mut expected = HEADERS.to_vec();
        if kind == "message/rfc822" {
            expected.extend_from_slice(b"\r\n");
            expected.extend_from_slice(&body);
        }
        assert_eq!(p.parts[2].2, expected, "{what}");
    }
}

#[test]
fn notify_decides_who_is_told_and_never_suppresses() {
    let (s, mut c) = scenario("bounce-notify", "").connect();
    let never = at_bounce(
        &mut c,
        &Original::simple(json!({"failure_class": "permanent",
            "dsn": {"rcpt": {"bob@dest.example": {"notify": "NEVER"}}}})),
    );
    let success_delay = at_bounce(
        &mut c,
        &Original::simple(json!({"failure_class": "permanent",
            "dsn": {"rcpt": {"BOB@dest.example": {"notify": "SUCCESS,DELAY"}}}})),
    );
    let two = at_bounce(
        &mut c,
        &Original {
            to: &["bob@dest.example", "dave@dest.example"],
            ..Original::simple(json!({"failure_class": "permanent", "dsn": {
            "envid": "QQ314159",
            "rcpt": {
                "bob@dest.example": {"notify": "NEVER"},
                "dave@dest.example": {"notify": "FAILURE", "orcpt": "rfc822;dave@old.example"}
            }}}))
        },
    );
    bounce(&s.conf, &[never, success_delay, two]);
    for id in [never, success_delay, two] {
        assert_eq!(row_at(&mut c, id), None, "message {id} is done");
    }
    assert!(dsn_of(&mut c, never).is_none(), "NEVER: no report");
    assert!(
        dsn_of(&mut c, success_delay).is_none(),
        "SUCCESS,DELAY: no report"
    );
    let p = parse(&dsn_of(&mut c, two).expect("a report for dave").raw);
    assert_eq!(p.per_recipient.len(), 1);
    assert_eq!(
        field(&p.per_recipient[0], "Final-Recipient"),
        Some("rfc822; dave@dest.example")
    );
    assert_eq!(
        field(&p.per_recipient[0], "Original-Recipient"),
        Some("rfc822;dave@old.example")
    );
    assert_eq!(
        field(&p.per_message, "Original-Envelope-Id"),
        Some("QQ314159")
    );
    assert!(!p.human().contains("bob@dest.example"));
    let rows = queue_len(&mut c);
    assert_eq!(rows, 1, "only dave's report is left");
}

#[test]
fn a_bounce_or_a_list_copy_is_never_bounced() {
    let (s, mut c) = scenario("bounce-never", "").connect();
    let null_sender = at_bounce(
        &mut c,
        &Original {
            from: "",
            ..Original::simple(json!({"failure_class": "permanent"}))
        },
    );
    let list_copy = at_bounce(
        &mut c,
        &Original::simple(json!({"failure_class": "permanent", "list_copy": true})),
    );
    bounce(&s.conf, &[null_sender, list_copy]);
    for id in [null_sender, list_copy] {
        assert_eq!(row_at(&mut c, id), None);
        assert!(dsn_of(&mut c, id).is_none());
    }
    let rows = queue_len(&mut c);
    assert_eq!(rows, 0);
}

#[test]
fn a_sender_that_is_not_one_valid_mailbox_gets_no_report_and_its_row_is_deleted() {
    let (s, mut c) = scenario("bounce-sender", "").connect();
    let senders = [
        // A second recipient smuggled into the report's To:.
        "a@x>, <evil@y.example",
        // A header line of its own.
        "a@x.example\r\nBcc: evil@y.example",
        // Text that reads backwards, and a line separator.
        "a\u{202e}moc.elpmaxe@x.example",
        "a@x.example\u{2028}Bcc: evil@y.example",
        "a\u{1b}[2J@x.example",
        "root",
    ];
    let mut ids = Vec::new();
    for from in senders {
        let id = at_bounce(
            &mut c,
            &Original::simple(json!({"failure_class": "permanent"})),
        );
        // Set afterwards, as any writer of the queue could have left it.
        c.execute(
            "UPDATE pepsi.workqueue SET mail_from = $2 WHERE workqueue_id = $1",
            &[&id, &from],
        )
        .unwrap();
        ids.push(id);
    }
    let mut w = Worker::ready(&stage("bounce"), &s.conf);
    for line in w.run(&ids) {
        assert_eq!(code(&line), 0, "{line}");
    }
    let (status, log) = w.finish();
    assert!(status.success(), "{log}");
    for (id, from) in ids.iter().zip(senders) {
        assert_eq!(row_at(&mut c, *id), None, "{from:?}: the row is gone");
        assert!(dsn_of(&mut c, *id).is_none(), "{from:?}: no report");
        let said = log
            .lines()
            .find(|l| l.contains(&format!("message {id}: its sender <")))
            .unwrap_or_else(|| panic!("no line for message {id} ({from:?}):\n{log}"));
        assert!(said.contains("not a valid mailbox"), "{said}");
    }
    assert_eq!(queue_len(&mut c), 0, "nothing was queued");
    for shown in [
        "<a@x>, <evil@y.example>",
        "<a@x.example\\r\\nBcc: evil@y.example>",
        "<a\\u{202e}moc.elpmaxe@x.example>",
        "<a@x.example\\u{2028}Bcc: evil@y.example>",
        "<a\\u{1b}[2J@x.example>",
    ] {
        assert!(log.contains(shown), "{shown} in:\n{log}");
    }
    assert_lacks!(
        log,
        ['\r', '\u{1b}', '\u{202e}', '\u{2028}'],
        "the log shows the senders escaped"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("Bcc:")),
        "no forged log line:\n{log}"
    );
}

#[test]
fn a_header_block_without_its_last_line_end_keeps_the_body_out_of_the_attached_headers() {
    let (s, mut c) = scenario("bounce-block-end", "").connect();
    // Stored without the line end of its last line; the body's first lines look like
    // header fields.
    let headers = b"From: Alice <alice@origin.example>\r\nSubject: Quarterly figures";
    let body = b"Bcc: evil@elsewhere.example\r\nX-Injected: yes\r\n\r\nThe figures.\r\n";
    for (ret, kind) in [("FULL", "message/rfc822"), ("HDRS", "text/rfc822-headers")] {
        let id = at_bounce(
            &mut c,
            &Original {
                headers: Some(headers),
                body: Some(body),
                ..Original::simple(json!({"failure_class": "permanent", "dsn": {"ret": ret}}))
            },
        );
        bounce(&s.conf, &[id]);
        let p = parse(&dsn_of(&mut c, id).expect("a report").raw);
        assert_eq!(p.parts[2].0, kind, "RET={ret}");
        let attached = &p.parts[2].2;
        let fields = if kind == "message/rfc822" {
            let original = MessageParser::default().parse(attached).unwrap();
            assert_eq!(original.subject(), Some("Quarterly figures"));
            let text = original.body_text(0).expect("a body");
            assert!(
                text.starts_with("Bcc: evil@elsewhere.example\r\nX-Injected: yes"),
                "the body stays the body: {text:?}"
            );
            original
                .headers_raw()
                .map(|(n, _)| n.to_string())
                .collect::<Vec<_>>()
        } else {
            assert_lacks!(
                String::from_utf8_lossy(attached),
                "evil",
                "no body in the header part"
            );
            fields_of(attached).into_iter().map(|(n, _)| n).collect()
        };
        assert_eq!(fields, ["From", "Subject"], "RET={ret}");
    }
}

#[test]
fn a_report_that_fails_later_is_moved_back_and_discarded_without_a_second() {
    let (s, mut c) = scenario("bounce-again", "").connect();
    let id = at_bounce(
        &mut c,
        &Original::simple(json!({"failure_class": "permanent"})),
    );
    bounce(&s.conf, &[id]);
    let dsn = dsn_of(&mut c, id).expect("a report");
    // Its delivery fails for good.
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed', \
                state = state || '{\"failure_class\": \"permanent\"}' WHERE workqueue_id = $1",
        &[&dsn.id],
    )
    .unwrap();
    let moved = move_failed(&mut c);
    assert_eq!(moved, 1);
    assert_eq!(
        row_at(&mut c, dsn.id),
        Some(("bounce".into(), "pending".into()))
    );
    claim(&mut c, &[dsn.id]);
    bounce(&s.conf, &[dsn.id]);
    assert_eq!(row_at(&mut c, dsn.id), None, "discarded");
    assert!(dsn_of(&mut c, dsn.id).is_none(), "no report of a report");
    let rows = queue_len(&mut c);
    assert_eq!(rows, 0);
}

/// The status a recipient reads for a row in this state.
fn status_for(c: &mut Client, conf: &std::path::Path, state: Value) -> (String, Option<String>) {
    let id = at_bounce(c, &Original::simple(state));
    bounce(conf, &[id]);
    let p = parse(&dsn_of(c, id).expect("a report").raw);
    let r = &p.per_recipient[0];
    (
        field(r, "Status").unwrap().to_string(),
        field(r, "Diagnostic-Code").map(str::to_string),
    )
}

#[test]
fn each_failure_class_gives_its_status_and_a_stage_given_one_wins() {
    let (s, mut c) = scenario("bounce-status", "").connect();
    for (class, status) in [
        ("permanent", "5.0.0"),
        ("retries-exhausted", "4.4.7"),
        ("looped", "5.4.6"),
        ("crashed", "5.3.0"),
        ("timed-out", "5.3.0"),
        ("unreadable", "5.3.0"),
        ("unwritable", "5.3.0"),
    ] {
        assert_eq!(
            status_for(&mut c, &s.conf, json!({ "failure_class": class })),
            (status.to_string(), None),
            "{class}"
        );
    }
    assert_eq!(
        status_for(
            &mut c,
            &s.conf,
            json!({"failure_class": "permanent", "dsn_status": "5.1.1",
                   "dsn_diagnostic": "smtp; 550 5.1.1 <bob@dest.example>: user unknown"})
        ),
        (
            "5.1.1".to_string(),
            Some("smtp; 550 5.1.1 <bob@dest.example>: user unknown".to_string())
        )
    );
}

/// The status of a row that really went each way to the bounce stage: a stage's
/// permanent error, MAX_LIFETIME spent (a host error past it moves the row straight
/// to BOUNCE_STAGE), three crashes and three hangs (moved by the bouncer's function).
#[test]
fn rows_failed_each_way_give_the_documented_status() {
    let b = Scenario::new("bounce-ways");
    let script = b.dir().write("fail67", "#!/bin/sh\nexit 67\n");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (s, mut c) = with_bounce(
        b,
        &format!(
            "\n[stage-hard]\nPROGRAM = {{exec}}\nCOMMAND = {}\n\
             [stage-soft]\nPROGRAM = {{exec}}\nCOMMAND = /bin/false\nMAX_LIFETIME = 1s\nBOUNCE_STAGE = bounce\n",
            script.display()
        ),
    )
    .connect();
    let inject_at = |c: &mut Client, stage: &str| -> i64 {
        let id: i64 = c
            .query_one(
                "SELECT pepsi.workqueue_inject($1, 'alice@origin.example', ARRAY['bob@dest.example'], $2, $3)",
                &[&stage, &HEADERS, &BODY],
            )
            .unwrap()
            .get(0);
        c.execute(
            "UPDATE pepsi.workqueue SET arrived = now() - interval '1 hour' WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap();
        claim(c, &[id]);
        id
    };
    let hard = inject_at(&mut c, "hard");
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    assert_eq!(code(&w.run(&[hard])[0]), 65, "a permanent failure");
    let soft = inject_at(&mut c, "soft");
    assert_eq!(code(&w.run(&[soft])[0]), 0, "moved to the bounce stage");
    w.finish();
    assert_eq!(row_at(&mut c, hard), Some(("hard".into(), "failed".into())));
    assert_eq!(
        row_at(&mut c, soft),
        Some(("bounce".into(), "pending".into()))
    );
    assert_eq!(state_of(&mut c, soft)["failure_class"], "retries-exhausted");
    let strike = |c: &mut Client, kind: &str| -> i64 {
        let id = inject_at(c, "hard");
        let token = crate::util::tokens(c, &[id])[0];
        for _ in 0..3 {
            c.execute(
                "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap();
            c.query(
                "SELECT * FROM pepsi.workqueue_strike($1, 'hard', $2, 'worker died', $3)",
                &[&id, &kind, &token],
            )
            .unwrap();
        }
        id
    };
    let crashed = strike(&mut c, "crashed");
    let hung = strike(&mut c, "timed-out");
    assert_eq!(
        row_at(&mut c, crashed),
        Some(("hard".into(), "failed".into()))
    );
    assert_eq!(
        row_at(&mut c, hung),
        Some(("hard".into(), "timeout".into()))
    );
    let moved = move_failed(&mut c);
    assert_eq!(moved, 3);
    let ids = [hard, soft, crashed, hung];
    claim(&mut c, &ids);
    bounce(&s.conf, &ids);
    let mut statuses = Vec::new();
    for id in ids {
        let p = parse(&dsn_of(&mut c, id).expect("a report").raw);
        statuses.push(field(&p.per_recipient[0], "Status").unwrap().to_string());
        assert!(!p.human().contains("worker died"));
    }
    // The permanent failure is exit 67 (EX_NOUSER), which reads as Postfix's pipe(8)
    // reports it.
    assert_eq!(statuses, ["5.1.1", "4.4.7", "5.3.0", "5.3.0"]);
}

#[test]
fn eight_bit_bodies_and_utf8_headers_survive_intact() {
    let (s, mut c) = scenario("bounce-utf8", "").connect();
    let headers = "From: Jürgen <jürgen@bücher.example>\r\nTo: zoë@dest.example\r\n\
                   Subject: Grüße aus Köln – 東京\r\nMessage-ID: <utf8.1@bücher.example>\r\n"
        .as_bytes()
        .to_vec();
    let mut body = "Liebe Zoë,\r\nschöne Grüße.\r\n".as_bytes().to_vec();
    body.extend_from_slice(b"Latin-1: \xe9t\xe9\r\n");
    let id = at_bounce(
        &mut c,
        &Original {
            from: "jürgen@bücher.example",
            to: &["zoë@dest.example"],
            headers: Some(&headers),
            body: Some(&body),
            state: json!({"failure_class": "permanent",
                          "dsn": {"rcpt": {"zoë@dest.example": {"orcpt": "utf-8;zoë@dest.example"}}}}),
        },
    );
    bounce(&s.conf, &[id]);
    let dsn = dsn_of(&mut c, id).expect("a report");
    assert_eq!(dsn.rcpt_to, ["jürgen@bücher.example"]);
    let p = parse(&dsn.raw);
    assert_eq!(p.top("To"), Some("<jürgen@bücher.example>"), "RFC 6532");
    assert_eq!(
        p.types(),
        [
            "text/plain",
            "message/global-delivery-status",
            "message/global"
        ]
    );
    assert_eq!(p.parts[2].1, "8bit");
    assert_eq!(
        field(&p.per_recipient[0], "Final-Recipient"),
        Some("utf-8; zoë@dest.example"),
        "RFC 6533"
    );
    assert_eq!(
        field(&p.per_recipient[0], "Original-Recipient"),
        Some("utf-8;zoë@dest.example")
    );
    let mut whole = headers.clone();
    whole.extend_from_slice(b"\r\n");
    whole.extend_from_slice(&body);
    assert_eq!(p.parts[2].2, whole, "byte for byte");
    let original = MessageParser::default().parse(&p.parts[2].2).unwrap();
    assert_eq!(original.subject(), Some("Grüße aus Köln – 東京"));
    assert!(p.human().contains("zoë@dest.example"));

    // The same header as ASCII with a body of 8-bit bytes: message/rfc822, 8bit.
    let id = at_bounce(
        &mut c,
        &Original {
            body: Some(b"caf\xe9 cr\xe8me\r\n"),
            ..Original::simple(json!({"failure_class": "permanent"}))
        },
    );
    bounce(&s.conf, &[id]);
    let p = parse(&dsn_of(&mut c, id).unwrap().raw);
    assert_eq!(
        p.types()[1..],
        ["message/delivery-status", "message/rfc822"]
    );
    assert_eq!(p.parts[2].1, "8bit");
    assert!(p.parts[2].2.ends_with(b"caf\xe9 cr\xe8me\r\n"));
}

#[test]
fn bad_originals_still_give_a_report_and_never_a_crash() {
    let (s, mut c) = scenario("bounce-bad", "").connect();
    let several_mb: Vec<u8> =
        b"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\r\n".repeat(80_000);
    let long_line = [b"x".repeat(5000), b"\r\n".to_vec()].concat();
    /// What, its header block and body, its state, and what the report attaches.
    type Case<'a> = (&'a str, Option<&'a [u8]>, Option<&'a [u8]>, Value, &'a str);
    let cases: Vec<Case<'_>> = vec![
        ("no header block", None, Some(BODY), json!({}), "none"),
        (
            "not RFC 5322",
            Some(b" folded first\r\nno colon at all\r\n"),
            Some(BODY),
            json!({}),
            "none",
        ),
        (
            "several MB, no RET",
            Some(HEADERS),
            Some(&several_mb),
            json!({}),
            "text/rfc822-headers",
        ),
        (
            "several MB, RET=FULL",
            Some(HEADERS),
            Some(&several_mb),
            json!({"dsn": {"ret": "FULL"}}),
            "message/rfc822",
        ),
        (
            "a 5000-octet line, RET=FULL",
            Some(HEADERS),
            Some(&long_line),
            json!({"dsn": {"ret": "FULL"}}),
            "text/rfc822-headers",
        ),
        (
            "a NUL in the body",
            Some(HEADERS),
            Some(b"a\0b\r\n"),
            json!({}),
            "text/rfc822-headers",
        ),
        ("no body", Some(HEADERS), None, json!({}), "message/rfc822"),
    ];
    let mut w = Worker::ready(&stage("bounce"), &s.conf);
    for (what, headers, body, mut state, attached) in cases {
        state["failure_class"] = json!("permanent");
        let id = at_bounce(
            &mut c,
            &Original {
                headers,
                body,
                ..Original::simple(state)
            },
        );
        let line = w.run(&[id]).remove(0);
        assert_eq!(code(&line), 0, "{what}: {line}");
        assert_eq!(row_at(&mut c, id), None, "{what}");
        let p = parse(
            &dsn_of(&mut c, id)
                .unwrap_or_else(|| panic!("{what}: a report"))
                .raw,
        );
        match attached {
            "none" => {
                assert_eq!(p.parts.len(), 2, "{what}");
                assert!(p.human().contains("could not be attached"), "{what}");
            }
            kind => assert_eq!(p.parts[2].0, kind, "{what}"),
        }
    }
    let (status, stderr) = w.finish();
    assert!(status.success(), "{stderr}");
}

#[test]
fn a_bounce_stage_without_next_or_with_a_bad_limit_does_not_start() {
    let db = TestDb::new();
    let dir = TempDir::new("bounce-config");
    for (section, named) in [
        (
            "NEXT = deliver\nBOUNCE_SIZE_LIMIT = lots\n",
            "BOUNCE_SIZE_LIMIT",
        ),
        ("BOUNCE_SIZE_LIMIT = 100\n", "NEXT"),
    ] {
        let conf = write_config(
            &dir,
            &db,
            &format!(
                "[stage-bounce]\nPROGRAM = {}\n{section}[stage-deliver]\nPROGRAM = {}\n",
                stage("bounce").display(),
                stage("discard").display()
            ),
        );
        let mut w = Worker::start(&stage("bounce"), &conf);
        let (status, stderr) = w.finish();
        assert_eq!(status.code(), Some(78), "{stderr}");
        assert_has!(stderr, &format!("[stage-bounce] {named}"));
    }
}

/// End to end: the dispatcher runs a relay (exec) that refuses one recipient domain for
/// good; the failure bouncer moves the failed messages to the bounce stage; their
/// reports are delivered by an exec stage into a folder. Each file is a report about
/// exactly the refused recipients of one message; nothing else is bounced: not the
/// delivered mail, not a failed notification (moved back and discarded), not a list
/// copy.
#[test]
fn end_to_end_a_refused_domain_is_reported_to_its_senders_and_nothing_else() {
    use crate::util::bouncer::Bouncer;

    let b = Scenario::new("bounce-e2e");
    let mail = b.dir().path("mail");
    let bounces = b.dir().path("bounces");
    crate::util::shared_dir(&mail);
    crate::util::shared_dir(&bounces);
    let relay = b.dir().write(
        "relay",
        &format!(
            "#!/bin/sh\ncase \",$PEPSI_RECIPIENTS,\" in\n  *@refused.example,*) echo 'refused.example refuses mail' >&2; exit 67 ;;\nesac\ncat > {}/$PEPSI_ID.eml\n",
            mail.display()
        ),
    );
    let deliver = b.dir().write(
        "deliver-bounce",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID.eml\n", bounces.display()),
    );
    for script in [&relay, &deliver] {
        std::fs::set_permissions(script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }
    let s = with_exec_relay_and_reports(b, &relay, "", &deliver);

    let mut c = s.client();
    let inject = |c: &mut Client, from: &str, to: &[&str], state: Value| -> i64 {
        let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
        c.query_one(
            "SELECT pepsi.workqueue_inject('relay', $1, $2, $3, $4, NULL, NULL, NULL, NULL, $5::text::jsonb)",
            &[&from, &to, &HEADERS, &BODY, &state.to_string()],
        )
        .unwrap()
        .get(0)
    };
    let mut delivered = Vec::new();
    for i in 0..20 {
        delivered.push(inject(
            &mut c,
            &format!("s{i}@ok-sender.example"),
            &[&format!("r{i}@ok.example")],
            json!({}),
        ));
    }
    inject(&mut c, "ann@a.example", &["x@refused.example"], json!({}));
    inject(
        &mut c,
        "ben@b.example",
        &["p@refused.example", "q@refused.example"],
        json!({"dsn": {"envid": "BEN-1"}}),
    );
    let failed_dsn = inject(&mut c, "", &["z@refused.example"], json!({}));
    inject(
        &mut c,
        "list-bounces@lists.example",
        &["m@refused.example"],
        json!({"list_copy": true}),
    );

    let mut d = s.start();
    let mut b = Bouncer::ready(&s.conf, &[]);
    crate::util::wait_until(Duration::from_secs(60), "the queue is empty", || {
        queue_len(&mut c) == 0
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert!(b.terminate().success(), "{}", b.log());

    let files = |dir: &std::path::Path| -> Vec<Vec<u8>> {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        names.iter().map(|p| std::fs::read(p).unwrap()).collect()
    };
    assert_eq!(
        files(&mail).len(),
        delivered.len(),
        "the good mail was delivered"
    );
    let reports = files(&bounces);
    let mut seen: Vec<(String, Vec<String>)> = reports
        .iter()
        .map(|raw| {
            let p = parse(raw);
            let finals = p
                .per_recipient
                .iter()
                .map(|r| field(r, "Final-Recipient").unwrap().to_string())
                .collect();
            for r in &p.per_recipient {
                assert_eq!(field(r, "Action"), Some("failed"));
                // Exit 67, EX_NOUSER.
                assert_eq!(field(r, "Status"), Some("5.1.1"));
                assert_eq!(field(r, "Diagnostic-Code"), None, "no last_error");
            }
            assert!(!p.human().contains("refuses mail"), "no last_error");
            (p.top("To").unwrap().to_string(), finals)
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            (
                "<ann@a.example>".to_string(),
                vec!["rfc822; x@refused.example".to_string()]
            ),
            (
                "<ben@b.example>".to_string(),
                vec![
                    "rfc822; p@refused.example".to_string(),
                    "rfc822; q@refused.example".to_string()
                ]
            ),
        ],
        "one report per failed message with a sender, naming exactly its refused recipients"
    );
    assert_has!(
        b.log(),
        &format!("message {failed_dsn} "),
        "the failed notification went through the bouncer"
    );
}

/// Before random boundaries, a sender who knew a message's id and claim planted every
/// boundary the report would try: 60,000 of them in an 8.9 MB `RET=FULL` message kept
/// the bounce worker scanning until it was killed at `MAX_RUNTIME`, and after three
/// strikes the report was never sent.
#[test]
fn a_message_full_of_planted_boundaries_is_bounced_at_once() {
    let (s, mut c) = scenario("bounce-planted", "").connect();
    let id = at_bounce(
        &mut c,
        &Original::simple(json!({"failure_class": "permanent", "dsn": {"ret": "FULL"}})),
    );
    let token = crate::util::tokens(&mut c, &[id])[0];
    // Every boundary the old scheme would have tried, a line each, padded to 8.9 MB.
    let mut body = Vec::with_capacity(9_000_000);
    for n in 0..60_000 {
        body.extend_from_slice(format!("--=_pepsi-report-{id}.{token}-{n}\r\n").as_bytes());
        body.extend_from_slice(&[b'x'; 100]);
        body.extend_from_slice(b"\r\n");
    }
    c.execute(
        "UPDATE pepsi.workqueue_body SET body = $2 \
          WHERE body_id = (SELECT body_id FROM pepsi.workqueue WHERE workqueue_id = $1)",
        &[&id, &body],
    )
    .unwrap();
    // One answer within the worker's line timeout (30 s), where the old worker ran
    // until it was killed.
    bounce(&s.conf, &[id]);
    let dsn = dsn_of(&mut c, id).expect("a report");
    let text = String::from_utf8_lossy(&dsn.raw);
    let at = text.find("boundary=\"").unwrap() + "boundary=\"".len();
    let boundary = text[at..].split('"').next().unwrap();
    // None of the planted ones: 128 random bits, nothing of the id or the claim.
    let random = boundary
        .strip_prefix("=_pepsi-report-")
        .unwrap_or_else(|| panic!("{boundary}"));
    assert!(
        random.len() == 32 && random.bytes().all(|b| b.is_ascii_hexdigit()),
        "{boundary}"
    );
    assert!(!boundary.contains(&token.to_string()), "{boundary}");
    // The original is attached whole, and the report reads as three parts.
    let parsed = parse(&dsn.raw);
    assert_eq!(parsed.parts.len(), 3);
    assert_eq!(parsed.parts[2].2.len(), HEADERS.len() + 2 + body.len());
}
