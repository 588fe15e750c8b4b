//! The queue's rows as the dispatcher suites look at them: injecting many at once or
//! one with a fault, counting, waiting with a deadline for a count, a status or an
//! empty queue, making a paused row due, and recording every pause.
//!
//! Used by the dispatch, queue, recovery, guarantees, containment, fair, batching,
//! bounce and roles suites. It reads and writes rows only through plain SQL and the
//! public injection function; it starts no program.

use std::time::Duration;

use postgres::Client;

use super::{row_at, wait_until};

/// The one `int8` that `sql` gives.
pub fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// Waits until `sql` counts `want`: the statistics of the last answers reach the
/// database on the idle flush, a moment after the queue empties.
#[track_caller]
pub fn wait_count(c: &mut Client, sql: &str, want: i64, timeout: Duration) {
    wait_until(timeout, &format!("{sql} gives {want}"), || {
        let rows = c.query(sql, &[]).unwrap();
        rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) == Some(want)
    });
}

/// How many rows the queue holds.
pub fn queue_len(c: &mut Client) -> i64 {
    count(c, "SELECT count(*) FROM pepsi.workqueue")
}

/// Injects `n` messages in one transaction (one notification).
pub fn inject_many(c: &mut Client, stage: &str, from: &str, n: i64) -> Vec<i64> {
    c.query(
        "SELECT pepsi.workqueue_inject($1, $2, ARRAY['r@y.example'], 'Subject: x\r\n'::bytea, 'body'::bytea) \
         FROM generate_series(1, $3::int8)",
        &[&stage, &from, &n],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Injects a message with `state.fault` set.
pub fn inject_fault(c: &mut Client, stage: &str, fault: &str) -> i64 {
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, 'f@x.example', ARRAY['r@y.example'], NULL, NULL, NULL, NULL, NULL, NULL, \
         jsonb_build_object('fault', $2::text))",
        &[&stage, &fault],
    )
    .unwrap()
    .get(0)
}

/// Makes a paused row due now (tests do not wait out the real minutes).
pub fn due_now(c: &mut Client, id: i64) {
    c.execute(
        "UPDATE pepsi.workqueue SET timeout = now() WHERE workqueue_id = $1 AND status = 'paused'",
        &[&id],
    )
    .unwrap();
}

/// Waits until a row is at `want` (stage, status).
#[track_caller]
pub fn wait_status(c: &mut Client, id: i64, want: (&str, &str), timeout: Duration) {
    let want = Some((want.0.to_string(), want.1.to_string()));
    wait_until(timeout, &format!("message {id} is {want:?}"), || {
        row_at(c, id) == want
    });
}

/// Waits until the queue is empty.
#[track_caller]
pub fn wait_empty(c: &mut Client, timeout: Duration) {
    wait_until(timeout, "the queue is empty", || queue_len(c) == 0);
}

/// Records every row that becomes `paused` (each strike pauses), so a test can tell a
/// row that was never struck from one whose pause it missed between two polls.
pub fn record_pauses(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE public.pauses (n serial, id bigint);
         CREATE FUNCTION public.record_pause() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO public.pauses (id) VALUES (NEW.workqueue_id); RETURN NULL; END $$;
         CREATE TRIGGER record_pause AFTER UPDATE ON pepsi.workqueue FOR EACH ROW
           WHEN (NEW.status = 'paused' AND OLD.status IS DISTINCT FROM 'paused')
           EXECUTE FUNCTION public.record_pause();",
    )
    .unwrap();
}

/// How many times a row was paused since [`record_pauses`].
pub fn pauses_of(c: &mut Client, id: i64) -> i64 {
    c.query_one("SELECT count(*) FROM public.pauses WHERE id = $1", &[&id])
        .unwrap()
        .get(0)
}
