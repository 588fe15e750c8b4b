//! The holder named: what the dispatcher says about the database's oldest
//! snapshot. While a snapshot older than `[pepsi-dispatch] SNAPSHOT_WARNING` holds the
//! horizon (a `pg_dump`, an analyst's REPEATABLE READ transaction, a psql idle in
//! transaction, a slot, a standby's feedback, a prepared transaction), VACUUM cannot
//! remove the queue's dead rows and dead index entries and claims slow down: the
//! dispatcher logs who holds it, at most once a [`WARNING_GAP`], and one line when it
//! ends.
//!
//! Pure policy: the loop hands it the holders the thread pool read
//! ([`crate::db::horizon::read`], every [`check_gap`]) and logs the notices it returns;
//! it does no I/O and keeps no clock of its own. A holder whose age in time the
//! database does not tell (a slot, a standby, a session this role may not see the
//! details of) is aged from when the dispatcher first saw that snapshot: a lower bound,
//! said as "at least".

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::db::horizon::{self, Holder};

/// The warning is repeated at most this often while the snapshot is held.
pub const WARNING_GAP: Duration = Duration::from_secs(60);

/// How often the holders are read for a threshold: a quarter of it, between 1 and 15
/// seconds, so the first warning comes at most that late; `None` when the warning is
/// off (a zero threshold).
pub fn check_gap(threshold: Duration) -> Option<Duration> {
    (!threshold.is_zero())
        .then(|| (threshold / 4).clamp(Duration::from_secs(1), Duration::from_secs(15)))
}

/// A line for the log.
#[derive(Clone, Debug, PartialEq)]
pub enum Notice {
    /// A snapshot past the threshold holds the horizon (a warning).
    Held(String),
    /// No snapshot past the threshold holds it any more (information).
    Ended(String),
}

type Key = (String, Option<i32>, Option<String>, Option<String>);

/// What the dispatcher remembers between reads.
#[derive(Debug)]
pub struct Watch {
    threshold: Duration,
    /// When each snapshot whose age the database does not tell was first seen.
    first_seen: HashMap<Key, Instant>,
    /// The last warning: when, and about whom (described).
    warned: Option<(Instant, String)>,
    /// When the condition began (the first warning of this spell).
    since: Option<Instant>,
    /// The oldest snapshot's age at the last read, if any holds the horizon.
    oldest: Option<Duration>,
}

impl Watch {
    /// A watch for this threshold (non-zero).
    pub fn new(threshold: Duration) -> Watch {
        Watch {
            threshold,
            first_seen: HashMap::new(),
            warned: None,
            since: None,
            oldest: None,
        }
    }

    /// The oldest snapshot's age at the last read (`None`: none held the horizon).
    pub fn oldest(&self) -> Option<Duration> {
        self.oldest
    }

    /// The holders of one read, oldest first (as [`crate::db::horizon::read`] returns
    /// them), at `now`: the notice to log, if any.
    pub fn observe(&mut self, holders: &[Holder], now: Instant) -> Option<Notice> {
        // Only the snapshots without an age of their own are aged by first sight; those
        // gone since the last read are forgotten.
        let unaged: Vec<Key> = holders
            .iter()
            .filter(|h| h.age_seconds.is_none())
            .map(Holder::key)
            .collect();
        self.first_seen.retain(|k, _| unaged.contains(k));
        for k in unaged {
            self.first_seen.entry(k).or_insert(now);
        }
        let oldest = holders.first().map(|h| match h.age_seconds {
            Some(a) => (h, a.max(0.0), false),
            None => (
                h,
                now.saturating_duration_since(self.first_seen[&h.key()])
                    .as_secs_f64(),
                true,
            ),
        });
        self.oldest = oldest.map(|(_, age, _)| Duration::from_secs_f64(age));
        let over = oldest.filter(|(_, age, _)| *age >= self.threshold.as_secs_f64());
        match over {
            Some((h, age, lower_bound)) => {
                if self
                    .warned
                    .as_ref()
                    .is_some_and(|(at, _)| now.saturating_duration_since(*at) < WARNING_GAP)
                {
                    return None;
                }
                let who = horizon::describe(h);
                self.since.get_or_insert(now);
                self.warned = Some((now, who.clone()));
                Some(Notice::Held(held_line(
                    h,
                    &who,
                    age,
                    lower_bound,
                    self.threshold,
                )))
            }
            None => {
                let (_, who) = self.warned.take()?;
                let since = self.since.take().unwrap_or(now);
                Some(Notice::Ended(format!(
                    "the database's oldest snapshot is younger than SNAPSHOT_WARNING ({}s) again, \
                     {}s after the first warning (the last named: {who}); VACUUM can remove the \
                     queue's dead rows again",
                    self.threshold.as_secs(),
                    now.saturating_duration_since(since).as_secs()
                )))
            }
        }
    }
}

/// The warning: how old, how many transactions behind, who.
fn held_line(h: &Holder, who: &str, age: f64, lower_bound: bool, threshold: Duration) -> String {
    let age = if lower_bound {
        format!(
            "at least {:.0}s old (the database does not say when it began; seen that long)",
            age
        )
    } else {
        format!("{age:.0}s old")
    };
    let behind = h
        .xid_age
        .map(|n| format!(", {n} transactions behind"))
        .unwrap_or_default();
    format!(
        "the database's oldest snapshot is {age}{behind}, over SNAPSHOT_WARNING ({}s): \
         VACUUM cannot remove the queue's dead rows while it lasts and claims slow down; \
         held by {who}",
        threshold.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(pid: i32, age: Option<f64>, xmin: &str) -> Holder {
        Holder {
            kind: "session".into(),
            pid: Some(pid),
            name: Some("pg_dump".into()),
            role: Some("postgres".into()),
            client: age.map(|_| "local".into()),
            state: age.map(|_| "active".into()),
            database: Some("mail".into()),
            age_seconds: age,
            xid_age: Some(12),
            xmin: Some(xmin.into()),
            visible: age.is_some(),
        }
    }

    #[test]
    fn the_check_gap_follows_the_threshold_within_bounds() {
        assert_eq!(check_gap(Duration::ZERO), None);
        assert_eq!(
            check_gap(Duration::from_secs(2)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            check_gap(Duration::from_secs(20)),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            check_gap(Duration::from_secs(600)),
            Some(Duration::from_secs(15))
        );
    }

    #[test]
    fn a_holder_is_named_once_a_minute_and_its_end_once() {
        let t0 = Instant::now();
        let mut w = Watch::new(Duration::from_secs(60));
        assert_eq!(w.observe(&[session(7, Some(30.0), "5")], t0), None);
        assert_eq!(
            w.oldest(),
            Some(Duration::from_secs(30)),
            "under the threshold too"
        );
        assert_eq!(w.observe(&[], t0), None, "nothing held: nothing ends");
        assert_eq!(w.oldest(), None);
        let Some(Notice::Held(line)) = w.observe(&[session(7, Some(61.0), "5")], t0) else {
            panic!("no warning");
        };
        assert!(line.contains("61s old, 12 transactions behind"), "{line}");
        assert!(
            line.contains("held by session pid 7 (application \"pg_dump\""),
            "{line}"
        );
        let t = t0 + Duration::from_secs(30);
        assert_eq!(w.observe(&[session(7, Some(91.0), "5")], t), None);
        let t = t0 + Duration::from_secs(60);
        assert!(matches!(
            w.observe(&[session(7, Some(121.0), "5")], t),
            Some(Notice::Held(_))
        ));
        let t = t0 + Duration::from_secs(70);
        let Some(Notice::Ended(line)) = w.observe(&[session(8, Some(1.0), "9")], t) else {
            panic!("no end");
        };
        assert!(line.contains("70s after the first warning"), "{line}");
        assert!(line.contains("session pid 7"), "{line}");
        assert_eq!(w.observe(&[], t), None);
    }

    #[test]
    fn a_holder_without_an_age_is_aged_from_first_sight_and_a_new_snapshot_starts_again() {
        let t0 = Instant::now();
        let mut w = Watch::new(Duration::from_secs(60));
        assert_eq!(w.observe(&[session(7, None, "5")], t0), None);
        let t = t0 + Duration::from_secs(59);
        assert_eq!(w.observe(&[session(7, None, "5")], t), None);
        assert_eq!(w.oldest(), Some(t - t0), "aged from first sight");
        // The same session with a newer snapshot: a new one, seen from now.
        let t = t0 + Duration::from_secs(61);
        assert_eq!(w.observe(&[session(7, None, "6")], t), None);
        let t = t0 + Duration::from_secs(121);
        let Some(Notice::Held(line)) = w.observe(&[session(7, None, "6")], t) else {
            panic!("no warning");
        };
        assert!(line.contains("at least 60s old"), "{line}");
        assert!(line.contains("pg_read_all_stats"), "{line}");
    }
}
