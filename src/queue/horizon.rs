//! The oldest snapshot in `pepsi-queue status` and `metrics` ("the holder
//! named"): who holds the database's MVCC horizon, so VACUUM cannot remove the queue's
//! dead rows, read with the rest of the status snapshot ([`super::status`]) through
//! [`crate::db::horizon::read`].
//!
//! Rendering only, pure: the holders come oldest first; the text escapes every value
//! from the database ([`crate::db::horizon::describe`]); the JSON carries them as they
//! are. The threshold is the file's `[pepsi-dispatch] SNAPSHOT_WARNING`, the one the
//! dispatcher warns at.

use std::time::Duration;

use serde_json::{Value, json};

use super::format::age;
use crate::db::horizon::{self, Holder};

/// Is this holder past the threshold (a zero threshold: never)? A holder whose age in
/// time is unknown is not judged.
pub fn over(h: &Holder, threshold: Duration) -> bool {
    !threshold.is_zero() && h.age_seconds.is_some_and(|a| a >= threshold.as_secs_f64())
}

/// The line of `status`'s text: `oldest snapshot: …`.
pub fn text(holders: &[Holder], threshold: Duration) -> String {
    let Some(h) = holders.first() else {
        return "oldest snapshot: none held by another session\n".to_string();
    };
    let age_text = match h.age_seconds {
        Some(a) => format!("{} old", age(a)),
        None => "age in time unknown (the database does not say when it began)".to_string(),
    };
    let behind = h
        .xid_age
        .map(|n| format!(", {n} transactions behind"))
        .unwrap_or_default();
    let warning = if over(h, threshold) {
        format!(
            " — over SNAPSHOT_WARNING ({}): VACUUM cannot remove the queue's dead rows while it lasts",
            age(threshold.as_secs_f64())
        )
    } else {
        String::new()
    };
    let others = match holders.len() - 1 {
        0 => String::new(),
        1 => " (1 younger holder)".to_string(),
        n => format!(" ({n} younger holders)"),
    };
    format!(
        "oldest snapshot: {age_text}{behind}, held by {}{others}{warning}\n",
        horizon::describe(h)
    )
}

/// The fields of `status --json`: `oldest_snapshot` (the oldest holder, with
/// `over_threshold`; `null` when none), `snapshot_holders` (all, oldest first) and
/// `snapshot_warning_seconds`.
pub fn json_fields(holders: &[Holder], threshold: Duration) -> [(&'static str, Value); 3] {
    let oldest = holders.first().map_or(Value::Null, |h| {
        let mut v = horizon::to_json(h);
        v["over_threshold"] = json!(over(h, threshold));
        v
    });
    [
        ("oldest_snapshot", oldest),
        (
            "snapshot_holders",
            Value::Array(holders.iter().map(horizon::to_json).collect()),
        ),
        ("snapshot_warning_seconds", json!(threshold.as_secs())),
    ]
}

/// `pepsi_oldest_snapshot_age_seconds`: the largest age in time among the holders
/// whose start this role can see; 0 when none.
pub fn age_seconds(holders: &[Holder]) -> f64 {
    holders
        .iter()
        .filter_map(|h| h.age_seconds)
        .fold(0.0, f64::max)
}

/// `pepsi_oldest_snapshot_age_transactions`: the oldest holder's age in transactions;
/// 0 when none.
pub fn age_transactions(holders: &[Holder]) -> i64 {
    holders
        .iter()
        .filter_map(|h| h.xid_age)
        .map(i64::from)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(age: Option<f64>, xid_age: i32) -> Holder {
        Holder {
            kind: "session".into(),
            pid: Some(42),
            name: Some("pg_dump\u{1b}]0;x".into()),
            role: Some("postgres".into()),
            client: Some("local".into()),
            state: Some("active".into()),
            database: Some("mail".into()),
            age_seconds: age,
            xid_age: Some(xid_age),
            xmin: Some("800".into()),
            visible: true,
        }
    }

    #[test]
    fn the_line_names_the_holder_escaped_and_says_when_it_is_over_the_threshold() {
        let t = Duration::from_secs(60);
        assert_eq!(
            text(&[], t),
            "oldest snapshot: none held by another session\n"
        );
        let holders = [holder(Some(125.0), 30), holder(Some(3.0), 2)];
        let line = text(&holders, t);
        assert!(
            line.starts_with(
                "oldest snapshot: 2m05s old, 30 transactions behind, held by session pid 42 \
                 (application \"pg_dump\\u{1b}]0;x\""
            ),
            "{line}"
        );
        assert!(
            line.contains("(1 younger holder) — over SNAPSHOT_WARNING (1m00s)"),
            "{line}"
        );
        assert!(!text(&[holder(Some(5.0), 0)], t).contains("over"));
        assert!(text(&[holder(None, 9)], t).contains("age in time unknown"));
        let [(_, oldest), (_, all), (_, secs)] = json_fields(&holders, t);
        assert_eq!(oldest["pid"], 42);
        assert_eq!(oldest["over_threshold"], true);
        assert_eq!(oldest["name"], "pg_dump\u{1b}]0;x");
        assert_eq!(all.as_array().unwrap().len(), 2);
        assert_eq!(secs, 60);
        assert_eq!(age_seconds(&holders), 125.0);
        assert_eq!(age_transactions(&holders), 30);
        assert_eq!(age_seconds(&[]), 0.0);
        assert_eq!(age_transactions(&[]), 0);
    }
}
