//! The delivery-to-the-internet benchmark: `cargo bench --bench internet` (release
//! build; as root, for the private Postfix instances, NSD on port 53 and a private
//! mount namespace). Pepsi's `relay-to-internet` against Postfix's own smtp(8): the
//! same mail to the same exchangers, found by the same DNS. Prints, measured in one
//! run and never asserted:
//!
//! - the machine (cores, Postfix's version) and the settings of both senders;
//! - for each sender, Postfix first, then Pepsi: the messages the exchangers took from
//!   it (their logs: each queue file of `client=…[SENDER]` that `discard` then logged
//!   `status=sent`), the seconds from the start of its delivery until its queue was
//!   empty, messages/s, the messages left in its queue, the connections it opened
//!   (`connect from …[SENDER]`), the most open at once (at most: the sum of each
//!   exchanger's most, from the order of its log lines), the messages in the
//!   exchangers' queues as its own queue emptied and the seconds until they were
//!   discarded too; its messages/s in each quarter of the messages;
//! - the CPU seconds from its start until then, by party: the sender (Postfix's master
//!   and its children; the dispatcher and its workers), PostgreSQL (Pepsi's run), the
//!   two exchangers, the whole machine (busy and iowait; other users' processes
//!   included), and the machine's milliseconds per message;
//! - the ratios Pepsi/Postfix of messages/s and of connections;
//! - for Postfix, how long filling its queue took, and its deferred deliveries if any;
//!   for Pepsi, its statements (`pg_stat_statements`: per message, and the six that
//!   took the server the most time), its stage events (`pepsi.stage_events`:
//!   connections opened, reused, shared …) and the warnings and errors its dispatcher
//!   logged.
//!
//! The set-up, on loopback addresses of its own (`127.0.60.x`, one port for all):
//!
//! - `BENCH_MESSAGES` (default 10,000) messages of a 2 KiB body, one recipient each,
//!   `rI@dK.test`, spread evenly over 20 domains `d1.test` … `d20.test`;
//! - NSD ([`Nsd::start_at`]) on `127.0.60.53:53` serving the zone `test.`: each domain
//!   `MX 10 mx1.dK.test` (`127.0.60.2`) and `MX 10 mx2.dK.test` (`127.0.60.3`);
//! - two exchangers, private Postfix instances on `127.0.60.2` and `127.0.60.3`, that
//!   take mail for every domain (`relay_domains`) and throw it away (`relay_transport =
//!   discard:bench`): no TLS, no reverse lookup of their clients;
//! - Postfix, a third private instance whose smtp(8) delivers from `127.0.60.5`. Its
//!   master runs in a private mount namespace whose `/etc/resolv.conf` says
//!   `nameserver 127.0.60.53` (`unshare --mount`, a bind mount), so that it finds the
//!   exchangers by NSD (`smtp_tcp_port` their port). Its queue is filled through its
//!   own smtpd, every message put on hold (`check_client_access static:HOLD`); the
//!   clock starts before `postsuper -H ALL` and `postqueue -f` and stops when its
//!   queue is empty. Settings: `default_process_limit` `BENCH_POSTFIX_PROCESSES`
//!   (default 100, Postfix's own), `default_destination_concurrency_limit = 20`,
//!   `smtp_tls_security_level = none`, Postfix's own queue timers, the rest its
//!   defaults (the connection cache on demand, 2 s);
//! - Pepsi, a dispatcher (log level info) with one `relay-to-internet` stage
//!   connecting from `127.0.60.1`: `NAMESERVER = 127.0.60.53`, `PARALLELISM`
//!   `BENCH_PARALLELISM` (default 8), `QUEUE_LIMIT` `BENCH_QUEUE_LIMIT` (default 16,
//!   as the recipe of `doc/operating.md`), `TLS = none`, `INET_PROTOCOLS = ipv4` (as the Postfix instances' `inet_protocols`),
//!   the rest its defaults (`DESTINATION_CONCURRENCY` 20, `CONNECTION_CACHE_TIME` 2 s,
//!   `MAX_MESSAGES` 1000), against the tests' throwaway PostgreSQL (`fsync = off`).
//!   The rows are injected while the dispatcher is not running; the clock starts as
//!   it is started and stops when the queue holds no row that is not failed.
//!   `BENCH_DISPATCH` adds `;`-separated `KEY = VALUE` lines to `[pepsi-dispatch]`
//!   (`BENCH_DISPATCH="FAIR_SCHEDULING = no"`). Postfix goes first, Pepsi second;
//!   `BENCH_ORDER=pepsi-first` the other way round (the second sender's exchangers pay
//!   for the first one's queue files on the file system).
//!
//! Every instance keeps its files under the temporary directory: `TMPDIR=/dev/shm`
//! puts the Postfix queues (and the PostgreSQL cluster) on tmpfs, apart from the disk's
//! file system (an ext4 without a journal scans for a free inode past the recently
//! deleted ones, which the exchangers' queue files make costly and uneven).
//! Before each sender the benchmark writes the file systems' dirty blocks out and waits
//! `BENCH_SETTLE` seconds (default 65; 0 skips it), so that neither sender's exchangers
//! meet the inodes a run before it deleted: such an ext4 reuses no inode deleted less
//! than a minute before and steps over each one to find a free inode.
//! `BENCH_ONLY=postfix` or `BENCH_ONLY=pepsi` runs one sender alone (to profile it).
//! `BENCH_TIMEOUT` (default 1800) bounds each wait in seconds. Everything started is
//! stopped when the benchmark ends, also when it fails.

#[allow(unused_imports, unused_macros)]
#[path = "../tests/util/mod.rs"]
mod util;
// The benchmark uses part of it.
#[allow(dead_code)]
#[path = "util/proc.rs"]
mod proc;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use postgres::Client;

use proc::{Machine, cpu_seconds, parent_of};
use util::exchangers::{max_open_sessions, sessions, zone};
use util::nsd::{self, Nsd};
use util::postfix::{self, POSTFIX, Postfix};
use util::scenario::Scenario;

/// The benchmark's network: `127.0.60.x`.
const fn at(host: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 60, host)
}

/// Where Pepsi connects from.
const PEPSI_FROM: Ipv4Addr = at(1);
/// The two exchangers, `mx1.dK.test` and `mx2.dK.test` of every domain.
const MX: [Ipv4Addr; 2] = [at(2), at(3)];
/// Where Postfix's smtp(8) connects from, and where its smtpd takes the mail to send.
const POSTFIX_FROM: Ipv4Addr = at(5);
/// NSD: port 53, which is all a `resolv.conf` can name.
const DNS: Ipv4Addr = at(53);

/// The recipient domains, `d1.test` … `d20.test`.
const DOMAINS: usize = 20;

/// The envelope sender of every message.
const ENVELOPE_FROM: &str = "bench@origin.test";

/// How often the end of a run is looked for: a look walks the Postfix queue's
/// directories or counts the rows, which costs the machine a little each time.
const POLL: Duration = Duration::from_millis(200);

/// Postfix's `sbin` programs besides `postfix`.
const POSTSUPER: &str = "/usr/sbin/postsuper";
const POSTQUEUE: &str = "/usr/sbin/postqueue";
const POSTCONF: &str = "/usr/sbin/postconf";

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How long any one wait may last (`BENCH_TIMEOUT`, seconds).
fn timeout() -> Duration {
    Duration::from_secs(env_number("BENCH_TIMEOUT", 1800))
}

/// Writes the file systems' dirty blocks out and waits `settle`, so that a sender's
/// exchangers do not meet the inodes the run before it deleted: an ext4 without a
/// journal reuses no inode deleted less than a minute before (six while its inode
/// table block is unwritten), and steps over each such one, reading its block, when it
/// creates a file. Each exchanger's queue file is created and deleted within that time.
fn settle_file_system(out: &mut impl Write, settle: Duration) {
    if settle.is_zero() {
        return;
    }
    writeln!(
        out,
        "  settling the file systems: sync, then {} s",
        settle.as_secs()
    )
    .unwrap();
    out.flush().unwrap();
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::thread::sleep(settle);
}

// ---------------------------------------------------------------------------------
// The mail.

/// One message: its recipient and its header block (each line ending in CRLF, no
/// blank line after).
struct Mail {
    rcpt: String,
    headers: Vec<u8>,
}

/// `n` messages, their recipients spread evenly over the domains.
fn mails(n: usize) -> Vec<Mail> {
    (0..n)
        .map(|i| {
            let rcpt = format!("r{i}@d{}.test", i % DOMAINS + 1);
            let headers = format!(
                "From: Bench <{ENVELOPE_FROM}>\r\nTo: <{rcpt}>\r\nSubject: internet benchmark {i}\r\n\
                 Date: Fri, 04 Dec 2026 12:00:00 +0000\r\nMessage-ID: <bench.{i}@origin.test>\r\n\
                 MIME-Version: 1.0\r\nContent-Type: text/plain; charset=us-ascii\r\n"
            );
            Mail {
                rcpt,
                headers: headers.into_bytes(),
            }
        })
        .collect()
}

/// A body of about 2 KiB: whole lines of text, none starting with a dot.
fn body() -> Vec<u8> {
    let mut b = Vec::with_capacity(2048);
    let mut i = 0;
    while b.len() < 2048 - 80 {
        b.extend_from_slice(
            format!("Line {i:04} of the benchmark's message, long enough to look like mail.\r\n")
                .as_bytes(),
        );
        i += 1;
    }
    b
}

// ---------------------------------------------------------------------------------
// The network: DNS and the exchangers.

/// A port free on every address of the benchmark that listens or connects.
fn free_port() -> u16 {
    loop {
        let first = TcpListener::bind((PEPSI_FROM, 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        if MX
            .iter()
            .chain([&POSTFIX_FROM])
            .all(|&a| TcpListener::bind((a, port)).is_ok())
        {
            return port;
        }
    }
}

/// The records of the zone `test.`: two exchangers of equal preference per domain.
fn records() -> String {
    let mut r = String::new();
    for k in 1..=DOMAINS {
        r.push_str(&format!(
            "d{k} IN MX 10 mx1.d{k}\nd{k} IN MX 10 mx2.d{k}\nmx1.d{k} IN A {}\nmx2.d{k} IN A {}\n",
            MX[0], MX[1]
        ));
    }
    r
}

/// Keeps only the last definition of each parameter in the instance's `main.cf` (the
/// benchmark's lines come after the helper's and replace some of them): Postfix warns
/// of every earlier one in every process it starts, and so many warnings at once fill
/// postlogd's socket while postlogd itself is writing its own to it, which blocks the
/// whole instance.
fn keep_last(conf: &Path) {
    let path = conf.join("main.cf");
    let text = std::fs::read_to_string(&path).unwrap();
    let key = |line: &str| -> Option<String> {
        let first = line.chars().next()?;
        if first.is_whitespace() || first == '#' {
            return None;
        }
        Some(line.split_once('=')?.0.trim().to_string())
    };
    let lines: Vec<&str> = text.lines().collect();
    let kept: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, line)| {
            key(line).is_none_or(|k| !lines[i + 1..].iter().any(|l| key(l).as_ref() == Some(&k)))
        })
        .map(|(_, line)| *line)
        .collect();
    std::fs::write(&path, kept.join("\n") + "\n").unwrap();
}

/// An exchanger on `address`:`port` that takes mail for every domain and discards it.
fn exchanger(n: usize, address: Ipv4Addr, port: u16) -> Postfix {
    let domains: Vec<String> = (1..=DOMAINS).map(|k| format!("d{k}.test")).collect();
    let main = format!(
        "relay_domains = {}\n\
         relay_transport = discard:bench\n\
         # Queue ids never used twice: the logs' lines are matched by them.\n\
         enable_long_queue_ids = yes\n\
         smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination\n\
         # Both senders' connections alike, without a reverse lookup through the\n\
         # machine's own resolver.\n\
         smtpd_peername_lookup = no\n",
        domains.join(" ")
    );
    Postfix::start_at(
        &format!("bench-mx{n}"),
        (address, port),
        &main,
        "",
        &[],
        keep_last,
    )
}

/// What the exchangers' logs say of one sender.
#[derive(Clone, Copy, Default)]
struct Seen {
    /// Messages accepted from it and discarded (delivered, as far as it is concerned).
    delivered: usize,
    /// SMTP sessions it opened.
    sessions: usize,
}

/// How many messages from `client` an exchanger's log shows taken and discarded: the
/// queue ids of its smtpd's lines `…/smtpd[PID]: QUEUEID: client=NAME[IP]` that also
/// have a line `…/discard[PID]: QUEUEID: to=<…>, …, status=sent (…)`.
fn delivered_from(maillog: &str, client: Ipv4Addr) -> usize {
    let queue_id = |line: &str, daemon: &str| -> Option<String> {
        let rest = &line[line.find(daemon)?..];
        let rest = &rest[rest.find("]: ")? + 3..];
        Some(rest.split(':').next()?.to_string())
    };
    let ip_tag = format!("[{client}]");
    let mut from_client = HashSet::new();
    let mut sent = HashSet::new();
    for line in maillog.lines() {
        if line.contains(": client=") && line.contains(&ip_tag) {
            from_client.extend(queue_id(line, "/smtpd["));
        } else if line.contains("/discard[") && line.contains("status=sent") {
            sent.extend(queue_id(line, "/discard["));
        }
    }
    from_client.intersection(&sent).count()
}

/// What both exchangers' logs say of `client` so far.
fn seen(exchangers: &[Postfix], client: Ipv4Addr) -> Seen {
    exchangers.iter().fold(Seen::default(), |s, mx| {
        let log = mx.maillog();
        Seen {
            delivered: s.delivered + delivered_from(&log, client),
            sessions: s.sessions + sessions(&log, client),
        }
    })
}

/// The messages in the exchangers' queues.
fn backlog(exchangers: &[Postfix]) -> usize {
    exchangers.iter().map(Postfix::queued).sum()
}

/// Waits until the exchangers' queues are empty (everything they took discarded).
fn wait_drained(exchangers: &[Postfix]) {
    let deadline = Instant::now() + timeout();
    while backlog(exchangers) > 0 && Instant::now() < deadline {
        std::thread::sleep(POLL);
    }
}

/// What the exchangers' logs say of `client` once they show `n` messages from it, or
/// no change for 10 seconds (their lines reach the files through postlogd, a moment
/// after the fact).
fn wait_logged(exchangers: &[Postfix], client: Ipv4Addr, n: usize) -> Seen {
    let mut last = (usize::MAX, Instant::now());
    loop {
        let now = seen(exchangers, client);
        if now.delivered >= n {
            return now;
        }
        if now.delivered != last.0 {
            last = (now.delivered, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(10) {
            return now;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The most sessions open at once at either exchanger in the part of its log from
/// `offset` on (each exchanger's own; their sum is an upper bound).
fn max_open_since(exchangers: &[Postfix], offsets: &[usize]) -> usize {
    exchangers
        .iter()
        .zip(offsets)
        .map(|(mx, &o)| max_open_sessions(mx.maillog().get(o..).unwrap_or("")))
        .sum()
}

/// The lengths of the exchangers' logs now.
fn log_offsets(exchangers: &[Postfix]) -> Vec<usize> {
    exchangers.iter().map(|mx| mx.maillog().len()).collect()
}

// ---------------------------------------------------------------------------------
// CPU seconds, by party.

/// CPU seconds of `leader` and its children, the ended ones (reaped: the leader's
/// `cutime` and `cstime`) and the live ones (with their own reaped children).
fn family_cpu(leader: u32) -> f64 {
    fn with_reaped(pid: u32) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let fields: Vec<f64> = stat
            .rsplit_once(')')
            .map_or("", |(_, r)| r)
            .split_whitespace()
            .map(|v| v.parse().unwrap_or(0.0))
            .collect();
        // After the command name: utime 11, stime 12, cutime 13, cstime 14.
        let reaped = fields.get(13).unwrap_or(&0.0) + fields.get(14).unwrap_or(&0.0);
        // SAFETY: sysconf has no preconditions.
        let tck = (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64;
        cpu_seconds(pid) + reaped / tck
    }
    let mut sum = with_reaped(leader);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) {
            if parent_of(pid) == leader {
                sum += with_reaped(pid);
            }
        }
    }
    sum
}

/// A Postfix instance's master process.
fn master_of(p: &Postfix) -> Option<u32> {
    let pid = std::fs::read_to_string(queue_dir(p).join("pid/master.pid")).ok()?;
    pid.trim().parse().ok()
}

/// The PostgreSQL server's postmaster (the throwaway cluster's).
fn postmaster() -> Option<u32> {
    let pid = std::fs::read_to_string(util::pg::data_dir()?.join("postmaster.pid")).ok()?;
    pid.lines().next()?.trim().parse().ok()
}

/// CPU seconds so far: the sender's family, PostgreSQL's, the exchangers' and the
/// machine's.
#[derive(Clone, Copy, Default)]
struct Cpu {
    sender: f64,
    database: f64,
    exchangers: f64,
    machine: Machine,
}

impl Cpu {
    fn now(sender: Option<u32>, exchangers: &[Postfix]) -> Cpu {
        Cpu {
            sender: sender.map_or(0.0, family_cpu),
            database: postmaster().map_or(0.0, family_cpu),
            exchangers: exchangers
                .iter()
                .filter_map(master_of)
                .map(family_cpu)
                .sum(),
            machine: Machine::now(),
        }
    }

    fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            sender: self.sender - earlier.sender,
            database: self.database - earlier.database,
            exchangers: self.exchangers - earlier.exchangers,
            machine: self.machine.since(earlier.machine),
        }
    }
}

// ---------------------------------------------------------------------------------
// Sender B: Postfix.

/// A Postfix instance's queue directory.
fn queue_dir(p: &Postfix) -> PathBuf {
    p.config_dir().parent().unwrap().join("queue")
}

/// Waits until an SMTP server on `address`:`port` greets.
#[track_caller]
fn wait_greeting(address: Ipv4Addr, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = TcpStream::connect((address, port)) {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut greeting = [0u8; 3];
            if s.read_exact(&mut greeting).is_ok() && &greeting == b"220" {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "nothing greets on {address}:{port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The sending Postfix: its smtpd on `POSTFIX_FROM`:`port` takes the mail (and holds
/// it), its smtp(8) delivers from `POSTFIX_FROM` to the exchangers on `port`. Started
/// as the tests' helper starts an instance, then stopped and started again inside a
/// private mount namespace whose `/etc/resolv.conf` names NSD; `postfix stop` (the
/// helper's, when the value drops) works from outside it.
fn start_sender(port: u16, processes: u64) -> Postfix {
    let main = format!(
        "# A name of its own: the exchangers greet with the helper's mx.pepsi.test.\n\
         myhostname = sender.pepsi.test\n\
         relayhost =\n\
         default_transport = smtp\n\
         relay_transport = smtp\n\
         smtp_bind_address = {POSTFIX_FROM}\n\
         # The exchangers' port for every MX host, as Pepsi's PORT.\n\
         smtp_tcp_port = {port}\n\
         smtp_tls_security_level = none\n\
         default_destination_concurrency_limit = 20\n\
         default_process_limit = {processes}\n\
         # Every message submitted waits on hold until the clock starts.\n\
         smtpd_recipient_restrictions = check_client_access static:HOLD, permit_mynetworks, reject\n\
         smtpd_peername_lookup = no\n\
         # Postfix's own queue timers, not the tests' short ones.\n\
         queue_run_delay = 300s\n\
         minimal_backoff_time = 300s\n\
         maximal_backoff_time = 4000s\n"
    );
    let p = Postfix::start_at(
        "bench-sender",
        (POSTFIX_FROM, port),
        &main,
        "",
        &[],
        |conf| {
            std::fs::write(conf.join("resolv.conf"), format!("nameserver {DNS}\n")).unwrap();
            keep_last(conf);
        },
    );
    // Started once by the helper, in this process's namespace: stop that master …
    let first = master_of(&p);
    p.run(POSTFIX, &["stop"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    // SAFETY: signal 0 only asks whether the process exists.
    while first.is_some_and(|pid| unsafe { libc::kill(pid as i32, 0) } == 0) {
        assert!(
            Instant::now() < deadline,
            "the sending Postfix did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // … and start it again where /etc/resolv.conf names NSD. The master daemonizes and
    // keeps the namespace; unshare's default propagation is private, so the bind mount
    // stays inside it.
    let resolv = p.config_dir().join("resolv.conf");
    let script = format!(
        "mount --bind '{}' /etc/resolv.conf && exec {POSTFIX} -c '{}' start",
        resolv.display(),
        p.config_dir().display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .expect("run unshare");
    assert!(
        out.status.success(),
        "cannot start the sending Postfix in a namespace of its own ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    wait_greeting(POSTFIX_FROM, port);
    // Its master sees NSD's resolv.conf, this process the machine's.
    let master = master_of(&p).expect("the sending Postfix's master runs");
    let seen =
        std::fs::read_to_string(format!("/proc/{master}/root/etc/resolv.conf")).unwrap_or_default();
    assert!(
        seen.contains(&format!("nameserver {DNS}")),
        "the sending Postfix's master sees another /etc/resolv.conf:\n{seen}"
    );
    p
}

/// One SMTP session with a submission server.
struct Smtp {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl Smtp {
    fn open(address: Ipv4Addr, port: u16) -> Smtp {
        let stream = TcpStream::connect((address, port)).expect("connect to the sender's smtpd");
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        let mut s = Smtp {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
            line: String::new(),
        };
        s.expect(220);
        s.writer.write_all(b"EHLO bench.origin.test\r\n").unwrap();
        s.expect(250);
        s
    }

    /// Reads a reply, which must have `code`.
    #[track_caller]
    fn expect(&mut self, code: u16) {
        let mut text = String::new();
        loop {
            self.line.clear();
            let n = self.reader.read_line(&mut self.line).expect("a reply");
            assert!(n > 0, "the sender's smtpd closed the connection");
            text.push_str(&self.line);
            if self.line.as_bytes().get(3) != Some(&b'-') {
                break;
            }
        }
        assert!(
            text.starts_with(&code.to_string()),
            "expected {code}, got: {text}"
        );
    }

    /// One message, MAIL, RCPT and DATA pipelined.
    fn send(&mut self, mail: &Mail, body: &[u8]) {
        self.writer
            .write_all(
                format!(
                    "MAIL FROM:<{ENVELOPE_FROM}>\r\nRCPT TO:<{}>\r\nDATA\r\n",
                    mail.rcpt
                )
                .as_bytes(),
            )
            .unwrap();
        self.expect(250);
        self.expect(250);
        self.expect(354);
        let mut data = Vec::with_capacity(mail.headers.len() + body.len() + 8);
        data.extend_from_slice(&mail.headers);
        data.extend_from_slice(b"\r\n");
        data.extend_from_slice(body);
        data.extend_from_slice(b".\r\n");
        self.writer.write_all(&data).unwrap();
        self.expect(250);
    }

    fn quit(mut self) {
        self.writer.write_all(b"QUIT\r\n").unwrap();
        self.expect(221);
    }
}

/// Submits `mails` to the sender's smtpd over four sessions; the seconds it took.
fn submit(port: u16, mails: &[Mail], body: &[u8]) -> f64 {
    let started = Instant::now();
    let sessions = 4;
    let share = mails.len().div_ceil(sessions);
    std::thread::scope(|scope| {
        for part in mails.chunks(share.max(1)) {
            scope.spawn(move || {
                let mut s = Smtp::open(POSTFIX_FROM, port);
                for mail in part {
                    s.send(mail, body);
                }
                s.quit();
            });
        }
    });
    started.elapsed().as_secs_f64()
}

/// Waits until every message of the sender's queue is on hold, `n` of them.
fn wait_held(p: &Postfix, n: usize) {
    let deadline = Instant::now() + timeout();
    loop {
        let held = postfix::count_files(&queue_dir(p).join("hold"));
        if held >= n && p.queued() == held {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{held} of {n} messages on hold in the sending Postfix, {} queued in all",
            p.queued()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls `remaining` (the messages a sender has still to send) until it is 0, or
/// until the benchmark's timeout; returns what it said last and the times at which
/// each quarter of `n` messages was gone (from `started`; `NAN` if it never was).
fn wait_sent(
    n: usize,
    started: Instant,
    mut remaining: impl FnMut() -> usize,
) -> (usize, [f64; 4]) {
    let deadline = Instant::now() + timeout();
    let mut quarters = [f64::NAN; 4];
    loop {
        let left = remaining();
        let gone = n.saturating_sub(left);
        for (q, at) in quarters.iter_mut().enumerate() {
            if at.is_nan() && gone * 4 >= n * (q + 1) {
                *at = started.elapsed().as_secs_f64();
            }
        }
        if left == 0 || Instant::now() >= deadline {
            return (left, quarters);
        }
        std::thread::sleep(POLL);
    }
}

/// One sender's run, as measured.
struct Run {
    /// Messages the exchangers took from it and discarded.
    delivered: usize,
    /// Seconds until its queue was empty (its last message taken by an exchanger).
    seconds: f64,
    /// Messages left in its queue (deferred, or failed) when its wait ended.
    left: usize,
    /// When each quarter of the messages had gone, in seconds from the start (to
    /// within [`POLL`]).
    quarters: [f64; 4],
    /// Messages in the exchangers' queues then, and the seconds until they were
    /// discarded too (from the same start).
    backlog: usize,
    drained: f64,
    /// The SMTP sessions it opened, and the most open at once.
    sessions: usize,
    max_open: usize,
    /// CPU seconds from the start until the exchangers had drained.
    cpu: Cpu,
}

impl Run {
    fn rate(&self) -> f64 {
        self.delivered as f64 / self.seconds
    }

    /// The end of a run whose sender's queue is empty now: waits until the exchangers
    /// have drained, takes the CPU seconds since `before` (the sender's family led by
    /// `sender`), then reads the exchangers' logs from `offsets` on.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        exchangers: &[Postfix],
        client: Ipv4Addr,
        n: usize,
        started: Instant,
        (left, quarters): (usize, [f64; 4]),
        sender: Option<u32>,
        before: Cpu,
        offsets: &[usize],
    ) -> Run {
        // When the last quarter was seen gone, unless the wait ended before.
        let seconds = if quarters[3].is_nan() {
            started.elapsed().as_secs_f64()
        } else {
            quarters[3]
        };
        let backlog = backlog(exchangers);
        wait_drained(exchangers);
        let drained = started.elapsed().as_secs_f64();
        let cpu = Cpu::now(sender, exchangers).since(before);
        let seen = wait_logged(exchangers, client, n);
        Run {
            delivered: seen.delivered,
            seconds,
            left,
            quarters,
            backlog,
            drained,
            sessions: seen.sessions,
            max_open: max_open_since(exchangers, offsets),
            cpu,
        }
    }
}

/// Postfix's run: fills its queue, then times the flush until the queue is empty.
fn postfix_run(
    out: &mut impl Write,
    exchangers: &[Postfix],
    mails: &[Mail],
    body: &[u8],
    processes: u64,
) -> Run {
    let port = exchangers[0].port;
    let sender = start_sender(port, processes);
    let submitted = submit(port, mails, body);
    wait_held(&sender, mails.len());
    writeln!(
        out,
        "  Postfix: {} messages submitted to its smtpd and held in {submitted:.1} s",
        mails.len()
    )
    .unwrap();
    out.flush().unwrap();
    let offsets = log_offsets(exchangers);
    let master = master_of(&sender);
    let before = Cpu::now(master, exchangers);
    let started = Instant::now();
    sender.run(POSTSUPER, &["-H", "ALL"]);
    sender.run(POSTQUEUE, &["-f"]);
    let released = started.elapsed().as_secs_f64();
    let sent = wait_sent(mails.len(), started, || sender.queued());
    let run = Run::finish(
        exchangers,
        POSTFIX_FROM,
        mails.len(),
        started,
        sent,
        master,
        before,
        &offsets,
    );
    let log = sender.maillog();
    let smtp = |what: &str| {
        log.lines()
            .filter(|l| l.contains("/smtp[") && l.contains(what))
            .count()
    };
    // smtp(8) logs `conn_use=N` for a delivery over a connection used before.
    writeln!(
        out,
        "  Postfix: released and flushed in {released:.2} s; smtp(8) logged {} sent, {} of \
         them over a connection used before",
        smtp("status=sent"),
        log.lines()
            .filter(|l| l.contains("/smtp[")
                && l.contains("status=sent")
                && l.contains("conn_use="))
            .count()
    )
    .unwrap();
    let deferred = smtp("status=deferred");
    if deferred > 0 {
        writeln!(
            out,
            "  Postfix deferred {deferred} deliveries; the first: {}",
            log.lines()
                .find(|l| l.contains("/smtp[") && l.contains("status=deferred"))
                .unwrap_or("")
        )
        .unwrap();
    }
    run
}

// ---------------------------------------------------------------------------------
// Sender A: Pepsi.

/// The dispatcher as a child process, in a process group of its own, its log in a
/// file; stopped (SIGTERM, then SIGKILL after 30 s) when dropped.
struct Dispatcher(Child);

impl Dispatcher {
    fn start(conf: &Path, log: &Path) -> Dispatcher {
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_pepsi-dispatch"))
            .arg("-c")
            .arg(conf)
            .args(["-L", "info", "serve"])
            .env_remove("PEPSI_CONFIG")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start pepsi-dispatch");
        Dispatcher(child)
    }

    fn stop(&mut self) {
        let group = self.0.id() as i32;
        // SAFETY: signalling the dispatcher's own process group (process_group(0));
        // its id is not reused while the leader is unreaped.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.0.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                // SAFETY: as above.
                unsafe { libc::kill(-group, libc::SIGKILL) };
                let _ = self.0.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Injects the messages at `stage`, a thousand a statement.
fn inject(c: &mut Client, stage: &str, mails: &[Mail], body: &[u8]) {
    for part in mails.chunks(1000) {
        let rcpts: Vec<&str> = part.iter().map(|m| m.rcpt.as_str()).collect();
        let headers: Vec<&[u8]> = part.iter().map(|m| m.headers.as_slice()).collect();
        c.execute(
            "/* bench */ SELECT count(pepsi.workqueue_inject($1, $2, ARRAY[t.rcpt], t.headers, $3::bytea)) \
               FROM unnest($4::text[], $5::bytea[]) AS t(rcpt, headers)",
            &[&stage, &ENVELOPE_FROM, &body, &rcpts, &headers],
        )
        .unwrap();
    }
}

/// Rows in the queue: all of them, and those failed.
fn rows(c: &mut Client) -> (i64, i64) {
    let row = c
        .query_one(
            "/* bench */ SELECT count(*), count(*) FILTER (WHERE status = 'failed') FROM pepsi.workqueue",
            &[],
        )
        .unwrap();
    (row.get(0), row.get(1))
}

/// Pepsi's run: the rows injected, the dispatcher started, the clock run until no row
/// is left but failed ones.
fn pepsi_run(
    out: &mut impl Write,
    exchangers: &[Postfix],
    mails: &[Mail],
    body: &[u8],
    section: &str,
) -> Run {
    // BENCH_DISPATCH: `KEY = VALUE` lines for [pepsi-dispatch], `;`-separated
    // (`FAIR_SCHEDULING = no`), over the tests' timers.
    let dispatch = std::env::var("BENCH_DISPATCH")
        .unwrap_or_default()
        .replace(';', "\n");
    let (s, mut c) = Scenario::new("bench-internet")
        .timers(&dispatch)
        .stages(section)
        .connect();
    inject(&mut c, "out", mails, body);
    // The statements of the run, where the server counts them (the tests' cluster
    // loads pg_stat_statements).
    let counting = c
        .batch_execute("/* bench */ SELECT pg_stat_statements_reset()")
        .is_ok();
    let offsets = log_offsets(exchangers);
    let log_path = s.dir.path("dispatch.log");
    let before = Cpu::now(None, exchangers);
    let started = Instant::now();
    let mut d = Dispatcher::start(&s.conf, &log_path);
    // Failed rows stay in the queue: they are not to be sent any more.
    let (_, quarters) = wait_sent(mails.len(), started, || {
        let (all, failed) = rows(&mut c);
        (all - failed) as usize
    });
    let left = rows(&mut c).0 as usize;
    // The dispatcher's family from its start: nothing of it before.
    let run = Run::finish(
        exchangers,
        PEPSI_FROM,
        mails.len(),
        started,
        (left, quarters),
        Some(d.0.id()),
        before,
        &offsets,
    );
    // Stopped before its events are read: it writes its statistics as it stops.
    d.stop();
    if counting {
        statements(out, &mut c, mails.len());
    }
    let events = c
        .query(
            "/* bench */ SELECT event, count FROM pepsi.stage_events WHERE stage = 'out' ORDER BY event",
            &[],
        )
        .unwrap();
    let events: Vec<String> = events
        .iter()
        .map(|r| format!("{} {}", r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    writeln!(out, "  Pepsi's stage events: {}", events.join(", ")).unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let notable: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    writeln!(
        out,
        "  Pepsi's dispatcher logged {} lines, {} of them warnings or errors{}",
        log.lines().count(),
        notable.len(),
        if notable.is_empty() {
            ""
        } else {
            "; the first:"
        }
    )
    .unwrap();
    for line in notable.iter().take(5) {
        writeln!(out, "    {line}").unwrap();
    }
    if left > 0 {
        let statuses = c
            .query(
                "/* bench */ SELECT status::text, count(*) FROM pepsi.workqueue GROUP BY 1 ORDER BY 1",
                &[],
            )
            .unwrap();
        for r in statuses {
            writeln!(
                out,
                "  Pepsi's queue still holds {} rows {}",
                r.get::<_, i64>(1),
                r.get::<_, String>(0)
            )
            .unwrap();
        }
    }
    run
}

/// The statements of Pepsi's run (every session's but the benchmark's own), from
/// `pg_stat_statements`: how many per message, and the six that took the most time.
fn statements(out: &mut impl Write, c: &mut Client, n: usize) {
    let rows = c
        .query(
            "/* bench */ SELECT s.calls, s.rows, s.total_exec_time + s.total_plan_time, s.query \
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
              WHERE d.datname = current_database() AND s.toplevel \
                AND s.query NOT LIKE '%/* bench */%' \
              ORDER BY 3 DESC",
            &[],
        )
        .unwrap();
    let calls: i64 = rows.iter().map(|r| r.get::<_, i64>(0)).sum();
    let ms: f64 = rows.iter().map(|r| r.get::<_, f64>(2)).sum();
    writeln!(
        out,
        "  Pepsi's statements: {calls} ({:.1} per message), {:.1} s in the server ({:.2} ms per message); the longest in all:",
        calls as f64 / n as f64,
        ms / 1000.0,
        ms / n as f64
    )
    .unwrap();
    for r in rows.iter().take(6) {
        let (calls, rows, ms, text): (i64, i64, f64, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let short: String = text.chars().take(90).collect();
        writeln!(
            out,
            "    {calls:7} calls {:6.1} rows/call {:7.3} ms/call {:6.2} s  {short}",
            rows as f64 / calls.max(1) as f64,
            ms / calls.max(1) as f64,
            ms / 1000.0
        )
        .unwrap();
    }
}

// ---------------------------------------------------------------------------------

/// Postfix's version, from `postconf`.
fn postfix_version() -> String {
    let out = Command::new(POSTCONF)
        .args(["-d", "-h", "mail_version"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    if out.is_empty() { "?".into() } else { out }
}

/// The two tables: delivery, then CPU seconds from the start until the exchangers
/// had drained (the whole work of the sender's mail, theirs included).
fn print_runs(out: &mut impl Write, runs: &[(&str, &Run)]) {
    writeln!(
        out,
        "\n{:<8} {:>9} {:>8} {:>8} {:>5} {:>11} {:>8} | {:>18} {:>9}",
        "sender",
        "delivered",
        "seconds",
        "msg/s",
        "left",
        "connections",
        "max open",
        "exchangers' queue",
        "drained s"
    )
    .unwrap();
    for (name, r) in runs {
        writeln!(
            out,
            "{name:<8} {:>9} {:>8.2} {:>8.0} {:>5} {:>11} {:>8} | {:>18} {:>9.2}",
            r.delivered,
            r.seconds,
            r.rate(),
            r.left,
            r.sessions,
            r.max_open,
            r.backlog,
            r.drained
        )
        .unwrap();
    }
    writeln!(
        out,
        "\nmsg/s by quarter of the messages (the first with the start):"
    )
    .unwrap();
    for (name, r) in runs {
        let n = r.delivered.max(1) as f64 / 4.0;
        let mut from = 0.0;
        let rates: Vec<String> = r
            .quarters
            .iter()
            .map(|&at| {
                let rate = n / (at - from);
                from = at;
                format!("{rate:>8.0}")
            })
            .collect();
        writeln!(out, "{name:<26} {}", rates.join(" ")).unwrap();
    }
    writeln!(
        out,
        "\nCPU seconds until drained: {:<8} {:>8} {:>10} {:>8} {:>7} | machine ms/message",
        "sender", "database", "exchangers", "machine", "iowait"
    )
    .unwrap();
    for (name, r) in runs {
        let c = &r.cpu;
        writeln!(
            out,
            "{name:<26} {:>8.1} {:>8.1} {:>10.1} {:>8.1} {:>7.1} | {:>6.2}",
            c.sender,
            c.database,
            c.exchangers,
            c.machine.busy,
            c.machine.iowait,
            1000.0 * c.machine.busy / r.delivered.max(1) as f64
        )
        .unwrap();
    }
}

fn main() {
    // `cargo bench` passes --bench; a plain `cargo test --benches` run lists nothing.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if !nsd::available("the internet benchmark") || !postfix::available("the internet benchmark") {
        return;
    }
    let n = env_number("BENCH_MESSAGES", 10_000) as usize;
    let parallelism = env_number("BENCH_PARALLELISM", 8);
    let queue_limit = env_number("BENCH_QUEUE_LIMIT", 16);
    let processes = env_number("BENCH_POSTFIX_PROCESSES", 100);
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    let out = std::io::stdout();
    let mut out = out.lock();

    // The tests' throwaway PostgreSQL runs through both runs (idle during Postfix's),
    // as on a machine that has it; started here, before anything is measured.
    let _ = util::pg::server();
    let port = free_port();
    let zone_text = zone("test", &records());
    let _dns = Nsd::start_at(
        "bench-internet",
        SocketAddr::from((DNS, 53)),
        &[("test", Some(zone_text.as_str()))],
    );
    let exchangers = [exchanger(1, MX[0], port), exchanger(2, MX[1], port)];
    let mails = mails(n);
    let body = body();
    let section = format!(
        "[stage-out]\nPROGRAM = {{relay-to-internet}}\nNAMESERVER = {DNS}\nPORT = {port}\n\
         HOSTNAME = pepsi.sender.test\nBIND_ADDRESS = {PEPSI_FROM}\nTLS = none\n\
         INET_PROTOCOLS = ipv4\nPARALLELISM = {parallelism}\nQUEUE_LIMIT = {queue_limit}\n"
    );

    writeln!(
        out,
        "pepsi internet benchmark: relay-to-internet against Postfix {} smtp(8); {cores} CPUs",
        postfix_version()
    )
    .unwrap();
    writeln!(
        out,
        "{n} messages, {} byte body, one recipient each, to {DOMAINS} domains d1.test .. d{DOMAINS}.test,\n  \
         each MX 10 mx1 ({}) and MX 10 mx2 ({}), port {port}, Postfix exchangers discarding;\n  \
         DNS: NSD on {DNS}:53; no TLS anywhere",
        body.len(),
        MX[0],
        MX[1]
    )
    .unwrap();
    writeln!(
        out,
        "Postfix from {POSTFIX_FROM}: default_process_limit = {processes}, \
         default_destination_concurrency_limit = 20,\n  smtp_tls_security_level = none, \
         connection cache on demand (smtp_connection_cache_time_limit 2s), resolv.conf -> {DNS}"
    )
    .unwrap();
    writeln!(
        out,
        "Pepsi from {PEPSI_FROM}: PARALLELISM = {parallelism}, QUEUE_LIMIT = {queue_limit}, \
         DESTINATION_CONCURRENCY = 20 (default),\n  CONNECTION_CACHE_TIME = 2s (default), \
         MAX_MESSAGES = 1000 (default), TLS = none, INET_PROTOCOLS = ipv4, log level info"
    )
    .unwrap();
    out.flush().unwrap();

    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    // The second sender meets exchangers whose file system has just created and
    // deleted the first one's 10,000 queue files, which costs them more: with
    // BENCH_ORDER=pepsi-first, Pepsi goes first.
    let pepsi_first = std::env::var("BENCH_ORDER").is_ok_and(|o| o == "pepsi-first");
    let mut postfix = None;
    let mut pepsi = None;
    let settle = Duration::from_secs(env_number("BENCH_SETTLE", 65));
    for turn in [pepsi_first, !pepsi_first] {
        if (turn && only == "postfix") || (!turn && only == "pepsi") {
            continue;
        }
        settle_file_system(&mut out, settle);
        if turn {
            pepsi = Some(pepsi_run(&mut out, &exchangers, &mails, &body, &section));
        } else {
            postfix = Some(postfix_run(&mut out, &exchangers, &mails, &body, processes));
        }
        out.flush().unwrap();
    }

    let runs: Vec<(&str, &Run)> = [("postfix", postfix.as_ref()), ("pepsi", pepsi.as_ref())]
        .into_iter()
        .filter_map(|(name, run)| Some((name, run?)))
        .collect();
    print_runs(&mut out, &runs);
    if let (Some(postfix), Some(pepsi)) = (&postfix, &pepsi) {
        writeln!(
            out,
            "ratio pepsi/postfix: msg/s {:.2}, connections {:.2}",
            pepsi.rate() / postfix.rate(),
            pepsi.sessions as f64 / postfix.sessions.max(1) as f64
        )
        .unwrap();
    }
}
