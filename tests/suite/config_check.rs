//! Operator-proof configuration (§4 "Strictness"): `pepsi-dispatch check`, a bad
//! built-in section refused at start and at reload but stopping only its own stage's
//! workers, unknown keys and cycles as warnings.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use pepsi::protocol::WORKER_STAGE_ENV;

use crate::util::scenario::{Builder, Scenario, programs};
use crate::util::worker::{Worker, code, report_stages};
use crate::util::{
    TempDir, TestDb, assert_has, assert_lacks, bin, inject_claimed, row_at, run, stage, stderr,
    write_config,
};

/// A scenario with `[pepsi-dispatch] POLL_INTERVAL` and `WORKER_IDLE_TIMEOUT` at 1s;
/// its stages, given with [`Builder::stages`], may write `{pass}`, `{if}`, `{discard}`
/// and `{exec}` for the stage programs.
fn scenario(tag: &str) -> Builder {
    Scenario::new(tag).section("pepsi-dispatch", DISPATCH)
}

/// The `[pepsi-dispatch]` section's body.
const DISPATCH: &str = "POLL_INTERVAL = 1s\nWORKER_IDLE_TIMEOUT = 1s\n";

/// [`scenario`]'s configuration with `stages` as a file for a database and directory of
/// the caller's.
fn config(dir: &TempDir, db: &TestDb, stages: &str) -> PathBuf {
    write_config(
        dir,
        db,
        &format!("[pepsi-dispatch]\n{DISPATCH}\n{}", programs(stages)),
    )
}

/// The 1-based line of the first line of `conf` that starts with `start`.
fn line_of(conf: &Path, start: &str) -> usize {
    std::fs::read_to_string(conf)
        .unwrap()
        .lines()
        .position(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starts with {start:?}"))
        + 1
}

/// `pepsi-dispatch -c conf check ARGS`.
fn check(conf: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-c", conf.to_str().unwrap(), "check"];
    all.extend_from_slice(args);
    run(&bin("pepsi-dispatch"), &all)
}

/// Stdout as text.
fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Both streams, for assertion messages.
fn both(out: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", stdout(out), stderr(out))
}

/// `pepsi-dispatch -c conf serve`, expected to stop at start (killed, failing the
/// test, if it is still running after a while).
fn serve_at_start(conf: &Path) -> Output {
    let mut child = Command::new(bin("pepsi-dispatch"))
        .arg("-c")
        .arg(conf)
        .arg("serve")
        .env_remove("PEPSI_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "pepsi-dispatch serve did not stop at start:\n{}",
                both(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A worker started as the dispatcher starts it (`PEPSI_WORKER_STAGE` names its
/// stage): its first line, then (stdin closed) its exit status and stderr.
fn worker_for(program: &Path, conf: &Path, stage: &str) -> (Option<String>, ExitStatus, String) {
    let mut child = Command::new(program)
        .arg("-c")
        .arg(conf)
        .arg("worker")
        .env_remove("PEPSI_CONFIG")
        .env(WORKER_STAGE_ENV, stage)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    let first = (!first.is_empty()).then(|| first.trim_end().to_string());
    (first, out.status, stderr(&out))
}

const GOOD: &str = "[stage-in]\nPROGRAM = {pass}\nNEXT = filter\n\n\
                    [stage-filter]\nPROGRAM = {if}\nMATCH = sender-domain is bounce.example or state.spam is true\nNEXT = out\nELSE_STAGE = out\n\n\
                    [stage-out]\nPROGRAM = {discard}\n";

#[test]
fn check_passes_a_good_configuration() {
    let s = scenario("c-good").stages(GOOD).build();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "configuration OK (0 warnings)",
        "{}",
        both(&out)
    );
}

#[test]
fn an_incomplete_match_is_refused_by_check_naming_file_line_and_word() {
    let db = TestDb::new();
    let dir = TempDir::new("c-match");
    for (expr, why) in [
        (
            "sender-domain is bounce.example or",
            "ends with a dangling \"or\"",
        ),
        (
            "sender-domain is x garbage",
            "unexpected \"garbage\" after the value \"x\"",
        ),
        (
            "sender is a and sender is b or sender is c",
            "mixes \"and\" and \"or\"",
        ),
        (
            "subject is \"open and sender is x",
            "the quoted value \"open and sender is x lacks its closing quote",
        ),
    ] {
        let conf = config(
            &dir,
            &db,
            &GOOD.replace(
                "sender-domain is bounce.example or state.spam is true",
                expr,
            ),
        );
        let out = check(&conf, &[]);
        assert_eq!(out.status.code(), Some(78), "{expr}: {}", both(&out));
        let expect = format!(
            "error: {}:{}: [stage-filter] MATCH: {why}",
            conf.display(),
            line_of(&conf, "MATCH")
        );
        assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    }
}

#[test]
fn one_bad_if_section_stops_the_dispatcher_at_start_but_only_its_own_workers() {
    let s = scenario("c-badif")
        .stages(&GOOD.replace(
            "sender-domain is bounce.example or state.spam is true",
            "sender-domain is bounce.example or",
        ))
        .build();
    let named = format!(
        "{}:{}: [stage-filter] MATCH: ends with a dangling \"or\"",
        s.conf.display(),
        line_of(&s.conf, "MATCH")
    );
    let out = serve_at_start(&s.conf);
    assert_eq!(out.status.code(), Some(1), "{}", both(&out));
    assert!(stderr(&out).contains(&named), "{}", both(&out));

    // The good stages' workers run: `in` may not fuse into the bad `filter`, which
    // only stops that fusion.
    let (first, status, err) = worker_for(&stage("discard"), &s.conf, "out");
    assert_eq!(first.as_deref(), Some("ready"), "{status:?} {err}");
    let (first, status, err) = worker_for(&stage("pass"), &s.conf, "in");
    assert_eq!(first.as_deref(), Some("ready"), "{status:?} {err}");
    assert!(status.success(), "{err}");
    assert_has!(err, &named);
    assert_has!(err, "messages will not be fused into stage filter");
    // The bad stage's worker refuses to run, naming its section.
    let (first, status, err) = worker_for(&stage("if"), &s.conf, "filter");
    assert_eq!(first, None, "{err}");
    assert_eq!(status.code(), Some(78), "{err}");
    assert!(err.contains(&named), "{err}");

    // A message at the good stage moves on (unfused) to the bad one and waits there.
    let mut c = s.client();
    let id = inject_claimed(&mut c, "in", "a@x.example", &["r@y.example"]);
    let mut w = Worker::ready(&stage("pass"), &s.conf);
    let lines = w.run(&[id]);
    assert_eq!(code(&lines[0]), 0, "{}", lines[0]);
    assert_eq!(report_stages(&lines[0]), vec!["in"], "{}", lines[0]);
    assert_eq!(
        row_at(&mut c, id),
        Some(("filter".into(), "pending".into()))
    );
}

#[test]
fn a_bad_exec_section_stops_the_dispatcher_at_start_but_only_its_own_workers() {
    let db = TestDb::new();
    let dir = TempDir::new("c-badexec");
    for (exec, key, why) in [
        (
            "COMMAND = /bin/true\nTIMEOUT = 30 seconds\n",
            "TIMEOUT",
            "\"30 seconds\" is not a duration",
        ),
        ("TIMEOUT = 30s\n", "COMMAND", "is required but not set"),
    ] {
        let conf = config(
            &dir,
            &db,
            &format!(
                "[stage-in]\nPROGRAM = {{pass}}\nNEXT = relay\n\n[stage-relay]\nPROGRAM = {{exec}}\n{exec}"
            ),
        );
        let line = if key == "TIMEOUT" {
            line_of(&conf, "TIMEOUT")
        } else {
            line_of(&conf, "[stage-relay]")
        };
        let named = format!("{}:{line}: [stage-relay] {key}: {why}", conf.display());
        let out = serve_at_start(&conf);
        assert_eq!(out.status.code(), Some(1), "{}", both(&out));
        assert!(stderr(&out).contains(&named), "{named}\n{}", both(&out));
        let out = check(&conf, &[]);
        assert_eq!(out.status.code(), Some(78), "{}", both(&out));
        assert_has!(
            stdout(&out),
            &format!("error: {named}"),
            "{named}\n{}",
            both(&out)
        );
        let (first, status, err) = worker_for(&stage("pass"), &conf, "in");
        assert_eq!(first.as_deref(), Some("ready"), "{status:?} {err}");
        let (first, status, err) = worker_for(&stage("exec"), &conf, "relay");
        assert_eq!(first, None, "{err}");
        assert_eq!(status.code(), Some(78), "{err}");
        assert!(err.contains(&named), "{named}\n{err}");
    }
}

#[test]
fn a_misspelt_key_is_a_warning_naming_the_nearest_key_in_the_file_and_the_overlay() {
    let s = scenario("c-typo")
        .stages("[stage-a]\nPROGRAM = {pass}\nNEXT = b\nPARALLELSIM = 4\n\n[stage-b]\nPROGRAM = {discard}\n")
        .build();
    let in_file = format!(
        "{}:{}: [stage-a] PARALLELSIM: unknown key of pepsi-stage-pass, ignored; did you mean PARALLELISM?",
        s.conf.display(),
        line_of(&s.conf, "PARALLELSIM")
    );
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(
        stdout(&out),
        &format!("warning: {in_file}"),
        "{in_file}\n{}",
        both(&out)
    );
    assert_has!(
        stdout(&out),
        "configuration OK (1 warning)",
        "{}",
        both(&out)
    );

    // The same key as an overlay row, first as if written, then written.
    let in_overlay = "pepsi.config_override: [stage-b] PARALLELSIM: unknown key of pepsi-stage-discard, ignored; did you mean PARALLELISM?";
    let out = check(&s.conf, &["--overlay", "stage-b", "PARALLELSIM", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert!(stdout(&out).contains(in_overlay), "{}", both(&out));
    let mut c = s.client();
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-b', 'PARALLELSIM', '2')",
        &[],
    )
    .unwrap();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert!(stdout(&out).contains(in_overlay), "{}", both(&out));
    assert!(stdout(&out).contains(&in_file), "{}", both(&out));

    // The dispatcher starts and logs both.
    let mut d = s.start();
    d.wait_log(&in_file, Duration::from_secs(20));
    d.wait_log(in_overlay, Duration::from_secs(20));
    d.wait_log("serving 2 stages", Duration::from_secs(20));
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn check_names_a_program_that_is_missing_or_not_executable() {
    let db = TestDb::new();
    let dir = TempDir::new("c-program");
    let plain = dir.write("not-executable", "#!/bin/sh\nexit 0\n");
    let conf = config(
        &dir,
        &db,
        &format!(
            "[stage-a]\nPROGRAM = {}/missing-program\nNEXT = b\n\n[stage-b]\nPROGRAM = {}\n\n[stage-c]\nPROGRAM = pepsi-no-such-program-anywhere\n",
            dir.0.display(),
            plain.display()
        ),
    );
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let text = stdout(&out);
    let at = |key: &str| format!("{}:{}:", conf.display(), line_of(&conf, key));
    let a = format!(
        "error: {} [stage-a] PROGRAM: {}/missing-program cannot be executed by RUN_AS root",
        at("PROGRAM = /"),
        dir.0.display()
    );
    assert!(text.contains(&a), "{a}\n{text}");
    let b = format!(
        "[stage-b] PROGRAM: {} cannot be executed by RUN_AS root",
        plain.display()
    );
    assert!(text.contains(&b), "{b}\n{text}");
    assert_has!(
        text,
        "[stage-c] PROGRAM: pepsi-no-such-program-anywhere is not found on PATH"
    );
    assert_eq!(text.matches("error: ").count(), 3, "{text}");
}

#[test]
fn check_with_an_overlay_row_checks_it_without_writing_it() {
    let s = scenario("c-overlay").stages(GOOD).build();
    let out = check(
        &s.conf,
        &["--overlay", "stage-filter", "MATCH", "sender is"],
    );
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "error: pepsi.config_override: [stage-filter] MATCH: the condition on \"sender\" lacks a value",
        "{}",
        both(&out)
    );
    let mut c = s.client();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "check writes nothing");
    // A valid row, and an empty value that unsets a key the section needs.
    let out = check(
        &s.conf,
        &[
            "--overlay",
            "stage-filter",
            "MATCH",
            "subject is \"a or b\"",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    let out = check(&s.conf, &["--overlay", "stage-filter", "ELSE_STAGE", ""]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "[stage-filter] ELSE_STAGE: is required but not set",
        "{}",
        both(&out)
    );
    // A usage error is 64.
    let out = check(&s.conf, &["--overlay", "stage-filter", "MATCH"]);
    assert_eq!(out.status.code(), Some(64), "{}", both(&out));
}

#[test]
fn a_stage_name_of_other_characters_is_an_error_naming_its_line_or_overlay_row() {
    let s = scenario("c-stage-name")
        .stages(&format!("{GOOD}\n[stage-re lay]\nPROGRAM = {{discard}}\n"))
        .build();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let line = line_of(&s.conf, "[stage-re lay]");
    assert_has!(
        stdout(&out),
        &format!(
            "error: {}:{line}: section name \"stage-re lay\" is not valid",
            s.conf.display()
        ),
        "{}",
        both(&out)
    );

    // The overlay's rows: a stage whose name would drive a terminal, and one with a
    // line break, each refused naming its row, shown escaped.
    let conf = config(&s.dir, &s.db, GOOD);
    let pass = stage("pass");
    let mut c = s.client();
    for section in ["stage-ev\u{1b}[2Jil", "stage-a\r\nfake"] {
        c.execute(
            "INSERT INTO pepsi.config_override VALUES ($1, 'PROGRAM', $2)",
            &[&section, &pass.to_str().unwrap()],
        )
        .unwrap();
    }
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let text = stdout(&out);
    for (section, name) in [
        ("stage-ev\\u{1b}[2Jil", "\"ev\\u{1b}[2Jil\""),
        ("stage-a\\r\\nfake", "\"a\\r\\nfake\""),
    ] {
        assert_has!(
            text,
            &format!(
                "error: pepsi.config_override: [{section}] PROGRAM: the stage name {name} is not \
                 valid (a stage name is one or more ASCII letters, digits, '.', '_' and '-')"
            ),
            "{section}: {}",
            both(&out)
        );
    }
    assert!(!text.contains(['\u{1b}', '\r']), "{}", both(&out));
    let status = serve_at_start(&conf).status;
    assert_eq!(status.code(), Some(1), "an invalid graph at start");
}

#[test]
fn an_overlay_row_breaking_a_built_in_section_at_reload_exits_78() {
    let s = scenario("c-reload").stages(GOOD).build();
    let mut d = s.start();
    d.wait_log("serving 3 stages", Duration::from_secs(20));
    s.client()
        .execute(
            "INSERT INTO pepsi.config_override VALUES ('stage-filter', 'MATCH', 'sender-domain is x garbage')",
            &[],
        )
        .unwrap();
    let status = d.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(78), "{}", d.log());
    assert_has!(
        d.log(),
        "pepsi.config_override: [stage-filter] MATCH: unexpected \"garbage\" after the value \"x\""
    );
}

/// `check` of the [`GOOD`] pipeline with `insert` (an INSERT of `pepsi.settings` rows)
/// run first.
fn check_with_settings(tag: &str, insert: &str) -> Output {
    let s = scenario(tag).stages(GOOD).build();
    s.client().execute(insert, &[]).unwrap();
    check(&s.conf, &[])
}

#[test]
fn check_lists_the_per_address_rows_the_workers_ignore_as_warnings() {
    let out = check_with_settings(
        "c-settings",
        "INSERT INTO pepsi.settings VALUES \
             ('r@y.example', 'filter', 'NEXT', 'out'), \
             ('r@y.example', 'filter', 'ELSE_STAGE', 'in'), \
             ('r@y.example', 'filter', 'MATCH', 'sender is x@y.example'), \
             ('r@y.example', 'filter', 'MAX_LIFETIME', '1h'), \
             ('s@y.example', 'in', 'PROGRAM', '/tmp/x'), \
             ('s@y.example', 'in', 'MATCH', 'sender is x@y.example'), \
             ('s@y.example', 'out', 'PARALLELISM', '1'), \
             ('t@y.example', 'gone', 'COMMAND', '/bin/sh'), \
             ('t@y.example', 'gone', 'TIMEOUT', '1s')",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "ignored rows are warnings: {}",
        both(&out)
    );
    let text = stdout(&out);
    for line in [
        "warning: pepsi.settings for r@y.example: [stage-filter] ELSE_STAGE: ELSE_STAGE is never overridable per address; ignored",
        "warning: pepsi.settings for r@y.example: [stage-filter] NEXT: NEXT is never overridable per address; ignored",
        "warning: pepsi.settings for s@y.example: [stage-in] PROGRAM: PROGRAM is never overridable per address; ignored",
        "warning: pepsi.settings for s@y.example: [stage-in] MATCH: MATCH is not overridable per address at stage in (pepsi-stage-pass allows only MAX_LIFETIME); ignored",
        "warning: pepsi.settings for s@y.example: [stage-out] PARALLELISM: PARALLELISM is never overridable per address; ignored",
        "warning: pepsi.settings for t@y.example: [stage-gone] COMMAND: COMMAND is never overridable per address; ignored",
    ] {
        assert!(text.contains(line), "{line}\n{}", both(&out));
    }
    assert_has!(
        text,
        "configuration OK (6 warnings)",
        "the allowed rows, and a stage without a section's TIMEOUT, are not reported: {}",
        both(&out)
    );
}

#[test]
fn check_refuses_a_per_address_value_that_breaks_its_section_naming_the_address() {
    let out = check_with_settings(
        "c-settings-values",
        "INSERT INTO pepsi.settings VALUES \
             ('r@y.example', 'filter', 'MATCH', 'sender is x@y.example'), \
             ('r@y.example', 'filter', 'MAX_LIFETIME', '1h'), \
             ('u@y.example', 'filter', 'MATCH', 'sender is'), \
             ('v@y.example', 'filter', 'MAX_LIFETIME', 'soon'), \
             ('v@y.example', 'filter', 'MATCH', 'subject contains x')",
    );
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let text = stdout(&out);
    for start in [
        "error: pepsi.settings for u@y.example: [stage-filter] MATCH: ",
        "error: pepsi.settings for v@y.example: [stage-filter] MAX_LIFETIME: ",
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("{start}\n{}", both(&out)));
        assert!(
            line.ends_with(
                "; every message of that address fails at this stage until the row is fixed"
            ),
            "{line}"
        );
    }
    assert_lacks!(
        text,
        "r@y.example",
        "a good row is not reported: {}",
        both(&out)
    );
    assert!(
        text.contains("2 errors and 0 warnings")
            || stderr(&out).contains("2 errors and 0 warnings"),
        "{}",
        both(&out)
    );
}

#[test]
fn a_hostile_per_address_row_reaches_checks_output_escaped() {
    // An address with a right-to-left override and a value that tries to print a line
    // of its own, as a row another role may have written.
    let out = check_with_settings(
        "c-settings-hostile",
        "INSERT INTO pepsi.settings VALUES \
             ('x\u{202e}@y.example', 'filter', 'MATCH', E'sender is a\\nerror: all is well'), \
             ('z@y.example', 'filter', 'MAX_LIFETIME', E'1h\\r\\n\\u0007')",
    );
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let text = stdout(&out);
    assert_lacks!(text, '\u{202e}');
    assert_lacks!(text, '\u{7}');
    assert_lacks!(text, '\r');
    assert!(
        !text.lines().any(|l| l.starts_with("error: all is well")),
        "a value cannot print a line of its own: {text}"
    );
    assert_has!(text, "pepsi.settings for x\\u{202e}@y.example");
    assert_has!(
        text,
        "pepsi.settings for z@y.example: [stage-filter] MAX_LIFETIME"
    );
}

#[test]
fn check_reports_an_overlay_program_outside_program_path_as_an_error() {
    let s = scenario("c-program").stages(GOOD).build();
    let refused = "error: pepsi.config_override: [stage-out] PROGRAM: \"/tmp/x\" is refused: it is not under [pepsi] PROGRAM_PATH (builtin:/usr/lib/pepsi)";
    let out = check(&s.conf, &["--overlay", "stage-out", "PROGRAM", "/tmp/x"]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    assert!(stdout(&out).contains(refused), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "; the dispatcher ignores this row",
        "{}",
        both(&out)
    );
    // A program the file names (at any stage) is no such problem.
    let discard = stage("discard").display().to_string();
    let out = check(&s.conf, &["--overlay", "stage-in", "PROGRAM", &discard]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    // A stored row is reported the same way.
    s.client()
        .execute(
            "INSERT INTO pepsi.config_override VALUES ('stage-out', 'PROGRAM', '/tmp/x')",
            &[],
        )
        .unwrap();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    assert!(stdout(&out).contains(refused), "{}", both(&out));
}

#[test]
fn a_reload_ignores_an_overlay_program_outside_program_path_and_applies_the_rest() {
    let (s, mut c) = scenario("c-program-reload")
        .stages(&format!(
            "{GOOD}\n[pepsi]\nPROGRAM_PATH = {}\n",
            crate::util::stage_dir().display()
        ))
        .connect();
    let mut d = s.start();
    d.wait_log("serving 3 stages", Duration::from_secs(20));
    // One statement: a PROGRAM outside PROGRAM_PATH, an attempt to widen PROGRAM_PATH
    // through the overlay, and a change that applies.
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-out', 'PROGRAM', '/tmp/x'), \
         ('pepsi', 'PROGRAM_PATH', '/tmp'), ('stage-in', 'PARALLELISM', '2')",
        &[],
    )
    .unwrap();
    d.wait_log(
        "pepsi.config_override: [stage-out] PROGRAM: \"/tmp/x\" is refused: it is not under [pepsi] PROGRAM_PATH",
        Duration::from_secs(20),
    );
    d.wait_log("this overlay row is ignored", Duration::from_secs(5));
    d.wait_log(
        "stage configuration reloaded: 3 stages",
        Duration::from_secs(20),
    );
    assert_has!(
        d.log(),
        "pepsi.config_override: [pepsi] PROGRAM_PATH: only [stage-*] sections can be overridden; ignored"
    );
    // A program under PROGRAM_PATH that the file does not name: a new stage that runs.
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-extra', 'PROGRAM', $1), \
         ('stage-extra', 'NEXT', 'out'), ('stage-filter', 'NEXT', 'extra')",
        &[&stage("pass").to_str().unwrap()],
    )
    .unwrap();
    d.wait_log(
        "stage configuration reloaded: 4 stages",
        Duration::from_secs(20),
    );
    // bounce.example matches the filter: to extra and on to out; the other goes to out
    // directly, still the file's discard.
    let matched = crate::util::inject(&mut c, "in", "a@bounce.example", &["r@y.example"]);
    let other = crate::util::inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    crate::util::wait_until(Duration::from_secs(30), "both messages are done", || {
        row_at(&mut c, matched).is_none() && row_at(&mut c, other).is_none()
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert_lacks!(d.log(), "cannot start PROGRAM /tmp/x");
    let passes = |c: &mut postgres::Client, stage: &str| -> i64 {
        c.query_opt(
            "SELECT passes FROM pepsi.stage_stats WHERE stage = $1",
            &[&stage],
        )
        .unwrap()
        .map_or(0, |r| r.get(0))
    };
    assert_eq!(passes(&mut c, "extra"), 1, "{}", d.log());
    assert_eq!(passes(&mut c, "out"), 2, "{}", d.log());
}

#[test]
fn a_cycle_is_a_warning_of_check_and_at_start() {
    let s = scenario("c-cycle")
        .stages("[stage-loop1]\nPROGRAM = {pass}\nNEXT = loop2\n\n[stage-loop2]\nPROGRAM = {pass}\nNEXT = loop1\n")
        .build();
    let warning = format!(
        "{}:{}: [stage-loop1] the stage references form a cycle: loop1 → loop2 → loop1",
        s.conf.display(),
        line_of(&s.conf, "[stage-loop1]")
    );
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(
        stdout(&out),
        &format!("warning: {warning}"),
        "{warning}\n{}",
        both(&out)
    );
    let mut d = s.start();
    d.wait_log(&warning, Duration::from_secs(20));
    d.wait_log("serving 2 stages", Duration::from_secs(20));
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn check_reads_the_ingress_certificate_and_key_and_names_the_line() {
    let db = TestDb::new();
    let dir = TempDir::new("c-ingress-tls");
    if !crate::util::tls_peer::ca_available("check_reads_the_ingress_certificate_and_key") {
        return;
    }
    let ca = crate::util::tls_peer::TestCa::new("c-ingress-tls");
    let (cert, key) = ca.server_cert("mx.test");
    let with = |key: &Path| {
        config(
            &dir,
            &db,
            &format!(
                "{GOOD}\n[pepsi-ingress]\nSTAGE = in\nTLS_CERT = {}\nTLS_KEY = {}\n",
                cert.display(),
                key.display()
            ),
        )
    };
    let conf = with(&key);
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    // A key that is not the certificate's (here: the certificate itself).
    let conf = with(&cert);
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let expect = format!(
        "error: {}:{}: [pepsi-ingress] TLS_CERT: ",
        conf.display(),
        line_of(&conf, "TLS_CERT")
    );
    assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    assert_has!(stdout(&out), "not a PEM private key");
}

#[test]
fn check_wants_the_ingress_stage_to_be_an_entry_stage_and_names_its_line() {
    let db = TestDb::new();
    let dir = TempDir::new("c-ingress");
    let with_stage = |stage: &str| {
        config(
            &dir,
            &db,
            &format!("{GOOD}\n[pepsi-ingress]\nSTAGE = {stage}\nXFORWARD_FROM = 127.0.0.1\n"),
        )
    };
    // An entry stage: nothing routes to it.
    let conf = with_stage("in");
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "configuration OK (0 warnings)",
        "{}",
        both(&out)
    );
    // The overlay counts: with a NEXT routing to it, it is no entry stage any more.
    let out = check(&conf, &["--overlay", "stage-out", "NEXT", "in"]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let expect = format!(
        "error: {}:{}: [pepsi-ingress] STAGE \"in\" is not one of [pepsi] INJECT_STAGES (none)",
        conf.display(),
        line_of(&conf, "STAGE")
    );
    assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    // A stage some NEXT routes to, and a stage without a section: errors naming them
    // and the line.
    for (stage, why) in [
        (
            "filter",
            "[pepsi-ingress] STAGE \"filter\" is not one of [pepsi] INJECT_STAGES (in): \
             pepsi-ingress may inject only into an entry stage",
        ),
        (
            "nowhere",
            "[pepsi-ingress] STAGE names stage \"nowhere\", which has no [stage-nowhere] section",
        ),
    ] {
        let conf = with_stage(stage);
        let out = check(&conf, &[]);
        assert_eq!(out.status.code(), Some(78), "{stage}: {}", both(&out));
        let expect = format!(
            "error: {}:{}: {why}",
            conf.display(),
            line_of(&conf, "STAGE")
        );
        assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    }
}

#[test]
fn a_syntax_error_hides_no_other_error_and_a_line_that_is_not_utf8_is_named() {
    let db = TestDb::new();
    let dir = TempDir::new("c-all");
    // A key set twice (line 2 of the stage section), a stage that names a stage with no
    // section, a bad value of a fixed key, and a line that is not UTF-8.
    let conf = config(
        &dir,
        &db,
        &format!(
            "{GOOD}
[stage-extra]
PROGRAM = {{pass}}
PROGRAM = {{pass}}
NEXT = nowhere
"
        ),
    );
    let mut text = std::fs::read(&conf).unwrap();
    text.extend_from_slice(b"[pepsi-dispatch]\nMAX_HOPS = lots\n# caf\xe9\n");
    std::fs::write(&conf, &text).unwrap();
    let lines: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
    let line = |start: &[u8]| lines.iter().position(|l| l.starts_with(start)).unwrap() + 1;
    let twice = lines
        .iter()
        .rposition(|l| l.starts_with(b"PROGRAM = "))
        .unwrap()
        + 1;
    let out = check(&conf, &[]);
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let text = stdout(&out);
    let c = conf.display();
    for expect in [
        format!(
            "{c}:{twice}: [stage-extra] PROGRAM: is already set at {c}:{}",
            twice - 1
        ),
        format!("{c}:{}: ", line(b"NEXT = nowhere")),
        format!(
            "{c}:{}: [pepsi-dispatch] MAX_HOPS",
            line(b"MAX_HOPS = lots")
        ),
        format!("{c}:{}: is not UTF-8", line(b"# caf")),
    ] {
        assert!(text.contains(&expect), "{expect}\n{}", both(&out));
    }
    assert!(text.contains("nowhere"), "{}", both(&out));
    // The dispatcher at start reports the file's syntax errors with its fixed
    // sections' (the stage graph is built once those are right).
    let out = serve_at_start(&conf);
    let log = stderr(&out);
    assert!(!out.status.success(), "{log}");
    for part in ["is already set", "MAX_HOPS", "not UTF-8"] {
        assert!(log.contains(part), "{part}: {log}");
    }
}

#[test]
fn an_exec_command_that_is_missing_or_not_executable_is_an_error_naming_its_line() {
    let user = crate::util::exec_user();
    let dir = TempDir::new("c-command-file");
    // A file nobody may execute, in a directory everyone may search.
    let plain = dir.write("deliver.txt", "not a program\n");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let not_executable = format!("{} cannot be executed", plain.display());
    for (command, says) in [
        (
            "/nonexistent/deliver --to x".to_string(),
            "/nonexistent/deliver cannot be executed",
        ),
        (plain.display().to_string(), not_executable.as_str()),
        (
            "no-such-deliver-program".to_string(),
            "no-such-deliver-program is not found on PATH (/usr/local/bin:/usr/bin:/bin)",
        ),
    ] {
        let s = scenario("c-command")
            .stages(&format!(
                "[stage-in]\nPROGRAM = {{exec}}\nCOMMAND = {command}\nUSER = {user}\n"
            ))
            .build();
        let out = check(&s.conf, &[]);
        assert_eq!(out.status.code(), Some(78), "{command}: {}", both(&out));
        let expect = format!(
            "error: {}:{}: [stage-in] COMMAND: {says}",
            s.conf.display(),
            line_of(&s.conf, "COMMAND")
        );
        assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    }
    // A command the account can run passes.
    let s = scenario("c-command-ok")
        .stages(&format!(
            "[stage-in]\nPROGRAM = {{exec}}\nCOMMAND = cat\nUSER = {user}\n"
        ))
        .build();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
}

#[test]
fn an_exec_timeout_not_below_max_runtime_is_a_warning() {
    let user = crate::util::exec_user();
    let stages = |timeout: &str| {
        format!("[stage-in]\nPROGRAM = {{exec}}\nCOMMAND = cat\nUSER = {user}\n{timeout}")
    };
    let s = scenario("c-timeout")
        .stages(&stages("TIMEOUT = 10m\n"))
        .build();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    let expect = format!(
        "warning: {}:{}: [stage-in] TIMEOUT: 10m is not below [pepsi-dispatch] MAX_RUNTIME (5m)",
        s.conf.display(),
        line_of(&s.conf, "TIMEOUT")
    );
    assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    assert!(stdout(&out).contains("(1 warning"), "{}", both(&out));
    // The default TIMEOUT (60s) is below the default MAX_RUNTIME (5m).
    let s = scenario("c-timeout-ok").stages(&stages("")).build();
    let out = check(&s.conf, &[]);
    assert_has!(
        stdout(&out),
        "configuration OK (0 warnings)",
        "{}",
        both(&out)
    );
}

#[test]
fn a_per_address_timeout_not_below_max_runtime_is_a_warning_naming_the_address() {
    let user = crate::util::exec_user();
    let s = scenario("c-timeout-address")
        .stages(&format!(
            "[stage-in]\nPROGRAM = {{exec}}\nCOMMAND = cat\nUSER = {user}\n"
        ))
        .build();
    s.client()
        .execute(
            "INSERT INTO pepsi.settings VALUES ('slow@y.example', 'in', 'TIMEOUT', '20m'), \
                 ('quick@y.example', 'in', 'TIMEOUT', '2m')",
            &[],
        )
        .unwrap();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    let expect = "warning: pepsi.settings for slow@y.example: [stage-in] TIMEOUT: 20m is not below [pepsi-dispatch] MAX_RUNTIME (5m)";
    assert!(stdout(&out).contains(expect), "{expect}\n{}", both(&out));
    assert_lacks!(
        stdout(&out),
        "quick@y.example",
        "a TIMEOUT below MAX_RUNTIME is not reported: {}",
        both(&out)
    );
    assert!(stdout(&out).contains("(1 warning"), "{}", both(&out));
}

#[test]
fn relay_timeouts_summing_to_max_runtime_or_more_are_a_warning() {
    let stages = |timeout: &str| {
        format!("[stage-out]\nPROGRAM = {{relay}}\nSMARTHOST = unix:/run/lmtp\n{timeout}")
    };
    let s = scenario("c-relay-timeout")
        .stages(&stages("COMMAND_TIMEOUT = 3m\n"))
        .build();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    let expect = format!(
        "warning: {}:{}: [stage-out] COMMAND_TIMEOUT: CONNECT_TIMEOUT + COMMAND_TIMEOUT + DATA_TIMEOUT + DATA_DONE_TIMEOUT (6m), one message's time, is not below [pepsi-dispatch] MAX_RUNTIME (5m)",
        s.conf.display(),
        line_of(&s.conf, "COMMAND_TIMEOUT")
    );
    assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
    // The defaults (30s + 60s + 60s + 90s = 4m) are below the default MAX_RUNTIME.
    let s = scenario("c-relay-timeout-ok").stages(&stages("")).build();
    let out = check(&s.conf, &[]);
    assert_has!(
        stdout(&out),
        "configuration OK (0 warnings)",
        "{}",
        both(&out)
    );
}

#[test]
fn check_looks_a_bare_program_up_on_the_path_the_switched_dispatcher_uses() {
    if !crate::util::is_root() {
        eprintln!("skipped: needs root (the dispatcher switches to RUN_AS only as root)");
        return;
    }
    let installed = ["/usr/local/bin", "/usr/bin", "/bin"]
        .iter()
        .any(|d| Path::new(d).join("pepsi-stage-exec").exists());
    if installed {
        eprintln!("skipped: pepsi-stage-exec is installed on the service PATH");
        return;
    }
    let db = TestDb::new();
    let dir = TempDir::new("c-path");
    let command = dir.write("deliver", "#!/bin/sh\ncat >/dev/null\n");
    let conf = crate::util::scenario::switched_accounts(&dir, &db, &command);
    // The stage program as a bare name, found only on root's PATH here.
    let program = dir.path("pepsi-stage-exec");
    let text = std::fs::read_to_string(&conf).unwrap().replace(
        &format!("PROGRAM = {}", program.display()),
        "PROGRAM = pepsi-stage-exec",
    );
    std::fs::write(&conf, text).unwrap();
    let path = format!(
        "{}:{}",
        dir.0.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(bin("pepsi-dispatch"))
        .args(["-c", conf.to_str().unwrap(), "check"])
        .env("PATH", &path)
        .env_remove("PEPSI_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "{}", both(&out));
    let expect = format!(
        "[stage-e] PROGRAM: pepsi-stage-exec is not found on PATH ({})",
        pepsi::privilege::SERVICE_PATH
    );
    assert!(stdout(&out).contains(&expect), "{expect}\n{}", both(&out));
}

#[test]
fn a_byte_order_mark_at_the_start_of_the_file_is_ignored() {
    let s = scenario("c-bom").stages(GOOD).build();
    let mut text = "\u{feff}".as_bytes().to_vec();
    text.extend(std::fs::read(&s.conf).unwrap());
    std::fs::write(&s.conf, text).unwrap();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(
        stdout(&out),
        "configuration OK (0 warnings)",
        "{}",
        both(&out)
    );
}

#[test]
fn check_without_a_database_still_checks_the_file() {
    let dir = TempDir::new("c-nodb");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n[pepsi-postgres]\nCONNECTION = host=/nonexistent dbname=x\n\
             [stage-a]\nPROGRAM = {}\nNEXT = a\nQUEUE_LIMT = 2\n",
            stage("pass").display()
        ),
    );
    let out = check(&conf, &[]);
    // The database out of reach is the only error: 75, a check to run again.
    assert_eq!(out.status.code(), Some(75), "{}", both(&out));
    let text = stdout(&out);
    assert!(text.contains("error: database: cannot connect"), "{text}");
    assert!(text.contains("did you mean QUEUE_LIMIT?"), "{text}");
    assert!(text.contains("form a cycle: a → a"), "{text}");
}

#[test]
fn the_usage_names_check() {
    let out = run(&bin("pepsi-dispatch"), &["-h"]);
    assert!(out.status.success());
    assert_has!(
        stdout(&out),
        "serve | check [--overlay SECTION KEY VALUE]",
        "{}",
        both(&out)
    );
    let out = run(&bin("pepsi-dispatch"), &["inspect"]);
    assert_eq!(out.status.code(), Some(64), "{}", both(&out));
}

#[test]
fn a_worker_started_for_a_stage_without_a_section_exits_78() {
    let s = scenario("c-nosection").stages(GOOD).build();
    let (first, status, err) = worker_for(&stage("pass"), &s.conf, "gone");
    assert_eq!(first, None, "{err}");
    assert_eq!(status.code(), Some(78), "{err}");
    assert_has!(
        err,
        "started for stage \"gone\" (PEPSI_WORKER_STAGE), which has no [stage-gone] section"
    );
}

#[test]
fn an_address_is_not_warned_about_when_the_files_section_draws_the_same_warning() {
    let user = crate::util::exec_user();
    let s = scenario("c-timeout-both")
        .stages(&format!(
            "[stage-in]\nPROGRAM = {{exec}}\nCOMMAND = cat\nUSER = {user}\nTIMEOUT = 10m\n"
        ))
        .build();
    s.client()
        .execute(
            "INSERT INTO pepsi.settings VALUES ('slow@y.example', 'in', 'TIMEOUT', '20m')",
            &[],
        )
        .unwrap();
    let out = check(&s.conf, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    assert_has!(stdout(&out), "[stage-in] TIMEOUT: 10m is not below");
    assert_lacks!(stdout(&out), "slow@y.example");
    assert_has!(stdout(&out), "(1 warning");
}
