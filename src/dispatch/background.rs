//! The small thread pool for work off the loop and off the queue-write path: statistics
//! flushes, the body GC, reading the configuration overlay for a reload, counting rows
//! at unknown stages, and writing the stages injecting roles may inject into. Jobs use the dispatcher's r2d2 pool (`DB_POOL_SIZE`).

use crossbeam_channel::{Receiver, Sender};
use postgres::types::Type;

use super::events::{Event, EventSender};
use super::stats::{self, Deltas};
use crate::db::pool::Pool;
use crate::db::{self, sql};

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
    /// Read `pepsi.config_override`.
    ReadOverlay,
    /// Count pending rows at stages other than these.
    UnknownStages(Vec<String>),
    /// Write the stages an injecting role may inject into (`[pepsi] INJECT_STAGES` of
    /// the current graph).
    InjectStages(Vec<String>),
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
                Job::ReadOverlay => {
                    events.send(Event::Overlay(Err(e.message)));
                }
                Job::BodyGc => {
                    events.send(Event::BodyGcDone { more: true });
                }
                Job::UnknownStages(_) | Job::InjectStages(_) => {}
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
        Job::ReadOverlay => {
            events.send(Event::Overlay(
                db::read_overlay(&mut **conn).map_err(|e| db::describe(&e)),
            ));
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
}

fn name(job: &Job) -> &'static str {
    match job {
        Job::Flush(_) => "statistics flush",
        Job::BodyGc => "body GC",
        Job::ReadOverlay => "configuration reload",
        Job::UnknownStages(_) => "unknown-stage count",
        Job::InjectStages(_) => "entry stages",
    }
}
