//! Separate database roles (§4 "Least privilege", schema 7): what each group role
//! may and may not do, run through the very statements the programs run
//! (`pepsi::db::sql`), and a whole pipeline with every program on a login role of its
//! own through the `[pepsi-postgres] *_CONNECTION` keys.
//!
//! Roles are cluster-wide, so the login roles here are created once under fixed names
//! (idempotently: tests run at the same time) and are members of the group roles that
//! `pepsi-setup` created when the harness installed the template.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use pepsi::db::sql;
use postgres::error::SqlState;
use postgres::types::Type;
use postgres::{Client, NoTls};
use serde_json::json;

use crate::util::bouncer::Bouncer;
use crate::util::dispatcher::Dispatcher;
use crate::util::pg::login_role;
use crate::util::rows::queue_len;
use crate::util::{
    TempDir, TestDb, assert_has, assert_lacks, bin, claim, inject, row_at, run, stage, stderr,
    tokens, upgrade_with_setup, wait_until,
};

/// The login roles of the tests, one per group role.
pub(super) fn dispatch_login() -> String {
    login_role("pepsi_t_dispatch", &["pepsi_dispatch"])
}
pub(super) fn worker_login() -> String {
    login_role("pepsi_t_worker", &["pepsi_worker"])
}
pub(super) fn admin_login() -> String {
    login_role("pepsi_t_admin", &["pepsi_admin"])
}
pub(super) fn inject_login() -> String {
    login_role("pepsi_t_inject", &["pepsi_inject"])
}

/// Fails unless `result` is a permission error (SQLSTATE 42501), naming `what`.
#[track_caller]
fn denied<T: std::fmt::Debug>(what: &str, result: Result<T, postgres::Error>) {
    match result {
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {}
        other => panic!("{what}: expected permission denied (42501), got {other:?}"),
    }
}

/// Runs `sql` and expects it refused for lack of privileges.
#[track_caller]
fn refused(c: &mut Client, sql: &str) {
    denied(sql, c.batch_execute(sql));
}

/// The statements that write what decides what the system runs, or what only the
/// dispatcher and pepsi-setup write: refused for workers and injectors alike.
const PROTECTED_WRITES: &[&str] = &[
    "INSERT INTO pepsi.config_override VALUES ('stage-x', 'PROGRAM', '/bin/sh')",
    "UPDATE pepsi.config_override SET value = '/bin/sh'",
    "DELETE FROM pepsi.config_override",
    "TRUNCATE pepsi.config_override",
    "INSERT INTO pepsi.settings VALUES ('a@b.example', 'x', 'MATCH', 'sender is a')",
    "UPDATE pepsi.settings SET value = 'x'",
    "DELETE FROM pepsi.settings",
    "UPDATE pepsi.schema_version SET version = 99",
    "DELETE FROM pepsi.schema_version",
    "INSERT INTO pepsi.stage_stats (stage, passes) VALUES ('x', 1)",
    "UPDATE pepsi.stage_stats SET passes = 0",
    "UPDATE pepsi.dispatch_stats SET claims = 0",
];

#[test]
fn a_worker_cannot_write_the_overlay_the_settings_the_schema_version_or_the_statistics() {
    let db = TestDb::new();
    let mut owner = db.client();
    // Something to read and write, so that a refusal is the privilege's doing.
    owner
        .batch_execute(
            "INSERT INTO pepsi.config_override VALUES ('stage-x', 'NEXT', 'y'); \
             INSERT INTO pepsi.settings VALUES ('r@y.example', 'x', 'MATCH', 'sender is a'); \
             INSERT INTO pepsi.stage_stats (stage) VALUES ('x')",
        )
        .unwrap();
    let id = inject(&mut owner, "x", "s@x.example", &["r@y.example"]);
    let mut w = db.client_as(&worker_login());
    for sql in PROTECTED_WRITES {
        refused(&mut w, sql);
    }
    // No access to the overlay table at all, nor a way round the outcome statements.
    refused(&mut w, "SELECT * FROM pepsi.config_override");
    refused(
        &mut w,
        "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) VALUES ('x', '', '{r@y.example}')",
    );
    refused(&mut w, "UPDATE pepsi.workqueue SET claim = 7");
    refused(&mut w, "UPDATE pepsi.workqueue SET headers = NULL");
    refused(&mut w, "DELETE FROM pepsi.workqueue_body");
    refused(&mut w, "SELECT pepsi.workqueue_resume(ARRAY[1::int8])");
    refused(
        &mut w,
        "SELECT pepsi.workqueue_inject('x', '', ARRAY['r@y.example'], NULL, NULL)",
    );
    refused(&mut w, "SELECT pepsi.workqueue_body_gc(10)");
    refused(&mut w, "SELECT pepsi.terminate_worker_sessions(ARRAY['%'])");
    refused(&mut w, "SELECT pepsi.setup_roles()");
    // What a worker reads at start: the schema version and the overlay.
    pepsi::db::schema::check(&mut w).unwrap();
    let overlay = pepsi::db::read_overlay(&mut w).unwrap();
    assert_eq!(overlay.len(), 1);
    assert_eq!(
        (overlay[0].section.as_str(), overlay[0].value.as_str()),
        ("stage-x", "y")
    );
    // Nothing changed.
    assert_eq!(row_at(&mut owner, id), Some(("x".into(), "pending".into())));
    let n: i64 = owner
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

/// A worker's batched outcome write: one object of `sql::WRITE_OUTCOMES`'s payload,
/// under the claim token `claim`.
pub(super) fn outcome(
    (id, claim): (i64, i64),
    claimed: &str,
    stage: &str,
    status: &str,
    delay_ms: Option<i64>,
) -> serde_json::Value {
    json!({"id": id, "claimed": claimed, "claim": claim, "stage": stage, "status": status,
           "delay_ms": delay_ms, "state": {}, "rewritten": false})
}

#[test]
fn a_worker_writes_every_outcome_of_a_stage_through_the_workers_own_statements() {
    let db = TestDb::new();
    let mut owner = db.client();
    let mut w = db.client_as(&worker_login());
    let body_count = |c: &mut Client| -> i64 {
        c.query_one("SELECT count(*) FROM pepsi.workqueue_body", &[])
            .unwrap()
            .get(0)
    };
    let ids: Vec<i64> = (0..5)
        .map(|_| inject(&mut owner, "s", "a@x.example", &["r@y.example"]))
        .collect();
    claim(&mut owner, &ids);
    let tok = tokens(&mut owner, &ids);
    let held = |i: usize| (ids[i], tok[i]);

    // Loading: metadata with the settings, the full message, a row's stage alone.
    let rows = w
        .query_typed(sql::LOAD_METADATA, &[(&ids, Type::INT8_ARRAY)])
        .unwrap();
    assert_eq!(rows.len(), 5);
    let rows = w
        .query_typed(
            sql::LOAD_FULL,
            &[(&ids, Type::INT8_ARRAY), (&(4i64 << 20), Type::INT8)],
        )
        .unwrap();
    assert_eq!(rows.len(), 5);
    assert!(
        rows.iter().all(|r| r.get::<_, bool>(18)),
        "every content came"
    );
    w.query_typed(
        sql::LOAD_CONTENT,
        &[(&ids[0], Type::INT8), (&"s", Type::TEXT)],
    )
    .unwrap();
    w.query_typed_one(sql::LOAD_CLAIM, &[(&ids[0], Type::INT8)])
        .unwrap();

    // Advance, pause and fail in one batch, one with a rewritten envelope.
    let mut rewritten = outcome(held(0), "s", "next", "pending", None);
    rewritten["rewritten"] = json!(true);
    rewritten["mail_from"] = json!("b@z.example");
    rewritten["rcpt_to"] = json!(["q@y.example"]);
    let payload = json!([
        rewritten,
        outcome(held(1), "s", "s", "paused", Some(60_000)),
        outcome(held(2), "s", "s", "failed", None),
    ])
    .to_string();
    let written = w
        .query_typed(sql::WRITE_OUTCOMES, &[(&payload, Type::TEXT)])
        .unwrap();
    assert_eq!(written.len(), 3);
    assert_eq!(
        row_at(&mut owner, ids[0]),
        Some(("next".into(), "pending".into()))
    );
    assert_eq!(row_at(&mut owner, ids[1]).unwrap().1, "paused");
    assert_eq!(row_at(&mut owner, ids[2]).unwrap().1, "failed");
    let key: String = owner
        .query_one(
            "SELECT sender_key FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&ids[0]],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        key, "from:z.example",
        "the generated column follows the rewrite"
    );

    // A batch that rewrote nothing: the plain advance.
    let payload = json!([outcome(held(4), "s", "next", "pending", None)]).to_string();
    let written = w
        .query_typed(sql::WRITE_OUTCOMES, &[(&payload, Type::TEXT)])
        .unwrap();
    assert_eq!(written.len(), 1);
    assert_eq!(
        row_at(&mut owner, ids[4]),
        Some(("next".into(), "pending".into()))
    );

    // Finish: the row goes, and its body with it (the release trigger).
    let before = body_count(&mut owner);
    let claimed = ["s".to_string()];
    let done = w
        .query_typed(
            sql::DELETE_FINISHED,
            &[(
                &format!(
                    r#"[{{"id": {}, "claimed": "{}", "claim": {}}}]"#,
                    ids[3], claimed[0], tok[3]
                ),
                Type::TEXT,
            )],
        )
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(row_at(&mut owner, ids[3]), None);
    assert_eq!(
        body_count(&mut owner),
        before - 1,
        "the body went with its row"
    );

    // Fail in place and the last-resort pause of an unwritable outcome.
    let more: Vec<i64> = (0..4)
        .map(|_| {
            inject(
                &mut owner,
                "s",
                "a@x.example",
                &["r1@y.example", "r2@y.example"],
            )
        })
        .collect();
    claim(&mut owner, &more);
    let tok = tokens(&mut owner, &more);
    w.query_typed_one(
        sql::FAIL_IN_PLACE,
        &[
            (&more[0], Type::INT8),
            (&"s", Type::TEXT),
            (&tok[0], Type::INT8),
            (&"unreadable", Type::TEXT),
            (&"cannot read it", Type::TEXT),
        ],
    )
    .unwrap();
    assert_eq!(row_at(&mut owner, more[0]).unwrap().1, "failed");
    let row = w
        .query_typed_one(
            sql::PAUSE_OR_FAIL_UNWRITTEN,
            &[
                (&more[1], Type::INT8),
                (&"s", Type::TEXT),
                (&"cannot write", Type::TEXT),
                (&tok[1], Type::INT8),
                (&5i32, Type::INT4),
            ],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "paused");

    // Split: the clone is a new pending row sharing the body.
    let groups = json!([["r1@y.example"], ["r2@y.example"]]).to_string();
    let row = w
        .query_typed_one(
            sql::SPLIT,
            &[
                (&more[2], Type::INT8),
                (&groups, Type::TEXT),
                (&"s", Type::TEXT),
                (&None::<&str>, Type::TEXT),
                (&None::<&str>, Type::TEXT),
                (&false, Type::BOOL),
                (&tok[2], Type::INT8),
            ],
        )
        .unwrap();
    let clones: Vec<i64> = row.get::<_, Option<Vec<i64>>>(0).unwrap();
    assert_eq!(clones.len(), 1);
    assert_eq!(
        row_at(&mut owner, clones[0]),
        Some(("s".into(), "pending".into()))
    );

    // Bounce: the notification in, the original and its body out.
    let before = body_count(&mut owner);
    let dsn: Option<i64> = w
        .query_typed_one(
            sql::BOUNCE,
            &[
                (&more[3], Type::INT8),
                (&"s", Type::TEXT),
                (&tok[3], Type::INT8),
                (&"deliver", Type::TEXT),
                (&"a@x.example", Type::TEXT),
                (&"MAILER-DAEMON@mx.example", Type::TEXT),
                (&"Undelivered", Type::TEXT),
                (&b"Subject: Undelivered\r\n".to_vec(), Type::BYTEA),
                (&b"It failed.\r\n".to_vec(), Type::BYTEA),
            ],
        )
        .unwrap()
        .get(0);
    let dsn = dsn.expect("the guard matched");
    assert_eq!(
        row_at(&mut owner, dsn),
        Some(("deliver".into(), "pending".into()))
    );
    assert_eq!(row_at(&mut owner, more[3]), None);
    assert_eq!(
        body_count(&mut owner),
        before,
        "the original's body went, the notification's came"
    );
}

#[test]
fn an_injector_may_only_inject() {
    let db = TestDb::new();
    let mut owner = db.client();
    let existing = inject(&mut owner, "s", "a@x.example", &["r@y.example"]);
    // An entry stage (schema 10): injectors may inject there only.
    owner
        .execute(sql::SET_INJECT_STAGES, &[&vec!["s".to_string()]])
        .unwrap();
    let mut i = db.client_as(&inject_login());
    let id: i64 = i
        .query_one(
            sql::INJECT,
            &[
                &"s",
                &"a@x.example",
                &vec!["r@y.example"],
                &b"Subject: hi\r\n".to_vec(),
                &b"Hello.\r\n".to_vec(),
                &None::<&str>,
                &Some("192.0.2.7"),
                &None::<&str>,
                &Some("hi"),
                &"{}",
            ],
        )
        .unwrap()
        .get(0);
    assert_eq!(row_at(&mut owner, id), Some(("s".into(), "pending".into())));
    // pepsi-queue inject's checks: the schema version and the stages of the overlay.
    pepsi::db::schema::check(&mut i).unwrap();
    pepsi::db::read_overlay(&mut i).unwrap();
    for sql in PROTECTED_WRITES {
        refused(&mut i, sql);
    }
    for sql in [
        "SELECT * FROM pepsi.workqueue",
        "SELECT stage FROM pepsi.workqueue",
        "SELECT * FROM pepsi.workqueue_body",
        "SELECT * FROM pepsi.settings",
        "SELECT * FROM pepsi.stage_stats",
        "UPDATE pepsi.workqueue SET status = 'pending'",
        "DELETE FROM pepsi.workqueue",
        "SELECT pepsi.workqueue_resume(ARRAY[1::int8])",
        "SELECT pepsi.workqueue_resume(NULL::text, NULL::pepsi.workqueue_status)",
        "SELECT * FROM pepsi.workqueue_resume_each(ARRAY[1::int8])",
        "SELECT * FROM pepsi.workqueue_hold(ARRAY[1::int8])",
        "SELECT * FROM pepsi.workqueue_delete(ARRAY[1::int8])",
        "SELECT * FROM pepsi.workqueue_requeue(ARRAY[1::int8], 'x')",
        "SELECT pepsi.workqueue_split(1, '[[\"a\"]]')",
        "SELECT pepsi.workqueue_bounce(1, 's', 0, 'd', 'a@b', NULL, NULL, NULL, NULL)",
        "SELECT * FROM pepsi.workqueue_bounce_failed('b', ARRAY['failed'::pepsi.workqueue_status], 1)",
        "SELECT * FROM pepsi.workqueue_strike(1, 's', 'crashed', 'x', 0)",
        "SELECT * FROM pepsi.workqueue_claim_fair(ARRAY['s'], ARRAY[1], ARRAY[0], ARRAY[1.0::float8], \
           ARRAY[NULL::text], '{}', '{}', '{}', 100, NULL)",
        "SELECT pepsi.workqueue_body_gc(10)",
        "SELECT * FROM pepsi.terminate_worker_sessions(ARRAY['%'])",
        "SELECT * FROM pepsi.setup_roles()",
    ] {
        refused(&mut i, sql);
    }
    assert_eq!(
        row_at(&mut owner, existing),
        Some(("s".into(), "pending".into()))
    );
}

#[test]
fn the_dispatcher_cannot_write_the_overlay_or_the_settings_nor_read_message_content() {
    let db = TestDb::new();
    let mut owner = db.client();
    let ids: Vec<i64> = (0..3)
        .map(|_| inject(&mut owner, "s", "a@x.example", &["r@y.example"]))
        .collect();
    let mut d = db.client_as(&dispatch_login());
    for sql in [
        "INSERT INTO pepsi.config_override VALUES ('stage-x', 'PROGRAM', '/bin/sh')",
        "UPDATE pepsi.config_override SET value = '/bin/sh'",
        "DELETE FROM pepsi.config_override",
        "INSERT INTO pepsi.settings VALUES ('a@b.example', 'x', 'MATCH', 'sender is a')",
        "DELETE FROM pepsi.settings",
        "UPDATE pepsi.schema_version SET version = 99",
        "SELECT mail_from FROM pepsi.workqueue",
        "SELECT headers FROM pepsi.workqueue",
        "SELECT state FROM pepsi.workqueue",
        "UPDATE pepsi.workqueue SET state = '{}'",
        "UPDATE pepsi.workqueue SET hops = 0",
        "SELECT * FROM pepsi.workqueue_body",
        "UPDATE pepsi.workqueue SET stage = 'x'",
        "DELETE FROM pepsi.workqueue",
        "SELECT pepsi.workqueue_inject('x', '', ARRAY['r@y.example'], NULL, NULL)",
        "SELECT pepsi.workqueue_resume(ARRAY[1::int8])",
    ] {
        refused(&mut d, sql);
    }
    // Its own work: the schema, the overlay, LISTEN, the claim, a strike, a requeue,
    // the statistics, the body GC and the reset.
    pepsi::db::schema::check(&mut d).unwrap();
    pepsi::db::read_overlay(&mut d).unwrap();
    d.batch_execute(sql::LISTEN_DISPATCHER).unwrap();
    let stages = vec!["s".to_string()];
    let claimed = d
        .query_typed(
            sql::CLAIM_OLDEST,
            &[
                (&stages, Type::TEXT_ARRAY),
                (&vec![3i32], Type::INT4_ARRAY),
                (&100i32, Type::INT4),
                (&None::<Vec<i64>>, Type::INT8_ARRAY),
                (&None::<Vec<bool>>, Type::BOOL_ARRAY),
            ],
        )
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let token_of = |id: i64| -> i64 {
        claimed
            .iter()
            .find(|r| r.get::<_, i64>(0) == id)
            .map(|r| r.get(3))
            .unwrap()
    };
    let struck = d
        .query_typed_opt(
            sql::STRIKE,
            &[
                (&ids[0], Type::INT8),
                (&"s", Type::TEXT),
                (&"crashed", Type::TEXT),
                (&"died", Type::TEXT),
                (&token_of(ids[0]), Type::INT8),
            ],
        )
        .unwrap();
    assert!(struck.is_some());
    let requeued = d
        .query_typed(
            sql::REQUEUE,
            &[
                (&vec![ids[1]], Type::INT8_ARRAY),
                (&stages, Type::TEXT_ARRAY),
                (&vec![token_of(ids[1])], Type::INT8_ARRAY),
            ],
        )
        .unwrap();
    assert_eq!(requeued.len(), 1);
    let one = vec![1i64];
    let event = vec!["tls-verified".to_string()];
    d.execute(
        sql::FLUSH_STATS,
        &[
            &stages, &one, &one, &one, &one, &one, &one, &one, &one, &one, &1i64, &1i64, &1i64,
            &1i64, &stages, &event, &one,
        ],
    )
    .unwrap();
    d.query_one(sql::BODY_GC, &[&10i32]).unwrap();
    d.query_one(sql::FLIP_PAUSED, &[]).unwrap();
    d.execute(sql::RESET_RUNNING, &[]).unwrap();
    let fair = d
        .query_typed(
            sql::CLAIM_FAIR,
            &[
                (&stages, Type::TEXT_ARRAY),
                (&vec![3i32], Type::INT4_ARRAY),
                (&vec![0i32], Type::INT4_ARRAY),
                (&vec![1000.0f64], Type::FLOAT8_ARRAY),
                (&vec![None::<String>], Type::TEXT_ARRAY),
                (&Vec::<String>::new(), Type::TEXT_ARRAY),
                (&Vec::<String>::new(), Type::TEXT_ARRAY),
                (&Vec::<f64>::new(), Type::FLOAT8_ARRAY),
                (&100i32, Type::INT4),
                (&None::<Vec<i64>>, Type::INT8_ARRAY),
                (&None::<Vec<bool>>, Type::BOOL_ARRAY),
                (&None::<Vec<i64>>, Type::INT8_ARRAY),
                (&None::<Vec<f64>>, Type::FLOAT8_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<f64>>, Type::FLOAT8_ARRAY),
                (&None::<Vec<f64>>, Type::FLOAT8_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<i32>>, Type::INT4_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<String>>, Type::TEXT_ARRAY),
                (&None::<Vec<i32>>, Type::INT4_ARRAY),
            ],
        )
        .unwrap();
    assert!(fair.iter().any(|r| r.get::<_, Option<i64>>(0).is_some()));
    let passes: i64 = owner
        .query_one(
            "SELECT passes FROM pepsi.stage_stats WHERE stage = 's'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(passes, 1);
}

#[test]
fn the_dispatcher_terminates_worker_sessions_and_nothing_else() {
    let db = TestDb::new();
    let worker = worker_login();
    let mut d = db.client_as(&dispatch_login());
    let named = |name: &str| -> Client {
        let conninfo = format!("{} application_name={name}", db.conninfo_as(&worker));
        Client::connect(&conninfo, NoTls).unwrap()
    };
    let mut victim = named("pepsi-worker:4242:s");
    let mut bystander = named("pepsi-worker:4343:s");
    let mut other = named("psql");
    let patterns = vec!["pepsi-worker:4242:%".to_string()];
    let row = d
        .query_typed_one(
            sql::TERMINATE_WORKER_SESSIONS,
            &[(&patterns, Type::TEXT_ARRAY)],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (1, 0),
        "the test cluster's schema owner is a superuser: it may signal the worker"
    );
    assert!(victim.simple_query("SELECT 1").is_err(), "terminated");
    bystander.simple_query("SELECT 1").unwrap();
    // A pattern that matches everything still ends only workers' sessions.
    let everything = vec!["%".to_string()];
    let row = d
        .query_typed_one(
            sql::TERMINATE_WORKER_SESSIONS,
            &[(&everything, Type::TEXT_ARRAY)],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    assert!(bystander.simple_query("SELECT 1").is_err());
    other.simple_query("SELECT 1").unwrap();
    d.simple_query("SELECT 1").unwrap();
}

/// `pepsi-setup -c conf schema`.
pub(super) fn setup(conf: &Path) -> Output {
    run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    )
}

/// A configuration naming only the owner's `CONNECTION`, then `extra`.
fn owner_config(dir: &TempDir, connection: &str, extra: &str) -> PathBuf {
    dir.write(
        "pepsi.conf",
        &format!("[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {connection}\n{extra}"),
    )
}

#[test]
fn pepsi_setup_grants_the_roles_every_run_and_upgrades_schema_6_with_rows() {
    let db = TestDb::empty();
    let dir = TempDir::new("roles-upgrade");
    let mut owner = db.client();
    crate::util::install_schema_upto(&mut owner, 6);
    let id = inject(&mut owner, "s", "a@x.example", &["r@y.example"]);
    claim(&mut owner, &[id]);
    // Before the upgrade, every function is anybody's to call (PostgreSQL's default).
    let nobody = login_role("pepsi_t_nobody", &[]);
    let conf = owner_config(&dir, db.connection(), "");
    upgrade_with_setup(&mut owner, &conf);
    let out = setup(&conf);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_has!(
        stderr(&out),
        "database roles granted their privileges: pepsi_dispatch, pepsi_worker, pepsi_admin, pepsi_inject"
    );
    // The row from before the upgrade is a worker's to finish.
    let mut w = db.client_as(&worker_login());
    let token = tokens(&mut owner, &[id])[0];
    let payload = json!([outcome((id, token), "s", "t", "pending", None)]).to_string();
    assert_eq!(
        w.query_typed(sql::WRITE_OUTCOMES, &[(&payload, Type::TEXT)])
            .unwrap()
            .len(),
        1
    );
    // EXECUTE is no longer PUBLIC's: a role that belongs to no group calls nothing.
    let mut n = db.client_as(&nobody);
    refused(
        &mut n,
        "SELECT pepsi.workqueue_inject('x', '', ARRAY['r@y.example'], NULL, NULL)",
    );
    refused(&mut n, "SELECT * FROM pepsi.config_override_rows()");
    let public: i64 = owner
        .query_one(
            "SELECT count(*) FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a \
              WHERE p.pronamespace = 'pepsi'::regnamespace AND a.grantee = 0",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(public, 0, "no function of the schema is PUBLIC's");
}

#[test]
fn pepsi_setup_says_which_roles_need_pg_read_all_stats_to_name_a_snapshot_holder_and_grants_none() {
    let db = TestDb::empty();
    let dir = TempDir::new("roles-read-all-stats");
    let conf = owner_config(&dir, db.connection(), "");
    let out = setup(&conf);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_has!(
        stderr(&out),
        "have a superuser run GRANT pg_read_all_stats TO pepsi_admin, pepsi_dispatch"
    );
    // A cluster-wide membership is the server administrator's to give.
    let member: bool = db
        .client()
        .query_one(
            "SELECT pg_has_role('pepsi_dispatch', 'pg_read_all_stats', 'USAGE') \
                 OR pg_has_role('pepsi_admin', 'pg_read_all_stats', 'USAGE')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(!member);
}

/// Writes the pipeline's configuration: the owner's CONNECTION and each program's own
/// connection key.
pub(super) fn split_config(
    dir: &TempDir,
    db: &TestDb,
    owner: &str,
    mail: &Path,
    bounces: &Path,
) -> PathBuf {
    let relay = dir.write(
        "relay",
        &format!(
            "#!/bin/sh\ncase \",$PEPSI_RECIPIENTS,\" in\n  *@refused.example,*) exit 67 ;;\nesac\n\
             cat > {}/$PEPSI_ID.eml\n",
            mail.display()
        ),
    );
    let deliver = dir.write(
        "deliver",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID.eml\n", bounces.display()),
    );
    for script in [&relay, &deliver] {
        std::fs::set_permissions(script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }
    let program = |name: &str| stage(name).display().to_string();
    let text = format!(
        "[pepsi]\nRUN_AS = root\nHOSTNAME = mx.test.example\n\n\
         [pepsi-postgres]\nCONNECTION = {owner}\nDISPATCH_CONNECTION = {dispatch}\n\
         WORKER_CONNECTION = {worker}\nADMIN_CONNECTION = {admin}\nINJECT_CONNECTION = {inject}\n\n\
         [pepsi-dispatch]\nSTATS_INTERVAL = 1s\n\n\
         [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n\
         [stage-in]\nPROGRAM = {pass}\nNEXT = route\n\n\
         [stage-route]\nPROGRAM = {if_}\nMATCH = recipient-domain is never.example\n\
         NEXT = special\nELSE_STAGE = relay\n\n\
         [stage-special]\nPROGRAM = {discard}\n\n\
         [stage-relay]\nPROGRAM = {exec}\nCOMMAND = {relay}\n\n\
         [stage-bounce]\nPROGRAM = {bounce}\nNEXT = deliver\n\n\
         [stage-deliver]\nPROGRAM = {exec}\nCOMMAND = {deliver}\n",
        owner = db.conninfo_as(owner),
        dispatch = db.conninfo_as(&dispatch_login()),
        worker = db.conninfo_as(&worker_login()),
        admin = db.conninfo_as(&admin_login()),
        inject = db.conninfo_as(&inject_login()),
        pass = program("pass"),
        if_ = program("if"),
        discard = program("discard"),
        exec = program("exec"),
        bounce = program("bounce"),
        relay = relay.display(),
        deliver = deliver.display(),
    );
    dir.write("pepsi.conf", &crate::util::with_exec_user(&text))
}

pub(super) fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

/// The recommended setup end to end: a schema owner that is no superuser, and the
/// dispatcher, its workers, the failure bouncer and `pepsi-queue` each on a login role
/// of its own group role. Mail injected by `pepsi-queue inject` is passed, routed (one
/// message split by a per-address setting the administrator wrote), delivered, or
/// refused, failed, moved by the bouncer and reported; the queue drains and the
/// dispatcher's statistics land.
#[test]
fn every_program_on_its_own_role_drains_a_pipeline() {
    drain_with_split_roles("roles-e2e", |_| {});
}

/// The pipeline of [`every_program_on_its_own_role_drains_a_pipeline`], with `before`
/// called once the configuration has been checked and before any mail is queued;
/// returns the database, drained.
pub(super) fn drain_with_split_roles(tag: &str, before: impl FnOnce(&TestDb)) -> TestDb {
    let owner = login_role("pepsi_t_owner", &[]);
    let db = TestDb::empty_owned_by(&owner);
    let dir = TempDir::new(tag);
    let mail = dir.path("mail");
    let bounces = dir.path("bounces");
    crate::util::shared_dir(&mail);
    crate::util::shared_dir(&bounces);
    let conf = split_config(&dir, &db, &owner, &mail, &bounces);
    let out = setup(&conf);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut o = db.client_as(&owner);
    let schema_owner: String = o
        .query_one(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pepsi'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(schema_owner, owner);

    let check = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    assert!(
        check.status.success(),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        stderr(&check)
    );
    before(&db);

    // The administrator's role writes the overlay (through pepsi-queue) and a
    // per-address setting; the workers read both.
    let queue = |args: &[&str], input: &[u8]| -> Output {
        use std::io::Write;
        let mut child = std::process::Command::new(bin("pepsi-queue"))
            .arg("-c")
            .arg(&conf)
            .args(args)
            .env_remove("PEPSI_CONFIG")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let _ = child.stdin.take().unwrap().write_all(input);
        child.wait_with_output().unwrap()
    };
    let out = queue(&["config", "set", "stage-relay", "TIMEOUT", "30s"], b"");
    assert!(out.status.success(), "{}", stderr(&out));
    let mut admin = db.client_as(&admin_login());
    admin
        .execute(
            "INSERT INTO pepsi.settings VALUES ('r2@y.example', 'route', 'MATCH', 'sender-domain is x.example')",
            &[],
        )
        .unwrap();

    let message = b"From: <s@x.example>\r\nSubject: hello\r\n\r\nHello.\r\n";
    let inject_one = |to: &[&str]| {
        let mut args = vec!["inject", "--stage", "in", "-f", "s@x.example"];
        args.extend_from_slice(to);
        let out = queue(&args, message);
        assert!(out.status.success(), "{}", stderr(&out));
    };
    for i in 0..5 {
        inject_one(&[&format!("r{i}@ok.example")]);
    }
    inject_one(&["r1@y.example", "r2@y.example"]);
    inject_one(&["x@refused.example"]);

    let mut d = Dispatcher::start(&conf, &[]);
    let mut b = Bouncer::ready(&conf, &[]);
    wait_until(Duration::from_secs(60), "the queue is empty", || {
        queue_len(&mut o) == 0
    });
    // Each program's session runs as its own login role.
    let roles: Vec<(String, String)> = o
        .query(
            "SELECT application_name, usename::text FROM pg_stat_activity \
              WHERE datname = current_database() \
                AND application_name IN ('pepsi-dispatch', 'pepsi-failure-bouncer') \
              ORDER BY 1, 2",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_has!(roles, &("pepsi-dispatch".into(), dispatch_login()));
    assert_has!(roles, &("pepsi-failure-bouncer".into(), admin_login()));
    wait_until(
        Duration::from_secs(20),
        "the statistics are flushed",
        || {
            o.query_one(
            "SELECT coalesce(sum(passes), 0)::int8 FROM pepsi.stage_stats WHERE stage = 'relay'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            >= 7
        },
    );
    assert!(d.terminate().success(), "{}", d.log());
    assert!(b.terminate().success(), "{}", b.log());
    for log in [d.log(), b.log()] {
        assert!(!log.contains("permission denied"), "{log}");
    }
    assert_eq!(
        files_in(&mail),
        6,
        "five messages and the split's r1 delivered"
    );
    assert_eq!(files_in(&bounces), 1, "one report for the refused message");
    let out = queue(&["status"], b"");
    assert!(out.status.success(), "{}", stderr(&out));
    // The repair functions (invoker's rights) run in the administrator's session too.
    let held = queue(&["hold", "-"], b"1\n");
    assert_lacks!(stderr(&held), "permission denied");
    drop(o);
    db
}

#[test]
fn a_second_dispatcher_on_another_role_names_the_holder() {
    let db = TestDb::new();
    let dir = TempDir::new("roles-second");
    let first_role = dispatch_login();
    let second_role = login_role("pepsi_t_dispatch2", &["pepsi_dispatch"]);
    let stages = format!(
        "[stage-s]\nPROGRAM = {}\nNEXT = t\n\n[stage-t]\nPROGRAM = {}\n",
        stage("pass").display(),
        stage("discard").display()
    );
    let first_conf = dir.write(
        "first.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\nDISPATCH_CONNECTION = {}\n\n{stages}",
            db.connection(),
            db.conninfo_as(&first_role)
        ),
    );
    let second_conf = dir.write(
        "second.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\nDISPATCH_CONNECTION = {}\n\n{stages}",
            db.connection(),
            db.conninfo_as(&second_role)
        ),
    );
    let first = Dispatcher::start(&first_conf, &[]);
    first.wait_log("serving", Duration::from_secs(20));
    let mut second = Dispatcher::start(&second_conf, &[]);
    let status = second.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", second.log());
    let log = second.log();
    assert_has!(log, "another pepsi-dispatch holds the dispatcher lock");
    assert_has!(log, &format!("(role {first_role})"));
    assert_has!(log, "application_name \"pepsi-dispatch\"");
    assert_has!(log, "pg_read_all_stats");
    drop(first);
}

#[test]
fn check_reports_a_worker_connection_that_cannot_connect() {
    let db = TestDb::new();
    let dir = TempDir::new("roles-check");
    let conf = owner_config(
        &dir,
        db.connection(),
        &format!(
            "WORKER_CONNECTION = {}\n\n[stage-s]\nPROGRAM = {}\n",
            db.conninfo_as("pepsi_t_no_such_role"),
            stage("discard").display()
        ),
    );
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(78), "{text}{}", stderr(&out));
    assert_has!(text, "error: database (WORKER_CONNECTION): cannot connect");
    assert_lacks!(text, "error: database: ", "the dispatcher's own is fine");
}

/// With a schema owner that is no superuser (as on a real server), the owner can
/// signal a worker's session only once it is a member of the worker's login role
/// (doc/roles-and-containment.md, "Database roles", step 3); until then the session is counted as refused
/// and left alone.
#[test]
fn a_worker_session_the_owner_may_not_signal_is_refused_until_the_owner_is_a_member() {
    let owner = login_role("pepsi_t_owner_signal", &[]);
    let db = TestDb::empty_owned_by(&owner);
    let dir = TempDir::new("roles-signal");
    let out = setup(&owner_config(&dir, &db.conninfo_as(&owner), ""));
    assert!(out.status.success(), "{}", stderr(&out));
    let worker = login_role("pepsi_t_worker_signal", &["pepsi_worker"]);
    let mut d = db.client_as(&dispatch_login());
    let conninfo = format!(
        "{} application_name=pepsi-worker:77:s",
        db.conninfo_as(&worker)
    );
    let mut session = Client::connect(&conninfo, NoTls).unwrap();
    let patterns = vec!["pepsi-worker:77:%".to_string()];
    let terminate = |d: &mut Client| -> (i64, i64) {
        let row = d
            .query_typed_one(
                sql::TERMINATE_WORKER_SESSIONS,
                &[(&patterns, Type::TEXT_ARRAY)],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(terminate(&mut d), (0, 1));
    session.simple_query("SELECT 1").unwrap();
    crate::util::pg::admin()
        .batch_execute(&format!("GRANT {worker} TO {owner}"))
        .unwrap();
    assert_eq!(terminate(&mut d), (1, 0));
    assert!(session.simple_query("SELECT 1").is_err());
}

/// With the dispatcher and the workers on their own roles, `check` reads the
/// per-address settings as the workers do, on their connection (the dispatcher's role
/// may not read them): a refused row is listed, not "not checked".
#[test]
fn check_reads_the_per_address_settings_on_the_workers_connection() {
    let db = TestDb::new();
    let dir = TempDir::new("roles-check-settings");
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.settings (address, stage, key, value) VALUES ('r@y.example', 's', 'COMMAND', '/tmp/x')",
        &[],
    )
    .unwrap();
    let conf = owner_config(
        &dir,
        db.connection(),
        &format!(
            "DISPATCH_CONNECTION = {}\nWORKER_CONNECTION = {}\n\n[stage-s]\nPROGRAM = {}\n",
            db.conninfo_as(&dispatch_login()),
            db.conninfo_as(&worker_login()),
            stage("discard").display()
        ),
    );
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert_has!(text, "r@y.example", "the refused row is listed");
    assert_has!(
        text,
        "COMMAND is never overridable per address",
        "the refused row is listed"
    );
    assert!(!text.contains("is not checked"), "{text}");
}

/// The dispatcher on a role of `pepsi_dispatch` (no `pg_read_all_stats`) cannot see a
/// superuser's session in full: it names the holder by pid, application and role, ages
/// the snapshot from when it first saw it, and says why.
#[test]
fn a_dispatcher_that_may_not_see_the_holders_details_names_it_by_pid_and_says_why() {
    let db = TestDb::new();
    let dir = TempDir::new("roles-holder");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\nDISPATCH_CONNECTION = {}\n\n\
             [pepsi-dispatch]\nSNAPSHOT_WARNING = 1s\n\n[stage-s]\nPROGRAM = /bin/true\n",
            db.connection(),
            db.conninfo_as(&dispatch_login())
        ),
    );
    let mut h = db.client();
    h.batch_execute(
        "SET application_name = 'pepsi-hidden-holder'; \
         BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pepsi.workqueue",
    )
    .unwrap();
    let pid: i32 = h.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let d = Dispatcher::start(&conf, &[]);
    let named = format!("held by session pid {pid} (application \"pepsi-hidden-holder\"");
    d.wait_log(&named, Duration::from_secs(60));
    let log = d.log();
    let line = log.lines().find(|l| l.contains(&named)).unwrap();
    assert_has!(line, "at least");
    assert_has!(line, "hidden from this database role");
    assert_has!(line, "pg_read_all_stats");
    assert_lacks!(line, "state \"");
    h.batch_execute("COMMIT").unwrap();
    d.wait_log(
        "younger than SNAPSHOT_WARNING (1s) again",
        Duration::from_secs(60),
    );
}
