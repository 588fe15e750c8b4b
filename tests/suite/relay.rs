//! The relay stage (§17): `pepsi-stage-relay` workers run by the dispatcher
//! against a scripted smarthost (`tests/util/smarthost.rs`), which counts connections
//! and records every command and every message it took.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use postgres::Client;
use serde_json::{Value, json};

use crate::util::bouncer::Bouncer;
use crate::util::rows::{due_now, queue_len, wait_empty};
use crate::util::scenario::Scenario;
use crate::util::smarthost::{Script, Smarthost};
use crate::util::worker::{Worker, code};
use crate::util::{assert_has, assert_lacks, claim, stage, state_of, wait_until};

const WAIT: Duration = Duration::from_secs(20);

const HEADERS: &[u8] = b"From: Alice <alice@origin.example>\r\n\
To: a@dest.example\r\n\
Subject: Figures\r\n\
Message-ID: <f1@origin.example>\r\n";
const BODY: &[u8] = b"The figures.\r\n.a line with a dot\r\n\r\n-- \r\nAlice\r\n";

/// The relay stage to `smarthost` (then done), a bounce stage whose reports go out
/// through the same relay, and the failure bouncer's section; `extra` lines go into
/// `[stage-relay]`.
fn stages(smarthost: &Smarthost, extra: &str) -> String {
    format!(
        "[stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {}\n{extra}\n\
         [stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = relay\n\n\
         [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
        smarthost.address
    )
}

/// Injects a message at `relay` with these headers, body, state, client address and
/// login.
fn inject_at_relay(
    c: &mut Client,
    from: &str,
    to: &[&str],
    (headers, body): (&[u8], &[u8]),
    state: Value,
    (ip, login): (Option<&str>, Option<&str>),
) -> i64 {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    c.query_one(
        "SELECT pepsi.workqueue_inject('relay', $1, $2, $3, $4, $5, $6::text::inet, NULL, NULL, $7::text::jsonb)",
        &[&from, &to, &headers, &body, &login, &ip, &state.to_string()],
    )
    .unwrap()
    .get(0)
}

/// Injects the standard message from alice to `to`.
fn inject(c: &mut Client, to: &[&str]) -> i64 {
    inject_at_relay(
        c,
        "alice@origin.example",
        to,
        (HEADERS, BODY),
        json!({}),
        (None, None),
    )
}

/// The message as stored: header block, the blank line, the body.
fn stored(headers: &[u8], body: &[u8]) -> Vec<u8> {
    [headers, b"\r\n", body].concat()
}

/// The paused rows at `relay`: (id, recipients).
fn paused(c: &mut Client) -> Vec<(i64, Vec<String>)> {
    c.query(
        "SELECT workqueue_id, rcpt_to FROM pepsi.workqueue WHERE stage = 'relay' AND status = 'paused' ORDER BY 1",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// A header-style field of a report, its folded lines joined.
fn fields(text: &str, name: &str) -> Vec<String> {
    let unfolded = text.replace("\r\n ", " ").replace("\r\n\t", " ");
    unfolded
        .lines()
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
        .collect()
}

#[test]
fn each_recipient_gets_its_own_result_delivered_refused_with_a_report_or_retried_alone() {
    let host = Smarthost::start(
        Script::default()
            .rcpt(
                "c@dest.example",
                &["550 5.1.1 <c@dest.example>: user unknown"],
            )
            .rcpt("b@dest.example", &["451 4.3.0 try again later"]),
    );
    let (s, mut c) = Scenario::new("relay-mixed")
        .pepsi("HOSTNAME = pepsi.test.example\n")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let id = inject(
        &mut c,
        &["a@dest.example", "b@dest.example", "c@dest.example"],
    );
    let mut d = s.start();
    let mut bouncer = Bouncer::ready(&s.conf, &[]);

    // a is delivered, b waits alone, c's report goes to alice from the null sender.
    wait_until(WAIT, "a delivered, b paused and c reported", || {
        host.deliveries("a@dest.example") == 1
            && host.deliveries("alice@origin.example") == 1
            && paused(&mut c).len() == 1
    });
    let waiting = paused(&mut c);
    assert_eq!(waiting[0].1, vec!["b@dest.example"], "b waits alone");
    let state = state_of(&mut c, waiting[0].0);
    assert_eq!(state["temporary_failures"], 1, "{state}");
    assert_has!(
        state["last_error"].as_str().unwrap(),
        "451 4.3.0 try again later",
        "{state}"
    );
    assert!(state.get("recipient_outcomes").is_none(), "{state}");
    assert_eq!(host.deliveries("b@dest.example"), 0);

    let report = {
        let seen = host.seen();
        let dsn = seen
            .messages
            .iter()
            .find(|m| m.delivered == ["alice@origin.example"])
            .unwrap()
            .clone();
        assert!(dsn.mail.starts_with("MAIL FROM:<> "), "{}", dsn.mail);
        String::from_utf8(dsn.data).unwrap()
    };
    assert_eq!(
        fields(&report, "Final-Recipient"),
        vec!["rfc822; c@dest.example"],
        "only the refused recipient: {report}"
    );
    assert_eq!(fields(&report, "Status"), vec!["5.1.1"], "{report}");
    assert_eq!(
        fields(&report, "Diagnostic-Code"),
        vec!["smtp; 550 5.1.1 <c@dest.example>: user unknown"],
        "{report}"
    );

    // The retry, made due now, delivers b alone.
    due_now(&mut c, waiting[0].0);
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    assert!(bouncer.terminate().success(), "{}", bouncer.log());
    for (rcpt, times) in [
        ("a@dest.example", 1),
        ("b@dest.example", 1),
        ("c@dest.example", 0),
        ("alice@origin.example", 1),
    ] {
        assert_eq!(host.deliveries(rcpt), times, "{rcpt}");
    }
    let seen = host.seen();
    let original = stored(HEADERS, BODY);
    let copies: Vec<_> = seen
        .messages
        .iter()
        .filter(|m| m.data == original)
        .collect();
    assert_eq!(copies.len(), 2, "a's and b's transfers, byte for byte");
    assert_eq!(
        seen.commands
            .iter()
            .filter(|c| c.starts_with("RCPT TO:<c@"))
            .count(),
        1
    );
    assert_has!(
        d.log(),
        &format!("message {id}: recipients with different results split")
    );
}

#[test]
fn a_connection_dropped_in_the_middle_of_the_data_is_retried_and_delivered_once() {
    let host = Smarthost::start(Script {
        drop_mid_data: 1,
        ..Script::default()
    });
    let (s, mut c) = Scenario::new("relay-drop")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let id = inject(&mut c, &["a@dest.example", "b@dest.example"]);
    let mut d = s.start();
    wait_until(WAIT, "the message is paused", || !paused(&mut c).is_empty());
    assert_eq!(
        paused(&mut c),
        vec![(
            id,
            vec!["a@dest.example".to_string(), "b@dest.example".to_string()]
        )]
    );
    let state = state_of(&mut c, id);
    assert!(
        state["last_error"]
            .as_str()
            .unwrap()
            .starts_with(&format!("smarthost {}: ", host.address)),
        "{state}"
    );
    assert_eq!(host.seen().messages.len(), 0);
    due_now(&mut c, id);
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    let seen = host.seen();
    assert_eq!(seen.messages.len(), 1, "delivered exactly once");
    assert_eq!(
        seen.messages[0].delivered,
        ["a@dest.example", "b@dest.example"]
    );
    assert_eq!(seen.messages[0].data, stored(HEADERS, BODY));
    assert_eq!(seen.connections, 2, "the lost connection was replaced");
}

#[test]
fn a_250_to_data_delivers_nothing_the_message_is_retried_on_a_new_connection() {
    let host = Smarthost::start(Script {
        data_replies: ["250 2.0.0 queued".to_string()].into(),
        ..Script::default()
    });
    let (s, mut c) = Scenario::new("relay-data-250")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let id = inject(&mut c, &["a@dest.example", "b@dest.example"]);
    let mut d = s.start();
    wait_until(WAIT, "the message is paused", || !paused(&mut c).is_empty());
    let waiting = paused(&mut c);
    assert_eq!(waiting[0].1.len(), 2, "no recipient done");
    let state = state_of(&mut c, waiting[0].0);
    assert_has!(
        state["last_error"].as_str().unwrap(),
        "protocol error: the smarthost answered DATA with 250",
        "{id} {state}"
    );
    assert_eq!(host.seen().messages.len(), 0);
    due_now(&mut c, waiting[0].0);
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    let seen = host.seen();
    assert_eq!(seen.messages.len(), 1, "delivered once, on the retry");
    assert_eq!(
        seen.messages[0].delivered,
        ["a@dest.example", "b@dest.example"]
    );
    assert_eq!(seen.connections, 2, "the broken connection was not kept");
}

#[test]
fn fifty_messages_go_over_one_kept_connection() {
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("relay-reuse")
        .timers("")
        .stages(&stages(&host, "PARALLELISM = 1\nQUEUE_LIMIT = 8\n"))
        .connect();
    for i in 0..50 {
        inject(&mut c, &[&format!("r{i}@dest.example")]);
    }
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    let seen = host.seen();
    assert_eq!(seen.messages.len(), 50);
    assert_eq!(seen.connections, 1, "one connection for all");
    let count = |verb: &str| seen.commands.iter().filter(|c| c.starts_with(verb)).count();
    assert_eq!(count("EHLO"), 1);
    assert_eq!(count("RSET"), 49, "RSET between messages");
}

#[test]
fn eight_bit_utf8_and_large_messages_arrive_byte_for_byte_with_their_parameters() {
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("relay-bytes")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let latin: &[u8] = b"Caf\xe9 cr\xe8me, 8-bit as stored.\r\n";
    let utf8_headers = "From: J\u{f6}rg <j\u{f6}rg@origin.example>\r\nSubject: Gr\u{fc}\u{df}e\r\n";
    let mut big = Vec::new();
    while big.len() < 2 << 20 {
        big.extend_from_slice(
            b".leading dot and a long enough line of text to fill the message\r\n",
        );
    }
    let dsn = json!({"dsn": {"ret": "HDRS", "envid": "ENV 1+",
        "rcpt": {"r@dest.example": {"notify": "SUCCESS,FAILURE", "orcpt": "rfc822;R@dest.example"}}}});
    inject_at_relay(
        &mut c,
        "alice@origin.example",
        &["r@dest.example"],
        (HEADERS, latin),
        dsn,
        (Some("192.0.2.7"), Some("alice")),
    );
    inject_at_relay(
        &mut c,
        "j\u{f6}rg@origin.example",
        &["\u{fc}ber@dest.example"],
        (utf8_headers.as_bytes(), BODY),
        json!({}),
        (None, None),
    );
    inject_at_relay(
        &mut c,
        "alice@origin.example",
        &["big@dest.example"],
        (HEADERS, &big),
        json!({}),
        (None, None),
    );
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    // The commands first: `seen` holds the smarthost's record until the end.
    let rcpt = host.commands("RCPT TO:<r@").remove(0);
    let forwarded = host.commands("XFORWARD ");
    let seen = host.seen();
    let by = |rcpt: &str| {
        seen.messages
            .iter()
            .find(|m| m.delivered == [rcpt])
            .unwrap_or_else(|| panic!("{rcpt} delivered"))
    };
    let eight = by("r@dest.example");
    assert_eq!(eight.data, stored(HEADERS, latin));
    assert!(eight.mail.contains(" BODY=8BITMIME"), "{}", eight.mail);
    assert_has!(eight.mail, " RET=HDRS ENVID=ENV+201+2B");
    assert!(eight.mail.contains(" SIZE="), "{}", eight.mail);
    assert_eq!(
        rcpt,
        "RCPT TO:<r@dest.example> NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;R@dest.example"
    );
    assert_has!(
        forwarded,
        &"XFORWARD ADDR=192.0.2.7 LOGIN=alice".to_string()
    );
    let utf8 = by("\u{fc}ber@dest.example");
    assert_eq!(utf8.data, stored(utf8_headers.as_bytes(), BODY));
    assert!(utf8.mail.contains(" SMTPUTF8"), "{}", utf8.mail);
    assert!(
        utf8.mail
            .starts_with("MAIL FROM:<j\u{f6}rg@origin.example>"),
        "{}",
        utf8.mail
    );
    let large = by("big@dest.example");
    assert!(
        large.data == stored(HEADERS, &big),
        "the 2 MB message intact"
    );
    assert!(!large.mail.contains("BODY="), "{}", large.mail);
}

#[test]
fn lmtp_gives_each_recipient_its_own_reply_after_the_data() {
    let host = Smarthost::start(
        Script {
            lmtp: true,
            pipelining: false,
            ..Script::default()
        }
        .after_data("b@dest.example", &["452 4.2.2 mailbox busy"])
        .after_data(
            "c@dest.example",
            &["552 5.2.2 <c@dest.example>: over quota"],
        ),
    );
    let (s, mut c) = Scenario::new("relay-lmtp")
        .timers("")
        .stages(&stages(&host, "PROTOCOL = lmtp\n"))
        .connect();
    inject(
        &mut c,
        &["a@dest.example", "b@dest.example", "c@dest.example"],
    );
    let mut d = s.start();
    wait_until(WAIT, "b paused and c failed", || {
        paused(&mut c).len() == 1
            && crate::util::rows::count(
                &mut c,
                "SELECT count(*) FROM pepsi.workqueue WHERE status = 'failed'",
            ) == 1
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(paused(&mut c)[0].1, vec!["b@dest.example"]);
    let failed: (i64, Vec<String>) = {
        let r = c
            .query_one(
                "SELECT workqueue_id, rcpt_to FROM pepsi.workqueue WHERE status = 'failed'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(failed.1, vec!["c@dest.example"]);
    let state = state_of(&mut c, failed.0);
    assert_eq!(
        state["dsn_status"],
        json!({"c@dest.example": "5.2.2"}),
        "{state}"
    );
    assert_eq!(
        state["dsn_diagnostic"],
        json!({"c@dest.example": "smtp; 552 5.2.2 <c@dest.example>: over quota"}),
        "{state}"
    );
    assert_eq!(state["failure_class"], "permanent");
    assert_eq!(host.deliveries("a@dest.example"), 1);
    assert_eq!(host.commands("LHLO").len(), 1);
    assert_eq!(queue_len(&mut c), 2, "a is done");
}

#[test]
fn a_null_sender_is_sent_as_mail_from_empty_brackets() {
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("relay-null")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    inject_at_relay(
        &mut c,
        "",
        &["alice@origin.example"],
        (HEADERS, BODY),
        json!({}),
        (None, None),
    );
    let mut d = s.start();
    wait_empty(&mut c, WAIT);
    assert!(d.terminate().success(), "{}", d.log());
    let seen = host.seen();
    assert_eq!(seen.messages.len(), 1);
    assert!(
        seen.messages[0].mail.starts_with("MAIL FROM:<> "),
        "{}",
        seen.messages[0].mail
    );
}

#[test]
fn a_row_split_by_recipient_results_takes_its_outcome_from_the_verdict_and_is_never_sent_again() {
    // As a split leaves its rows: here the kept row, still running under its claim
    // after a worker died before the batch write.
    let host = Smarthost::start(Script::default());
    let (s, mut c) = Scenario::new("relay-verdict")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let verdict = json!({"recipient_outcomes": {"stage": "relay", "next": null, "rcpt": {
        "a@dest.example": {"result": "done"},
        "b@dest.example": {"result": "deferred", "error": "smarthost deferred <b@dest.example>: 451 later"},
        "c@dest.example": {"result": "failed", "error": "refused", "status": "5.1.1",
                           "diagnostic": "smtp; 550 5.1.1 no"}}}});
    let done = inject_at_relay(
        &mut c,
        "alice@origin.example",
        &["a@dest.example"],
        (HEADERS, BODY),
        verdict.clone(),
        (None, None),
    );
    let deferred = inject_at_relay(
        &mut c,
        "alice@origin.example",
        &["b@dest.example"],
        (HEADERS, BODY),
        verdict.clone(),
        (None, None),
    );
    let failed = inject_at_relay(
        &mut c,
        "alice@origin.example",
        &["c@dest.example"],
        (HEADERS, BODY),
        verdict,
        (None, None),
    );
    claim(&mut c, &[done, deferred, failed]);
    let mut w = Worker::ready(&stage("relay"), &s.conf);
    let answers: Vec<u8> = w
        .run(&[done, deferred, failed])
        .iter()
        .map(|l| code(l))
        .collect();
    assert_eq!(answers, vec![0, 0, pepsi::protocol::STATUS_PERMANENT]);
    let (status, stderr) = w.finish();
    assert!(status.success(), "{stderr}");
    assert_eq!(host.seen().connections, 0, "nothing was sent again");
    assert_eq!(crate::util::row_at(&mut c, done), None, "a is done");
    assert_eq!(
        paused(&mut c),
        vec![(deferred, vec!["b@dest.example".to_string()])]
    );
    let state = state_of(&mut c, failed);
    assert_eq!(state["dsn_status"], json!({"c@dest.example": "5.1.1"}));
    assert!(state.get("recipient_outcomes").is_none(), "{state}");
    assert!(
        state_of(&mut c, deferred)
            .get("recipient_outcomes")
            .is_none()
    );
}

#[test]
fn a_message_the_smarthost_cannot_take_fails_with_the_matching_status() {
    let host = Smarthost::start(Script {
        smtputf8: false,
        eightbit: false,
        size: Some(300),
        ..Script::default()
    });
    let (s, mut c) = Scenario::new("relay-limits")
        .timers("")
        .stages(&stages(&host, ""))
        .connect();
    let big = vec![b'x'; 400];
    let cases = [
        (
            inject_at_relay(
                &mut c,
                "alice@origin.example",
                &["big@dest.example"],
                (HEADERS, &big),
                json!({}),
                (None, None),
            ),
            "5.3.4",
        ),
        (
            inject_at_relay(
                &mut c,
                "alice@origin.example",
                &["\u{fc}ber@dest.example"],
                (HEADERS, BODY),
                json!({}),
                (None, None),
            ),
            "5.6.7",
        ),
        (
            inject_at_relay(
                &mut c,
                "alice@origin.example",
                &["latin@dest.example"],
                (HEADERS, b"caf\xe9\r\n"),
                json!({}),
                (None, None),
            ),
            "5.6.3",
        ),
    ];
    let fits = inject(&mut c, &["fits@dest.example"]);
    let mut d = s.start();
    wait_until(WAIT, "three failed and one delivered", || {
        crate::util::rows::count(
            &mut c,
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'failed'",
        ) == 3
            && crate::util::row_at(&mut c, fits).is_none()
    });
    assert!(d.terminate().success(), "{}", d.log());
    for (id, status) in cases {
        let state = state_of(&mut c, id);
        let rcpt = c
            .query_one(
                "SELECT rcpt_to[1] FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap()
            .get::<_, String>(0);
        assert_eq!(state["dsn_status"], json!({ rcpt: status }), "{state}");
        assert_eq!(state["failure_class"], "permanent", "{state}");
    }
    let seen = host.seen();
    assert_eq!(
        seen.messages.len(),
        1,
        "only the message that fits was sent"
    );
    assert_eq!(
        seen.commands
            .iter()
            .filter(|c| c.starts_with("MAIL"))
            .count(),
        1
    );
}

/// A worker of `relay` started with `conf` stops before its ready line (exit 78) and
/// `pepsi-dispatch check` fails (78), both saying each of `says`.
#[track_caller]
fn refused_by_worker_and_check(conf: &std::path::Path, says: &[&str]) {
    let mut w = Worker::start(&stage("relay"), conf);
    assert_eq!(w.next_line(), None, "no ready line");
    let (status, err) = w.finish();
    assert_eq!(status.code(), Some(78), "{err}");
    let out = crate::util::run(
        &crate::util::bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    let text = format!("{}{}", crate::util::stdout(&out), crate::util::stderr(&out));
    assert_eq!(out.status.code(), Some(78), "{text}");
    for s in says {
        assert_has!(err, s);
        assert!(text.contains(s), "check does not say {s:?}: {text}");
    }
}

#[test]
fn require_tls_and_a_login_file_open_to_others_stop_the_worker_and_fail_the_check() {
    let (s, _c) = Scenario::new("relay-tls")
        .timers("")
        .stages("[stage-relay]\nPROGRAM = {relay}\nSMARTHOST = 192.0.2.1:25\nREQUIRE_TLS = no\n")
        .connect();
    refused_by_worker_and_check(&s.conf, &["[stage-relay] REQUIRE_TLS", "TLS = none"]);
    // Its replacement is taken.
    let conf = std::fs::read_to_string(&s.conf).unwrap();
    let conf = conf.replace("REQUIRE_TLS = no\n", "TLS = none\n");
    std::fs::write(&s.conf, &conf).unwrap();
    let mut w = Worker::ready(&stage("relay"), &s.conf);
    let (status, err) = w.finish();
    assert!(status.success(), "{err}");
    // A login file its group may read: refused, and nothing of it shown.
    let auth = s.dir.path("relay-auth");
    std::fs::write(&auth, "relay@example.net Hunter2-secret\n").unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(
        &s.conf,
        conf.replace(
            "TLS = none\n",
            &format!("TLS = verify\nAUTH_FILE = {}\n", auth.display()),
        ),
    )
    .unwrap();
    refused_by_worker_and_check(&s.conf, &["[stage-relay] AUTH_FILE", "chmod 600"]);
    let out = crate::util::run(
        &crate::util::bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    assert_lacks!(crate::util::stderr(&out), "Hunter2");
    assert_lacks!(crate::util::stdout(&out), "Hunter2");
}

#[test]
fn a_message_that_expires_while_the_smarthost_is_down_tells_its_sender_why() {
    // Nothing listens on the port: every attempt is a host error, and the message,
    // arrived an hour before with MAX_LIFETIME 1s, fails at its first one.
    let port = crate::util::ingress::free_port();
    let (s, mut c) = Scenario::new("relay-expired")
        .timers("")
        .stages(&format!(
            "[stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = 127.0.0.1:{port}\nMAX_LIFETIME = 1s\n"
        ))
        .connect();
    let id = inject(&mut c, &["a@dest.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '1 hour' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    let _d = s.start();
    wait_until(WAIT, "the message failed", || {
        crate::util::row_at(&mut c, id).is_some_and(|(_, status)| status == "failed")
    });
    let state = state_of(&mut c, id);
    assert_eq!(state["failure_class"], "retries-exhausted", "{state}");
    assert_eq!(state["dsn_status"], "4.4.7", "{state}");
    let diagnostic = state["dsn_diagnostic"].as_str().unwrap_or_default();
    assert!(diagnostic.starts_with("x-pepsi; "), "{diagnostic}");
    assert_has!(
        diagnostic,
        &format!("cannot connect to 127.0.0.1:{port}: Connection refused")
    );
}
