//! The fairness benchmark: `cargo bench --bench fairness` (release build). Runs the
//! dispatcher with the fault worker (each message costs its `cost_ms`) against a
//! throwaway PostgreSQL and prints, measured in one run, never asserted:
//!
//! - (1) ten tenants of equal weight, each with a backlog of 400 messages interleaved by
//!   id, one worker slot: the Jain fairness index of the worker time each got over
//!   2,000 messages (past the first 50), and the least and most;
//! - (2) two tenants weighted 2 and 1, both backlogged: the ratio of their worker time
//!   over 1,000 messages;
//! - (3) a tenant sending through 100 sender keys against a tenant with one: its worker
//!   time against the other's over 1,000 messages;
//! - (4) a tenant held to `rate 10/s` with 2,000 messages waiting beside a free tenant
//!   (two worker slots): the limited tenant's messages a second over 60 s, and the free
//!   tenant's beside it against alone (its first 5 s).
//!
//! `BENCH_RATE_SECONDS` (default 60) sets the window of (4).

#[allow(unused_imports, unused_macros)]
#[path = "../tests/util/mod.rs"]
mod util;

use std::time::{Duration, Instant};

use util::dispatcher::Dispatcher;
use util::fairness::{
    finished_between, finished_count, inject, jain, now_epoch, record_finishes, worker_times,
};
use util::queue::{expect, queue};
use util::scenario::conf;
use util::{TempDir, TestDb};

const ONE_SLOT: &str = "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 1\n";

/// Runs the stage until `n` messages finished.
fn run_until(conf: &std::path::Path, c: &mut postgres::Client, n: i64) {
    let d = Dispatcher::start(conf, &[]);
    let until = Instant::now() + Duration::from_secs(600);
    while finished_count(c) < n {
        assert!(
            Instant::now() < until,
            "{n} messages not done in 10 minutes"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(d);
}

/// A database, a configuration with one slot and no FIFO slots, the finishes recorded.
fn setup(tag: &str) -> (TestDb, TempDir, std::path::PathBuf, postgres::Client) {
    let db = TestDb::new();
    let dir = TempDir::new(tag);
    let conf = conf(&dir, &db, "FAIR_FIFO_PERCENT = 0", ONE_SLOT);
    let mut c = db.client();
    record_finishes(&mut c);
    (db, dir, conf, c)
}

fn equal_tenants() {
    let (_db, _dir, conf, mut c) = setup("b-jain");
    let names: Vec<String> = (0..10).map(|i| format!("domain:t{i}.example")).collect();
    for _ in 0..400 {
        for i in 0..10 {
            inject(&mut c, &format!("x@t{i}.example"), 1, 5);
        }
    }
    run_until(&conf, &mut c, 2050);
    let tenants: Vec<&str> = names.iter().map(String::as_str).collect();
    let times = worker_times(&mut c, &tenants, 51, 2050);
    let (least, most) = times
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, m), &t| (l.min(t), m.max(t)));
    println!(
        "(1) 10 equal tenants, 2,000 messages of 5 ms: Jain index {:.4} of their worker time \
         (least {least:.2} s, most {most:.2} s)",
        jain(&times)
    );
}

fn weighted() {
    let (_db, _dir, conf, mut c) = setup("b-weight");
    expect(
        &queue(&conf, &["settings", "weight", "domain:paying.example", "2"]),
        0,
    );
    for _ in 0..800 {
        inject(&mut c, "x@paying.example", 1, 5);
        inject(&mut c, "x@free.example", 1, 5);
    }
    run_until(&conf, &mut c, 1050);
    let t = worker_times(
        &mut c,
        &["domain:paying.example", "domain:free.example"],
        51,
        1050,
    );
    println!(
        "(2) weights 2 and 1, 1,000 messages of 5 ms: worker time {:.2} s and {:.2} s, {:.3} : 1",
        t[0],
        t[1],
        t[0] / t[1]
    );
}

fn hundred_keys() {
    let (_db, _dir, conf, mut c) = setup("b-keys");
    for i in 0..800 {
        inject(&mut c, &format!("x@s{}.big.example", i % 100), 1, 5);
        inject(&mut c, "x@small.example", 1, 5);
    }
    run_until(&conf, &mut c, 1050);
    let t = worker_times(
        &mut c,
        &["domain:big.example", "domain:small.example"],
        51,
        1050,
    );
    println!(
        "(3) a tenant of 100 sender keys against one of 1, 1,000 messages of 5 ms: worker \
         time {:.2} s and {:.2} s, {:.3} : 1 (as 101 senders: 100 : 1)",
        t[0],
        t[1],
        t[0] / t[1]
    );
}

fn rate() {
    let seconds: f64 = std::env::var("BENCH_RATE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60.0);
    let db = TestDb::new();
    let dir = TempDir::new("b-rate");
    let stage = "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\nQUEUE_LIMIT = 1\n";
    let conf = conf(&dir, &db, "", stage);
    expect(
        &queue(
            &conf,
            &["settings", "rate", "domain:limited.example", "10/s"],
        ),
        0,
    );
    let mut c = db.client();
    record_finishes(&mut c);
    let free_messages = (150.0 * (seconds + 20.0)) as i64;
    inject(&mut c, "x@free.example", free_messages, 10);
    let d = Dispatcher::start(&conf, &[]);
    while finished_count(&mut c) < 20 {
        std::thread::sleep(Duration::from_millis(100));
    }
    let alone_from = now_epoch(&mut c);
    std::thread::sleep(Duration::from_secs(5));
    let alone = finished_between(&mut c, "domain:free.example", alone_from, 5.0) as f64 / 5.0;
    inject(&mut c, "x@limited.example", 2000, 10);
    std::thread::sleep(Duration::from_secs(2));
    let from = now_epoch(&mut c);
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let limited = finished_between(&mut c, "domain:limited.example", from, seconds);
    let free = finished_between(&mut c, "domain:free.example", from, seconds) as f64 / seconds;
    drop(d);
    let per_second = limited as f64 / seconds;
    println!(
        "(4) rate 10/s beside a free tenant, over {seconds:.0} s: {limited} messages, {per_second:.3}/s \
         ({:+.1} %); the free tenant {free:.1}/s beside it, {alone:.1}/s alone",
        (per_second / 10.0 - 1.0) * 100.0
    );
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("pepsi fairness benchmark: the fault worker, one throwaway PostgreSQL; {cores} CPUs");
    equal_tenants();
    weighted();
    hundred_keys();
    rate();
}
