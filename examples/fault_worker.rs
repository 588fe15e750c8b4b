//! A fault-injecting stage program for the dispatcher's tests, built on the worker
//! protocol by hand (it must be able to misbehave in ways the real runtime never does).
//!
//! Start-up is steered by the file named in `$FAULT_CONTROL` (re-read at every start):
//! `ok`, `exit78` (refuse to run), `die` (exit 1 before ready), `garbage` (print
//! something else than ready), `ready78` (ready, then exit 78 at the first id). Each message is steered by its row's `state.fault`:
//! `crash` (exit without answering), `hang`, `garbage-status`, `garbage-report`,
//! `tempfail` (75), `tempfail-once` (75, clearing the fault), `ioerr` (74), `slow` (300 ms), anything else advances the row to the
//! stage's `NEXT` (or deletes it). Every batch read from stdin is logged to
//! `$FAULT_LOG` as `batch N`; with `$FAULT_BATCH_ANSWERS` set a batch is answered only
//! once all of it ran, as the runtime's batched stages do.

use std::io::Write;

use pepsi::config::Config;
use pepsi::worker::input::IdReader;
use postgres::{Client, NoTls};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let config_path = args
        .iter()
        .position(|a| a == "-c")
        .map(|i| std::path::PathBuf::from(&args[i + 1]));
    let control = std::env::var("FAULT_CONTROL").ok();
    let mode = control
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "ok".into());
    match mode.as_str() {
        "exit78" => {
            eprintln!("fault_worker: refusing to run (told to by the control file)");
            std::process::exit(78);
        }
        "die" => std::process::exit(1),
        _ => {}
    }
    let config = Config::load(config_path.as_deref()).expect("configuration");
    let graph = config.file_graph().expect("stage graph");
    let mut db = Client::connect(&config.postgres.connection, NoTls).expect("database");
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if mode == "garbage" {
        writeln!(out, "hello?").unwrap();
        out.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_secs(30));
        return;
    }
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    let mut input = IdReader::stdin();
    let log = std::env::var("FAULT_LOG").ok();
    let delay: u64 = std::env::var("FAULT_DELAY_MS")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    // Answer a batch only once all of it ran, as the runtime's batched stages do.
    let batch_answers = std::env::var_os("FAULT_BATCH_ANSWERS").is_some();
    let mut pending_lines: Vec<String> = Vec::new();
    let mut writes: Vec<(i64, String, Option<String>)> = Vec::new();
    while let Some(ids) = input.next_batch(64).expect("ids") {
        if mode == "ready78" {
            eprintln!("fault_worker: refusing to run after ready (told to by the control file)");
            std::process::exit(78);
        }
        if let Some(path) = &log {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(f, "batch {}", ids.len()).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(delay));
        for id in ids {
            let row = db
                .query_opt(
                    "SELECT stage, coalesce(state->>'fault', '') FROM pepsi.workqueue WHERE workqueue_id = $1",
                    &[&id],
                )
                .expect("load");
            let Some(row) = row else {
                pending_lines.push("0".into());
                continue;
            };
            let (stage, fault): (String, String) = (row.get(0), row.get(1));
            let next = graph.get(&stage).and_then(|s| s.next.clone());
            // Batched answers also mean batched writes: nothing is committed until the
            // whole batch ran.
            let mut advance = |db: &mut Client| {
                writes.push((id, stage.clone(), next.clone()));
                if !batch_answers {
                    commit(db, &mut writes);
                }
            };
            match fault.as_str() {
                "crash" => std::process::exit(3),
                "hang" => loop {
                    std::thread::sleep(std::time::Duration::from_secs(60));
                },
                "garbage-status" => pending_lines.push("what?".into()),
                "garbage-report" => {
                    advance(&mut db);
                    pending_lines.push("0 {broken".into());
                }
                "tempfail" => pending_lines.push("75".into()),
                "tempfail-once" => {
                    db.execute(
                        "UPDATE pepsi.workqueue SET state = state - 'fault' WHERE workqueue_id = $1",
                        &[&id],
                    )
                    .expect("clear the fault");
                    pending_lines.push("75".into());
                }
                "ioerr" => pending_lines.push("74".into()),
                "slow" => {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                    advance(&mut db);
                    pending_lines.push("0".into());
                }
                _ => {
                    advance(&mut db);
                    pending_lines.push("0".into());
                }
            }
            if !batch_answers {
                answer(&mut out, &mut pending_lines);
            }
        }
        commit(&mut db, &mut writes);
        answer(&mut out, &mut pending_lines);
    }
}

fn answer(out: &mut impl Write, lines: &mut Vec<String>) {
    for line in lines.drain(..) {
        writeln!(out, "{line}").unwrap();
    }
    out.flush().unwrap();
}

/// Advances (or, without a NEXT, deletes) rows, guarded like the runtime's writes.
fn commit(db: &mut Client, writes: &mut Vec<(i64, String, Option<String>)>) {
    for (id, stage, next) in writes.drain(..) {
        match next {
            Some(next) => db.execute(
                "UPDATE pepsi.workqueue SET stage = $2, status = 'pending' \
                 WHERE workqueue_id = $1 AND status = 'running' AND stage = $3",
                &[&id, &next, &stage],
            ),
            None => db.execute(
                "DELETE FROM pepsi.workqueue WHERE workqueue_id = $1 AND status = 'running' AND stage = $2",
                &[&id, &stage],
            ),
        }
        .expect("write");
    }
}
