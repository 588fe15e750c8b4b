//! Statistics (§10): per-stage and global counters accumulated in memory by the claim
//! ledger and written as deltas in one statement by the thread pool. No deltas, no
//! write. Every counter saturates instead of overflowing.
//!
//! Best effort by design: deltas not yet flushed die with the dispatcher; a failed
//! flush hands its deltas back to be merged and retried.
//!
//! The ledger counts into [`Deltas`]; the thread pool ([`super::background`]) calls
//! [`flush`]. Neither the counters nor the flush touch any other state.

use std::collections::BTreeMap;

use postgres::types::Type;

use crate::db::sql;

/// Counters of one stage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageCounters {
    /// Executions of the stage (fused ones included).
    pub passes: i64,
    /// Executions fused into another stage's pass.
    pub fused_passes: i64,
    /// Messages the worker marked failed.
    pub failures: i64,
    /// Worker crashes blamed on a message at the front.
    pub crashes: i64,
    /// Messages killed at MAX_RUNTIME.
    pub timeouts: i64,
    /// Claimed rows put back to pending without running.
    pub requeues: i64,
    /// Microseconds of work.
    pub busy_us: i64,
    /// Messages paused because their worker lost the database (§8.4).
    pub deferrals: i64,
    /// Distinct senders among each claim's rows at the stage, summed (§7).
    pub senders_served: i64,
}

impl StageCounters {
    fn add(&mut self, o: &StageCounters) {
        self.passes = self.passes.saturating_add(o.passes);
        self.fused_passes = self.fused_passes.saturating_add(o.fused_passes);
        self.failures = self.failures.saturating_add(o.failures);
        self.crashes = self.crashes.saturating_add(o.crashes);
        self.timeouts = self.timeouts.saturating_add(o.timeouts);
        self.requeues = self.requeues.saturating_add(o.requeues);
        self.busy_us = self.busy_us.saturating_add(o.busy_us);
        self.deferrals = self.deferrals.saturating_add(o.deferrals);
        self.senders_served = self.senders_served.saturating_add(o.senders_served);
    }
}

/// Everything accumulated since the last flush.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Deltas {
    /// Per stage.
    pub stages: BTreeMap<String, StageCounters>,
    /// Worker passes (a fused chain counts once).
    pub stages_executed: i64,
    /// Claim statements that claimed at least one row.
    pub claims: i64,
    /// Rows claimed.
    pub rows_claimed: i64,
    /// Worker processes started.
    pub worker_starts: i64,
    /// The events stages counted (schema 20), by stage and event.
    pub events: BTreeMap<(String, String), i64>,
}

/// The most event names one stage keeps between two flushes: a worker that makes up
/// names cannot grow the dispatcher's memory or the table without bound.
pub const MAX_EVENTS_PER_STAGE: usize = 64;

/// The most one status line may add to one event (a pass handles one message).
pub const MAX_EVENT_COUNT: u64 = 1_000;

/// Is `name` an event name a stage may count: lower-case ASCII letters, digits, dots
/// and dashes, 1 to 32 bytes?
pub fn event_name_ok(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

impl Deltas {
    /// Adds `n` of `event` at `stage`; false when the stage has [`MAX_EVENTS_PER_STAGE`]
    /// other names already (the count is dropped).
    pub fn event(&mut self, stage: &str, event: &str, n: i64) -> bool {
        let key = (stage.to_string(), event.to_string());
        if !self.events.contains_key(&key)
            && self.events.keys().filter(|(s, _)| s == stage).count() >= MAX_EVENTS_PER_STAGE
        {
            return false;
        }
        let c = self.events.entry(key).or_insert(0);
        *c = c.saturating_add(n);
        true
    }

    /// Is there nothing to write?
    pub fn is_empty(&self) -> bool {
        self == &Deltas::default()
    }

    /// The counters of a stage, created on first use.
    pub fn stage(&mut self, name: &str) -> &mut StageCounters {
        if !self.stages.contains_key(name) {
            self.stages
                .insert(name.to_string(), StageCounters::default());
        }
        self.stages.get_mut(name).expect("just inserted")
    }

    /// Adds other deltas (a failed flush coming back).
    pub fn merge(&mut self, other: &Deltas) {
        for (name, c) in &other.stages {
            self.stage(name).add(c);
        }
        self.stages_executed = self.stages_executed.saturating_add(other.stages_executed);
        self.claims = self.claims.saturating_add(other.claims);
        self.rows_claimed = self.rows_claimed.saturating_add(other.rows_claimed);
        self.worker_starts = self.worker_starts.saturating_add(other.worker_starts);
        for ((stage, event), n) in &other.events {
            self.event(stage, event, *n);
        }
    }
}

/// Writes deltas in one statement.
pub fn flush(client: &mut crate::db::Client, d: &Deltas) -> Result<(), postgres::Error> {
    let names: Vec<&str> = d.stages.keys().map(String::as_str).collect();
    let col = |f: fn(&StageCounters) -> i64| d.stages.values().map(f).collect::<Vec<i64>>();
    let (passes, fused, failures, crashes, timeouts, requeues, busy, deferrals, senders) = (
        col(|c| c.passes),
        col(|c| c.fused_passes),
        col(|c| c.failures),
        col(|c| c.crashes),
        col(|c| c.timeouts),
        col(|c| c.requeues),
        col(|c| c.busy_us),
        col(|c| c.deferrals),
        col(|c| c.senders_served),
    );
    let event_stages: Vec<&str> = d.events.keys().map(|(s, _)| s.as_str()).collect();
    let event_names: Vec<&str> = d.events.keys().map(|(_, e)| e.as_str()).collect();
    let event_counts: Vec<i64> = d.events.values().copied().collect();
    client.query_typed(
        sql::FLUSH_STATS,
        &[
            (&names, Type::TEXT_ARRAY),
            (&passes, Type::INT8_ARRAY),
            (&fused, Type::INT8_ARRAY),
            (&failures, Type::INT8_ARRAY),
            (&crashes, Type::INT8_ARRAY),
            (&timeouts, Type::INT8_ARRAY),
            (&requeues, Type::INT8_ARRAY),
            (&busy, Type::INT8_ARRAY),
            (&deferrals, Type::INT8_ARRAY),
            (&senders, Type::INT8_ARRAY),
            (&d.stages_executed, Type::INT8),
            (&d.claims, Type::INT8),
            (&d.rows_claimed, Type::INT8),
            (&d.worker_starts, Type::INT8),
            (&event_stages, Type::TEXT_ARRAY),
            (&event_names, Type::TEXT_ARRAY),
            (&event_counts, Type::INT8_ARRAY),
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_everything() {
        let mut a = Deltas::default();
        assert!(a.is_empty());
        a.stage("x").passes = 2;
        a.claims = 1;
        let mut b = Deltas::default();
        b.stage("x").passes = 3;
        b.stage("y").busy_us = 7;
        b.stage("y").senders_served = 2;
        b.worker_starts = 4;
        a.merge(&b);
        assert_eq!(a.stages["x"].passes, 5);
        assert_eq!(a.stages["y"].busy_us, 7);
        assert_eq!(a.stages["y"].senders_served, 2);
        assert_eq!(a.claims, 1);
        assert_eq!(a.worker_starts, 4);
        assert!(!a.is_empty());
    }
}
