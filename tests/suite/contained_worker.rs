//! A compromised stage worker (SPEC §4 "Containment", amended 2026-12-04): what an
//! administrator's overlay cannot do to take an exec command out of its keeper, and
//! what a worker program written by an attacker cannot reach.

use std::path::Path;
use std::process::Output;

use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb, bin, run, stderr, stdout};

/// `PROGRAM -c conf ARGS…`.
fn program(name: &str, conf: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-c", conf.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&bin(name), &all)
}

/// A relay followed by an exec stage: the pipeline of the finding, fused or not.
const RELAY_THEN_ARCHIVE: &str = "[stage-relay]\nPROGRAM = {pass}\nNEXT = archive\n\n\
                                  [stage-archive]\nPROGRAM = {exec}\nCOMMAND = /bin/cat\n";

#[test]
fn a_stage_that_runs_a_command_is_never_fused_into_by_file_overlay_or_check() {
    let db = TestDb::new();
    let dir = TempDir::new("fuse-exec");
    // In the file: check names the line, the dispatcher refuses to start.
    let fused = conf(
        &dir,
        &db,
        "",
        &format!("{RELAY_THEN_ARCHIVE}FUSION = yes\n"),
    );
    let line = std::fs::read_to_string(&fused)
        .unwrap()
        .lines()
        .position(|l| l == "FUSION = yes")
        .unwrap()
        + 1;
    let checked = program("pepsi-dispatch", &fused, &["check"]);
    assert_eq!(checked.status.code(), Some(78), "{}", stdout(&checked));
    let said = format!(
        "{}:{line}: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into",
        fused.display()
    );
    assert!(stdout(&checked).contains(&said), "{}", stdout(&checked));
    let serve = program("pepsi-dispatch", &fused, &["serve"]);
    assert_eq!(serve.status.code(), Some(1), "{}", stderr(&serve));
    assert!(stderr(&serve).contains(&said), "{}", stderr(&serve));

    // In the overlay: pepsi-queue config set refuses it and writes nothing; check
    // --overlay says why; a row written behind its back is an error of check.
    let conf = conf(&dir, &db, "", RELAY_THEN_ARCHIVE);
    assert_eq!(
        program("pepsi-dispatch", &conf, &["check"]).status.code(),
        Some(0)
    );
    let set = program(
        "pepsi-queue",
        &conf,
        &["config", "set", "stage-archive", "FUSION", "yes"],
    );
    assert_ne!(set.status.code(), Some(0), "{}", stdout(&set));
    assert!(
        stderr(&set)
            .contains("[stage-archive] FUSION: a stage that runs a COMMAND is never fused into"),
        "{}",
        stderr(&set)
    );
    let mut c = db.client();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "the refused row was written");
    let dry = program(
        "pepsi-dispatch",
        &conf,
        &["check", "--overlay", "stage-archive", "FUSION", "yes"],
    );
    assert_eq!(dry.status.code(), Some(78), "{}", stdout(&dry));
    assert!(
        stdout(&dry).contains(
            "pepsi.config_override: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into"
        ),
        "{}",
        stdout(&dry)
    );
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-archive', 'FUSION', 'yes')",
        &[],
    )
    .unwrap();
    let checked = program("pepsi-dispatch", &conf, &["check"]);
    assert_eq!(checked.status.code(), Some(78), "{}", stdout(&checked));
    assert!(
        stdout(&checked).contains(
            "pepsi.config_override: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into"
        ),
        "{}",
        stdout(&checked)
    );
}
