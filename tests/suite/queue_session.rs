//! `pepsi-queue`'s command line and session (`src/queue/args.rs`, `src/queue/mod.rs`):
//! usage errors, a stage argument that is no stage name, the exits for a missing
//! schema, an unreachable database and a broken file, and the switch to `RUN_AS`.

use std::path::Path;

use crate::util::queue::{STAGES, both, expect, nothing_raw, os, queue, queue_in};
use crate::util::rows::count;
use crate::util::{Scenario, TestDb, assert_has, inject, row_at, stderr, stdout, write_config};

#[test]
fn requeue_and_inject_refuse_a_stage_that_is_no_stage_name() {
    let (s, mut c) = Scenario::new("q-stage-name").stages(STAGES).connect();
    let id = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    for stage in ["re\u{1b}[2Jlay", "relay\r\nfake", "a b"] {
        let out = queue(&s.conf, &["requeue", "--stage", stage, &id.to_string()]);
        expect(&out, 64);
        assert_has!(
            stderr(&out),
            "a stage name is one or more ASCII letters",
            "{}",
            both(&out)
        );
        nothing_raw(&stderr(&out));
        let out = queue_in(
            &s.conf,
            &os(&[
                "inject",
                "--stage",
                stage,
                "-f",
                "a@x.example",
                "r@y.example",
            ]),
            b"Subject: x\n\nbody\n",
        );
        expect(&out, 64);
    }
    assert_eq!(row_at(&mut c, id), Some(("in".into(), "pending".into())));
    assert_eq!(count(&mut c, "SELECT count(*) FROM pepsi.workqueue"), 1);
}

#[test]
fn usage_schema_and_connection_errors_have_their_own_exits() {
    let s = Scenario::new("q-errors").stages(STAGES).build();
    for args in [
        &[][..],
        &["frobnicate"],
        &["status", "--colour"],
        &["status", "-v"],
        &["list", "--limit", "none"],
    ] {
        let out = queue(&s.conf, args);
        expect(&out, 64);
        assert_has!(stderr(&out), "usage: pepsi-queue", "{}", both(&out));
    }
    let help = queue(&s.conf, &["-h"]);
    expect(&help, 0);
    assert!(stdout(&help).contains("requeue --stage S ID"));

    let empty = TestDb::empty();
    let no_schema = write_config(&s.dir, &empty, STAGES);
    let out = queue(&no_schema, &["status"]);
    expect(&out, 78);
    assert_has!(stderr(&out), "run pepsi-setup schema", "{}", both(&out));

    let away = s.dir.write(
        "away.conf",
        "[pepsi]\nRUN_AS = root\n[pepsi-postgres]\nCONNECTION = host=/nonexistent port=5999 user=x dbname=x\n",
    );
    let out = queue(&away, &["status"]);
    expect(&out, 75);
    assert_has!(stderr(&out), "/nonexistent/.s.PGSQL.5999", "{}", both(&out));
    let out = queue(&s.dir.write("broken.conf", "[pepsi\n"), &["status"]);
    expect(&out, 78);
}

#[test]
fn started_as_root_it_works_as_run_as() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: there is no privilege to drop");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let s = Scenario::new("q-run-as").stages(STAGES).build();
    let mode = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    };
    mode(&s.dir.0, 0o755);
    let text = std::fs::read_to_string(&s.conf)
        .unwrap()
        .replace("RUN_AS = root", "RUN_AS = nobody");
    std::fs::write(&s.conf, text).unwrap();
    mode(&s.conf, 0o644);
    expect(&queue(&s.conf, &["status"]), 0);
    // A folder only root may write to is closed to the account it switched to.
    let closed = s.dir.path("closed");
    std::fs::create_dir(&closed).unwrap();
    mode(&closed, 0o700);
    let out = queue(
        &s.conf,
        &[
            "metrics",
            "--output",
            closed.join("pepsi.prom").to_str().unwrap(),
        ],
    );
    expect(&out, 73);
    assert!(stderr(&out).contains("Permission denied"), "{}", both(&out));

    let text = std::fs::read_to_string(&s.conf)
        .unwrap()
        .replace("RUN_AS = nobody", "RUN_AS = pepsi-no-such-account");
    std::fs::write(&s.conf, text).unwrap();
    let out = queue(&s.conf, &["status"]);
    expect(&out, 78);
    assert_has!(stderr(&out), "pepsi-no-such-account", "{}", both(&out));
}
