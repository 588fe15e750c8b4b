//! Failover: the suite's pipeline against a primary and a streaming
//! standby of its own ([`Pair`]), through the connection string that names both and
//! asks for the one that takes writes. At 30 % of the drain every process of the
//! primary gets SIGKILL; 2 s later the standby is promoted. The dispatcher must ride it
//! out (it never exits), and on the promoted node nothing is lost, nothing is left
//! running, and every committed outcome is there exactly once and in order.
//!
//! What the killed primary had committed that the standby never received is read
//! afterwards from its data directory, started alone on a socket no connection string
//! names: those stage executions ran again on the promoted node. The last stage (`c`,
//! `d`, discards) records each execution, with the commit that records its outcome, on a
//! side table (`public.last_stage_runs`, one row per deleted message with a random
//! execution id), so a message whose last stage ran twice has two execution ids across
//! the two data directories.
//!
//! A third run freezes the primary instead (SIGSTOP to every process: a storage freeze,
//! a paused virtual machine, a partition behind which it still accepts connections):
//! it is left frozen until the drain is over, then killed. Every program must leave it
//! by its own deadlines (§8.4 "A server that hangs"): the first stage advance on
//! the promoted node must come within [`ADVANCE_BOUND`] of the promotion, every stage
//! must advance messages there, and `pepsi-queue status` run during the freeze must
//! answer (from the promoted node) or exit 75, within [`QUEUE_BOUND`].
//!
//! Two runs: asynchronous replication with today's default (the workers commit with
//! `synchronous_commit = off`), where the re-runs are a figure; and synchronous
//! replication with `SYNCHRONOUS_COMMIT = on` on the last stages, where no acknowledged
//! last-stage commit may be lost. A commit that is only on the old primary in that run
//! can only be one its worker was still waiting for (flushed locally, not yet by the
//! standby) when the primary died: it is told apart by its session (each session waits
//! on every synchronous commit, so at most its last transaction can be missing from the
//! standby) and reported, never counted as acknowledged. `PEPSI_FAILOVER_SYNC_RUNS=N`
//! repeats the synchronous run N times (default 1).
//!
//! ```text
//! cargo test --test faults failover -- --nocapture
//! ```
//!
//! Figures, printed, never asserted: time from the promotion to the first stage
//! advance, stage executions re-run because of the replication window (all stages, and
//! messages whose last stage ran twice), WAL the standby never received, and the drain
//! time against a fault-free drain on the same pair.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::util::TempDir;
use super::util::dispatcher::{Dispatcher, alive};
use super::util::replica::{Node, Pair, server_binaries};
use super::{
    CAPACITY, DRAIN_DEADLINE, Drained, Fault, INJECT, INSTRUMENT, MESSAGES, Monitor, TICK,
    TableRow, cluster, panic_text, pipeline, quiesce, supervise, table_head, tail,
};

/// The share of the drain done when the primary is killed.
const KILL_AT: f64 = 0.3;
/// From the kill to the promotion (a failover manager's detection time).
const PROMOTE_AFTER: Duration = Duration::from_secs(2);
/// How many synchronous runs (default 1).
const SYNC_RUNS_ENV: &str = "PEPSI_FAILOVER_SYNC_RUNS";
/// How many asynchronous runs with the primary killed (default 1; the first measures
/// the baseline too).
const KILL_RUNS_ENV: &str = "PEPSI_FAILOVER_KILL_RUNS";
/// How many frozen-primary runs (default 1).
const FROZEN_RUNS_ENV: &str = "PEPSI_FAILOVER_FROZEN_RUNS";
/// With the primary frozen: the longest time from the promotion to the first stage
/// advance on the promoted node. A wait on the frozen host has it probed after half a
/// second and given up 2 s later (0.22–0.39 s were measured from the promotion); the
/// rest is a busy machine's margin. Without the probe the claims would wait out their
/// statement timeout (10 s and the grace), and new connections `connect_timeout`
/// (10 s), so the bound still tells the two apart.
const ADVANCE_BOUND: Duration = Duration::from_secs(5);
/// With the primary frozen: the longest `pepsi-queue status` may take (a new process
/// knows nothing of the frozen host: its first connection ends when a probe of the
/// host goes unanswered, 2.5 s, or at `connect_timeout`, 10 s, and then the promoted
/// node answers).
const QUEUE_BOUND: Duration = Duration::from_secs(15);

/// How the primary is taken away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// SIGKILL to every process.
    Kill,
    /// SIGSTOP to every process, SIGKILL once the drain is over.
    Freeze,
}

/// Beside the suite's trace ([`INSTRUMENT`]): an execution id and the time on every
/// `fault_log` row, and the last stage's executions: one row per message deleted (its
/// last stage's outcome), written by the deleting transaction, with the session and
/// transaction that committed it and the session's `synchronous_commit`.
const RUNS: &str = "
ALTER TABLE public.fault_log
    ADD COLUMN exec uuid NOT NULL DEFAULT gen_random_uuid(),
    ADD COLUMN at timestamptz NOT NULL DEFAULT clock_timestamp();
CREATE TABLE public.last_stage_runs (
    exec uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    id bigint NOT NULL, stage text NOT NULL, claim bigint,
    pid int NOT NULL DEFAULT pg_backend_pid(),
    xid text NOT NULL DEFAULT pg_current_xact_id()::text,
    sync text NOT NULL DEFAULT current_setting('synchronous_commit'),
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION public.last_stage_run() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
BEGIN
    INSERT INTO public.last_stage_runs (id, stage, claim)
    VALUES (OLD.workqueue_id, OLD.stage, OLD.claim);
    RETURN NULL;
END $$;
CREATE TRIGGER last_stage_run AFTER DELETE ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION public.last_stage_run();
";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Asynchronous replication, the workers' default commit.
    Async,
    /// Synchronous replication, `SYNCHRONOUS_COMMIT = on` on the last stages.
    Sync,
}

impl Mode {
    /// The mode in the suite's 24-character fault column.
    fn name(self) -> &'static str {
        match self {
            Mode::Async => "async",
            Mode::Sync => "sync",
        }
    }

    /// The mode in words.
    fn describe(self) -> &'static str {
        match self {
            Mode::Async => "async replication",
            Mode::Sync => "sync replication, SYNCHRONOUS_COMMIT = on",
        }
    }

    /// What the last stages' sections say.
    fn last_stage(self) -> &'static str {
        match self {
            Mode::Async => "",
            Mode::Sync => "SYNCHRONOUS_COMMIT = on\n",
        }
    }

    /// The `synchronous_commit` the last stage's sessions must have run with.
    fn last_stage_commit(self) -> &'static str {
        match self {
            Mode::Async => "off",
            Mode::Sync => "on",
        }
    }
}

/// One line of the table.
struct Line {
    name: String,
    lost: i64,
    stuck: i64,
    duplicate_commits: i64,
    reclaims: i64,
    bound: i64,
    drain: Duration,
    baseline: Option<Duration>,
    notes: String,
    failures: Vec<String>,
    figures: Option<Figures>,
}

/// A failover run's figures.
#[derive(Clone)]
struct Figures {
    mode: Mode,
    /// How the primary was taken away.
    cut: Cut,
    /// From the promotion's start to the first stage outcome committed on the
    /// promoted node.
    promotion_to_advance: Option<Duration>,
    /// How long `pg_ctl promote -w` took.
    promotion: Duration,
    /// Stage outcomes committed on the old primary only (each ran again).
    reruns: usize,
    /// Messages whose last stage ran on both nodes.
    last_stage_twice: usize,
    /// Of those, commits the worker was still waiting for (sync run).
    unacknowledged: usize,
    /// WAL bytes (and commit records) the standby never received.
    wal_lost: (u64, usize),
}

#[test]
fn failover_to_a_promoted_standby_loses_nothing_and_with_synchronous_commit_runs_no_last_stage_twice()
 {
    // One at a time with the suite's scenarios: their drain times are figures, and two
    // cores do not run two pipelines without skewing both.
    let _cluster = cluster();
    if let Err(e) = server_binaries() {
        // The pair is the test's own, also when the other tests use DATABASE_URL; on a
        // machine with only that server (no server binaries) it cannot run.
        let external = ["PEPSI_TEST_DATABASE_URL", "DATABASE_URL"]
            .iter()
            .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()));
        if external {
            println!("skipped (needs PostgreSQL's server binaries for a pair of its own): {e}");
            return;
        }
        panic!("{e}");
    }
    let started = Instant::now();
    let sync_runs: usize = std::env::var(SYNC_RUNS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let frozen_runs: usize = std::env::var(FROZEN_RUNS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    println!(
        "failover: {MESSAGES} messages a run, the primary SIGKILLed (or frozen) at {:.0} % of \
         the drain, the standby promoted {} s later; {sync_runs} synchronous run(s), \
         {frozen_runs} frozen-primary run(s)",
        KILL_AT * 100.0,
        PROMOTE_AFTER.as_secs()
    );
    let mut lines: Vec<Line> = Vec::new();
    let kill_runs: usize = std::env::var(KILL_RUNS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut plan: Vec<(Mode, Cut, bool)> = (0..kill_runs)
        .map(|i| (Mode::Async, Cut::Kill, i == 0))
        .collect();
    plan.extend((0..sync_runs).map(|i| (Mode::Sync, Cut::Kill, i == 0)));
    plan.extend((0..frozen_runs).map(|_| (Mode::Async, Cut::Freeze, false)));
    let mut baselines: HashMap<&str, Duration> = HashMap::new();
    for (mode, cut, with_baseline) in plan {
        let baseline = baselines.get(mode.name()).copied();
        let got =
            std::panic::catch_unwind(AssertUnwindSafe(|| run(mode, cut, with_baseline, baseline)));
        let got = got.unwrap_or_else(|panic| {
            vec![Line {
                name: failover_name(mode, cut),
                lost: -1,
                stuck: -1,
                duplicate_commits: -1,
                reclaims: -1,
                bound: 0,
                drain: Duration::ZERO,
                baseline: None,
                notes: "aborted".into(),
                failures: vec![format!("panicked: {}", panic_text(&panic))],
                figures: None,
            }]
        });
        for line in got {
            if line.figures.is_none() && line.failures.is_empty() {
                baselines.insert(mode.name(), line.drain);
            }
            println!("{}", row(&line));
            lines.push(line);
        }
    }
    println!("\n{}", table(&lines));
    println!("failover: {:.0} s in all", started.elapsed().as_secs_f64());
    let failures: Vec<String> = lines
        .iter()
        .flat_map(|l| l.failures.iter().map(move |f| format!("{}: {f}", l.name)))
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// A failover run's name in the table.
fn failover_name(mode: Mode, cut: Cut) -> String {
    match cut {
        Cut::Kill => format!("failover, {}", mode.name()),
        Cut::Freeze => format!("frozen primary, {}", mode.name()),
    }
}

/// A pair set up for `mode`, a fault-free drain on it when `with_baseline`, then the
/// failover drain with the primary taken away by `cut`.
fn run(mode: Mode, cut: Cut, with_baseline: bool, baseline: Option<Duration>) -> Vec<Line> {
    let pair = Pair::start().unwrap_or_else(|e| panic!("cannot start the pair: {e}"));
    {
        let mut c = pepsi::db::Client::unwatched(pair.primary.client().unwrap());
        pepsi::db::schema::install(&mut c).unwrap();
        c.batch_execute(INSTRUMENT).unwrap();
        c.batch_execute(RUNS).unwrap();
    }
    pair.start_standby().unwrap();
    if mode == Mode::Sync {
        pair.make_synchronous().unwrap();
    }
    let dir = TempDir::new("failover");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n{}",
            pair.multi_host(),
            pipeline(Fault::None, mode.last_stage())
        ),
    );
    let mut lines = Vec::new();
    let mut baseline = baseline;
    if with_baseline {
        let mut drain = Drain::start(&pair, &conf, mode, None);
        drain.watch();
        let line = drain.judge(None);
        baseline = Some(line.drain);
        lines.push(line);
        let mut c = pair.primary.client().unwrap();
        c.batch_execute("TRUNCATE public.fault_injected, public.fault_log, public.last_stage_runs")
            .unwrap();
    }
    let mut drain = Drain::start(&pair, &conf, mode, Some(cut));
    drain.watch();
    let line = drain.judge(baseline);
    lines.push(line);
    lines
}

/// One drain of [`MESSAGES`] through the pair.
struct Drain<'a> {
    pair: &'a Pair,
    conf: PathBuf,
    mode: Mode,
    /// How the primary is taken away (`None`: a fault-free drain).
    cut: Option<Cut>,
    d: Dispatcher,
    monitor: Monitor,
    started: Instant,
    /// Every worker pid seen.
    workers: HashSet<u32>,
    /// Exits of the dispatcher (none may happen).
    exits: Vec<String>,
    /// When the primary was killed, at what share of the drain, how many processes.
    killed: Option<Instant>,
    kill_notes: String,
    /// The standby's `sync_state` just before the kill.
    sync_state: Option<String>,
    /// The standby's last received WAL position before its promotion.
    received: Option<String>,
    /// When the promotion started (wall clock, to compare with the database's) and
    /// how long it took.
    promoted: Option<(SystemTime, Duration)>,
    /// With the primary frozen: `pepsi-queue status` during the freeze, its exit code,
    /// how long it took and what it printed.
    queue_status: Option<(Option<i32>, Duration, String)>,
}

impl<'a> Drain<'a> {
    /// Injects the messages (replicated before the dispatcher starts) and starts the
    /// dispatcher.
    fn start(pair: &'a Pair, conf: &std::path::Path, mode: Mode, cut: Option<Cut>) -> Drain<'a> {
        let mut c = pair.primary.client().unwrap();
        c.execute(INJECT, &[&MESSAGES, &false]).unwrap();
        drop(c);
        pair.wait_caught_up().unwrap();
        let started = Instant::now();
        Drain {
            pair,
            conf: conf.to_path_buf(),
            mode,
            cut,
            d: Dispatcher::start(conf, &[]),
            monitor: Monitor {
                conninfo: pair.multi_host(),
                client: None,
            },
            started,
            workers: HashSet::new(),
            exits: Vec::new(),
            killed: None,
            kill_notes: String::new(),
            sync_state: None,
            received: None,
            promoted: None,
            queue_status: None,
        }
    }

    fn name(&self) -> String {
        match self.cut {
            Some(cut) => failover_name(self.mode, cut),
            None => format!("none, {} (baseline)", self.mode.name()),
        }
    }

    /// Watches the drain to its end, killing the primary and promoting the standby on
    /// the way in a failover run.
    fn watch(&mut self) {
        loop {
            self.supervise();
            let left = self.monitor.count("SELECT count(*) FROM pepsi.workqueue");
            if left == Some(0) && (self.cut.is_none() || self.promoted.is_some()) {
                return;
            }
            if self.started.elapsed() > DRAIN_DEADLINE {
                panic!(
                    "the pipeline did not drain within {DRAIN_DEADLINE:?}\nlog tail:\n{}",
                    tail(&self.d.log(), 40)
                );
            }
            if let Some(cut) = self.cut {
                if let (Some(left), None) = (left, self.killed) {
                    let done = 1.0 - left as f64 / MESSAGES as f64;
                    if done >= KILL_AT {
                        // The replication the commits just before the kill had.
                        self.sync_state = self.pair.sync_state().ok();
                        let (processes, what) = match cut {
                            Cut::Kill => (self.pair.kill_primary().unwrap(), "killed"),
                            Cut::Freeze => (self.pair.freeze_primary().unwrap(), "frozen"),
                        };
                        self.killed = Some(Instant::now());
                        self.kill_notes = format!(
                            "{what} at {:.0} % ({processes} processes) after {:.1} s; ",
                            done * 100.0,
                            self.started.elapsed().as_secs_f64()
                        );
                    }
                }
                if let (Some(killed), None) = (self.killed, self.promoted) {
                    if killed.elapsed() >= PROMOTE_AFTER {
                        // What the standby has by now is all it will ever get.
                        self.received = Some(self.pair.standby_received().unwrap());
                        let wall = SystemTime::now();
                        let t = Instant::now();
                        self.pair.promote().unwrap();
                        self.promoted = Some((wall, t.elapsed()));
                        if cut == Cut::Freeze {
                            self.queue_status = Some(queue_status(&self.conf));
                        }
                    }
                }
            }
            std::thread::sleep(TICK);
        }
    }

    /// Notes the workers; a dispatcher that exited is recorded (a failure) and started
    /// again, so that the rest can still be measured.
    fn supervise(&mut self) {
        supervise(&mut self.d, &self.conf, &mut self.workers, &mut self.exits);
    }

    /// Quiescence, the suite's checks on the node that takes writes, and for a
    /// failover the old primary's data directory read alone.
    fn judge(mut self, baseline: Option<Duration>) -> Line {
        let drain = self.started.elapsed();
        let mut failures = Vec::new();
        failures.extend(quiesce(
            &mut self.d,
            &self.conf,
            &mut self.workers,
            &mut self.exits,
        ));
        let drained = Drained::read(&mut self.monitor, None);
        failures.extend(drained.failures());
        let m = &mut self.monitor;
        // Each message's last stage, as the node that takes writes recorded it: once.
        let runs_here = m.must(
            "SELECT count(*) FROM (SELECT id FROM public.last_stage_runs \
              GROUP BY id HAVING count(*) > 1) s",
        );
        let other_commit = m.must(&format!(
            "SELECT count(*) FROM public.last_stage_runs WHERE sync <> '{}'",
            self.mode.last_stage_commit()
        ));
        let mut check = |ok: bool, what: String| {
            if !ok {
                failures.push(what);
            }
        };
        check(
            runs_here == 0,
            format!("{runs_here} messages whose last stage committed twice on one node"),
        );
        check(
            other_commit == 0,
            format!(
                "{other_commit} last-stage executions did not run with synchronous_commit = {}",
                self.mode.last_stage_commit()
            ),
        );
        if self.cut.is_some() {
            let want = match self.mode {
                Mode::Async => "async",
                Mode::Sync => "sync",
            };
            check(
                self.sync_state.as_deref() == Some(want),
                format!(
                    "the standby was {:?} just before the kill, not {want}",
                    self.sync_state
                ),
            );
        }
        check(
            self.exits.is_empty(),
            format!("the dispatcher exited: {:?}", self.exits),
        );
        let mut notes = String::new();
        let mut bound = 0;
        let mut figures = None;
        if let Some(cut) = self.cut {
            if cut == Cut::Freeze {
                let checked = self.freeze_checks(&mut notes);
                failures.extend(checked);
            }
            match self.failover_figures() {
                Ok((f, more_failures)) => {
                    // Everything in flight when the lock went (once), and every outcome
                    // lost with the old primary's WAL (its row was claimed again).
                    bound = CAPACITY + f.reruns as i64;
                    failures.extend(more_failures);
                    notes.push_str(&self.kill_notes);
                    if let Some((code, took, _)) = &self.queue_status {
                        let _ = write!(
                            notes,
                            "pepsi-queue status during the freeze: exit {} after {:.1} s; ",
                            code.map_or("none (killed)".into(), |c| c.to_string()),
                            took.as_secs_f64()
                        );
                    }
                    let _ = write!(
                        notes,
                        "promotion → first advance {}; re-run {} stage executions, last stage \
                         of {} messages ({} unacknowledged); {:.1} KB WAL ({} commits) not \
                         at the standby; ",
                        f.promotion_to_advance
                            .map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64())),
                        f.reruns,
                        f.last_stage_twice,
                        f.unacknowledged,
                        f.wal_lost.0 as f64 / 1024.0,
                        f.wal_lost.1
                    );
                    figures = Some(f);
                }
                Err(e) => failures.push(e),
            }
        }
        let reclaims = drained.reclaims;
        if reclaims > bound {
            failures.push(format!(
                "{reclaims} second runs of a stage, more than the failover explains ({bound})"
            ));
        }
        notes.push_str(&drained.given_back());
        let status = self.d.terminate();
        if !status.success() {
            failures.push(format!(
                "the dispatcher did not shut down cleanly: {status}\n{}",
                tail(&self.d.log(), 30)
            ));
        }
        let survivors: Vec<u32> = self.workers.iter().copied().filter(|&p| alive(p)).collect();
        if !survivors.is_empty() {
            failures.push(format!(
                "worker processes outlived their dispatcher: {survivors:?}"
            ));
        }
        if !failures.is_empty() {
            failures.push(format!("dispatcher log tail:\n{}", tail(&self.d.log(), 30)));
        }
        Line {
            name: self.name(),
            lost: drained.lost,
            stuck: drained.stuck,
            duplicate_commits: drained.duplicate_commits,
            reclaims,
            bound,
            drain,
            baseline,
            notes,
            failures,
            figures,
        }
    }

    /// With the primary frozen, on the promoted node: the first advance within
    /// [`ADVANCE_BOUND`] of the promotion, every stage advancing messages there, and
    /// `pepsi-queue status` during the freeze answered or exited 75 in time.
    fn freeze_checks(&mut self, notes: &mut String) -> Vec<String> {
        let mut failures = Vec::new();
        let Some((promoted_at, _)) = self.promoted else {
            return vec!["the standby was never promoted".into()];
        };
        let since = promoted_at
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let c = self.monitor.client();
        let rows = c
            .query(
                "SELECT stage, extract(epoch FROM min(at))::float8 FROM public.fault_log \
                  WHERE kind = 'outcome' AND at >= to_timestamp($1) GROUP BY stage ORDER BY stage",
                &[&since],
            )
            .unwrap_or_default();
        let firsts: Vec<(String, f64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let stages: Vec<&str> = firsts.iter().map(|(s, _)| s.as_str()).collect();
        if stages != ["a", "b", "c", "d"] {
            failures.push(format!(
                "after the promotion only stages {stages:?} advanced messages on the promoted node"
            ));
        }
        let _ = write!(
            notes,
            "first advance after the promotion per stage: {}; ",
            firsts
                .iter()
                .map(|(stage, t)| format!("{stage} {:.2} s", t - since))
                .collect::<Vec<_>>()
                .join(", ")
        );
        match firsts.iter().map(|(_, t)| *t).reduce(f64::min) {
            Some(first) if first - since <= ADVANCE_BOUND.as_secs_f64() => {}
            Some(first) => failures.push(format!(
                "the first advance on the promoted node came {:.2} s after the promotion, more than {ADVANCE_BOUND:?}",
                first - since
            )),
            None => failures.push("nothing advanced on the promoted node".into()),
        }
        match &self.queue_status {
            Some((code, took, _)) if matches!(code, Some(0) | Some(75)) && *took <= QUEUE_BOUND => {
            }
            Some((code, took, text)) => failures.push(format!(
                "pepsi-queue status during the freeze exited {code:?} after {took:?}: {text}"
            )),
            None => failures.push("pepsi-queue status was not run during the freeze".into()),
        }
        failures
    }

    /// After the drain of a failover run (the dispatcher still running, every worker
    /// gone): the promotion's figure from the promoted node, then the old primary's
    /// data directory started alone and compared with it.
    fn failover_figures(&mut self) -> Result<(Figures, Vec<String>), String> {
        let received = self
            .received
            .clone()
            .ok_or("the primary was never killed")?;
        let (promoted_at, promotion) = self.promoted.ok_or("the standby was never promoted")?;
        let since = promoted_at
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let c = self.monitor.client();
        let first: Option<f64> = c
            .query_one(
                "SELECT extract(epoch FROM min(at))::float8 FROM public.fault_log \
                  WHERE kind = 'outcome' AND at >= to_timestamp($1)",
                &[&since],
            )
            .map_err(|e| e.to_string())?
            .get(0);
        let promotion_to_advance = first.map(|t| Duration::from_secs_f64((t - since).max(0.0)));
        let new = read_node(c)?;
        if self.cut == Some(Cut::Freeze) {
            // The drain is over: the frozen primary goes, as a failover manager's
            // fencing would end it, before its data directory is read.
            self.pair.kill_primary()?;
        }
        let wal_lost = self.pair.wal_beyond(&received)?;
        let alone = self.pair.start_old_primary_alone()?;
        let old = read_node(&mut alone.client()?)?;
        let (figures, failures) = compare(self.mode, &old, &new, &alone);
        Ok((
            Figures {
                cut: self.cut.unwrap_or(Cut::Kill),
                promotion_to_advance,
                promotion,
                wal_lost,
                ..figures
            },
            failures,
        ))
    }
}

/// `pepsi-queue status` with `conf`, killed at twice [`QUEUE_BOUND`] (it must never
/// hang): its exit code, how long it took and what it printed.
fn queue_status(conf: &std::path::Path) -> (Option<i32>, Duration, String) {
    let started = Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pepsi-queue"))
        .arg("-c")
        .arg(conf)
        .arg("status")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start pepsi-queue");
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > QUEUE_BOUND * 2 {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (code, took, tail(&text, 10))
}

/// What one node recorded: its outcomes' execution ids, and its last-stage executions.
struct NodeTrace {
    outcomes: HashSet<String>,
    /// (exec, message id, session pid, transaction id, synchronous_commit).
    last: Vec<(String, i64, i32, u64, String)>,
}

fn read_node(c: &mut impl pepsi::db::Queries) -> Result<NodeTrace, String> {
    let outcomes = c
        .query(
            "SELECT exec::text FROM public.fault_log WHERE kind = 'outcome'",
            &[],
        )
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let last = c
        .query(
            "SELECT exec::text, id, pid, xid::int8, sync FROM public.last_stage_runs",
            &[],
        )
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                r.get(2),
                r.get::<_, i64>(3) as u64,
                r.get(4),
            )
        })
        .collect();
    Ok(NodeTrace { outcomes, last })
}

/// The old primary against the promoted node: what ran again, and in the synchronous
/// run whether any last-stage commit missing from the promoted node could have been
/// acknowledged.
fn compare(mode: Mode, old: &NodeTrace, new: &NodeTrace, alone: &Node) -> (Figures, Vec<String>) {
    let mut failures = Vec::new();
    let reruns = old.outcomes.difference(&new.outcomes).count();
    let new_execs: HashSet<&str> = new.last.iter().map(|r| r.0.as_str()).collect();
    let old_only: Vec<&(String, i64, i32, u64, String)> = old
        .last
        .iter()
        .filter(|r| !new_execs.contains(r.0.as_str()))
        .collect();
    let twice: HashSet<i64> = old_only.iter().map(|r| r.1).collect();
    let mut unacknowledged = 0;
    if mode == Mode::Sync {
        // A session waits for the standby on each synchronous commit: when the primary
        // died, at most its last transaction can have been flushed locally and not by
        // the standby. Anything else missing from the promoted node was acknowledged
        // and lost.
        let mut last_xid: HashMap<i32, u64> = HashMap::new();
        for r in &old.last {
            let x = last_xid.entry(r.2).or_insert(r.3);
            *x = (*x).max(r.3);
        }
        let mut acknowledged = Vec::new();
        for r in &old_only {
            if r.4 == "on" && last_xid.get(&r.2) == Some(&r.3) {
                unacknowledged += 1;
            } else {
                acknowledged.push(r.1);
            }
        }
        if !acknowledged.is_empty() {
            failures.push(format!(
                "{} last-stage commits the standby never received were not the last \
                 synchronous commit of their session (acknowledged, then lost): \
                 messages {acknowledged:?} ran their last stage twice; the old primary's \
                 log:\n{}",
                acknowledged.len(),
                alone.log_tail(10)
            ));
        }
    }
    (
        Figures {
            mode,
            cut: Cut::Kill,
            promotion_to_advance: None,
            promotion: Duration::ZERO,
            reruns,
            last_stage_twice: twice.len(),
            unacknowledged,
            wal_lost: (0, 0),
        },
        failures,
    )
}

/// One line in the suite's table format.
fn row(l: &Line) -> String {
    TableRow {
        name: &l.name,
        lost: l.lost,
        stuck: l.stuck,
        duplicate_commits: l.duplicate_commits,
        reclaims: l.reclaims,
        bound: l.bound,
        drain: l.drain,
        baseline: l.baseline,
        notes: &l.notes,
        failed: !l.failures.is_empty(),
    }
    .line()
}

fn table(lines: &[Line]) -> String {
    let mut out = table_head();
    for l in lines {
        out.push('\n');
        out.push_str(&row(l));
    }
    out.push_str(
        "\nthe primary killed (SIGKILL, every process) at 30 % of the drain, the standby \
         promoted 2 s later; async: asynchronous replication, today's default commit; sync: \
         synchronous replication and SYNCHRONOUS_COMMIT = on on the last stages (c, d); \
         frozen primary: every process of the primary stopped (SIGSTOP) instead, and \
         killed once the drain is over; \
         lost, stuck, duplicates: as in the fault suite, read on the promoted node, the \
         bound being what was in flight plus every outcome lost with the old primary's WAL",
    );
    let _ = write!(
        out,
        "\n\nfailover figures                          | promote | promotion → first advance | \
         re-run: stage executions / last stage twice (unacknowledged) | WAL not at the standby | drain vs baseline"
    );
    for l in lines {
        let Some(f) = &l.figures else { continue };
        let vs = match l.baseline {
            Some(b) if b > Duration::ZERO => {
                format!("×{:.1}", l.drain.as_secs_f64() / b.as_secs_f64())
            }
            _ => "—".into(),
        };
        let _ = write!(
            out,
            "\n{:<41} | {:>5.2} s | {:>25} | {:>60} | {:>22} | {:>17}",
            match f.cut {
                Cut::Kill => f.mode.describe().to_string(),
                Cut::Freeze => format!("frozen primary, {}", f.mode.describe()),
            },
            f.promotion.as_secs_f64(),
            f.promotion_to_advance
                .map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64())),
            format!(
                "{} / {} ({})",
                f.reruns, f.last_stage_twice, f.unacknowledged
            ),
            format!(
                "{:.1} KB, {} commits",
                f.wal_lost.0 as f64 / 1024.0,
                f.wal_lost.1
            ),
            vs
        );
    }
    out
}
