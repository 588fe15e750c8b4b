//! `pepsi-queue status`, and the snapshot it shares with `metrics`: rows per stage and
//! status with the oldest age, the age shape per stage (Postfix `qshape`), the rows at
//! stages that have no section, the statistics tables (`metrics` alone shows
//! `pepsi.ingress_stats`), whether a dispatcher holds its lock, who holds the
//! database's oldest snapshot ([`super::horizon`]), and relay-to-internet's destinations
//! in trouble (`metrics` alone shows them, [`super::destinations`]) — all read in one
//! read-only transaction, so the numbers agree.
//!
//! [`Snapshot::read`] is the only database access; everything else here is rendering.
//! Stage names come from rows as well as from the configuration: the text shows them
//! escaped (its tables escape every cell, [`crate::escape`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use postgres::IsolationLevel;
use serde_json::{Value, json};

use super::destinations::{self, Destination};
use super::format::{Align, Table, age};
use super::horizon;
use super::tenants::{self, StageShares};
use super::{Session, configured_stages, db_failure, emit, emit_json};
use crate::db::horizon::Holder;
use crate::db::{self, sql};
use crate::escape::Visible;
use crate::exit::Failure;

/// The age buckets' lower bounds in seconds (the first bucket starts at 0).
pub const BUCKET_BOUNDS: [f64; 6] = [300.0, 600.0, 1200.0, 2400.0, 4800.0, 9600.0];
/// The age buckets' names, one more than the bounds.
pub const BUCKET_NAMES: [&str; 7] = [
    "0-5m", "5-10m", "10-20m", "20-40m", "40-80m", "80-160m", "160m+",
];

/// Rows at one stage in one status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cell {
    /// How many.
    pub rows: i64,
    /// The oldest one's age in seconds.
    pub oldest: f64,
    /// How many in each age bucket.
    pub buckets: [i64; 7],
}

/// One row of `pepsi.stage_stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageStats {
    /// The stage.
    pub stage: String,
    /// The counters in column order: passes, fused passes, failures, crashes,
    /// timeouts, requeues, busy µs, deferrals, senders served.
    pub counters: [i64; 9],
    /// When the dispatcher last added to the row (epoch seconds).
    pub updated: f64,
    /// The same in ISO 8601 (UTC).
    pub updated_text: String,
}

/// The names of [`StageStats::counters`], as in the table.
pub const STAGE_COUNTERS: [&str; 9] = [
    "passes",
    "fused_passes",
    "failures",
    "crashes",
    "timeouts",
    "requeues",
    "busy_us",
    "deferrals",
    "senders_served",
];

/// The row of `pepsi.dispatch_stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DispatchStats {
    /// stages_executed, claims, rows_claimed, worker_starts.
    pub counters: [i64; 4],
    /// When the dispatcher last flushed (epoch seconds).
    pub updated: f64,
    /// The same in ISO 8601 (UTC).
    pub updated_text: String,
}

/// The names of [`DispatchStats::counters`], as in the table.
pub const DISPATCH_COUNTERS: [&str; 4] =
    ["stages_executed", "claims", "rows_claimed", "worker_starts"];

/// The one row of `pepsi.ingress_stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IngressStats {
    /// sessions, accepted, recipients, deferred, refused, commits, TLS sessions.
    pub counters: [i64; 7],
    /// When `pepsi-ingress` last added to them (epoch seconds).
    pub updated: f64,
}

/// The names of [`IngressStats::counters`], as in the table.
pub const INGRESS_COUNTERS: [&str; 7] = [
    "sessions",
    "accepted",
    "recipients",
    "deferred",
    "refused",
    "commits",
    "tls_sessions",
];

/// Everything `status` and `metrics` show, read at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Every status value, in the type's order.
    pub statuses: Vec<String>,
    /// Rows by stage, then status.
    pub cells: BTreeMap<String, BTreeMap<String, Cell>>,
    /// The stages that have a section (file and overlay).
    pub configured: BTreeSet<String>,
    /// `pepsi.stage_stats`.
    pub stage_stats: Vec<StageStats>,
    /// `pepsi.stage_events`: (stage, event, count).
    pub stage_events: Vec<(String, String, i64)>,
    /// `pepsi.dispatch_stats`.
    pub dispatch: DispatchStats,
    /// `pepsi.ingress_stats`.
    pub ingress: IngressStats,
    /// Does a session hold the dispatcher's lock.
    pub dispatcher_running: bool,
    /// The database's clock (epoch seconds).
    pub now: f64,
    /// Who holds the database's oldest snapshot, oldest first (this session excluded).
    pub holders: Vec<Holder>,
    /// `[pepsi-dispatch] SNAPSHOT_WARNING` of the file.
    pub snapshot_warning: Duration,
    /// `pepsi.destinations`: relay-to-internet's destinations in trouble, suspended
    /// first.
    pub destinations: Vec<Destination>,
    /// Per stage, the tenants waiting and what each got over the last minute (§7).
    pub shares: BTreeMap<String, StageShares>,
}

impl Snapshot {
    /// Reads the snapshot in one read-only repeatable-read transaction.
    pub fn read(session: &mut Session) -> Result<Snapshot, Failure> {
        let failed = |e: postgres::Error| db_failure("reading the queue", &e);
        let mut tx = session
            .client
            .transaction_with(IsolationLevel::RepeatableRead, true)
            .map_err(failed)?;
        let statuses: Vec<String> = tx
            .query(sql::QUEUE_STATUSES, &[])
            .map_err(failed)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut cells: BTreeMap<String, BTreeMap<String, Cell>> = BTreeMap::new();
        for r in tx
            .query(sql::QUEUE_SHAPE, &[&BUCKET_BOUNDS.to_vec()])
            .map_err(failed)?
        {
            let cell = cells
                .entry(r.get(0))
                .or_default()
                .entry(r.get(1))
                .or_default();
            let bucket: i32 = r.get(2);
            let rows: i64 = r.get(3);
            let oldest: f64 = r.get(4);
            cell.rows += rows;
            cell.buckets[bucket.clamp(0, 6) as usize] += rows;
            if cell.rows == rows || oldest > cell.oldest {
                cell.oldest = oldest;
            }
        }
        let stage_stats = tx
            .query(sql::QUEUE_STAGE_STATS, &[])
            .map_err(failed)?
            .iter()
            .map(|r| StageStats {
                stage: r.get(0),
                counters: std::array::from_fn(|i| r.get(i + 1)),
                updated: r.get(10),
                updated_text: r.get(11),
            })
            .collect();
        let d = tx
            .query_one(sql::QUEUE_DISPATCH_STATS, &[])
            .map_err(failed)?;
        let dispatch = DispatchStats {
            counters: std::array::from_fn(|i| d.get(i)),
            updated: d.get(4),
            updated_text: d.get(5),
        };
        let now: f64 = d.get(6);
        let i = tx
            .query_one(sql::QUEUE_INGRESS_STATS, &[])
            .map_err(failed)?;
        let ingress = IngressStats {
            counters: std::array::from_fn(|n| i.get(n)),
            updated: i.get(7),
        };
        let dispatcher_running: bool = tx
            .query_one(sql::DISPATCHER_RUNNING, &[&sql::DISPATCH_LOCK_KEY])
            .map_err(failed)?
            .get(0);
        let stage_events = tx
            .query(sql::QUEUE_STAGE_EVENTS, &[])
            .map_err(failed)?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let overlay = db::read_overlay(&mut tx).map_err(failed)?;
        let holders = db::horizon::read(&mut tx).map_err(failed)?;
        let destinations = destinations::read(&mut tx).map_err(failed)?;
        let with_rows: Vec<&str> = cells.keys().map(String::as_str).collect();
        let shares = tenants::read(&mut tx, &with_rows).map_err(failed)?;
        tx.commit().map_err(failed)?;
        Ok(Snapshot {
            statuses,
            cells,
            configured: configured_stages(&session.config, &overlay),
            stage_stats,
            stage_events,
            dispatch,
            ingress,
            dispatcher_running,
            now,
            holders,
            snapshot_warning: session.config.dispatch.snapshot_warning,
            destinations,
            shares,
        })
    }

    /// Every stage with a section or with rows, by name.
    pub fn stages(&self) -> BTreeSet<&str> {
        self.configured
            .iter()
            .map(String::as_str)
            .chain(self.cells.keys().map(String::as_str))
            .collect()
    }

    /// Rows at a stage in a status (0 when none).
    pub fn rows(&self, stage: &str, status: &str) -> i64 {
        self.cell(stage, status).map_or(0, |c| c.rows)
    }

    /// The cell of a stage and status, if it has rows.
    pub fn cell(&self, stage: &str, status: &str) -> Option<&Cell> {
        self.cells.get(stage).and_then(|s| s.get(status))
    }

    /// A stage's rows in every status together: count, oldest age (`None` when empty)
    /// and age buckets.
    pub fn stage_total(&self, stage: &str) -> Cell {
        let mut total = Cell::default();
        for cell in self.cells.get(stage).into_iter().flat_map(|s| s.values()) {
            if total.rows == 0 || cell.oldest > total.oldest {
                total.oldest = cell.oldest;
            }
            total.rows += cell.rows;
            for (t, b) in total.buckets.iter_mut().zip(cell.buckets) {
                *t += b;
            }
        }
        total
    }

    /// Stages that have rows but no section (never claimed), with their row counts.
    pub fn unknown_stages(&self) -> Vec<(&str, i64)> {
        self.cells
            .keys()
            .filter(|s| !self.configured.contains(*s))
            .map(|s| (s.as_str(), self.stage_total(s).rows))
            .collect()
    }

    /// Rows in a status over all stages.
    pub fn status_total(&self, status: &str) -> i64 {
        self.cells
            .values()
            .filter_map(|s| s.get(status))
            .map(|c| c.rows)
            .sum()
    }

    /// Seconds since the dispatcher last flushed its statistics.
    pub fn flush_age(&self) -> f64 {
        self.now - self.dispatch.updated
    }
}

/// A float for JSON: `null` when it is not finite.
fn finite(x: f64) -> Value {
    if x.is_finite() { json!(x) } else { Value::Null }
}

/// The snapshot as one JSON document.
pub fn to_json(s: &Snapshot) -> Value {
    let stages: Vec<Value> = s
        .stages()
        .into_iter()
        .map(|stage| {
            let total = s.stage_total(stage);
            let by_status: serde_json::Map<String, Value> = s
                .statuses
                .iter()
                .map(|st| {
                    let cell = s.cell(stage, st);
                    (
                        st.clone(),
                        json!({
                            "rows": cell.map_or(0, |c| c.rows),
                            "oldest_age_seconds": cell.map_or(Value::Null, |c| finite(c.oldest)),
                        }),
                    )
                })
                .collect();
            json!({
                "stage": stage,
                "configured": s.configured.contains(stage),
                "rows": total.rows,
                "oldest_age_seconds": if total.rows > 0 { finite(total.oldest) } else { Value::Null },
                "statuses": by_status,
                "age_buckets": total.buckets,
            })
        })
        .collect();
    let totals: serde_json::Map<String, Value> = s
        .statuses
        .iter()
        .map(|st| (st.clone(), json!(s.status_total(st))))
        .collect();
    let unknown: Vec<Value> = s
        .unknown_stages()
        .iter()
        .map(|(stage, rows)| json!({"stage": stage, "rows": rows}))
        .collect();
    let stage_stats: Vec<Value> = s
        .stage_stats
        .iter()
        .map(|st| {
            let mut o = serde_json::Map::new();
            o.insert("stage".into(), json!(st.stage));
            for (name, v) in STAGE_COUNTERS.iter().zip(st.counters) {
                o.insert((*name).into(), json!(v));
            }
            o.insert("updated".into(), json!(st.updated_text));
            Value::Object(o)
        })
        .collect();
    let mut dispatch = serde_json::Map::new();
    for (name, v) in DISPATCH_COUNTERS.iter().zip(s.dispatch.counters) {
        dispatch.insert((*name).into(), json!(v));
    }
    dispatch.insert("updated".into(), json!(s.dispatch.updated_text));
    dispatch.insert("updated_age_seconds".into(), finite(s.flush_age()));
    let rows: i64 = s
        .cells
        .values()
        .flat_map(|m| m.values())
        .map(|c| c.rows)
        .sum();
    let shares: Vec<Value> = s
        .shares
        .iter()
        .map(|(stage, sh)| {
            let list: Vec<Value> = sh
                .tenants
                .iter()
                .map(|t| {
                    json!({
                        "tenant": t.tenant,
                        "waiting": t.waiting,
                        "worker_seconds": t.worker_us as f64 / 1e6,
                        "messages": t.messages,
                        "weight": finite(t.weight),
                        "throttled_seconds": t.throttled_us as f64 / 1e6,
                    })
                })
                .collect();
            json!({
                "stage": stage,
                "tenants_waiting": sh.waiting,
                "jain_index": sh.jain().map_or(Value::Null, finite),
                "tenants": list,
            })
        })
        .collect();
    let mut doc = json!({
        "rows": rows,
        "fair_shares": shares,
        "statuses": totals,
        "age_buckets": BUCKET_NAMES,
        "stages": stages,
        "unknown_stages": unknown,
        "stage_stats": stage_stats,
        "dispatch_stats": dispatch,
        "dispatcher_running": s.dispatcher_running,
    });
    for (key, value) in horizon::json_fields(&s.holders, s.snapshot_warning) {
        doc[key] = value;
    }
    doc
}

/// The snapshot for people.
pub fn to_text(s: &Snapshot) -> String {
    let mut out = String::new();
    let total: i64 = s
        .cells
        .values()
        .flat_map(|m| m.values())
        .map(|c| c.rows)
        .sum();
    let by_status: Vec<String> = s
        .statuses
        .iter()
        .map(|st| format!("{st} {}", s.status_total(st)))
        .collect();
    out.push_str(&format!(
        "queue: {total} message{} ({})\ndispatcher: {}\n{}\n",
        if total == 1 { "" } else { "s" },
        by_status.join(", "),
        if s.dispatcher_running {
            "running"
        } else {
            "NOT RUNNING (no session holds its lock)"
        },
        horizon::text(&s.holders, s.snapshot_warning)
    ));

    let mut columns = vec![("STAGE", Align::Left)];
    columns.extend(s.statuses.iter().map(|st| (st.as_str(), Align::Right)));
    columns.extend([("TOTAL", Align::Right), ("OLDEST", Align::Right)]);
    let mut table = Table::new(&columns);
    for stage in s.stages() {
        let t = s.stage_total(stage);
        let mut cells = vec![if s.configured.contains(stage) {
            stage.to_string()
        } else {
            format!("{stage} (no section)")
        }];
        cells.extend(s.statuses.iter().map(|st| s.rows(stage, st).to_string()));
        cells.push(t.rows.to_string());
        cells.push(if t.rows > 0 {
            age(t.oldest)
        } else {
            "-".into()
        });
        table.row(cells);
    }
    out.push_str(&table.render());

    let unknown = s.unknown_stages();
    if !unknown.is_empty() {
        let list: Vec<String> = unknown
            .iter()
            .map(|(stage, rows)| format!("{} ({rows})", Visible(stage)))
            .collect();
        out.push_str(&format!(
            "\nrows at stages without a [stage-NAME] section are never claimed: {}\n",
            list.join(", ")
        ));
    }

    out.push_str("\nmessages by age (since arrival):\n");
    let mut columns = vec![("STAGE", Align::Left), ("TOTAL", Align::Right)];
    columns.extend(BUCKET_NAMES.iter().map(|b| (*b, Align::Right)));
    let mut shape = Table::new(&columns);
    let mut all = Cell::default();
    let stages: Vec<&str> = s.cells.keys().map(String::as_str).collect();
    let totals: Vec<Cell> = stages.iter().map(|st| s.stage_total(st)).collect();
    for t in &totals {
        all.rows += t.rows;
        for (a, b) in all.buckets.iter_mut().zip(t.buckets) {
            *a += b;
        }
    }
    let shape_row = |name: &str, c: &Cell| {
        let mut cells = vec![name.to_string(), c.rows.to_string()];
        cells.extend(c.buckets.iter().map(i64::to_string));
        cells
    };
    shape.row(shape_row("TOTAL", &all));
    for (stage, t) in stages.iter().zip(&totals) {
        shape.row(shape_row(stage, t));
    }
    out.push_str(&shape.render());

    out.push_str("\nstatistics per stage (pepsi.stage_stats, since installation):\n");
    if s.stage_stats.is_empty() {
        out.push_str("  none yet\n");
    } else {
        let mut stats = Table::new(&[
            ("STAGE", Align::Left),
            ("PASSES", Align::Right),
            ("FUSED", Align::Right),
            ("FAILURES", Align::Right),
            ("CRASHES", Align::Right),
            ("TIMEOUTS", Align::Right),
            ("REQUEUES", Align::Right),
            ("DEFERRALS", Align::Right),
            ("SENDERS", Align::Right),
            ("BUSY", Align::Right),
            ("MS/PASS", Align::Right),
            ("UPDATED", Align::Left),
        ]);
        for st in &s.stage_stats {
            let c = st.counters;
            let per_pass = if c[0] > 0 {
                format!("{:.1}", c[6] as f64 / c[0] as f64 / 1000.0)
            } else {
                "-".into()
            };
            stats.row(vec![
                st.stage.clone(),
                c[0].to_string(),
                c[1].to_string(),
                c[2].to_string(),
                c[3].to_string(),
                c[4].to_string(),
                c[5].to_string(),
                c[7].to_string(),
                c[8].to_string(),
                age(c[6] as f64 / 1e6),
                per_pass,
                format!("{} ago", age(s.now - st.updated)),
            ]);
        }
        out.push_str(&stats.render());
    }
    out.push_str(&shares_text(s));
    let d = s.dispatch.counters;
    out.push_str(&format!(
        "\ndispatcher (pepsi.dispatch_stats): {} stages executed, {} claims, {} rows claimed, \
         {} worker starts; last flush {} ago ({})\n",
        d[0],
        d[1],
        d[2],
        d[3],
        age(s.flush_age()),
        s.dispatch.updated_text
    ));
    out
}

/// The tenants shown per stage in the text (all of them in `--json`).
const TENANTS_SHOWN: usize = 10;

/// The fair shares for people: per stage the tenants waiting and the Jain index, then
/// its busiest tenants over the last minute.
fn shares_text(s: &Snapshot) -> String {
    let mut out = String::from("\nfair shares over the last minute (pepsi.tenant_shares):\n");
    if s.shares.is_empty() {
        out.push_str("  no tenant waits or ran\n");
        return out;
    }
    let mut table = Table::new(&[
        ("STAGE", Align::Left),
        ("TENANT", Align::Left),
        ("WAITING", Align::Left),
        ("WORKER", Align::Right),
        ("SHARE", Align::Right),
        ("MESSAGES", Align::Right),
        ("WEIGHT", Align::Right),
        ("THROTTLED", Align::Right),
    ]);
    for (stage, sh) in &s.shares {
        let jain = sh
            .jain()
            .map_or("no index (no waiting tenant ran)".to_string(), |j| {
                format!("Jain index {j:.3}")
            });
        out.push_str(&format!(
            "  {}: {} tenants waiting; {jain}\n",
            Visible(stage),
            sh.waiting
        ));
        let total = sh.worker_us().max(1) as f64;
        for t in sh.tenants.iter().take(TENANTS_SHOWN) {
            table.row(vec![
                stage.clone(),
                t.tenant.clone(),
                if t.waiting { "yes" } else { "no" }.into(),
                format!("{:.1}s", t.worker_us as f64 / 1e6),
                format!("{:.0}%", 100.0 * t.worker_us as f64 / total),
                t.messages.to_string(),
                format!("{}", t.weight),
                format!("{:.1}s", t.throttled_us as f64 / 1e6),
            ]);
        }
        if sh.tenants.len() > TENANTS_SHOWN {
            let more = sh.tenants.len() - TENANTS_SHOWN;
            let mut row = vec![stage.clone(), format!("({more} more)")];
            row.extend(std::iter::repeat_n(String::new(), 6));
            table.row(row);
        }
    }
    out.push_str(&table.render());
    out
}

/// Runs `pepsi-queue status`.
pub fn run(session: &mut Session, json: bool) -> Result<(), Failure> {
    let snapshot = Snapshot::read(session)?;
    if json {
        emit_json(&to_json(&snapshot))
    } else {
        emit(to_text(&snapshot).as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> Snapshot {
        let mut s = Snapshot {
            statuses: ["pending", "running", "paused", "failed", "timeout", "held"]
                .map(String::from)
                .to_vec(),
            configured: ["in".to_string(), "relay".to_string()].into(),
            now: 1000.0,
            ..Snapshot::default()
        };
        let mut put = |stage: &str, status: &str, rows, oldest, bucket: usize| {
            let mut buckets = [0; 7];
            buckets[bucket] = rows;
            s.cells.entry(stage.into()).or_default().insert(
                status.into(),
                Cell {
                    rows,
                    oldest,
                    buckets,
                },
            );
        };
        put("in", "pending", 3, 20.0, 0);
        put("relay", "paused", 2, 700.0, 2);
        put("relay", "held", 1, 10000.0, 6);
        put("lost", "pending", 4, 5.0, 0);
        s
    }

    #[test]
    fn totals_unknown_stages_and_json_agree() {
        let s = snapshot();
        assert_eq!(s.stage_total("relay").rows, 3);
        assert_eq!(s.stage_total("relay").oldest, 10000.0);
        assert_eq!(s.stage_total("relay").buckets, [0, 0, 2, 0, 0, 0, 1]);
        assert_eq!(s.unknown_stages(), vec![("lost", 4)]);
        assert_eq!(s.status_total("pending"), 7);
        let j = to_json(&s);
        assert_eq!(j["rows"], 10);
        assert_eq!(j["statuses"]["held"], 1);
        assert_eq!(j["unknown_stages"][0]["stage"], "lost");
        let relay = j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["stage"] == "relay")
            .unwrap();
        assert_eq!(relay["statuses"]["paused"]["rows"], 2);
        assert_eq!(
            relay["statuses"]["pending"]["oldest_age_seconds"],
            Value::Null
        );
        let text = to_text(&s);
        assert!(text.contains("lost (no section)"), "{text}");
        assert!(text.contains("never claimed: lost (4)"), "{text}");
    }
}
