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
              WHERE c.relnamespace = 'pepsi'::regnamespace \
                AND obj_description(c.oid, 'pg_class') IS NULL \
             UNION ALL \
             SELECT 'column ' || c.oid::regclass::text || '.' || a.attname \
               FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
              WHERE c.relnamespace = 'pepsi'::regnamespace AND c.relkind IN ('r', 'v', 'm', 'p') \
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
