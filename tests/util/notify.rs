//! Notifications as the suites count them: a LISTEN session on some channels plus a
//! sentinel, and the channels notified until the sentinel arrives.
//!
//! Used by the foundation, queue and dispatch suites. It listens and sends the
//! sentinel only; what a test expects to have been notified is the test's.

use std::time::Duration;

use postgres::Client;
use postgres::fallible_iterator::FallibleIterator;

use super::TestDb;

/// A LISTEN session on `channels` and on `sentinel`, in that order.
pub fn listen(db: &TestDb, channels: &[&str]) -> Client {
    let mut l = db.client();
    let sql: Vec<String> = channels
        .iter()
        .chain(&["sentinel"])
        .map(|ch| format!("LISTEN {ch}"))
        .collect();
    l.batch_execute(&sql.join("; ")).unwrap();
    l
}

/// The channels notified since the last call, in order, until the sentinel: `writer`
/// sends the sentinel after its own work (or after a command it ran has exited), and
/// notifications are delivered in commit order, so whatever the work notified has
/// arrived by then.
pub fn notified(l: &mut Client, writer: &mut Client) -> Vec<String> {
    writer.batch_execute("NOTIFY sentinel").unwrap();
    let mut seen = Vec::new();
    let mut n = l.notifications();
    let mut it = n.timeout_iter(Duration::from_secs(10));
    while let Some(note) = it.next().unwrap() {
        if note.channel() == "sentinel" {
            return seen;
        }
        seen.push(note.channel().to_string());
    }
    panic!("the sentinel notification never arrived; saw {seen:?}");
}
