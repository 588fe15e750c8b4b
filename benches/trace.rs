//! The trace benchmark: `cargo bench --bench trace` (release build). Fills
//! `pepsi.history` (schema 22) of a throwaway cluster (or `DATABASE_URL`'s server) with
//! the records of `BENCH_MESSAGES` finished messages (default 1,000,000: one delivered
//! recipient each with a Message-ID and the next hop's queue id, and every tenth split
//! in two with the part bounced), then times `pepsi-queue trace` — by id, by a part's id,
//! by Message-ID and by the next hop's queue id — as an operator runs it (the program,
//! its start and its connection included), median of 5 each. Figures, never assertions.

#[allow(dead_code)]
#[path = "../tests/util/pg.rs"]
mod pg;

use std::process::Command;
use std::time::Instant;

use pg::TestDb;

/// The records of `n` messages, as the outcome functions write them, in one statement.
const FILL: &str = "\
    INSERT INTO pepsi.history (at, workqueue_id, origin, event, stage, mail_from, recipient, \
                               message_id, relay, reply, remote_id, dsn, arrived, queued_ms, \
                               stage_ms, trail, detail) \
    SELECT now() - (i % 86400) * interval '1 second', x.id, i, x.event, 'out', \
           'sender' || (i % 977) || '@example.org', x.rcpt, '<' || i || '@bench.example>', \
           'mx.example.net[192.0.2.1]:25', x.reply, x.remote, x.dsn, \
           now() - (i % 86400) * interval '1 second' - interval '2 seconds', 1, 40, \
           E'in 12 1733377200123\\nout 40123 1733377200200\\n', x.detail \
      FROM generate_series(1, $1::int8) i, \
           LATERAL (SELECT i AS id, 'delivered' AS event, 'r' || i || '@example.net' AS rcpt, \
                           '250 2.0.0 Ok: queued as Q' || i AS reply, 'Q' || i AS remote, \
                           '2.0.0' AS dsn, NULL::jsonb AS detail \
                    UNION ALL \
                    SELECT $1 + i, 'split', NULL, NULL, NULL, NULL, \
                           jsonb_build_object('from', i, 'recipients', \
                                              jsonb_build_array('s' || i || '@example.net')) \
                     WHERE i % 10 = 0 \
                    UNION ALL \
                    SELECT $1 + i, 'bounced', 's' || i || '@example.net', \
                           '550 5.1.1 unknown user', NULL, '5.1.1', NULL \
                     WHERE i % 10 = 0) x";

/// Median of five runs of `pepsi-queue -c conf trace ARGS --json`, in milliseconds, and
/// the number of history entries the last one showed.
fn time_trace(conf: &std::path::Path, args: &[&str]) -> (f64, usize) {
    let mut times = Vec::new();
    let mut shown = 0;
    for _ in 0..5 {
        let started = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_pepsi-queue"))
            .arg("-c")
            .arg(conf)
            .arg("trace")
            .args(args)
            .arg("--json")
            .output()
            .expect("pepsi-queue");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        assert!(
            out.status.success(),
            "trace {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        shown = doc["messages"].as_array().map_or(0, |m| {
            m.iter()
                .map(|t| t["history"].as_array().map_or(0, |h| h.len()))
                .sum()
        });
    }
    times.sort_by(f64::total_cmp);
    (times[2], shown)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: i64 = std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let db = TestDb::new();
    let mut c = db.client();
    let started = Instant::now();
    c.execute(FILL, &[&n]).unwrap();
    c.batch_execute("ANALYZE pepsi.history").unwrap();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.history", &[])
        .unwrap()
        .get(0);
    let size: String = c
        .query_one(
            "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_inherits i \
               JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'pepsi.history'::regclass",
            &[],
        )
        .unwrap()
        .get(0);
    println!(
        "history: {n} messages, {rows} rows, {size}, filled in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let dir = std::env::temp_dir().join(format!("pepsi-trace-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("pepsi.conf");
    std::fs::write(
        &conf,
        format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n",
            db.connection()
        ),
    )
    .unwrap();
    let middle = n / 2 / 10 * 10;
    let cases = [
        ("by id", vec![middle.to_string()]),
        ("by a split part's id", vec![(n + middle).to_string()]),
        (
            "by Message-ID",
            vec!["--message-id".into(), format!("<{middle}@bench.example>")],
        ),
        (
            "by the next hop's queue id",
            vec!["--remote-id".into(), format!("Q{middle}")],
        ),
    ];
    for (what, args) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ms, shown) = time_trace(&conf, &args);
        println!("pepsi-queue trace {what}: {ms:.1} ms (median of 5; {shown} history entries)");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
