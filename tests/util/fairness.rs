//! What the fairness tests and the fairness benchmark share: a record of every finished
//! message with its tenant and when (a trigger on the queue's deletes, the last stage
//! deleting), messages injected with a cost for the fault worker, and the worker time
//! and completions per tenant read back from that record.

use postgres::Client;

/// Records every finished message (deleted at the end of the stage) in order, with its
/// tenant and when.
pub fn record_finishes(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE finished (n bigserial, tenant text, at timestamptz DEFAULT clock_timestamp());
         CREATE FUNCTION finished() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN INSERT INTO finished (tenant) VALUES (OLD.tenant_key); RETURN NULL; END $$;
         CREATE TRIGGER finished AFTER DELETE ON pepsi.workqueue FOR EACH ROW
             EXECUTE FUNCTION finished();",
    )
    .unwrap();
}

/// Injects `n` messages from `from` at stage `s`, each costing `cost_ms`.
pub fn inject(c: &mut Client, from: &str, n: i64, cost_ms: i64) {
    c.execute(
        "SELECT count(pepsi.workqueue_inject('s', $1, ARRAY['r@y.example'], NULL, NULL, NULL, \
                NULL, NULL, NULL, jsonb_build_object('cost_ms', $3::int8))) \
           FROM generate_series(1, $2::int8)",
        &[&from, &n, &cost_ms],
    )
    .unwrap();
}

/// Messages finished so far.
pub fn finished_count(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM finished", &[])
        .unwrap()
        .get(0)
}

/// The worker time each of `tenants` got among finished messages `from`..=`to` (in
/// order of completion), seconds: each message's time from the completion before it
/// (with one slot at the stage, the time it took).
pub fn worker_times(c: &mut Client, tenants: &[&str], from: i64, to: i64) -> Vec<f64> {
    tenants
        .iter()
        .map(|t| {
            c.query_one(
                "WITH f AS (SELECT n, tenant, \
                                   extract(epoch FROM at - lag(at) OVER (ORDER BY n))::float8 AS took \
                              FROM finished) \
                 SELECT coalesce(sum(took), 0) FROM f \
                  WHERE tenant = $1 AND n >= $2 AND n <= $3",
                &[t, &from, &to],
            )
            .unwrap()
            .get(0)
        })
        .collect()
}

/// Messages of `tenant` finished in the `seconds` after `from` (epoch seconds).
pub fn finished_between(c: &mut Client, tenant: &str, from: f64, seconds: f64) -> i64 {
    c.query_one(
        "SELECT count(*) FROM finished WHERE tenant = $1 \
            AND extract(epoch FROM at)::float8 > $2::float8 \
            AND extract(epoch FROM at)::float8 <= $2::float8 + $3::float8",
        &[&tenant, &from, &seconds],
    )
    .unwrap()
    .get(0)
}

/// The database's clock, epoch seconds.
pub fn now_epoch(c: &mut Client) -> f64 {
    c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
        .unwrap()
        .get(0)
}

/// The Jain fairness index of `xs`: (Σx)² / (n · Σx²).
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
}
