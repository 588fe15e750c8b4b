//! A fault-injecting stage program for the dispatcher's tests, built on the worker
//! protocol by hand (it must be able to misbehave in ways the real runtime never does).
//!
//! Its database session is named like a real worker's
//! (`pepsi::protocol::own_session_name`): the name the dispatcher gave it in
//! `$PGAPPNAME`, or `pepsi-worker:PID:STAGE` with STAGE from `$PEPSI_WORKER_STAGE`
//! (`fault` without it) when started by hand, so the dispatcher can find and terminate
//! it. It takes each row's claim token from its assignment line and writes every
//! outcome through the schema's guarded functions with it, as the runtime does (SPEC
//! §6).
//!
//! Start-up is steered by the file named in `$FAULT_CONTROL` (re-read at every start):
//! `ok`, `exit78` (refuse to run), `exit75` / `exit74` (exit so before ready, as a
//! worker refused a connection for overload or unable to reach the database does),
//! `die` (exit 1 before ready), `slowready` (ready only after 3 s), `garbage` (print
//! something else than ready), `ready78` (ready, then exit 78 at the first id). Each
//! message is steered by its row's `state.fault`: `crash` (exit without answering),
//! `hang`, `db-sleep` (hang inside a statement: `SELECT pg_sleep(3600)` on its database
//! session), `garbage-status`, `garbage-report`, `report-unknown` (advance, then report
//! a stage that is not in the graph: `0 [["nosuch-stage",5]]`), `report-huge` (advance,
//! then report 2^62 µs for the row's stage), `tempfail` (75), `tempfail-once` (75,
//! clearing the fault), `ioerr` (74), `ioerr-once` (74, clearing the fault), `slow`
//! (300 ms); anything else advances the row to
//! the stage's `NEXT` (or deletes it). A message's `state.cost_ms` is slept before it
//! is handled (what it costs at the stage). Every batch read from stdin is logged to
//! `$FAULT_LOG` as `batch N`; with `$FAULT_BATCH_ANSWERS` set a batch is answered only
//! once all of it ran, as the runtime's batched stages do.

use std::io::Write;

use pepsi::config::Config;
use pepsi::db::sql;
use pepsi::worker::input::IdReader;
use postgres::{Client, NoTls};

/// One outcome to commit: the id, the stage it was claimed at, where it goes (None:
/// done, deleted) and the claim token it was loaded with.
type Outcome = (i64, String, Option<String>, i64);

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
        "exit75" => std::process::exit(75),
        "exit74" => std::process::exit(74),
        "slowready" => std::thread::sleep(std::time::Duration::from_secs(3)),
        _ => {}
    }
    let config = Config::load(config_path.as_deref()).expect("configuration");
    let graph = config.file_graph().expect("stage graph");
    let mut db = connect(
        config
            .postgres
            .connection_for(pepsi::config::DbRole::Worker),
    );
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
    let mut writes: Vec<Outcome> = Vec::new();
    while let Some(batch) = input.next_batch(64).expect("ids") {
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
            writeln!(f, "batch {}", batch.len()).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(delay));
        for assignment in batch {
            let (id, claim) = (assignment.id, assignment.token);
            let row = db
                .query_opt(
                    "SELECT stage, coalesce(state->>'fault', ''), \
                            coalesce((state->>'cost_ms')::int8, 0) \
                       FROM pepsi.workqueue WHERE workqueue_id = $1",
                    &[&id],
                )
                .expect("load");
            let Some(row) = row else {
                pending_lines.push("0".into());
                continue;
            };
            let (stage, fault): (String, String) = (row.get(0), row.get(1));
            // What the message costs at this stage: its `state.cost_ms`.
            let cost: i64 = row.get(2);
            std::thread::sleep(std::time::Duration::from_millis(cost.max(0) as u64));
            let next = graph.get(&stage).and_then(|s| s.next.clone());
            // Batched answers also mean batched writes: nothing is committed until the
            // whole batch ran.
            let mut advance = |db: &mut Client| {
                writes.push((id, stage.clone(), next.clone(), claim));
                if !batch_answers {
                    commit(db, &mut writes);
                }
            };
            match fault.as_str() {
                "crash" => std::process::exit(3),
                "hang" => hang(),
                "db-sleep" => {
                    // Hangs inside a statement: only the dispatcher terminating the
                    // session ends it on the server.
                    if let Err(e) = db.batch_execute("SELECT pg_sleep(3600)") {
                        eprintln!("fault_worker: the sleeping statement ended: {e}");
                    }
                    hang();
                }
                "garbage-status" => pending_lines.push("what?".into()),
                "garbage-report" => {
                    advance(&mut db);
                    pending_lines.push("0 {broken".into());
                }
                "report-unknown" => {
                    advance(&mut db);
                    pending_lines.push(r#"0 [["nosuch-stage",5]]"#.into());
                }
                "report-huge" => {
                    advance(&mut db);
                    // 2^62 µs: two of them overflow a signed 64-bit sum.
                    let name = serde_json::to_string(&stage).unwrap();
                    pending_lines.push(format!("0 [[{name},4611686018427387904]]"));
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
                "ioerr-once" => {
                    db.execute(
                        "UPDATE pepsi.workqueue SET state = state - 'fault' WHERE workqueue_id = $1",
                        &[&id],
                    )
                    .expect("clear the fault");
                    pending_lines.push("74".into());
                }
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

/// Connects with the session named as the dispatcher said, or as a worker of
/// `$PEPSI_WORKER_STAGE` (or `fault`).
fn connect(conninfo: &str) -> Client {
    let stage = std::env::var(pepsi::protocol::WORKER_STAGE_ENV).unwrap_or_else(|_| "fault".into());
    let mut pg: postgres::Config = conninfo.parse().expect("[pepsi-postgres] CONNECTION");
    pg.application_name(&pepsi::protocol::own_session_name(&stage));
    pg.connect(NoTls).expect("database")
}

fn hang() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

fn answer(out: &mut impl Write, lines: &mut Vec<String>) {
    for line in lines.drain(..) {
        writeln!(out, "{line}").unwrap();
    }
    out.flush().unwrap();
}

/// Advances (or, without a NEXT, deletes) rows through the runtime's guarded
/// functions: only a row still `running` at the stage it was claimed at, under the
/// claim token handed with its id, is written.
fn commit(db: &mut Client, writes: &mut Vec<Outcome>) {
    for (id, stage, next, claim) in writes.drain(..) {
        match next {
            Some(next) => {
                let state: String = db
                    .query_one(
                        "SELECT state::text FROM pepsi.workqueue WHERE workqueue_id = $1",
                        &[&id],
                    )
                    .map(|r| r.get(0))
                    .unwrap_or_else(|_| "{}".into());
                let row = serde_json::json!([{
                    "id": id, "claimed": stage, "claim": claim, "stage": next,
                    "status": "pending", "delay_ms": null,
                    "state": serde_json::from_str::<serde_json::Value>(&state).unwrap(),
                }]);
                db.query(sql::WRITE_OUTCOMES, &[&row.to_string()])
            }
            None => {
                let row = serde_json::json!([{"id": id, "claimed": stage, "claim": claim}]);
                db.query(sql::DELETE_FINISHED, &[&row.to_string()])
            }
        }
        .expect("write");
    }
}
