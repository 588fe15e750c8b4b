//! The fair claim's sweep (schema 18): while a snapshot is held, the read of the rows a
//! fair claim takes its senders and their candidates from starts past what the last
//! claim took and wraps round to the floor; the floor still bounds what is left
//! unread, the oldest rows' slots still read from it; and over a backlog whose oldest
//! rows wait, claims from the sweep read far fewer index entries than claims from the
//! floor, which step over the entries of every row taken above it again.

use postgres::{Client, GenericClient};

use super::fair_sql::{assert_reads_at_most, nested_plans};
use crate::util::TestDb;
use pepsi::db::sql;

/// Senders `s0@x0.example` … in turn: `n` rows at `stage`, ids ascending. Returns the
/// ids and each one's sender number.
fn interleaved(c: &mut Client, stage: &str, senders: i64, n: i64) -> Vec<(i64, i64)> {
    let mut rows: Vec<(i64, i64)> = c
        .query(
            "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
             SELECT $1, 's' || (g % $2) || '@x' || (g % $2) || '.example', \
                    ARRAY['r@y.example'] \
               FROM generate_series(0, $3::int8 - 1) g ORDER BY g \
             RETURNING workqueue_id, split_part(mail_from, '@', 1)",
            &[&stage, &senders, &n],
        )
        .unwrap()
        .iter()
        .map(|r| {
            let who: String = r.get(1);
            (r.get(0), who[1..].parse().unwrap())
        })
        .collect();
    rows.sort_unstable();
    rows
}

/// What one fair claim of one stage asks.
struct Ask<'a> {
    stage: &'a str,
    cap: i32,
    fifo: i32,
    floor: Option<i64>,
    sweep: Option<i64>,
    /// How many senders there are (numbered from 0).
    senders: i64,
    /// Senders (by number) with a lead so large they are served last; every other
    /// sender's lead is 0.
    behind: &'a [i64],
}

/// What it answers: the ids taken, the next floor and the next sweep.
#[derive(Debug)]
struct Took {
    ids: Vec<i64>,
    floor: Option<i64>,
    sweep: Option<i64>,
}

/// The fair claim of one stage, its senders' walk paused (as while a snapshot is held
/// and a walk was slow).
fn claim(c: &mut impl GenericClient, ask: &Ask) -> Took {
    let lead_stage: Vec<&str> = (0..ask.senders).map(|_| ask.stage).collect();
    let lead_sender: Vec<String> = (0..ask.senders)
        .map(|s| format!("from:x{s}.example"))
        .collect();
    let lead_us: Vec<f64> = (0..ask.senders)
        .map(|s| if ask.behind.contains(&s) { 1e12 } else { 0.0 })
        .collect();
    // Each sender is alone in its tenant (its domain), which knows the same lead.
    let lead_tenant: Vec<String> = (0..ask.senders)
        .map(|s| format!("domain:x{s}.example"))
        .collect();
    let weights: Vec<f64> = lead_us.iter().map(|_| 1.0).collect();
    let rows = c
        .query(
            sql::CLAIM_FAIR,
            &[
                &vec![ask.stage],
                &vec![ask.cap],
                &vec![ask.fifo],
                &vec![1000.0f64],
                &vec![None::<String>],
                &lead_stage,
                &lead_sender,
                &lead_us,
                &100i32,
                &vec![ask.floor],
                &vec![false],
                &vec![ask.sweep],
                &weights,
                &lead_stage,
                &lead_tenant,
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
    let mut ids: Vec<i64> = rows.iter().filter_map(|r| r.get(0)).collect();
    ids.sort_unstable();
    let answer = rows
        .iter()
        .find(|r| r.get::<_, Option<i64>>(0).is_none())
        .expect("a row for the stage");
    Took {
        ids,
        floor: answer.get(7),
        sweep: answer.get(8),
    }
}

#[test]
fn a_sweep_reads_past_what_the_last_claim_took_and_wraps_round_to_the_floor() {
    let db = TestDb::new();
    let mut c = db.client();
    let rows = interleaved(&mut c, "a", 4, 800);
    let id = |i: usize| rows[i].0;
    let of = |s: i64| -> Vec<i64> { rows.iter().filter(|r| r.1 == s).map(|r| r.0).collect() };
    // From the floor, no sweep yet: the first two of each sender, and a sweep just
    // past the last of them.
    let mut ask = Ask {
        stage: "a",
        cap: 8,
        fifo: 0,
        floor: None,
        sweep: None,
        senders: 4,
        behind: &[],
    };
    let t = claim(&mut c, &ask);
    assert_eq!(t.ids, (0..8).map(id).collect::<Vec<_>>());
    assert_eq!((t.floor, t.sweep), (Some(id(8)), Some(id(7) + 1)));
    // Sender 0 served far ahead: the claims pass over its rows, each reading from
    // where the last one's candidates ended, and the floor stays at its oldest row.
    ask.behind = &[0];
    ask.floor = t.floor;
    ask.sweep = t.sweep;
    let mut taken: Vec<i64> = Vec::new();
    for round in 0..5 {
        let t = claim(&mut c, &ask);
        assert_eq!(t.ids.len(), 8, "round {round}: {t:?}");
        assert!(
            t.ids
                .iter()
                .all(|&i| i >= ask.sweep.unwrap() && !of(0).contains(&i)),
            "round {round}: from the sweep {:?}, none of sender 0's: {t:?}",
            ask.sweep
        );
        assert_eq!(
            t.floor,
            Some(id(8)),
            "round {round}: the oldest left holds the floor"
        );
        assert_eq!(t.sweep, Some(t.ids[7] + 1), "round {round}");
        taken.extend(&t.ids);
        ask.sweep = t.sweep;
    }
    let expected: Vec<i64> = (8..800)
        .map(id)
        .filter(|i| !of(0).contains(i))
        .take(40)
        .collect();
    assert_eq!(taken, expected, "the others' rows in order, none twice");
    // With slots for the oldest rows, those come from the floor, whatever the sweep.
    ask.fifo = 2;
    let t = claim(&mut c, &ask);
    assert!(t.ids.contains(&id(8)) && t.ids.contains(&id(12)), "{t:?}");
    assert_eq!(t.floor, Some(id(12) + 1), "past the two oldest it took");
    ask.floor = t.floor;
    // A sweep past every row wraps round: the set is the oldest rows from the floor,
    // and the candidates each sender's two oldest among them (no sender ahead now).
    ask.fifo = 0;
    ask.behind = &[];
    ask.sweep = Some(id(799) + 1);
    let before: Vec<(i64, i64)> = {
        let pending: Vec<i64> = c
            .query(
                "SELECT workqueue_id FROM pepsi.workqueue \
                  WHERE status = 'pending' AND workqueue_id >= $1",
                &[&ask.floor.unwrap()],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        rows.iter()
            .copied()
            .filter(|r| pending.contains(&r.0))
            .collect()
    };
    let t = claim(&mut c, &ask);
    let mut expected: Vec<i64> = (0..4)
        .flat_map(|s| before.iter().filter(move |r| r.1 == s).take(2).map(|r| r.0))
        .collect();
    expected.sort_unstable();
    assert_eq!(t.ids, expected);
    let left = before.iter().map(|r| r.0).find(|i| !t.ids.contains(i));
    assert_eq!(
        t.floor, left,
        "the rows read from the floor after the wrap move it"
    );
    assert_eq!(t.sweep, Some(expected[7] + 1), "the sweep went round");
    // The rows below the floor were never left unread: a claim from the first entry
    // with no sender ahead takes the oldest pending row of all.
    let oldest: i64 = c
        .query_one(
            "SELECT min(workqueue_id) FROM pepsi.workqueue WHERE status = 'pending'",
            &[],
        )
        .unwrap()
        .get(0);
    let t = claim(
        &mut c,
        &Ask {
            stage: "a",
            cap: 1,
            fifo: 1,
            floor: None,
            sweep: None,
            senders: 4,
            behind: &[],
        },
    );
    assert_eq!(t.ids, [oldest]);
}

#[test]
fn a_stage_whose_rows_all_fit_takes_them_all_from_a_sweep_and_answers_none() {
    let db = TestDb::new();
    let mut c = db.client();
    let rows = interleaved(&mut c, "a", 3, 20);
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    // A sweep in the middle: the rows past it and those from the floor below it are
    // every row, and they fit.
    let t = claim(
        &mut c,
        &Ask {
            stage: "a",
            cap: 32,
            fifo: 2,
            floor: Some(ids[0]),
            sweep: Some(ids[10]),
            senders: 3,
            behind: &[],
        },
    );
    assert_eq!(t.ids, ids);
    assert_eq!(t.floor, Some(ids[19] + 1));
    assert_eq!(t.sweep, None, "nothing left to sweep");
}

/// Entries read from the stage-ordered pending index since the last call (the
/// statistics flushed first).
fn entries_read(c: &mut Client) -> i64 {
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .unwrap();
    c.query_one(
        "SELECT idx_tup_read FROM pg_stat_user_indexes \
          WHERE indexrelname = 'workqueue_pending_idx'",
        &[],
    )
    .unwrap()
    .get(0)
}

#[test]
fn under_a_held_snapshot_claims_from_the_sweep_do_not_read_the_taken_rows_again() {
    let db = TestDb::new();
    let mut c = db.client();
    interleaved(&mut c, "a", 20, 4000);
    interleaved(&mut c, "b", 20, 4000);
    // A snapshot held open: the entries of rows claimed from now on stay.
    let mut holder = db.client();
    holder
        .batch_execute(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pepsi.workqueue",
        )
        .unwrap();
    // The same 100 claims at two stages alike, sender 0 served far ahead (its rows
    // hold the floor): at `a` from the floor alone, at `b` from the sweep.
    let run = |c: &mut Client, stage: &str, sweeping: bool| -> (i64, usize) {
        let before = entries_read(c);
        let mut ask = Ask {
            stage,
            cap: 16,
            fifo: 0,
            floor: None,
            sweep: None,
            senders: 20,
            behind: &[0],
        };
        let mut taken = 0;
        for _ in 0..100 {
            let t = claim(c, &ask);
            taken += t.ids.len();
            ask.floor = t.floor;
            ask.sweep = if sweeping { t.sweep } else { None };
        }
        (entries_read(c) - before, taken)
    };
    let (from_floor, taken_a) = run(&mut c, "a", false);
    let (from_sweep, taken_b) = run(&mut c, "b", true);
    assert_eq!((taken_a, taken_b), (1600, 1600));
    println!(
        "index entries read by 100 claims: {from_floor} from the floor, {from_sweep} from the sweep"
    );
    // From the floor each claim reads its 513 rows plus the entries of every row taken
    // above the floor so far (1,600 by the end): about 51,000 + 80,000. From the sweep,
    // about 51,000 and the few taken in its way.
    assert!(
        from_sweep * 2 < from_floor,
        "from the sweep {from_sweep} entries, from the floor {from_floor}"
    );
    assert!(from_sweep < 100 * 600, "{from_sweep}");
    holder.batch_execute("COMMIT").unwrap();
}

#[test]
fn the_claims_plans_from_a_sweep_stay_on_the_pending_indexes() {
    let db = TestDb::new();
    let mut c = db.client();
    interleaved(&mut c, "a", 40, 10_000);
    c.batch_execute("ANALYZE pepsi.workqueue").unwrap();
    let from = |s: &str| {
        format!(
            "SELECT count(*) FROM pepsi.workqueue_claim_fair('{{a}}', '{{16}}', '{{2}}', \
             '{{1000}}', '{{NULL}}', '{{}}', '{{}}', '{{}}', 100, \
             (SELECT ARRAY[min(workqueue_id)] FROM pepsi.workqueue), '{{false}}', {s});\n"
        )
    };
    let script = format!(
        "BEGIN;\n{}{}ROLLBACK;\n",
        from("(SELECT ARRAY[min(workqueue_id) + 5000] FROM pepsi.workqueue)"),
        from("(SELECT ARRAY[max(workqueue_id) - 100] FROM pepsi.workqueue)"),
    );
    let plans = nested_plans(&db, &script);
    assert!(plans.contains("workqueue_pending_idx"), "{plans}");
    assert!(!plans.contains("WITH RECURSIVE walk"), "{plans}");
    assert!(!plans.contains("Bitmap Heap Scan on workqueue"), "{plans}");
    // No node reads more than the 513 rows of the set and their senders' candidates.
    assert_reads_at_most(&plans, 700.0, 600.0, "from a sweep over 10,000 rows");
}
