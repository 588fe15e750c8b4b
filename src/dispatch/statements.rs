//! The coordinator's claim statement and guarded writes over claims, and the reading
//! of their answers: which rows a claim took (a row failed by the loop limit is logged
//! and left out), where a fair claim's sender windows ended, where each stage's next
//! pick may start (`floors.rs`), and the rows a requeue or an early resume wrote.
//! Called only by the coordinator thread, on its session; it holds no state.

use std::time::Instant;

use crate::db::Client;
use postgres::types::Type;

use super::claim::Claim;
use super::events::Event;
use super::floors::{self, Starts};
use super::scheduler::{ClaimRequest, Window};
use crate::db::pool::Connection;
use crate::db::{self, sql};
use crate::escape::Visible;

/// Runs a guarded write over claims, one round trip: `statement` takes their ids,
/// claimed stages and tokens as `$1`–`$3` and returns the rows it wrote.
pub fn write_claims(
    client: &mut Client,
    statement: &str,
    claims: &[Claim],
) -> Result<Vec<postgres::Row>, postgres::Error> {
    let ids: Vec<i64> = claims.iter().map(|c| c.id).collect();
    let stages: Vec<&str> = claims.iter().map(|c| c.stage.as_str()).collect();
    let tokens: Vec<i64> = claims.iter().map(|c| c.token).collect();
    db::retry_transient(|| {
        client.query_typed(
            statement,
            &[
                (&ids, Type::INT8_ARRAY),
                (&stages, Type::TEXT_ARRAY),
                (&tokens, Type::INT8_ARRAY),
            ],
        )
    })
}

/// Runs one claim statement, each stage's pick from its floor (`floors`, parallel to
/// the stages asked), and reads its answer: the claimed rows (rows failed by the loop
/// limit are logged and left out), for a fair claim where each stage's sender window
/// ended, and where each stage's next pick may start. The statement is prepared on the session the first time (one more
/// round trip, once): a claim is then one round trip that the server neither parses
/// nor plans: about half the server time of a one-message claim.
pub fn claim(
    client: &mut Connection,
    request: &ClaimRequest,
    starts: &Starts,
    max_hops: i32,
) -> Result<Event, postgres::Error> {
    let floors = &starts.floors;
    let started = Instant::now();
    let stages: Vec<&str> = request.asked().iter().map(|a| a.0.as_str()).collect();
    let caps: Vec<i32> = request.asked().iter().map(|a| a.1).collect();
    let rows = match request {
        ClaimRequest::Oldest(_) => db::retry_transient(|| {
            client.query_prepared(
                sql::CLAIM_OLDEST,
                &[
                    Type::TEXT_ARRAY,
                    Type::INT4_ARRAY,
                    Type::INT4,
                    Type::INT8_ARRAY,
                ],
                &[&stages, &caps, &max_hops, &floors],
            )
        })?,
        ClaimRequest::Fair(fair) => db::retry_transient(|| {
            client.query_prepared(
                sql::CLAIM_FAIR,
                &[
                    Type::TEXT_ARRAY,
                    Type::INT4_ARRAY,
                    Type::INT4_ARRAY,
                    Type::FLOAT8_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::FLOAT8_ARRAY,
                    Type::INT4,
                    Type::INT8_ARRAY,
                    Type::BOOL_ARRAY,
                    Type::INT8_ARRAY,
                    Type::FLOAT8_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::FLOAT8_ARRAY,
                    Type::FLOAT8_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::INT4_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::TEXT_ARRAY,
                    Type::INT4_ARRAY,
                ],
                &[
                    &stages,
                    &caps,
                    &fair.fifo,
                    &fair.avg_us,
                    &fair.cursor,
                    &fair.lead_stage,
                    &fair.lead_sender,
                    &fair.lead_us,
                    &max_hops,
                    floors,
                    &starts.walks,
                    &starts.sweeps,
                    &fair.lead_w,
                    &fair.tlead_stage,
                    &fair.tlead_tenant,
                    &fair.tlead_us,
                    &fair.tlead_w,
                    &fair.tcur_stage,
                    &fair.tcur_tenant,
                    &fair.tcur_sender,
                    &fair.allow_default,
                    &fair.allow_stage,
                    &fair.allow_tenant,
                    &fair.allow_n,
                ],
            )
        })?,
    };
    let took = started.elapsed();
    let next_paused = rows.first().and_then(|r| r.get::<_, Option<f64>>(4));
    // Where each stage's next pick may start: a fair claim says so per stage; an
    // oldest-first claim took every pending row from the floor up to its highest
    // (looped rows included, so this reads them before they are left out).
    let next_floors = match request {
        ClaimRequest::Oldest(_) => {
            let took: Vec<(String, i64)> = rows
                .iter()
                .filter_map(|r| Some((r.get::<_, Option<String>>(1)?, r.get::<_, Option<i64>>(0)?)))
                .collect();
            floors::oldest_next(&stages, &took)
        }
        ClaimRequest::Fair(_) => rows
            .iter()
            .filter(|r| stage_row(r))
            .filter_map(|r| Some((r.get::<_, Option<String>>(1)?, r.get::<_, Option<i64>>(7))))
            .collect(),
    };
    // A row that passed MAX_HOPS was failed by the claim instead of run.
    for r in rows
        .iter()
        .filter(|r| r.get::<_, Option<bool>>(5) == Some(true))
    {
        log::warn!(
            "{}: message {} looped: claimed at a changed stage more than MAX_HOPS ({max_hops}) times; failed instead of run",
            Visible(&r.get::<_, String>(1)),
            r.get::<_, i64>(0)
        );
    }
    let rows: Vec<&postgres::Row> = rows
        .iter()
        .filter(|r| r.get::<_, Option<bool>>(5) != Some(true))
        .collect();
    // A fair claim answers one row per requested stage with no id: where that stage's
    // window of tenants ended; and one per tenant whose walk of its senders stopped
    // short or had a start, with the tenant. (A claim of nothing at all answers one
    // row of NULLs.)
    let windows = match request {
        ClaimRequest::Oldest(_) => Vec::new(),
        ClaimRequest::Fair(_) => rows
            .iter()
            .filter(|r| r.get::<_, Option<i64>>(0).is_none())
            .filter_map(|r| {
                Some(Window {
                    stage: r.get::<_, Option<String>>(1)?,
                    tenant: r.get::<_, Option<String>>(9),
                    end: r.get::<_, Option<String>>(6),
                })
            })
            .collect(),
    };
    let sweeps = match request {
        ClaimRequest::Oldest(_) => Vec::new(),
        ClaimRequest::Fair(_) => rows
            .iter()
            .filter(|r| stage_row(r))
            .filter_map(|r| Some((r.get::<_, Option<String>>(1)?, r.get::<_, Option<i64>>(8))))
            .collect(),
    };
    let claimed_at = Instant::now();
    let claims = rows
        .iter()
        .filter_map(|r| {
            Some(Claim {
                id: r.get::<_, Option<i64>>(0)?,
                stage: r.get(1),
                sender_key: r.get::<_, Option<String>>(2).unwrap_or_default(),
                tenant_key: tenant(r),
                token: r.get(3),
                claimed_at,
            })
        })
        .collect();
    Ok(Event::Claimed {
        claims,
        next_paused,
        windows,
        floors: next_floors,
        sweeps,
        took,
    })
}

/// A fair claim's row for a stage: no id and no tenant (a tenant's row is where its
/// senders' walk ended).
fn stage_row(r: &postgres::Row) -> bool {
    r.get::<_, Option<i64>>(0).is_none() && r.get::<_, Option<String>>(9).is_none()
}

/// A claimed row's tenant: the fair claim's tenth column; the oldest-first claim has
/// none (its policy shares nothing between tenants).
fn tenant(r: &postgres::Row) -> String {
    if r.len() > 9 {
        r.get::<_, Option<String>>(9).unwrap_or_default()
    } else {
        String::new()
    }
}
