//! Containment (§4 "Containment", §12.7 exec): what the overlay, a planted object,
//! an exec command, a worker's role and an injector's role cannot do, each tried as an
//! attacker would. The foreign worker's sessions (`guarantees.rs`) and the small cases
//! of escaping and notifications (`bounce.rs`, `queue.rs`, `config_check.rs`) have
//! their tests beside the code they concern.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use pepsi::db::sql;
use postgres::Client;
use postgres::error::SqlState;
use serde_json::json;

use super::roles::{admin_login, drain_with_split_roles, inject_login, worker_login};
use crate::util::dispatcher::Dispatcher;
use crate::util::rows::queue_len;
use crate::util::scenario::conf;
use crate::util::{
    TempDir, TestDb, assert_has, bin, is_root, row_at, run, shared_dir, stage, stderr, wait_until,
    write_config,
};

/// `pepsi-queue -c conf ARGS…`.
fn queue(conf: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-c", conf.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&bin("pepsi-queue"), &all)
}

/// The overlay's rows.
fn overlay_rows(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0)
}

/// An executable script in `dir`.
fn script(dir: &TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.write(name, text);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn the_overlay_cannot_set_a_command_or_a_user_nor_add_a_stage_that_runs_one() {
    let db = TestDb::new();
    let dir = TempDir::new("contain-overlay");
    let out = dir.path("out");
    shared_dir(&out);
    let deliver = script(
        &dir,
        "deliver",
        &format!(
            "#!/bin/sh\ncat >/dev/null\ntouch {}/file.$PEPSI_ID\n",
            out.display()
        ),
    );
    let planted = script(
        &dir,
        "planted",
        &format!(
            "#!/bin/sh\ncat >/dev/null\ntouch {}/overlay.$PEPSI_ID\n",
            out.display()
        ),
    );
    let conf = conf(
        &dir,
        &db,
        "",
        &format!(
            "[stage-in]\nPROGRAM = {{pass}}\nNEXT = deliver\n\n\
             [stage-deliver]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            deliver.display()
        ),
    );
    let mut c = db.client();
    let command = format!("{} -x", planted.display());
    // pepsi-queue refuses every such row, with why, and writes nothing.
    for (args, says) in [
        (
            vec![
                "config",
                "set",
                "stage-deliver",
                "COMMAND",
                command.as_str(),
            ],
            "COMMAND is refused",
        ),
        (
            vec!["config", "set", "stage-deliver", "USER", "root"],
            "USER is refused",
        ),
        (
            vec!["config", "unset", "stage-deliver", "COMMAND"],
            "nothing changed",
        ),
        (
            vec![
                "config",
                "set",
                "stage-new",
                "PROGRAM",
                "/usr/bin/pepsi-stage-exec",
            ],
            "COMMAND",
        ),
        (
            vec!["config", "set", "stage-new", "COMMAND", "/bin/sh"],
            "COMMAND is refused",
        ),
    ] {
        let done = queue(&conf, &args);
        assert_ne!(done.status.code(), Some(0), "{args:?} was accepted");
        assert!(stderr(&done).contains(says), "{args:?}: {}", stderr(&done));
        assert_eq!(overlay_rows(&mut c), 0, "{args:?} wrote something");
    }
    // A row written behind pepsi-queue's back (by the table's owner) is reported by
    // check and left out by the dispatcher, which runs the file's command.
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-deliver', 'COMMAND', $1), \
         ('stage-deliver', 'USER', 'root')",
        &[&command],
    )
    .unwrap();
    let check = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    let printed = String::from_utf8_lossy(&check.stdout).into_owned();
    assert_eq!(check.status.code(), Some(78), "{printed}");
    assert_has!(
        printed,
        "error: pepsi.config_override: [stage-deliver] COMMAND: COMMAND is refused"
    );
    assert_has!(printed, "[stage-deliver] USER: USER is refused");
    let mut d = Dispatcher::start(&conf, &[]);
    let id = crate::util::inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    wait_until(Duration::from_secs(30), "the message is delivered", || {
        row_at(&mut c, id).is_none()
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert!(out.join(format!("file.{id}")).exists(), "{}", d.log());
    assert!(!out.join(format!("overlay.{id}")).exists(), "{}", d.log());
    assert_has!(d.log(), "[stage-deliver] COMMAND: COMMAND is refused");
}

#[test]
fn every_function_and_every_session_resolves_names_through_the_catalog_alone() {
    let db = TestDb::new();
    let mut c = db.client();
    let loose: Vec<String> = c
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p \
              WHERE p.pronamespace = 'pepsi'::regnamespace \
                AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false) \
              ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(loose.is_empty(), "without SET search_path: {loose:#?}");
    let functions: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pepsi'::regnamespace",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(functions > 20, "the check looked at the schema's functions");
    let mut session = pepsi::db::connect(db.connection(), "t").unwrap();
    let path: String = session.query_one("SHOW search_path", &[]).unwrap().get(0);
    assert_eq!(path, "pg_catalog,pg_temp");
}

/// A function and an operator on the queue's status type, created in `public` by an
/// injecting role, that count their calls in `public.calls`.
fn plant_operator(db: &TestDb) {
    let mut su = db.client();
    su.batch_execute(
        "GRANT CREATE ON SCHEMA public TO PUBLIC; \
         CREATE TABLE public.calls (n int); \
         GRANT INSERT, SELECT ON public.calls TO PUBLIC",
    )
    .unwrap();
    let mut i = db.client_as(&inject_login());
    i.batch_execute(
        "CREATE FUNCTION public.status_eq(a pepsi.workqueue_status, b pepsi.workqueue_status) \
         RETURNS boolean LANGUAGE plpgsql AS $$ \
         BEGIN INSERT INTO public.calls VALUES (1); RETURN a::text = b::text; END $$; \
         CREATE OPERATOR public.= (LEFTARG = pepsi.workqueue_status, \
                                   RIGHTARG = pepsi.workqueue_status, \
                                   FUNCTION = public.status_eq)",
    )
    .unwrap();
    // Live: a session with the default search_path picks it over the catalog's.
    let mut plain = db.client_as(&admin_login());
    plain
        .query(
            "SELECT 1 FROM pepsi.workqueue WHERE status = 'pending'",
            &[],
        )
        .unwrap();
    plain
        .execute("INSERT INTO public.calls VALUES (0)", &[])
        .unwrap();
    let calls: i64 = su
        .query_one("SELECT count(*) FROM public.calls WHERE n = 1", &[])
        .unwrap()
        .get(0);
    // The planted operator is called for a row it compares; an empty queue compares
    // none, so prove it with a row of its own.
    if calls == 0 {
        su.batch_execute(
            "INSERT INTO pepsi.workqueue (stage, status, mail_from, rcpt_to) \
             VALUES ('probe', 'held', '', ARRAY['r@y.example'])",
        )
        .unwrap();
        plain
            .query(
                "SELECT 1 FROM pepsi.workqueue WHERE status = 'pending'",
                &[],
            )
            .unwrap();
        su.batch_execute("DELETE FROM pepsi.workqueue WHERE stage = 'probe'")
            .unwrap();
    }
    let calls: i64 = su
        .query_one("SELECT count(*) FROM public.calls WHERE n = 1", &[])
        .unwrap()
        .get(0);
    assert!(calls > 0, "the planted operator is not live");
    su.batch_execute("DELETE FROM public.calls").unwrap();
}

#[test]
fn an_operator_an_injector_planted_in_public_is_never_called_while_the_pipeline_drains() {
    let db = drain_with_split_roles("contain-planted", plant_operator);
    let calls: i64 = db
        .client()
        .query_one("SELECT count(*) FROM public.calls", &[])
        .unwrap()
        .get(0);
    assert_eq!(calls, 0, "the planted operator ran in a Pepsi session");
}

#[test]
fn pepsi_setup_closes_public_and_check_reports_a_schema_other_roles_may_create_in() {
    let db = TestDb::new();
    let dir = TempDir::new("contain-public");
    let conf = write_config(&dir, &db, "[stage-in]\nPROGRAM = pepsi-stage-discard\n");
    let mut su = db.client();
    let open =
        |c: &mut Client| -> bool { c.query_one(sql::PUBLIC_SCHEMA_OPEN, &[]).unwrap().get(0) };
    su.batch_execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        .unwrap();
    assert!(open(&mut su));
    let check = |conf: &Path| {
        run(
            &bin("pepsi-dispatch"),
            &["-c", conf.to_str().unwrap(), "check"],
        )
    };
    let out = check(&conf);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(78), "{printed}");
    assert_has!(
        printed,
        "error: database: role pepsi_inject may create objects in schema public, which sessions resolve names through"
    );
    assert_has!(printed, "REVOKE CREATE ON SCHEMA public FROM PUBLIC");
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_has!(stderr(&out), "revoked CREATE on schema public from PUBLIC");
    assert!(!open(&mut su));
    let out = check(&conf);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!printed.contains("may create objects"), "{printed}");
    // The queue's own schema: no Pepsi role but its owner creates there.
    su.batch_execute("GRANT CREATE ON SCHEMA pepsi TO pepsi_worker")
        .unwrap();
    let out = check(&conf);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_has!(
        printed,
        "role pepsi_worker may create objects in schema pepsi"
    );
    assert_has!(printed, "REVOKE CREATE ON SCHEMA pepsi FROM pepsi_worker");
}

#[test]
fn a_worker_changes_only_the_rows_it_holds_the_claim_of_and_never_a_claim() {
    let db = TestDb::new();
    let mut owner = db.client();
    let pending = crate::util::inject(
        &mut owner,
        "s",
        "a@x.example",
        &["r1@y.example", "r2@y.example"],
    );
    let failed = crate::util::inject(&mut owner, "s", "a@x.example", &["r@y.example"]);
    owner
        .execute(
            "UPDATE pepsi.workqueue SET status = 'failed' WHERE workqueue_id = $1",
            &[&failed],
        )
        .unwrap();
    let running = crate::util::inject(&mut owner, "s", "a@x.example", &["r@y.example"]);
    owner
        .execute(
            "UPDATE pepsi.workqueue SET status = 'running', claim = 42 WHERE workqueue_id = $1",
            &[&running],
        )
        .unwrap();
    let mut w = db.client_as(&worker_login());
    // No row is the worker's to change directly, in flight or not, nor its token to
    // read: its writes go through the functions that take the token.
    for sql in [
        "UPDATE pepsi.workqueue SET stage = 'deliver' WHERE workqueue_id = $1",
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = $1",
        "UPDATE pepsi.workqueue SET claim = 7 WHERE workqueue_id = $1",
        "DELETE FROM pepsi.workqueue WHERE workqueue_id = $1",
        "SELECT claim FROM pepsi.workqueue WHERE workqueue_id = $1",
    ] {
        for id in [pending, failed, running] {
            let err = w.execute(sql, &[&id]).unwrap_err();
            assert_eq!(
                err.code(),
                Some(&SqlState::INSUFFICIENT_PRIVILEGE),
                "{sql} {id}: {err}"
            );
        }
    }
    assert_eq!(
        row_at(&mut owner, pending),
        Some(("s".into(), "pending".into()))
    );
    assert_eq!(
        row_at(&mut owner, failed),
        Some(("s".into(), "failed".into()))
    );
    // A split or a bounce of a row the worker does not hold does nothing; a split
    // without its guard is refused.
    let split: Option<Vec<i64>> = w
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r1@y.example\"],[\"r2@y.example\"]]', 's', \
             NULL, NULL, false, 0)",
            &[&pending],
        )
        .unwrap()
        .get(0);
    assert_eq!(split, None);
    let err = w
        .query_one(
            "SELECT pepsi.workqueue_split($1, '[[\"r1@y.example\"],[\"r2@y.example\"]]')",
            &[&pending],
        )
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
    let bounce: Option<i64> = w
        .query_one(
            sql::BOUNCE,
            &[
                &failed,
                &"s",
                &0i64,
                &"deliver",
                &"a@x.example",
                &None::<&str>,
                &None::<&str>,
                &None::<Vec<u8>>,
                &None::<Vec<u8>>,
            ],
        )
        .unwrap()
        .get(0);
    assert_eq!(bounce, None);
    // The row in flight, under a token the worker does not hold: nothing, whatever
    // the write.
    let advance = |claim: i64, status: &str| {
        json!([{"id": running, "claimed": "s", "claim": claim, "stage": "t",
                "status": status, "delay_ms": null, "state": {}}])
        .to_string()
    };
    for guess in [0i64, 41, 43, -42] {
        assert!(
            w.query(sql::WRITE_OUTCOMES, &[&advance(guess, "pending")])
                .unwrap()
                .is_empty()
        );
        assert!(
            w.query(
                sql::DELETE_FINISHED,
                &[&format!(
                    r#"[{{"id": {running}, "claimed": "s", "claim": {guess}}}]"#
                )]
            )
            .unwrap()
            .is_empty()
        );
        let failed_it: Option<i64> = w
            .query_one(
                sql::FAIL_IN_PLACE,
                &[&running, &"s", &guess, &"permanent", &"x"],
            )
            .unwrap()
            .get(0);
        assert_eq!(failed_it, None);
        assert!(
            w.query(
                sql::PAUSE_OR_FAIL_UNWRITTEN,
                &[&running, &"s", &"x", &guess, &5i32]
            )
            .unwrap()
            .is_empty()
        );
    }
    assert_eq!(
        row_at(&mut owner, running),
        Some(("s".into(), "running".into()))
    );
    // Under its token: its outcome, in a status a worker writes, a notification only
    // to its own sender, never an unclean envelope.
    let err = w
        .query_one(
            sql::BOUNCE,
            &[
                &running,
                &"s",
                &42i64,
                &"deliver",
                &"victim@z.example",
                &None::<&str>,
                &None::<&str>,
                &None::<Vec<u8>>,
                &None::<Vec<u8>>,
            ],
        )
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
    for status in ["held", "timeout", "nonsense"] {
        let err = w
            .query(sql::WRITE_OUTCOMES, &[&advance(42, status)])
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE),
            "{status}: {err}"
        );
    }
    for (mail_from, rcpt_to) in [
        (
            json!("a@x.example"),
            json!(["evil@z.example\r\nRCPT TO:<x@y.example>"]),
        ),
        (json!("a@x.example\r\nRSET"), json!(["r@y.example"])),
        (json!("a@x.example"), json!([])),
        (json!(null), json!(["r@y.example"])),
    ] {
        let mut row = serde_json::from_str::<serde_json::Value>(&advance(42, "pending")).unwrap();
        row[0]["rewritten"] = json!(true);
        row[0]["mail_from"] = mail_from.clone();
        row[0]["rcpt_to"] = rcpt_to.clone();
        let err = w
            .query(sql::WRITE_OUTCOMES, &[&row.to_string()])
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PARAMETER_VALUE),
            "{mail_from} {rcpt_to}: {err}"
        );
    }
    assert_eq!(
        w.query(sql::WRITE_OUTCOMES, &[&advance(42, "pending")])
            .unwrap()
            .len(),
        1,
        "the worker advances the row it holds"
    );
    assert_eq!(
        row_at(&mut owner, running),
        Some(("t".into(), "pending".into()))
    );
}

/// Runs `workqueue_inject` as `c` and returns the error's SQLSTATE, or `None` when it
/// injected.
fn inject_as(
    c: &mut Client,
    stage: &str,
    from: &str,
    to: &[&str],
    state: serde_json::Value,
) -> Option<SqlState> {
    let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
    c.query_one(
        sql::INJECT,
        &[
            &stage,
            &from,
            &to,
            &b"Subject: hi\r\n".to_vec(),
            &b"Hello.\r\n".to_vec(),
            &None::<&str>,
            &None::<&str>,
            &None::<&str>,
            &Some("hi"),
            &state.to_string(),
        ],
    )
    .err()
    .map(|e| e.code().cloned().expect("a database error"))
}

/// Runs `workqueue_inject_many` (`pepsi-ingress`'s group commit) as `c` with two
/// messages, a clean one from `a@x.example` and then the one given, and returns the
/// error's SQLSTATE, or `None` when it injected both. Either both are queued or
/// neither.
fn inject_many_as(
    c: &mut Client,
    stage: &str,
    from: &str,
    to: &[&str],
    state: serde_json::Value,
) -> Option<SqlState> {
    let senders = vec!["a@x.example".to_string(), from.to_string()];
    let rcpts = vec![json!(["r@y.example"]).to_string(), json!(to).to_string()];
    let headers = vec![b"Subject: hi\r\n".to_vec(); 2];
    let bodies = vec![b"Hello.\r\n".to_vec(); 2];
    let none = vec![None::<String>; 2];
    let subjects = vec![Some("hi".to_string()); 2];
    let states = vec!["{}".to_string(), state.to_string()];
    match c.query(
        sql::INJECT_MANY,
        &[
            &stage, &senders, &rcpts, &headers, &bodies, &none, &none, &none, &subjects, &states,
        ],
    ) {
        Ok(rows) => {
            let positions: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            assert_eq!(positions, [1, 2], "one id per message, in order");
            None
        }
        Err(e) => Some(e.code().cloned().expect("a database error")),
    }
}

#[test]
fn an_injector_injects_only_into_entry_stages_clean_envelopes_without_reserved_state() {
    let db = TestDb::new();
    let mut owner = db.client();
    let entries = vec!["in".to_string()];
    owner.execute(sql::SET_INJECT_STAGES, &[&entries]).unwrap();
    let mut i = db.client_as(&inject_login());
    let ok = json!({"dsn": {"ret": "HDRS"}, "list_copy": true, "spam": false});
    assert_eq!(
        inject_as(&mut i, "in", "a@x.example", &["r@y.example"], ok.clone()),
        None
    );
    assert_eq!(
        inject_as(&mut i, "in", "", &["r@y.example"], json!({})),
        None,
        "the null sender"
    );
    let before = queue_len(&mut owner);
    assert_eq!(inject_many_as(&mut i, "in", "", &["r@y.example"], ok), None);
    assert_eq!(
        queue_len(&mut owner),
        before + 2,
        "both messages of the call"
    );
    let before = before + 2;
    let long = format!("{}@y.example", "l".repeat(250));
    for (stage, from, to, state, code) in [
        (
            "deliver",
            "a@x.example",
            vec!["r@y.example"],
            json!({}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "bounce",
            "a@x.example",
            vec!["r@y.example"],
            json!({}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "in",
            "a@x>, <evil@y.example",
            vec!["r@y.example"],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example\u{202e}"],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example\r\nBcc: v@z.example"],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r\u{2028}@y.example"],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec![long.as_str()],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec!["root"],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec![],
            json!({}),
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example"],
            json!({"strikes": 2}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example"],
            json!({"failure_class": "permanent"}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example"],
            json!({"dsn_created": "2999-01-01T00:00:00Z"}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example"],
            json!({"local_origin": true}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
        (
            "in",
            "a@x.example",
            vec!["r@y.example"],
            json!({"recipient_outcomes": {"stage": "relay", "rcpt": {}}}),
            SqlState::INSUFFICIENT_PRIVILEGE,
        ),
    ] {
        assert_eq!(
            inject_as(&mut i, stage, from, &to, state.clone()),
            Some(code.clone()),
            "{stage} {from:?} {to:?} {state}"
        );
        // The group commit holds every message to the same checks, and one refused
        // message refuses the call: the clean one beside it is not written either.
        assert_eq!(
            inject_many_as(&mut i, stage, from, &to, state.clone()),
            Some(code.clone()),
            "many: {stage} {from:?} {to:?} {state}"
        );
    }
    assert_eq!(queue_len(&mut owner), before, "nothing refused was written");
    // The administrators' role injects anywhere, with any state.
    let mut a = db.client_as(&admin_login());
    assert_eq!(
        inject_as(
            &mut a,
            "deliver",
            "a@x.example",
            &["r@y.example"],
            json!({"local_origin": true})
        ),
        None
    );
    assert_eq!(
        inject_many_as(
            &mut a,
            "deliver",
            "a@x.example",
            &["r@y.example"],
            json!({"local_origin": true})
        ),
        None
    );
    // Clean addresses bind every caller.
    assert_eq!(
        inject_as(
            &mut a,
            "deliver",
            "a@x.example",
            &["r@y.example\u{202e}"],
            json!({})
        ),
        Some(SqlState::INVALID_PARAMETER_VALUE)
    );
    assert_eq!(
        inject_many_as(
            &mut a,
            "deliver",
            "a@x.example",
            &["r@y.example\u{202e}"],
            json!({})
        ),
        Some(SqlState::INVALID_PARAMETER_VALUE)
    );
}

#[test]
fn the_entry_stages_are_written_by_pepsi_setup_and_by_the_dispatcher() {
    let db = TestDb::new();
    let dir = TempDir::new("contain-entries");
    let stages = "[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n\
                  [stage-in]\nPROGRAM = {pass}\nNEXT = out\n\n[stage-side]\nPROGRAM = {discard}\n\n\
                  [stage-out]\nPROGRAM = {discard}\n\n[stage-bounce]\nPROGRAM = {discard}\n";
    let conf = conf(&dir, &db, "", stages);
    let mut c = db.client();
    let entries = |c: &mut Client| -> Vec<String> {
        c.query("SELECT stage FROM pepsi.inject_stages ORDER BY 1", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let out = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(entries(&mut c), ["in", "side"]);
    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("RUN_AS = root\n", "RUN_AS = root\nINJECT_STAGES = out\n");
    std::fs::write(&conf, text).unwrap();
    let mut d = Dispatcher::start(&conf, &[]);
    wait_until(
        Duration::from_secs(20),
        "the dispatcher writes them",
        || entries(&mut c) == ["out"],
    );
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn the_database_and_the_programs_judge_mailboxes_alike() {
    let db = TestDb::new();
    let mut c = db.client();
    let long = format!("{}@y.example", "l".repeat(245));
    let longer = format!("{}@y.example", "l".repeat(247));
    let label = format!("a@{}.example", "d".repeat(64));
    for address in [
        "a@x.example",
        "a.b+c@x.example",
        "\"a b\"@x.example",
        "\"a\\\"b\"@x.example",
        "\"\"@x.example",
        "\"a@b\"@x.example",
        "jörg@münchen.example",
        "a@localhost",
        "a@[192.0.2.1]",
        "a@[256.0.2.1]",
        "a@[IPv6:2001:db8::1]",
        "a@[ipv6:2001:db8::1]",
        "a@[x]",
        "a@x..example",
        "a@-x.example",
        "a@x-.example",
        ".a@x.example",
        "a.@x.example",
        "a..b@x.example",
        "a@x>, <evil@y",
        "a b@x.example",
        "a@",
        "@x.example",
        "root",
        "a@x.example\r\n",
        "a\u{1b}@x.example",
        "a@x\u{202e}.example",
        "\"a\u{2028}\"@x.example",
        "a\u{85}@x.example",
        "a\u{200b}@x.example",
        long.as_str(),
        longer.as_str(),
        label.as_str(),
    ] {
        let ours = pepsi::mailbox::check(address).is_ok();
        let theirs: bool = c
            .query_one("SELECT pepsi.mailbox_problem($1) IS NULL", &[&address])
            .unwrap()
            .get(0);
        assert_eq!(
            ours, theirs,
            "{address:?}: the program says {ours}, the database {theirs}"
        );
    }
}

#[test]
fn an_exec_command_runs_as_its_user_without_the_workers_environment_descriptors_or_database() {
    if !is_root() {
        eprintln!("not root: no account to switch to; nothing to check");
        return;
    }
    let db = TestDb::new();
    let dir = TempDir::new("contain-exec");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.path("out");
    shared_dir(&out);
    let psql = crate::util::pg::psql();
    let host = db
        .connection()
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("host="))
        .expect("the test database is reached through a socket")
        .to_string();
    let roles = [
        "postgres".to_string(),
        worker_login(),
        admin_login(),
        inject_login(),
    ];
    let tries = roles
        .iter()
        .map(|role| {
            format!(
                "{} -X -w -h {host} -U {role} -d postgres -c 'SELECT 1' >/dev/null 2>&1 && echo {role} >> {}/connected\n",
                psql.display(),
                out.display()
            )
        })
        .collect::<String>();
    let command = script(
        &dir,
        "command",
        &format!(
            "#!/bin/sh\ncat >/dev/null\nid -u > {o}/uid\nenv > {o}/env\n\
             cat {conf} > {o}/config 2>/dev/null\n{tries}\
             setsid sleep 300 </dev/null >/dev/null 2>&1 &\necho $! > {o}/detached\n\
             echo $$ > {o}/pid\nexec sleep 2\n",
            o = out.display(),
            conf = dir.path("pepsi.conf").display(),
        ),
    );
    // The file is RUN_AS's to read, nobody else's.
    let conf = crate::util::scenario::switched_accounts(&dir, &db, &command);
    // What the command tries must work for an account the database admits: RUN_AS.
    let control = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&psql)
        .args([
            "-X", "-w", "-h", &host, "-U", "postgres", "-d", "postgres", "-c", "SELECT 1",
        ])
        .output()
        .unwrap();
    assert!(control.status.success(), "{}", stderr(&control));

    let mut c = db.client();
    let id = crate::util::inject(&mut c, "e", "a@x.example", &["r@y.example"]);
    let mut d = Dispatcher::start(&conf, &[]);
    // The file exists once the shell opened it, its number a moment later.
    let pid_written = || {
        std::fs::read_to_string(out.join("pid"))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
    };
    wait_until(Duration::from_secs(30), "the command runs", || {
        pid_written().is_some()
    });
    let command_pid = pid_written().unwrap();
    // Its descriptors once it is the `sleep` it execs (the shell before it holds its
    // script open): the three and the read end of its own recipients' pipe, nothing of
    // the worker's or the keeper's.
    wait_until(Duration::from_secs(10), "the command execs sleep", || {
        std::fs::read_to_string(format!("/proc/{command_pid}/comm"))
            .is_ok_and(|c| c.trim_end() == "sleep")
    });
    let fds = || {
        let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{command_pid}/fd"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        fds.sort();
        fds
    };
    // The new name shows a moment before the kernel has closed the shell's
    // close-on-exec descriptors (its script): a busy machine can be caught in between.
    let want = ["0", "1", "2", "3"];
    let settled = Instant::now() + Duration::from_secs(5);
    while fds() != want && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(fds(), want);
    let recipients = std::fs::read_link(format!("/proc/{command_pid}/fd/3")).unwrap();
    assert!(
        recipients.to_string_lossy().starts_with("pipe:"),
        "{recipients:?}"
    );
    let fdinfo = std::fs::read_to_string(format!("/proc/{command_pid}/fdinfo/3")).unwrap();
    let flags = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
        .unwrap();
    assert_eq!(flags & 3, 0, "read only: {fdinfo}");
    let worker = d.children()[0];
    let worker_uid = std::fs::read_to_string(format!("/proc/{worker}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Uid:")
                .map(|u| u.split_whitespace().next().unwrap().to_string())
        })
        .unwrap();
    wait_until(Duration::from_secs(30), "the message is done", || {
        row_at(&mut c, id).is_none()
    });
    assert!(d.terminate().success(), "{}", d.log());

    let uid = std::fs::read_to_string(out.join("uid")).unwrap();
    assert_eq!(uid.trim(), "1", "daemon's");
    assert_eq!(
        worker_uid,
        crate::util::accounts::uid_of(&crate::util::accounts::worker_account()).to_string(),
        "the worker runs as WORKER_AS"
    );
    let env = std::fs::read_to_string(out.join("env")).unwrap();
    for gone in [
        "PEPSI_CONFIG",
        "PGAPPNAME",
        "PEPSI_WORKER_STAGE",
        "PEPSI_KEEPER_FD",
        "USER=",
        "LOGNAME=",
    ] {
        assert!(!env.lines().any(|l| l.starts_with(gone)), "{gone}: {env}");
    }
    assert!(env.contains(&format!("PEPSI_ID={id}\n")), "{env}");
    assert!(env.contains("PEPSI_RECIPIENTS_FD=3\n"), "{env}");
    assert!(env.contains("HOME=/usr/sbin\n"), "{env}");
    let config = std::fs::read_to_string(out.join("config")).unwrap_or_default();
    assert!(
        config.is_empty(),
        "the command read the configuration: {config}"
    );
    assert!(
        !out.join("connected").exists(),
        "the command reached the database as {}",
        std::fs::read_to_string(out.join("connected")).unwrap_or_default()
    );
    // What it detached is gone with it.
    let detached: u32 = std::fs::read_to_string(out.join("detached"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the detached process is gone",
        || !Path::new(&format!("/proc/{detached}")).exists(),
    );
    let _ = stage("exec");
}
