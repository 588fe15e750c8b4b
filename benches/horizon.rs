//! The held-snapshot benchmark: `cargo bench --bench horizon` (release build). Prints,
//! measured in one run against one PostgreSQL server (a throwaway cluster, or
//! `DATABASE_URL`), what a snapshot held open elsewhere (a nightly `pg_dump`, a
//! forgotten `psql`) does to the mail:
//!
//! An a → b → c pipeline (`pass`, `pass`, `discard`, fair scheduling on, 20 senders)
//! first drains a burst, which gives its drain rate; then it gets steady input at
//! `BENCH_LOAD` (default 60 %) of that rate, and after a warm-up a session opens a
//! REPEATABLE READ transaction, reads one row and holds the snapshot
//! `BENCH_HOLD_SECS` (default 60) seconds before it commits. Per phase — before the
//! hold, slices of the hold, after it — one line: messages injected and completed
//! (deleted by `c`), the share completed, the p99 time from injection to deletion of
//! the messages completed in it, claims per second and the mean time of a claim
//! statement (`pg_stat_statements`), and the entries the two pending indexes returned
//! per claim and per index scan (`pg_stat_user_indexes.idx_tup_read`: the dead entries
//! a scan steps over count, the live ones too). Then how long after the commit the
//! backlog took to go back to where it was before the hold.
//!
//! `BENCH_BEFORE=DIR` runs the same scenario first with the programs in DIR
//! (`pepsi-dispatch`, `pepsi-setup`, `pepsi-stage`, e.g. a release build of main, each
//! database installed by that build's own `pepsi-setup`), at the same input rate, so
//! the two builds are compared in one session; `BENCH_RATE` (messages/s) sets the
//! input rate instead of measuring the drain rate. `BENCH_BURST=N` injects N more
//! messages at once 10 s into the hold, as a mail server sees bursts: a backlog of
//! more rows than the fair claim reads from its floor makes it walk the senders, and
//! that walk reads every dead entry the snapshot keeps. Figures, never assertions.

#[allow(dead_code)]
#[path = "../tests/util/pg.rs"]
mod pg;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pg::TestDb;
use postgres::Client;

/// One build of the programs.
struct Build {
    /// For the table.
    name: String,
    /// Where its programs are; `None`: this build's.
    dir: Option<PathBuf>,
}

impl Build {
    fn program(&self, name: &str) -> PathBuf {
        match &self.dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(match name {
                "pepsi-dispatch" => env!("CARGO_BIN_EXE_pepsi-dispatch"),
                "pepsi-setup" => env!("CARGO_BIN_EXE_pepsi-setup"),
                "pepsi-stage" => env!("CARGO_BIN_EXE_pepsi-stage"),
                other => panic!("no program {other}"),
            }),
        }
    }
}

/// The senders the input cycles through.
const SENDERS: i64 = 20;

/// One run's files: the stage links, the configuration, the dispatcher's log.
struct Run {
    dir: PathBuf,
    conf: PathBuf,
}

impl Run {
    fn new(build: &Build, db: &TestDb, tag: &str) -> Run {
        let dir = std::env::temp_dir().join(format!("pepsi-horizon-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for s in ["pass", "discard"] {
            std::os::unix::fs::symlink(
                build.program("pepsi-stage"),
                dir.join(format!("pepsi-stage-{s}")),
            )
            .unwrap();
        }
        let conf = dir.join("pepsi.conf");
        let text = format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n\
             [pepsi-dispatch]\nSTATS_INTERVAL = 60s\nWORKER_IDLE_TIMEOUT = 600s\n\n\
             [stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n\
             [stage-b]\nPROGRAM = {pass}\nNEXT = c\nFUSION = no\n\n\
             [stage-c]\nPROGRAM = {discard}\nFUSION = no\n",
            db.conninfo,
            pass = dir.join("pepsi-stage-pass").display(),
            discard = dir.join("pepsi-stage-discard").display(),
        );
        std::fs::write(&conf, text).unwrap();
        Run { dir, conf }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A database with `build`'s schema, installed by its own `pepsi-setup`, and the
/// latency trigger.
fn database(build: &Build) -> (TestDb, Run) {
    let db = TestDb::empty();
    let run = Run::new(build, &db, &build.name);
    let out = Command::new(build.program("pepsi-setup"))
        .arg("-c")
        .arg(&run.conf)
        .arg("schema")
        .output()
        .expect("run pepsi-setup");
    assert!(
        out.status.success(),
        "pepsi-setup schema: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = db.client();
    c.batch_execute(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
         CREATE TABLE public.latency (done float8, ms float8);
         CREATE FUNCTION public.record_latency() RETURNS trigger LANGUAGE plpgsql
             SET search_path = public, pg_catalog AS $$
         BEGIN
             INSERT INTO public.latency VALUES (extract(epoch FROM clock_timestamp()),
                 extract(epoch FROM clock_timestamp() - OLD.arrived) * 1000);
             RETURN NULL;
         END $$;
         CREATE TRIGGER latency AFTER DELETE ON pepsi.workqueue
             FOR EACH ROW EXECUTE FUNCTION public.record_latency();",
    )
    .unwrap();
    (db, run)
}

fn start_dispatcher(build: &Build, run: &Run) -> Child {
    let log = std::fs::File::create(run.dir.join("dispatch.log")).unwrap();
    Command::new(build.program("pepsi-dispatch"))
        .arg("-c")
        .arg(&run.conf)
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

/// Injects `n` messages at `a`, numbered from `from` (the sender cycles).
fn inject(c: &mut Client, from: i64, n: i64) {
    c.execute(
        "/* bench */ SELECT count(pepsi.workqueue_inject('a', 's' || (g % $3::int8) || '@x.example', \
             ARRAY['r@y.example'], NULL, NULL)) FROM generate_series($1::int8, $2::int8) g",
        &[&from, &(from + n - 1), &SENDERS],
    )
    .unwrap();
}

fn completed(c: &mut Client) -> i64 {
    c.query_one("/* bench */ SELECT count(*) FROM public.latency", &[])
        .unwrap()
        .get(0)
}

/// The drain rate of a 3,000-message burst, messages/s.
fn drain_rate(build: &Build) -> f64 {
    let (db, run) = database(build);
    let child = start_dispatcher(build, &run);
    let mut c = db.client();
    std::thread::sleep(Duration::from_millis(700));
    // Warm the workers up.
    inject(&mut c, 0, 200);
    while completed(&mut c) < 200 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let n = 3000;
    let t0 = Instant::now();
    inject(&mut c, 200, n);
    while completed(&mut c) < 200 + n {
        std::thread::sleep(Duration::from_millis(20));
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    stop(child);
    rate
}

/// The counters a phase is the difference of.
#[derive(Clone, Copy, Debug, Default)]
struct Snap {
    at: f64,
    injected: i64,
    claims: i64,
    claim_ms: f64,
    scans: i64,
    entries: i64,
}

fn snap(c: &mut Client, injected: &AtomicI64) -> Snap {
    c.batch_execute("/* bench */ SELECT pg_stat_clear_snapshot()")
        .unwrap();
    let claims = c
        .query_one(
            "/* bench */ SELECT coalesce(sum(s.calls), 0)::int8, coalesce(sum(s.total_exec_time), 0)::float8 \
               FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
              WHERE d.datname = current_database() AND s.toplevel \
                AND s.query LIKE '%workqueue_claim_fair%' AND s.query NOT LIKE '%/* bench */%'",
            &[],
        )
        .unwrap();
    let idx = c
        .query_one(
            "/* bench */ SELECT coalesce(sum(idx_scan), 0)::int8, coalesce(sum(idx_tup_read), 0)::int8 \
               FROM pg_stat_user_indexes \
              WHERE indexrelname IN ('workqueue_pending_idx', 'workqueue_pending_tenant_idx')",
            &[],
        )
        .unwrap();
    let at: f64 = c
        .query_one(
            "/* bench */ SELECT extract(epoch FROM clock_timestamp())::float8",
            &[],
        )
        .unwrap()
        .get(0);
    Snap {
        at,
        injected: injected.load(Ordering::SeqCst),
        claims: claims.get(0),
        claim_ms: claims.get(1),
        scans: idx.get(0),
        entries: idx.get(1),
    }
}

/// One line of the table: what happened between two snapshots.
struct Phase {
    label: String,
    injected: i64,
    completed: i64,
    p99_s: f64,
    claims_per_s: f64,
    claim_ms: f64,
    entries_per_claim: f64,
    entries_per_scan: f64,
}

fn phase(c: &mut Client, label: &str, a: Snap, b: Snap) -> Phase {
    let row = c
        .query_one(
            "/* bench */ SELECT count(*)::int8, \
                    coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)::float8 \
               FROM public.latency WHERE done >= $1 AND done < $2",
            &[&a.at, &b.at],
        )
        .unwrap();
    let claims = (b.claims - a.claims).max(0);
    let per = |x: i64, n: i64| if n > 0 { x as f64 / n as f64 } else { 0.0 };
    Phase {
        label: label.to_string(),
        injected: b.injected - a.injected,
        completed: row.get(0),
        p99_s: row.get::<_, f64>(1) / 1000.0,
        claims_per_s: claims as f64 / (b.at - a.at),
        claim_ms: if claims > 0 {
            (b.claim_ms - a.claim_ms) / claims as f64
        } else {
            0.0
        },
        entries_per_claim: per(b.entries - a.entries, claims),
        entries_per_scan: per(b.entries - a.entries, b.scans - a.scans),
    }
}

fn print_phase(build: &str, p: &Phase) {
    let share = if p.injected > 0 {
        100.0 * p.completed as f64 / p.injected as f64
    } else {
        0.0
    };
    println!(
        "{build:<8} | {:<14} | {:>8} | {:>9} | {:>6.1} % | {:>+8} | {:>7.2} | {:>8.0} | {:>8.2} | {:>14.1} | {:>13.1}",
        p.label,
        p.injected,
        p.completed,
        share,
        p.injected - p.completed,
        p.p99_s,
        p.claims_per_s,
        p.claim_ms,
        p.entries_per_claim,
        p.entries_per_scan
    );
}

/// The scenario for one build at `rate` messages/s with the snapshot held `hold`.
fn scenario(build: &Build, rate: f64, hold: Duration, burst: i64) {
    let (db, run) = database(build);
    let child = start_dispatcher(build, &run);
    std::thread::sleep(Duration::from_millis(700));
    let injected = Arc::new(AtomicI64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let burst_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    // The input: every 10 ms, the messages due by then, and the burst when it is due.
    let injector = {
        let injected = Arc::clone(&injected);
        let done = Arc::clone(&done);
        let burst_at = Arc::clone(&burst_at);
        let mut c = db.client();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut sent = 0i64;
            let mut extra = 0i64;
            while !done.load(Ordering::SeqCst) {
                let due = (t0.elapsed().as_secs_f64() * rate) as i64;
                if due > sent {
                    inject(&mut c, sent + extra, due - sent);
                    sent = due;
                    injected.store(sent + extra, Ordering::SeqCst);
                }
                let burst_due = {
                    let mut at = burst_at.lock().unwrap();
                    let due = at.is_some_and(|t| t <= Instant::now());
                    if due {
                        *at = None;
                    }
                    due
                };
                if burst_due && burst > 0 {
                    inject(&mut c, sent + extra, burst);
                    extra += burst;
                    injected.store(sent + extra, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let mut c = db.client();
    let _ = c.batch_execute("/* bench */ SELECT pg_stat_statements_reset()");
    // Warm-up, then the phase before the hold.
    std::thread::sleep(Duration::from_secs(10));
    let s0 = snap(&mut c, &injected);
    std::thread::sleep(Duration::from_secs(20));
    let s1 = snap(&mut c, &injected);
    let mut phases = vec![phase(&mut c, "before hold", s0, s1)];
    // The snapshot, held.
    let mut holder = db.client();
    holder
        .batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pepsi.dispatch_stats;",
        )
        .unwrap();
    *burst_at.lock().unwrap() = Some(Instant::now() + Duration::from_secs(10).min(hold / 2));
    // What the claims' statements cost over the hold counts from here.
    let _ = c.batch_execute("/* bench */ SELECT pg_stat_statements_reset()");
    let slices = 6u32;
    let mut at = snap(&mut c, &injected);
    let start = at;
    for i in 1..=slices {
        std::thread::sleep(hold / slices);
        let next = snap(&mut c, &injected);
        let label = format!(
            "hold {:>3}-{:<3}s",
            (hold / slices * (i - 1)).as_secs(),
            (hold / slices * i).as_secs()
        );
        phases.push(phase(&mut c, &label, at, next));
        at = next;
    }
    let nested = claim_statements(&mut c);
    holder.batch_execute("COMMIT").unwrap();
    let committed = Instant::now();
    let mut whole = phase(&mut c, "hold, all", start, at);
    // The backlog before the hold, and how long after the commit it took to get back
    // there.
    let before_backlog = s1.injected - completed_before(&mut c, s1.at);
    let mut caught_up = None;
    while committed.elapsed() < Duration::from_secs(60) {
        let now = injected.load(Ordering::SeqCst);
        if now - completed(&mut c) <= before_backlog.max(0) + (rate * 0.25) as i64 {
            caught_up = Some(committed.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(5));
    let s3 = snap(&mut c, &injected);
    let after = phase(&mut c, "after commit", at, s3);
    done.store(true, Ordering::SeqCst);
    injector.join().unwrap();
    stop(child);
    whole.label = "hold, all".into();
    for p in &phases {
        print_phase(&build.name, p);
    }
    print_phase(&build.name, &whole);
    print_phase(&build.name, &after);
    if !nested.is_empty() {
        println!(
            "{:<8} | the claims' statements over the hold (pg_stat_statements, track = all): calls, mean ms, buffers per call, statement",
            build.name
        );
        for line in &nested {
            println!("{:<8} |   {line}", build.name);
        }
    }
    match caught_up {
        Some(s) => println!(
            "{:<8} | caught up {s:.1} s after the commit (backlog back to {before_backlog} + {})",
            build.name,
            (rate * 0.25) as i64
        ),
        None => println!("{:<8} | not caught up 60 s after the commit", build.name),
    }
    drop(run);
}

/// The statements inside the claim functions that took the most time since the last
/// reset (`pg_stat_statements.track = all`, as the throwaway cluster has it): one line
/// each, with calls, mean milliseconds and shared buffers read per call; none when the
/// server does not count statements.
fn claim_statements(c: &mut Client) -> Vec<String> {
    c.query(
        "/* bench */ SELECT s.calls, s.total_exec_time / greatest(s.calls, 1), \
                (s.shared_blks_hit + s.shared_blks_read)::float8 / greatest(s.calls, 1), \
                regexp_replace(left(s.query, 400), '\\s+', ' ', 'g') \
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
          WHERE d.datname = current_database() AND NOT s.toplevel \
            AND s.query LIKE '%pepsi.workqueue%' AND s.query NOT LIKE '%/* bench */%' \
          ORDER BY s.total_exec_time DESC LIMIT 8",
        &[],
    )
    .map(|rows| {
        rows.iter()
            .map(|r| {
                let text: String = r.get(3);
                format!(
                    "{:>8} | {:>8.3} | {:>10.1} | {}",
                    r.get::<_, i64>(0),
                    r.get::<_, f64>(1),
                    r.get::<_, f64>(2),
                    text.chars().take(150).collect::<String>()
                )
            })
            .collect()
    })
    .unwrap_or_default()
}

fn completed_before(c: &mut Client, at: f64) -> i64 {
    c.query_one(
        "/* bench */ SELECT count(*) FROM public.latency WHERE done < $1",
        &[&at],
    )
    .unwrap()
    .get(0)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let hold = Duration::from_secs(
        std::env::var("BENCH_HOLD_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    );
    let load: f64 = std::env::var("BENCH_LOAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let mut builds = Vec::new();
    if let Ok(dir) = std::env::var("BENCH_BEFORE") {
        builds.push(Build {
            name: "before".into(),
            dir: Some(Path::new(&dir).to_path_buf()),
        });
    }
    builds.push(Build {
        name: "this".into(),
        dir: None,
    });
    let rate = match std::env::var("BENCH_RATE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    {
        Some(r) => r,
        None => {
            let drain = drain_rate(&builds[0]);
            println!(
                "drain rate ({}): {drain:.0} messages/s; input at {load:.0} %",
                builds[0].name
            );
            drain * load / 100.0
        }
    };
    let burst: i64 = std::env::var("BENCH_BURST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    println!(
        "a → b → c, fair scheduling, {SENDERS} senders, input {rate:.0} messages/s, a REPEATABLE READ snapshot held {} s, then committed{}",
        hold.as_secs(),
        if burst > 0 {
            format!("; {burst} more messages at once 10 s into the hold")
        } else {
            String::new()
        }
    );
    println!(
        "build    | phase          | injected | completed | compl/inj | backlog  | p99 s   | claims/s | claim ms | entries/claim  | entries/scan"
    );
    for build in &builds {
        scenario(build, rate, hold, burst);
    }
}
