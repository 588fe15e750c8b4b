//! The session's unit tests (`session.rs`): a session driven through a pair of
//! in-memory streams, with a committer that answers as the test says.

use super::*;
use crate::ingress::commit::{self, Message, Outcome};
use std::sync::{Arc, Mutex};

/// A session of `protocol` fed `input` whole; what it wrote and what it queued.
fn session_of(protocol: Protocol, input: &[u8]) -> (String, Vec<Message>) {
    let (committer, seen) = commit::answered_by(|_| Outcome::Queued(7));
    let stopping = AtomicBool::new(false);
    let settings = settings(protocol, &stopping, Duration::from_secs(30));
    let mut out = Vec::new();
    serve(
        input,
        &mut out,
        &settings,
        None,
        &|_| Ok(()),
        &committer,
        &Counters::default(),
    );
    drop(committer);
    let queued = seen.lock().unwrap().clone();
    (String::from_utf8(out).unwrap(), queued)
}

fn settings(protocol: Protocol, stopping: &AtomicBool, timeout: Duration) -> Settings<'_> {
    Settings {
        protocol,
        hostname: "mx.test",
        max_size: 100_000,
        max_recipients: 10,
        max_errors: 5,
        xforward: false,
        stopping,
        timeout,
        min_data_rate: 500,
        tls: None,
        require_tls: false,
    }
}

/// A transaction, its data ended by `ending`, then a second transaction smuggled
/// behind it, then the one real end and QUIT.
fn smuggling(hello: &str, ending: &str) -> Vec<u8> {
    format!(
        "{hello} client.test\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n\
         Subject: one\r\n\r\nfirst{ending}\
         MAIL FROM:<ceo@example.org>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n\
         From: <ceo@example.org>\r\nSubject: two\r\n\r\nsmuggled\r\n.\r\nQUIT\r\n"
    )
    .into_bytes()
}

#[test]
fn only_crlf_dot_crlf_ends_the_data_so_nothing_is_smuggled_behind_it() {
    for protocol in [Protocol::Smtp, Protocol::Lmtp] {
        let hello = if protocol == Protocol::Lmtp {
            "LHLO"
        } else {
            "EHLO"
        };
        for ending in ["\n.\n", "\r\n.\n", "\n.\r\n"] {
            let (said, queued) = session_of(protocol, &smuggling(hello, ending));
            assert_eq!(queued.len(), 1, "{ending:?}: {said}");
            let m = &queued[0];
            assert_eq!(m.mail_from, "a@x.example", "{ending:?}");
            let body = String::from_utf8_lossy(&m.body);
            assert!(
                body.contains("MAIL FROM:<ceo@example.org>"),
                "{ending:?}: {body}"
            );
            assert!(!body.replace("\r\n", "").contains('\n'), "{body:?}");
            assert_eq!(said.matches("queued as 7").count(), 1, "{ending:?}: {said}");
            assert!(said.ends_with("221 2.0.0 Bye\r\n"), "{said}");
        }
    }
}

#[test]
fn a_bare_line_feed_ends_a_line_as_crlf_and_a_bare_cr_stays() {
    let input = b"EHLO c\nMAIL FROM:<a@x.example>\nRCPT TO:<b@y.example>\r\nDATA\r\n\
                  Subject: s\n\r\nline\nmore\rstill\r\n..dot\r\n.\r\nQUIT\r\n";
    let (said, queued) = session_of(Protocol::Smtp, input);
    assert_eq!(queued.len(), 1, "{said}");
    assert_eq!(queued[0].headers, b"Subject: s\r\n");
    assert_eq!(queued[0].body, b"line\r\nmore\rstill\r\n.dot\r\n");
}

#[test]
fn an_address_is_taken_as_sent_or_refused_never_repaired() {
    let input = b"EHLO c\r\nMAIL FROM:<a\xe9@x.example>\r\n\
                  MAIL FROM:<a@x.example> ENVID=a+00b\r\n\
                  MAIL FROM:<a@x.example>\r\nRCPT TO:<r@y.example> ORCPT=rfc822;r+0D+0Ax\r\n\
                  QUIT\r\n";
    let (said, queued) = session_of(Protocol::Smtp, input);
    assert!(queued.is_empty());
    let lines: Vec<&str> = said.lines().filter(|l| !l.starts_with("250")).collect();
    assert_eq!(
        lines,
        [
            "220 mx.test ESMTP Pepsi",
            "500 5.5.2 Error: the command is not UTF-8",
            "501 5.5.4 Bad ENVID parameter: not xtext of at most 100 characters",
            "501 5.5.4 Bad ORCPT parameter: the address is not xtext",
            "221 2.0.0 Bye"
        ],
        "{said}"
    );
}

/// A reader that gives one byte per read, `pause` apart: a client dripping.
struct Drip {
    bytes: Vec<u8>,
    at: usize,
    pause: Duration,
}

impl Read for Drip {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        std::thread::sleep(self.pause);
        match self.bytes.get(self.at) {
            Some(&b) if !buf.is_empty() => {
                buf[0] = b;
                self.at += 1;
                Ok(1)
            }
            _ => Ok(0),
        }
    }
}

#[test]
fn a_command_dripped_a_byte_at_a_time_meets_its_deadline_whatever_the_gaps() {
    let (committer, _) = commit::answered_by(|_| Outcome::Queued(7));
    let stopping = AtomicBool::new(false);
    let settings = settings(Protocol::Smtp, &stopping, Duration::from_millis(300));
    let drip = Drip {
        bytes: b"EHLO a-very-long-name-for-a-client.example\r\n".to_vec(),
        at: 0,
        pause: Duration::from_millis(20),
    };
    let timeouts = Arc::new(Mutex::new(Vec::new()));
    let seen = timeouts.clone();
    let mut out = Vec::new();
    let summary = serve(
        drip,
        &mut out,
        &settings,
        None,
        &move |t| {
            seen.lock().unwrap().push(t);
            Ok(())
        },
        &committer,
        &Counters::default(),
    );
    assert_eq!(summary.end, End::Timeout);
    let said = String::from_utf8(out).unwrap();
    assert!(
        said.ends_with("421 4.4.2 Timeout exceeded, closing the connection\r\n"),
        "{said}"
    );
    assert!(
        !said.contains("250"),
        "the line never ended in time: {said}"
    );
    // Every read waited at most what was left of the line's 300 ms.
    let t = timeouts.lock().unwrap();
    assert!(t.iter().all(|t| *t <= Duration::from_millis(300)), "{t:?}");
    assert!(
        t.windows(2).all(|w| w[1] <= w[0]),
        "the wait shrinks: {t:?}"
    );
}

#[test]
fn the_data_gets_a_second_more_per_min_data_rate_bytes() {
    let (committer, _) = commit::answered_by(|_| Outcome::Queued(7));
    let stopping = AtomicBool::new(false);
    let settings = settings(Protocol::Smtp, &stopping, Duration::from_secs(10));
    let no_timeout = |_| Ok(());
    let session = Session {
        settings: &settings,
        peer: None,
        deadline: Deadline::Data {
            started: Instant::now(),
            received: 1500,
        },
        committer: &committer,
        counters: &Counters::default(),
        io: BufReader::new(Channel::Plain(Duplex::new(
            &b""[..],
            Vec::new(),
            &no_timeout,
        ))),
        out: Vec::new(),
        errors: 0,
        helo: None,
        tx: Transaction::default(),
        forwarded: Forwarded::default(),
        summary: Summary {
            helo: None,
            accepted: 0,
            recipients: 0,
            deferred: 0,
            refused: 0,
            end: End::Closed,
            tls: None,
        },
    };
    let left = session.due().saturating_duration_since(Instant::now());
    assert!(
        left > Duration::from_secs(12) && left <= Duration::from_secs(13),
        "{left:?}"
    );
}

/// The last line of each reply (`250-` continuation lines left out): one per command.
fn finals(said: &str) -> Vec<&str> {
    said.lines()
        .filter(|l| l.as_bytes().get(3) != Some(&b'-'))
        .collect()
}

#[test]
fn each_command_out_of_order_is_refused_and_the_session_goes_on() {
    // Five refusals: one more would end the session (max_errors).
    let input = b"MAIL FROM:<a@x.example>\r\nEHLO c\r\nRCPT TO:<b@y.example>\r\n\
                  MAIL FROM:<a@x.example>\r\nMAIL FROM:<a@x.example>\r\nDATA\r\n\
                  RCPT TO:<b@y.example>\r\nRSET\r\nRCPT TO:<b@y.example>\r\n\
                  MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n\
                  Subject: s\r\n\r\nbody\r\n.\r\nQUIT\r\n";
    let (said, queued) = session_of(Protocol::Smtp, input);
    assert_eq!(
        finals(&said),
        [
            "220 mx.test ESMTP Pepsi",
            "503 5.5.1 Error: send EHLO or LHLO first",
            "250 DSN",
            "503 5.5.1 Error: need MAIL command",
            "250 2.1.0 Ok",
            "503 5.5.1 Error: nested MAIL command",
            "554 5.5.1 Error: no valid recipients",
            "250 2.1.5 Ok",
            "250 2.0.0 Ok",
            "503 5.5.1 Error: need MAIL command",
            "250 2.1.0 Ok",
            "250 2.1.5 Ok",
            "354 End data with <CR><LF>.<CR><LF>",
            "250 2.0.0 Ok: queued as 7",
            "221 2.0.0 Bye",
        ],
        "{said}"
    );
    assert_eq!(queued.len(), 1, "only the transaction that got its DATA");
}

#[test]
fn a_new_hello_ends_the_transaction_and_the_wrong_hello_is_refused() {
    let input = b"LHLO c\r\nEHLO c\r\nHELO c\r\nEHLO c\r\nMAIL FROM:<a@x.example>\r\n\
                  EHLO again\r\nRCPT TO:<b@y.example>\r\nQUIT\r\n";
    let (said, queued) = session_of(Protocol::Smtp, input);
    assert_eq!(
        finals(&said),
        [
            "220 mx.test ESMTP Pepsi",
            "500 5.5.1 This is SMTP: say EHLO or HELO",
            "250 DSN",
            "250 mx.test",
            "250 DSN",
            "250 2.1.0 Ok",
            "250 DSN",
            "503 5.5.1 Error: need MAIL command",
            "221 2.0.0 Bye",
        ],
        "{said}"
    );
    assert!(queued.is_empty());
    let (said, _) = session_of(Protocol::Lmtp, b"EHLO c\r\nHELO c\r\nLHLO c\r\nQUIT\r\n");
    assert_eq!(
        finals(&said)[1..],
        [
            "500 5.5.1 This is LMTP: say LHLO",
            "500 5.5.1 This is LMTP: say LHLO",
            "250 DSN",
            "221 2.0.0 Bye",
        ],
        "{said}"
    );
}

#[test]
fn lmtp_answers_the_data_once_per_recipient_and_smtp_once() {
    let tx = |hello: &str| {
        format!(
            "{hello} c\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\n\
             RCPT TO:<c@y.example>\r\nRCPT TO:<d@y.example>\r\nDATA\r\n\
             Subject: s\r\n\r\nbody\r\n.\r\nQUIT\r\n"
        )
    };
    let (said, queued) = session_of(Protocol::Lmtp, tx("LHLO").as_bytes());
    assert_eq!(
        said.matches("250 2.1.5 Ok: queued as 7").count(),
        3,
        "{said}"
    );
    assert_eq!(queued.len(), 1, "one message for three recipients");
    assert_eq!(queued[0].rcpt_to.len(), 3);
    let (said, queued) = session_of(Protocol::Smtp, tx("EHLO").as_bytes());
    assert_eq!(said.matches("queued as 7").count(), 1, "{said}");
    assert_eq!(queued[0].rcpt_to.len(), 3);
}

#[test]
fn recipients_past_the_limit_are_deferred_and_the_rest_go_on() {
    let mut input = String::from("EHLO c\r\nMAIL FROM:<a@x.example>\r\n");
    for i in 0..12 {
        input.push_str(&format!("RCPT TO:<r{i}@y.example>\r\n"));
    }
    input.push_str("DATA\r\nSubject: s\r\n\r\nbody\r\n.\r\nQUIT\r\n");
    let (said, queued) = session_of(Protocol::Smtp, input.as_bytes());
    assert_eq!(said.matches("250 2.1.5 Ok").count(), 10, "{said}");
    assert_eq!(
        said.matches("452 4.5.3 Error: too many recipients").count(),
        2,
        "{said}"
    );
    assert_eq!(queued.len(), 1);
    assert_eq!(queued[0].rcpt_to.len(), 10, "the ten taken, in order");
}

#[test]
fn too_many_errors_close_the_session_with_421() {
    // max_errors is 5: the sixth 5xx ends the session, and nothing after it is read.
    let input = b"EHLO c\r\nBOGUS\r\nBOGUS\r\nBOGUS\r\nBOGUS\r\nBOGUS\r\nBOGUS\r\nNOOP\r\n";
    let (said, _) = session_of(Protocol::Smtp, input);
    let lines = finals(&said);
    assert_eq!(
        lines[lines.len() - 2..],
        [
            "500 5.5.2 Error: command not recognized",
            "421 4.7.0 Too many errors, closing the connection"
        ],
        "{said}"
    );
    assert_eq!(said.matches("500 5.5.2").count(), 6, "{said}");
    assert!(!said.contains("250 2.0.0 Ok"), "NOOP after the end: {said}");
}
