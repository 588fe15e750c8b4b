//! relay-to-internet (§22) against real peers: a private NSD (`util::nsd`) serving the
//! test's zone, private Postfix instances as the mail exchangers
//! (`util::exchangers`), each test on loopback addresses of its own (127.0.N.2,
//! 127.0.N.3 …, one port), and `pepsi-stage-relay-to-internet` workers run by the
//! dispatcher. Hostile peers: a DNS server that answers with a compression loop
//! (`util::hostile_dns`), an exchanger that greets with 100 KB.

use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

use postgres::Client;

use crate::util::bouncer::Bouncer;
use crate::util::exchangers::{self, Options, max_open_sessions, sessions, zone};
use crate::util::hostile_dns::{Hostile, HostileDns};
use crate::util::nsd::{self, Nsd};
use crate::util::postfix::{self, Postfix};
use crate::util::rows::{count, due_now, queue_len, wait_empty};
use crate::util::scenario::Scenario;
use crate::util::{bin, inject, run, state_of, stdout, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// The timeouts of the tests' stages: their sum below the tests' MAX_RUNTIME (30 s).
const TIMEOUTS: &str =
    "CONNECT_TIMEOUT = 2s\nCOMMAND_TIMEOUT = 8s\nDATA_TIMEOUT = 8s\nDATA_DONE_TIMEOUT = 10s\n";

/// One test's network: its loopback addresses `127.0.N.x`, a free port on all of them,
/// and the NSD serving its zones.
struct Net {
    n: u8,
    port: u16,
    dns: Nsd,
}

impl Net {
    /// Net `n` (unique per test), NSD serving `test.` from `records` and `extra` zones.
    fn new(n: u8, records: &str, extra: &[(&str, Option<&str>)]) -> Net {
        let port = free_port(n);
        let test_zone = zone("test", &records.replace("{N}", &n.to_string()));
        let mut zones = vec![("test", Some(test_zone.as_str()))];
        zones.extend_from_slice(extra);
        let dns = Nsd::start(&format!("rti{n}"), &zones);
        Net { n, port, dns }
    }

    /// `127.0.N.host`.
    fn at(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 0, self.n, host)
    }

    /// An exchanger at `127.0.N.host` for `domains`, with maildirs for `mailboxes`.
    fn exchanger(&self, host: u8, domains: &[&str], mailboxes: &[&str], o: &Options) -> Postfix {
        exchangers::start(
            &format!("rti{}-{host}", self.n),
            (self.at(host), self.port),
            domains,
            mailboxes,
            o,
        )
    }

    /// A stage section `[stage-NAME]` of relay-to-internet on this net, with `extra`;
    /// it connects from `127.0.N.1`.
    fn stage(&self, name: &str, extra: &str) -> String {
        format!(
            "[stage-{name}]\nPROGRAM = {{relay-to-internet}}\nNAMESERVER = {}\nPORT = {}\nHOSTNAME = pepsi.sender.test\nBIND_ADDRESS = {}\n{TIMEOUTS}{extra}\n",
            self.dns.addr(),
            self.port,
            self.at(1)
        )
    }
}

/// May a test that needs NSD and Postfix run (`nsd::available`, `postfix::available`)?
fn runnable(test: &str) -> bool {
    nsd::available(test) && postfix::available(test)
}

/// Makes due the paused rows that wait less than `within` (an SQL interval): rows
/// deferred or paused a few seconds, not those a suspension holds.
fn make_due(c: &mut Client, within: &str) {
    c.execute(
        "UPDATE pepsi.workqueue SET timeout = now() WHERE status = 'paused' AND timeout < now() + $1::text::interval",
        &[&within],
    )
    .unwrap();
}

/// A port free on 127.0.N.1 to 127.0.N.6.
fn free_port(n: u8) -> u16 {
    loop {
        let first = TcpListener::bind((Ipv4Addr::new(127, 0, n, 1), 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        if (2..=6).all(|h| TcpListener::bind((Ipv4Addr::new(127, 0, n, h), port)).is_ok()) {
            return port;
        }
    }
}

/// Waits until no row is left at the stages (all delivered or failed elsewhere).
fn wait_gone(c: &mut Client, sql: &str) {
    wait_until(WAIT, sql, || count(c, sql) == 0);
}

/// The state of the row holding `recipient`.
fn state_of_recipient(c: &mut Client, recipient: &str) -> serde_json::Value {
    let id: i64 = c
        .query_one(
            "SELECT workqueue_id FROM pepsi.workqueue WHERE $1 = ANY (rcpt_to)",
            &[&recipient],
        )
        .unwrap()
        .get(0);
    state_of(c, id)
}

#[test]
fn mx_by_preference_falls_back_past_a_refusing_exchanger_the_implicit_mx_and_a_cname_deliver_and_three_domains_split()
 {
    if !runnable("rti mx") {
        return;
    }
    let net = Net::new(
        41,
        "a IN MX 10 mx1.a\na IN MX 20 mx2.a\nmx1.a IN A 127.0.{N}.2\nmx2.a IN A 127.0.{N}.3\n\
         b IN A 127.0.{N}.3\nc IN MX 5 alias.c\nalias.c IN CNAME mx2.a\n",
        &[],
    );
    // Nothing listens on .2: mx1.a refuses connections.
    let mx2 = net.exchanger(
        3,
        &["a.test", "b.test", "c.test"],
        &["alice", "bob", "carol"],
        &Options::default(),
    );
    let (s, mut c) = Scenario::new("rti-mx")
        .timers("")
        .stages(&net.stage("out", ""))
        .connect();
    let mut d = s.start();
    inject(
        &mut c,
        "out",
        "sender@origin.example",
        &["alice@a.test", "bob@B.test", "carol@c.test"],
    );
    wait_empty(&mut c, WAIT);
    for who in ["alice", "bob", "carol"] {
        assert_eq!(mx2.wait_mailbox(who, 1, WAIT).len(), 1, "{who}");
    }
    // Three rows (one per domain), each delivered once: three sessions at most (a
    // session per worker and domain), never a second copy.
    std::thread::sleep(Duration::from_secs(1));
    for who in ["alice", "bob", "carol"] {
        assert_eq!(mx2.mailbox(who).len(), 1, "{who} got one copy");
    }
    wait_until(WAIT, "the refusal logged", || {
        d.log().contains("mx1.a.test[127.0.41.2]")
    });
    d.terminate();
}

#[test]
fn a_null_mx_fails_5_1_10_without_a_connection_nxdomain_5_1_2_and_no_address_5_4_4() {
    if !runnable("rti null") {
        return;
    }
    let net = Net::new(
        42,
        "null IN MX 0 .\nnull IN A 127.0.{N}.3\nnoaddr IN MX 10 nowhere.noaddr\nnowhere.noaddr IN TXT \"no address\"\n",
        &[],
    );
    let mx = net.exchanger(3, &["null.test"], &["x"], &Options::default());
    let (s, mut c) = Scenario::new("rti-null")
        .timers("")
        .stages(&net.stage("out", ""))
        .connect();
    let mut d = s.start();
    inject(
        &mut c,
        "out",
        "sender@origin.example",
        &["x@null.test", "y@gone.test", "z@noaddr.test"],
    );
    let failed = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'failed'";
    wait_until(WAIT, "three failed rows", || count(&mut c, failed) == 3);
    for (who, status) in [
        ("x@null.test", "5.1.10"),
        ("y@gone.test", "5.1.2"),
        ("z@noaddr.test", "5.4.4"),
    ] {
        let state = state_of_recipient(&mut c, who);
        assert_eq!(state["dsn_status"][who], status, "{who}: {state}");
    }
    d.terminate();
    assert_eq!(
        sessions(&mx.maillog(), net.at(1)),
        0,
        "no connection:\n{}",
        mx.maillog()
    );
}

#[test]
fn servfail_defers_as_a_host_error_and_the_message_goes_once_the_zone_answers() {
    if !runnable("rti servfail") {
        return;
    }
    let mut net = Net::new(43, "", &[("broken.example", None)]);
    let mx = net.exchanger(3, &["broken.example"], &["z"], &Options::default());
    let (s, mut c) = Scenario::new("rti-servfail")
        .timers("")
        .stages(&net.stage("out", ""))
        .connect();
    let _d = s.start();
    let id = inject(
        &mut c,
        "out",
        "sender@origin.example",
        &["z@broken.example"],
    );
    let paused = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'paused' AND state->>'last_error' LIKE '%4.4.3%'";
    wait_until(WAIT, "deferred with 4.4.3", || count(&mut c, paused) == 1);
    assert_eq!(sessions(&mx.maillog(), net.at(1)), 0);
    net.dns.set_zone(
        "broken.example",
        &zone(
            "broken.example",
            &format!("@ IN MX 10 mx\nmx IN A {}\n", net.at(3)),
        ),
    );
    due_now(&mut c, id);
    wait_empty(&mut c, WAIT);
    assert_eq!(mx.wait_mailbox("z", 1, WAIT).len(), 1);
}

#[test]
fn a_550_for_one_recipient_reaches_its_report_with_the_exchangers_text_and_the_others_are_delivered()
 {
    if !runnable("rti 550") {
        return;
    }
    let net = Net::new(
        44,
        "a IN MX 10 mx.a\nmx.a IN A 127.0.{N}.3\norigin IN MX 10 mx.a\n",
        &[],
    );
    let refuse = Options {
        main: "smtpd_recipient_restrictions = check_recipient_access inline:{ {nobody@a.test = 550 5.1.1 nobody here by that name} }, permit_mynetworks, reject_unauth_destination\n".into(),
        ..Options::default()
    };
    let mx = net.exchanger(3, &["a.test", "origin.test"], &["alice", "sender"], &refuse);
    let stages = format!(
        "{}[stage-bounce]\nPROGRAM = {{bounce}}\nNEXT = out\n\n[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
        net.stage("out", "")
    );
    let (s, mut c) = Scenario::new("rti-550")
        .pepsi("HOSTNAME = pepsi.sender.test\n")
        .timers("")
        .stages(&stages)
        .connect();
    let _d = s.start();
    let mut bouncer = Bouncer::ready(&s.conf, &[]);
    inject(
        &mut c,
        "out",
        "sender@origin.test",
        &["alice@a.test", "nobody@a.test"],
    );
    assert_eq!(mx.wait_mailbox("alice", 1, WAIT).len(), 1);
    let report = mx.wait_mailbox("sender", 1, WAIT).remove(0);
    let report = String::from_utf8_lossy(&report);
    assert!(report.contains("nobody@a.test"), "{report}");
    assert!(report.contains("5.1.1"), "{report}");
    assert!(
        report.contains("nobody here by that name"),
        "the exchanger's text:\n{report}"
    );
    wait_empty(&mut c, WAIT);
    bouncer.terminate();
}

#[test]
fn opportunistic_tls_is_used_when_the_exchanger_offers_it() {
    if !runnable("rti tls") || !crate::util::tls_peer::ca_available("rti tls") {
        return;
    }
    let net = Net::new(45, "a IN MX 10 mx.a\nmx.a IN A 127.0.{N}.3\n", &[]);
    let ca = crate::util::tls_peer::TestCa::new("rti-tls");
    let o = Options {
        tls: Some(ca.server_cert("mx.a.test")),
        ..Options::default()
    };
    let mx = net.exchanger(3, &["a.test"], &["alice"], &o);
    let (s, mut c) = Scenario::new("rti-tls")
        .timers("")
        .stages(&net.stage("out", ""))
        .connect();
    let mut d = s.start();
    inject(&mut c, "out", "sender@origin.example", &["alice@a.test"]);
    assert_eq!(mx.wait_mailbox("alice", 1, WAIT).len(), 1);
    let log = mx.maillog();
    assert!(log.contains("TLS connection established from"), "{log}");
    d.terminate();
}

#[test]
fn never_more_than_destination_concurrency_sessions_from_four_stages_of_workers() {
    if !runnable("rti cap") {
        return;
    }
    let net = Net::new(46, "a IN MX 10 mx.a\nmx.a IN A 127.0.{N}.3\n", &[]);
    // Each session lasts at least a second: workers of every stage want one at once.
    let slow = Options {
        main: "smtpd_client_restrictions = sleep 1, permit\nsmtpd_delay_reject = no\n".into(),
        ..Options::default()
    };
    let mx = net.exchanger(3, &["a.test"], &["alice"], &slow);
    let cap = 2;
    let mut stages = String::new();
    for i in 1..=4 {
        stages.push_str(&net.stage(
            &format!("out{i}"),
            &format!(
                "PARALLELISM = 3\nDESTINATION_CONCURRENCY = {cap}\nCONNECTION_CACHE_TIME = 1s\n"
            ),
        ));
    }
    let (s, mut c) = Scenario::new("rti-cap")
        .timers("")
        .stages(&stages)
        .connect();
    let _d = s.start();
    for i in 1..=4 {
        for _ in 0..6 {
            inject(
                &mut c,
                &format!("out{i}"),
                "sender@origin.example",
                &["alice@a.test"],
            );
        }
    }
    let left = "SELECT count(*) FROM pepsi.workqueue";
    wait_until(Duration::from_secs(120), "all delivered", || {
        // Rows that found every slot taken pause a few seconds; make them due again.
        make_due(&mut c, "1 day");
        count(&mut c, left) == 0
    });
    assert_eq!(mx.wait_mailbox("alice", 24, WAIT).len(), 24);
    let log = mx.maillog();
    let most = max_open_sessions(&log);
    assert!(
        most <= cap,
        "{most} sessions at once, the cap is {cap}:\n{log}"
    );
    assert!(sessions(&log, net.at(1)) >= 1);
}

#[test]
fn a_dead_destination_is_suspended_shown_lifted_and_then_delivered() {
    if !runnable("rti dead") {
        return;
    }
    let net = Net::new(47, "d IN MX 10 mx.d\nmx.d IN A 127.0.{N}.3\n", &[]);
    let (s, mut c) = Scenario::new("rti-dead")
        .timers("")
        .stages(&net.stage("out", "DEAD_AFTER = 2\nDEAD_TIME = 1h\n"))
        .connect();
    let _d = s.start();
    let first = inject(&mut c, "out", "sender@origin.example", &["u@d.test"]);
    // Nothing listens yet: two failed deliveries suspend d.test.
    let suspended = "SELECT count(*) FROM pepsi.destinations WHERE destination = 'd.test' AND suspended_until > now()";
    wait_until(WAIT, "d.test suspended", || {
        due_now(&mut c, first);
        count(&mut c, suspended) == 1
    });
    let shown = run(
        &bin("pepsi-queue"),
        &["-c", s.conf.to_str().unwrap(), "destinations"],
    );
    assert!(shown.status.success(), "{shown:?}");
    assert!(stdout(&shown).contains("d.test"), "{}", stdout(&shown));
    assert!(stdout(&shown).contains("suspended"), "{}", stdout(&shown));
    // A new message waits without a strike: paused, no failure counted on it.
    let second = inject(&mut c, "out", "sender@origin.example", &["v@d.test"]);
    let waiting = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'paused' AND timeout > now() + interval '10 minutes'";
    wait_until(WAIT, "both wait out the suspension", || {
        // A row deferred by the failure that suspended it waits its backoff: due now.
        make_due(&mut c, "10 minutes");
        count(&mut c, waiting) == 2
    });
    let mx = net.exchanger(3, &["d.test"], &["u", "v"], &Options::default());
    let lifted = run(
        &bin("pepsi-queue"),
        &[
            "-c",
            s.conf.to_str().unwrap(),
            "destinations",
            "lift",
            "D.test",
        ],
    );
    assert!(lifted.status.success(), "{lifted:?}");
    assert_eq!(count(&mut c, suspended), 0);
    due_now(&mut c, first);
    due_now(&mut c, second);
    wait_empty(&mut c, WAIT);
    assert_eq!(mx.wait_mailbox("u", 1, WAIT).len(), 1);
    assert_eq!(mx.wait_mailbox("v", 1, WAIT).len(), 1);
    assert_eq!(queue_len(&mut c), 0);
}

#[test]
fn hostile_dns_a_thousand_mx_records_an_mx_naming_its_own_domain_a_compression_loop_and_64_kib_of_junk()
 {
    if !runnable("rti hostile") {
        return;
    }
    let mut many = String::new();
    for i in 0..1000 {
        many.push_str(&format!("many IN MX {} mx{i}.many\n", 10 + i));
    }
    many.push_str("mx0.many IN A 127.0.{N}.3\nself IN MX 10 self\nself IN A 127.0.{N}.3\n");
    // An exchanger whose name holds a space: no TLS name, so clear text at `may`.
    many.push_str("weird IN MX 10 mx\\032x.weird\nmx\\032x.weird IN A 127.0.{N}.3\n");
    let net = Net::new(48, &many, &[]);
    let mx = net.exchanger(
        3,
        &["many.test", "self.test", "weird.test"],
        &["m", "s", "w"],
        &Options::default(),
    );
    let hostile = HostileDns::start(Hostile::CompressionLoop);
    let huge = HostileDns::start(Hostile::Huge);
    let stages = format!(
        "{}[stage-looped]\nPROGRAM = {{relay-to-internet}}\nNAMESERVER = {}\nPORT = {}\n{TIMEOUTS}\n\
         [stage-huge]\nPROGRAM = {{relay-to-internet}}\nNAMESERVER = {}\nPORT = {}\n{TIMEOUTS}\n",
        net.stage("out", ""),
        hostile.addr(),
        net.port,
        huge.addr(),
        net.port
    );
    let (s, mut c) = Scenario::new("rti-hostile")
        .timers("")
        .stages(&stages)
        .connect();
    let _d = s.start();
    inject(
        &mut c,
        "out",
        "sender@origin.example",
        &["m@many.test", "s@self.test"],
    );
    assert_eq!(
        mx.wait_mailbox("m", 1, WAIT).len(),
        1,
        "1,000 MX records, over TCP"
    );
    assert_eq!(
        mx.wait_mailbox("s", 1, WAIT).len(),
        1,
        "an MX naming its own domain"
    );
    inject(&mut c, "out", "sender@origin.example", &["w@weird.test"]);
    assert_eq!(
        mx.wait_mailbox("w", 1, WAIT).len(),
        1,
        "an MX name TLS cannot carry"
    );
    let looped = inject(&mut c, "looped", "sender@origin.example", &["x@loop.test"]);
    wait_until(WAIT, "the looped answer defers", || {
        let st = state_of(&mut c, looped);
        st["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("4.4.3") && e.contains("malformed"))
    });
    assert!(hostile.queries() >= 1);
    // 64 KiB answers (over TCP, after a truncated one over UDP) of records of no type
    // the resolver reads: no MX, and the domain itself has no address either.
    let junk = inject(&mut c, "huge", "sender@origin.example", &["y@huge.test"]);
    wait_until(WAIT, "the junk answers fail the recipient", || {
        state_of(&mut c, junk)["dsn_status"]["y@huge.test"] == "5.4.4"
    });
    assert!(huge.queries() >= 4, "MX and A, each over UDP then TCP");
    wait_gone(
        &mut c,
        "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'out'",
    );
}

#[test]
fn an_exchanger_greeting_with_our_own_name_is_a_loop_and_one_greeting_with_100_kb_a_deferral() {
    if !runnable("rti loop") {
        return;
    }
    let net = Net::new(
        49,
        "me IN MX 10 mx.me\nmx.me IN A 127.0.{N}.3\nbig IN MX 10 mx.big\nmx.big IN A 127.0.{N}.4\n",
        &[],
    );
    let ourselves = Options {
        hostname: Some("pepsi.sender.test".into()),
        ..Options::default()
    };
    let mx = net.exchanger(3, &["me.test"], &["m"], &ourselves);
    // An exchanger whose greeting never ends: 100 KB of one reply line.
    let big = TcpListener::bind((net.at(4), net.port)).unwrap();
    std::thread::spawn(move || {
        for s in big.incoming().flatten() {
            let mut s = s;
            let _ = s.write_all(b"220-");
            let _ = s.write_all(&vec![b'x'; 100 * 1024]);
            let _ = s.write_all(b"\r\n220 done\r\n");
        }
    });
    let (s, mut c) = Scenario::new("rti-loop")
        .timers("")
        .stages(&net.stage("out", ""))
        .connect();
    let _d = s.start();
    inject(
        &mut c,
        "out",
        "sender@origin.example",
        &["m@me.test", "b@big.test"],
    );
    let failed = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'failed'";
    wait_until(WAIT, "the loop fails", || count(&mut c, failed) == 1);
    let state = state_of_recipient(&mut c, "m@me.test");
    assert_eq!(state["dsn_status"]["m@me.test"], "5.4.6", "{state}");
    assert!(mx.mailbox("m").is_empty());
    let deferred = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'paused' AND 'b@big.test' = ANY (rcpt_to)";
    wait_until(WAIT, "the 100 KB greeting defers", || {
        count(&mut c, deferred) == 1
    });
}

#[test]
fn one_kept_connection_serves_two_domains_whose_exchangers_share_an_address() {
    if !runnable("rti shared") {
        return;
    }
    let net = Net::new(
        50,
        "a IN MX 10 mx.a\nmx.a IN A 127.0.{N}.3\nb IN MX 10 mx.b\nmx.b IN A 127.0.{N}.3\n",
        &[],
    );
    let mx = net.exchanger(
        3,
        &["a.test", "b.test"],
        &["alice", "bob"],
        &Options::default(),
    );
    let (s, mut c) = Scenario::new("rti-shared")
        .timers("")
        .stages(&net.stage("out", "PARALLELISM = 1\nCONNECTION_CACHE_TIME = 60s\n"))
        .connect();
    let _d = s.start();
    inject(&mut c, "out", "sender@origin.example", &["alice@a.test"]);
    assert_eq!(mx.wait_mailbox("alice", 1, WAIT).len(), 1);
    inject(&mut c, "out", "sender@origin.example", &["bob@b.test"]);
    assert_eq!(mx.wait_mailbox("bob", 1, WAIT).len(), 1);
    inject(&mut c, "out", "sender@origin.example", &["alice@a.test"]);
    assert_eq!(mx.wait_mailbox("alice", 2, WAIT).len(), 2);
    let log = mx.maillog();
    assert_eq!(
        sessions(&log, net.at(1)),
        1,
        "one session for both domains:\n{log}"
    );
}

#[test]
fn an_exchanger_that_defers_everything_with_4_7_x_slows_its_destination_down_to_a_suspension() {
    if !runnable("rti slow") {
        return;
    }
    let net = Net::new(51, "s IN MX 10 mx.s\nmx.s IN A 127.0.{N}.3\n", &[]);
    let slow = Options {
        main: "smtpd_sender_restrictions = check_sender_access inline:{ {sender@origin.example = 451 4.7.1 too many messages, slow down} }\n".into(),
        ..Options::default()
    };
    let mx = net.exchanger(3, &["s.test"], &["u"], &slow);
    let (s, mut c) = Scenario::new("rti-slow")
        .timers("")
        .stages(&net.stage("out", "DEAD_AFTER = 2\nDEAD_TIME = 1h\n"))
        .connect();
    let _d = s.start();
    let id = inject(&mut c, "out", "sender@origin.example", &["u@s.test"]);
    // The exchanger is reached every time, and every time it says "slow down".
    let suspended = "SELECT count(*) FROM pepsi.destinations WHERE destination = 's.test' AND suspended_until > now() AND reason LIKE '%4.7.1%'";
    wait_until(WAIT, "s.test suspended", || {
        due_now(&mut c, id);
        count(&mut c, suspended) == 1
    });
    let log = mx.maillog();
    let refused = log.matches("too many messages, slow down;").count();
    assert!(refused >= 2, "two deliveries met the reply:\n{log}");
    assert!(mx.mailbox("u").is_empty());
}
