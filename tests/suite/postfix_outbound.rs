//! Mail leaving through the Postfix recipe of doc/postfix.md (the loop of
//! `postfix.rs`): signed by `dkim-sign` on its way back to Postfix, the message in the
//! mailbox still verifies with dkimpy; forwarded with a sender rewritten by `srs`, a
//! bounce to that sender goes round the loop to the original sender's mailbox, and a
//! bounce to an address that does not reverse (a forged hash, an expired timestamp)
//! is not delivered: its sender gets a notification (5.1.1), nothing else is lost.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use pepsi::stages::srs::scheme::Srs;

use super::postfix::{ROUND, message, open_pipeline};
use crate::util::dkim::{all_verify, key_table, make_key, published};
use crate::util::postfix::{DOMAIN, POSTMASTER};
use crate::util::{TempDir, assert_has};

/// Where the recipe's `filter` sends mail: signed, then back to Postfix.
const SIGNING: &str = "\
[stage-filter]
PROGRAM = {if}
MATCH = sender-domain is spam.test
NEXT = drop
ELSE_STAGE = sign

[stage-drop]
PROGRAM = {discard}

[stage-sign]
PROGRAM = {dkim-sign}
KEY_TABLE = @KEYS@
NEXT = reinject

[stage-bounce]
PROGRAM = {bounce}
NEXT = reinject

";

/// `filter` sends mail for the forwarder's domain `fwd.test` to `unsrs` (reverse),
/// the rest through `srs` (forward: every sender but `pepsi.test`'s is rewritten).
const FORWARDING: &str = "\
[stage-filter]
PROGRAM = {if}
MATCH = recipient-domain is fwd.test
NEXT = unsrs
ELSE_STAGE = srs

[stage-unsrs]
PROGRAM = {srs}
MODE = reverse
SRS_DOMAIN = fwd.test
SECRETS_FILE = @SECRETS@
NEXT = reinject

[stage-srs]
PROGRAM = {srs}
MODE = forward
SRS_DOMAIN = fwd.test
LOCAL_DOMAINS = pepsi.test
SECRETS_FILE = @SECRETS@
NEXT = reinject

[stage-bounce]
PROGRAM = {bounce}
NEXT = reinject

";

/// The maildir file `stored` (LF line ends) as a receiving MTA hands it to a verifier:
/// CRLF line ends.
fn as_received(stored: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(stored.len() + stored.len() / 40);
    for &b in stored {
        if b == b'\n' {
            out.push(b'\r');
        }
        out.push(b);
    }
    out
}

/// The envelope sender Postfix recorded on delivery (`Return-Path: <…>`).
fn return_path(stored: &[u8]) -> String {
    let text = String::from_utf8_lossy(stored);
    let line = text
        .lines()
        .find(|l| l.starts_with("Return-Path: <"))
        .unwrap_or_else(|| panic!("no Return-Path:\n{text}"));
    line["Return-Path: <".len()..line.len() - 1].to_string()
}

#[test]
fn a_message_signed_on_its_way_back_to_postfix_still_verifies_in_the_mailbox() {
    let dir = TempDir::new("pf-dkim");
    let rsa = make_key(&dir, "rsa.pem", "rsa2048");
    let ed = make_key(&dir, "ed.pem", "ed25519");
    let table = key_table(
        &dir,
        &[
            (DOMAIN, "pf1", "rsa-sha256", &rsa),
            (DOMAIN, "pf2", "ed25519-sha256", &ed),
        ],
    );
    let pipeline = SIGNING.replace("@KEYS@", table.to_str().unwrap());
    let Some(mut l) = open_pipeline("pf-dkim", &["alice", "bob"], "", "", &pipeline) else {
        return;
    };
    let records = published(&l.s.conf);
    let body = "8-bit: \u{e9}t\u{e9}\r\n.A dotted line.\r\n\r\n\r\n".as_bytes();
    let sent = message(
        &format!("Alice <alice@{DOMAIN}>"),
        &format!("bob@{DOMAIN}"),
        "signed",
        "dkim",
        "Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n",
        body,
    );
    l.submit(
        &format!("alice@{DOMAIN}"),
        &[&format!("bob@{DOMAIN}")],
        &sent,
        &["BODY=8BITMIME"],
    );
    l.postfix.wait_mailbox("bob", 1, ROUND);
    l.settle(&["bob", POSTMASTER]);
    let got = l.postfix.mailbox("bob");
    assert_eq!(got.len(), 1);
    let received = as_received(&got[0]);
    assert!(
        all_verify(&received, &records, 2),
        "both signatures verify in the mailbox:\n{}",
        String::from_utf8_lossy(&got[0])
    );
    assert!(received.ends_with(body), "the body arrives as sent");
    let mut forged = received.clone();
    let at = forged.len() - 5;
    forged[at] ^= 0x01;
    assert!(
        !all_verify(&forged, &records, 2),
        "a changed byte breaks them"
    );
}

#[test]
fn a_bounce_to_a_forwarded_sender_reaches_the_original_sender_and_a_forged_one_is_refused() {
    let dir = TempDir::new("pf-srs");
    let secrets = dir.write("secrets", "l00p-s3cret\n");
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let pipeline = FORWARDING.replace("@SECRETS@", secrets.to_str().unwrap());
    let Some(mut l) = open_pipeline(
        "pf-srs",
        &["carol", "dave"],
        // Postfix takes mail for the forwarder's domain and hands it to the filter;
        // after the filter it would go nowhere (the test instance relays nothing).
        "relay_domains = fwd.test\ntransport_maps = inline:{fwd.test=discard:}\n",
        "",
        &pipeline,
    ) else {
        return;
    };
    // carol's message to dave is forwarded: dave's copy has an SRS sender.
    let carol = format!("carol@{DOMAIN}");
    let dave = format!("dave@{DOMAIN}");
    let sent = message(&carol, &dave, "forwarded", "fwd", "", b"Hello.\r\n");
    l.submit(&carol, &[&dave], &sent, &[]);
    let got = l.postfix.wait_mailbox("dave", 1, ROUND);
    let srs_sender = return_path(&got[0]);
    assert!(srs_sender.starts_with("SRS0="), "{srs_sender}");
    assert!(srs_sender.ends_with("@fwd.test"), "{srs_sender}");
    // A bounce to that sender finds carol.
    let bounce = message(
        "Mail Delivery System <MAILER-DAEMON@ext.test>",
        &srs_sender,
        "Undelivered Mail Returned to Sender",
        "srs-bounce",
        "",
        b"Your message could not be delivered.\r\n",
    );
    l.submit("", &[&srs_sender], &bounce, &[]);
    let got = l.postfix.wait_mailbox("carol", 1, ROUND);
    assert_eq!(return_path(&got[0]), "", "the bounce keeps its null sender");
    assert_has!(
        String::from_utf8_lossy(&got[0]),
        "Subject: Undelivered Mail Returned to Sender"
    );
    // A forged hash and an expired timestamp: not delivered; their sender (dave) is
    // told 5.1.1 for each.
    let now = SystemTime::now();
    let ours = Srs::new(vec![b"l00p-s3cret".to_vec()], "fwd.test", 21).unwrap();
    let expired = ours
        .forward(&carol, now - Duration::from_secs(40 * 86_400))
        .unwrap()
        .unwrap();
    let theirs = Srs::new(vec![b"f0rg3d".to_vec()], "fwd.test", 21).unwrap();
    let forged = theirs.forward(&carol, now).unwrap().unwrap();
    let probe = message(
        &dave,
        &forged,
        "forged",
        "srs-forged",
        "",
        b"Is this carol?\r\n",
    );
    l.submit(&dave, &[&forged, &expired], &probe, &[]);
    let got = l.postfix.wait_mailbox("dave", 2, ROUND);
    l.settle(&["carol", "dave", POSTMASTER]);
    let report = got
        .iter()
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .find(|m| m.contains("Status: "))
        .expect("a delivery status notification in dave's mailbox");
    assert_eq!(report.matches("Status: 5.1.1").count(), 2, "{report}");
    assert_has!(report, &forged);
    assert_has!(report, &expired);
    assert_eq!(
        l.postfix.mailbox("carol").len(),
        1,
        "carol got the bounce alone"
    );
    assert_eq!(l.postfix.mailbox("dave").len(), 2);
    assert!(l.postfix.mailbox(POSTMASTER).is_empty());
}
