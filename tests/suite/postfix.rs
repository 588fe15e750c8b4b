//! The Postfix recipe of doc/postfix.md, run for real: a private Postfix (`util::postfix`)
//! takes mail over SMTP, hands it to `pepsi-ingress` through `content_filter =
//! lmtp:inet:…`, a dispatcher runs it through a pipeline (`filter`, an `if` stage that
//! drops mail from `spam.test`, then the recipe's `reinject` stage), and
//! `pepsi-stage-relay` gives it back to Postfix's second `smtpd`, which delivers it
//! into maildirs the test reads. Every Postfix and Pepsi line of the loop is the recipe's
//! own (`Recipe::from_guide`), moved to free loopback ports.
//!
//! What the loop must do: a message for two local recipients arrives once in each
//! mailbox, byte for byte as sent; a bounce from outside (the null sender) is
//! delivered with its null sender and never bounced again; an 8-bit message, an
//! SMTPUTF8 message and a 2 MB attachment arrive byte for byte; when the reinjection
//! `smtpd` refuses one of two recipients (550 5.1.1), the other gets the message and
//! the sender a notification from the bounce stage, where the failure bouncer moves
//! the refused recipient. Needs root and Postfix (`apt-get install postfix`);
//! elsewhere each test says why and passes, unless `CI` is set. On every machine, doc/postfix.md must still give each piece of the recipe in
//! the shape the loop reads it, and `pepsi-ingress(8)` the same lines as doc/postfix.md.

use std::time::{Duration, Instant};

use postgres::Client;

use crate::util::bouncer::Bouncer;
use crate::util::dispatcher::Dispatcher;
use crate::util::ingress::{Ingress, free_port, python};
use crate::util::postfix::{self, DOMAIN, HOSTNAME, POSTMASTER, Postfix, Recipe};
use crate::util::quick_start_file;
use crate::util::rows::queue_len;
use crate::util::{Scenario, assert_has, assert_lacks, stage};

/// The pipeline before the recipe's `[stage-reinject]`: `filter` (the recipe's entry
/// stage) drops mail from `spam.test` and passes the rest on to `reinject`; the bounce
/// stage, where the failure bouncer moves failed mail, hands its notifications to
/// `reinject` too.
pub(super) const PIPELINE: &str = "\
[stage-filter]
PROGRAM = {if}
MATCH = sender-domain is spam.test
NEXT = drop
ELSE_STAGE = reinject

[stage-drop]
PROGRAM = {discard}

[stage-bounce]
PROGRAM = {bounce}
NEXT = reinject

";

/// The longest a message may take round the loop.
pub(super) const ROUND: Duration = Duration::from_secs(60);

/// The loop of one test. The fields drop in this order: Postfix stops first, so
/// nothing more reaches `pepsi-ingress`; the database goes last.
pub(super) struct Loop {
    pub(super) postfix: Postfix,
    ingress: Ingress,
    dispatcher: Dispatcher,
    bouncer: Bouncer,
    pub(super) c: Client,
    pub(super) s: Scenario,
}

/// Wires the recipe of doc/postfix.md on free ports (see the module's paragraph) with the
/// maildirs `mailboxes` of `local.test`, or says why it cannot run here (None).
fn open(tag: &str, mailboxes: &[&str]) -> Option<Loop> {
    open_with(tag, mailboxes, "", "")
}

/// [`open`], with `main` added to Postfix's `main.cf` lines and `master` to the
/// recipe's `master.cf` entry of the server that takes the mail back (`-o` lines that
/// override the recipe's).
fn open_with(tag: &str, mailboxes: &[&str], main: &str, master: &str) -> Option<Loop> {
    open_pipeline(tag, mailboxes, main, master, PIPELINE)
}

/// [`open_with`], with `pipeline` (its `{…}` program placeholders filled) before the
/// recipe's `[stage-reinject]` instead of [`PIPELINE`]: its entry stage is `filter`.
pub(super) fn open_pipeline(
    tag: &str,
    mailboxes: &[&str],
    main: &str,
    master: &str,
    pipeline: &str,
) -> Option<Loop> {
    open_configured(tag, mailboxes, main, master, pipeline, "")
}

/// [`open_pipeline`], with `pepsi` (lines, each ending in a line feed) added to the
/// `[pepsi]` section: `DELIVERY_LOG = …`.
pub(super) fn open_configured(
    tag: &str,
    mailboxes: &[&str],
    main: &str,
    master: &str,
    pipeline: &str,
    pepsi: &str,
) -> Option<Loop> {
    if !postfix::available(tag) {
        return None;
    }
    let recipe = Recipe::from_guide().on_ports(free_port(), free_port(), &stage("relay"));
    let (s, c) = Scenario::new(tag)
        .pepsi(&recipe.pepsi)
        .pepsi(pepsi)
        .timers("")
        .section("pepsi-ingress", &recipe.ingress)
        .section("pepsi-failure-bouncer", "BOUNCE_STAGE = bounce\n")
        .stages(pipeline)
        .stages(&recipe.reinject_stage)
        .connect();
    let ingress = Ingress::start(&s.conf);
    let dispatcher = s.start();
    let bouncer = Bouncer::ready(&s.conf, &[]);
    let postfix = Postfix::start(
        tag,
        &format!("{}{main}", recipe.main_cf),
        &first_entry_overridden(&recipe.master_cf, master),
        mailboxes,
    );
    Some(Loop {
        postfix,
        ingress,
        dispatcher,
        bouncer,
        c,
        s,
    })
}

/// The recipe's `master.cf` lines with `extra` (`-o` lines) added to its first entry,
/// the server that takes the mail back, before any entry that follows it.
fn first_entry_overridden(master_cf: &str, extra: &str) -> String {
    let lines: Vec<&str> = master_cf.lines().collect();
    let next_entry = lines
        .iter()
        .skip(1)
        .position(|l| !l.starts_with([' ', '\t']))
        .map_or(lines.len(), |i| i + 1);
    let mut out = String::new();
    for line in &lines[..next_entry] {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(extra);
    for line in &lines[next_entry..] {
        out.push_str(line);
        out.push('\n');
    }
    out
}

impl Drop for Loop {
    /// Stops Postfix first, so nothing more reaches `pepsi-ingress`, then lets
    /// `pepsi-ingress`, the dispatcher and the failure bouncer end as they do in
    /// service (SIGTERM), so that no worker outlives the test; a program that takes
    /// longer than 15 s is killed when its field drops.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the private Postfix's log:\n{}", self.postfix.maillog());
            eprintln!("pepsi-ingress:\n{}", self.ingress.log());
            eprintln!("pepsi-dispatch:\n{}", self.dispatcher.log());
        }
        self.postfix.stop();
        self.ingress.signal(libc::SIGTERM);
        self.dispatcher.signal(libc::SIGTERM);
        self.bouncer.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline
            && (self.ingress.try_wait().is_none()
                || self.dispatcher.try_wait().is_none()
                || self.bouncer.try_wait().is_none())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Loop {
    /// Submits `message` over SMTP to Postfix's `smtpd` from `sender` (`""` is the null
    /// sender) to `recipients` with the MAIL FROM parameters `options`; Postfix must
    /// answer 250 at the end of the data.
    #[track_caller]
    pub(super) fn submit(
        &self,
        sender: &str,
        recipients: &[&str],
        message: &[u8],
        options: &[&str],
    ) {
        let dir = crate::util::TempDir::new("pf-msg");
        let file = dir.path("message");
        std::fs::write(&file, message).unwrap();
        let target = format!("127.0.0.1:{}", self.postfix.port);
        let out = python(
            r#"
s = smtp(sys.argv[1])
message = open(sys.argv[4], "rb").read()
options = [o for o in sys.argv[5].split(",") if o]
out = transaction(s, sys.argv[2], sys.argv[3].split(","), message, mail_options=options)
s.quit()
print(json.dumps(out))
"#,
            &[
                &target,
                sender,
                &recipients.join(","),
                file.to_str().unwrap(),
                &options.join(","),
            ],
            Duration::from_secs(120),
        );
        assert_eq!(out["data"][0][0], 250, "Postfix takes the message: {out}");
    }

    /// Waits until the loop is at rest: Pepsi's queue and Postfix's empty, and the
    /// mailboxes `watch` unchanged for three seconds (longer than Postfix's queue run
    /// delay and backoff, so a retry or a bounce would have shown).
    #[track_caller]
    pub(super) fn settle(&mut self, watch: &[&str]) {
        let deadline = Instant::now() + ROUND;
        let counts =
            |p: &Postfix| -> Vec<usize> { watch.iter().map(|m| p.mailbox(m).len()).collect() };
        let mut last = (counts(&self.postfix), Instant::now());
        loop {
            let now = counts(&self.postfix);
            let idle = queue_len(&mut self.c) == 0 && self.postfix.queued() == 0;
            if now != last.0 || !idle {
                last = (now, Instant::now());
            } else if last.1.elapsed() >= Duration::from_secs(3) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the loop did not come to rest within {ROUND:?}: {} rows in Pepsi's queue, \
                 {} messages in Postfix's",
                queue_len(&mut self.c),
                self.postfix.queued()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `message` (written with CRLF line ends) as a maildir file holds it: LF line ends.
pub(super) fn as_stored(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len());
    let mut i = 0;
    while i < message.len() {
        if message[i..].starts_with(b"\r\n") {
            out.push(b'\n');
            i += 2;
        } else {
            out.push(message[i]);
            i += 1;
        }
    }
    out
}

/// Asserts that `delivered` (a maildir file) is `message` byte for byte, after the
/// header fields Postfix adds on delivery (Return-Path with the envelope `sender`,
/// X-Original-To, Delivered-To) and one Received field for each of the two passes
/// through an `smtpd`: the way in and the way back from Pepsi.
#[track_caller]
fn arrived_intact(delivered: &[u8], message: &[u8], sender: &str) {
    let original = as_stored(message);
    assert!(
        delivered.ends_with(&original),
        "the delivered message ends with the message as sent, byte for byte; it is:\n{}",
        String::from_utf8_lossy(&delivered[..delivered.len().min(4096)])
    );
    let added = std::str::from_utf8(&delivered[..delivered.len() - original.len()])
        .expect("the fields Postfix adds are UTF-8");
    let names: Vec<&str> = added
        .lines()
        .filter(|l| !l.starts_with([' ', '\t']))
        .map(|l| l.split(':').next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "Return-Path",
            "X-Original-To",
            "Delivered-To",
            "Received",
            "Received"
        ],
        "Postfix adds its delivery fields and two Received fields, nothing else:\n{added}"
    );
    assert!(
        added.starts_with(&format!("Return-Path: <{sender}>\n")),
        "the envelope sender survives the loop:\n{added}"
    );
    assert_eq!(
        added.matches(&format!("by {HOSTNAME} (Postfix)")).count(),
        2,
        "both Received fields are Postfix's:\n{added}"
    );
}

/// A message with every header field Postfix would otherwise add, the fields `more`
/// (each line ending in CRLF) and `body`.
pub(super) fn message(
    from: &str,
    to: &str,
    subject: &str,
    id: &str,
    more: &str,
    body: &[u8],
) -> Vec<u8> {
    let mut m = format!(
        "From: {from}\r\nTo: {to}\r\nSubject: {subject}\r\nDate: Thu, 03 Dec 2026 16:00:00 +0000\r\n\
         Message-ID: <{id}@ext.test>\r\nMIME-Version: 1.0\r\n{more}\r\n"
    )
    .into_bytes();
    m.extend_from_slice(body);
    m
}

#[test]
fn a_message_for_two_local_recipients_goes_round_the_loop_and_arrives_once_in_each_mailbox() {
    let Some(mut l) = open("pf-two", &["alice", "bob"]) else {
        return;
    };
    let sent = message(
        "Sender <sender@ext.test>",
        "alice@local.test, bob@local.test",
        "round the loop",
        "two",
        "",
        b"Hello, both of you.\r\n.A line that starts with a dot.\r\n\r\nThe end.\r\n",
    );
    l.submit(
        "sender@ext.test",
        &[&format!("alice@{DOMAIN}"), &format!("bob@{DOMAIN}")],
        &sent,
        &[],
    );
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.postfix.wait_mailbox("bob", 1, ROUND);
    l.settle(&["alice", "bob", POSTMASTER]);
    for mailbox in ["alice", "bob"] {
        let got = l.postfix.mailbox(mailbox);
        assert_eq!(got.len(), 1, "{mailbox} gets the message once");
        arrived_intact(&got[0], &sent, "sender@ext.test");
    }
    assert!(l.postfix.mailbox(POSTMASTER).is_empty());
    // The message went to pepsi-ingress over LMTP and came back through the reinjection
    // smtpd: Postfix says so in its log.
    let log = l.postfix.maillog();
    assert_has!(
        log,
        "postfix/lmtp[",
        "Postfix's lmtp client handed the message to pepsi-ingress"
    );
    assert_has!(
        log,
        "status=sent (250 2.1.5",
        "Postfix's lmtp client handed the message to pepsi-ingress"
    );
}

#[test]
fn a_bounce_from_outside_is_delivered_with_its_null_sender_and_never_bounced_again() {
    let Some(mut l) = open("pf-bounce", &["alice"]) else {
        return;
    };
    let sent = message(
        "Mail Delivery System <MAILER-DAEMON@ext.test>",
        "alice@local.test",
        "Undelivered Mail Returned to Sender",
        "bounce",
        "",
        b"This is the mail system at host ext.test.\r\n\r\nYour message could not be delivered.\r\n",
    );
    l.submit("", &[&format!("alice@{DOMAIN}")], &sent, &[]);
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.settle(&["alice", POSTMASTER]);
    let got = l.postfix.mailbox("alice");
    assert_eq!(got.len(), 1, "alice gets the bounce once");
    arrived_intact(&got[0], &sent, "");
    assert!(
        l.postfix.mailbox(POSTMASTER).is_empty(),
        "no double bounce reaches the postmaster"
    );
    let log = l.postfix.maillog();
    assert_lacks!(log, "non-delivery notification", "Postfix bounced nothing");
    assert_lacks!(log, "status=bounced", "Postfix bounced nothing");
    // The queue manager names each queue file's sender: the message as it came in,
    // and as it came back from Pepsi.
    let queued: std::collections::BTreeSet<&str> = log
        .lines()
        .filter(|l| l.contains("postfix/qmgr[") && l.contains(": from=<"))
        .filter_map(|l| l.split("]: ").nth(1)?.split(':').next())
        .collect();
    assert_eq!(queued.len(), 2, "Postfix queued the message twice:\n{log}");
    assert_eq!(
        log.matches(": from=<>,").count(),
        log.matches(": from=<").count(),
        "the null sender both times:\n{log}"
    );
}

#[test]
fn a_recipient_the_reinjection_server_refuses_gets_a_notification_and_the_other_the_message() {
    // The recipe's reinjection server, refusing unknown recipients as an operator may
    // have it do (the recipe's lines, two of them overridden), behind a first smtpd
    // that takes them: `ghost` passes the way in, Pepsi's relay is refused it with
    // 550 5.1.1 on the way back, and the bounce stage reports it to the sender.
    let Some(mut l) = open_with(
        "pf-refused",
        &["alice", "sender"],
        "smtpd_reject_unlisted_recipient = no\n",
        "  -o receive_override_options=no_header_body_checks,no_milters\n  \
         -o smtpd_recipient_restrictions=reject_unlisted_recipient,permit_mynetworks,reject\n",
    ) else {
        return;
    };
    let sent = message(
        "Sender <sender@local.test>",
        "alice@local.test, ghost@local.test",
        "one of you is gone",
        "refused",
        "",
        b"Hello, both of you.\r\n",
    );
    let sender = format!("sender@{DOMAIN}");
    l.submit(
        &sender,
        &[&format!("alice@{DOMAIN}"), &format!("ghost@{DOMAIN}")],
        &sent,
        &[],
    );
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.postfix.wait_mailbox("sender", 1, ROUND);
    l.settle(&["alice", "sender", POSTMASTER]);
    let got = l.postfix.mailbox("alice");
    assert_eq!(got.len(), 1, "alice gets the message once");
    arrived_intact(&got[0], &sent, &sender);
    let notices = l.postfix.mailbox("sender");
    assert_eq!(notices.len(), 1, "the sender gets one notification");
    let notice = String::from_utf8_lossy(&notices[0]);
    assert!(
        notice.starts_with("Return-Path: <>\n"),
        "the notification comes from the null sender:\n{notice}"
    );
    for text in [
        "Content-Type: multipart/report",
        "Final-Recipient: rfc822; ghost@local.test",
        "Action: failed",
        "Status: 5.1.1",
        "User unknown",
        "Subject: one of you is gone",
    ] {
        assert_has!(notice, text, "the notification has {text:?}");
    }
    assert_lacks!(notice, "alice@local.test\nAction", "only ghost is reported");
    assert!(l.postfix.mailbox(POSTMASTER).is_empty());
    let log = l.postfix.maillog();
    assert_has!(
        log,
        "550 5.1.1 <ghost@local.test>",
        "the reinjection server refused ghost"
    );
    assert_lacks!(log, "status=bounced", "Postfix itself bounced nothing");
}

/// `n` bytes that do not repeat in any way a compressor or a careless copy would hide.
fn noise(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[test]
fn an_8bit_message_an_smtputf8_message_and_a_2_mb_attachment_arrive_byte_for_byte() {
    let Some(mut l) = open("pf-8bit", &["alice", "bob", "carol"]) else {
        return;
    };
    // 8-bit text in Latin-1, then in UTF-8.
    let mut latin1_and_utf8 = b"Gr\xfc\xdfe aus K\xf6ln, \xa9 2026.\r\n".to_vec();
    latin1_and_utf8.extend_from_slice("Grüße, ½ € — ✓\r\n".as_bytes());
    let eight_bit = message(
        "sender@ext.test",
        "alice@local.test",
        "8-bit",
        "8bit",
        "Content-Type: text/plain; charset=iso-8859-1\r\nContent-Transfer-Encoding: 8bit\r\n",
        &latin1_and_utf8,
    );
    let utf8 = message(
        "José <josé@ext.test>",
        "bob@local.test",
        "Grüße aus Köln ✓",
        "utf8",
        "Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n",
        "Un message en UTF-8 : ça marche, 日本語も.\r\n".as_bytes(),
    );
    let attachment = {
        use base64::Engine;
        let encoded = base64::engine::general_purpose::STANDARD.encode(noise(2 << 20));
        let mut body = b"--b\r\nContent-Type: text/plain\r\n\r\nThe attachment.\r\n--b\r\n\
              Content-Type: application/octet-stream; name=\"noise.bin\"\r\n\
              Content-Transfer-Encoding: base64\r\n\r\n"
            .to_vec();
        for line in encoded.as_bytes().chunks(76) {
            body.extend_from_slice(line);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"--b--\r\n");
        message(
            "sender@ext.test",
            "carol@local.test",
            "2 MB",
            "big",
            "Content-Type: multipart/mixed; boundary=\"b\"\r\n",
            &body,
        )
    };
    assert!(attachment.len() > 2_700_000);

    l.submit(
        "sender@ext.test",
        &[&format!("alice@{DOMAIN}")],
        &eight_bit,
        &["BODY=8BITMIME"],
    );
    l.submit(
        "josé@ext.test",
        &[&format!("bob@{DOMAIN}")],
        &utf8,
        &["SMTPUTF8", "BODY=8BITMIME"],
    );
    l.submit(
        "sender@ext.test",
        &[&format!("carol@{DOMAIN}")],
        &attachment,
        &[],
    );
    for mailbox in ["alice", "bob", "carol"] {
        l.postfix.wait_mailbox(mailbox, 1, ROUND);
    }
    l.settle(&["alice", "bob", "carol", POSTMASTER]);
    for (mailbox, sent, sender) in [
        ("alice", &eight_bit, "sender@ext.test"),
        ("bob", &utf8, "josé@ext.test"),
        ("carol", &attachment, "sender@ext.test"),
    ] {
        let got = l.postfix.mailbox(mailbox);
        assert_eq!(got.len(), 1, "{mailbox} gets one message");
        arrived_intact(&got[0], sent, sender);
    }
}

#[test]
fn the_guide_gives_every_piece_of_the_recipe_the_loop_runs_where_the_loop_expects_it() {
    // Runs without root or Postfix too: a recipe edited out of shape fails here on
    // every machine, not only where the loop itself runs.
    let relay = std::path::Path::new("/srv/pepsi-stage-relay");
    let recipe = Recipe::from_guide().on_ports(20025, 20026, relay);
    assert!(
        recipe
            .main_cf
            .lines()
            .any(|l| l == "content_filter = lmtp:inet:127.0.0.1:20025"),
        "{}",
        recipe.main_cf
    );
    assert!(
        recipe.master_cf.starts_with("127.0.0.1:20026 inet ")
            && recipe.master_cf.contains("\n  -o content_filter=\n"),
        "{}",
        recipe.master_cf
    );
    assert!(recipe.ingress.contains("LISTEN = lmtp:127.0.0.1:20025\n"));
    assert!(recipe.ingress.contains("STAGE = filter\n"));
    assert_eq!(
        recipe.reinject_stage,
        "[stage-reinject]\nPROGRAM = /srv/pepsi-stage-relay\nSMARTHOST = 127.0.0.1:20026\n",
        "the relay stage, loopback so without TLS"
    );
    assert!(recipe.pepsi.starts_with("HOSTNAME = "), "{}", recipe.pepsi);
    // The built-in stage the recipe names exists and takes every key it is given.
    let relay = pepsi::stages::BUILTINS
        .iter()
        .find(|s| format!("pepsi-stage-{}", s.name()) == postfix::RELAY_PROGRAM)
        .expect("the recipe's PROGRAM is a built-in stage");
    for line in recipe.reinject_stage.lines().skip(1) {
        let key = line.split(" = ").next().unwrap();
        assert!(
            key == "PROGRAM" || relay.keys().contains(&key),
            "{key} is a key of {}",
            postfix::RELAY_PROGRAM
        );
    }
}

#[test]
fn pepsi_ingress_8_gives_the_postfix_and_pepsi_lines_of_the_tested_recipe_verbatim() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/man/pepsi-ingress.8");
    let page = std::fs::read_to_string(&path).unwrap();
    // The page's example blocks (.EX … .EE), roff's `\-` read as `-`.
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (line, current.as_mut()) {
            (".EX", None) => current = Some(String::new()),
            (".EE", Some(_)) => blocks.extend(current.take()),
            (line, Some(block)) => {
                block.push_str(&line.replace("\\-", "-"));
                block.push('\n');
            }
            _ => {}
        }
    }
    let recipe = Recipe::from_guide();
    for (what, lines) in [
        ("main.cf", recipe.main_cf.clone()),
        ("master.cf", recipe.master_cf.clone()),
        ("pepsi.conf", format!("[pepsi-ingress]\n{}", recipe.ingress)),
        ("pepsi.conf", recipe.reinject_stage.clone()),
        ("pepsi.conf", format!("[pepsi]\n{}", recipe.pepsi)),
    ] {
        assert_has!(
            blocks,
            &lines,
            "pepsi-ingress(8) gives doc/postfix.md's {what} lines verbatim:\n{lines}"
        );
    }
}

#[test]
fn the_quick_starts_pipeline_with_the_recipe_hands_mail_for_other_domains_back_to_postfix() {
    // The shipped example as the README's quick start and the guide's edits for the
    // recipe leave it: its stage sections, before the recipe's own [stage-reinject].
    let dir = crate::util::TempDir::new("pf-quick");
    let read = |file: &str| -> Vec<String> {
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let edits: Vec<String> = quick_start_file::config_edits(&read("README.md"))
        .into_iter()
        .chain(quick_start_file::config_edits(&read(postfix::GUIDE)))
        .collect();
    let file = std::fs::read_to_string(quick_start_file::edited_example(&dir.0, &edits)).unwrap();
    let start = file
        .find("[stage-filter]")
        .expect("the quick start's filter");
    let end = file.find("[stage-reinject]").expect("the guide's reinject");
    let mut pipeline = file[start..end].to_string();
    for stage in crate::util::stage_names() {
        pipeline = pipeline.replace(
            &format!("PROGRAM = pepsi-stage-{stage}\n"),
            &format!("PROGRAM = {{{stage}}}\n"),
        );
    }
    let Some(mut l) = open_pipeline("pf-quick", &["alice"], "", "", &pipeline) else {
        return;
    };
    let sent = message(
        "Sender <sender@ext.test>",
        "alice@local.test",
        "not for example.org",
        "quick",
        "",
        b"Through the quick start's filter.\r\n",
    );
    l.submit("sender@ext.test", &[&format!("alice@{DOMAIN}")], &sent, &[]);
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.settle(&["alice", POSTMASTER]);
    arrived_intact(&l.postfix.mailbox("alice")[0], &sent, "sender@ext.test");
    assert_lacks!(l.dispatcher.log(), "discarded");
}

/// `n` bytes of base64 text in lines of 76 characters and CRLF.
fn base64_lines(n: usize) -> Vec<u8> {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let raw = noise(n);
    let mut out = Vec::with_capacity(n + n / 38);
    for (i, b) in raw.iter().enumerate() {
        out.push(alphabet[(*b as usize) % 64]);
        if i % 76 == 75 {
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[test]
fn a_message_as_large_as_postfix_takes_comes_back_through_the_reinjection_server() {
    // Postfix takes messages up to its message_size_limit on the way in; the way back
    // adds a Received field (and a signature, when there is one), and must not refuse
    // what the way in took.
    let limit = 200_000;
    let Some(mut l) = open_with(
        "pf-size",
        &["alice"],
        &format!("message_size_limit = {limit}\n"),
        "",
    ) else {
        return;
    };
    let sent = message(
        "Sender <sender@ext.test>",
        "alice@local.test",
        "large",
        "large",
        "",
        &base64_lines((limit - 1150) * 76 / 78),
    );
    l.submit("sender@ext.test", &[&format!("alice@{DOMAIN}")], &sent, &[]);
    l.postfix.wait_mailbox("alice", 1, ROUND);
    l.settle(&["alice", POSTMASTER]);
    arrived_intact(&l.postfix.mailbox("alice")[0], &sent, "sender@ext.test");
}
