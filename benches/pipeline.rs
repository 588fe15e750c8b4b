//! The pipeline benchmark: `cargo bench --bench pipeline` (release build). Prints, all
//! measured in one run against one PostgreSQL server (a throwaway cluster, or
//! `DATABASE_URL`):
//!
//! (a) the raw hop rate: N client threads each running the SELECT by id + advancing
//!     UPDATE loop of a stage worker, `synchronous_commit = off`;
//! (a2) the batched raw hop rate: N clients each advancing 16 rows per SELECT `= ANY`
//!     and one UPDATE `FROM unnest`, `synchronous_commit = off`;
//! (b) the dispatcher's hop rate through a 5-stage pipeline (four `pass`, one
//!     `discard`) with fusion off, at QUEUE_LIMIT 4 and 16, and the ratios (b)/(a) and (b)/(a2);
//! (c) messages/s end to end, fusion off and on;
//! (d) the dispatcher's CPU seconds per 1,000 hops (from /proc);
//! (e) median and p99 latency from inject to the row's deletion for a trickle of
//!     single messages;
//! (f) the fair claim's time (`sql::CLAIM_FAIR`, rolled back) at one sender's backlog
//!     depths 1k, 10k, 100k and 1M, plus 50 small senders; (f2) the same plus 1,000
//!     tenants of 10 senders each instead of the 50;
//! (g) a 10-message sender's p50/p99 wait (inject to deletion) behind a 10,000-message
//!     flood of another sender, against its wait on an empty queue;
//! (h) the 5-stage hop rate with fair scheduling on against off.
//!
//! Each (b) burst also prints its claims and rows per claim (`pepsi.dispatch_stats`),
//! the top-level statements and transactions per hop of every session but the
//! benchmark's own (`pg_stat_statements`, `pg_stat_database`), those statements per
//! role they ran as, the most frequent statements, and per stage the sizes of the
//! batches its workers processed (from the line each worker logs as its input ends).
//!
//! `BENCH_MESSAGES` (default 5000) sets the burst size, `BENCH_QUEUE_LIMITS` (default
//! `4,16`) the QUEUE_LIMITs of (b); `BENCH_QUICK` set stops after
//! (a), (a2), (b) and (e), `BENCH_QUICK=c` after (c); `BENCH_QUICK=f` runs (f) alone.
//! Figures, never assertions.
//!
//! `BENCH_ROLES=split` runs every pipeline the dispatcher serves ((b), (c), (e), (g),
//! (h)) with the dispatcher connecting as the login role `pepsi_bench_dispatch`, a
//! member of `pepsi_dispatch` (`DISPATCH_CONNECTION`), and its workers as
//! `pepsi_bench_worker`, a member of `pepsi_worker` (`WORKER_CONNECTION`), so that the
//! queue's row-level security applies to the claim and to every worker write; both
//! roles are created at start unless they exist. Unset (or `one`), they connect as the
//! benchmark's own role, a superuser, which row-level security does not apply to. The
//! raw loops (a) and (a2), the fair claim (f), the injections and every measuring
//! statement always run as the benchmark's own role. The header says which mode ran.
//! `BENCH_LAST_STAGE_SYNC=on` (or another level) sets the last stage's
//! `SYNCHRONOUS_COMMIT`, so that what it costs can be measured (the stage that
//! finishes a message, where a delivery stage would be); `BENCH_DURABLE=1` turns the
//! throwaway cluster's `fsync` and `full_page_writes` on first, as a production server
//! has them, without which a commit that waits for its flush waits for nothing.
//! With `BENCH_RLS=off` as well, the queue's row-level security is disabled in each
//! database of the run, so that one session can measure what it costs.

#[allow(dead_code)]
#[path = "../tests/util/pg.rs"]
mod pg;
// The benchmark uses part of it.
#[path = "util/durable.rs"]
mod durable;
#[allow(dead_code)]
#[path = "util/proc.rs"]
mod proc;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use durable::durable_server;
use pg::TestDb;
use postgres::{Client, NoTls};
use proc::{cpu_of_families, cpu_seconds, parent_of};

/// The QUEUE_LIMITs of the (b) bursts: `BENCH_QUEUE_LIMITS` (comma-separated), default
/// 4 and 16.
fn queue_limits() -> Vec<u32> {
    std::env::var("BENCH_QUEUE_LIMITS")
        .ok()
        .map(|v| v.split(',').filter_map(|q| q.trim().parse().ok()).collect())
        .filter(|v: &Vec<u32>| !v.is_empty())
        .unwrap_or_else(|| vec![4, 16])
}

/// The login roles of `BENCH_ROLES=split`: members of `pepsi_dispatch` and
/// `pepsi_worker`, with the test harness's password.
const DISPATCH_LOGIN: &str = "pepsi_bench_dispatch";
const WORKER_LOGIN: &str = "pepsi_bench_worker";

/// Which roles the dispatcher and its workers connect as (`BENCH_ROLES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Roles {
    /// Both as the benchmark's own role (`CONNECTION`), a superuser: row-level security
    /// does not apply.
    One,
    /// The dispatcher as [`DISPATCH_LOGIN`] (`DISPATCH_CONNECTION`), the workers as
    /// [`WORKER_LOGIN`] (`WORKER_CONNECTION`).
    Split,
}

impl Roles {
    /// `BENCH_ROLES`: `split`, else (unset, empty or `one`) one role.
    fn from_env() -> Roles {
        match std::env::var("BENCH_ROLES").as_deref() {
            Err(_) | Ok("") | Ok("one") => Roles::One,
            Ok("split") => Roles::Split,
            Ok(other) => panic!("BENCH_ROLES={other:?}: `split`, or `one` (the default)"),
        }
    }

    /// For the header of the run.
    fn describe(self) -> &'static str {
        match self {
            Roles::One => "one (superuser)",
            Roles::Split => "split (pepsi_dispatch / pepsi_worker login roles)",
        }
    }
}

/// Creates the login roles of `BENCH_ROLES=split` unless they exist, and makes them
/// members of their group roles (again: an existing role may have lost it). Roles are
/// cluster-wide; the group roles exist once the template database holds the schema
/// (its `pepsi.setup_roles()` creates them when the benchmark's role may).
fn create_login_roles() {
    let mut admin = pg::admin();
    for (login, group) in [
        (DISPATCH_LOGIN, "pepsi_dispatch"),
        (WORKER_LOGIN, "pepsi_worker"),
    ] {
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN
                     IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = '{login}') THEN
                         CREATE ROLE {login} LOGIN PASSWORD '{password}';
                     END IF;
                 EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                 END $$;
                 GRANT {group} TO {login};",
                password = pg::LOGIN_PASSWORD
            ))
            .unwrap_or_else(|e| {
                panic!(
                    "cannot create the login role {login} in {group}: {}",
                    pepsi::db::describe(&e)
                )
            });
    }
}

/// Whether the group roles hold their grants and their row-level security policies
/// in the connected database.
const GROUP_GRANTS_READY: &str = "/* bench */ SELECT \
     (SELECT count(*) FROM pg_catalog.pg_policies \
       WHERE schemaname = 'pepsi' AND tablename = 'workqueue' \
         AND policyname IN ('workqueue_dispatch', 'workqueue_worker_write')) = 2 \
     AND pg_catalog.has_table_privilege('pepsi_dispatch', 'pepsi.dispatch_stats', 'UPDATE') \
     AND pg_catalog.has_table_privilege('pepsi_worker', 'pepsi.workqueue', 'DELETE')";

/// Makes sure `pepsi_dispatch` and `pepsi_worker` hold their grants in `db`: the
/// schema's installation granted them if the roles existed then; otherwise
/// `pepsi.setup_roles()` runs again now.
fn ensure_group_grants(db: &TestDb) {
    let mut c = db.client();
    if rls_off() {
        c.batch_execute("/* bench */ ALTER TABLE pepsi.workqueue DISABLE ROW LEVEL SECURITY")
            .unwrap();
    }
    let ready = |c: &mut Client| -> bool { c.query_one(GROUP_GRANTS_READY, &[]).unwrap().get(0) };
    if !ready(&mut c) {
        c.batch_execute("/* bench */ SELECT * FROM pepsi.setup_roles()")
            .unwrap_or_else(|e| panic!("pepsi.setup_roles(): {}", pepsi::db::describe(&e)));
        assert!(
            ready(&mut c),
            "pepsi_dispatch and pepsi_worker still lack their grants after pepsi.setup_roles()"
        );
    }
}

/// `BENCH_RLS=off`: the queue's row-level security disabled (with `BENCH_ROLES=split`,
/// the one mode it applies to).
fn rls_off() -> bool {
    std::env::var("BENCH_RLS").as_deref() == Ok("off")
}

/// `BENCH_DURABLE=1`: the throwaway cluster made durable before anything is measured.
fn durable() -> bool {
    std::env::var("BENCH_DURABLE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `BENCH_LAST_STAGE_SYNC`: the last stage's `SYNCHRONOUS_COMMIT` (a level), or none.
fn last_stage_sync() -> Option<String> {
    std::env::var("BENCH_LAST_STAGE_SYNC")
        .ok()
        .filter(|v| !v.is_empty())
}

fn messages() -> i64 {
    std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

/// Runs `threads` clients of a fresh database, each on its own `per_thread` rows
/// (`running` at stage `s0`) with `synchronous_commit = off`: `client` prepares, waits
/// at the barrier, then works. Returns the seconds from the barrier until all are done.
fn raw_clients<F>(threads: usize, per_thread: usize, client: F) -> f64
where
    F: Fn(&mut Client, Vec<i64>, &std::sync::Barrier) + Clone + Send + 'static,
{
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, status, mail_from, rcpt_to) \
         SELECT 's0', 'running', 'a@x.example', ARRAY['r@y.example'] FROM generate_series(1, $1::int4)",
        &[&((threads * per_thread) as i32)],
    )
    .unwrap();
    let ids: Vec<i64> = c
        .query("SELECT workqueue_id FROM pepsi.workqueue ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads + 1));
    let mut handles = Vec::new();
    for mine in ids.chunks(per_thread).map(<[i64]>::to_vec) {
        let mut config = client_config(&db);
        pepsi::db::append_options(&mut config, pepsi::db::sql::ASYNC_COMMIT_OPTION);
        let barrier = barrier.clone();
        let client = client.clone();
        handles.push(std::thread::spawn(move || {
            let mut c = config.connect(NoTls).unwrap();
            client(&mut c, mine, &barrier);
        }));
    }
    barrier.wait();
    let t0 = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    t0.elapsed().as_secs_f64()
}

/// (a): `threads` clients, each advancing its own rows through `hops` SELECT+UPDATE
/// pairs. Returns hops/s.
fn raw_hop_rate(threads: usize, hops_per_thread: usize) -> f64 {
    let seconds = raw_clients(threads, 16, move |c, mine, barrier| {
        let select = c
            .prepare(
                "SELECT workqueue_id, stage, status, mail_from, rcpt_to, header_from, subject, state, sender_key \
                 FROM pepsi.workqueue WHERE workqueue_id = $1",
            )
            .unwrap();
        let update = c
            .prepare(
                "UPDATE pepsi.workqueue SET stage = $2, status = 'running' \
                 WHERE workqueue_id = $1 AND status = 'running' AND stage = $3",
            )
            .unwrap();
        let mut stage_of: Vec<u64> = vec![0; mine.len()];
        barrier.wait();
        for h in 0..hops_per_thread {
            let i = h % mine.len();
            let row = c.query_one(&select, &[&mine[i]]).unwrap();
            let stage: String = row.get(1);
            stage_of[i] += 1;
            let next = format!("s{}", stage_of[i]);
            c.execute(&update, &[&mine[i], &next, &stage]).unwrap();
        }
    });
    (threads * hops_per_thread) as f64 / seconds
}

/// (a2): `threads` clients, each advancing its own 16 rows together: one SELECT of all
/// 16 by `= ANY` and one UPDATE of all 16 from `unnest`, per round. Returns hops/s.
fn raw_batched_hop_rate(threads: usize, rounds_per_thread: usize) -> f64 {
    const ROWS: usize = 16;
    let seconds = raw_clients(threads, ROWS, move |c, mine, barrier| {
        let select = c
            .prepare(
                "SELECT workqueue_id, stage, status, mail_from, rcpt_to, header_from, subject, state, sender_key \
                 FROM pepsi.workqueue WHERE workqueue_id = ANY($1)",
            )
            .unwrap();
        let update = c
            .prepare(
                "UPDATE pepsi.workqueue q SET stage = u.next, status = 'running' \
                 FROM unnest($1::int8[], $2::text[], $3::text[]) AS u(id, next, prev) \
                 WHERE q.workqueue_id = u.id AND q.status = 'running' AND q.stage = u.prev",
            )
            .unwrap();
        barrier.wait();
        for _ in 0..rounds_per_thread {
            let rows = c.query(&select, &[&mine]).unwrap();
            let mut id = Vec::with_capacity(ROWS);
            let mut next = Vec::with_capacity(ROWS);
            let mut prev = Vec::with_capacity(ROWS);
            for row in rows {
                let stage: String = row.get(1);
                let n: u64 = stage[1..].parse().unwrap();
                id.push(row.get::<_, i64>(0));
                next.push(format!("s{}", n + 1));
                prev.push(stage);
            }
            let n = c.execute(&update, &[&id, &next, &prev]).unwrap();
            assert_eq!(n as usize, ROWS);
        }
    });
    (threads * rounds_per_thread * ROWS) as f64 / seconds
}

/// The test database's connection, parsed: `DATABASE_URL` may be a URL as well as a
/// conninfo, so options are appended to the parsed form, never to the text.
fn client_config(db: &TestDb) -> postgres::Config {
    db.conninfo
        .parse()
        .unwrap_or_else(|e| panic!("the test database's connection {:?}: {e}", db.conninfo))
}

struct Setup {
    dir: PathBuf,
    bin: PathBuf,
    /// Which roles the dispatcher and its workers connect as.
    roles: Roles,
}

impl Setup {
    fn new(roles: Roles) -> Setup {
        let dir = std::env::temp_dir().join(format!("pepsi-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for s in ["pass", "discard"] {
            std::os::unix::fs::symlink(
                env!("CARGO_BIN_EXE_pepsi-stage"),
                bin.join(format!("pepsi-stage-{s}")),
            )
            .unwrap();
        }
        Setup { dir, bin, roles }
    }

    fn config(&self, db: &TestDb, fusion: bool, queue_limit: u32) -> PathBuf {
        self.config_with(db, fusion, queue_limit, true)
    }

    /// The pipeline's `pepsi.conf` for `db`. With [`Roles::Split`], the dispatcher and
    /// the workers connect through `DISPATCH_CONNECTION` and `WORKER_CONNECTION` as the
    /// login roles, whose group roles are first made sure to hold their grants in `db`.
    fn config_with(&self, db: &TestDb, fusion: bool, queue_limit: u32, fair: bool) -> PathBuf {
        let roles = match self.roles {
            Roles::One => String::new(),
            Roles::Split => {
                ensure_group_grants(db);
                format!(
                    "DISPATCH_CONNECTION = {}\nWORKER_CONNECTION = {}\n",
                    db.conninfo_as(DISPATCH_LOGIN),
                    db.conninfo_as(WORKER_LOGIN)
                )
            }
        };
        let mut text = format!(
            "[pepsi]\nRUN_AS = root\nALLOW_FUSION = {}\n\n[pepsi-postgres]\nCONNECTION = {}\n{roles}\n\
             [pepsi-dispatch]\nSTATS_INTERVAL = 60s\nFAIR_SCHEDULING = {}\n\
             WORKER_IDLE_TIMEOUT = {}s\n\n",
            if fusion { "yes" } else { "no" },
            db.conninfo,
            if fair { "yes" } else { "no" },
            IDLE_TIMEOUT.as_secs()
        );
        for i in 1..=4 {
            text.push_str(&format!(
                "[stage-p{i}]\nPROGRAM = {}\nNEXT = p{}\nQUEUE_LIMIT = {queue_limit}\n\n",
                self.bin.join("pepsi-stage-pass").display(),
                i + 1
            ));
        }
        text.push_str(&format!(
            "[stage-p5]\nPROGRAM = {}\nQUEUE_LIMIT = {queue_limit}\n",
            self.bin.join("pepsi-stage-discard").display()
        ));
        if let Some(level) = last_stage_sync() {
            text.push_str(&format!("SYNCHRONOUS_COMMIT = {level}\n"));
        }
        let path = self
            .dir
            .join(format!("bench-{fusion}-{queue_limit}-{fair}.conf"));
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_dispatcher(conf: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_pepsi-dispatch"))
        .arg("-c")
        .arg(conf)
        .arg("-L")
        .arg("warn")
        .arg("serve")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start pepsi-dispatch")
}

fn stop(mut child: Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

/// How often a burst's end is looked for. `count(*)` scans the whole table, dead rows
/// included, which a burst leaves plenty of: polled every 5 ms it took a good part of a
/// core from the server it measures.
const DRAIN_POLL: Duration = Duration::from_millis(20);

fn queue_len(c: &mut Client) -> i64 {
    c.query_one("/* bench */ SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0)
}

/// Waits until the dispatcher has claimed once (its workers are not started yet).
fn settle(c: &mut Client) {
    // The dispatcher's first claim happens right after its lock; give it a moment.
    std::thread::sleep(Duration::from_millis(500));
    let _ = queue_len(c);
}

/// The benchmark's `WORKER_IDLE_TIMEOUT`: after a burst, workers go cold this soon and
/// log their batch sizes as their input ends.
const IDLE_TIMEOUT: Duration = Duration::from_secs(1);

struct Burst {
    seconds: f64,
    cpu: f64,
    profile: Profile,
}

/// What a burst cost the database, and how full its claims and batches ran.
#[derive(Default)]
struct Profile {
    /// `pepsi.dispatch_stats`: claim statements and the rows they took.
    claims: i64,
    rows_claimed: i64,
    /// Top-level statements of every session but the benchmark's own
    /// (`pg_stat_statements`; `None` on a server that does not load it), and the most
    /// frequent of them: (calls, rows, ms per call, planning ms per call, plans, text).
    statements: Option<i64>,
    top: Vec<(i64, i64, f64, f64, i64, String)>,
    /// Those statements' calls per role they ran as (`BENCH_ROLES` shows here).
    by_role: Vec<(String, i64)>,
    /// CPU seconds during the burst of PostgreSQL's processes and of the stage workers
    /// (processes alive at its end; workers start during the burst).
    cpu_postgres: f64,
    cpu_workers: f64,
    cpu_dispatcher: f64,
    /// Transactions of every session but the benchmark's own (`pg_stat_database`).
    transactions: i64,
    /// Per stage, the batch sizes its workers logged: messages, batches, and the
    /// counts of the classes 1, 2-3, 4-7, 8-15, 16-31, 32+.
    batches: std::collections::BTreeMap<String, (u64, u64, [u64; 6])>,
}

/// Committed plus rolled back transactions of the database so far, as the statistics
/// collector has them.
fn transactions(c: &mut Client) -> i64 {
    c.batch_execute("/* bench */ SELECT pg_stat_clear_snapshot()")
        .unwrap();
    c.query_one(
        "/* bench */ SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Reads back the per-stage batch sizes workers log as their input ends
/// (`p1: input ended after 120 messages in 9 batches (sizes 1: 1, 2-3: 0, …)`).
fn batch_sizes(log: &str) -> std::collections::BTreeMap<String, (u64, u64, [u64; 6])> {
    let mut out: std::collections::BTreeMap<String, (u64, u64, [u64; 6])> = Default::default();
    for line in log.lines() {
        let Some((head, tail)) = line.split_once(": input ended after ") else {
            continue;
        };
        let Some((totals, sizes)) = tail.split_once(" (sizes ") else {
            continue;
        };
        let totals: Vec<u64> = totals
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let classes: Vec<u64> = sizes
            .trim_end_matches(')')
            .split(", ")
            .filter_map(|c| c.split_once(": ")?.1.parse().ok())
            .collect();
        if totals.len() != 2 || classes.len() != 6 {
            continue;
        }
        let stage = head.rsplit(' ').next().unwrap_or(head).to_string();
        let e = out.entry(stage).or_default();
        e.0 += totals[0];
        e.1 += totals[1];
        for (sum, n) in e.2.iter_mut().zip(classes) {
            *sum += n;
        }
    }
    out
}

impl Profile {
    fn print(&self, out: &mut impl Write, hops: i64) {
        writeln!(
            out,
            "    claims {} taking {} rows: {:.1} rows per claim; {}, {} transactions ({:.2} per hop)",
            self.claims,
            self.rows_claimed,
            self.rows_claimed as f64 / self.claims.max(1) as f64,
            match self.statements {
                Some(n) => format!("{n} statements ({:.2} per hop)", n as f64 / hops as f64),
                None => "statements not counted (the server does not load pg_stat_statements: \
                         add it to shared_preload_libraries)"
                    .to_string(),
            },
            self.transactions,
            self.transactions as f64 / hops as f64,
        )
        .unwrap();
        writeln!(
            out,
            "    CPU seconds during the burst: PostgreSQL {:.2}, stage workers {:.2}, dispatcher {:.2}",
            self.cpu_postgres, self.cpu_workers, self.cpu_dispatcher
        )
        .unwrap();
        let by_role: Vec<String> = self
            .by_role
            .iter()
            .map(|(role, calls)| format!("{role} {calls}"))
            .collect();
        if self.statements.is_some() {
            writeln!(out, "    statements by role: {}", by_role.join(", ")).unwrap();
        }
        for (stage, (messages, batches, classes)) in &self.batches {
            writeln!(
                out,
                "    {stage}: {messages} messages in {batches} worker batches, {:.1} per batch; sizes 1: {}, 2-3: {}, 4-7: {}, 8-15: {}, 16-31: {}, 32+: {}",
                *messages as f64 / (*batches).max(1) as f64,
                classes[0], classes[1], classes[2], classes[3], classes[4], classes[5]
            )
            .unwrap();
        }
        for (calls, rows, ms, plan_ms, plans, text) in &self.top {
            let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
            let short: String = text.chars().take(80).collect();
            writeln!(
                out,
                "    {calls:8} calls {:6.1} rows/call {ms:7.3} ms/call ({plan_ms:.3} planning, {plans} plans)  {short}",
                *rows as f64 / (*calls).max(1) as f64
            )
            .unwrap();
        }
    }
}

/// (b)/(c)/(d): a burst of `n` messages through the 5-stage pipeline.
fn burst(setup: &Setup, fusion: bool, queue_limit: u32, n: i64) -> Burst {
    burst_with(setup, fusion, queue_limit, n, true)
}

fn burst_with(setup: &Setup, fusion: bool, queue_limit: u32, n: i64, fair: bool) -> Burst {
    let db = TestDb::new();
    let conf = setup.config_with(&db, fusion, queue_limit, fair);
    let child = start_dispatcher(&conf, &setup.dir.join("dispatch.log"));
    let pid = child.id();
    let mut c = db.client();
    settle(&mut c);
    let cpu0 = cpu_seconds(pid);
    let backend: i32 = c
        .query_one("/* bench */ SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    // The postmaster's CPU, its backends', and the dispatcher's workers' (the
    // dispatcher's own is counted apart, so its own time is taken off below).
    let families = [parent_of(backend as u32), pid];
    let others0 = cpu_of_families(&families);
    // Without pg_stat_statements (a stock server) the statement figures are left out.
    let counting = c
        .batch_execute("/* bench */ SELECT pg_stat_statements_reset()")
        .is_ok();
    let xact0 = transactions(&mut c);
    // Every statement of the benchmark's own session from here on is one transaction
    // to take off the database's count: the inject, the polls, the snapshot reads.
    let mut own = 3;
    c.execute(
        "/* bench */ SELECT count(pepsi.workqueue_inject('p1', 'a' || (g % 50) || '@x.example', ARRAY['r@y.example'], NULL, NULL)) \
         FROM generate_series(1, $1::int8) g",
        &[&n],
    )
    .unwrap();
    let t0 = Instant::now();
    while queue_len(&mut c) > 0 {
        own += 1;
        std::thread::sleep(DRAIN_POLL);
    }
    own += 1;
    let seconds = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu0;
    let others = cpu_of_families(&families);
    // The workers go cold and log their batch sizes; then the dispatcher's shutdown
    // flushes its statistics and every session's counts reach pg_stat_database.
    std::thread::sleep(IDLE_TIMEOUT + Duration::from_millis(1500));
    stop(child);
    std::thread::sleep(Duration::from_millis(700));
    let transactions = transactions(&mut c) - xact0 - own;
    let stats = c
        .query_one(
            "/* bench */ SELECT claims, rows_claimed FROM pepsi.dispatch_stats",
            &[],
        )
        .unwrap();
    let rows = if counting {
        c.query(
            "/* bench */ SELECT calls, rows, mean_exec_time + total_plan_time / greatest(calls, 1), total_plan_time / greatest(calls, 1), plans, query FROM pg_stat_statements s \
             JOIN pg_database d ON d.oid = s.dbid \
             WHERE d.datname = current_database() AND s.toplevel AND s.query NOT LIKE '%/* bench */%' \
             ORDER BY calls DESC",
            &[],
        )
        .unwrap()
    } else {
        Vec::new()
    };
    let by_role = if counting {
        c.query(
            "/* bench */ SELECT r.rolname::text, sum(s.calls)::int8 FROM pg_stat_statements s \
             JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid \
             WHERE d.datname = current_database() AND s.toplevel AND s.query NOT LIKE '%/* bench */%' \
             GROUP BY 1 ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    } else {
        Vec::new()
    };
    let log = std::fs::read_to_string(setup.dir.join("dispatch.log")).unwrap_or_default();
    let profile = Profile {
        claims: stats.get(0),
        rows_claimed: stats.get(1),
        statements: counting.then(|| rows.iter().map(|r| r.get::<_, i64>(0)).sum()),
        by_role,
        top: rows
            .iter()
            .take(6)
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
            .collect(),
        transactions,
        batches: batch_sizes(&log),
        cpu_postgres: others[0] - others0[0],
        cpu_workers: others[1] - others0[1] - cpu,
        cpu_dispatcher: cpu,
    };
    Burst {
        seconds,
        cpu,
        profile,
    }
}

/// The table the latency triggers of (e) and (g) write. A trigger function runs with
/// the rights of the session whose deletion fires it, a worker's (with
/// `BENCH_ROLES=split`, the `pepsi_worker` login role, which has no rights of its own
/// in `public`): so every role may write it.
const LATENCY_TABLE: &str = "CREATE TABLE public.latency (ms float8);
     GRANT INSERT, SELECT ON public.latency TO PUBLIC;";

/// (e): single messages, one every 10 ms, through the fused pipeline. Returns (p50,
/// p99) milliseconds from inject to deletion.
fn trickle(setup: &Setup, count: i64) -> (f64, f64) {
    let db = TestDb::new();
    let conf = setup.config(&db, true, 4);
    let mut c = db.client();
    c.batch_execute(&format!(
        "{LATENCY_TABLE}
         CREATE FUNCTION public.record_latency() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO public.latency VALUES (extract(epoch FROM clock_timestamp() - OLD.arrived) * 1000); RETURN NULL; END $$;
         CREATE TRIGGER latency AFTER DELETE ON pepsi.workqueue FOR EACH ROW EXECUTE FUNCTION public.record_latency();",
    ))
    .unwrap();
    let child = start_dispatcher(&conf, &setup.dir.join("trickle.log"));
    settle(&mut c);
    // Warm the workers up, then measure.
    for i in 0..(count + 20) {
        if i == 20 {
            while queue_len(&mut c) > 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            c.execute("DELETE FROM public.latency", &[]).unwrap();
        }
        c.execute(
            "SELECT pepsi.workqueue_inject('p1', 'a@x.example', ARRAY['r@y.example'], NULL, NULL)",
            &[],
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    while queue_len(&mut c) > 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    stop(child);
    let row = c
        .query_one(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) FROM public.latency",
            &[],
        )
        .unwrap();
    (row.get(0), row.get(1))
}

/// (f) at the depths 1k, 10k, 100k and 1M, each printed: the times in ms.
fn fair_claim_depths(out: &mut impl Write) -> Vec<f64> {
    let mut depths = Vec::new();
    for depth in [1_000i64, 10_000, 100_000, 1_000_000] {
        let ms = fair_claim_ms(depth, false);
        writeln!(
            out,
            "(f) fair claim, one sender {depth:>9} deep + 50 small senders, cap 16: {ms:6.2} ms (median of 21)"
        )
        .unwrap();
        depths.push(ms);
    }
    for depth in [1_000i64, 10_000, 100_000, 1_000_000] {
        let ms = fair_claim_ms(depth, true);
        writeln!(
            out,
            "(f2) fair claim, one sender {depth:>9} deep + 1,000 tenants x 10 senders, cap 16: {ms:6.2} ms (median of 21)"
        )
        .unwrap();
        depths.push(ms);
    }
    depths
}

/// (f): the fair claim's median time over 21 calls (each rolled back) with `depth` rows
/// of one sender and 10 rows of each of 50 others waiting at one stage; cap 16. (f2),
/// `tenants`: instead of the 50, one row of each of 10 senders of each of 1,000
/// tenants (`x@sJ.tI.example`: 10,000 sender keys, 1,000 registrable domains).
fn fair_claim_ms(depth: i64, tenants: bool) -> f64 {
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
         SELECT 's', 'flood@a.example', ARRAY['r@y.example'] FROM generate_series(1, $1::int8)",
        &[&depth],
    )
    .unwrap();
    c.batch_execute(if tenants {
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
         SELECT 's', 'x@s' || (g % 10) || '.t' || (g / 10) || '.example', ARRAY['r@y.example'] \
           FROM generate_series(0, 9999) g"
    } else {
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
         SELECT 's', 'x@s' || (g % 50) || '.example', ARRAY['r@y.example'] FROM generate_series(1, 500) g"
    })
    .unwrap();
    // Alone: VACUUM refuses to run inside the implicit transaction of a batch.
    c.batch_execute("VACUUM ANALYZE pepsi.workqueue").unwrap();
    let stages = vec!["s".to_string()];
    let caps = vec![16i32];
    let fifo = vec![2i32];
    let avg = vec![1000f64];
    let cursor: Vec<Option<String>> = vec![None];
    let none_t: Vec<String> = Vec::new();
    let none_f: Vec<f64> = Vec::new();
    let mut times = Vec::new();
    for _ in 0..21 {
        let mut tx = c.transaction().unwrap();
        let t0 = Instant::now();
        tx.query(
            pepsi::db::sql::CLAIM_FAIR,
            &[
                &stages,
                &caps,
                &fifo,
                &avg,
                &cursor,
                &none_t,
                &none_t,
                &none_f,
                &100i32,
                &None::<Vec<i64>>,
                &None::<Vec<bool>>,
                &None::<Vec<i64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<f64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
            ],
        )
        .unwrap();
        times.push(t0.elapsed().as_secs_f64() * 1000.0);
        tx.rollback().unwrap();
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// (g): inject-to-deletion latencies (ms, sorted) of 10 messages of a small sender,
/// after `flood` messages of another sender (0: on an empty queue), unfused, QL 4.
fn small_sender_waits(setup: &Setup, flood: i64) -> Vec<f64> {
    let db = TestDb::new();
    let conf = setup.config(&db, false, 4);
    let mut c = db.client();
    c.batch_execute(&format!(
        "{LATENCY_TABLE}
         CREATE FUNCTION public.record_latency() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN IF OLD.sender_key = 'from:small.example' THEN
             INSERT INTO public.latency VALUES (extract(epoch FROM clock_timestamp() - OLD.arrived) * 1000);
         END IF; RETURN NULL; END $$;
         CREATE TRIGGER latency AFTER DELETE ON pepsi.workqueue FOR EACH ROW EXECUTE FUNCTION public.record_latency();",
    ))
    .unwrap();
    let child = start_dispatcher(&conf, &setup.dir.join("small.log"));
    settle(&mut c);
    if flood > 0 {
        c.execute(
            "SELECT count(pepsi.workqueue_inject('p1', 'x@flood.example', ARRAY['r@y.example'], NULL, NULL)) \
             FROM generate_series(1, $1::int8)",
            &[&flood],
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    c.execute(
        "SELECT count(pepsi.workqueue_inject('p1', 'x@small.example', ARRAY['r@y.example'], NULL, NULL)) \
         FROM generate_series(1, 10)",
        &[],
    )
    .unwrap();
    while c
        .query_one("SELECT count(*) FROM public.latency", &[])
        .unwrap()
        .get::<_, i64>(0)
        < 10
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    stop(child);
    let mut ms: Vec<f64> = c
        .query("SELECT ms FROM public.latency", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    ms.sort_by(f64::total_cmp);
    ms
}

/// The p50 and p99 of sorted values.
fn p50_p99(sorted: &[f64]) -> (f64, f64) {
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn main() {
    // `cargo bench` passes --bench; a plain `cargo test --benches` run lists nothing.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n = messages();
    let roles = Roles::from_env();
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(
        out,
        "pepsi pipeline benchmark: {n} messages per burst, {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
    .unwrap();
    writeln!(out, "roles: {}", roles.describe()).unwrap();
    writeln!(
        out,
        "last stage's SYNCHRONOUS_COMMIT: {}",
        last_stage_sync().as_deref().unwrap_or("unset (off)")
    )
    .unwrap();
    if rls_off() {
        writeln!(
            out,
            "row-level security on pepsi.workqueue: off (BENCH_RLS=off)"
        )
        .unwrap();
    }
    if durable() {
        let server = durable_server(&["fsync", "full_page_writes", "wal_sync_method"]);
        writeln!(out, "{server}").unwrap();
    }
    if roles == Roles::Split {
        create_login_roles();
    }
    if std::env::var_os("BENCH_QUICK").is_some_and(|q| q == "f") {
        let depths = fair_claim_depths(&mut out);
        writeln!(
            out,
            "fair claim at 100k / at 1k deep: {:.2}; with 1,000 tenants: {:.2}",
            depths[2] / depths[0],
            depths[6] / depths[4]
        )
        .unwrap();
        return;
    }
    let setup = Setup::new(roles);

    let mut raw = Vec::new();
    for threads in [8, 16] {
        let rate = raw_hop_rate(threads, 2500);
        writeln!(
            out,
            "(a) raw SELECT+UPDATE hop loop, {threads:2} clients:        {rate:8.0} hops/s"
        )
        .unwrap();
        raw.push(rate);
    }
    let raw_best = raw.iter().cloned().fold(0.0, f64::max);
    let mut batched = Vec::new();
    for threads in [4, 8] {
        let rate = raw_batched_hop_rate(threads, 300);
        writeln!(
            out,
            "(a2) raw batched loop, 16 rows per SELECT+UPDATE, {threads:2} clients: {rate:8.0} hops/s"
        )
        .unwrap();
        batched.push(rate);
    }
    let batched_best = batched.iter().cloned().fold(0.0, f64::max);

    let mut unfused_best = (0.0, 0.0, 0);
    for ql in queue_limits() {
        let b = burst(&setup, false, ql, n);
        let hops = (5 * n) as f64;
        let rate = hops / b.seconds;
        writeln!(
            out,
            "(b) dispatcher, 5 stages, fusion off, QUEUE_LIMIT {ql:2}: {rate:8.0} hops/s  ({:.0} messages/s; dispatcher CPU {:.3} s per 1,000 hops = {:.1}% of a core per 1,000 hops/s)",
            n as f64 / b.seconds,
            b.cpu / hops * 1000.0,
            b.cpu / hops * 1000.0 * 100.0,
        )
        .unwrap();
        b.profile.print(&mut out, 5 * n);
        if rate > unfused_best.0 {
            unfused_best = (rate, n as f64 / b.seconds, ql);
        }
    }
    writeln!(
        out,
        "ratio (b)/(a): {:.2}  (best unfused dispatcher hop rate {:.0} at QUEUE_LIMIT {} / best raw loop {:.0})",
        unfused_best.0 / raw_best,
        unfused_best.0,
        unfused_best.2,
        raw_best
    )
    .unwrap();
    writeln!(
        out,
        "ratio (b)/(a2): {:.2}  (best unfused dispatcher hop rate {:.0} / best batched raw loop {:.0})",
        unfused_best.0 / batched_best,
        unfused_best.0,
        batched_best
    )
    .unwrap();
    let (p50, p99) = trickle(&setup, 300);
    writeln!(out, "(e) latency inject -> deletion, 300 single messages, fused: p50 {p50:.2} ms, p99 {p99:.2} ms").unwrap();
    let quick = std::env::var_os("BENCH_QUICK");
    if quick.as_ref().is_some_and(|q| q != "c") {
        return;
    }
    let mut fused_best = 0.0f64;
    for ql in [4, 16] {
        let b = burst(&setup, true, ql, n);
        let rate = n as f64 / b.seconds;
        writeln!(
            out,
            "(c) dispatcher, 5 stages, fusion on,  QUEUE_LIMIT {ql:2}: {rate:8.0} messages/s ({:.0} stage executions/s; dispatcher CPU {:.3} s per 1,000 passes)",
            rate * 5.0,
            b.cpu / n as f64 * 1000.0,
        )
        .unwrap();
        fused_best = fused_best.max(rate);
    }
    if quick.is_some() {
        return;
    }
    let depths = fair_claim_depths(&mut out);
    let alone = p50_p99(&small_sender_waits(&setup, 0));
    let behind = p50_p99(&small_sender_waits(&setup, 10_000));
    writeln!(
        out,
        "(g) a 10-message sender's wait, p50 / p99: alone {:.1} / {:.1} ms, behind a 10,000-message flood {:.1} / {:.1} ms",
        alone.0, alone.1, behind.0, behind.1
    )
    .unwrap();
    let off = burst_with(&setup, false, 16, n, false);
    let on = burst_with(&setup, false, 16, n, true);
    let (off_rate, on_rate) = ((5 * n) as f64 / off.seconds, (5 * n) as f64 / on.seconds);
    writeln!(
        out,
        "(h) 5 stages, fusion off, QUEUE_LIMIT 16: fair scheduling off {off_rate:.0} hops/s, on {on_rate:.0} hops/s"
    )
    .unwrap();
    writeln!(out, "---").unwrap();
    writeln!(
        out,
        "fused / unfused message rate: {:.2}  ({:.0} / {:.0} messages/s)",
        fused_best / unfused_best.1,
        fused_best,
        unfused_best.1
    )
    .unwrap();
    let (lo, hi) = depths
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &d| (lo.min(d), hi.max(d)));
    writeln!(
        out,
        "fair claim at 1M / at 1k deep: {:.2} (spread {:.0}% around the middle)",
        depths[3] / depths[0],
        (hi - lo) / ((hi + lo) / 2.0) * 50.0
    )
    .unwrap();
    writeln!(
        out,
        "small sender's p99 behind a flood / alone: {:.2}",
        behind.1 / alone.1
    )
    .unwrap();
    writeln!(out, "fair on / off hop rate: {:.2}", on_rate / off_rate).unwrap();
}
