//! Poison data: rows holding values the schema or the worker did not expect (numbers
//! beyond f64 and u64, infinite timestamps, rows that cannot be loaded, outcomes the
//! database always refuses, garbage counters). Each must hurt only its own row, never
//! its batch, never forever, and never lose the row's state.

use postgres::Client;

use crate::util::scenario::{Builder, Scenario};
use crate::util::worker::{Worker, code};
use crate::util::{TestDb, assert_has, claim, due_in_secs, inject, row_at, stage, state_of};

/// `pass` at `p` advancing to `q` (a discard), unfused, batches of up to 8.
const PASS_TO_Q: &str = "[stage-p]\nPROGRAM = {pass}\nNEXT = q\nQUEUE_LIMIT = 8\n\n\
                         [stage-q]\nPROGRAM = {discard}\n";

/// A scenario without fusion and with the given stage sections; `{pass}`, `{discard}`
/// stand for the stage programs.
fn scenario(tag: &str, stages: &str) -> Builder {
    Scenario::new(tag)
        .pepsi("ALLOW_FUSION = no\n")
        .stages(stages)
}

/// Replaces a row's state with this JSON text (parsed by PostgreSQL, not by serde).
fn set_state(c: &mut Client, id: i64, state: &str) {
    let n = c
        .execute(
            "UPDATE pepsi.workqueue SET state = $2::text::jsonb WHERE workqueue_id = $1",
            &[&id, &state],
        )
        .unwrap();
    assert_eq!(n, 1);
}

/// Does the row's state equal this JSON text, as jsonb (exactly, numbers included)?
fn state_is(c: &mut Client, id: i64, state: &str) -> bool {
    c.query_one(
        "SELECT state = $2::text::jsonb FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id, &state],
    )
    .unwrap()
    .get(0)
}

/// A row's state as the text PostgreSQL prints.
fn state_text(c: &mut Client, id: i64) -> String {
    c.query_one(
        "SELECT state::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

/// Marks a row running under claim token `token`, as a dispatcher's claim does.
fn claim_with_token(c: &mut Client, id: i64, token: i64) {
    let n = c
        .execute(
            "UPDATE pepsi.workqueue SET status = 'running', timeout = NULL, claim = $2 \
             WHERE workqueue_id = $1",
            &[&id, &token],
        )
        .unwrap();
    assert_eq!(n, 1, "claim {id}");
}

/// A state with numbers serde_json reads as f64 or not at all without
/// `arbitrary_precision`, beside the keys a failure must never lose.
const BIG_NUMBERS: &str = r#"{"n": 1e400, "big": 123456789012345678901234567890,
    "neg": -98765432109876543210987654321, "tiny": 1e-400,
    "frac": 0.1000000000000000000000000001, "trailing": 1.50,
    "list_copy": true, "local_origin": true, "dsn": {"ret": "hdrs", "envid": "e-1"}}"#;

#[test]
fn a_state_with_numbers_beyond_f64_and_u64_round_trips_exactly_through_a_stage() {
    let (s, mut c) = scenario("p-numbers", PASS_TO_Q).connect();
    let id = inject(&mut c, "p", "a@x.example", &["r@y.example"]);
    set_state(&mut c, id, BIG_NUMBERS);
    let before = state_text(&mut c, id);
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    assert_eq!(row_at(&mut c, id), Some(("q".into(), "pending".into())));
    assert!(
        state_is(&mut c, id, BIG_NUMBERS),
        "the state changed:\nbefore {before}\nafter  {}",
        state_text(&mut c, id)
    );
}

#[test]
fn a_state_the_worker_cannot_read_fails_the_row_and_keeps_every_key() {
    let (s, mut c) = scenario("p-deep", PASS_TO_Q).connect();
    let good = inject(&mut c, "p", "a@x.example", &["r@y.example"]);
    let bad = inject(&mut c, "p", "a@x.example", &["r@y.example"]);
    // Valid jsonb, nested deeper than serde_json reads.
    let deep = format!(
        r#"{{"list_copy": true, "dsn": {{"ret": "full"}}, "n": 1e400, "deep": {}1{}}}"#,
        "[".repeat(300),
        "]".repeat(300)
    );
    set_state(&mut c, bad, &deep);
    claim(&mut c, &[good, bad]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[good, bad]);
    assert_eq!(code(&lines[0]), 0);
    assert_eq!(code(&lines[1]), 65, "{}", lines[1]);
    assert_eq!(row_at(&mut c, good), Some(("q".into(), "pending".into())));
    assert_eq!(row_at(&mut c, bad), Some(("p".into(), "failed".into())));
    let kept: bool = c
        .query_one(
            "SELECT state @> $2::text::jsonb AND state ->> 'failure_class' = 'permanent' \
                    AND state ->> 'failed_stage' = 'p' AND state ? 'last_error' \
               FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&bad, &deep],
        )
        .unwrap()
        .get(0);
    assert!(
        kept,
        "the stored state was replaced: {}",
        state_text(&mut c, bad)
    );
}

#[test]
fn infinite_timestamps_do_not_stop_a_batch() {
    let (s, mut c) = scenario("p-infinity", PASS_TO_Q).connect();
    // Schema 3 refuses such values from now on; a database changed by hand, or rows
    // written before, may still hold them.
    c.batch_execute(
        "ALTER TABLE pepsi.workqueue DROP CONSTRAINT workqueue_arrived_check;
         ALTER TABLE pepsi.workqueue DROP CONSTRAINT workqueue_paused_timeout_check",
    )
    .unwrap();
    let ids: Vec<i64> = (0..7)
        .map(|_| inject(&mut c, "p", "a@x.example", &["r@y.example"]))
        .collect();
    let [good, future, past, dsn, stale, paused_inf, paused_null] = ids[..] else {
        unreachable!()
    };
    let set = |c: &mut Client, sql: &str, id: i64| {
        assert_eq!(c.execute(sql, &[&id]).unwrap(), 1, "{sql}");
    };
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET arrived = 'infinity' WHERE workqueue_id = $1",
        future,
    );
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET arrived = '-infinity' WHERE workqueue_id = $1",
        past,
    );
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET state = '{\"dsn_created\": \"infinity\"}' WHERE workqueue_id = $1",
        dsn,
    );
    claim(&mut c, &[good, future, past, dsn, stale]);
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET timeout = 'infinity' WHERE workqueue_id = $1",
        stale,
    );
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = 'infinity' WHERE workqueue_id = $1",
        paused_inf,
    );
    set(
        &mut c,
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = NULL WHERE workqueue_id = $1",
        paused_null,
    );
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&ids);
    for (line, id) in lines.iter().zip(&ids) {
        assert_eq!(code(line), 0, "message {id}: {line}");
    }
    for id in [good, future, past, dsn, stale] {
        assert_eq!(
            row_at(&mut c, id),
            Some(("q".into(), "pending".into())),
            "message {id}"
        );
    }
    for id in [paused_inf, paused_null] {
        assert_eq!(
            row_at(&mut c, id),
            Some(("p".into(), "paused".into())),
            "a row that is not running is left alone: {id}"
        );
    }
    let (status, err) = w.finish();
    assert!(status.success(), "{status:?} {err}");
}

/// Makes every load of a row whose state has the key `poison` fail, as a damaged row
/// would: the lifetime start of a DSN is computed by this function in the load.
fn poison_loads(c: &mut Client) {
    c.batch_execute(
        "CREATE OR REPLACE FUNCTION pepsi.lifetime_start(p_state jsonb, p_arrived timestamptz)
         RETURNS timestamptz LANGUAGE plpgsql STABLE AS $$
         BEGIN
             IF p_state ? 'poison' THEN
                 RAISE EXCEPTION 'row is poisoned' USING ERRCODE = 'data_corrupted';
             END IF;
             RETURN coalesce((p_state ->> 'dsn_created')::timestamptz, p_arrived);
         END $$",
    )
    .unwrap();
}

const POISONED: &str = r#"{"dsn_created": "2024-01-01T00:00:00Z", "poison": true,
    "list_copy": true, "n": 1e400}"#;

#[test]
fn a_row_that_cannot_be_loaded_fails_alone_as_unreadable_and_its_batch_runs() {
    let (s, mut c) = scenario("p-unloadable", PASS_TO_Q).connect();
    poison_loads(&mut c);
    let ids: Vec<i64> = (0..5)
        .map(|_| inject(&mut c, "p", "a@x.example", &["r@y.example"]))
        .collect();
    let [good1, bad, good2, paused_bad, alone] = ids[..] else {
        unreachable!()
    };
    for id in [bad, paused_bad, alone] {
        set_state(&mut c, id, POISONED);
    }
    claim(&mut c, &[good1, bad, good2, alone]);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() + interval '1 hour' \
         WHERE workqueue_id = $1",
        &[&paused_bad],
    )
    .unwrap();
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[good1, bad, good2, paused_bad]);
    assert_eq!(
        lines.iter().map(|l| code(l)).collect::<Vec<_>>(),
        vec![0, 65, 0, 0],
        "{lines:?}"
    );
    for id in [good1, good2] {
        assert_eq!(row_at(&mut c, id), Some(("q".into(), "pending".into())));
    }
    assert_eq!(
        row_at(&mut c, paused_bad),
        Some(("p".into(), "paused".into())),
        "a row that is not running is left alone"
    );
    assert!(state_is(&mut c, paused_bad, POISONED));
    // A batch of one takes the same way.
    assert_eq!(code(&w.run(&[alone])[0]), 65);
    for id in [bad, alone] {
        assert_eq!(row_at(&mut c, id), Some(("p".into(), "failed".into())));
        let st = state_of(&mut c, id);
        assert_eq!(st["failure_class"], "unreadable", "{st}");
        assert_eq!(st["failed_stage"], "p", "{st}");
        assert_has!(
            st["last_error"].as_str().unwrap(),
            "row is poisoned",
            "{st}"
        );
        let kept: bool = c
            .query_one(
                "SELECT state @> $2::text::jsonb FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id, &POISONED],
            )
            .unwrap()
            .get(0);
        assert!(kept, "the state was kept: {}", state_text(&mut c, id));
    }
}

#[test]
fn an_outcome_the_database_always_refuses_fails_as_unwritable_after_5_attempts() {
    let (s, mut c) = scenario("p-unwritable", PASS_TO_Q).connect();
    // An operator's constraint that this message's advance violates, every time.
    c.batch_execute(
        "ALTER TABLE pepsi.workqueue ADD CONSTRAINT refuse_q \
         CHECK (mail_from <> 'refused@x.example' OR stage <> 'q') NOT VALID",
    )
    .unwrap();
    let good = inject(&mut c, "p", "a@x.example", &["r@y.example"]);
    let bad = inject(&mut c, "p", "refused@x.example", &["r@y.example"]);
    set_state(
        &mut c,
        bad,
        r#"{"list_copy": true, "big": 123456789012345678901234567890}"#,
    );
    // A count of unwritable attempts that is not a number counts as none.
    let garbage = inject(&mut c, "p", "refused@x.example", &["r@y.example"]);
    set_state(&mut c, garbage, r#"{"unwritten": "x"}"#);
    claim(&mut c, &[good, bad, garbage]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[good, bad, garbage]);
    assert_eq!(code(&lines[0]), 0);
    assert_eq!(row_at(&mut c, good), Some(("q".into(), "pending".into())));
    assert_eq!(code(&lines[2]), 0, "{}", lines[2]);
    assert_eq!(row_at(&mut c, garbage), Some(("p".into(), "paused".into())));
    assert_eq!(state_of(&mut c, garbage)["unwritten"], 1);
    for attempt in 1..=5i64 {
        let answer = if attempt == 1 {
            code(&lines[1])
        } else {
            claim_with_token(&mut c, bad, 100 + attempt);
            code(&w.run(&[bad])[0])
        };
        let st = state_of(&mut c, bad);
        assert_eq!(st["unwritten"], attempt, "attempt {attempt}: {st}");
        assert_has!(
            st["last_error"].as_str().unwrap(),
            "refuse_q",
            "attempt {attempt}: {st}"
        );
        assert_eq!(st["list_copy"], true, "{st}");
        if attempt < 5 {
            assert_eq!(answer, 0, "attempt {attempt}");
            assert_eq!(
                row_at(&mut c, bad),
                Some(("p".into(), "paused".into())),
                "attempt {attempt}"
            );
            let minutes = (1i64 << (attempt - 1)) as f64;
            let due = due_in_secs(&mut c, bad);
            assert!(
                (due - minutes * 60.0).abs() < 20.0,
                "attempt {attempt}: due in {due}s"
            );
        } else {
            assert!(
                answer != 0 && answer != 74 && answer != 75,
                "a failed row is answered as failed: {answer}"
            );
            assert_eq!(
                row_at(&mut c, bad),
                Some(("p".into(), "failed".into())),
                "attempt {attempt}: {st}"
            );
            assert_eq!(st["failure_class"], "unwritable", "{st}");
            assert_eq!(st["failed_stage"], "p", "{st}");
        }
    }
    assert_has!(state_text(&mut c, bad), "123456789012345678901234567890");
}

#[test]
fn a_strike_works_whatever_state_strikes_holds() {
    let db = TestDb::new();
    let mut c = db.client();
    // (strikes, strike_stage, expected count, expected status)
    let cases: &[(&str, Option<&str>, i32, &str)] = &[
        (r#""x""#, None, 1, "paused"),
        ("1.5", None, 1, "paused"),
        ("1e400", None, 1, "paused"),
        ("-7", None, 1, "paused"),
        (r#""x""#, Some("p"), 1, "paused"),
        ("1.5", Some("p"), 2, "paused"),
        ("-7", Some("p"), 1, "paused"),
        ("null", Some("p"), 1, "paused"),
        (r#"{"a": 1}"#, Some("p"), 1, "paused"),
        // A huge count is a count: the third strike fails the row.
        ("1e400", Some("p"), 3, "failed"),
    ];
    for (i, (strikes, strike_stage, count, status)) in cases.iter().enumerate() {
        let id = inject(&mut c, "p", "a@x.example", &["r@y.example"]);
        let state = match strike_stage {
            Some(s) => format!(r#"{{"strikes": {strikes}, "strike_stage": "{s}"}}"#),
            None => format!(r#"{{"strikes": {strikes}}}"#),
        };
        set_state(&mut c, id, &state);
        let token = 1000 + i as i64;
        claim_with_token(&mut c, id, token);
        let row = c
            .query_opt(
                "SELECT strikes, status::text FROM pepsi.workqueue_strike($1, 'p', 'crashed', 'why', $2)",
                &[&id, &token],
            )
            .unwrap_or_else(|e| panic!("strikes {strikes}: {e}"))
            .unwrap_or_else(|| panic!("strikes {strikes}: no row"));
        assert_eq!(
            (row.get::<_, i32>(0), row.get::<_, String>(1).as_str()),
            (*count, *status),
            "strikes {strikes} at {strike_stage:?}"
        );
        assert_eq!(
            row_at(&mut c, id),
            Some(("p".into(), status.to_string())),
            "strikes {strikes}"
        );
        let st = state_of(&mut c, id);
        assert_eq!(st["strikes"], *count, "{st}");
        assert_eq!(st["strike_stage"], "p", "{st}");
        assert_eq!(st["last_error"], "why", "{st}");
        if *status == "paused" {
            assert!(due_in_secs(&mut c, id) > 0.0, "a paused row is due later");
        } else {
            assert_eq!(st["failure_class"], "crashed", "{st}");
        }
    }
}
