//! `pepsi-ingress`'s counters (§10's way): kept in memory by the sessions and the
//! committer, taken as deltas by the committer, which adds them to
//! `pepsi.ingress_stats` every few seconds in one statement. Best effort: deltas not
//! yet written die with the process. A leaf, shared by `session.rs` and `commit.rs`.

use std::sync::atomic::{AtomicU64, Ordering};

/// The counters since the last write.
#[derive(Debug, Default)]
pub struct Counters {
    /// Sessions served.
    pub sessions: AtomicU64,
    /// Messages accepted (committed and answered 250).
    pub accepted: AtomicU64,
    /// Their recipients.
    pub recipients: AtomicU64,
    /// Messages answered 4xx at the end of their data.
    pub deferred: AtomicU64,
    /// Messages answered 5xx at the end of their data.
    pub refused: AtomicU64,
    /// Commits of accepted messages.
    pub commits: AtomicU64,
    /// Sessions whose STARTTLS handshake completed.
    pub tls_sessions: AtomicU64,
}

/// A snapshot of the deltas, in `sql::INGRESS_STATS_ADD`'s order.
pub type Deltas = [i64; 7];

impl Counters {
    /// Adds one to a counter.
    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    /// The counters in the order of [`Deltas`] (the table's columns).
    fn all(&self) -> [&AtomicU64; 7] {
        [
            &self.sessions,
            &self.accepted,
            &self.recipients,
            &self.deferred,
            &self.refused,
            &self.commits,
            &self.tls_sessions,
        ]
    }

    /// Takes every counter's value, leaving zero; `None` when all were zero.
    pub fn take(&self) -> Option<Deltas> {
        let deltas = self.all().map(|c| c.swap(0, Ordering::Relaxed) as i64);
        deltas.iter().any(|d| *d != 0).then_some(deltas)
    }

    /// Gives deltas back after a write that failed, to be written with the next.
    pub fn restore(&self, deltas: Deltas) {
        for (c, d) in self.all().iter().zip(deltas) {
            c.fetch_add(d as u64, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_are_taken_once_and_given_back_after_a_failed_write() {
        let c = Counters::default();
        assert_eq!(c.take(), None);
        Counters::bump(&c.accepted, 3);
        Counters::bump(&c.commits, 1);
        Counters::bump(&c.tls_sessions, 2);
        let d = c.take().unwrap();
        assert_eq!(d, [0, 3, 0, 0, 0, 1, 2]);
        assert_eq!(c.take(), None);
        c.restore(d);
        Counters::bump(&c.accepted, 1);
        assert_eq!(c.take(), Some([0, 4, 0, 0, 0, 1, 2]));
    }
}
