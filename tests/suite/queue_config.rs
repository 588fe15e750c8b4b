//! `pepsi-queue config` (`src/queue/overlay.rs`): `check` is the dispatcher's check,
//! and `set`/`unset` check the resulting stage graph, PROGRAM_PATH and the failure
//! bouncer's target before they write the overlay.

use postgres::Client;

use crate::util::notify::notified;
use crate::util::queue::{STAGES, both, expect, listener, queue};
use crate::util::rows::count;
use crate::util::{Scenario, assert_has, bin, run, stage, stage_dir, stderr, stdout, write_config};

#[test]
fn config_check_is_the_dispatchers_check() {
    let s = Scenario::new("q-check")
        .stages("[stage-in]\nPROGRAM = /bin/true\nNEXT = out\n\n[stage-out]\nPROGRAM = /bin/true\n")
        .build();
    let good = &s.conf;
    for conf in [
        good.clone(),
        s.dir.write("bad.conf", "[stage-a]\nNEXT = nowhere\n"),
    ] {
        let ours = queue(&conf, &["config", "check"]);
        let theirs = run(
            &bin("pepsi-dispatch"),
            &["-c", conf.to_str().unwrap(), "check"],
        );
        assert_eq!(ours.status.code(), theirs.status.code(), "{}", both(&ours));
        assert_eq!(stdout(&ours), stdout(&theirs));
    }
    expect(&queue(good, &["config", "check"]), 0);
    expect(&queue(&s.dir.path("bad.conf"), &["config", "check"]), 78);
    // --json: the same findings as one document, the same exit.
    for (conf, code) in [(good.clone(), 0), (s.dir.path("bad.conf"), 78)] {
        let text = queue(&conf, &["config", "check"]);
        let out = queue(&conf, &["config", "check", "--json"]);
        expect(&out, code);
        let doc: serde_json::Value =
            serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{e}: {}", both(&out)));
        assert_eq!(doc["file"], conf.display().to_string());
        assert_eq!(doc["ok"], code == 0);
        let lines = |kind: &str| -> Vec<String> {
            stdout(&text)
                .lines()
                .filter_map(|l| l.strip_prefix(&format!("{kind}: ")))
                .map(str::to_string)
                .collect()
        };
        let listed = |key: &str| -> Vec<String> {
            doc[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(listed("errors"), lines("error"), "{}", both(&out));
        assert_eq!(listed("warnings"), lines("warning"), "{}", both(&out));
        assert_eq!(code == 78, !listed("errors").is_empty());
    }
    expect(
        &queue(
            good,
            &["config", "set", "stage-in", "NEXT", "out", "--json"],
        ),
        64,
    );
}

#[test]
fn config_set_and_unset_check_the_resulting_graph_before_writing() {
    let (s, mut c) = Scenario::new("q-config")
        .timers("")
        .stages(
            "[stage-in]\nPROGRAM = {if}\nMATCH = sender-domain is x.example\nNEXT = out\nELSE_STAGE = out\n\n\
             [stage-out]\nPROGRAM = {discard}\n",
        )
        .connect();
    let mut l = listener(&s.db);
    let overlay = |c: &mut Client| -> Vec<(String, String, String)> {
        c.query(
            "SELECT section, key, value FROM pepsi.config_override ORDER BY 1, 2",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
    };

    let out = queue(&s.conf, &["config", "set", "stage-out", "PARALLELISM", "2"]);
    expect(&out, 0);
    assert_eq!(
        overlay(&mut c),
        [("stage-out".into(), "PARALLELISM".into(), "2".into())]
    );
    assert_eq!(notified(&mut l, &mut c), ["config_changed"]);

    // Refused: a dangling reference, a value that does not parse, a MATCH the if
    // stage's worker would refuse; each lists the problem and writes nothing.
    for (args, says) in [
        (
            &["config", "set", "stage-in", "NEXT", "nowhere"][..],
            "names stage \"nowhere\"",
        ),
        (
            &["config", "set", "stage-out", "QUEUE_LIMIT", "lots"],
            "\"lots\" is not a whole number",
        ),
        (
            &[
                "config",
                "set",
                "stage-in",
                "MATCH",
                "sender-domain is x.example garbage",
            ],
            "MATCH",
        ),
        (&["config", "unset", "stage-in", "NEXT"], "nothing changed"),
        (&["config", "set", "[stage-new]", "NEXT", "out"], "PROGRAM"),
    ] {
        let out = queue(&s.conf, args);
        let code = if args[1] == "unset" { 65 } else { 78 };
        expect(&out, code);
        assert!(stderr(&out).contains(says), "{args:?}: {}", both(&out));
        assert_eq!(overlay(&mut c).len(), 1, "{args:?} wrote something");
    }
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());

    // A new stage in two steps is refused at the first (no PROGRAM); a PROGRAM first
    // works (a built-in stage program, which [pepsi] PROGRAM_PATH allows), then its
    // NEXT.
    expect(
        &queue(
            &s.conf,
            &[
                "config",
                "set",
                "stage-new",
                "PROGRAM",
                "pepsi-stage-discard",
            ],
        ),
        0,
    );
    expect(
        &queue(&s.conf, &["config", "set", "stage-new", "NEXT", "out"]),
        0,
    );
    // Unsetting removes the overlay row: the file's value applies again.
    expect(
        &queue(&s.conf, &["config", "unset", "stage-out", "PARALLELISM"]),
        0,
    );
    assert_eq!(
        overlay(&mut c),
        [
            ("stage-new".into(), "NEXT".into(), "out".into()),
            (
                "stage-new".into(),
                "PROGRAM".into(),
                "pepsi-stage-discard".into()
            ),
        ]
    );
    // Unsetting the new stage's PROGRAM would leave a section without one.
    let out = queue(&s.conf, &["config", "unset", "stage-new", "PROGRAM"]);
    expect(&out, 78);
    assert!(stderr(&out).contains("PROGRAM"), "{}", both(&out));
    assert_eq!(notified(&mut l, &mut c), ["config_changed"; 3]);

    for args in [
        &["config", "set", "pepsi", "RUN_AS", "root"][..],
        &["config", "set", "stage-out", "parallelism", "2"],
        &["config", "set", "stage-out", "PARALLELISM"],
        &["config", "frob"],
    ] {
        expect(&queue(&s.conf, args), 64);
    }
}

#[test]
fn config_set_refuses_a_program_outside_program_path_unless_the_file_names_it() {
    let bin_dir = stage_dir().display().to_string();
    let with_path = |path: &str| format!("[pepsi]\nPROGRAM_PATH = {path}\n\n{STAGES}");
    let (s, mut c) = Scenario::new("q-config-program")
        .stages(&with_path(&bin_dir))
        .connect();
    let conf = s.conf.clone();
    let mut l = listener(&s.db);
    let overlay = |c: &mut Client| count(c, "SELECT count(*) FROM pepsi.config_override");
    let discard = stage("discard").display().to_string();
    let outside = [
        ("/tmp/x".to_string(), "it is not under [pepsi] PROGRAM_PATH"),
        (
            "pepsi-stage-discard".to_string(),
            "it is not an absolute path",
        ),
        (format!("{bin_dir}/../x"), "it has a \"..\" component"),
        (format!("{bin_dir}x/pepsi-stage-discard"), "it is not under"),
        (
            format!("{bin_dir}/"),
            "it ends in '/', which names a directory",
        ),
    ];
    for (value, says) in &outside {
        let out = queue(&conf, &["config", "set", "stage-relay", "PROGRAM", value]);
        expect(&out, 78);
        let text = stderr(&out);
        assert_has!(
            text,
            &format!("pepsi.config_override: [stage-relay] PROGRAM: {value:?} is refused: {says}"),
            "{value}: {}",
            both(&out)
        );
        assert!(text.contains("nothing changed"), "{}", both(&out));
    }
    assert_eq!(overlay(&mut c), 0, "nothing written");
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
    // The overlay cannot widen PROGRAM_PATH: [pepsi] is not a section it overrides.
    expect(
        &queue(&conf, &["config", "set", "pepsi", "PROGRAM_PATH", "/tmp"]),
        64,
    );
    // Under PROGRAM_PATH, or exactly a program the file names: written.
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-relay", "PROGRAM", &discard],
        ),
        0,
    );
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-in", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    assert_eq!(overlay(&mut c), 2);
    assert_eq!(notified(&mut l, &mut c), ["config_changed"; 2]);
    // With PROGRAM_PATH = none, only what the file names.
    let conf = write_config(&s.dir, &s.db, &with_path("none"));
    let out = queue(&conf, &["config", "set", "stage-new", "PROGRAM", &discard]);
    expect(&out, 78);
    assert_has!(
        stderr(&out),
        "[pepsi] PROGRAM_PATH is none",
        "{}",
        both(&out)
    );
    expect(
        &queue(
            &conf,
            &["config", "set", "stage-new", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    assert_eq!(overlay(&mut c), 3);
}

#[test]
fn config_unset_may_not_take_the_failure_bouncers_stage_away() {
    let (s, mut c) = Scenario::new("q-config-bouncer")
        .stages(&format!(
            "[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n{STAGES}"
        ))
        .connect();
    // The bounce stage exists only in the overlay; its last key unset, it would be gone.
    expect(
        &queue(
            &s.conf,
            &["config", "set", "stage-bounce", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    let out = queue(&s.conf, &["config", "unset", "stage-bounce", "PROGRAM"]);
    expect(&out, 78);
    assert_has!(
        stderr(&out),
        "the failure bouncer would lose its target",
        "{}",
        both(&out)
    );
    assert!(stderr(&out).contains("BOUNCE_STAGE"), "{}", both(&out));
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM pepsi.config_override"),
        1,
        "nothing changed"
    );
    // Other changes stay possible while the target is there.
    expect(
        &queue(&s.conf, &["config", "set", "stage-bounce", "NEXT", "relay"]),
        0,
    );
}
