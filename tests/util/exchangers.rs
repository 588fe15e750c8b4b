//! Mail exchangers for relay-to-internet's tests: private Postfix instances
//! (`util::postfix`) on loopback addresses of their own (127.0.0.2, 127.0.0.3 …), all
//! on one port, taking mail for the test's domains into the maildirs of
//! `LOCAL@local.test` (the local part kept, the domain dropped); a zone file for them
//! (`util::nsd` serves it); and what an exchanger's log tells: its SMTP sessions, and
//! how many were open at once.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use super::postfix::Postfix;

/// The options of one exchanger.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Its `myhostname` (default Postfix's test name `mx.pepsi.test`).
    pub hostname: Option<String>,
    /// STARTTLS with this certificate and key (from `tls_peer::TestCa`).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// More `main.cf` lines.
    pub main: String,
}

/// Starts an exchanger on `address`:`port` taking mail for `domains` into the maildirs
/// of `mailboxes` (by local part).
#[track_caller]
pub fn start(
    tag: &str,
    (address, port): (Ipv4Addr, u16),
    domains: &[&str],
    mailboxes: &[&str],
    options: &Options,
) -> Postfix {
    let mut main = format!(
        "virtual_alias_domains = {}\nvirtual_alias_maps = regexp:$config_directory/catchall\n\
         smtpd_relay_restrictions = reject_unauth_destination\n",
        domains.join(" ")
    );
    if let Some(h) = &options.hostname {
        main.push_str(&format!("myhostname = {h}\n"));
    }
    let mut master = String::new();
    if options.tls.is_some() {
        main.push_str(
            "smtpd_tls_security_level = may\n\
             smtpd_tls_cert_file = $config_directory/cert.pem\n\
             smtpd_tls_key_file = $config_directory/key.pem\n\
             smtpd_tls_loglevel = 1\n",
        );
        master.push_str("tlsmgr unix - - n 1000? 1 tlsmgr\n");
    }
    main.push_str(&options.main);
    let tls = options.tls.clone();
    Postfix::start_at(tag, (address, port), &main, &master, mailboxes, |conf| {
        std::fs::write(conf.join("catchall"), "/^([^@]+)@.*$/ ${1}@local.test\n").unwrap();
        if let Some((cert, key)) = &tls {
            use std::os::unix::fs::PermissionsExt;
            for (from, to) in [(cert, "cert.pem"), (key, "key.pem")] {
                std::fs::copy(from, conf.join(to)).unwrap();
                std::fs::set_permissions(conf.join(to), std::fs::Permissions::from_mode(0o600))
                    .unwrap();
            }
        }
    })
}

/// The SMTP sessions from `client` in an exchanger's log (`smtpd[…]: connect from
/// NAME[CLIENT]`); the helper's own check of the greeting comes from 127.0.0.1.
pub fn sessions(maillog: &str, client: Ipv4Addr) -> usize {
    maillog
        .lines()
        .filter(|l| {
            l.contains("/smtpd[")
                && l.contains(": connect from ")
                && l.contains(&format!("[{client}]"))
        })
        .count()
}

/// The most SMTP sessions open at once in an exchanger's log: each `connect from`
/// opens one, its `disconnect from` (or the smtpd's `lost connection`-free exit,
/// logged as `disconnect from` too) closes it, in the log's order. A session closed
/// just before another opened may be logged after it, so this can only overcount.
pub fn max_open_sessions(maillog: &str) -> usize {
    let (mut open, mut max) = (0usize, 0usize);
    for line in maillog.lines().filter(|l| l.contains("/smtpd[")) {
        if line.contains(": connect from ") {
            open += 1;
            max = max.max(open);
        } else if line.contains(": disconnect from ") {
            open = open.saturating_sub(1);
        }
    }
    max
}

/// A zone for `origin` with its SOA and NS records, then `records` (zone file lines,
/// names relative to the origin).
pub fn zone(origin: &str, records: &str) -> String {
    format!(
        "$ORIGIN {origin}.\n$TTL 60\n@ IN SOA ns.{origin}. hostmaster.{origin}. 1 3600 600 86400 60\n\
         @ IN NS ns.{origin}.\nns IN A 127.0.0.1\n{records}\n"
    )
}
