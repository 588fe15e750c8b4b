//! The ingress benchmark: `cargo bench --bench ingress` (release build). Starts
//! `pepsi-ingress serve` (the binary cargo builds for this benchmark, in the bench
//! profile, i.e. `target/release/pepsi-ingress`) listening for LMTP on a free port of
//! 127.0.0.1, against one PostgreSQL server (a throwaway cluster, or `DATABASE_URL`),
//! and drives it with client threads speaking LMTP (RFC 2033) over TCP: each sends the
//! greeting's LHLO, then per message MAIL, three RCPT and DATA pipelined in one write
//! (RFC 2920), reads their five replies, writes the 4 KiB message with its final "."
//! and reads the three replies (one per recipient) that come after its commit.
//!
//! The throwaway cluster of the test harness runs with `fsync` and `full_page_writes`
//! off; here both are turned on (`ALTER SYSTEM` and a reload, with
//! `track_wal_io_timing` for the WAL flush times), so every commit waits for a real
//! flush of the write-ahead log, as in production. An external server (`DATABASE_URL`)
//! is used as it is configured; the header says which and what its settings are.
//!
//! Each run has a database and a daemon of its own: every client sends a few messages
//! to warm up, then all start together and take messages from one count until
//! `BENCH_MESSAGES` (default 20,000) are sent. Printed per run, measured and never
//! asserted, beside the targets (≥ 2,000 accepted messages/s, p99 ≤ 20 ms,
//! ≥ 10 messages per commit at 16 clients):
//!
//! - accepted messages/s (messages whose every reply was 2xx, over the run's time);
//! - p50, p99 and max of the time from the client's write of the final "." to the last
//!   reply of that message;
//! - commits per second and messages per commit: the calls and rows of the committer's
//!   statement (`sql::INJECT_MANY`, one per commit) in `pg_stat_statements` over the
//!   run, else the transactions of the database (`pg_stat_database.xact_commit`); and,
//!   for comparison, `pepsi.ingress_stats` as the daemon wrote it at its SIGTERM
//!   (its whole life, warm-up included);
//! - where a commit's time goes: the statement's mean execution time against the
//!   time per commit, the statements `workqueue_inject_many` runs inside it with their time
//!   per message (`pg_stat_statements.track = all`, as the throwaway cluster has it),
//!   and the WAL flushes of the run (`pg_stat_wal`: count and mean time; WAL bytes per
//!   message from the WAL position; full-page images);
//! - CPU seconds during the run (from /proc) of the ingress (and of its committer
//!   thread), of its database session, of all of PostgreSQL, of the client threads,
//!   and the machine's busy and iowait seconds (the machine is shared: others' work
//!   shows as the difference).
//!
//! Runs: `BENCH_CLIENTS` (comma-separated, default `16`) client counts, then always one
//! client (`BENCH_SINGLE_MESSAGES`, default 1,000 messages): a lone message's latency,
//! with no other message to share its commit. Last, the memory run: `BENCH_LARGE`
//! (default 10) clients send one message each of the largest size the daemon accepts
//! (`MAX_MESSAGE_SIZE`, default 10,240,000 bytes, with `SIZE=` declared) at once; it
//! prints the daemon's peak resident memory (`VmHWM`) before and after, and the growth
//! per message. `BENCH_INGRESS=PATH` measures another
//! `pepsi-ingress` binary instead (two builds compared in one session).

#[path = "util/durable.rs"]
mod durable;
#[allow(dead_code)]
#[path = "../tests/util/pg.rs"]
mod pg;
#[path = "util/proc.rs"]
mod proc;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use durable::durable_server;
use pg::TestDb;
use postgres::Client;
use proc::{Machine, cpu_of_families, cpu_seconds, parent_of, thread_cpu_seconds};

/// The size of every message, header block and body (the final "." not counted).
const MESSAGE_SIZE: usize = 4096;
/// Recipients per message.
const RECIPIENTS: usize = 3;
/// Messages each client sends before the measured run.
const WARMUP_PER_CLIENT: u64 = 25;
/// How long the warm-up's statistics are given to reach the views: a backend reports
/// at most once a second, and one that goes idle less than a second after its last
/// report does so 10 s later (PostgreSQL's PGSTAT_IDLE_INTERVAL).
const STATS_SETTLE: Duration = Duration::from_millis(10_500);

/// The login role the daemon injects as, a member of `pepsi_inject`.
const INJECT_LOGIN: &str = "pepsi_bench_inject";

/// The targets, printed beside the figures.
const TARGET_RATE: f64 = 2000.0;
const TARGET_P99_MS: f64 = 20.0;
const TARGET_PER_COMMIT: f64 = 10.0;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace([',', '_'], "").parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

/// `BENCH_CLIENTS`: the client counts of the concurrent runs, default 16.
fn client_counts() -> Vec<usize> {
    std::env::var("BENCH_CLIENTS")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty() && !v.contains(&0))
        .unwrap_or_else(|| vec![16])
}

// ---------------------------------------------------------------------------------
// The server: durable, and what it counts.

/// The server's cumulative counters, read before and after a run.
#[derive(Clone, Copy, Default)]
struct ServerCounts {
    /// Committed transactions of the database.
    xact_commit: i64,
    /// `pg_stat_wal`: WAL flushes (syncs), their time in ms, writes, full-page images.
    wal_sync: i64,
    wal_sync_ms: f64,
    wal_write: i64,
    wal_fpi: i64,
}

impl ServerCounts {
    /// One statement (so one transaction, whose statistics snapshot is fresh).
    fn read(c: &mut Client) -> ServerCounts {
        let r = c
            .query_one(
                "/* bench */ SELECT d.xact_commit, w.wal_sync, w.wal_sync_time, w.wal_write, w.wal_fpi \
                   FROM pg_stat_database d, pg_stat_wal w WHERE d.datname = current_database()",
                &[],
            )
            .unwrap();
        ServerCounts {
            xact_commit: r.get(0),
            wal_sync: r.get(1),
            wal_sync_ms: r.get(2),
            wal_write: r.get(3),
            wal_fpi: r.get(4),
        }
    }

    fn since(self, before: ServerCounts) -> ServerCounts {
        ServerCounts {
            xact_commit: self.xact_commit - before.xact_commit,
            wal_sync: self.wal_sync - before.wal_sync,
            wal_sync_ms: self.wal_sync_ms - before.wal_sync_ms,
            wal_write: self.wal_write - before.wal_write,
            wal_fpi: self.wal_fpi - before.wal_fpi,
        }
    }
}

/// The WAL's insert position, in bytes: immediate and exact, where the statistics views
/// lag.
fn wal_position(c: &mut Client) -> f64 {
    c.query_one(
        "/* bench */ SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::float8",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Does the server count statements (`pg_stat_statements` installed and loaded)?
fn counts_statements(c: &mut Client) -> bool {
    c.batch_execute("/* bench */ SELECT pg_stat_statements_reset()")
        .is_ok()
}

/// The committer's statement over the run: (calls, rows, mean execution ms).
fn inject_statement(c: &mut Client) -> Option<(i64, i64, f64)> {
    c.query_opt(
        "/* bench */ SELECT sum(s.calls)::int8, sum(s.rows)::int8, \
                sum(s.total_exec_time) / greatest(sum(s.calls), 1) \
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
          WHERE d.datname = current_database() AND s.query LIKE '%workqueue_inject_many%' AND s.toplevel \
            AND s.query NOT LIKE '%/* bench */%' \
         HAVING sum(s.calls) > 0",
        &[],
    )
    .ok()
    .flatten()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// The statements run inside the committer's statement (by `workqueue_inject_many`, when
/// `pg_stat_statements.track = all`, as on the throwaway cluster) that took the most
/// time over the run: (calls, total ms, planning ms, text).
fn nested_statements(c: &mut Client) -> Vec<(i64, f64, f64, String)> {
    c.query(
        "/* bench */ SELECT s.calls, s.total_exec_time + s.total_plan_time, s.total_plan_time, s.query \
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
          WHERE d.datname = current_database() AND NOT s.toplevel \
            AND s.query NOT LIKE '%/* bench */%' \
          ORDER BY 2 DESC LIMIT 8",
        &[],
    )
    .map(|rows| {
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect()
    })
    .unwrap_or_default()
}

// ---------------------------------------------------------------------------------
// CPU from /proc (`util/proc.rs`).

/// CPU seconds of everything the run involves, read at once.
#[derive(Clone, Copy, Default)]
struct Cpu {
    ingress: f64,
    committer: f64,
    backend: f64,
    postgres: f64,
    clients: f64,
    machine: Machine,
}

impl Cpu {
    fn read(ingress: u32, backend: u32, postmaster: u32) -> Cpu {
        Cpu {
            ingress: cpu_seconds(ingress),
            committer: thread_cpu_seconds(ingress, "committer"),
            backend: cpu_seconds(backend),
            postgres: cpu_of_families(&[postmaster])[0],
            clients: cpu_seconds(std::process::id()),
            machine: Machine::now(),
        }
    }

    fn since(self, b: Cpu) -> Cpu {
        Cpu {
            ingress: self.ingress - b.ingress,
            committer: self.committer - b.committer,
            backend: self.backend - b.backend,
            postgres: self.postgres - b.postgres,
            clients: self.clients - b.clients,
            machine: self.machine.since(b.machine),
        }
    }
}

// ---------------------------------------------------------------------------------
// The daemon.

/// The daemon measured: `BENCH_INGRESS` (another build, to compare two in one
/// session), else the one cargo built for this benchmark.
fn ingress_binary() -> PathBuf {
    std::env::var_os("BENCH_INGRESS")
        .filter(|p| !p.is_empty())
        .map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_pepsi-ingress")),
            PathBuf::from,
        )
}

struct Daemon {
    child: Child,
    port: u16,
    log: PathBuf,
}

/// A port of 127.0.0.1 free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

impl Daemon {
    /// Starts `pepsi-ingress serve` on `db`, LMTP on a free port, queueing at stage
    /// `in` as [`INJECT_LOGIN`] (a member of `pepsi_inject`, as with doc/roles-and-containment.md's
    /// separate roles: every message is held to the injecting role's checks); returns
    /// once it accepts connections.
    fn start(db: &TestDb, dir: &Path, run: &str) -> Daemon {
        // What the dispatcher writes at its start: `in` is the entry stage.
        db.client()
            .execute("SELECT pepsi.set_inject_stages(ARRAY['in'])", &[])
            .expect("write the entry stages");
        let port = free_port();
        let conf = dir.join(format!("ingress-{run}.conf"));
        std::fs::write(
            &conf,
            format!(
                "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\
                 INJECT_CONNECTION = {}\n\n\
                 [pepsi-ingress]\nLISTEN = lmtp:127.0.0.1:{port}\nSTAGE = in\n\n\
                 [stage-in]\nPROGRAM = {}\n",
                db.conninfo,
                db.conninfo_as(&pg::login_role(INJECT_LOGIN, &["pepsi_inject"])),
                env!("CARGO_BIN_EXE_pepsi-stage")
            ),
        )
        .unwrap();
        let log = dir.join(format!("ingress-{run}.log"));
        let child = Command::new(ingress_binary())
            .arg("-c")
            .arg(&conf)
            .args(["-L", "warn", "serve"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start pepsi-ingress");
        let mut daemon = Daemon { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!(
                    "pepsi-ingress exited at start ({status}):\n{}",
                    std::fs::read_to_string(&daemon.log).unwrap_or_default()
                );
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return daemon;
            }
            assert!(
                Instant::now() < deadline,
                "pepsi-ingress does not listen on 127.0.0.1:{port} after 20 s:\n{}",
                std::fs::read_to_string(&daemon.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, and waits for the exit (the counters are written on the way out).
    fn stop(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        if !log.trim().is_empty() {
            eprintln!("pepsi-ingress logged:\n{log}");
        }
    }
}

// ---------------------------------------------------------------------------------
// The LMTP client.

/// A tiny xorshift generator: message bodies that do not compress (like the base64 of
/// an attachment), different for each client.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A message of exactly [`MESSAGE_SIZE`] bytes, dot-stuffing free, with its final
/// ".": the header block names client `c`'s message `i`; the body is `body`, cut.
fn message(c: usize, i: u64, body: &[u8]) -> Vec<u8> {
    let mut m = format!(
        "From: Bench Sender <sender{c}@bench.example>\r\n\
         To: <r1@dest.example>, <r2@dest.example>, <r3@dest.example>\r\n\
         Subject: ingress benchmark message {c}.{i}\r\n\
         Date: Thu, 03 Dec 2026 12:00:00 +0000\r\n\
         Message-ID: <{c}.{i}@bench.example>\r\n\
         MIME-Version: 1.0\r\n\
         Content-Type: text/plain; charset=us-ascii\r\n\r\n"
    )
    .into_bytes();
    let rest = MESSAGE_SIZE - m.len();
    m.extend_from_slice(&body[..rest - 2]);
    if m.last() == Some(&b'\r') {
        // Cut between a line's CR and LF: no bare CR.
        *m.last_mut().unwrap() = b'A';
    }
    m.extend_from_slice(b"\r\n.\r\n");
    m
}

/// A body of [`MESSAGE_SIZE`] bytes of base64 lines of 76 characters.
fn body(seed: u64) -> Vec<u8> {
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut noise = Noise(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut out = Vec::with_capacity(MESSAGE_SIZE + 80);
    while out.len() < MESSAGE_SIZE {
        for _ in 0..76 {
            out.push(B64[(noise.next() % 64) as usize]);
        }
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One LMTP connection.
struct Lmtp {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl Lmtp {
    /// Connects, reads the greeting and says LHLO.
    fn connect(port: u16) -> Lmtp {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to pepsi-ingress");
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut c = Lmtp {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
            line: String::new(),
        };
        let greeting = c.reply();
        assert_eq!(greeting, 220, "greeting: {}", c.line);
        c.writer.write_all(b"LHLO bench.example\r\n").unwrap();
        let lhlo = c.reply();
        assert_eq!(lhlo, 250, "LHLO: {}", c.line);
        c
    }

    /// Reads one reply (all its lines); returns its code. The last line stays in
    /// `self.line`.
    fn reply(&mut self) -> u16 {
        loop {
            self.line.clear();
            let n = self
                .reader
                .read_line(&mut self.line)
                .expect("read a reply of pepsi-ingress");
            assert!(n > 0, "pepsi-ingress closed the connection");
            let code = self.line.get(..3).and_then(|c| c.parse().ok()).unwrap_or(0);
            if self.line.as_bytes().get(3) != Some(&b'-') {
                return code;
            }
        }
    }

    /// Sends one message: the pipelined envelope, its five replies, the data and the
    /// three replies after it. Returns whether all were positive, and the time from the
    /// write of the final "." to the last reply.
    fn send(&mut self, envelope: &[u8], data: &[u8]) -> (bool, Duration) {
        self.writer.write_all(envelope).unwrap();
        // MAIL and each RCPT, then DATA: one reply each, whatever they say.
        let mut ok = true;
        for _ in 0..=RECIPIENTS {
            if self.reply() != 250 {
                ok = false;
            }
        }
        if self.reply() != 354 {
            // DATA refused: the transaction is over, with no data to send.
            return (false, Duration::ZERO);
        }
        self.writer.write_all(data).unwrap();
        let written = Instant::now();
        for _ in 0..RECIPIENTS {
            if !(200..300).contains(&self.reply()) {
                ok = false;
            }
        }
        (ok, written.elapsed())
    }

    fn quit(mut self) {
        let _ = self.writer.write_all(b"QUIT\r\n");
        let _ = self.reply();
    }
}

/// One client thread: connects, warms up, waits for the start, then sends messages
/// while the shared count lasts. Returns the latencies (ms) of its accepted messages
/// and how many were not accepted.
fn client(
    c: usize,
    port: u16,
    warmup: u64,
    total: u64,
    tickets: &AtomicU64,
    ready: &Barrier,
    go: &Barrier,
) -> (Vec<f64>, u64) {
    let mut lmtp = Lmtp::connect(port);
    let body = body(c as u64 + 1);
    let envelope = format!(
        "MAIL FROM:<sender{c}@bench.example> SIZE={MESSAGE_SIZE}\r\n\
         RCPT TO:<r1@dest.example>\r\nRCPT TO:<r2@dest.example>\r\nRCPT TO:<r3@dest.example>\r\n\
         DATA\r\n"
    )
    .into_bytes();
    for i in 0..warmup {
        lmtp.send(&envelope, &message(c, i, &body));
    }
    ready.wait();
    go.wait();
    let mut latencies = Vec::with_capacity((total as usize).div_ceil(16) * 2);
    let mut failed = 0;
    let mut i = warmup;
    while tickets.fetch_add(1, Ordering::Relaxed) < total {
        let data = message(c, i, &body);
        i += 1;
        let (ok, took) = lmtp.send(&envelope, &data);
        if ok {
            latencies.push(took.as_secs_f64() * 1000.0);
        } else {
            failed += 1;
        }
    }
    lmtp.quit();
    (latencies, failed)
}

// ---------------------------------------------------------------------------------
// The memory run.

/// The largest message the daemon accepts: its default `MAX_MESSAGE_SIZE`.
const LARGE_SIZE: usize = 10_240_000;

/// The peak resident memory of a process, in KiB (`VmHWM`).
fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// `clients` connections each send one message of [`LARGE_SIZE`] bytes at once;
/// prints the daemon's peak memory before and after.
fn large_run(dir: &Path, clients: usize, out: &mut impl Write) {
    let db = TestDb::new();
    let daemon = Daemon::start(&db, dir, "large");
    let before = peak_kib(daemon.pid());
    let go = Arc::new(Barrier::new(clients));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (go, port) = (go.clone(), daemon.port);
            std::thread::spawn(move || {
                let mut lmtp = Lmtp::connect(port);
                let noise = body(c as u64 + 1);
                let mut data = message(c, 0, &noise);
                data.truncate(data.len() - 3);
                while data.len() + noise.len() + 3 < LARGE_SIZE {
                    data.extend_from_slice(&noise[..noise.len() - noise.len() % 78]);
                }
                data.extend_from_slice(b".\r\n");
                let envelope = format!(
                    "MAIL FROM:<sender{c}@bench.example> SIZE={}\r\n\
                     RCPT TO:<r1@dest.example>\r\nRCPT TO:<r2@dest.example>\r\nRCPT TO:<r3@dest.example>\r\n\
                     DATA\r\n",
                    data.len() - 3
                );
                go.wait();
                let (ok, _) = lmtp.send(envelope.as_bytes(), &data);
                lmtp.quit();
                (ok, data.len() - 3)
            })
        })
        .collect();
    let mut accepted = 0;
    let mut size = 0;
    for t in threads {
        let (ok, bytes) = t.join().expect("a client thread failed");
        accepted += usize::from(ok);
        size = bytes;
    }
    let after = peak_kib(daemon.pid());
    daemon.stop();
    writeln!(
        out,
        "\nmemory: {clients} clients each sent one {size}-byte message at once, {accepted} accepted\n  \
         peak resident memory of pepsi-ingress: {:.1} MiB before, {:.1} MiB after: \
         {:.1} MiB per message ({:.2}x its size)",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        (after - before) as f64 / 1024.0 / clients as f64,
        (after - before) as f64 * 1024.0 / clients as f64 / size as f64
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------
// A run.

struct Figures {
    clients: usize,
    sent: u64,
    seconds: f64,
    latencies: Vec<f64>,
    failed: u64,
    /// (calls, rows, mean ms) of the committer's statement, when counted.
    statement: Option<(i64, i64, f64)>,
    /// The statements inside it that took the most time: (calls, total ms, planning
    /// ms, text).
    nested: Vec<(i64, f64, f64, String)>,
    server: ServerCounts,
    /// WAL written during the run.
    wal_bytes: f64,
    cpu: Cpu,
    /// `pepsi.ingress_stats` after the SIGTERM: accepted, commits, deferred, refused.
    stats: (i64, i64, i64, i64),
}

fn run(dir: &Path, clients: usize, total: u64) -> Figures {
    let db = TestDb::new();
    let daemon = Daemon::start(&db, dir, &format!("{clients}"));
    let mut c = db.client();
    // The run starts at a checkpoint: its first change to every page writes the whole
    // page to the WAL, as it does after each checkpoint of a production server.
    c.batch_execute("/* bench */ CHECKPOINT").unwrap();
    let tickets = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(Barrier::new(clients + 1));
    let go = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let (tickets, ready, go) = (tickets.clone(), ready.clone(), go.clone());
            let port = daemon.port;
            std::thread::spawn(move || {
                client(i, port, WARMUP_PER_CLIENT, total, &tickets, &ready, &go)
            })
        })
        .collect();
    ready.wait();
    // The warm-up's statistics reach the views, then the counts start.
    std::thread::sleep(STATS_SETTLE);
    let backend: i32 = c
        .query_one(
            "/* bench */ SELECT coalesce(max(pid), 0) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'pepsi-ingress'",
            &[],
        )
        .unwrap()
        .get(0);
    let own: i32 = c
        .query_one("/* bench */ SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let postmaster = parent_of(own as u32);
    let counting = counts_statements(&mut c);
    let server0 = ServerCounts::read(&mut c);
    let wal0 = wal_position(&mut c);
    let cpu0 = Cpu::read(daemon.pid(), backend as u32, postmaster);
    go.wait();
    let t0 = Instant::now();
    let mut latencies = Vec::new();
    let mut failed = 0;
    for t in threads {
        let (l, f) = t.join().expect("a client thread failed");
        latencies.extend(l);
        failed += f;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu = Cpu::read(daemon.pid(), backend as u32, postmaster).since(cpu0);
    let wal_bytes = wal_position(&mut c) - wal0;
    let (statement, nested) = if counting {
        (inject_statement(&mut c), nested_statements(&mut c))
    } else {
        (None, Vec::new())
    };
    // Its session ends, and reports its statistics as it does.
    daemon.stop();
    std::thread::sleep(Duration::from_millis(500));
    let server = ServerCounts::read(&mut c).since(server0);
    let stats = c
        .query_one(
            "/* bench */ SELECT accepted, commits, deferred, refused FROM pepsi.ingress_stats",
            &[],
        )
        .unwrap();
    latencies.sort_by(f64::total_cmp);
    Figures {
        clients,
        sent: total,
        seconds,
        latencies,
        failed,
        statement,
        nested,
        server,
        wal_bytes,
        cpu,
        stats: (stats.get(0), stats.get(1), stats.get(2), stats.get(3)),
    }
}

/// The value at quantile `q` of sorted values (0 when there are none).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn mark(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

impl Figures {
    fn print(&self, out: &mut impl Write) {
        let accepted = self.latencies.len() as f64;
        let rate = accepted / self.seconds;
        let (p50, p99, max) = (
            quantile(&self.latencies, 0.5),
            quantile(&self.latencies, 0.99),
            self.latencies.last().copied().unwrap_or(0.0),
        );
        let many = self.clients > 1;
        let target = |s: String| if many { s } else { String::new() };
        writeln!(
            out,
            "{:2} client{}: {} messages in {:.2} s: {rate:.0} accepted messages/s{}{}",
            self.clients,
            if many { "s" } else { " " },
            self.sent,
            self.seconds,
            target(format!(
                " (target >= {TARGET_RATE:.0}: {})",
                mark(rate >= TARGET_RATE)
            )),
            if self.failed > 0 {
                format!("; {} NOT accepted", self.failed)
            } else {
                String::new()
            }
        )
        .unwrap();
        writeln!(
            out,
            "    end of data -> last reply: p50 {p50:.2} ms, p99 {p99:.2} ms{}, max {max:.2} ms",
            target(format!(
                " (target <= {TARGET_P99_MS:.0} ms: {})",
                mark(p99 <= TARGET_P99_MS)
            )),
        )
        .unwrap();
        let (commits, rows, source) = match self.statement {
            Some((calls, rows, _)) => (
                calls,
                rows,
                "calls and rows of the committer's statement in pg_stat_statements",
            ),
            None => (
                self.server.xact_commit,
                accepted as i64,
                "pg_stat_database xact_commit of the database during the run, with a few of the benchmark's own",
            ),
        };
        let per_commit = rows as f64 / commits.max(1) as f64;
        writeln!(
            out,
            "    commits: {commits} = {:.0}/s, {per_commit:.1} messages per commit{} [{source}]",
            commits as f64 / self.seconds,
            target(format!(
                " (target >= {TARGET_PER_COMMIT:.0}: {})",
                mark(per_commit >= TARGET_PER_COMMIT)
            )),
        )
        .unwrap();
        let cycle_ms = self.seconds * 1000.0 / commits.max(1) as f64;
        if let Some((_, _, mean_ms)) = self.statement {
            writeln!(
                out,
                "    per commit: {cycle_ms:.2} ms of wall time; the statement executes in {mean_ms:.2} ms ({:.0}%), {:.3} ms per message",
                mean_ms / cycle_ms * 100.0,
                mean_ms / per_commit.max(1e-9),
            )
            .unwrap();
        }
        for (calls, ms, plan_ms, text) in &self.nested {
            let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
            let short: String = text.chars().take(72).collect();
            writeln!(
                out,
                "      inside: {:5.3} ms per message ({plan_ms:.0} ms planning in all), {:4.1} calls per message: {short}",
                ms / accepted.max(1.0),
                *calls as f64 / accepted.max(1.0),
            )
            .unwrap();
        }
        let s = &self.server;
        writeln!(
            out,
            "    WAL: {} flushes ({:.0}/s, {:.1} per commit, mean {:.2} ms, {:.0}% of the run), {} writes, {:.1} MB ({:.1} KB per message), {} full-page images; about {} transactions (the daemon's counter writes and the benchmark's own few included)",
            s.wal_sync,
            s.wal_sync as f64 / self.seconds,
            s.wal_sync as f64 / commits.max(1) as f64,
            s.wal_sync_ms / s.wal_sync.max(1) as f64,
            s.wal_sync_ms / 10.0 / self.seconds,
            s.wal_write,
            self.wal_bytes / 1e6,
            self.wal_bytes / 1024.0 / accepted.max(1.0),
            s.wal_fpi,
            s.xact_commit,
        )
        .unwrap();
        let c = &self.cpu;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let pct = |v: f64| v / self.seconds * 100.0;
        writeln!(
            out,
            "    CPU seconds: ingress {:.2} ({:.0}% of a core; committer thread {:.2}), its database session {:.2} ({:.0}%), all of PostgreSQL {:.2} ({:.0}%), client threads {:.2} ({:.0}%)",
            c.ingress,
            pct(c.ingress),
            c.committer,
            c.backend,
            pct(c.backend),
            c.postgres,
            pct(c.postgres),
            c.clients,
            pct(c.clients),
        )
        .unwrap();
        writeln!(
            out,
            "    machine: {:.2} of {:.2} CPU seconds busy ({:.0}%; {:.2} not ingress, PostgreSQL or clients), iowait {:.2} s, stolen by the host {:.2} s",
            c.machine.busy,
            cores * self.seconds,
            c.machine.busy / (cores * self.seconds) * 100.0,
            c.machine.busy - c.ingress - c.postgres - c.clients,
            c.machine.iowait,
            c.machine.steal,
        )
        .unwrap();
        let (accepted_all, commits_all, deferred, refused) = self.stats;
        writeln!(
            out,
            "    pepsi.ingress_stats after SIGTERM (the daemon's life, warm-up included): {accepted_all} accepted in {commits_all} commits = {:.1} per commit, {deferred} deferred, {refused} refused",
            accepted_all as f64 / commits_all.max(1) as f64,
        )
        .unwrap();
    }
}

fn main() {
    // `cargo bench` passes --bench; a plain `cargo test --benches` run lists nothing.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let total = env_number("BENCH_MESSAGES", 20_000);
    let single = env_number("BENCH_SINGLE_MESSAGES", 1_000);
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(
        out,
        "pepsi ingress benchmark: LMTP over TCP to 127.0.0.1, {MESSAGE_SIZE}-byte messages with {RECIPIENTS} recipients, \
         MAIL/RCPT/DATA pipelined, {WARMUP_PER_CLIENT} warm-up messages per client; {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
    .unwrap();
    writeln!(
        out,
        "daemon: {}, injecting as {INJECT_LOGIN} (a member of pepsi_inject)",
        ingress_binary().display()
    )
    .unwrap();
    let server = durable_server(&[
        "fsync",
        "full_page_writes",
        "wal_sync_method",
        "synchronous_commit",
        "commit_delay",
        "wal_level",
    ]);
    writeln!(
        out,
        "{server} (synchronous_commit=on for the ingress's session: sql::INGRESS_SESSION_OPTION)"
    )
    .unwrap();
    out.flush().unwrap();
    let dir = std::env::temp_dir().join(format!("pepsi-bench-ingress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for clients in client_counts() {
        run(&dir, clients, total).print(&mut out);
        out.flush().unwrap();
    }
    run(&dir, 1, single).print(&mut out);
    out.flush().unwrap();
    large_run(&dir, env_number("BENCH_LARGE", 10) as usize, &mut out);
    let _ = std::fs::remove_dir_all(&dir);
}
