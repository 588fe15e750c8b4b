//! The worker runtime and the built-in stages, driven over stdin/stdout as the
//! dispatcher drives them, with the rows checked in PostgreSQL.

use std::path::PathBuf;
use std::time::Duration;

use pepsi::protocol::{SESSION_NAME_ENV, WORKER_STAGE_ENV, session_pattern, worker_session_name};
use postgres::Client;

use crate::util::Scenario;
use crate::util::scenario::{Builder, add_to_pepsi, programs};
use crate::util::worker::{Worker, code, report_stages};
use crate::util::{
    TempDir, TestDb, assert_has, claim, due_in_secs, inject, inject_claimed, row_at, stage,
    state_of, wait_until, write_config,
};

/// `[pepsi] ALLOW_FUSION = yes` or `no`.
fn allow_fusion(fusion: bool) -> &'static str {
    if fusion {
        "ALLOW_FUSION = yes\n"
    } else {
        "ALLOW_FUSION = no\n"
    }
}

/// A scenario with `[pepsi] ALLOW_FUSION` and the given stage sections; `{pass}`, `{if}`,
/// `{discard}`, `{exec}` stand for the stage programs.
fn scenario(tag: &str, fusion: bool, stages: &str) -> Builder {
    Scenario::new(tag)
        .pepsi(allow_fusion(fusion))
        .stages(stages)
}

/// The same configuration for a database and directory of the caller's.
fn config(dir: &TempDir, db: &TestDb, fusion: bool, stages: &str) -> PathBuf {
    let conf = write_config(dir, db, &programs(stages));
    add_to_pepsi(&conf, allow_fusion(fusion));
    conf
}

const CHAIN: &str = "[stage-pass]\nPROGRAM = {pass}\nNEXT = if\n\n\
                     [stage-if]\nPROGRAM = {if}\nMATCH = sender-domain is match.example\nNEXT = discard\nELSE_STAGE = hold\n\n\
                     [stage-discard]\nPROGRAM = {discard}\n\n\
                     [stage-hold]\nPROGRAM = {exec}\nCOMMAND = /bin/true\n";

/// Records every UPDATE and DELETE of a workqueue row, so a test can see which
/// intermediate states were committed.
fn audit(c: &mut Client) {
    c.batch_execute(
        "CREATE TABLE audit (n serial, id bigint, op text, stage text, status text);
         CREATE FUNCTION audit_row() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_catalog AS $$
         BEGIN
           IF TG_OP = 'DELETE' THEN
             INSERT INTO audit (id, op, stage, status) VALUES (OLD.workqueue_id, 'delete', OLD.stage, OLD.status);
           ELSE
             INSERT INTO audit (id, op, stage, status) VALUES (NEW.workqueue_id, 'update', NEW.stage, NEW.status);
           END IF;
           RETURN NULL;
         END $$;
         CREATE TRIGGER audit AFTER UPDATE OR DELETE ON pepsi.workqueue FOR EACH ROW EXECUTE FUNCTION audit_row();",
    )
    .unwrap();
}

fn audit_of(c: &mut Client, id: i64) -> Vec<String> {
    c.query(
        "SELECT op, stage, status FROM audit WHERE id = $1 ORDER BY n",
        &[&id],
    )
    .unwrap()
    .iter()
    .map(|r| {
        format!(
            "{} {} {}",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2)
        )
    })
    .collect()
}

#[test]
fn ready_first_answers_in_order_and_eof_exits_0() {
    let (s, mut c) = scenario("w-order", false, CHAIN).connect();
    let ids: Vec<i64> = (0..6)
        .map(|_| inject(&mut c, "pass", "a@x.example", &["r@y.example"]))
        .collect();
    claim(&mut c, &ids);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    // Unknown and not-running ids are answered too, in their place.
    let mut sent = ids.clone();
    sent.insert(2, 999_999);
    let lines = w.run(&sent);
    assert_eq!(lines.len(), 7);
    for line in &lines {
        assert_eq!(code(line), 0, "{line}");
    }
    for (line, id) in lines.iter().zip(&sent) {
        if *id != 999_999 {
            assert_eq!(report_stages(line), vec!["pass"], "{line}");
        }
    }
    for id in &ids {
        assert_eq!(row_at(&mut c, *id), Some(("if".into(), "pending".into())));
    }
    let (status, err) = w.finish();
    assert!(status.success(), "{status:?} {err}");
}

#[test]
fn a_wrong_schema_version_exits_78_before_ready() {
    let s = scenario("w-schema", true, CHAIN).build();
    s.client()
        .execute("UPDATE pepsi.schema_version SET version = version + 1", &[])
        .unwrap();
    let mut w = Worker::start(&stage("pass"), &s.conf);
    assert_eq!(w.next_line(), None, "no ready line");
    let (status, err) = w.finish();
    assert_eq!(status.code(), Some(78), "{err}");
    assert!(err.contains("newer"), "{err}");
}

#[test]
fn an_unparsable_stage_section_exits_78_with_its_cause() {
    let s = scenario(
        "w-badmatch",
        true,
        "[stage-if]\nPROGRAM = {if}\nMATCH = colour is red\nNEXT = if\nELSE_STAGE = if\n",
    )
    .build();
    let mut w = Worker::start(&stage("if"), &s.conf);
    assert_eq!(w.next_line(), None);
    let (status, err) = w.finish();
    assert_eq!(status.code(), Some(78), "{err}");
    assert_has!(err, "[stage-if] MATCH: unknown field \"colour\"");
    assert_has!(err, &format!("{}:", s.conf.display()), "names the file");
}

#[test]
fn a_fused_chain_is_one_terminal_write_with_a_report_of_every_stage() {
    let (s, mut c) = scenario("w-fused", true, CHAIN).connect();
    audit(&mut c);
    let matched = inject(&mut c, "pass", "a@match.example", &["r@y.example"]);
    let other = inject(&mut c, "pass", "a@other.example", &["r@y.example"]);
    claim(&mut c, &[matched, other]);
    c.execute("DELETE FROM audit", &[]).unwrap();
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[matched, other]);
    assert_eq!(code(&lines[0]), 0);
    assert_eq!(
        report_stages(&lines[0]),
        vec!["pass", "if", "discard"],
        "{}",
        lines[0]
    );
    assert_eq!(row_at(&mut c, matched), None, "discarded");
    assert_eq!(
        audit_of(&mut c, matched),
        vec!["delete pass running"],
        "no intermediate state was committed"
    );
    // The other routes to ELSE_STAGE; exec is not fusable, so the chain stops there.
    assert_eq!(report_stages(&lines[1]), vec!["pass", "if"]);
    assert_eq!(
        row_at(&mut c, other),
        Some(("hold".into(), "pending".into()))
    );
    assert_eq!(audit_of(&mut c, other), vec!["update hold pending"]);
}

#[test]
fn without_fusion_each_hop_is_committed() {
    let (s, mut c) = scenario("w-unfused", false, CHAIN).connect();
    audit(&mut c);
    let id = inject(&mut c, "pass", "a@match.example", &["r@y.example"]);
    for (program, next) in [
        ("pass", Some("if")),
        ("if", Some("discard")),
        ("discard", None),
    ] {
        claim(&mut c, &[id]);
        let mut w = Worker::ready(&stage(program), &s.conf);
        let lines = w.run(&[id]);
        assert_eq!(report_stages(&lines[0]), vec![program]);
        assert_eq!(
            row_at(&mut c, id),
            next.map(|n| (n.to_string(), "pending".to_string()))
        );
    }
    assert_eq!(
        audit_of(&mut c, id),
        vec![
            "update pass running",
            "update if pending",
            "update if running",
            "update discard pending",
            "update discard running",
            "delete discard running",
        ]
    );
}

#[test]
fn fusion_off_for_a_successor_section_commits_the_hop() {
    let (s, mut c) = scenario(
        "w-fusionkey",
        true,
        &CHAIN.replace("[stage-if]\n", "[stage-if]\nFUSION = no\n"),
    )
    .connect();
    let id = inject_claimed(&mut c, "pass", "a@match.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[id]);
    assert_eq!(report_stages(&lines[0]), vec!["pass"]);
    assert_eq!(row_at(&mut c, id), Some(("if".into(), "pending".into())));
}

/// Calls of statements matching `pattern` in this database, from pg_stat_statements.
fn statement_calls(c: &mut Client, pattern: &str) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = current_database() AND s.query LIKE $1",
        &[&pattern],
    )
    .expect("pg_stat_statements must be loaded (the throwaway test cluster preloads it)")
    .get(0)
}

#[test]
fn a_metadata_stage_loads_a_buffered_batch_with_one_select_and_one_write() {
    let (s, mut c) = scenario(
        "w-batch",
        false,
        &CHAIN.replace("NEXT = if\n", "NEXT = if\nQUEUE_LIMIT = 16\n"),
    )
    .connect();
    let ids: Vec<i64> = (0..4)
        .map(|_| inject(&mut c, "pass", "a@x.example", &["r@y.example"]))
        .collect();
    claim(&mut c, &ids);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let selects_before = statement_calls(
        &mut c,
        "%FROM pepsi.workqueue q WHERE q.workqueue_id = ANY%",
    );
    let lines = w.run(&ids);
    assert!(lines.iter().all(|l| code(l) == 0));
    assert_eq!(
        statement_calls(
            &mut c,
            "%FROM pepsi.workqueue q WHERE q.workqueue_id = ANY%"
        ) - selects_before,
        1,
        "4 buffered ids, one SELECT"
    );
    assert_eq!(
        statement_calls(&mut c, "SELECT w FROM pepsi.workqueue_write(%"),
        1,
        "and one write"
    );
    for id in &ids {
        assert_eq!(row_at(&mut c, *id), Some(("if".into(), "pending".into())));
    }
}

/// An exec stage whose command is a script steered by a control file.
struct ExecSetup {
    _dir: TempDir,
    conf: PathBuf,
    control: PathBuf,
    out: PathBuf,
}

impl ExecSetup {
    /// Makes the command take 2 s (within the stage's TIMEOUT of 5 s), so a test can
    /// act while it runs.
    fn slow_down(&self) {
        self.before_exit("sleep 2");
    }

    /// Makes the command run `shell` just before it exits.
    fn before_exit(&self, shell: &str) {
        let script = self.conf.parent().unwrap().join("deliver.sh");
        let text = std::fs::read_to_string(&script).unwrap();
        std::fs::write(
            &script,
            text.replace("exit $mode", &format!("{shell}; exit $mode")),
        )
        .unwrap();
    }

    /// Waits until the command runs for message `id` (it has written the envelope).
    fn wait_running(&self, id: i64) {
        let env = self.out.join(format!("{id}.env"));
        wait_until(Duration::from_secs(10), "the command runs", || env.exists());
    }
}

fn exec_setup(db: &TestDb, extra: &str) -> ExecSetup {
    let dir = TempDir::new("w-exec");
    let out = dir.path("out");
    crate::util::shared_dir(&out);
    let control = dir.path("control");
    std::fs::write(&control, "0").unwrap();
    let script = dir.write(
        "deliver.sh",
        &format!(
            "#!/bin/sh\nmode=$(cat {control})\ncat > {out}/$PEPSI_ID\n\
             echo \"$PEPSI_STAGE|$PEPSI_SENDER|$PEPSI_RECIPIENTS|$PEPSI_SENDER_KEY\" > {out}/$PEPSI_ID.env\n\
             echo \"complaint about $PEPSI_ID\" >&2\n\
             if [ \"$mode\" = hang ]; then sleep 30; fi\nexit $mode\n",
            control = control.display(),
            out = out.display()
        ),
    );
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .unwrap();
    let conf = config(
        &dir,
        db,
        true,
        &format!(
            "[stage-deliver]\nPROGRAM = {{exec}}\nCOMMAND = {}\nTIMEOUT = 5s\nNEXT = done\n{extra}\n\n\
             [stage-done]\nPROGRAM = {{discard}}\n\n[stage-bounce]\nPROGRAM = {{discard}}\n",
            script.display()
        ),
    );
    ExecSetup {
        _dir: dir,
        conf,
        control,
        out,
    }
}

#[test]
fn exec_exit_0_advances_with_the_message_on_stdin_and_the_envelope_in_the_environment() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    let mut c = db.client();
    let id = inject(
        &mut c,
        "deliver",
        "a@x.example",
        &["r1@y.example", "r2@y.example"],
    );
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    let line = &w.run(&[id])[0];
    assert_eq!(code(line), 0);
    // `done` is a discard stage: fusable, so the same pass finishes the message.
    assert_eq!(report_stages(line), vec!["deliver", "done"]);
    assert_eq!(row_at(&mut c, id), None);
    let text = std::fs::read_to_string(s.out.join(id.to_string())).unwrap();
    assert_eq!(text, "Subject: test\r\nFrom: <a@b>\r\n\r\nHello.\r\n");
    let env = std::fs::read_to_string(s.out.join(format!("{id}.env"))).unwrap();
    assert_eq!(
        env.trim(),
        "deliver|a@x.example|r1@y.example,r2@y.example|from:x.example"
    );
}

#[test]
fn exec_exit_65_fails_the_message_permanently() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    std::fs::write(&s.control, "65").unwrap();
    let mut c = db.client();
    let id = inject_claimed(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    let line = &w.run(&[id])[0];
    assert_ne!(code(line), 0, "a failed row is answered non-zero");
    assert_eq!(
        row_at(&mut c, id),
        Some(("deliver".into(), "failed".into()))
    );
    let st = state_of(&mut c, id);
    assert_eq!(st["failure_class"], "permanent");
    assert_eq!(st["failed_stage"], "deliver");
    assert_has!(
        st["last_error"].as_str().unwrap(),
        &format!("complaint about {id}"),
        "{st}"
    );
}

#[test]
fn a_nul_byte_in_the_commands_stderr_still_fails_the_message_permanently() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    s.before_exit("printf 'bad\\000byte' >&2");
    std::fs::write(&s.control, "65").unwrap();
    let mut c = db.client();
    let id = inject_claimed(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 65);
    assert_eq!(
        row_at(&mut c, id),
        Some(("deliver".into(), "failed".into()))
    );
    let st = state_of(&mut c, id);
    assert!(
        st["last_error"]
            .as_str()
            .unwrap()
            .ends_with("bad\u{FFFD}byte"),
        "{st}"
    );
}

#[test]
fn a_row_with_a_null_recipient_fails_alone_and_its_batch_is_answered() {
    let (s, mut c) = scenario(
        "w-nullrcpt",
        false,
        "[stage-p]\nPROGRAM = {pass}\nNEXT = q\n\n[stage-q]\nPROGRAM = {discard}\n",
    )
    .connect();
    let good = inject_claimed(&mut c, "p", "a@x.example", &["r@y.example"]);
    let bad = inject_claimed(&mut c, "p", "a@x.example", &["r@y.example"]);
    // The schema refuses such a row; a database changed by hand may still hold one.
    c.batch_execute("ALTER TABLE pepsi.workqueue DROP CONSTRAINT workqueue_rcpt_to_check")
        .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET rcpt_to = ARRAY['r@y.example', NULL] WHERE workqueue_id = $1",
        &[&bad],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET state = state || '{\"strikes\": 1}' WHERE workqueue_id = $1",
        &[&bad],
    )
    .unwrap();
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[good, bad]);
    assert_eq!(code(&lines[0]), 0);
    assert_eq!(code(&lines[1]), 65);
    assert_eq!(row_at(&mut c, good), Some(("q".into(), "pending".into())));
    assert_eq!(row_at(&mut c, bad), Some(("p".into(), "failed".into())));
    let st = state_of(&mut c, bad);
    assert_eq!(st["failure_class"], "permanent");
    assert_eq!(st["strikes"], 1, "the row's state is kept: {st}");
    assert_has!(st["last_error"].as_str().unwrap(), "rcpt_to", "{st}");
}

#[test]
fn exec_tempfail_and_hangs_pause_with_backoff_1_2_4_minutes() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    let mut c = db.client();
    let id = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    for (attempt, mode, minutes) in [(1, "75", 1.0), (2, "hang", 2.0), (3, "1", 4.0)] {
        std::fs::write(&s.control, mode).unwrap();
        claim(&mut c, &[id]);
        let line = &w.run(&[id])[0];
        assert_eq!(code(line), 0, "a host error is answered 0 ({mode})");
        assert_eq!(
            row_at(&mut c, id),
            Some(("deliver".into(), "paused".into()))
        );
        let due = due_in_secs(&mut c, id);
        assert!(
            (due - minutes * 60.0).abs() < 20.0,
            "attempt {attempt} ({mode}): due in {due}s"
        );
        let st = state_of(&mut c, id);
        assert_eq!(st["temporary_failures"], attempt);
        assert_eq!(st["temporary_stage"], "deliver");
        if mode == "hang" {
            assert_has!(
                st["last_error"].as_str().unwrap(),
                "timed out after 5s",
                "{st}"
            );
        }
        c.execute(
            "UPDATE pepsi.workqueue SET status = 'pending', timeout = NULL WHERE workqueue_id = $1",
            &[&id],
        )
        .unwrap();
    }
}

#[test]
fn past_max_lifetime_a_host_error_moves_to_the_bounce_stage_or_fails() {
    let db = TestDb::new();
    let s = exec_setup(&db, "MAX_LIFETIME = 1h\nBOUNCE_STAGE = bounce");
    std::fs::write(&s.control, "75").unwrap();
    let mut c = db.client();
    let old = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let young = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let list = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '2 hours' WHERE workqueue_id = ANY ($1)",
        &[&vec![old, list]],
    )
    .unwrap();
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{\"list_copy\": true}' WHERE workqueue_id = $1",
        &[&list],
    )
    .unwrap();
    claim(&mut c, &[old, young, list]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    let lines = w.run(&[old, young, list]);
    assert_eq!(code(&lines[0]), 0);
    assert_eq!(
        row_at(&mut c, old),
        Some(("bounce".into(), "pending".into()))
    );
    let st = state_of(&mut c, old);
    assert_eq!(st["failure_class"], "retries-exhausted");
    assert_eq!(st["failed_stage"], "deliver");
    assert_eq!(
        row_at(&mut c, young),
        Some(("deliver".into(), "paused".into()))
    );
    assert_ne!(code(&lines[2]), 0, "a list copy is never bounced: it fails");
    assert_eq!(
        row_at(&mut c, list),
        Some(("deliver".into(), "failed".into()))
    );
    assert_eq!(state_of(&mut c, list)["failure_class"], "retries-exhausted");
}

#[test]
fn past_max_lifetime_without_a_bounce_stage_the_message_fails() {
    let db = TestDb::new();
    let s = exec_setup(&db, "MAX_LIFETIME = 1h");
    std::fs::write(&s.control, "hang").unwrap();
    let mut c = db.client();
    let id = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '2 hours' WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    assert_ne!(code(&w.run(&[id])[0]), 0);
    assert_eq!(
        row_at(&mut c, id),
        Some(("deliver".into(), "failed".into()))
    );
    let st = state_of(&mut c, id);
    assert_eq!(st["failure_class"], "retries-exhausted");
    assert_has!(st["last_error"].as_str().unwrap(), "timed out", "{st}");
}

/// Terminates the sessions of a worker in this database, found by their name as the
/// dispatcher finds them: the worker's pid and stage.
fn terminate(c: &mut Client, w: &Worker, stage: &str) -> i64 {
    c.query_one(
        "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1",
        &[&worker_session_name(w.pid(), stage)],
    )
    .unwrap()
    .get(0)
}

#[test]
fn a_connection_lost_mid_message_answers_74_and_commits_nothing() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    let mut c = db.client();
    let a = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    let b = inject(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    claim(&mut c, &[a, b]);
    s.slow_down();
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    w.send(&[a]);
    // The command runs; meanwhile the database drops the worker's connection.
    s.wait_running(a);
    // Started without PEPSI_WORKER_STAGE, a worker names its sessions after its built-in.
    assert_eq!(terminate(&mut c, &w, "exec"), 1);
    assert_eq!(code(&w.status()), 74);
    assert_eq!(
        row_at(&mut c, a),
        Some(("deliver".into(), "running".into())),
        "nothing committed"
    );
    // The next message gets a fresh connection.
    assert_eq!(code(&w.run(&[b])[0]), 0);
    assert_eq!(row_at(&mut c, b), None, "delivered and fused into done");
}

#[test]
fn a_connection_that_died_while_idle_is_replaced_before_the_next_message() {
    let (s, mut c) = scenario("w-idlekill", false, CHAIN).connect();
    let a = inject_claimed(&mut c, "pass", "a@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    // As after a database restart: the pooled connection is gone before any work.
    assert_eq!(terminate(&mut c, &w, "pass"), 1);
    assert_eq!(code(&w.run(&[a])[0]), 0);
    assert_eq!(row_at(&mut c, a), Some(("if".into(), "pending".into())));
}

const ROUTE: &str = "[stage-route]\nPROGRAM = {if}\nMATCH = sender-domain is nowhere.example\nNEXT = a\nELSE_STAGE = b\n\n\
                     [stage-a]\nPROGRAM = {exec}\nCOMMAND = /bin/true\n\n\
                     [stage-b]\nPROGRAM = {exec}\nCOMMAND = /bin/true\n";

#[test]
fn diverging_per_address_settings_split_the_message_and_each_part_runs_with_its_own() {
    let (s, mut c) = scenario("w-split", true, ROUTE).connect();
    c.execute(
        "INSERT INTO pepsi.settings VALUES ('r2@y.example', 'route', 'MATCH', 'sender-domain is x.example')",
        &[],
    )
    .unwrap();
    let id = inject(
        &mut c,
        "route",
        "s@x.example",
        &["r1@y.example", "R2@y.example"],
    );
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    assert_eq!(
        row_at(&mut c, id),
        Some(("b".into(), "pending".into())),
        "r1 has no override: ELSE"
    );
    let rows = c
        .query(
            "SELECT workqueue_id, stage, status::text, rcpt_to, body_id FROM pepsi.workqueue ORDER BY workqueue_id",
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].get::<_, Vec<String>>(3), vec!["r1@y.example"]);
    let clone: i64 = rows[1].get(0);
    assert_eq!(rows[1].get::<_, String>(1), "route");
    assert_eq!(rows[1].get::<_, String>(2), "pending");
    assert_eq!(rows[1].get::<_, Vec<String>>(3), vec!["R2@y.example"]);
    assert_eq!(
        rows[0].get::<_, i64>(4),
        rows[1].get::<_, i64>(4),
        "the parts share the body"
    );
    claim(&mut c, &[clone]);
    assert_eq!(code(&w.run(&[clone])[0]), 0);
    assert_eq!(
        row_at(&mut c, clone),
        Some(("a".into(), "pending".into())),
        "r2's override matches"
    );
}

#[test]
fn identical_per_address_settings_do_not_split() {
    let (s, mut c) = scenario("w-nosplit", true, ROUTE).connect();
    c.execute(
        "INSERT INTO pepsi.settings VALUES \
         ('r1@y.example', 'route', 'MATCH', 'sender-domain is x.example'), \
         ('r2@y.example', 'route', 'MATCH', 'sender-domain is x.example')",
        &[],
    )
    .unwrap();
    let id = inject(
        &mut c,
        "route",
        "s@x.example",
        &["r1@y.example", "r2@y.example"],
    );
    claim(&mut c, &[id]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    let n: i64 = c
        .query_one("SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    assert_eq!(row_at(&mut c, id), Some(("a".into(), "pending".into())));
}

#[test]
fn a_per_address_override_that_breaks_the_section_fails_that_message_permanently() {
    let (s, mut c) = scenario("w-badoverride", true, ROUTE).connect();
    c.execute(
        "INSERT INTO pepsi.settings VALUES ('r@y.example', 'route', 'MATCH', 'nonsense')",
        &[],
    )
    .unwrap();
    let id = inject_claimed(&mut c, "route", "s@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_ne!(code(&w.run(&[id])[0]), 0);
    assert_eq!(row_at(&mut c, id), Some(("route".into(), "failed".into())));
    let st = state_of(&mut c, id);
    assert_eq!(st["failure_class"], "permanent");
    assert_has!(
        st["last_error"].as_str().unwrap(),
        "pepsi.settings for r@y.example",
        "{st}"
    );
}

/// How many lines of `text` contain `needle`.
fn lines_with(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn per_address_command_next_program_or_parallelism_rows_change_nothing_and_warn_once() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    let mut c = db.client();
    // Each of these, were it applied, would show: /bin/false pauses the message, the
    // bounce stage or the discard program would never run the delivery script.
    c.execute(
        "INSERT INTO pepsi.settings VALUES \
         ('r@y.example', 'deliver', 'COMMAND', '/bin/false'), \
         ('r@y.example', 'deliver', 'NEXT', 'bounce'), \
         ('r@y.example', 'deliver', 'PROGRAM', $1), \
         ('r@y.example', 'deliver', 'PARALLELISM', '1'), \
         ('r@y.example', 'deliver', 'BOUNCE_STAGE', 'bounce'), \
         ('r@y.example', 'done', 'FUSION', 'no')",
        &[&stage("discard").to_str().unwrap()],
    )
    .unwrap();
    let ids: Vec<i64> = (0..2)
        .map(|_| {
            inject_claimed(
                &mut c,
                "deliver",
                "a@x.example",
                &["R@y.example", "q@y.example"],
            )
        })
        .collect();
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    for id in &ids {
        let line = &w.run(&[*id])[0];
        assert_eq!(code(line), 0, "{line}");
        assert_eq!(
            report_stages(line),
            vec!["deliver", "done"],
            "delivered by the file's command and fused into done: {line}"
        );
        assert_eq!(row_at(&mut c, *id), None);
        assert!(
            s.out.join(id.to_string()).exists(),
            "the file's COMMAND ran for {id}"
        );
    }
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "ignored rows do not split a message either");
    let (status, err) = w.finish();
    assert!(status.success(), "{status:?} {err}");
    for (stage, key) in [
        ("deliver", "COMMAND"),
        ("deliver", "NEXT"),
        ("deliver", "PROGRAM"),
        ("deliver", "PARALLELISM"),
        ("deliver", "BOUNCE_STAGE"),
        ("done", "FUSION"),
    ] {
        let warning = format!(
            "pepsi.settings for r@y.example: [stage-{stage}] {key}: {key} is never overridable per address; ignored"
        );
        assert_eq!(
            lines_with(&err, &warning),
            1,
            "one warning per row and worker, whatever the number of messages: {warning}\n{err}"
        );
    }
}

#[test]
fn an_allowed_per_address_key_applies_and_one_not_declared_by_the_stage_is_ignored() {
    let db = TestDb::new();
    // The command takes 2 s, within the file's TIMEOUT of 5 s.
    let s = exec_setup(&db, "");
    s.slow_down();
    let mut c = db.client();
    c.execute(
        "INSERT INTO pepsi.settings VALUES \
         ('slow@y.example', 'deliver', 'TIMEOUT', '1s'), \
         ('slow@y.example', 'deliver', 'MATCH', 'sender is nobody'), \
         ('other@y.example', 'deliver', 'BOUNCE_SIZE_LIMIT', '1')",
        &[],
    )
    .unwrap();
    let slow = inject_claimed(&mut c, "deliver", "a@x.example", &["slow@y.example"]);
    let other = inject_claimed(&mut c, "deliver", "a@x.example", &["other@y.example"]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    assert_eq!(code(&w.run(&[slow])[0]), 0);
    assert_eq!(
        row_at(&mut c, slow),
        Some(("deliver".into(), "paused".into())),
        "the per-address TIMEOUT of 1s applies"
    );
    assert_has!(
        state_of(&mut c, slow)["last_error"].as_str().unwrap(),
        "timed out after 1s",
        "{}",
        state_of(&mut c, slow)
    );
    assert_eq!(code(&w.run(&[other])[0]), 0);
    assert_eq!(row_at(&mut c, other), None, "delivered");
    let (_, err) = w.finish();
    assert_eq!(
        lines_with(
            &err,
            "pepsi.settings for slow@y.example: [stage-deliver] MATCH: MATCH is not overridable per address at stage deliver (pepsi-stage-exec allows only MAX_LIFETIME, TIMEOUT); ignored"
        ),
        1,
        "{err}"
    );
    assert_eq!(
        lines_with(
            &err,
            "pepsi.settings for other@y.example: [stage-deliver] BOUNCE_SIZE_LIMIT: BOUNCE_SIZE_LIMIT is not overridable"
        ),
        1,
        "{err}"
    );
    assert!(!err.contains("[stage-deliver] TIMEOUT"), "{err}");
}

#[test]
fn per_address_routing_rows_neither_route_nor_split_a_message_at_an_if_stage() {
    let (s, mut c) = scenario("w-noroute", true, ROUTE).connect();
    // r2 tries to route its mail to a (the NEXT of a match) around the condition.
    c.execute(
        "INSERT INTO pepsi.settings VALUES \
         ('r2@y.example', 'route', 'ELSE_STAGE', 'a'), \
         ('r2@y.example', 'route', 'NEXT', 'b'), \
         ('r2@y.example', 'route', 'PROGRAM', $1)",
        &[&stage("pass").to_str().unwrap()],
    )
    .unwrap();
    let id = inject_claimed(
        &mut c,
        "route",
        "s@x.example",
        &["r1@y.example", "r2@y.example"],
    );
    let mut w = Worker::ready(&stage("if"), &s.conf);
    assert_eq!(code(&w.run(&[id])[0]), 0);
    assert_eq!(
        row_at(&mut c, id),
        Some(("b".into(), "pending".into())),
        "the file's ELSE_STAGE, for both recipients"
    );
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "not split");
    let (_, err) = w.finish();
    for key in ["ELSE_STAGE", "NEXT", "PROGRAM"] {
        assert_eq!(
            lines_with(
                &err,
                &format!(
                    "pepsi.settings for r2@y.example: [stage-route] {key}: {key} is never overridable per address; ignored"
                )
            ),
            1,
            "{err}"
        );
    }
}

#[test]
fn a_row_taken_away_while_the_worker_held_it_is_not_overwritten() {
    let db = TestDb::new();
    let s = exec_setup(&db, "");
    let mut c = db.client();
    let id = inject_claimed(&mut c, "deliver", "a@x.example", &["r@y.example"]);
    // The script sleeps while the row is moved elsewhere by another writer.
    s.slow_down();
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    w.send(&[id]);
    s.wait_running(id);
    c.execute("UPDATE pepsi.workqueue SET stage = 'elsewhere', status = 'pending' WHERE workqueue_id = $1", &[&id])
        .unwrap();
    assert_eq!(code(&w.status()), 0, "a taken-away row is answered 0");
    assert_eq!(
        row_at(&mut c, id),
        Some(("elsewhere".into(), "pending".into()))
    );
}

/// Marks a row running under claim token `token`, as a dispatcher's claim does.
fn claim_with_token(c: &mut Client, id: i64, token: i64) {
    let n = c
        .execute(
            "UPDATE pepsi.workqueue SET status = 'running', claim = $2 WHERE workqueue_id = $1",
            &[&id, &token],
        )
        .unwrap();
    assert_eq!(n, 1, "claim {id}");
}

/// A row's claim token.
fn token_of(c: &mut Client, id: i64) -> i64 {
    c.query_one(
        "SELECT claim FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .get(0)
}

/// Waits until a session of the worker with this pid waits for a lock.
#[track_caller]
fn wait_lock_wait(c: &mut Client, w: &Worker) {
    // The pattern leaves the stage out.
    let pattern = session_pattern(&worker_session_name(w.pid(), "any"));
    wait_until(
        Duration::from_secs(10),
        "the worker's write waits for the row lock",
        || {
            c.query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name LIKE $1 AND wait_event_type = 'Lock'",
                &[&pattern],
            )
            .unwrap()
            .get::<_, i64>(0)
                == 1
        },
    );
}

#[test]
fn a_write_left_over_from_an_earlier_claim_never_lands_on_a_later_claim() {
    // Both write shapes: `pass` advances (the batched UPDATE), `discard` finishes (the
    // batched DELETE).
    for (program, at, written) in [
        ("pass", "p", Some(("q".to_string(), "pending".to_string()))),
        ("discard", "q", None),
    ] {
        let (s, mut c) = scenario(
            "w-token",
            false,
            "[stage-p]\nPROGRAM = {pass}\nNEXT = q\n\n[stage-q]\nPROGRAM = {discard}\n",
        )
        .connect();
        let stale = inject(&mut c, at, "a@x.example", &["r@y.example"]);
        let fresh = inject(&mut c, at, "a@x.example", &["r@y.example"]);
        claim_with_token(&mut c, stale, 5);
        claim_with_token(&mut c, fresh, 5);
        let mut w = Worker::ready(&stage(program), &s.conf);
        // Another session holds the row, so the worker's write waits after its load.
        let mut locker = s.client();
        let mut tx = locker.transaction().unwrap();
        tx.query(
            "SELECT 1 FROM pepsi.workqueue WHERE workqueue_id = $1 FOR UPDATE",
            &[&stale],
        )
        .unwrap();
        w.send(&[stale, fresh]);
        wait_lock_wait(&mut c, &w);
        // Meanwhile the row is released and claimed again, at the same stage.
        tx.execute(
            "UPDATE pepsi.workqueue SET claim = 6, state = state || '{\"marker\": 2}' \
             WHERE workqueue_id = $1",
            &[&stale],
        )
        .unwrap();
        tx.commit().unwrap();
        assert_eq!(
            code(&w.status()),
            0,
            "{program}: a taken-away row is answered 0"
        );
        assert_eq!(
            code(&w.status()),
            0,
            "{program}: the row still under its token"
        );
        assert_eq!(
            row_at(&mut c, stale),
            Some((at.to_string(), "running".to_string())),
            "{program}: the earlier claim's outcome did not land"
        );
        assert_eq!(token_of(&mut c, stale), 6, "{program}");
        assert_eq!(state_of(&mut c, stale)["marker"], 2, "{program}");
        assert_eq!(
            row_at(&mut c, fresh),
            written,
            "{program}: the token read with the row guards its write"
        );
        let (status, err) = w.finish();
        assert!(status.success(), "{program}: {status:?} {err}");
        assert_has!(err, &format!("message {stale} was taken away"), "{program}");
    }
}

/// `conninfo` with its own `application_name`, in its own form (URL or key=value).
fn with_application_name(conninfo: &str, name: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let sep = if conninfo.contains('?') { '&' } else { '?' };
        format!("{conninfo}{sep}application_name={name}")
    } else {
        format!("{conninfo} application_name={name}")
    }
}

#[test]
fn a_worker_names_its_sessions_after_its_pid_and_stage_whatever_connection_says() {
    // The stage a worker is started for has a section: the worker checks it.
    let s = scenario(
        "w-session",
        false,
        &format!("{CHAIN}\n[stage-relay]\nPROGRAM = {{pass}}\nNEXT = discard\n"),
    )
    .build();
    let text = std::fs::read_to_string(&s.conf).unwrap().replacen(
        &format!("CONNECTION = {}", s.db.connection()),
        &format!(
            "CONNECTION = {}",
            with_application_name(s.db.connection(), "custom")
        ),
        1,
    );
    std::fs::write(&s.conf, text).unwrap();
    // The dispatcher names the section a worker serves in its environment.
    let program = s.dir.write(
        "relay-worker",
        &format!(
            "#!/bin/sh\n{WORKER_STAGE_ENV}=relay exec {} \"$@\"\n",
            stage("pass").display()
        ),
    );
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&program)
        .status()
        .unwrap();
    let w = Worker::ready(&program, &s.conf);
    let mut c = s.client();
    let names: Vec<String> = c
        .query(
            "SELECT application_name FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, vec![worker_session_name(w.pid(), "relay")]);
}

#[test]
fn a_worker_names_its_sessions_as_pgappname_says_when_the_dispatcher_set_it() {
    let s = scenario("w-appname", false, CHAIN).build();
    let given = "pepsi-worker:0000beef-7:pass";
    for (value, want) in [
        // As the dispatcher names it.
        (given, None),
        // An operator's own PGAPPNAME is not a worker's name.
        ("psql", Some("pass")),
    ] {
        let program = s.dir.write(
            "named-worker",
            &format!(
                "#!/bin/sh\n{SESSION_NAME_ENV}='{value}' exec {} \"$@\"\n",
                stage("pass").display()
            ),
        );
        std::process::Command::new("chmod")
            .arg("+x")
            .arg(&program)
            .status()
            .unwrap();
        let mut w = Worker::ready(&program, &s.conf);
        let mut c = s.client();
        let others = "SELECT application_name FROM pg_stat_activity \
                      WHERE datname = current_database() AND pid <> pg_backend_pid()";
        let names: Vec<String> = c
            .query(others, &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let expected = match want {
            None => value.to_string(),
            Some(stage) => worker_session_name(w.pid(), stage),
        };
        assert_eq!(names, vec![expected], "PGAPPNAME={value}");
        let (status, err) = w.finish();
        assert!(status.success(), "{status:?} {err}");
        wait_until(Duration::from_secs(10), "the worker's session ends", || {
            c.query(others, &[]).unwrap().is_empty()
        });
    }
}

/// Statements a metadata stage's worker runs for `n` buffered messages.
fn statements_for(queue_limit: u32, n: usize) -> i64 {
    let (s, mut c) = scenario(
        "w-rt",
        false,
        &CHAIN.replace(
            "NEXT = if\n",
            &format!("NEXT = if\nQUEUE_LIMIT = {queue_limit}\n"),
        ),
    )
    .connect();
    let ids: Vec<i64> = (0..n)
        .map(|_| inject(&mut c, "pass", "a@x.example", &["r@y.example"]))
        .collect();
    claim(&mut c, &ids);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let count = |c: &mut Client| {
        statement_calls(c, "%FROM pepsi.workqueue q WHERE q.workqueue_id = ANY%")
            + statement_calls(c, "SELECT w FROM pepsi.workqueue_write(%")
            + statement_calls(c, "SELECT f FROM pepsi.workqueue_done(%")
    };
    let before = count(&mut c);
    assert!(w.run(&ids).iter().all(|l| code(l) == 0));
    count(&mut c) - before
}

#[test]
fn round_trips_per_message_shrink_with_the_queue_limit() {
    let one = statements_for(1, 32);
    let sixteen = statements_for(16, 32);
    eprintln!(
        "metadata stage, 32 messages: QUEUE_LIMIT 1: {one} statements ({:.3}/message); QUEUE_LIMIT 16: {sixteen} statements ({:.3}/message)",
        one as f64 / 32.0,
        sixteen as f64 / 32.0
    );
    assert_eq!(one, 64, "a SELECT and an UPDATE per message");
    assert_eq!(sixteen, 4, "a SELECT and an UPDATE per 16 messages");
}
