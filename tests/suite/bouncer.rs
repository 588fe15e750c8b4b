//! `pepsi-failure-bouncer` (§13.1): failed and timed-out rows moved to the bounce
//! stage as they fail (`serve`, by LISTEN) and in sweeps, scoped by
//! `--failed-only`/`--timeout-only`, one NOTIFY per batch, never a row twice, the bounce
//! stage's own failures left alone; its refusals (exit 64, 78) and its shutdown; and
//! `pepsi-dispatch check` on `BOUNCE_STAGE`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;
use postgres::types::Type;

use pepsi::bouncer::BATCH;
use pepsi::db::sql;

use crate::util::bouncer::Bouncer;
use crate::util::scenario::{Builder, Scenario, programs};
use crate::util::{
    TempDir, TestDb, assert_has, assert_lacks, bin, claim, inject, row_at, run, stage, state_of,
    stderr, wait_until, write_config,
};

/// The pipeline: `a` → `b`, failures to `bounce`, whose DSNs go on to `dsn`.
const STAGES: &str = "[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n\
                      [stage-b]\nPROGRAM = {discard}\n\n\
                      [stage-bounce]\nPROGRAM = {pass}\nNEXT = dsn\n\n\
                      [stage-dsn]\nPROGRAM = {discard}\n";

/// A scenario: `bouncer` as the `[pepsi-failure-bouncer]` section's body, then the
/// stages, `{pass}` and `{discard}` standing for the stage programs.
fn scenario_with(tag: &str, bouncer: &str, stages: &str) -> Builder {
    Scenario::new(tag)
        .section("pepsi-failure-bouncer", bouncer)
        .stages(stages)
}

/// The usual scenario: `BOUNCE_STAGE = bounce`.
fn scenario(tag: &str) -> Builder {
    scenario_with(tag, "BOUNCE_STAGE = bounce\n", STAGES)
}

/// [`scenario_with`]'s configuration as a file for a database and directory of the
/// caller's.
fn config_with(dir: &TempDir, db: &TestDb, bouncer: &str, stages: &str) -> PathBuf {
    write_config(
        dir,
        db,
        &format!("[pepsi-failure-bouncer]\n{bouncer}\n{}", programs(stages)),
    )
}

/// `pepsi-failure-bouncer -c conf ARGS`.
fn bouncer(conf: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-c", conf.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&bin("pepsi-failure-bouncer"), &all)
}

/// `sweep ARGS`, which must exit 0; returns its log.
#[track_caller]
fn sweep(conf: &Path, args: &[&str]) -> String {
    let mut all = vec!["sweep"];
    all.extend_from_slice(args);
    let out = bouncer(conf, &all);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    stderr(&out)
}

/// Turns a row `failed` or `timeout` as a worker or the dispatcher does: claimed, then
/// the status with the state's failure keys merged in.
fn fail(c: &mut postgres::Client, id: i64, status: &str, state: &str) {
    claim(c, &[id]);
    let n = c
        .execute(
            "UPDATE pepsi.workqueue SET status = $2::text::pepsi.workqueue_status, \
             state = state || $3::text::jsonb WHERE workqueue_id = $1",
            &[&id, &status, &state],
        )
        .unwrap();
    assert_eq!(n, 1);
}

/// A message at `stage` that failed there with `status` and nothing in its state.
fn failed_at(c: &mut postgres::Client, stage: &str, status: &str) -> i64 {
    let id = inject(c, stage, "s@x.example", &["r@y.example"]);
    fail(c, id, status, "{}");
    id
}

/// The 1-based line of the first line of `conf` that starts with `start`.
fn line_of(conf: &Path, start: &str) -> usize {
    std::fs::read_to_string(conf)
        .unwrap()
        .lines()
        .position(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starts with {start:?}"))
        + 1
}

fn at(stage: &str, status: &str) -> Option<(String, String)> {
    Some((stage.to_string(), status.to_string()))
}

/// The ids in the log lines of moved messages, with how often each is named.
fn moved_ids(log: &str) -> BTreeMap<i64, usize> {
    let mut ids = BTreeMap::new();
    for line in log.lines() {
        let Some(rest) = line.split("message ").nth(1) else {
            continue;
        };
        if !line.contains(") moved to bounce stage ") {
            continue;
        }
        let id: i64 = rest.split(' ').next().unwrap().parse().unwrap();
        *ids.entry(id).or_default() += 1;
    }
    ids
}

/// Notifications on `channel` that reach `listener` within `quiet` of one another.
fn notifications(listener: &mut postgres::Client, quiet: Duration) -> usize {
    let mut notes = listener.notifications();
    let mut it = notes.timeout_iter(quiet);
    let mut n = 0;
    while let Some(_note) = it.next().unwrap() {
        n += 1;
    }
    n
}

/// How long a row that failed under `serve` may take to reach the bounce stage: it
/// takes milliseconds; the margin is for a busy machine. Five such waits in a row stay
/// below the minute after which the safety-net sweep would move a row anyway, so a
/// row moved within it was moved on its notification.
const NOTIFIED: Duration = Duration::from_secs(10);

#[test]
fn a_row_failing_while_serve_runs_is_moved_on_its_notification_before_the_next_sweep() {
    let (s, mut c) = scenario("fb-listen").connect();
    let mut b = Bouncer::ready(&s.conf, &[]);
    // Several in a row: each is the notification's doing (the next safety-net sweep is
    // a minute away, more than five waits of NOTIFIED), not a lucky sweep.
    for (i, status) in ["failed", "timeout", "failed", "failed", "timeout"]
        .iter()
        .enumerate()
    {
        let id = inject(&mut c, "a", "s@x.example", &["r@y.example"]);
        fail(&mut c, id, status, "{}");
        wait_until(
            NOTIFIED,
            &format!("message {id} ({status}) is at the bounce stage"),
            || row_at(&mut c, id) == at("bounce", "pending"),
        );
        b.wait_log(
            &format!("message {id} (failed at stage a, {status}) moved to bounce stage bounce"),
            Duration::from_secs(5),
        );
        assert_eq!(moved_ids(&b.log()).len(), i + 1);
    }
    assert_eq!(b.terminate().code(), Some(0), "{}", b.log());
}

#[test]
fn rows_that_failed_while_the_bouncer_was_down_are_swept_when_serve_starts() {
    let (s, mut c) = scenario("fb-start").connect();
    let f1 = failed_at(&mut c, "a", "failed");
    let t1 = failed_at(&mut c, "b", "timeout");
    let f2 = failed_at(&mut c, "b", "failed");
    // Rows in no terminal state stay where they are.
    let pending = inject(&mut c, "a", "s@x.example", &["r@y.example"]);
    let running = inject(&mut c, "b", "s@x.example", &["r@y.example"]);
    claim(&mut c, &[running]);
    let paused = inject(&mut c, "a", "s@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '1 hour' \
         WHERE workqueue_id = $1",
        &[&paused],
    )
    .unwrap();
    let mut b = Bouncer::ready(&s.conf, &[]);
    for id in [f1, t1, f2] {
        assert_eq!(row_at(&mut c, id), at("bounce", "pending"), "{}", b.log());
    }
    assert_eq!(row_at(&mut c, pending), at("a", "pending"));
    assert_eq!(row_at(&mut c, running), at("b", "running"));
    assert_eq!(row_at(&mut c, paused), at("a", "paused"));
    assert_eq!(b.terminate().code(), Some(0));
    let log = b.log();
    assert_has!(
        log,
        &format!("message {t1} (failed at stage b, timeout) moved to bounce stage bounce")
    );
    assert_eq!(
        moved_ids(&log).keys().copied().collect::<Vec<_>>(),
        [f1, t1, f2]
    );
}

#[test]
fn sweep_moves_only_the_states_it_is_told_and_both_by_default() {
    let (s, mut c) = scenario("fb-scope").connect();
    let f1 = failed_at(&mut c, "a", "failed");
    let t1 = failed_at(&mut c, "a", "timeout");
    let f2 = failed_at(&mut c, "b", "failed");
    let t2 = failed_at(&mut c, "b", "timeout");

    let log = sweep(&s.conf, &["--timeout-only"]);
    assert_eq!(row_at(&mut c, t1), at("bounce", "pending"), "{log}");
    assert_eq!(row_at(&mut c, t2), at("bounce", "pending"), "{log}");
    assert_eq!(row_at(&mut c, f1), at("a", "failed"), "{log}");
    assert_eq!(row_at(&mut c, f2), at("b", "failed"), "{log}");
    assert_has!(
        log,
        "moved 2 messages to bounce stage bounce (0 failed, 2 timeout)"
    );

    let t3 = failed_at(&mut c, "a", "timeout");
    let log = sweep(&s.conf, &["--failed-only"]);
    assert_eq!(row_at(&mut c, f1), at("bounce", "pending"), "{log}");
    assert_eq!(row_at(&mut c, f2), at("bounce", "pending"), "{log}");
    assert_eq!(row_at(&mut c, t3), at("a", "timeout"), "{log}");
    assert_has!(
        log,
        "moved 2 messages to bounce stage bounce (2 failed, 0 timeout)"
    );

    let f3 = failed_at(&mut c, "b", "failed");
    let log = sweep(&s.conf, &[]);
    assert_eq!(row_at(&mut c, t3), at("bounce", "pending"), "{log}");
    assert_eq!(row_at(&mut c, f3), at("bounce", "pending"), "{log}");
    assert_has!(
        log,
        "moved 2 messages to bounce stage bounce (1 failed, 1 timeout)"
    );
    assert_eq!(
        moved_ids(&log).keys().copied().collect::<Vec<_>>(),
        [t3, f3]
    );

    let log = sweep(&s.conf, &[]);
    assert_has!(log, "nothing to move to bounce stage bounce");
}

#[test]
fn the_move_line_shows_the_rows_stage_escaped() {
    let (s, mut c) = scenario("fb-escaped").connect();
    let id = failed_at(&mut c, "a", "failed");
    // A stage that a writer of the queue set: a terminal control, a forged log line, a
    // right-to-left override and a line separator.
    let odd = "a\u{1b}[2J\r\n2026-12-03 INFO forged\u{202e}x\u{2028}y";
    c.execute(
        "UPDATE pepsi.workqueue SET stage = $2 WHERE workqueue_id = $1",
        &[&id, &odd],
    )
    .unwrap();
    let log = sweep(&s.conf, &[]);
    assert_eq!(row_at(&mut c, id), at("bounce", "pending"), "{log}");
    assert_has!(
        log,
        &format!(
            "message {id} (failed at stage a\\u{{1b}}[2J\\r\\n2026-12-03 INFO forged\\u{{202e}}x\\u{{2028}}y, failed) moved to bounce stage bounce"
        )
    );
    assert_lacks!(log, ['\u{1b}', '\r', '\u{202e}', '\u{2028}']);
    assert!(
        !log.lines().any(|l| l.starts_with("2026-12-03 INFO forged")),
        "{log}"
    );
}

#[test]
fn a_sweep_sends_one_notification_per_batch_and_none_when_nothing_moved() {
    let (s, mut c) = scenario("fb-notify").connect();
    let mut listener = s.client();
    listener
        .batch_execute(&format!("LISTEN {}", sql::CHANNEL_WORKQUEUE))
        .unwrap();
    let quiet = Duration::from_millis(500);

    // Several rows, one batch: one notification.
    for _ in 0..5 {
        failed_at(&mut c, "a", "failed");
    }
    failed_at(&mut c, "b", "timeout");
    // The injections notified too: not counted.
    notifications(&mut listener, quiet);
    let log = sweep(&s.conf, &[]);
    assert!(log.contains("moved 6 messages"), "{log}");
    assert_eq!(notifications(&mut listener, quiet), 1, "{log}");

    // Nothing to move: no notification.
    let log = sweep(&s.conf, &[]);
    assert!(log.contains("nothing to move"), "{log}");
    assert_eq!(notifications(&mut listener, quiet), 0, "{log}");

    // Two and a half batches: three calls that moved something, three notifications.
    let n = i64::from(BATCH) * 5 / 2;
    // Two statements: a statement does not see the rows its own CTE inserted.
    let ids: Vec<i64> = c
        .query(
            "SELECT pepsi.workqueue_inject('a', 's@x.example', ARRAY['r@y.example'], NULL, NULL) \
               FROM generate_series(1, $1::int8)",
            &[&n],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed' WHERE workqueue_id = ANY ($1)",
        &[&ids],
    )
    .unwrap();
    notifications(&mut listener, quiet);
    let log = sweep(&s.conf, &[]);
    assert!(
        log.contains(&format!("moved {n} messages to bounce stage bounce")),
        "{}",
        &log[log.len().saturating_sub(2000)..]
    );
    assert_eq!(notifications(&mut listener, quiet), 3);
}

#[test]
fn the_bounce_stages_own_failures_stay_and_an_undeliverable_dsn_goes_back_to_it() {
    let (s, mut c) = scenario("fb-loop").connect();
    // A bounce that failed at the bounce stage must not loop.
    let at_bounce = failed_at(&mut c, "bounce", "failed");
    let timed_out_at_bounce = failed_at(&mut c, "bounce", "timeout");
    // A DSN (null sender) that could not be delivered after the bounce stage goes back
    // there, to be discarded: a bounce is never bounced.
    let dsn = inject(&mut c, "dsn", "", &["s@x.example"]);
    fail(
        &mut c,
        dsn,
        "failed",
        r#"{"failure_class": "permanent", "failed_stage": "dsn"}"#,
    );
    let log = sweep(&s.conf, &[]);
    assert_eq!(row_at(&mut c, at_bounce), at("bounce", "failed"), "{log}");
    assert_eq!(
        row_at(&mut c, timed_out_at_bounce),
        at("bounce", "timeout"),
        "{log}"
    );
    assert_eq!(row_at(&mut c, dsn), at("bounce", "pending"), "{log}");
    assert_has!(
        log,
        &format!("message {dsn} (failed at stage dsn, failed) moved to bounce stage bounce")
    );
    assert_eq!(moved_ids(&log).keys().copied().collect::<Vec<_>>(), [dsn]);
    // And again: still left alone.
    let log = sweep(&s.conf, &[]);
    assert!(log.contains("nothing to move"), "{log}");
    assert_eq!(row_at(&mut c, at_bounce), at("bounce", "failed"));
}

#[test]
fn a_moved_row_keeps_its_failure_or_gets_one_and_its_hops_start_afresh() {
    let (sc, mut c) = scenario("fb-state").connect();
    let kept = inject(&mut c, "b", "s@x.example", &["r@y.example"]);
    fail(
        &mut c,
        kept,
        "failed",
        r#"{"failure_class": "crashed", "failed_stage": "a", "last_error": "died", "strikes": 3}"#,
    );
    let bare_failed = failed_at(&mut c, "b", "failed");
    let bare_timeout = failed_at(&mut c, "a", "timeout");
    let looped = inject(&mut c, "a", "s@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET hops = 7, hop_stage = 'a' WHERE workqueue_id = $1",
        &[&looped],
    )
    .unwrap();
    fail(&mut c, looped, "failed", r#"{"failure_class": "looped"}"#);
    let log = sweep(&sc.conf, &[]);
    assert!(log.contains("moved 4 messages"), "{log}");

    let s = state_of(&mut c, kept);
    assert_eq!(s["failure_class"], "crashed");
    assert_eq!(s["failed_stage"], "a");
    assert_eq!(s["last_error"], "died");
    assert_eq!(s["strikes"], 3);
    let s = state_of(&mut c, bare_failed);
    assert_eq!(s["failure_class"], "permanent", "{s}");
    assert_eq!(s["failed_stage"], "b", "{s}");
    let s = state_of(&mut c, bare_timeout);
    assert_eq!(s["failure_class"], "timed-out", "{s}");
    assert_eq!(s["failed_stage"], "a", "{s}");
    let s = state_of(&mut c, looped);
    assert_eq!(s["failure_class"], "looped", "{s}");
    assert_eq!(s["failed_stage"], "a", "{s}");
    for id in [kept, bare_failed, bare_timeout, looped] {
        let r = c
            .query_one(
                "SELECT stage, status::text, hops, hop_stage, timeout IS NULL \
                   FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap();
        assert_eq!(r.get::<_, String>(0), "bounce");
        assert_eq!(r.get::<_, String>(1), "pending");
        assert_eq!(r.get::<_, i32>(2), 0, "hops of {id}");
        assert_eq!(r.get::<_, Option<String>>(3), None, "hop_stage of {id}");
        assert!(r.get::<_, bool>(4), "timeout of {id}");
    }
}

#[test]
fn bouncers_at_once_never_move_a_row_twice() {
    let (sc, mut c) = scenario("fb-race").connect();
    // Every move to the bounce stage, as the database sees it.
    c.batch_execute(
        "CREATE TABLE public.moves (id bigint NOT NULL);
         CREATE FUNCTION public.log_move() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN
             INSERT INTO public.moves VALUES (NEW.workqueue_id);
             RETURN NULL;
         END $$;
         CREATE TRIGGER log_move AFTER UPDATE ON pepsi.workqueue FOR EACH ROW
             WHEN (NEW.stage = 'bounce' AND OLD.stage IS DISTINCT FROM NEW.stage)
             EXECUTE FUNCTION public.log_move();",
    )
    .unwrap();
    const ROWS: i64 = 6000;
    let ids: Vec<i64> = c
        .query(
            "SELECT pepsi.workqueue_inject(CASE WHEN g % 3 = 0 THEN 'b' ELSE 'a' END, \
                    's@x.example', ARRAY['r@y.example'], NULL, NULL) \
               FROM generate_series(1, $1::int8) g",
            &[&ROWS],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut serve = Bouncer::ready(&sc.conf, &[]);

    // Eight threads calling the move with small batches, so that they contend on
    // every row, start with the failure's commit, beside the service and three sweeps.
    const THREADS: usize = 8;
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let mut client = sc.client();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let statuses = ["failed", "timeout"];
                let mut moved = Vec::new();
                barrier.wait();
                loop {
                    let rows = client
                        .query_typed(
                            sql::BOUNCE_FAILED,
                            &[
                                (&"bounce", Type::TEXT),
                                (&&statuses[..], Type::TEXT_ARRAY),
                                (&25i32, Type::INT4),
                            ],
                        )
                        .unwrap();
                    if rows.is_empty() {
                        return moved;
                    }
                    moved.extend(rows.iter().map(|r| r.get::<_, i64>(0)));
                }
            })
        })
        .collect();
    let sweeps: Vec<_> = (0..3)
        .map(|_| {
            let mut cmd = std::process::Command::new(bin("pepsi-failure-bouncer"));
            cmd.arg("-c")
                .arg(&sc.conf)
                .arg("sweep")
                .env_remove("PEPSI_CONFIG")
                .stderr(std::process::Stdio::piped());
            cmd
        })
        .collect();
    c.execute(
        "UPDATE pepsi.workqueue SET status = CASE WHEN workqueue_id % 2 = 0 \
                                             THEN 'failed' ELSE 'timeout' END::pepsi.workqueue_status \
          WHERE workqueue_id = ANY ($1)",
        &[&ids],
    )
    .unwrap();
    barrier.wait();
    let sweeps: Vec<_> = sweeps
        .into_iter()
        .map(|mut cmd| cmd.spawn().unwrap())
        .collect();

    let mut reported: BTreeMap<i64, usize> = BTreeMap::new();
    let mut by_threads = 0;
    for t in threads {
        let moved = t.join().unwrap();
        by_threads += moved.len();
        for id in moved {
            *reported.entry(id).or_default() += 1;
        }
    }
    let mut by_sweeps = 0;
    for s in sweeps {
        let out = s.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        for (id, n) in moved_ids(&stderr(&out)) {
            by_sweeps += n;
            *reported.entry(id).or_default() += n;
        }
    }
    wait_until(Duration::from_secs(20), "no row is failed any more", || {
        c.query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE status IN ('failed', 'timeout')",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 0
    });
    // The service logs its moves after each call: wait for the last of them.
    let total = |log: &str| {
        let mut all = reported.clone();
        for (id, n) in moved_ids(log) {
            *all.entry(id).or_default() += n;
        }
        all
    };
    wait_until(Duration::from_secs(10), "every move is reported", || {
        total(&serve.log()).values().sum::<usize>() >= ROWS as usize
    });
    assert_eq!(serve.terminate().code(), Some(0));
    let all = total(&serve.log());
    let twice: Vec<_> = all.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} rows reported moved more than once, e.g. (id, times): {:?}",
        twice.len(),
        &twice[..twice.len().min(10)]
    );
    assert_eq!(
        all.keys().copied().collect::<BTreeSet<_>>(),
        ids.iter().copied().collect::<BTreeSet<_>>()
    );
    let by_serve = moved_ids(&serve.log()).len();
    println!("moved by threads {by_threads}, sweeps {by_sweeps}, serve {by_serve}");
    // The database's own count: one move per row.
    let (moves, distinct): (i64, i64) = c
        .query_one("SELECT count(*), count(DISTINCT id) FROM public.moves", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!((moves, distinct), (ROWS, ROWS));
    let at_bounce: i64 = c
        .query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'bounce' AND status = 'pending'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(at_bounce, ROWS);
}

#[test]
fn sigterm_and_sigint_stop_serve_promptly_with_exit_0() {
    let s = scenario("fb-signal").build();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut b = Bouncer::ready(&s.conf, &[]);
        b.signal(signal);
        // It looks at the stop flag at least every half second; the bound is
        // generous for a busy machine, and still far below the minute of a sweep's
        // wait or systemd's 30 s stop timeout.
        let status = b.wait(Duration::from_secs(10));
        assert_eq!(status.code(), Some(0), "signal {signal}: {}", b.log());
        assert!(b.log().contains("stopping on signal"), "{}", b.log());
    }
}

#[test]
fn serve_waits_for_an_unreachable_database_and_a_signal_ends_the_wait() {
    let dir = TempDir::new("fb-away");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n[pepsi-postgres]\nCONNECTION = host={} port=5999 user=x dbname=x\n\
             [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n",
            dir.path("nosock").display()
        ),
    );
    let mut b = Bouncer::serve(&conf, &[]);
    b.wait_log("the database is not available", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(600));
    assert!(b.try_wait().is_none(), "it exited: {}", b.log());
    assert_eq!(b.terminate().code(), Some(0), "{}", b.log());
    // One line, however many attempts.
    assert_eq!(b.count("the database is not available"), 1, "{}", b.log());

    // A sweep cannot wait: it says why and exits 1.
    let out = bouncer(&conf, &["sweep"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_has!(stderr(&out), "cannot connect to socket");
}

#[test]
fn a_missing_bounce_stage_exits_78_naming_the_key_and_the_file() {
    let s = scenario_with("fb-unset", "", STAGES).build();
    for args in [&["sweep"][..], &["serve"][..]] {
        let out = bouncer(&s.conf, args);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {}", stderr(&out));
        let text = stderr(&out);
        assert_has!(
            text,
            "[pepsi-failure-bouncer] BOUNCE_STAGE is required but not set"
        );
        assert!(text.contains(s.conf.to_str().unwrap()), "{text}");
    }
}

#[test]
fn a_bounce_stage_naming_no_section_exits_78_unless_the_overlay_has_it() {
    let (s, mut c) = scenario_with("fb-nosection", "BOUNCE_STAGE = bounces\n", STAGES).connect();
    let id = failed_at(&mut c, "a", "failed");
    for args in [&["sweep"][..], &["serve"][..]] {
        let out = bouncer(&s.conf, args);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {}", stderr(&out));
        let text = stderr(&out);
        assert_has!(
            text,
            &format!(
                "{}:{}: [pepsi-failure-bouncer] BOUNCE_STAGE: names stage \"bounces\", which has no [stage-bounces] section",
                s.conf.display(),
                line_of(&s.conf, "BOUNCE_STAGE")
            )
        );
    }
    assert_eq!(row_at(&mut c, id), at("a", "failed"), "nothing moved");
    // A section that only the overlay has is a stage all the same.
    c.execute(
        "INSERT INTO pepsi.config_override (section, key, value) \
         VALUES ('stage-bounces', 'PROGRAM', $1)",
        &[&stage("discard").to_str().unwrap()],
    )
    .unwrap();
    sweep(&s.conf, &[]);
    assert_eq!(row_at(&mut c, id), at("bounces", "pending"));
}

#[test]
fn bad_arguments_exit_64_with_the_reason() {
    let s = scenario("fb-usage").build();
    for (args, says) in [
        (&[][..], "missing subcommand"),
        (&["bounce"][..], "unknown subcommand \"bounce\""),
        (
            &["sweep", "--failed-only", "--timeout-only"][..],
            "--failed-only and --timeout-only exclude each other",
        ),
        (
            &["serve", "--timeout-only", "--failed-only"][..],
            "exclude each other",
        ),
        (&["sweep", "--once"][..], "unexpected argument \"--once\""),
        (&["sweep", "-v"][..], "must come before the subcommand"),
    ] {
        let out = bouncer(&s.conf, args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn a_schema_mismatch_exits_78() {
    let s = scenario("fb-schema").empty().build();
    for args in [&["sweep"][..], &["serve"][..]] {
        let out = bouncer(&s.conf, args);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {}", stderr(&out));
        assert_has!(stderr(&out), "run pepsi-setup schema");
    }
}

#[test]
fn dispatch_check_reports_a_bounce_stage_without_a_section_at_its_line() {
    let s = scenario("fb-check").build();
    let check = |conf: &Path, extra: &[&str]| {
        let mut args = vec!["-c", conf.to_str().unwrap(), "check"];
        args.extend_from_slice(extra);
        let out = run(&bin("pepsi-dispatch"), &args);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        (out.status.code(), text)
    };
    let (code, text) = check(&s.conf, &[]);
    assert_eq!(code, Some(0), "{text}");

    let conf = config_with(&s.dir, &s.db, "\nBOUNCE_STAGE = bounces\n", STAGES);
    let (code, text) = check(&conf, &[]);
    assert_eq!(code, Some(78), "{text}");
    assert_has!(
        text,
        &format!(
            "error: {}:{}: [pepsi-failure-bouncer] BOUNCE_STAGE: names stage \"bounces\", which has no [stage-bounces] section",
            conf.display(),
            line_of(&conf, "BOUNCE_STAGE")
        )
    );
    // As if the overlay gave it a section.
    let discard = stage("discard");
    let (code, text) = check(
        &conf,
        &[
            "--overlay",
            "stage-bounces",
            "PROGRAM",
            discard.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(0), "{text}");
}
