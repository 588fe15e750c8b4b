//! The fair claim at the SQL level (§7): `pepsi.workqueue_claim_fair` called
//! through [`sql::CLAIM_FAIR`] with typed parameters, against a real PostgreSQL. The
//! fence, the ranking by lead, the FIFO reserve, the rotating window of senders, rows
//! another session holds, the properties shared with the oldest-first claim (one token,
//! hops, the due time), the upgrade from schema 3, and the bound on what one call
//! reads however deep one sender's backlog is: every nested statement's plan, read
//! from `auto_explain` through `psql` (the `postgres` client does not expose notices).

use std::collections::HashSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postgres::{Client, GenericClient};

use pepsi::db::sql;

use crate::util::{TempDir, TestDb, assert_has, assert_lacks, pg, write_config};

/// MAX_HOPS for the calls that do not test it.
const MAX_HOPS: i32 = 100;

/// What the dispatcher asks of the fair claim for one stage.
#[derive(Clone, Debug)]
struct Ask {
    stage: String,
    cap: i32,
    fifo: i32,
    avg_us: f64,
    cursor: Option<String>,
}

/// A stage's ask with no FIFO slots, an average of 1 ms and no cursor.
fn ask(stage: &str, cap: i32) -> Ask {
    Ask {
        stage: stage.to_string(),
        cap,
        fifo: 0,
        avg_us: 1000.0,
        cursor: None,
    }
}

impl Ask {
    fn fifo(mut self, fifo: i32) -> Ask {
        self.fifo = fifo;
        self
    }

    fn cursor(mut self, cursor: Option<String>) -> Ask {
        self.cursor = cursor;
        self
    }
}

/// A known lead: (stage, sender key, µs).
type Lead<'a> = (&'a str, &'a str, f64);

/// One claimed row.
#[derive(Clone, Debug, PartialEq)]
struct Claimed {
    id: i64,
    stage: String,
    sender: String,
    token: i64,
    looped: bool,
}

/// What one call answered.
#[derive(Debug)]
struct Answer {
    rows: Vec<Claimed>,
    /// Each stage's window end, in the order the rows came.
    ends: Vec<(String, Option<String>)>,
    /// The due time, the same on every row.
    due: Option<f64>,
    /// How many rows the statement returned.
    returned: usize,
}

impl Answer {
    fn ids(&self) -> HashSet<i64> {
        self.rows.iter().map(|r| r.id).collect()
    }

    fn at(&self, stage: &str) -> Vec<&Claimed> {
        self.rows.iter().filter(|r| r.stage == stage).collect()
    }

    #[track_caller]
    fn end(&self, stage: &str) -> Option<String> {
        let ends: Vec<&Option<String>> = self
            .ends
            .iter()
            .filter(|(s, _)| s == stage)
            .map(|(_, e)| e)
            .collect();
        assert_eq!(ends.len(), 1, "one window row per stage: {self:?}");
        ends[0].clone()
    }
}

/// Calls [`sql::CLAIM_FAIR`] with typed parameters and sorts out its rows.
#[track_caller]
fn claim_fair(c: &mut impl GenericClient, asks: &[Ask], leads: &[Lead], max_hops: i32) -> Answer {
    let stages: Vec<String> = asks.iter().map(|a| a.stage.clone()).collect();
    let caps: Vec<i32> = asks.iter().map(|a| a.cap).collect();
    let fifo: Vec<i32> = asks.iter().map(|a| a.fifo).collect();
    let avg: Vec<f64> = asks.iter().map(|a| a.avg_us).collect();
    let cursor: Vec<Option<String>> = asks.iter().map(|a| a.cursor.clone()).collect();
    let lead_stage: Vec<String> = leads.iter().map(|l| l.0.to_string()).collect();
    let lead_sender: Vec<String> = leads.iter().map(|l| l.1.to_string()).collect();
    let lead_us: Vec<f64> = leads.iter().map(|l| l.2).collect();
    // Each known sender's tenant knows the same lead, as the dispatcher charges both
    // (these tests' senders are alone in their tenants).
    let tlead_tenant: Vec<String> = lead_sender
        .iter()
        .map(|s| {
            let row = c.query_one("SELECT pepsi.tenant_of($1)", &[s]).unwrap();
            row.get(0)
        })
        .collect();
    let weights: Vec<f64> = leads.iter().map(|_| 1.0).collect();
    let rows = c
        .query(
            sql::CLAIM_FAIR,
            &[
                &stages,
                &caps,
                &fifo,
                &avg,
                &cursor,
                &lead_stage,
                &lead_sender,
                &lead_us,
                &max_hops,
                &None::<Vec<i64>>,
                &None::<Vec<bool>>,
                &None::<Vec<i64>>,
                &weights,
                &lead_stage,
                &tlead_tenant,
                &lead_us,
                &weights,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<i32>>,
            ],
        )
        .unwrap();
    let mut answer = Answer {
        rows: Vec::new(),
        ends: Vec::new(),
        due: None,
        returned: rows.len(),
    };
    for (i, r) in rows.iter().enumerate() {
        let due: Option<f64> = r.get(4);
        if i == 0 {
            answer.due = due;
        }
        assert_eq!(due, answer.due, "the due time is the same on every row");
        let id: Option<i64> = r.get(0);
        match id {
            Some(id) => {
                let end: Option<String> = r.get(6);
                assert_eq!(end, None, "a claimed row carries no window end");
                answer.rows.push(Claimed {
                    id,
                    stage: r.get(1),
                    sender: r.get(2),
                    token: r.get(3),
                    looped: r.get(5),
                })
            }
            None => {
                let tenant: Option<String> = r.get(9);
                if let (Some(stage), None) = (r.get::<_, Option<String>>(1), tenant) {
                    answer.ends.push((stage, r.get(6)));
                }
            }
        }
    }
    answer
}

/// Calls the fair claim inside a transaction that is rolled back, so one queue serves
/// several questions.
#[track_caller]
fn what_would_be_claimed(c: &mut Client, asks: &[Ask], leads: &[Lead]) -> Answer {
    let mut tx = c.transaction().unwrap();
    let answer = claim_fair(&mut tx, asks, leads, MAX_HOPS);
    tx.rollback().unwrap();
    answer
}

/// Adds `n` pending rows at `stage` from `from` (sender key `from:<domain>`), straight
/// into the queue; returns their ids, oldest first.
pub(super) fn add(c: &mut Client, stage: &str, from: &str, n: i64) -> Vec<i64> {
    let mut ids: Vec<i64> = c
        .query(
            "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
             SELECT $1, $2, ARRAY['r@y.example'] FROM generate_series(1, $3::int8) \
             RETURNING workqueue_id",
            &[&stage, &from, &n],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.sort_unstable();
    ids
}

/// The sender key of mail from `from`.
fn key(from: &str) -> String {
    format!("from:{}", from.split_once('@').unwrap().1)
}

/// The default tenant of an address's sender key, for these tests' two-label domains
/// (`pepsi.tenant_default`): the windows walk tenants.
fn tenant(from: &str) -> String {
    format!("domain:{}", from.split_once('@').unwrap().1)
}

fn status(c: &mut Client, id: i64) -> String {
    c.query_one(
        "SELECT status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

#[test]
fn the_fair_claim_never_takes_more_than_the_cap() {
    let db = TestDb::new();
    let mut c = db.client();
    // 100 senders with two rows each at `a`, five rows at `b`.
    let senders: Vec<String> = (0..100).map(|i| format!("x@d{i:03}.example")).collect();
    for s in &senders {
        add(&mut c, "a", s, 2);
    }
    let at_b = add(&mut c, "b", "y@b.example", 5);
    let answer = claim_fair(&mut c, &[ask("a", 7), ask("b", 0)], &[], MAX_HOPS);
    assert_eq!(answer.at("a").len(), 7, "{answer:?}");
    assert!(answer.at("b").is_empty(), "{answer:?}");
    // All level, so seven senders get one row each.
    let distinct: HashSet<&str> = answer.rows.iter().map(|r| r.sender.as_str()).collect();
    assert_eq!(distinct.len(), 7, "{answer:?}");
    let running: i64 = c
        .query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(running, 7);
    for id in at_b {
        assert_eq!(status(&mut c, id), "pending");
    }
    // 100 senders fill the window of 64: it ends at the 64th; `b`, asked for nothing,
    // keeps its cursor.
    assert_eq!(answer.end("a"), Some(tenant(&senders[63])));
    assert_eq!(answer.end("b"), None);
    assert_eq!(answer.returned, 7 + 2);
    // FIFO slots beyond the cap are still within the cap.
    let answer = claim_fair(&mut c, &[ask("a", 3).fifo(10)], &[], MAX_HOPS);
    assert_eq!(answer.at("a").len(), 3, "{answer:?}");
}

#[test]
fn a_flood_alternates_with_a_level_sender_and_a_lead_yields() {
    let db = TestDb::new();
    let mut c = db.client();
    let a = add(&mut c, "a", "x@flood.example", 1000);
    let b = add(&mut c, "a", "x@small.example", 10);
    let (ka, kb) = (key("x@flood.example"), key("x@small.example"));
    let set = |ids: &[i64]| ids.iter().copied().collect::<HashSet<i64>>();

    // A has lead 0 and B none, so B is level: they alternate, five each.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 10)], &[("a", &ka, 0.0)]);
    let want: HashSet<i64> = a[..5].iter().chain(&b[..5]).copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");

    // A is 50 ms ahead of B: B's ten come first.
    let leads = [("a", ka.as_str(), 50_000.0), ("a", kb.as_str(), 0.0)];
    let answer = what_would_be_claimed(&mut c, &[ask("a", 10)], &leads);
    assert_eq!(answer.ids(), set(&b), "{answer:?}");
    // With a cap of 60, B's ten and then A's rows from rank 50 ms on: A's k-th row
    // ranks 50 + k ms, B's 10 rows 0…9 ms, so A's 50 oldest follow.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 60)], &leads);
    let want: HashSet<i64> = b.iter().chain(&a[..50]).copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");

    // A is 50 ms ahead and B has no lead: B starts level with the least-served sender
    // considered, which is A, so keeping quiet bought B nothing: they alternate.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 10)], &[("a", &ka, 50_000.0)]);
    let want: HashSet<i64> = a[..5].iter().chain(&b[..5]).copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");

    // Level with the least-served: with C at 0 and A at 50 ms, B (no lead) ranks with
    // C, and both come before A.
    let c_ids = add(&mut c, "a", "x@third.example", 5);
    let kc = key("x@third.example");
    let leads = [("a", ka.as_str(), 50_000.0), ("a", kc.as_str(), 0.0)];
    let answer = what_would_be_claimed(&mut c, &[ask("a", 10)], &leads);
    let want: HashSet<i64> = b[..5].iter().chain(&c_ids).copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");

    // A lead of another stage does not count here.
    let leads = [("other", ka.as_str(), 50_000.0)];
    let answer = what_would_be_claimed(&mut c, &[ask("a", 3)], &leads);
    assert_eq!(answer.ids(), set(&[a[0], b[0], c_ids[0]]), "{answer:?}");
}

#[test]
fn equal_ranks_go_to_the_lower_id() {
    let db = TestDb::new();
    let mut c = db.client();
    // At t1 P's rows are older, at t2 Q's. Cap 3: both senders' rank-0 rows, then the
    // rank-1 row with the lower id.
    let p1 = add(&mut c, "t1", "x@p.example", 3);
    let q1 = add(&mut c, "t1", "x@q.example", 3);
    let q2 = add(&mut c, "t2", "x@q.example", 3);
    let p2 = add(&mut c, "t2", "x@p.example", 3);
    let answer = claim_fair(&mut c, &[ask("t1", 3), ask("t2", 3)], &[], MAX_HOPS);
    let at = |stage: &str| -> Vec<i64> {
        let mut ids: Vec<i64> = answer.at(stage).iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(at("t1"), vec![p1[0], p1[1], q1[0]]);
    assert_eq!(at("t2"), vec![q2[0], q2[1], p2[0]]);
}

#[test]
fn the_fifo_reserve_takes_the_oldest_rows_whatever_their_rank() {
    let db = TestDb::new();
    let mut c = db.client();
    let flood = add(&mut c, "a", "x@flood.example", 300);
    let newcomers: Vec<i64> = (1..=5)
        .map(|i| add(&mut c, "a", &format!("x@new{i}.example"), 1)[0])
        .collect();
    let kf = key("x@flood.example");
    let keys: Vec<String> = (1..=5).map(|i| key(&format!("x@new{i}.example"))).collect();
    let mut leads: Vec<Lead> = vec![("a", kf.as_str(), 1e9)];
    leads.extend(keys.iter().map(|k| ("a", k.as_str(), 0.0)));
    let set = |ids: &[i64]| ids.iter().copied().collect::<HashSet<i64>>();

    // By rank alone the flood, a thousand seconds ahead, gets nothing.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 4)], &leads);
    assert_eq!(answer.ids(), set(&newcomers[..4]), "{answer:?}");
    // Two FIFO slots: the stage's two oldest rows, then the best ranked.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 4).fifo(2)], &leads);
    let want = set(&[flood[0], flood[1], newcomers[0], newcomers[1]]);
    assert_eq!(answer.ids(), want, "{answer:?}");
    // FIFO slots never exceed the cap.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 4).fifo(9)], &leads);
    assert_eq!(answer.ids(), set(&flood[..4]), "{answer:?}");
}

#[test]
fn the_window_of_senders_rotates_until_every_sender_was_served() {
    let db = TestDb::new();
    let mut c = db.client();
    let senders: Vec<String> = (0..200).map(|i| format!("x@d{i:03}.example")).collect();
    for s in &senders {
        add(&mut c, "a", s, 1);
    }
    let mut cursor: Option<String> = None;
    let mut served: Vec<String> = Vec::new();
    let mut calls = 0;
    let mut ends = Vec::new();
    while served.len() < senders.len() {
        calls += 1;
        assert!(
            calls <= 4,
            "200 senders take ⌈200/64⌉ = 4 calls; served {served:?}"
        );
        let answer = claim_fair(&mut c, &[ask("a", 64).cursor(cursor)], &[], MAX_HOPS);
        served.extend(answer.rows.iter().map(|r| r.sender.clone()));
        cursor = answer.end("a");
        ends.push(cursor.clone());
    }
    assert_eq!(served.len(), 200);
    let distinct: HashSet<&String> = served.iter().collect();
    assert_eq!(distinct.len(), 200, "each sender once");
    assert_eq!(
        ends,
        vec![
            Some(tenant(&senders[63])),
            Some(tenant(&senders[127])),
            Some(tenant(&senders[191])),
            None
        ]
    );

    // Wrapping round: 70 senders at `w`, the cursor at the 41st. The window runs from
    // the 42nd to the last, then from the first on: 29 + 35 senders, and it is full,
    // so it ends at the 35th. The next call takes the six left and ends the round.
    let senders: Vec<String> = (0..70).map(|i| format!("x@w{i:02}.example")).collect();
    for s in &senders {
        add(&mut c, "w", s, 1);
    }
    let answer = claim_fair(
        &mut c,
        &[ask("w", 100).cursor(Some(tenant(&senders[40])))],
        &[],
        MAX_HOPS,
    );
    let got: HashSet<String> = answer.rows.iter().map(|r| r.sender.clone()).collect();
    let want: HashSet<String> = senders[41..]
        .iter()
        .chain(&senders[..35])
        .map(|s| key(s))
        .collect();
    assert_eq!(got, want);
    assert_eq!(answer.end("w"), Some(tenant(&senders[34])));
    let answer = claim_fair(
        &mut c,
        &[ask("w", 100).cursor(answer.end("w"))],
        &[],
        MAX_HOPS,
    );
    let got: HashSet<String> = answer.rows.iter().map(|r| r.sender.clone()).collect();
    let want: HashSet<String> = senders[35..41].iter().map(|s| key(s)).collect();
    assert_eq!(got, want);
    assert_eq!(answer.end("w"), None);
}

#[test]
fn a_stage_with_no_more_rows_than_fit_is_claimed_whole_as_the_ranking_would() {
    let db = TestDb::new();
    let mut c = db.client();
    // Five senders with three rows each at `a`: 15 rows, within a window of 64.
    let senders: Vec<String> = (0..5).map(|i| format!("x@s{i}.example")).collect();
    let mut all = HashSet::new();
    for s in &senders {
        all.extend(add(&mut c, "a", s, 3));
    }
    // A cap of exactly 15, from a cursor in the middle, a sender with a lead and FIFO
    // slots: every row, and the window ends (NULL) as a walk over every sender ends.
    let ahead = key(&senders[1]);
    let mut tx = c.transaction().unwrap();
    let answer = claim_fair(
        &mut tx,
        &[ask("a", 15).fifo(2).cursor(Some(tenant(&senders[2])))],
        &[("a", &ahead, 1e9)],
        MAX_HOPS,
    );
    assert_eq!(answer.ids(), all, "{answer:?}");
    assert_eq!(answer.end("a"), None);
    let tokens: HashSet<i64> = answer.rows.iter().map(|r| r.token).collect();
    assert_eq!(tokens.len(), 15, "a token per row: {answer:?}");
    tx.rollback().unwrap();

    // One row fewer than the rows: the ranking decides, and the sender far ahead is
    // the one left short.
    let mut tx = c.transaction().unwrap();
    let answer = claim_fair(&mut tx, &[ask("a", 14)], &[("a", &ahead, 1e9)], MAX_HOPS);
    assert_eq!(answer.rows.len(), 14, "{answer:?}");
    let short: Vec<&String> = answer
        .rows
        .iter()
        .map(|r| &r.sender)
        .filter(|s| **s == ahead)
        .collect();
    assert_eq!(short.len(), 2, "the sender ahead yields a row: {answer:?}");
    tx.rollback().unwrap();

    // A row another session holds is still skipped when the stage is claimed whole.
    let held = *all.iter().min().unwrap();
    let mut locker = db.client();
    let mut lock = locker.transaction().unwrap();
    lock.query_one(
        "SELECT 1 FROM pepsi.workqueue WHERE workqueue_id = $1 FOR UPDATE",
        &[&held],
    )
    .unwrap();
    let answer = claim_fair(&mut c, &[ask("a", 64)], &[], MAX_HOPS);
    let mut rest = all.clone();
    rest.remove(&held);
    assert_eq!(answer.ids(), rest, "{answer:?}");
    lock.rollback().unwrap();
    assert_eq!(status(&mut c, held), "pending");
}

#[test]
fn a_row_another_session_holds_is_skipped_and_the_next_takes_its_slot() {
    let db = TestDb::new();
    let mut c = db.client();
    let s = add(&mut c, "a", "x@s.example", 5);
    let t = add(&mut c, "a", "x@t.example", 3);
    // An operator holds the stage's oldest row, which the FIFO slot would take.
    let mut other = db.client();
    let mut held = other.transaction().unwrap();
    held.query(
        "SELECT 1 FROM pepsi.workqueue WHERE workqueue_id = $1 FOR UPDATE",
        &[&s[0]],
    )
    .unwrap();
    // Waiting for it would fail the claim instead of passing the test.
    c.batch_execute("SET lock_timeout = '5s'").unwrap();
    // In line: s[0] (FIFO), then t[0] (rank 0), s[1] and t[1] (rank 1 ms, by id).
    // s[0] is skipped and the next in line, s[1], takes its slot.
    let answer = claim_fair(&mut c, &[ask("a", 2).fifo(1)], &[], MAX_HOPS);
    assert_eq!(
        answer.ids(),
        [t[0], s[1]].into_iter().collect(),
        "{answer:?}"
    );
    held.rollback().unwrap();
    assert_eq!(status(&mut c, s[0]), "pending");
    // Released, it is the next claim's oldest row.
    let answer = claim_fair(&mut c, &[ask("a", 1).fifo(1)], &[], MAX_HOPS);
    assert_eq!(answer.ids(), [s[0]].into_iter().collect());
}

#[test]
fn the_fair_claim_stamps_a_token_per_row_counts_hops_and_tells_the_due_time() {
    let db = TestDb::new();
    let mut c = db.client();
    let a = add(&mut c, "a", "x@a.example", 3);
    let b = add(&mut c, "b", "x@b.example", 2);
    // a[0] arrived from stage z after 3 hops: this claim is its 4th, past MAX_HOPS 3.
    // a[1] is retried at the stage of its previous claim: no hop.
    c.execute(
        "UPDATE pepsi.workqueue SET hops = 3, hop_stage = 'z' WHERE workqueue_id = $1",
        &[&a[0]],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET hops = 3, hop_stage = 'a' WHERE workqueue_id = $1",
        &[&a[1]],
    )
    .unwrap();
    let paused = add(&mut c, "p", "x@p.example", 1)[0];
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '1 hour' \
         WHERE workqueue_id = $1",
        &[&paused],
    )
    .unwrap();
    let answer = claim_fair(&mut c, &[ask("a", 5), ask("b", 5)], &[], 3);
    assert_eq!(answer.rows.len(), 5, "{answer:?}");
    let tokens: HashSet<i64> = answer.rows.iter().map(|r| r.token).collect();
    assert_eq!(
        tokens.len(),
        5,
        "a token per row, none telling another's: {answer:?}"
    );
    let token = |id: i64| answer.rows.iter().find(|r| r.id == id).unwrap().token;
    let due = answer.due.expect("a paused row is due");
    assert!((3590.0..=3600.0).contains(&due), "{due}");
    let looped: Vec<i64> = answer
        .rows
        .iter()
        .filter(|r| r.looped)
        .map(|r| r.id)
        .collect();
    assert_eq!(looped, vec![a[0]]);
    let row = |c: &mut Client, id: i64| -> (String, i32, Option<String>, i64, Option<String>) {
        let r = c
            .query_one(
                "SELECT status::text, hops, hop_stage, claim, state ->> 'failure_class' \
                 FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
    };
    assert_eq!(
        row(&mut c, a[0]),
        (
            "failed".into(),
            4,
            Some("a".into()),
            token(a[0]),
            Some("looped".into())
        )
    );
    assert_eq!(
        row(&mut c, a[1]),
        ("running".into(), 3, Some("a".into()), token(a[1]), None)
    );
    assert_eq!(
        row(&mut c, b[0]),
        ("running".into(), 1, Some("b".into()), token(b[0]), None)
    );
    // Nothing left to claim; the next row's token is none of the earlier ones.
    let answer = claim_fair(&mut c, &[ask("a", 5), ask("b", 5)], &[], 3);
    assert!(answer.rows.is_empty(), "{answer:?}");
    add(&mut c, "b", "x@b.example", 1);
    let next = claim_fair(&mut c, &[ask("b", 5)], &[], 3);
    assert_eq!(next.rows.len(), 1);
    assert!(!tokens.contains(&next.rows[0].token), "{next:?}");
    // No stage asked: one row, with the due time only.
    let answer = claim_fair(&mut c, &[], &[], 3);
    assert_eq!(answer.returned, 1);
    assert!(answer.rows.is_empty() && answer.ends.is_empty() && answer.due.is_some());
}

/// The oldest-first claim statement of releases 3 to 12 (before schema 13 made it a
/// function), to claim on a database as release 3 left it.
const RELEASE_3_CLAIM: &str = "WITH want AS ( \
         SELECT w.stage, w.cap FROM unnest($1::text[], $2::int4[]) AS w(stage, cap) WHERE w.cap > 0 \
     ), picked AS MATERIALIZED ( \
         SELECT p.workqueue_id FROM want w CROSS JOIN LATERAL ( \
             SELECT q.workqueue_id FROM pepsi.workqueue q \
              WHERE q.stage >= w.stage AND q.stage <= w.stage AND q.status = 'pending' \
              ORDER BY q.stage, q.workqueue_id LIMIT w.cap \
                FOR NO KEY UPDATE SKIP LOCKED) p \
     ), claimed AS ( \
         UPDATE pepsi.workqueue q \
            SET status = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > $3::int4 \
                              THEN 'failed' ELSE 'running' END::pepsi.workqueue_status, \
                hops = q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int, \
                hop_stage = q.stage, \
                claim = (SELECT nextval('pepsi.workqueue_claim_seq')), \
                state = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > $3::int4 \
                             THEN q.state || jsonb_build_object( \
                                 'failure_class', 'looped', 'failed_stage', q.stage, \
                                 'last_error', 'looped: claimed at a changed stage more than MAX_HOPS (' \
                                               || $3::int4 || ') times') \
                             ELSE q.state END \
           FROM unnest(ARRAY(SELECT workqueue_id FROM picked)) AS p(id) \
          WHERE q.workqueue_id = p.id AND q.status::text = 'pending' \
         RETURNING q.workqueue_id, q.stage, q.sender_key, q.claim, q.status = 'failed' AS looped \
     ) \
     SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, n.due, c.looped \
       FROM (SELECT extract(epoch FROM min(timeout))::float8 - extract(epoch FROM now())::float8 \
                    AS due \
               FROM pepsi.workqueue WHERE status = 'paused') n \
       LEFT JOIN claimed c ON true";

#[test]
fn upgrading_from_schema_3_keeps_rows_in_flight_and_adds_the_fair_claim() {
    let db = TestDb::empty();
    let dir = TempDir::new("fair-upgrade");
    let mut c = db.client();
    // A database as release 3 left it: rows pending, claimed (tokens, hops), paused.
    crate::util::install_schema_upto(&mut c, 3);
    let ids = add(&mut c, "a", "x@a.example", 12);
    let rows = c
        .query(
            RELEASE_3_CLAIM,
            &[&vec!["a".to_string()], &vec![5i32], &MAX_HOPS],
        )
        .unwrap();
    assert_eq!(rows.len(), 5);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '1 hour' \
         WHERE workqueue_id = $1",
        &[&ids[11]],
    )
    .unwrap();
    c.batch_execute("INSERT INTO pepsi.stage_stats (stage, passes) VALUES ('a', 7)")
        .unwrap();
    const ROWS: &str = "SELECT workqueue_id, stage, status::text, claim, hops, hop_stage, \
                               state::text, sender_key, timeout::text \
                          FROM pepsi.workqueue ORDER BY workqueue_id";
    type Row = (
        i64,
        String,
        String,
        i64,
        i32,
        Option<String>,
        String,
        String,
        Option<String>,
    );
    let snapshot = |c: &mut Client| -> Vec<Row> {
        c.query(ROWS, &[])
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r.get(0),
                    r.get(1),
                    r.get(2),
                    r.get(3),
                    r.get(4),
                    r.get(5),
                    r.get(6),
                    r.get(7),
                    r.get(8),
                )
            })
            .collect()
    };
    let before = snapshot(&mut c);
    assert_eq!(
        before.iter().filter(|r| r.2 == "running").count(),
        5,
        "{before:?}"
    );

    let conf = write_config(&dir, &db, "");
    let version = crate::util::upgrade_with_setup(&mut c, &conf);
    assert!(version >= 4);
    assert_eq!(snapshot(&mut c), before, "every row kept as it was");
    let (passes, served): (i64, i64) = c
        .query_one(
            "SELECT passes, senders_served FROM pepsi.stage_stats WHERE stage = 'a'",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!((passes, served), (7, 0));
    // The fair claim works on the upgraded queue, under fresh tokens.
    let old_tokens: HashSet<i64> = before.iter().map(|r| r.3).collect();
    let answer = claim_fair(&mut c, &[ask("a", 10)], &[], MAX_HOPS);
    let want: HashSet<i64> = ids[5..11].iter().copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");
    assert!(answer.rows.iter().all(|r| !old_tokens.contains(&r.token)));
    assert!(answer.due.is_some());
}

/// A psql script: [`sql::CLAIM_FAIR`] prepared as `fair`, then `n` calls with `args`
/// (its first twelve parameters as SQL literals, the tenants' eight NULL), each in a
/// transaction rolled back.
fn prepared_calls(args: &str, n: usize) -> String {
    format!(
        "PREPARE fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4, \
         int8[], bool[], int8[], float8[], text[], text[], float8[], float8[], text[], text[], \
         text[], int4[], text[], text[], int4[]) AS {};\n",
        sql::CLAIM_FAIR
    ) + &format!(
        "BEGIN;\nEXECUTE fair({args}, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, \
         NULL, NULL);\nROLLBACK;\n"
    )
    .repeat(n)
}

/// The plan lines of every statement `auto_explain` logged while `psql` ran `calls`
/// (superuser: `LOAD` of a library outside `plugins/` needs it).
pub(super) fn nested_plans(db: &TestDb, calls: &str) -> String {
    let script = format!(
        "\\set ON_ERROR_STOP on\n\
         LOAD 'auto_explain';\n\
         SET auto_explain.log_min_duration = 0;\n\
         SET auto_explain.log_analyze = on;\n\
         SET auto_explain.log_timing = off;\n\
         SET auto_explain.log_buffers = on;\n\
         SET auto_explain.log_nested_statements = on;\n\
         SET auto_explain.log_level = notice;\n\
         SET client_min_messages = notice;\n\
         {calls}"
    );
    let mut child = Command::new(pg::psql())
        .args(["-X", "-q", "-d", &db.conninfo, "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", pg::psql().display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "psql failed:\n{text}");
    text
}

/// Fails when a node of any logged plan read more than `most` rows in all (actual rows
/// per loop × loops, rows removed by a filter, heap fetches), a node of a statement
/// inside the function touched more than `pages` buffers, or the queue was scanned
/// whole. The buffers catch what the row counts do not show: index entries an index
/// scan steps over because they fail its conditions (a sender matched by equality
/// after a range on the stage is such a condition: the scan would step over every
/// later sender's entries). The calling statement's buffers are the sum of the
/// function's statements (and, in a session's first call, of their planning), so
/// only its rows are bounded.
#[track_caller]
pub(super) fn assert_reads_at_most(plans: &str, most: f64, pages: f64, when: &str) {
    let number_after = |line: &str, tag: &str| -> Option<f64> {
        let rest = &line[line.find(tag)? + tag.len()..];
        let end = rest
            .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    let mut loops = 1.0;
    let mut nodes = 0;
    let mut caller = false;
    for line in plans.lines() {
        if let Some(text) = line.strip_prefix("Query Text: ") {
            caller =
                text.contains("workqueue_claim_fair(") || text.contains("workqueue_claim_oldest(");
        }
        if let Some(rows) = number_after(line, "actual rows=") {
            loops = number_after(line, "loops=").unwrap_or(1.0);
            nodes += 1;
            assert!(
                rows * loops <= most,
                "{when}: a node read {rows} × {loops} rows, more than {most}: {line}\n{plans}"
            );
        }
        for tag in [
            "Rows Removed by Filter: ",
            "Rows Removed by Index Recheck: ",
        ] {
            if let Some(removed) = number_after(line, tag) {
                assert!(
                    removed * loops <= most,
                    "{when}: {line} (× {loops} loops) is more than {most}\n{plans}"
                );
            }
        }
        if let Some(fetches) = number_after(line, "Heap Fetches: ") {
            assert!(fetches <= most, "{when}: {line}\n{plans}");
        }
        if line.contains("Buffers: shared") && !caller {
            let touched = number_after(line, "hit=").unwrap_or(0.0)
                + number_after(line, "read=").unwrap_or(0.0);
            assert!(
                touched <= pages,
                "{when}: a node touched {touched} buffers, more than {pages}: {line}\n{plans}"
            );
        }
        assert_lacks!(line, "Seq Scan on workqueue", "{when}: {line}\n{plans}");
    }
    assert!(nodes > 0, "{when}: no plan was logged:\n{plans}");
}

/// The median time of `n` fair claims, each rolled back.
fn median_claim_time(c: &mut Client, asks: &[Ask], leads: &[Lead], n: usize) -> Duration {
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let started = Instant::now();
            what_would_be_claimed(c, asks, leads);
            started.elapsed()
        })
        .collect();
    times.sort();
    times[n / 2]
}

#[test]
fn the_fair_claim_reads_no_more_than_its_window_however_deep_a_backlog() {
    let db = TestDb::new();
    let mut c = db.client();
    // The statistics stay as the burst left them until the test runs ANALYZE itself.
    c.batch_execute("ALTER TABLE pepsi.workqueue SET (autovacuum_enabled = off)")
        .unwrap();
    // The flood is an authenticated submitter (sender key `user:flood`): the quickest
    // key to compute, and a million rows are inserted here.
    let insert_flood = |c: &mut Client, n: i64| {
        c.execute(
            "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, auth_user) \
             SELECT 'a', 'x@flood.example', ARRAY['r@y.example'], 'flood' \
               FROM generate_series(1, $1::int8)",
            &[&n],
        )
        .unwrap();
    };
    insert_flood(&mut c, 1000);
    // 50 other senders, whose keys sort before the flood's: 25 with 20 rows each (more
    // than the cap), each its own tenant, and 25 with one (a scan of such a sender's
    // rows that does not stop at its last entry would run on into the flood's), all of
    // one tenant (several.example), so that its senders are walked too.
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
         SELECT 'a', 'x@other' || (g % 25) || '.example', ARRAY['r@y.example'] \
           FROM generate_series(1, 500) g \
         UNION ALL \
         SELECT 'a', 'x@single' || g || '.several.example', ARRAY['r@y.example'] \
           FROM generate_series(1, 25) g",
        &[],
    )
    .unwrap();
    let (senders, cap, fifo) = (51.0, 16, 2);
    let most = senders * f64::from(cap) + f64::from(fifo);
    let leads: Vec<Lead> = vec![("a", "user:flood", 0.0)];
    let asks = [ask("a", cap).fifo(fifo)];
    let shallow = median_claim_time(&mut c, &asks, &leads, 21);

    let started = Instant::now();
    insert_flood(&mut c, 999_000);
    let filled = started.elapsed();
    // A node may touch three buffers per row it may read (index pages, heap pages):
    // far fewer than a walk over the flood's entries in either pending index.
    let pages = 3.0 * most;
    let index_pages: i64 = c
        .query_one(
            "SELECT least(pg_relation_size('pepsi.workqueue_pending_tenant_idx'), \
                          pg_relation_size('pepsi.workqueue_pending_idx')) / 8192",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        index_pages as f64 > 1.5 * pages,
        "{index_pages} index pages"
    );

    // Seven calls in one session: the first five with custom plans, the later ones
    // with the generic plans PL/pgSQL switches to.
    let call = prepared_calls(
        "'{a}', '{16}', '{2}', '{1000}', '{NULL}', '{a}', '{user:flood}', '{0}', 100, NULL, NULL, NULL",
        7,
    );
    for when in ["a fresh burst", "after ANALYZE"] {
        if when == "after ANALYZE" {
            c.batch_execute("ANALYZE pepsi.workqueue").unwrap();
        }
        let plans = nested_plans(&db, &call);
        for walk in ["WITH RECURSIVE walk(key", "WITH RECURSIVE walk(i"] {
            assert_eq!(
                plans.matches(walk).count(),
                7,
                "{when}: every call's nested statements are logged ({walk}):\n{plans}"
            );
        }
        assert!(plans.contains("workqueue_pending_tenant_idx"), "{plans}");
        assert!(plans.contains("workqueue_pending_idx"), "{plans}");
        assert_reads_at_most(&plans, most, pages, when);
        // The tenants' walk over (tenant, sender) pairs: one probe per tenant of one
        // sender, two for several.example (its second sender, then past it), 27
        // found, one for the first (the wrap; the NULL cursor's own probe reads
        // nothing). The walk of several.example's senders: three probes at most per
        // sender walked (its NULL cursor's, its first sender, one that finds no
        // more); no other tenant's senders are probed.
        for (walk, most) in [
            ("WITH RECURSIVE walk(key", senders + 2.0),
            ("WITH RECURSIVE walk(i", 3.0 * senders),
        ] {
            for plan in plans.split("Query Text: ").filter(|b| b.starts_with(walk)) {
                let probes: f64 = plan
                    .lines()
                    .filter(|l| l.contains("Scan using workqueue_pending_tenant_idx"))
                    .filter_map(|l| l.split("loops=").nth(1))
                    .filter_map(|n| n.trim_end_matches(')').parse::<f64>().ok())
                    .sum();
                assert!(
                    probes <= most,
                    "{when}: {probes} probes for {senders} senders:\n{plan}"
                );
            }
        }
        if when == "a fresh burst" {
            // One call's plans, for the record (`--nocapture`).
            let first = plans.split("Query Text: PREPARE").next().unwrap();
            eprintln!("fair claim, 1,000,000-row backlog, {when}, first call:\n{first}");
        }
    }
    let deep = median_claim_time(&mut c, &asks, &leads, 21);
    eprintln!(
        "fair claim (51 senders, cap 16, fifo 2), median of 21: {shallow:?} with a 1,000-row \
         backlog, {deep:?} with 1,000,000 (filled in {filled:?})"
    );
    let answer = claim_fair(&mut c, &asks, &leads, MAX_HOPS);
    assert_eq!(answer.rows.len(), 16, "{answer:?}");
}

/// Scenario (f) of the pipeline benchmark: one sender 100,000 rows deep and 50 small
/// ones, analyzed. From the sixth call of a session PL/pgSQL may use generic plans, and
/// before schema 24 the read of the stage's 513 oldest rows then took the covering
/// sender index and sorted the whole stage: 100,500 rows a claim.
#[test]
fn the_fair_claims_generic_plans_stop_at_the_window_at_a_middling_depth() {
    let db = TestDb::new();
    let mut c = db.client();
    c.batch_execute(
        "ALTER TABLE pepsi.workqueue SET (autovacuum_enabled = off);
         INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to)
         SELECT 'a', 'flood@a.example', ARRAY['r@y.example'] FROM generate_series(1, 100000);
         INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to)
         SELECT 'a', 'x@s' || (g % 50) || '.example', ARRAY['r@y.example']
           FROM generate_series(1, 500) g;",
    )
    .unwrap();
    c.batch_execute("VACUUM ANALYZE pepsi.workqueue").unwrap();
    let (senders, cap, fifo) = (51.0, 16, 2);
    let most = senders * f64::from(cap) + f64::from(fifo);
    let call = prepared_calls(
        "'{a}', '{16}', '{2}', '{1000}', '{NULL}', '{}', '{}', '{}', 100, NULL, NULL, NULL",
        8,
    );
    let plans = nested_plans(&db, &call);
    assert_eq!(
        plans.matches("LIMIT 513) x").count(),
        8,
        "every call reads the stage's oldest rows:\n{plans}"
    );
    assert_reads_at_most(&plans, most, 3.0 * most, "100,000 deep, analyzed");
    assert_lacks!(plans, "Sort Key: q.stage, q.workqueue_id");
}

#[test]
fn one_waiting_sender_is_claimed_oldest_first_without_the_window() {
    // One sender deep at a stage (schema 24): the claim is its oldest rows up to the cap,
    // as the full pick would take them, without the read of 513 rows or the walk. A
    // second sender, arriving last, brings the window back.
    let db = TestDb::new();
    let mut c = db.client();
    let flood = add(&mut c, "a", "x@flood.example", 1000);
    let answer = what_would_be_claimed(&mut c, &[ask("a", 16).fifo(2)], &[]);
    let want: HashSet<i64> = flood[..16].iter().copied().collect();
    assert_eq!(answer.ids(), want, "{answer:?}");
    assert_eq!(answer.end("a"), None, "the window reached every sender");
    // A cap beyond the window's 64 is filled too.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 100)], &[]);
    let want: HashSet<i64> = flood[..100].iter().copied().collect();
    assert_eq!(answer.ids(), want);
    let one = prepared_calls(
        "'{a}', '{16}', '{2}', '{1000}', '{NULL}', '{}', '{}', '{}', 100, NULL, NULL, NULL",
        1,
    );
    let plans = nested_plans(&db, &one);
    assert_lacks!(plans, "LIMIT 513) x");
    assert_lacks!(plans, "WITH RECURSIVE walk");
    // The take updates 16 rows and their index entries: a few hundred buffers.
    assert_reads_at_most(&plans, 100.0, 1000.0, "one sender");

    // The newest row from another sender: the window again, and its row is ranked in.
    let late = add(&mut c, "a", "y@late.example", 1);
    let answer = what_would_be_claimed(&mut c, &[ask("a", 16).fifo(2)], &[]);
    assert!(answer.ids().contains(&late[0]), "{answer:?}");
    assert_eq!(answer.rows.len(), 16);
    let plans = nested_plans(&db, &one);
    assert_has!(plans, "LIMIT 513) x");
}

#[test]
fn senders_whose_keys_differ_only_by_hostile_characters_are_not_one_sender() {
    // A flood of `user:flood` and, newest, one row each of keys that print the same or
    // nearly: a bidi override, CR/LF with a forged line, a NUL-free 100 KB name. Each is
    // a sender of its own, so the window runs and ranks each one's row in ahead of the
    // flood's backlog.
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, auth_user) \
         SELECT 'a', 'x@flood.example', ARRAY['r@y.example'], 'flood' FROM generate_series(1, 1000)",
        &[],
    )
    .unwrap();
    let long = "flood".to_string() + &"x".repeat(100_000);
    let mut late = Vec::new();
    for user in ["flood\u{202e}", "flood\r\nX-Forged: yes", long.as_str()] {
        let id: i64 = c
            .query_one(
                "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, auth_user) \
                 VALUES ('a', 'x@flood.example', ARRAY['r@y.example'], $1) RETURNING workqueue_id",
                &[&user],
            )
            .unwrap()
            .get(0);
        late.push(id);
    }
    let keys: i64 = c
        .query_one(
            "SELECT count(DISTINCT sender_key) FROM pepsi.workqueue",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(keys, 4, "four senders");
    let answer = what_would_be_claimed(&mut c, &[ask("a", 16).fifo(2)], &[]);
    for id in &late {
        assert!(answer.ids().contains(id), "row {id} ranked in: {answer:?}");
    }
    assert_eq!(answer.rows.len(), 16);
}

#[test]
fn tenants_of_several_senders_are_walked_wherever_they_fall_in_the_window() {
    let db = TestDb::new();
    let mut c = db.client();
    // More than 512 rows, so that the window is walked: a flood of one sender, two
    // tenants of one sender, and two of three senders each, one in the middle of the
    // key order (m.example) and one last (z.example: the walk ends after it).
    add(&mut c, "a", "x@flood.example", 600);
    let several = [
        "x@s1.m.example",
        "x@s2.m.example",
        "x@s3.m.example",
        "x@s1.z.example",
        "x@s2.z.example",
        "x@s3.z.example",
    ];
    for from in ["x@a1.example", "x@a2.example"].iter().chain(&several) {
        add(&mut c, "a", from, 1);
    }
    // No leads: j = 0 gives each of the five tenants a row, j = 1 and j = 2 the flood,
    // m and z one each (their second and third senders), the rest is the flood's. A
    // tenant whose senders were not walked would give one row.
    let answer = what_would_be_claimed(&mut c, &[ask("a", 20)], &[]);
    let got: Vec<String> = answer.rows.iter().map(|r| r.sender.clone()).collect();
    for from in ["x@a1.example", "x@a2.example"].iter().chain(&several) {
        assert!(got.contains(&key(from)), "{from} claimed: {got:?}");
    }
    let flood = got.iter().filter(|s| **s == key("x@flood.example")).count();
    assert_eq!((got.len(), flood), (20, 12), "{got:?}");

    // A full window: at `b` 64 tenants of one row (c00 … c63; c63 the 64th in key
    // order, of two senders) and the flood's, the 65th. The window ends at c63, and
    // with 64 tenants each walks one sender: c63 answers where its walk stopped, as
    // one more sender waits.
    add(&mut c, "b", "x@flood.example", 600);
    for i in 0..63 {
        add(&mut c, "b", &format!("x@c{i:02}.example"), 1);
    }
    add(&mut c, "b", "x@s1.c63.example", 1);
    add(&mut c, "b", "x@s2.c63.example", 1);
    let mut tx = c.transaction().unwrap();
    let rows = tx
        .query(
            "SELECT tenant_key, window_end FROM pepsi.workqueue_claim_fair(\
             '{b}', '{64}', '{0}', '{1000}', '{NULL}', '{}', '{}', '{}', 100, NULL) \
             WHERE workqueue_id IS NULL",
            &[],
        )
        .unwrap();
    tx.rollback().unwrap();
    let ends: Vec<(Option<String>, Option<String>)> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        ends,
        vec![
            (None, Some("domain:c63.example".to_string())),
            (
                Some("domain:c63.example".to_string()),
                Some("from:s1.c63.example".to_string())
            ),
        ]
    );
}

#[test]
fn senders_of_one_tenant_whose_keys_differ_only_by_hostile_characters_are_walked_apart() {
    // One tenant (domain:x.example): a flood of `user:flood@x.example` and one row each
    // from logins that print the same or nearly (a bidi override, CR/LF with a forged
    // line). The walk over (tenant, sender) pairs must see three senders in that
    // tenant, so each late row is ranked in beside the flood's. A 100 KB login is kept
    // as a 200-character key with its digest, which no longer names the domain: it is
    // a tenant of its own, bounded like its key. A fourth tenant waits too.
    let db = TestDb::new();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, auth_user) \
         SELECT 'a', 'x@x.example', ARRAY['r@y.example'], 'flood@x.example' \
           FROM generate_series(1, 1000)",
        &[],
    )
    .unwrap();
    let long = format!("flood{}@x.example", "x".repeat(100_000));
    let mut late = Vec::new();
    for user in [
        "flood\u{202e}@x.example",
        "flood\r\nX-Forged: yes@x.example",
        long.as_str(),
    ] {
        let id: i64 = c
            .query_one(
                "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, auth_user) \
                 VALUES ('a', 'x@x.example', ARRAY['r@y.example'], $1) RETURNING workqueue_id",
                &[&user],
            )
            .unwrap()
            .get(0);
        late.push(id);
    }
    late.extend(add(&mut c, "a", "x@other.example", 1));
    let (senders, tenants): (i64, i64) = {
        let r = c
            .query_one(
                "SELECT count(DISTINCT sender_key), count(DISTINCT tenant_key) \
                   FROM pepsi.workqueue WHERE tenant_key = 'domain:x.example'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((senders, tenants), (3, 1), "three senders of one tenant");
    let longest: i32 = c
        .query_one(
            "SELECT max(octet_length(tenant_key)) FROM pepsi.workqueue",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(longest <= 220, "{longest}");
    let answer = what_would_be_claimed(&mut c, &[ask("a", 16)], &[]);
    for id in &late {
        assert!(answer.ids().contains(id), "row {id} ranked in: {answer:?}");
    }
    assert_eq!(answer.rows.len(), 16);
}

/// The rows a fair claim of `cap` at stage `a` takes, under the allowances `default`
/// (a tenant not listed) and `listed` (tenant, rows), rolled back.
fn claimed_under_rates(
    c: &mut Client,
    cap: i32,
    default: Option<i32>,
    listed: &[(&str, i32)],
) -> Vec<(i64, String)> {
    let stages = vec!["a".to_string()];
    let mut tx = c.transaction().unwrap();
    let rows = tx
        .query(
            sql::CLAIM_FAIR,
            &[
                &stages,
                &vec![cap],
                &vec![4i32],
                &vec![1000.0f64],
                &vec![None::<String>],
                &Vec::<String>::new(),
                &Vec::<String>::new(),
                &Vec::<f64>::new(),
                &MAX_HOPS,
                &None::<Vec<i64>>,
                &None::<Vec<bool>>,
                &None::<Vec<i64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<f64>>,
                &None::<Vec<f64>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &None::<Vec<String>>,
                &vec![default],
                &listed.iter().map(|_| "a").collect::<Vec<_>>(),
                &listed.iter().map(|l| l.0).collect::<Vec<_>>(),
                &listed.iter().map(|l| l.1).collect::<Vec<_>>(),
            ],
        )
        .unwrap();
    tx.rollback().unwrap();
    rows.iter()
        .filter_map(|r| Some((r.get::<_, Option<i64>>(0)?, r.get::<_, String>(9))))
        .collect()
}

#[test]
fn a_rate_holds_each_tenant_of_the_window_to_its_allowance_whatever_the_path() {
    let db = TestDb::new();
    let mut c = db.client();
    // A small stage (its rows fit the cap: claimed whole without a rate) and one sender
    // per tenant; the oldest rows are the throttled tenant's.
    add(&mut c, "a", "x@throttled.example", 5);
    add(&mut c, "a", "x@two.example", 5);
    add(&mut c, "a", "x@free.example", 5);
    let count = |rows: &[(i64, String)], t: &str| rows.iter().filter(|r| r.1 == t).count();
    let unlimited = claimed_under_rates(&mut c, 16, None, &[]);
    assert_eq!(unlimited.len(), 15);
    let rows = claimed_under_rates(
        &mut c,
        16,
        None,
        &[("domain:throttled.example", 0), ("domain:two.example", 2)],
    );
    assert_eq!(count(&rows, "domain:throttled.example"), 0, "{rows:?}");
    assert_eq!(count(&rows, "domain:two.example"), 2, "{rows:?}");
    assert_eq!(count(&rows, "domain:free.example"), 5, "{rows:?}");
    // A stage RATE's burst for every tenant not listed.
    let rows = claimed_under_rates(&mut c, 16, Some(3), &[("domain:two.example", 1)]);
    assert_eq!(count(&rows, "domain:throttled.example"), 3, "{rows:?}");
    assert_eq!(count(&rows, "domain:two.example"), 1, "{rows:?}");
    assert_eq!(count(&rows, "domain:free.example"), 3, "{rows:?}");
    // One tenant deep (the one-sender path without a rate): held all the same.
    c.batch_execute("DELETE FROM pepsi.workqueue").unwrap();
    add(&mut c, "a", "x@deep.example", 200);
    assert_eq!(claimed_under_rates(&mut c, 16, None, &[]).len(), 16);
    let rows = claimed_under_rates(&mut c, 16, None, &[("domain:deep.example", 4)]);
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(claimed_under_rates(&mut c, 16, None, &[("domain:deep.example", 0)]).is_empty());
}
