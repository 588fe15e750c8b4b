//! The schema, `pepsi-setup`, the configuration overlay and the global options, against
//! a real PostgreSQL.

use postgres::Client;

use crate::util::notify::{listen, notified};
use crate::util::{TempDir, TestDb, assert_has, bin, run, stderr, write_config};

fn sender_key(
    c: &mut Client,
    auth: Option<&str>,
    ip: Option<&str>,
    from: &str,
    to: &[&str],
) -> String {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('s', $1, $2, NULL, NULL, $3, $4::text::inet)",
            &[&from, &to, &auth, &ip],
        )
        .unwrap()
        .get(0);
    c.query_one(
        "SELECT sender_key FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

#[test]
fn sender_key_has_all_four_forms() {
    let db = TestDb::new();
    let mut c = db.client();
    assert_eq!(
        sender_key(
            &mut c,
            Some("alice"),
            Some("192.0.2.7"),
            "x@Example.org",
            &["r@a.example"]
        ),
        "user:alice"
    );
    assert_eq!(
        sender_key(
            &mut c,
            None,
            Some("192.0.2.7"),
            "x@example.org",
            &["r@a.example"]
        ),
        "ip:192.0.2.7"
    );
    let v6a = sender_key(
        &mut c,
        None,
        Some("2001:db8:1:2::1"),
        "a@x.example",
        &["r@a.example"],
    );
    let v6b = sender_key(
        &mut c,
        None,
        Some("2001:db8:1:2:ffff::9"),
        "b@y.example",
        &["r@a.example"],
    );
    let v6c = sender_key(
        &mut c,
        None,
        Some("2001:db8:1:3::1"),
        "a@x.example",
        &["r@a.example"],
    );
    assert_eq!(v6a, "ip:2001:db8:1:2::/64");
    assert_eq!(v6a, v6b, "two peers of one /64 share a key");
    assert_ne!(v6a, v6c, "peers of different /64s do not");
    assert_eq!(
        sender_key(
            &mut c,
            None,
            None,
            "",
            &["Bob@Rcpt.Example", "c@other.example"]
        ),
        "null:rcpt.example"
    );
    assert_eq!(
        sender_key(
            &mut c,
            None,
            None,
            "notices@Pepsi.Example",
            &["r@a.example"]
        ),
        "from:pepsi.example"
    );
    // An IPv4 client seen by a dual-stack listener is that IPv4 peer, not one IPv6 /64.
    let k = |c: &mut Client, user: Option<&str>, ip: Option<&str>, from: &str, to: &str| {
        sender_key(c, user, ip, from, &[to])
    };
    assert_eq!(
        k(
            &mut c,
            None,
            Some("::ffff:192.0.2.7"),
            "x@e.example",
            "r@a.example"
        ),
        "ip:192.0.2.7"
    );
    assert_ne!(
        k(
            &mut c,
            None,
            Some("::ffff:192.0.2.8"),
            "x@e.example",
            "r@a.example"
        ),
        "ip:192.0.2.7"
    );
    // An empty login is no login; logins group regardless of case.
    assert_eq!(
        k(
            &mut c,
            Some(""),
            Some("192.0.2.7"),
            "x@e.example",
            "r@a.example"
        ),
        "ip:192.0.2.7"
    );
    assert_eq!(
        k(&mut c, Some("Alice"), None, "x@e.example", "r@a.example"),
        "user:alice"
    );
    // Angle brackets and a trailing dot do not make another domain. (workqueue_inject
    // refuses such an address; the key is computed for whatever a writer stores.)
    let key: String = c
        .query_one(
            "INSERT INTO pepsi.workqueue (stage, status, mail_from, rcpt_to) \
             VALUES ('s', 'pending', '', ARRAY['<Bob@Rcpt.Example.>']) RETURNING sender_key",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(key, "null:rcpt.example");
}

fn body_count(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM pepsi.workqueue_body", &[])
        .unwrap()
        .get(0)
}

#[test]
fn the_body_goes_with_the_last_row_that_shares_it() {
    let db = TestDb::new();
    let mut c = db.client();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('s', 'a@x.example', ARRAY['r1@y.example','r2@z.example'], 'H: v\r\n'::bytea, 'body'::bytea)",
            &[],
        )
        .unwrap()
        .get(0);
    crate::util::claim(&mut c, &[id]);
    let token = crate::util::tokens(&mut c, &[id])[0];
    let new: Vec<i64> = c
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r1@y.example\"],[\"r2@z.example\"]]'::jsonb, 's', \
             NULL, NULL, false, $2)",
            &[&id, &token],
        )
        .unwrap()
        .get(0);
    assert_eq!(new.len(), 1);
    assert_eq!(body_count(&mut c), 1);
    c.execute(
        "DELETE FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(
        body_count(&mut c),
        1,
        "the split sibling still references the body"
    );
    c.execute(
        "DELETE FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&new[0]],
    )
    .unwrap();
    assert_eq!(
        body_count(&mut c),
        0,
        "the last reference is gone, so is the body"
    );
}

#[test]
fn body_gc_removes_orphans_only() {
    let db = TestDb::new();
    let mut c = db.client();
    c.query_one("SELECT pepsi.workqueue_inject('s', 'a@x.example', ARRAY['r@y.example'], NULL, 'kept'::bytea)", &[])
        .unwrap();
    // An orphan as two concurrent deletes can leave one.
    c.execute(
        "INSERT INTO pepsi.workqueue_body (body) VALUES ('orphan'), ('orphan2')",
        &[],
    )
    .unwrap();
    assert_eq!(body_count(&mut c), 3);
    let n: i32 = c
        .query_one("SELECT pepsi.workqueue_body_gc(1)", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "the limit bounds one run");
    let n: i32 = c
        .query_one("SELECT pepsi.workqueue_body_gc(10000)", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let left: Vec<u8> = c
        .query_one("SELECT body FROM pepsi.workqueue_body", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, b"kept");
}

/// A LISTEN session on every channel Pepsi uses plus a sentinel.
fn listener(db: &TestDb) -> Client {
    listen(db, &["workqueue", "workqueue_failed", "config_changed"])
}

#[test]
fn inject_and_resume_notify_but_an_advance_does_not() {
    let db = TestDb::new();
    let mut l = listener(&db);
    let mut c = db.client();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('a', 'x@y.example', ARRAY['r@z.example'], NULL, NULL)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue"]);

    c.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET stage = 'b', status = 'pending' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(
        notified(&mut l, &mut c),
        Vec::<String>::new(),
        "an advance notifies nothing"
    );

    c.execute(
        "UPDATE pepsi.workqueue SET status = 'paused', timeout = now() WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
    let n: i32 = c
        .query_one("SELECT pepsi.workqueue_resume(ARRAY[$1::bigint])", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue"]);

    // Resume by stage/status, and a resume that matches nothing is silent.
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed', state = state || \
         '{\"strikes\": 3, \"temporary_failures\": 4, \"temporary_stage\": \"b\", \"last_error\": \"x\"}' \
         WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue_failed"]);
    let n: i32 = c
        .query_one(
            "SELECT pepsi.workqueue_resume('b', 'failed'::pepsi.workqueue_status)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue"]);
    // A resumed row starts afresh, its retry backoff included; the last error stays.
    let state: String = c
        .query_one(
            "SELECT state::text FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(state, r#"{"last_error": "x"}"#);
    let n: i32 = c
        .query_one("SELECT pepsi.workqueue_resume('b', NULL)", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
    let status: String = c
        .query_one(
            "SELECT status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "pending");
}

#[test]
fn failed_and_timeout_rows_notify_workqueue_failed() {
    let db = TestDb::new();
    let mut l = listener(&db);
    let mut c = db.client();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('a', 'x@y.example', ARRAY['r@z.example'], NULL, NULL)",
            &[],
        )
        .unwrap()
        .get(0);
    notified(&mut l, &mut c);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'timeout' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue_failed"]);
    // Staying failed/timeout (an update of the state only) does not notify again.
    c.execute("UPDATE pepsi.workqueue SET status = 'timeout', state = '{\"x\":1}' WHERE workqueue_id = $1", &[&id])
        .unwrap();
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'failed' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    assert_eq!(notified(&mut l, &mut c), vec!["workqueue_failed"]);
}

#[test]
fn the_config_override_trigger_notifies_config_changed() {
    let db = TestDb::new();
    let mut l = listener(&db);
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-a', 'PROGRAM', 'p'), ('stage-a', 'NEXT', 'b')",
        &[],
    )
    .unwrap();
    assert_eq!(
        notified(&mut l, &mut c),
        vec!["config_changed"],
        "once per statement"
    );
}

#[test]
fn split_keeps_group_one_and_clones_the_rest_pending_at_the_same_stage() {
    let db = TestDb::new();
    let mut c = db.client();
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('relay', 'a@x.example', ARRAY['r1@y.example','r2@z.example','r3@z.example'], 'Subject: s\r\n'::bytea, 'b'::bytea, NULL, NULL, NULL, 'subj', '{\"k\":1}')",
            &[],
        )
        .unwrap()
        .get(0);
    c.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    let new: Vec<i64> = c
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r2@z.example\"],[\"r1@y.example\"],[\"r3@z.example\"]]'::jsonb, \
             'relay', NULL, NULL, false, 0)",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(new.len(), 2);
    let rows = c
        .query(
            "SELECT workqueue_id, stage, status::text, rcpt_to, body_id, subject, state::text, headers \
             FROM pepsi.workqueue ORDER BY workqueue_id",
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), 3);
    let body: i64 = rows[0].get(4);
    let expect = [
        (id, "running", vec!["r2@z.example"]),
        (new[0], "pending", vec!["r1@y.example"]),
        (new[1], "pending", vec!["r3@z.example"]),
    ];
    for (row, (eid, status, rcpt)) in rows.iter().zip(expect) {
        assert_eq!(row.get::<_, i64>(0), eid);
        assert_eq!(row.get::<_, String>(1), "relay");
        assert_eq!(row.get::<_, String>(2), status);
        assert_eq!(row.get::<_, Vec<String>>(3), rcpt);
        assert_eq!(row.get::<_, i64>(4), body, "the body is shared");
        assert_eq!(row.get::<_, String>(5), "subj");
        assert_eq!(row.get::<_, String>(6), "{\"k\": 1}");
        assert_eq!(row.get::<_, Vec<u8>>(7), b"Subject: s\r\n");
    }
    assert_eq!(body_count(&mut c), 1);

    // Groups that are not exactly the recipients are refused.
    let err = c
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r2@z.example\"],[\"nobody@x\"]]'::jsonb, \
             'relay', NULL, NULL, false, 0)",
            &[&id],
        )
        .unwrap_err();
    let err = pepsi::db::describe(&err);
    assert!(err.contains("not exactly the row's recipients"), "{err}");
    // A guarded split of a row that is not running at the claimed stage, or under
    // another claim token, does nothing.
    for (row, stage, claim) in [(new[0], "relay", 0i64), (id, "other", 0), (id, "relay", 7)] {
        let none: Option<Vec<i64>> = c
            .query_one(
                "SELECT pepsi.workqueue_split($1, '[[\"r2@z.example\"]]'::jsonb, $2, NULL, NULL, \
                 false, $3)",
                &[&row, &stage, &claim],
            )
            .unwrap()
            .get(0);
        assert_eq!(none, None, "{row} {stage} {claim}");
    }
    // Without its guard a split is refused: only a worker holding the row splits it.
    let err = c
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r2@z.example\"]]'::jsonb)",
            &[&id],
        )
        .unwrap_err();
    let err = pepsi::db::describe(&err);
    assert_has!(err, "the claimed stage and the claim token are required");
}

fn setup(dir: &TempDir, db: &TestDb) -> std::process::Output {
    let conf = write_config(dir, db, "");
    run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    )
}

#[test]
fn pepsi_setup_installs_once_then_is_a_no_op() {
    let db = TestDb::empty();
    let dir = TempDir::new("setup");
    let out = setup(&dir, &db);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_has!(
        stderr(&out),
        &format!(
            "schema installed at version {}",
            pepsi::db::schema::version()
        )
    );
    let mut c = db.client();
    let (v, d): (i32, String) = c
        .query_one("SELECT version, digest FROM pepsi.schema_version", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(v, pepsi::db::schema::version());
    assert_eq!(d, pepsi::db::schema::digest(v));
    let out = setup(&dir, &db);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_has!(stderr(&out), "schema is up to date");
    pepsi::db::schema::check(&mut c).unwrap();
}

#[test]
fn each_schema_mismatch_exits_78_with_its_own_message() {
    let db = TestDb::new();
    let dir = TempDir::new("mismatch");
    let mut c = db.client();
    let v = pepsi::db::schema::version();

    c.execute("UPDATE pepsi.schema_version SET version = $1", &[&(v + 1)])
        .unwrap();
    let out = setup(&dir, &db);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert_has!(stderr(&out), "newer");
    assert_has!(stderr(&out), "this binary is older");

    c.execute(
        "UPDATE pepsi.schema_version SET version = $1, digest = 'feedface'",
        &[&v],
    )
    .unwrap();
    let out = setup(&dir, &db);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert_has!(stderr(&out), "built from other files");

    // Older: the library check every program runs names the remedy.
    c.execute(
        "UPDATE pepsi.schema_version SET version = 0, digest = $1",
        &[&pepsi::db::schema::digest(0)],
    )
    .unwrap();
    let err = pepsi::db::schema::check(&mut c).unwrap_err();
    assert_has!(err.to_string(), "older", "{err}");
    assert_has!(err.to_string(), "run pepsi-setup schema", "{err}");
    // Not installed at all reads as the same remedy.
    let empty = TestDb::empty();
    let err = pepsi::db::schema::check(&mut empty.client()).unwrap_err();
    assert_has!(err.to_string(), "not installed");
    assert_has!(err.to_string(), "run pepsi-setup schema");
}

#[test]
fn a_trailing_global_flag_exits_64() {
    let out = run(&bin("pepsi-setup"), &["schema", "-v"]);
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert_has!(stderr(&out), "must come before the subcommand");
    let out = run(&bin("pepsi-setup"), &["frobnicate"]);
    assert_eq!(out.status.code(), Some(64));
    let out = run(&bin("pepsi-setup"), &["-V"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("pepsi-setup "));
}

#[test]
fn a_configuration_only_root_can_read_stops_the_dispatcher_at_start() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: RUN_AS is not applied, nothing to check");
        return;
    }
    let dir = TempDir::new("rootconf");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = nobody\nWORKER_AS = {}\n[pepsi-postgres]\nCONNECTION = host=/nonexistent\n",
            crate::util::accounts::worker_account()
        ),
    );
    std::fs::set_permissions(&conf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "serve"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_has!(stderr(&out), "cannot be read as RUN_AS nobody");
}

#[test]
fn a_configuration_syntax_error_names_file_and_line_and_exits_1() {
    let dir = TempDir::new("badconf");
    let conf = dir.write(
        "pepsi.conf",
        "[pepsi]\nRUN_AS = root\n[pepsi-dispatch]\nMAX_RUNTIME = soon\n",
    );
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    assert_eq!(out.status.code(), Some(1));
    let expect = format!(
        "{}:4: [pepsi-dispatch] MAX_RUNTIME: \"soon\" is not a duration",
        conf.display()
    );
    assert!(stderr(&out).contains(&expect), "{}", stderr(&out));
    // The search order: $PEPSI_CONFIG when there is no -c.
    let out = std::process::Command::new(bin("pepsi-setup"))
        .arg("schema")
        .env("PEPSI_CONFIG", &conf)
        .output()
        .unwrap();
    assert!(stderr(&out).contains(&expect), "{}", stderr(&out));
}

#[test]
fn the_overlay_from_the_database_beats_the_file() {
    let db = TestDb::new();
    let dir = TempDir::new("overlay");
    let conf = write_config(
        &dir,
        &db,
        "[stage-a]\nPROGRAM = pepsi-stage-pass\nNEXT = b\nPARALLELISM = 2\n[stage-b]\nPROGRAM = pepsi-stage-discard\n",
    );
    let config = pepsi::config::Config::load(Some(&conf)).unwrap();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-a', 'PARALLELISM', '9'), ('stage-a', 'NEXT', 'c'), \
         ('stage-c', 'PROGRAM', 'pepsi-stage-pass'), ('stage-c', 'NEXT', 'b')",
        &[],
    )
    .unwrap();
    let overlay = pepsi::db::read_overlay(&mut c).unwrap();
    let graph = config.graph(&overlay).unwrap();
    assert_eq!(graph.get("a").unwrap().parallelism, 9);
    assert_eq!(graph.get("a").unwrap().next.as_deref(), Some("c"));
    assert!(graph.contains("c"));
    // A dangling reference through the overlay is rejected, naming the overlay.
    c.execute("UPDATE pepsi.config_override SET value = 'nowhere' WHERE section = 'stage-c' AND key = 'NEXT'", &[])
        .unwrap();
    let overlay = pepsi::db::read_overlay(&mut c).unwrap();
    let errs = config.graph(&overlay).unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        "pepsi.config_override: [stage-c] NEXT: names stage \"nowhere\", which has no [stage-nowhere] section"
    );
}
