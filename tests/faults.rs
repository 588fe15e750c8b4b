//! The fault suite: a test binary of its own, so it gets a throwaway PostgreSQL cluster
//! of its own that it may restart, starve of connections and configure
//! (`max_connections = 60`) without disturbing the integration tests' cluster.
//!
//! One test runs the scenarios one after another (a cluster restart would break a
//! scenario running beside it). Each drains the same pipeline of built-in stages —
//! `a` pass → `b` if (sender domain) → `c` or `d` discard, `FUSION = no`, so every hop
//! is a claim — of 2,000 messages under one fault, and checks by database triggers
//! what a mail queue must guarantee whatever happens: no message lost, none left
//! running, every committed stage outcome exactly once and in order, and every second
//! run of a stage (a second claim of a row at one stage) explained by the fault. Drain
//! times are printed against the fault-free baseline, as figures, never asserted:
//!
//! ```text
//! cargo test --test faults -- --nocapture
//! ```
//!
//! Beside it, the failure bouncer's PostgreSQL restart, `pepsi-ingress` answering
//! 451 while PostgreSQL is stopped and 250 once it is started again, and the failover
//! test ([`failover`]: the same pipeline on a primary and a streaming standby of its
//! own, the primary killed and the standby promoted mid-drain). The tests of this
//! binary that restart or stop its cluster take [`CLUSTER`] first, so they run one at
//! a time.

#[path = "faults/failover.rs"]
mod failover;
mod util;

use std::collections::HashSet;
use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::{Client, NoTls};

use pepsi::protocol;
use util::bouncer::Bouncer;
use util::dispatcher::{Dispatcher, alive, fault_worker, session_name_of};
use util::ingress::{self, Ingress};
use util::scenario::programs;
use util::{
    TempDir, TestDb, assert_has, claim, inject, pg, row_at, stage, wait_until, write_config,
};

/// Held by a test while it runs against this binary's cluster in a way another test's
/// restart would break (or while it restarts it).
static CLUSTER: Mutex<()> = Mutex::new(());

/// Takes [`CLUSTER`], also after another test panicked holding it.
fn cluster() -> MutexGuard<'static, ()> {
    CLUSTER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Messages per scenario (the poison scenario adds its poison).
const MESSAGES: i64 = 2000;
/// `QUEUE_LIMIT` and `PARALLELISM` of every stage: the bounds below derive from them.
const QUEUE_LIMIT: i64 = 4;
const PARALLELISM: i64 = 4;
/// Stages with a section (`a`, `b`, `c`, `d`).
const STAGES: i64 = 4;
/// Rows the dispatcher holds claimed for one stage at most (§6 "Batched claim").
const STAGE_CAPACITY: i64 = QUEUE_LIMIT * PARALLELISM;
/// Rows it holds claimed at most: a fault that takes the whole dispatcher down (its
/// death, its lost lock) sends back at most this many for a second run.
const CAPACITY: i64 = STAGES * STAGE_CAPACITY;
/// The shortest start-failure cooldown (§8.1, `COOLDOWN_FIRST` in
/// `src/dispatch/pool.rs`): a stage's start failures, each giving back at most what the
/// stage holds, are at least this far apart.
const COOLDOWN_FIRST: Duration = Duration::from_secs(2);
/// The throwaway cluster's `max_connections` for this binary: low, so exhausting it is
/// cheap, and still far above what the pipeline needs (~45).
const MAX_CONNECTIONS: i64 = 60;
/// How long the connections are held exhausted.
const EXHAUSTION: Duration = Duration::from_secs(10);
/// Generous: a drain takes seconds, plus the 30 s pause of a deferral (§8.4).
const DRAIN_DEADLINE: Duration = Duration::from_secs(180);
/// How often the drain is watched (and a fault's moment checked).
const TICK: Duration = Duration::from_millis(50);

/// §6 "Outage" (amended): the dispatcher never exits because the database is
/// away. The full rule is not built on this branch (it exits 1 when it cannot re-take
/// its lock within ~10 s), but the outages here are shorter than that (a fast restart
/// is down well under 10 s; exhausted connections leave its own session alone), so the
/// suite asserts that the dispatcher never exited. Set to false to tolerate exits in
/// the outage scenarios (a PostgreSQL restart, exhausted connections) — each is then
/// restarted, as a service manager would, and reported in the table. An exit in any
/// other scenario always fails the suite.
const DISPATCHER_MUST_SURVIVE_OUTAGES: bool = true;

/// Records, by trigger, everything the suite judges by, in the transaction that does
/// it (so a rolled-back write leaves no trace): every claim (`claim`, with the status
/// it took the row from), every committed stage outcome (`outcome`: the stage left and
/// the stage entered, NULL for the deletion that ends a message), and every return of
/// a running row at its stage (`strike`, `defer` for a 30 s deferral, `requeue` for a
/// requeue or reset to pending, or the terminal status). `fault_injected` holds the
/// stage each injected message must end at.
const INSTRUMENT: &str = "
CREATE TABLE public.fault_injected (id bigint PRIMARY KEY, end_stage text NOT NULL);
CREATE TABLE public.fault_log (
    n bigserial PRIMARY KEY, id bigint NOT NULL, kind text NOT NULL, stage text NOT NULL,
    next text, prior text);
CREATE INDEX ON public.fault_log (id);
CREATE FUNCTION public.fault_log() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO public.fault_log (id, kind, stage, prior)
        VALUES (OLD.workqueue_id, 'outcome', OLD.stage, OLD.status::text);
    ELSIF NEW.stage IS DISTINCT FROM OLD.stage THEN
        INSERT INTO public.fault_log (id, kind, stage, next, prior)
        VALUES (OLD.workqueue_id, 'outcome', OLD.stage, NEW.stage, OLD.status::text);
    ELSIF NEW.status = 'running' AND NEW.claim IS DISTINCT FROM OLD.claim THEN
        INSERT INTO public.fault_log (id, kind, stage, prior)
        VALUES (NEW.workqueue_id, 'claim', NEW.stage, OLD.status::text);
    ELSIF OLD.status = 'running' AND NEW.status <> 'running' THEN
        INSERT INTO public.fault_log (id, kind, stage, prior)
        VALUES (NEW.workqueue_id,
                CASE WHEN NEW.status = 'paused'
                          AND NEW.state->'strikes' IS DISTINCT FROM OLD.state->'strikes'
                         THEN 'strike'
                     WHEN NEW.status = 'paused' THEN 'defer'
                     WHEN NEW.status = 'pending' THEN 'requeue'
                     ELSE NEW.status::text END,
                NEW.stage, 'running');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER fault_log AFTER UPDATE OR DELETE ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION public.fault_log();
";

/// Injects `$1` messages at `a`, alternating senders at `drop.example` (which `b`
/// sends to `c`) and `keep.example` (to `d`), and records where each must end. The
/// poison pipeline's `b` sends everything to `c` (`$2`).
const INJECT: &str = "INSERT INTO public.fault_injected (id, end_stage) \
     SELECT pepsi.workqueue_inject('a', \
                CASE WHEN g % 2 = 0 THEN 's@drop.example' ELSE 's@keep.example' END, \
                ARRAY['r@y.example'], 'Subject: x\r\n'::bytea, 'body'::bytea), \
            CASE WHEN $2 THEN 'c' WHEN g % 2 = 0 THEN 'c' ELSE 'd' END \
       FROM generate_series(1, $1::int8) g";

/// The faults, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    KillWorkers,
    KillDispatcher,
    RestartPostgres,
    TerminateSessions,
    ExhaustConnections,
    Poison,
}

impl Fault {
    const ALL: [Fault; 7] = [
        Fault::None,
        Fault::KillWorkers,
        Fault::KillDispatcher,
        Fault::RestartPostgres,
        Fault::TerminateSessions,
        Fault::ExhaustConnections,
        Fault::Poison,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::None => "none (baseline)",
            Fault::KillWorkers => "SIGKILL random workers",
            Fault::KillDispatcher => "SIGKILL dispatcher",
            Fault::RestartPostgres => "PostgreSQL fast restart",
            Fault::TerminateSessions => "pg_terminate_backend",
            Fault::ExhaustConnections => "connections exhausted",
            Fault::Poison => "poison message",
        }
    }

    /// The drain progress (share of messages done) at which the fault strikes, once
    /// per entry.
    fn moments(self) -> &'static [f64] {
        match self {
            Fault::None | Fault::Poison => &[],
            Fault::KillWorkers => &[0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65],
            Fault::KillDispatcher => &[0.25, 0.6],
            Fault::RestartPostgres | Fault::ExhaustConnections => &[0.3],
            Fault::TerminateSessions => &[0.2, 0.45, 0.7],
        }
    }

    /// Does it need the throwaway cluster (a restart, or starving a shared server)?
    fn needs_own_cluster(self) -> bool {
        matches!(self, Fault::RestartPostgres | Fault::ExhaustConnections)
    }

    /// The database goes away: see [`DISPATCHER_MUST_SURVIVE_OUTAGES`].
    fn is_outage(self) -> bool {
        matches!(self, Fault::RestartPostgres | Fault::ExhaustConnections)
    }
}

/// Notes the dispatcher's workers in `workers`; a dispatcher that exited without being
/// told to is recorded in `exits` (with the last ERROR line of its log) and started
/// again, so that the rest can still be measured.
fn supervise(
    d: &mut Dispatcher,
    conf: &std::path::Path,
    workers: &mut HashSet<u32>,
    exits: &mut Vec<String>,
) {
    workers.extend(d.children());
    if let Some(status) = d.try_wait() {
        let log = d.log();
        let why = log
            .lines()
            .rev()
            .find(|l| l.contains("ERROR"))
            .unwrap_or("")
            .to_string();
        exits.push(format!("{status}: {why}"));
        assert!(exits.len() < 20, "the dispatcher keeps exiting: {exits:?}");
        std::thread::sleep(Duration::from_millis(300));
        *d = Dispatcher::start(conf, &[]);
    }
}

/// After a drain: waits up to 30 s, supervising, for every worker to stop (after
/// WORKER_IDLE_TIMEOUT); the failure when some still run.
fn quiesce(
    d: &mut Dispatcher,
    conf: &std::path::Path,
    workers: &mut HashSet<u32>,
    exits: &mut Vec<String>,
) -> Option<String> {
    let quiet = Instant::now() + Duration::from_secs(30);
    while !d.children().is_empty() && Instant::now() < quiet {
        supervise(d, conf, workers, exits);
        std::thread::sleep(TICK);
    }
    supervise(d, conf, workers, exits);
    (!d.children().is_empty()).then(|| {
        format!(
            "workers still running 30 s after the drain: {:?}",
            d.children()
        )
    })
}

/// What the fault log and the queue say after a drain, as counts.
struct Drained {
    /// Rows left running.
    stuck: i64,
    /// Rows left in the queue (but the poison, left there on purpose).
    left: i64,
    /// Messages whose last stage never committed its outcome.
    lost: i64,
    /// Stage outcomes committed twice.
    duplicate_commits: i64,
    /// Messages whose committed outcomes, in commit order, are not exactly their path.
    off_path: i64,
    /// Outcomes written on a row that was not running (by no claim's holder).
    unclaimed_outcomes: i64,
    /// Claims of a row that was not pending (one some worker still held).
    double_claims: i64,
    /// Second claims of a row at one stage: what the fault must explain.
    reclaims: i64,
    /// Rows given back by a worker: struck, deferred, requeued.
    given_back: (i64, i64, i64),
}

impl Drained {
    /// Reads the counts once the database answers; `poison` is a row left in the queue
    /// on purpose.
    fn read(m: &mut Monitor, poison: Option<i64>) -> Drained {
        let returns = |m: &mut Monitor, kind: &str| {
            m.must(&format!(
                "SELECT count(*) FROM public.fault_log WHERE kind = '{kind}'"
            ))
        };
        Drained {
            stuck: m.must("SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'"),
            left: m.must(&format!(
                "SELECT count(*) FROM pepsi.workqueue WHERE workqueue_id <> {}",
                poison.unwrap_or(0)
            )),
            lost: m.must(
                "SELECT count(*) FROM public.fault_injected i WHERE NOT EXISTS ( \
                   SELECT 1 FROM public.fault_log l WHERE l.id = i.id AND l.kind = 'outcome' \
                      AND l.next IS NULL AND l.stage = i.end_stage)",
            ),
            duplicate_commits: m.must(
                "SELECT (count(*) - count(DISTINCT (id, stage)))::int8 FROM public.fault_log \
                  WHERE kind = 'outcome'",
            ),
            off_path: m.must(
                "SELECT count(*) FROM public.fault_injected i \
                  WHERE (SELECT array_agg(l.stage || '>' || coalesce(l.next, 'done') ORDER BY l.n) \
                           FROM public.fault_log l WHERE l.id = i.id AND l.kind = 'outcome') \
                        IS DISTINCT FROM ARRAY['a>b', 'b>' || i.end_stage, i.end_stage || '>done']",
            ),
            unclaimed_outcomes: m.must(
                "SELECT count(*) FROM public.fault_log WHERE kind = 'outcome' AND prior <> 'running'",
            ),
            double_claims: m.must(
                "SELECT count(*) FROM public.fault_log WHERE kind = 'claim' AND prior <> 'pending'",
            ),
            reclaims: m.must(
                "SELECT coalesce(sum(n - 1), 0)::int8 FROM ( \
                   SELECT count(*) AS n FROM public.fault_log WHERE kind = 'claim' \
                    GROUP BY id, stage) s",
            ),
            given_back: (
                returns(m, "strike"),
                returns(m, "defer"),
                returns(m, "requeue"),
            ),
        }
    }

    /// The checks every scenario makes whatever its fault, each failed one described.
    fn failures(&self) -> Vec<String> {
        [
            (self.lost, "messages never reached their end"),
            (self.stuck, "rows left running"),
            (self.left, "messages left in the queue"),
            (self.duplicate_commits, "stage outcomes committed twice"),
            (
                self.off_path,
                "messages whose committed outcomes are not exactly their path",
            ),
            (
                self.unclaimed_outcomes,
                "outcomes written on a row that was not running",
            ),
            (self.double_claims, "claims of a row that was not pending"),
        ]
        .into_iter()
        .filter(|(n, _)| *n != 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect()
    }

    /// The notes' "given back" part.
    fn given_back(&self) -> String {
        let (strikes, defers, requeues) = self.given_back;
        format!("given back: {strikes} struck, {defers} deferred, {requeues} requeued")
    }
}

/// A connection for watching that reconnects after a restart or a termination.
/// The test's own view of the database: a session of Pepsi's client, so that a server
/// that stops answering (the frozen primary of the failover test) is left as the
/// programs leave it, and the next session goes to the host that answers.
struct Monitor {
    conninfo: String,
    client: Option<pepsi::db::Client>,
}

impl Monitor {
    /// The value of a one-number query, or None while the database cannot answer.
    fn count(&mut self, sql: &str) -> Option<i64> {
        if self.client.is_none() {
            self.client = pepsi::db::connect(&self.conninfo, "pepsi-fault-monitor").ok();
        }
        let result = self.client.as_mut()?.query_one(sql, &[]);
        match result {
            Ok(row) => Some(row.get(0)),
            Err(_) => {
                self.client = None;
                None
            }
        }
    }

    /// The value of a one-number query, once the database answers.
    #[track_caller]
    fn must(&mut self, sql: &str) -> i64 {
        let mut value = None;
        wait_until(Duration::from_secs(30), &format!("{sql} answers"), || {
            value = self.count(sql);
            value.is_some()
        });
        value.unwrap()
    }

    /// The session names of the workers that are working (so ready, and holding
    /// ids): those whose database session is inside a statement, or else those that
    /// ran one within the last 100 ms.
    fn busy_workers(&mut self) -> Vec<String> {
        let Some(c) = self.client.as_mut() else {
            return Vec::new();
        };
        let sessions: Vec<(String, bool)> = c
            .query(
                "SELECT application_name, state = 'active' \
                   FROM pg_stat_activity \
                  WHERE datname = current_database() AND application_name LIKE $1 \
                    AND (state = 'active' \
                         OR state_change > clock_timestamp() - interval '100 milliseconds')",
                &[&protocol::ANY_WORKER_SESSION],
            )
            .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
            .unwrap_or_default();
        let active = sessions.iter().any(|&(_, active)| active);
        sessions
            .into_iter()
            .filter(|&(_, a)| a || !active)
            .map(|(name, _)| name)
            .collect()
    }

    /// The connected client (after the drain, when the database is back).
    fn client(&mut self) -> &mut pepsi::db::Client {
        self.must("SELECT 1::int8");
        self.client.as_mut().unwrap()
    }
}

/// A small deterministic generator for picking workers (its seed is printed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One scenario while it runs.
struct Run {
    fault: Fault,
    db: TestDb,
    conf: PathBuf,
    d: Dispatcher,
    monitor: Monitor,
    rng: Rng,
    /// The poison's id (the poison scenario).
    poison: Option<i64>,
    /// Every worker pid seen under any of the dispatchers.
    workers: HashSet<u32>,
    /// Dispatcher exits the test did not cause: (exit status, its last error line).
    exits: Vec<String>,
    /// How many of the fault's moments came before the drain ended.
    fired: usize,
    /// What the fault did, for the notes and the bound: workers killed while working,
    /// and others (none was working).
    busy_kills: i64,
    worker_kills: i64,
    dispatcher_kills: i64,
    restarts: Vec<Duration>,
    termination_rounds: i64,
    sessions_terminated: i64,
    connections_held: usize,
    connections_refused: usize,
    /// How long the connections were held exhausted, in all.
    exhausted: Duration,
}

/// What one scenario found.
struct Report {
    fault: Fault,
    lost: i64,
    stuck: i64,
    /// Outcomes committed more than once.
    duplicate_commits: i64,
    /// Second claims of a row at one stage: the only way a stage runs a message again.
    reclaims: i64,
    bound: i64,
    drain: Duration,
    notes: String,
    failures: Vec<String>,
}

#[test]
fn every_fault_drains_the_pipeline_with_nothing_lost_stuck_or_run_twice_unexplained() {
    let _cluster = cluster();
    let suite_started = Instant::now();
    let own_cluster = pg::is_throwaway();
    if own_cluster {
        lower_max_connections();
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("fault suite: {MESSAGES} messages a scenario, worker-kill seed {seed}");
    let mut reports: Vec<Report> = Vec::new();
    let mut skipped = Vec::new();
    for fault in Fault::ALL {
        if fault.needs_own_cluster() && !own_cluster {
            skipped.push(fault.name());
            continue;
        }
        let rng = Rng(seed ^ (fault as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let report = match std::panic::catch_unwind(AssertUnwindSafe(|| scenario(fault, rng))) {
            Ok(report) => report,
            Err(panic) => Report {
                fault,
                lost: -1,
                stuck: -1,
                duplicate_commits: -1,
                reclaims: -1,
                bound: 0,
                drain: Duration::ZERO,
                notes: "aborted".into(),
                failures: vec![format!("panicked: {}", panic_text(&panic))],
            },
        };
        println!("{}", row(&report, reports.first()));
        reports.push(report);
    }
    println!("\n{}", table(&reports));
    for name in &skipped {
        println!("skipped (needs the throwaway cluster, the tests use DATABASE_URL): {name}");
    }
    println!(
        "fault suite: {:.0} s in all",
        suite_started.elapsed().as_secs_f64()
    );
    let failures: Vec<String> = reports
        .iter()
        .flat_map(|r| {
            r.failures
                .iter()
                .map(move |f| format!("{}: {f}", r.fault.name()))
        })
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// `ALTER SYSTEM SET max_connections` needs a restart; this binary's cluster is its own.
fn lower_max_connections() {
    pg::admin()
        .batch_execute(&format!(
            "ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}"
        ))
        .unwrap();
    pg::restart(true).unwrap();
    let now: String = pg::admin()
        .query_one("SHOW max_connections", &[])
        .unwrap()
        .get(0);
    assert_eq!(now, MAX_CONNECTIONS.to_string());
}

/// The pipeline: `a` pass → `b` if → `c` (drop.example) or `d` (the rest), discards;
/// for the poison, `b` is the fault worker and sends everything to `c`.
fn config(dir: &TempDir, db: &TestDb, fault: Fault) -> PathBuf {
    write_config(dir, db, &pipeline(fault, ""))
}

/// The `[pepsi-dispatch]` and `[stage-*]` sections of [`config`]; `last` is added to
/// the sections of the last stages (`c`, `d`).
fn pipeline(fault: Fault, last: &str) -> String {
    let b = if fault == Fault::Poison {
        format!("PROGRAM = {}\nNEXT = c", fault_worker().to_str().unwrap())
    } else {
        format!(
            "PROGRAM = {}\nMATCH = sender-domain is drop.example\nNEXT = c\nELSE_STAGE = d",
            stage("if").display()
        )
    };
    let limits = format!("QUEUE_LIMIT = {QUEUE_LIMIT}\nPARALLELISM = {PARALLELISM}\nFUSION = no");
    format!(
        "[pepsi-dispatch]\nPOLL_INTERVAL = 1s\nSTATS_INTERVAL = 60s\nWORKER_IDLE_TIMEOUT = 1s\n\
         MAX_RUNTIME = 30s\n\n\
         [stage-a]\nPROGRAM = {pass}\nNEXT = b\n{limits}\n\n\
         [stage-b]\n{b}\n{limits}\n\n\
         [stage-c]\nPROGRAM = {discard}\n{limits}\n{last}\n\
         [stage-d]\nPROGRAM = {discard}\n{limits}\n{last}",
        pass = stage("pass").display(),
        discard = stage("discard").display(),
    )
}

fn scenario(fault: Fault, rng: Rng) -> Report {
    let db = TestDb::new();
    let dir = TempDir::new("faults");
    let conf = config(&dir, &db, fault);
    let mut c = db.client();
    c.batch_execute(INSTRUMENT).unwrap();
    let poison = if fault == Fault::Poison {
        // The poison sits in the middle of the claim order, among normal messages.
        let half = MESSAGES / 2;
        c.execute(INJECT, &[&half, &true]).unwrap();
        let id: i64 = c
            .query_one(
                "SELECT pepsi.workqueue_inject('a', 'f@x.example', ARRAY['r@y.example'], \
                 NULL, NULL, NULL, NULL, NULL, NULL, '{\"fault\": \"crash\"}'::jsonb)",
                &[],
            )
            .unwrap()
            .get(0);
        c.execute(INJECT, &[&(MESSAGES - half), &true]).unwrap();
        Some(id)
    } else {
        c.execute(INJECT, &[&MESSAGES, &false]).unwrap();
        None
    };
    drop(c);
    let started = Instant::now();
    let mut run = Run {
        fault,
        d: Dispatcher::start(&conf, &[]),
        monitor: Monitor {
            conninfo: db.conninfo.clone(),
            client: None,
        },
        db,
        conf,
        rng,
        poison,
        workers: HashSet::new(),
        exits: Vec::new(),
        fired: 0,
        busy_kills: 0,
        worker_kills: 0,
        dispatcher_kills: 0,
        restarts: Vec::new(),
        termination_rounds: 0,
        sessions_terminated: 0,
        connections_held: 0,
        exhausted: Duration::ZERO,
        connections_refused: 0,
    };
    run.drain(started);
    let drain = started.elapsed();
    run.judge(drain)
}

impl Run {
    /// Watches the drain to its end, striking at the fault's moments.
    fn drain(&mut self, started: Instant) {
        let mut moments = self.fault.moments().iter().peekable();
        let mut last_flip = Instant::now();
        loop {
            self.supervise();
            // Rows not yet done: a failed row is done with (the poison's end).
            let left = self
                .monitor
                .count("SELECT count(*) FROM pepsi.workqueue WHERE status <> 'failed'");
            if left == Some(0) {
                return;
            }
            if started.elapsed() > DRAIN_DEADLINE {
                panic!(
                    "the pipeline did not drain within {DRAIN_DEADLINE:?}: {}\nlog tail:\n{}",
                    self.queue_summary(),
                    tail(&self.d.log(), 30)
                );
            }
            if let Some(left) = left {
                let total = MESSAGES + i64::from(self.poison.is_some());
                let progress = 1.0 - left as f64 / total as f64;
                if moments.peek().is_some_and(|&&m| progress >= m) && self.strike() {
                    moments.next();
                    self.fired += 1;
                }
            }
            // A crash strike pauses its row for 1, then 2 minutes (§8.2): the drain
            // does not wait them out. A deferral (30 s, §8.4) is left as it is: its
            // cost shows in the drain time.
            if last_flip.elapsed() > Duration::from_millis(250) {
                self.monitor.count(
                    "WITH due AS (UPDATE pepsi.workqueue SET timeout = now() \
                      WHERE status = 'paused' AND state ? 'strikes' AND timeout > now() \
                      RETURNING 1) SELECT count(*) FROM due",
                );
                last_flip = Instant::now();
            }
            std::thread::sleep(TICK);
        }
    }

    /// Notes the workers, and restarts a dispatcher that exited without being told to
    /// (recording the exit).
    fn supervise(&mut self) {
        supervise(&mut self.d, &self.conf, &mut self.workers, &mut self.exits);
    }

    /// Strikes once; false when it could not yet (no worker to kill).
    fn strike(&mut self) -> bool {
        match self.fault {
            Fault::None | Fault::Poison => unreachable!("no moments"),
            Fault::KillWorkers => {
                let workers = self.d.children();
                if workers.is_empty() {
                    return false;
                }
                // A working worker when there is one: the dispatcher packs work onto
                // few workers, so a random one is often idle and the kill costs nothing.
                let busy_sessions = self.monitor.busy_workers();
                let busy: Vec<u32> = workers
                    .iter()
                    .copied()
                    .filter(|&pid| {
                        session_name_of(pid).is_some_and(|name| busy_sessions.contains(&name))
                    })
                    .collect();
                let pool = if busy.is_empty() { &workers } else { &busy };
                let victim = pool[(self.rng.next() % pool.len() as u64) as usize];
                // SAFETY: signalling a child of our own child.
                unsafe { libc::kill(victim as i32, libc::SIGKILL) };
                self.worker_kills += 1;
                self.busy_kills += i64::from(!busy.is_empty());
            }
            Fault::KillDispatcher => {
                self.workers.extend(self.d.children());
                self.d.signal(libc::SIGKILL);
                self.d.wait(Duration::from_secs(10));
                self.dispatcher_kills += 1;
                // A new one, as a service manager starts it: it takes the lock once
                // the dead one's session is gone and resets the orphaned rows.
                self.d = Dispatcher::start(&self.conf, &[]);
            }
            Fault::RestartPostgres => {
                let t = Instant::now();
                pg::restart(true).unwrap();
                self.restarts.push(t.elapsed());
            }
            Fault::TerminateSessions => {
                // Every session of the pipeline: the dispatcher's (and its lock with
                // it), its listener's, every worker's.
                let n = self.monitor.count(
                    "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid() \
                       AND backend_type = 'client backend'",
                );
                let Some(n) = n else { return false };
                self.sessions_terminated += n;
                self.termination_rounds += 1;
            }
            Fault::ExhaustConnections => self.exhaust(),
        }
        true
    }

    /// Opens connections until the server refuses, keeps it full for
    /// [`EXHAUSTION`] (a connection a dying worker frees is taken at once), releases.
    fn exhaust(&mut self) {
        // The monitor's own connection stays open: it is the test's.
        self.monitor.must("SELECT 1::int8");
        let mut held: Vec<Client> = Vec::new();
        let started = Instant::now();
        let until = started + EXHAUSTION;
        while Instant::now() < until {
            loop {
                match Client::connect(&self.db.conninfo, NoTls) {
                    Ok(c) => held.push(c),
                    Err(e) if e.code() == Some(&SqlState::TOO_MANY_CONNECTIONS) => {
                        self.connections_refused += 1;
                        break;
                    }
                    Err(e) => panic!("exhausting the connections: {e}"),
                }
                assert!(
                    held.len() <= MAX_CONNECTIONS as usize,
                    "more connections than max_connections"
                );
            }
            self.connections_held = self.connections_held.max(held.len());
            self.workers.extend(self.d.children());
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(held);
        self.exhausted += started.elapsed();
    }

    /// Rows per stage and status, for a failure message.
    fn queue_summary(&mut self) -> String {
        let Some(c) = self.monitor.client.as_mut() else {
            return "(no database connection)".into();
        };
        c.query(
            "SELECT stage, status::text, count(*) FROM pepsi.workqueue GROUP BY 1, 2 ORDER BY 1, 2",
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| {
                    format!(
                        "{} {} {}",
                        r.get::<_, String>(0),
                        r.get::<_, String>(1),
                        r.get::<_, i64>(2)
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_else(|e| e.to_string())
    }

    /// After the drain: quiescence, then every check.
    fn judge(mut self, drain: Duration) -> Report {
        let mut failures = Vec::new();
        failures.extend(quiesce(
            &mut self.d,
            &self.conf,
            &mut self.workers,
            &mut self.exits,
        ));
        let drained = Drained::read(&mut self.monitor, self.poison);
        let mut notes = self.fault_notes();
        if !notes.is_empty() {
            notes.push_str("; ");
        }
        notes.push_str(&drained.given_back());
        // The poison: failed at b as crashed after three strikes, and every second run
        // of another message is one it shared a worker with.
        let mut poison_claims = 0;
        if let Some(id) = self.poison {
            let c = self.monitor.client();
            let row = c
                .query_opt(
                    "SELECT stage, status::text, state->>'failure_class', \
                            (state->>'strikes')::int8, state->>'failed_stage' \
                       FROM pepsi.workqueue WHERE workqueue_id = $1",
                    &[&id],
                )
                .unwrap();
            let got = row.map(|r| {
                (
                    r.get::<_, String>(0),
                    r.get::<_, String>(1),
                    r.get::<_, Option<String>>(2),
                    r.get::<_, Option<i64>>(3),
                    r.get::<_, Option<String>>(4),
                )
            });
            let want = (
                "b".to_string(),
                "failed".to_string(),
                Some("crashed".to_string()),
                Some(3),
                Some("b".to_string()),
            );
            if got.as_ref() != Some(&want) {
                failures.push(format!(
                    "the poison is {got:?}, not failed crashed at b after 3 strikes"
                ));
            }
            poison_claims = c
                .query_one(
                    "SELECT count(*) FROM public.fault_log \
                      WHERE id = $1 AND kind = 'claim' AND stage = 'b'",
                    &[&id],
                )
                .unwrap()
                .get(0);
            // Each strike needs a run alone, and each run alone may follow one run in a
            // batch whose death named nobody (§8.2 "Batches").
            if !(3..=6).contains(&poison_claims) {
                failures.push(format!(
                    "the poison was claimed at b {poison_claims} times, not 3 to 6"
                ));
            }
            let _ = write!(notes, "; poison claimed {poison_claims}× at b");
        }
        let bound = self.bound(poison_claims);
        let status = self.d.terminate();
        if !status.success() {
            failures.push(format!(
                "the last dispatcher did not shut down cleanly: {status}\n{}",
                tail(&self.d.log(), 30)
            ));
        }
        let survivors: Vec<u32> = self.workers.iter().copied().filter(|&p| alive(p)).collect();
        if !survivors.is_empty() {
            failures.push(format!(
                "worker processes outlived their dispatcher: {survivors:?}"
            ));
        }
        failures.extend(drained.failures());
        let reclaims = drained.reclaims;
        let mut check = |ok: bool, what: String| {
            if !ok {
                failures.push(what);
            }
        };
        check(
            reclaims <= bound,
            format!("{reclaims} second runs of a stage, more than the fault explains ({bound})"),
        );
        check(
            self.fired == self.fault.moments().len(),
            format!(
                "the drain ended after {} of the fault's {} strikes",
                self.fired,
                self.fault.moments().len()
            ),
        );
        if self.fault == Fault::ExhaustConnections {
            check(
                self.connections_refused > 0,
                "the server never refused a connection: not exhausted".into(),
            );
        }
        let exits_allowed = self.fault.is_outage() && !DISPATCHER_MUST_SURVIVE_OUTAGES;
        check(
            self.exits.is_empty() || exits_allowed,
            format!("the dispatcher exited: {:?}", self.exits),
        );
        Report {
            fault: self.fault,
            lost: drained.lost,
            stuck: drained.stuck,
            duplicate_commits: drained.duplicate_commits,
            reclaims,
            bound,
            drain,
            notes,
            failures,
        }
    }

    /// How many second claims of a row at one stage the fault explains. A second
    /// claim is the only way a stage can run a message again; it is an upper bound on
    /// second runs (a row given back before it reached a worker is claimed again
    /// without having run). Any dispatcher that exited and was restarted adds
    /// [`CAPACITY`].
    fn bound(&self, poison_claims: i64) -> i64 {
        let exits = self.exits.len() as i64 * CAPACITY;
        exits
            + match self.fault {
                Fault::None => 0,
                // A working (so ready) worker held at most QUEUE_LIMIT ids; another
                // may have been still starting, and gives back every claim waiting for
                // its stage (§8.1).
                Fault::KillWorkers => {
                    self.busy_kills * QUEUE_LIMIT
                        + (self.worker_kills - self.busy_kills) * STAGE_CAPACITY
                }
                // Everything in flight, once per death.
                Fault::KillDispatcher => self.dispatcher_kills * CAPACITY,
                // The lock is lost with the connection: everything in flight, once.
                Fault::RestartPostgres => self.restarts.len() as i64 * CAPACITY,
                Fault::TerminateSessions => self.termination_rounds * CAPACITY,
                // No worker can start: each stage gives back what it holds at most once
                // per cooldown (a worker's own 75 gives back one id, and waits out its
                // pool's checkout timeout first).
                Fault::ExhaustConnections => {
                    // Over the time the connections were in fact held, which a busy
                    // machine makes longer than EXHAUSTION.
                    let held = self.exhausted.as_secs_f64() / COOLDOWN_FIRST.as_secs_f64();
                    let episodes = 1 + held.ceil() as i64;
                    CAPACITY * episodes
                }
                // Every claim of the poison at b crashed a worker holding at most
                // QUEUE_LIMIT ids, the poison's included.
                Fault::Poison => poison_claims * QUEUE_LIMIT,
            }
    }

    /// What the fault did, in words.
    fn fault_notes(&self) -> String {
        let mut notes = match self.fault {
            Fault::None => String::new(),
            Fault::KillWorkers => format!(
                "{} workers killed ({} while working)",
                self.worker_kills, self.busy_kills
            ),
            Fault::KillDispatcher => format!("{} dispatcher kills", self.dispatcher_kills),
            Fault::RestartPostgres => format!(
                "restart took {}",
                self.restarts
                    .iter()
                    .map(|d| format!("{:.1} s", d.as_secs_f64()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Fault::TerminateSessions => format!(
                "{} rounds, {} sessions",
                self.termination_rounds, self.sessions_terminated
            ),
            Fault::ExhaustConnections => format!(
                "{} held {:.1} s, {} refused",
                self.connections_held,
                self.exhausted.as_secs_f64(),
                self.connections_refused
            ),
            Fault::Poison => String::new(),
        };
        if !self.exits.is_empty() {
            let _ = write!(
                notes,
                "; dispatcher exited {}× and was restarted (first: {})",
                self.exits.len(),
                self.exits[0]
            );
        }
        notes
    }
}

/// The last `n` lines of a log.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

const HEADER: &str = "fault                    | lost | stuck | duplicates: commits / claims ≤ bound | drain s | vs baseline | notes";

/// One line of the suite's table, whoever measured it.
struct TableRow<'a> {
    name: &'a str,
    lost: i64,
    stuck: i64,
    duplicate_commits: i64,
    reclaims: i64,
    bound: i64,
    drain: Duration,
    /// The fault-free drain it is compared with.
    baseline: Option<Duration>,
    notes: &'a str,
    failed: bool,
}

impl TableRow<'_> {
    fn line(&self) -> String {
        let vs = match self.baseline {
            Some(b) if b > Duration::ZERO && self.drain > Duration::ZERO => {
                format!("×{:.1}", self.drain.as_secs_f64() / b.as_secs_f64())
            }
            _ => "—".into(),
        };
        let verdict = if self.failed { " FAILED" } else { "" };
        format!(
            "{:<24} | {:>4} | {:>5} | {:>35} | {:>7.1} | {:>11} | {}{verdict}",
            self.name,
            self.lost,
            self.stuck,
            format!(
                "{} / {} ≤ {}",
                self.duplicate_commits, self.reclaims, self.bound
            ),
            self.drain.as_secs_f64(),
            vs,
            self.notes
        )
    }
}

/// The table's header and its rule.
fn table_head() -> String {
    format!("{HEADER}\n{}", "-".repeat(HEADER.chars().count()))
}

/// One line of the table.
fn row(r: &Report, baseline: Option<&Report>) -> String {
    TableRow {
        name: r.fault.name(),
        lost: r.lost,
        stuck: r.stuck,
        duplicate_commits: r.duplicate_commits,
        reclaims: r.reclaims,
        bound: r.bound,
        drain: r.drain,
        baseline: baseline.map(|b| b.drain),
        notes: &r.notes,
        failed: !r.failures.is_empty(),
    }
    .line()
}

fn table(reports: &[Report]) -> String {
    let mut out = table_head();
    for r in reports {
        out.push('\n');
        out.push_str(&row(r, reports.first()));
    }
    out.push_str(
        "\nlost: messages that never reached their end stage; stuck: rows left running; \
         duplicates: stage outcomes committed twice / second claims of a row at one stage \
         (the only way a stage runs a message again) ≤ what the fault explains; \
         given back: returns of running rows (by the dispatcher or a restart's reset)",
    );
    out
}

/// The role the failure bouncer connects as in its restart test, a member of
/// `pepsi_admin` as the bouncer's login role is: its LOGIN is taken away to keep the
/// bouncer out after the restart for as long as the test needs.
const BOUNCER_ROLE: &str = "pepsi_fault_bouncer";

/// Fails a message at stage `a` as a worker does (claimed, then failed).
fn fail_one(c: &mut Client) -> i64 {
    let id = inject(c, "a", "s@x.example", &["r@y.example"]);
    claim(c, &[id]);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    id
}

/// How long a failed message may take to reach the bounce stage on its notification:
/// it takes milliseconds; the margin is a busy machine's. Far below the minute after
/// which the bouncer's safety-net sweep would move it anyway, so a message moved within
/// it was moved on its notification.
const NOTIFIED: Duration = Duration::from_secs(10);

/// Waits until message `id` is pending at the bounce stage; returns how long it took.
#[track_caller]
fn bounced(c: &mut Client, id: i64, within: Duration, log: impl Fn() -> String) -> Duration {
    let started = Instant::now();
    while row_at(c, id) != Some(("bounce".into(), "pending".into())) {
        assert!(
            started.elapsed() < within,
            "message {id} not at the bounce stage within {within:?}: {:?}; log:\n{}",
            row_at(c, id),
            log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    started.elapsed()
}

#[test]
fn the_failure_bouncer_rides_out_a_postgres_restart_and_sweeps_what_failed_meanwhile() {
    let _cluster = cluster();
    if !pg::is_throwaway() {
        println!("skipped (needs the throwaway cluster, the tests use DATABASE_URL)");
        return;
    }
    let db = TestDb::new();
    let mut c = db.client();
    // Roles are the cluster's: it may exist from an earlier run.
    c.batch_execute(&format!(
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{BOUNCER_ROLE}') THEN
                 CREATE ROLE {BOUNCER_ROLE} LOGIN;
             END IF;
         END $$;
         ALTER ROLE {BOUNCER_ROLE} LOGIN;
         GRANT pepsi_admin TO {BOUNCER_ROLE};"
    ))
    .unwrap();
    let dir = TempDir::new("faults-bouncer");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {} user={BOUNCER_ROLE}\n\n\
             [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n\
             [stage-a]\nPROGRAM = {pass}\nNEXT = bounce\n\n\
             [stage-bounce]\nPROGRAM = {pass}\n",
            db.conninfo,
            pass = stage("pass").display(),
        ),
    );
    let mut b = Bouncer::ready(&conf, &[]);
    let first = fail_one(&mut c);
    bounced(&mut c, first, NOTIFIED, || b.log());

    // One failing just before the restart: moved before it or swept after it.
    let before = fail_one(&mut c);
    // Kept out after the restart (its open session is not affected by this), so that
    // a message fails while it is away for sure.
    c.batch_execute(&format!("ALTER ROLE {BOUNCER_ROLE} NOLOGIN"))
        .unwrap();
    drop(c);
    pg::restart(true).unwrap();
    let mut c = db.client();
    let during = fail_one(&mut c);
    b.wait_log("the database connection is lost", Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        row_at(&mut c, during),
        Some(("a".into(), "failed".into())),
        "the bouncer cannot have moved it yet; log:\n{}",
        b.log()
    );
    assert!(b.try_wait().is_none(), "it exited:\n{}", b.log());

    // Let in again: it reconnects (within its 5 s backoff) and sweeps, although the
    // notifications were lost.
    c.batch_execute(&format!("ALTER ROLE {BOUNCER_ROLE} LOGIN"))
        .unwrap();
    bounced(&mut c, during, Duration::from_secs(30), || b.log());
    bounced(&mut c, before, NOTIFIED, || b.log());
    b.wait_log("database connection re-established", Duration::from_secs(5));

    // And it listens again: the next failure is moved on its notification, long
    // before the next sweep.
    let after = fail_one(&mut c);
    let took = bounced(&mut c, after, NOTIFIED, || b.log());
    println!("failure bouncer: moved {after} {took:?} after it failed, after the restart");
    assert_eq!(b.terminate().code(), Some(0), "{}", b.log());
    let log = b.log();
    assert_eq!(
        log.matches("the database connection is lost").count()
            + log.matches("the database is not available").count(),
        1,
        "one outage line a minute at most:\n{log}"
    );
}

/// Starts this binary's cluster again when dropped, should a test that stopped it fail
/// before it started it again itself (then pg_ctl refuses, which is fine).
struct StartsAgain;

impl Drop for StartsAgain {
    fn drop(&mut self) {
        let _ = pg::start_again();
    }
}

#[test]
fn the_ingress_answers_451_while_postgres_is_stopped_and_250_again_once_it_is_back() {
    let _cluster = cluster();
    if !pg::is_throwaway() {
        println!("skipped (needs the throwaway cluster, the tests use DATABASE_URL)");
        return;
    }
    let db = TestDb::new();
    let dir = TempDir::new("faults-ingress");
    let target = format!("127.0.0.1:{}", ingress::free_port());
    let conf = write_config(
        &dir,
        &db,
        &format!(
            "[pepsi-ingress]\n{}\n{}",
            ingress::section(&format!("lmtp:{target}"), ""),
            programs(ingress::PIPELINE)
        ),
    );
    let mut daemon = Ingress::start(&conf);
    assert_eq!(
        ingress::data_codes(&ingress::send_lmtp(&target, &["r@y.example"])),
        [250]
    );

    let _starts_again = StartsAgain;
    pg::stop().unwrap();
    let away = ingress::send_lmtp(&target, &["r1@y.example", "r2@y.example"]);
    assert_eq!(ingress::data_codes(&away), [451, 451], "{away}");
    for reply in away["data"].as_array().unwrap() {
        assert!(reply[1].as_str().unwrap().starts_with("4.3.0 "), "{away}");
    }
    assert!(daemon.try_wait().is_none(), "it exited:\n{}", daemon.log());

    pg::start_again().unwrap();
    let back = Instant::now();
    // Messages answered 451 meanwhile (the daemon retries its connection from 250 ms,
    // doubling up to 5 s).
    let mut deferred = 1;
    wait_until(
        Duration::from_secs(15),
        "a message is accepted again",
        || {
            let out = ingress::send_lmtp(&target, &["r@y.example"]);
            let codes = ingress::data_codes(&out);
            assert!(codes == [451] || codes == [250], "{out}");
            deferred += usize::from(codes == [451]);
            codes == [250]
        },
    );
    println!(
        "ingress: accepting again {:?} after PostgreSQL was started again ({deferred} messages deferred)",
        back.elapsed()
    );
    let mut c = db.client();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2, "the deferred messages left no row");
    assert!(daemon.terminate().success(), "{}", daemon.log());
    // Written at shutdown, over the connection it made again.
    let (accepted, counted): (i64, i64) = c
        .query_one("SELECT accepted, deferred FROM pepsi.ingress_stats", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!((accepted, counted), (2, deferred as i64));
    let log = daemon.log();
    assert_has!(log, "deferring mail (451)");
    assert_has!(log, "the database is back");
}
