//! Schema 006, the operator's API, in the database itself (§14): a comment on
//! every object of the `pepsi` schema, and the upgrade from schema 5 that adds the
//! `held` status and the repair functions `pepsi-queue` calls.

use crate::util::queue::{STAGES, expect, queue, set_status};
use crate::util::rows::count;
use crate::util::{Scenario, TestDb, inject, row_at, state_of};

#[test]
fn every_public_schema_object_has_a_comment() {
    let db = TestDb::new();
    let mut c = db.client();
    let missing: Vec<String> = c
        .query(
            "SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc p \
              WHERE p.pronamespace = 'pepsi'::regnamespace \
                AND obj_description(p.oid, 'pg_proc') IS NULL \
             UNION ALL \
             SELECT 'relation ' || c.oid::regclass::text FROM pg_class c \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND NOT c.relispartition \
                AND obj_description(c.oid, 'pg_class') IS NULL \
             UNION ALL \
             SELECT 'column ' || c.oid::regclass::text || '.' || a.attname \
               FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND c.relkind IN ('r', 'v', 'm', 'p') \
                AND NOT c.relispartition \
                AND a.attnum > 0 AND NOT a.attisdropped \
                AND col_description(c.oid, a.attnum) IS NULL \
             UNION ALL \
             SELECT 'type ' || t.oid::regtype::text FROM pg_type t \
              WHERE t.typnamespace = 'pepsi'::regnamespace AND t.typrelid = 0 \
                AND t.typcategory <> 'A' AND obj_description(t.oid, 'pg_type') IS NULL \
             UNION ALL \
             SELECT 'trigger ' || tg.tgname FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND NOT tg.tgisinternal \
                AND obj_description(tg.oid, 'pg_trigger') IS NULL \
             UNION ALL \
             SELECT 'schema pepsi' WHERE obj_description('pepsi'::regnamespace, 'pg_namespace') IS NULL",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(missing.is_empty(), "without a COMMENT: {missing:#?}");
    // The check looks where it should: there are functions, tables, columns and
    // indexes, and their comments are there.
    assert!(
        count(
            &mut c,
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pepsi'::regnamespace"
        ) >= 20
    );
    let comment: String = c
        .query_one(
            "SELECT col_description('pepsi.workqueue'::regclass, \
               (SELECT attnum FROM pg_attribute WHERE attrelid = 'pepsi.workqueue'::regclass \
                 AND attname = 'state'))",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(comment.contains("local_origin"), "{comment}");
}

#[test]
fn upgrading_from_schema_5_adds_held_and_the_repair_functions() {
    let (s, mut c) = Scenario::new("q-upgrade").empty().stages(STAGES).connect();
    crate::util::install_schema_upto(&mut c, 5);
    let a = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    let b = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    set_status(&mut c, b, "failed");
    crate::util::upgrade_with_setup(&mut c, &s.conf);
    // The new value and the functions that use it work once the upgrade committed.
    let out = queue(&s.conf, &["hold", &a.to_string(), &b.to_string()]);
    expect(&out, 0);
    assert_eq!(row_at(&mut c, a).unwrap().1, "held");
    assert_eq!(row_at(&mut c, b).unwrap().1, "held");
    assert_eq!(state_of(&mut c, b)["held_from"], "failed");
    expect(&queue(&s.conf, &["release", &b.to_string()]), 0);
    assert_eq!(row_at(&mut c, b).unwrap().1, "pending");
    assert_eq!(
        state_of(&mut c, b),
        serde_json::json!({}),
        "the hold's keys are gone"
    );
}

#[test]
fn a_batch_write_of_ten_thousand_rows_finds_each_by_its_id_and_guard() {
    // Schema 16: the write functions name their ids as a condition on the primary key.
    // A batch of 10,000 (more than any worker sends) is written in one call; a row
    // whose claim token or claimed stage is not the row's own is left alone.
    let db = TestDb::new();
    let mut c = db.client();
    c.batch_execute(
        "INSERT INTO pepsi.workqueue (stage, status, mail_from, rcpt_to, claim) \
         SELECT 'a', 'running', 'x@y.example', ARRAY['r@y.example'], 7 \
           FROM generate_series(1, 10000)",
    )
    .unwrap();
    let ids: Vec<i64> = c
        .query("SELECT workqueue_id FROM pepsi.workqueue ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let rows: Vec<serde_json::Value> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            // Every 1,000th row claims a token it was not handed, every 999th a stage.
            let claim = if i % 1000 == 0 { 8 } else { 7 };
            let claimed = if i % 999 == 1 { "b" } else { "a" };
            serde_json::json!({"id": id, "claimed": claimed, "claim": claim,
                               "stage": "b", "status": "pending", "state": {}})
        })
        .collect();
    let text = serde_json::Value::Array(rows).to_string();
    let written = c
        .query(pepsi::db::sql::WRITE_OUTCOMES, &[&text])
        .unwrap()
        .len();
    let refused = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 1000 == 0 || i % 999 == 1)
        .count();
    assert_eq!(written, 10_000 - refused);
    let left: i64 = c
        .query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'a' AND status = 'running'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        left as usize, refused,
        "the unguarded rows stay as they were"
    );
    let rows: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| serde_json::json!({"id": id, "claimed": "a", "claim": 7}))
        .collect();
    let finished = c
        .query(
            "SELECT f FROM pepsi.workqueue_done($1::text::jsonb) f",
            &[&serde_json::Value::Array(rows).to_string()],
        )
        .unwrap()
        .len();
    assert_eq!(
        finished, refused,
        "only the rows still running at a under their token are finished"
    );
}
