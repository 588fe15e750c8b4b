//! The small thread pool for work off the loop and off the queue-write path: statistics
//! flushes, the body GC, reading a reload's inputs (the configuration overlay and the
//! file), counting rows at unknown stages, writing the stages injecting roles may
//! inject into, and reading who holds the database's oldest snapshot. Jobs use the dispatcher's r2d2 pool (`DB_POOL_SIZE`).
//!
//! The loop's housekeeping ([`super::housekeeping`]) sends the jobs; each answers, if
//! at all, with an event. A job reads or writes the database and, for a reload, the
//! configuration file; it touches no state of the loop.

use std::path::{Path, PathBuf};

use crossbeam_channel::{Receiver, Sender};
use postgres::types::Type;

use super::events::{Event, EventSender, ReloadFile, ReloadInput};
use super::shares::Share;
use super::stats::{self, Deltas};
use crate::config::Config;
use crate::db::pool::Pool;
use crate::db::{self, horizon, sql};

/// Threads in the pool.
const THREADS: usize = 2;
/// Bodies collected per GC run (§10).
pub const BODY_GC_LIMIT: i32 = 10_000;

/// A job.
#[derive(Debug)]
pub enum Job {
    /// Write these deltas.
    Flush(Box<Deltas>),
    /// Run `pepsi.workqueue_body_gc`.
    BodyGc,
    /// Read a reload's inputs: `pepsi.config_override` and the configuration file at
    /// this path.
    ReadReload(PathBuf),
    /// Count pending rows at stages other than these.
    UnknownStages(Vec<String>),
    /// Write the stages an injecting role may inject into (`[pepsi] INJECT_STAGES` of
    /// the current graph).
    InjectStages(Vec<String>),
    /// Read who holds the database's oldest snapshot.
    Horizon,
    /// The delivery history's upkeep, keeping this many days.
    History(i32),
    /// What each tenant got at each stage over the last minute (§7 "Seen").
    Shares(Vec<Share>),
}

/// Starts the pool; jobs sent to the returned sender run in order of arrival.
pub fn spawn(pool: Pool, events: EventSender) -> std::io::Result<Sender<Job>> {
    let (tx, rx) = crossbeam_channel::unbounded::<Job>();
    for n in 0..THREADS {
        let (rx, pool, watcher): (Receiver<Job>, Pool, EventSender) =
            (rx.clone(), pool.clone(), events.clone());
        let events = events.clone();
        super::events::spawn_watched(&format!("background-{n}"), watcher, move || {
            for job in rx {
                run(&pool, &events, job);
            }
        })?;
    }
    Ok(tx)
}

fn run(pool: &Pool, events: &EventSender, job: Job) {
    let mut conn = match pool.get() {
        Ok(c) => c,
        Err(e) => {
            log::warn!(
                "background job {}: no database connection: {}",
                name(&job),
                e.message
            );
            match job {
                Job::Flush(d) => {
                    events.send(Event::Flushed(Err((e.message, d))));
                }
                Job::ReadReload(path) => {
                    let (overlay, weights) = (Err(e.message.clone()), Err(e.message));
                    let file = read_config_file(&path);
                    let input = ReloadInput {
                        overlay,
                        weights,
                        file,
                    };
                    events.send(Event::ReloadRead(Box::new(input)));
                }
                Job::BodyGc => {
                    events.send(Event::BodyGcDone { more: true });
                }
                Job::Horizon => {
                    events.send(Event::Horizon(Err(e.message)));
                }
                Job::UnknownStages(_) | Job::InjectStages(_) | Job::History(_) | Job::Shares(_) => {
                }
            }
            return;
        }
    };
    match job {
        Job::Flush(d) => {
            let result = stats::flush(&mut conn, &d).map_err(|e| (db::describe(&e), d));
            events.send(Event::Flushed(result));
        }
        Job::BodyGc => match conn.query_typed_one(sql::BODY_GC, &[(&BODY_GC_LIMIT, Type::INT4)]) {
            Ok(row) => {
                let n: i32 = row.get(0);
                if n > 0 {
                    log::info!("body GC removed {n} unreferenced bodies");
                }
                events.send(Event::BodyGcDone {
                    more: n >= BODY_GC_LIMIT,
                });
            }
            Err(e) => {
                log::warn!("body GC failed: {}", db::describe(&e));
                events.send(Event::BodyGcDone { more: true });
            }
        },
        Job::ReadReload(path) => {
            let overlay = db::read_overlay(&mut **conn).map_err(|e| db::describe(&e));
            let weights = conn
                .query(sql::READ_FAIR_WEIGHTS, &[])
                .map(|rows| {
                    rows.iter()
                        .map(|r| (r.get(0), r.get(1), r.get(2)))
                        .collect()
                })
                .map_err(|e| db::describe(&e));
            let file = read_config_file(&path);
            let input = ReloadInput {
                overlay,
                weights,
                file,
            };
            events.send(Event::ReloadRead(Box::new(input)));
        }
        Job::UnknownStages(known) => {
            match conn.query_typed(sql::UNKNOWN_STAGES, &[(&known, Type::TEXT_ARRAY)]) {
                Ok(rows) => {
                    events.send(Event::UnknownStages(
                        rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
                    ));
                }
                Err(e) => log::warn!("cannot count rows at unknown stages: {}", db::describe(&e)),
            }
        }
        Job::Horizon => {
            let holders = horizon::read(&mut **conn).map_err(|e| db::describe(&e));
            events.send(Event::Horizon(holders));
        }
        // Hourly and idempotent: a failure waits for the next hour (partitions are
        // made two days ahead; rows meanwhile go to the default partition).
        // Best effort, as the statistics: the next tick writes the figures again.
        Job::Shares(list) => {
            let col = |f: fn(&Share) -> i64| list.iter().map(f).collect::<Vec<i64>>();
            let stages: Vec<&str> = list.iter().map(|s| s.stage.as_str()).collect();
            let tenants: Vec<&str> = list.iter().map(|s| s.tenant.as_str()).collect();
            let weights: Vec<f64> = list.iter().map(|s| s.weight).collect();
            let written = conn.query_typed(
                sql::WRITE_TENANT_SHARES,
                &[
                    (&stages, Type::TEXT_ARRAY),
                    (&tenants, Type::TEXT_ARRAY),
                    (&col(|s| s.worker_us), Type::INT8_ARRAY),
                    (&col(|s| s.messages), Type::INT8_ARRAY),
                    (&col(|s| s.throttled_us), Type::INT8_ARRAY),
                    (&weights, Type::FLOAT8_ARRAY),
                ],
            );
            if let Err(e) = written {
                log::warn!("cannot write the tenants' shares: {}", db::describe(&e));
            }
        }
        Job::History(days) => match conn
            .query_typed_one(sql::HISTORY_MAINTAIN, &[(&days, Type::INT4)])
        {
            Ok(row) => {
                let dropped: i32 = row.get(0);
                if dropped > 0 {
                    log::info!("delivery history: {dropped} day(s) older than {days} days dropped");
                }
            }
            Err(e) => log::warn!("delivery history upkeep failed: {}", db::describe(&e)),
        },
        // Idempotent and rewritten at every start and reload, a reconnect included (a
        // reconnected LISTEN session reloads): a failure here is only a warning.
        Job::InjectStages(stages) => match db::write_inject_stages(&mut **conn, &stages) {
            Ok(true) => log::info!(
                "stages an injecting role may inject into: {}",
                if stages.is_empty() {
                    "none".to_string()
                } else {
                    stages.join(", ")
                }
            ),
            Ok(false) => {}
            Err(e) => log::warn!(
                "cannot write the stages an injecting role may inject into: {}",
                db::describe(&e)
            ),
        },
    }
    if conn.is_closed() {
        // The session was lost: so were the pool's others, to the same server.
        pool.forget_connections();
    }
}

fn name(job: &Job) -> &'static str {
    match job {
        Job::Flush(_) => "statistics flush",
        Job::BodyGc => "body GC",
        Job::History(_) => "history upkeep",
        Job::ReadReload(_) => "configuration reload",
        Job::UnknownStages(_) => "unknown-stage count",
        Job::InjectStages(_) => "entry stages",
        Job::Horizon => "oldest snapshot",
        Job::Shares(_) => "tenant shares",
    }
}

/// Reads the configuration file for a reload. A file that cannot be opened right now
/// (replaced, briefly missing) is not a broken configuration: the reload keeps the
/// graph and tries again.
pub fn read_config_file(path: &Path) -> ReloadFile {
    if let Err(e) = std::fs::File::open(path) {
        return ReloadFile::Unreadable(e.to_string());
    }
    match Config::load(Some(path)) {
        Ok(c) => ReloadFile::Parsed(Box::new(c)),
        Err(errors) => ReloadFile::Invalid(errors),
    }
}
