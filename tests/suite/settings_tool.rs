//! `pepsi-settings` (`src/queue/settings/`), run through a link named after it to the
//! `pepsi-queue` binary as the package installs it: the per-address settings read and
//! written, every write checked by the stage's own rules before anything is written,
//! `export` and `import` round-tripping the table, hostile input refused or shown
//! escaped, and a running dispatcher's workers using a new setting at once. Also
//! `pepsi-config`, the other name of the binary, whose `check` is `pepsi-queue config
//! check`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use postgres::Client;

use crate::util::notify::notified;
use crate::util::queue::{both, expect, json, listener, queue};
use crate::util::{Scenario, assert_has, assert_lacks, bin, inject, stderr, stdout, wait_until};

/// `route` sends mail for `a.example` on to `ta`, the rest to `tb`; `run` is an exec
/// stage, for its keys.
const STAGES: &str = "[stage-route]\nPROGRAM = {if}\nMATCH = recipient-domain is a.example\nNEXT = ta\nELSE_STAGE = tb\n\n\
                      [stage-ta]\nPROGRAM = {discard}\n\n\
                      [stage-tb]\nPROGRAM = {discard}\n\n\
                      [stage-run]\nPROGRAM = {exec}\nCOMMAND = /bin/cat\nNEXT = ta\n";

/// A directory with `pepsi-settings` and `pepsi-config`, links to the `pepsi-queue`
/// test binary, as the package installs them.
fn links() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pepsi-t-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in pepsi::queue::multicall::LINKS {
            std::os::unix::fs::symlink(bin("pepsi-queue"), dir.join(name)).unwrap();
        }
        dir
    })
}

/// Runs the link `name -c conf ARGS` with `input` on its standard input.
fn linked(name: &str, conf: &Path, args: &[OsString], input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(links().join(name))
        .arg("-c")
        .arg(conf)
        .args(args)
        .env_remove("PEPSI_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    // A command that does not read its input may have exited already.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().unwrap()
}

/// `pepsi-settings -c conf ARGS`.
fn settings(conf: &Path, args: &[&str]) -> Output {
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    linked("pepsi-settings", conf, &args, b"")
}

/// Every row of `pepsi.settings`, ordered.
fn table(c: &mut Client) -> Vec<(String, String, String, String)> {
    c.query(
        "SELECT address, stage, key, value FROM pepsi.settings ORDER BY 1, 2, 3",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// A row of the table.
fn row(a: &str, s: &str, k: &str, v: &str) -> (String, String, String, String) {
    (a.into(), s.into(), k.into(), v.into())
}

#[test]
fn set_get_unset_and_list_read_and_write_the_table_without_notifying_anyone() {
    let (s, mut c) = Scenario::new("settings-crud").stages(STAGES).connect();
    let mut l = listener(&s.db);
    let out = settings(
        &s.conf,
        &[
            "set",
            "Bob@B.example",
            "route",
            "MATCH",
            "recipient-domain is b.example",
        ],
    );
    expect(&out, 0);
    assert_has!(
        stdout(&out),
        "bob@b.example [stage-route] MATCH = recipient-domain is b.example; the workers apply it",
        "{}",
        both(&out)
    );
    for args in [
        ["set", "bob@b.example", "route", "MAX_LIFETIME", "2h"],
        ["set", "carol@c.example", "run", "TIMEOUT", "5s"],
        ["set", "carol@c.example", "run", "TIMEOUT", "7s"],
    ] {
        expect(&settings(&s.conf, &args), 0);
    }
    let written = [
        row(
            "bob@b.example",
            "route",
            "MATCH",
            "recipient-domain is b.example",
        ),
        row("bob@b.example", "route", "MAX_LIFETIME", "2h"),
        row("carol@c.example", "run", "TIMEOUT", "7s"),
    ];
    assert_eq!(table(&mut c), written, "lower-cased, a second set replaces");
    // The workers read the settings with each message; nothing is notified.
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());

    let out = settings(&s.conf, &["get", "BOB@b.example"]);
    expect(&out, 0);
    assert_eq!(
        stdout(&out),
        "[stage-route]\nMATCH = recipient-domain is b.example\nMAX_LIFETIME = 2h\n"
    );
    let doc = json(&settings(&s.conf, &["get", "bob@b.example", "--json"]));
    assert_eq!(doc["address"], "bob@b.example");
    assert_eq!(doc["settings"].as_array().unwrap().len(), 2, "{doc}");
    assert_eq!(doc["settings"][0]["key"], "MATCH");
    assert_eq!(doc["settings"][0]["value"], "recipient-domain is b.example");
    assert_eq!(doc["settings"][0]["ignored"], serde_json::Value::Null);
    assert_eq!(
        stdout(&settings(&s.conf, &["get", "nobody@x.example"])),
        "# nobody@x.example has no settings\n"
    );

    let out = settings(&s.conf, &["list"]);
    expect(&out, 0);
    assert_eq!(
        stdout(&out),
        "bob@b.example [stage-route] MATCH = recipient-domain is b.example\n\
         bob@b.example [stage-route] MAX_LIFETIME = 2h\n\
         carol@c.example [stage-run] TIMEOUT = 7s\n"
    );
    assert_eq!(
        stdout(&settings(&s.conf, &["list", "--stage", "run"])),
        "carol@c.example [stage-run] TIMEOUT = 7s\n"
    );
    let doc = json(&settings(&s.conf, &["list", "Carol@C.example", "--json"]));
    assert_eq!(
        doc["settings"],
        serde_json::json!([{"address": "carol@c.example", "stage": "run", "key": "TIMEOUT",
                            "value": "7s", "ignored": null}])
    );
    assert_eq!(stdout(&settings(&s.conf, &["list", "--stage", "ta"])), "");
    // `pepsi-queue settings` is the same program.
    let through_queue = queue(&s.conf, &["settings", "list"]);
    expect(&through_queue, 0);
    assert_eq!(
        stdout(&through_queue),
        stdout(&settings(&s.conf, &["list"]))
    );

    let out = settings(&s.conf, &["unset", "BOB@b.example", "route", "MATCH"]);
    expect(&out, 0);
    assert_has!(stdout(&out), "bob@b.example [stage-route] MATCH removed");
    assert_eq!(table(&mut c), written[1..]);
    let out = settings(&s.conf, &["unset", "bob@b.example", "route", "MATCH"]);
    expect(&out, 65);
    assert_has!(
        stderr(&out),
        "there is no setting bob@b.example [stage-route] MATCH"
    );
    assert_eq!(table(&mut c), written[1..]);

    // A row another tool wrote that the workers ignore is listed with why, and can be
    // removed.
    c.execute(
        "INSERT INTO pepsi.settings VALUES ('dave@d.example', 'route', 'NEXT', 'ta')",
        &[],
    )
    .unwrap();
    assert_eq!(
        stdout(&settings(&s.conf, &["list", "dave@d.example"])),
        "dave@d.example [stage-route] NEXT = ta  # NEXT is never overridable per address; ignored\n"
    );
    let doc = json(&settings(&s.conf, &["list", "dave@d.example", "--json"]));
    assert_eq!(
        doc["settings"][0]["ignored"],
        "NEXT is never overridable per address; ignored"
    );
    expect(
        &settings(&s.conf, &["unset", "dave@d.example", "route", "NEXT"]),
        0,
    );
    assert_eq!(notified(&mut l, &mut c), Vec::<String>::new());
}

#[test]
fn a_value_the_stage_refuses_or_a_key_it_keeps_to_itself_is_refused_with_nothing_written() {
    let (s, mut c) = Scenario::new("settings-refused").stages(STAGES).connect();
    for (args, says) in [
        (
            [
                "set",
                "bob@b.example",
                "route",
                "MATCH",
                "recipient-domain is b.example junk",
            ],
            "pepsi.settings for bob@b.example: [stage-route] MATCH:",
        ),
        (
            [
                "set",
                "bob@b.example",
                "route",
                "MATCH",
                "sender-domain resembles x",
            ],
            "[stage-route] MATCH:",
        ),
        (
            ["set", "bob@b.example", "route", "MATCH", ""],
            "[stage-route] MATCH: is required but not set",
        ),
        (
            ["set", "bob@b.example", "route", "MAX_LIFETIME", "soon"],
            "[stage-route] MAX_LIFETIME:",
        ),
        (
            ["set", "bob@b.example", "route", "NEXT", "ta"],
            "NEXT is never overridable per address",
        ),
        (
            ["set", "bob@b.example", "route", "ELSE_STAGE", "ta"],
            "ELSE_STAGE is never overridable per address",
        ),
        (
            ["set", "bob@b.example", "run", "COMMAND", "/bin/sh"],
            "COMMAND is never overridable per address",
        ),
        (
            ["set", "bob@b.example", "route", "TIMEOUT", "5s"],
            "pepsi-stage-if allows only MAX_LIFETIME, MATCH",
        ),
        (
            ["set", "bob@b.example", "extra", "MAX_LIFETIME", "1h"],
            "there is no stage \"extra\"",
        ),
    ] {
        let out = settings(&s.conf, &args);
        expect(&out, 78);
        assert_has!(stderr(&out), says, "{args:?}: {}", both(&out));
        assert_has!(stderr(&out), "nothing changed", "{}", both(&out));
        assert_eq!(table(&mut c), [], "{args:?} wrote something");
    }
    // A stage of the overlay is a stage: once `pepsi-config set` made it, it takes
    // settings.
    let config = |args: &[&str]| {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        linked("pepsi-config", &s.conf, &args, b"")
    };
    expect(
        &config(&["set", "stage-extra", "PROGRAM", "pepsi-stage-discard"]),
        0,
    );
    expect(
        &settings(
            &s.conf,
            &["set", "bob@b.example", "extra", "MAX_LIFETIME", "1h"],
        ),
        0,
    );
    assert_eq!(
        table(&mut c),
        [row("bob@b.example", "extra", "MAX_LIFETIME", "1h")]
    );
    // A row another tool wrote that breaks the section: a change that leaves it
    // applying alone is refused, its own removal is not.
    c.batch_execute(
        "INSERT INTO pepsi.settings VALUES ('eve@e.example', 'route', 'MATCH', 'subject resembles x'), \
                                           ('eve@e.example', 'route', 'MAX_LIFETIME', '1h')",
    )
    .unwrap();
    for args in [
        &["unset", "eve@e.example", "route", "MAX_LIFETIME"][..],
        &["set", "eve@e.example", "route", "MAX_LIFETIME", "2h"],
    ] {
        let out = settings(&s.conf, args);
        expect(&out, 78);
        assert_has!(
            stderr(&out),
            "pepsi.settings for eve@e.example: [stage-route] MATCH:",
            "{}",
            both(&out)
        );
    }
    expect(
        &settings(&s.conf, &["unset", "eve@e.example", "route", "MATCH"]),
        0,
    );
    assert_eq!(
        table(&mut c)[1..],
        [row("eve@e.example", "route", "MAX_LIFETIME", "1h")]
    );
    // Usage errors name the program typed.
    let out = settings(&s.conf, &["frob"]);
    expect(&out, 64);
    assert_has!(
        stderr(&out),
        "unknown command \"frob\" (list, get, set, unset, export, import)"
    );
    assert_has!(stderr(&out), "usage: pepsi-settings [GLOBAL OPTIONS]");
    expect(&settings(&s.conf, &["set", "bob@b.example", "route"]), 64);
}

/// Values for the round trip: spaces, `#`, quotes, backslashes, tabs, line ends,
/// non-ASCII and invisible characters, trailing spaces; all a MATCH the `if` stage
/// takes.
const VALUES: &[&str] = &[
    "subject contains \"a b  # not a comment\"",
    "subject contains \"tab\there\"",
    "subject is \"quote \\\" and back\\\\slash 'single'\"",
    "subject contains \"é 日本語 ü\"",
    "subject contains \"line\nfeed\r\nand \u{202e}override \u{1b}[2J\"",
    "sender is x@y.example   ",
    "  recipient-domain is b.example",
];

/// 10,000 settings of 10,000 addresses: a MATCH of [`VALUES`] or a MAX_LIFETIME each,
/// some addresses non-ASCII, some starting with `#`.
fn many() -> Vec<(String, String, String, String)> {
    let mut rows: Vec<_> = (0..10_000)
        .map(|i| {
            let address = match i % 11 {
                0 => format!("#tag{i}@x.example"),
                1 => format!("ü{i}@bücher.example"),
                _ => format!("u{i}@d{}.example", i % 7),
            };
            if i % 2 == 0 {
                row(&address, "route", "MATCH", VALUES[i / 2 % VALUES.len()])
            } else {
                row(
                    &address,
                    "route",
                    "MAX_LIFETIME",
                    &format!("{}h", 1 + i % 48),
                )
            }
        })
        .collect();
    rows.sort();
    rows
}

/// Writes `rows` into the table directly.
fn fill(c: &mut Client, rows: &[(String, String, String, String)]) {
    let column = |f: fn(&(String, String, String, String)) -> &String| -> Vec<&str> {
        rows.iter().map(|r| f(r).as_str()).collect()
    };
    c.execute(
        "INSERT INTO pepsi.settings SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])",
        &[&column(|r| &r.0), &column(|r| &r.1), &column(|r| &r.2), &column(|r| &r.3)],
    )
    .unwrap();
}

#[test]
fn export_then_import_round_trips_ten_thousand_settings() {
    let (s, mut c) = Scenario::new("settings-roundtrip").stages(STAGES).connect();
    let original = many();
    fill(&mut c, &original);
    let out = settings(&s.conf, &["export"]);
    expect(&out, 0);
    let text = String::from_utf8(out.stdout.clone()).expect("the export is UTF-8");
    assert_eq!(
        text.lines().count(),
        10_001,
        "a header line and a line a setting"
    );
    assert!(
        text.starts_with("# pepsi-settings export"),
        "{}",
        &text[..80]
    );
    assert!(
        !text.contains(|ch: char| ch != '\t' && ch != '\n' && pepsi::escape::must_escape(ch)),
        "the export shows no control or invisible character"
    );
    let file = s.dir.write("settings.tsv", &text);

    // Into an empty table, merged: every setting added.
    c.execute("DELETE FROM pepsi.settings", &[]).unwrap();
    let out = settings(&s.conf, &["import", file.to_str().unwrap()]);
    expect(&out, 0);
    assert_has!(
        stdout(&out),
        "10000 settings imported (10000 added, 0 changed, 0 unchanged)",
        "{}",
        both(&out)
    );
    assert_eq!(table(&mut c), original);

    // Over a table that drifted, --replace: the table is the file again.
    c.batch_execute(
        "UPDATE pepsi.settings SET value = '5h' WHERE key = 'MAX_LIFETIME' AND address LIKE 'u1%'; \
         DELETE FROM pepsi.settings WHERE address LIKE 'u2%'; \
         INSERT INTO pepsi.settings VALUES ('new1@x.example', 'route', 'MAX_LIFETIME', '1h'), \
                                           ('new2@x.example', 'run', 'TIMEOUT', '1s')",
    )
    .unwrap();
    let out = settings(&s.conf, &["import", "--replace", file.to_str().unwrap()]);
    expect(&out, 0);
    assert_has!(stdout(&out), ", 2 removed)", "{}", both(&out));
    assert_eq!(table(&mut c), original);

    // `export | import --replace -`: nothing to change.
    let exported = settings(&s.conf, &["export"]);
    let args: Vec<OsString> = ["import", "--replace", "-"].map(OsString::from).to_vec();
    let out = linked("pepsi-settings", &s.conf, &args, &exported.stdout);
    expect(&out, 0);
    assert_has!(
        stdout(&out),
        "standard input: 10000 settings imported (0 added, 0 changed, 10000 unchanged, 0 removed)",
        "{}",
        both(&out)
    );
    assert_eq!(table(&mut c), original);
}

#[test]
fn an_import_with_one_bad_line_in_ten_thousand_writes_nothing_and_names_the_line() {
    let (s, mut c) = Scenario::new("settings-badline").stages(STAGES).connect();
    let before = [row("keep@x.example", "route", "MAX_LIFETIME", "1h")];
    fill(&mut c, &before);
    let lines = |bad: &str| -> String {
        (1..=10_000)
            .map(|n| {
                if n == 5_000 {
                    format!("{bad}\n")
                } else {
                    format!("u{n}@x.example\troute\tMAX_LIFETIME\t{}h\n", 1 + n % 48)
                }
            })
            .collect()
    };
    // A value the stage refuses: 78 when the settings are checked.
    let refused = s.dir.write(
        "refused.tsv",
        &lines("u5000@x.example\troute\tMATCH\tsubject resembles x"),
    );
    for replace in [false, true] {
        let mut args = vec!["import"];
        if replace {
            args.push("--replace");
        }
        args.push(refused.to_str().unwrap());
        let out = settings(&s.conf, &args);
        expect(&out, 78);
        let err = stderr(&out);
        assert_has!(
            err,
            "line 5000: pepsi.settings for u5000@x.example: [stage-route] MATCH:",
            "{}",
            both(&out)
        );
        assert_has!(err, "nothing changed");
        assert_lacks!(err, "line 4999");
        assert_lacks!(err, "line 5001");
        assert_eq!(table(&mut c), before, "nothing written");
    }
    // A key the stage keeps to itself, a stage without a section: the same.
    for (bad, says) in [
        (
            "u5000@x.example\troute\tNEXT\tta",
            "line 5000: the workers would ignore it",
        ),
        (
            "u5000@x.example\tnowhere\tMAX_LIFETIME\t1h",
            "line 5000: u5000@x.example [stage-nowhere] MAX_LIFETIME: there is no stage",
        ),
    ] {
        let file = s.dir.write("key.tsv", &lines(bad));
        let out = settings(&s.conf, &["import", file.to_str().unwrap()]);
        expect(&out, 78);
        assert_has!(stderr(&out), says, "{}", both(&out));
        assert_eq!(table(&mut c), before);
    }
    // A line that is no setting, a malformed address: 65, before anything is checked
    // against the configuration.
    for (bad, says) in [
        ("u5000@x.example\troute\tMAX_LIFETIME", "line 5000"),
        (
            "u5000@x.example route MAX_LIFETIME 1h",
            "line 5000: 1 field;",
        ),
        (
            "u5000\troute\tMAX_LIFETIME\t1h",
            "line 5000: the address \"u5000\"",
        ),
        (
            "u5000@x.example\troute\tMAX_LIFETIME\t1h\\",
            "line 5000: the value ends in a lone backslash",
        ),
    ] {
        let file = s.dir.write("format.tsv", &lines(bad));
        let out = settings(&s.conf, &["import", file.to_str().unwrap()]);
        if bad.ends_with("MAX_LIFETIME") {
            // Three fields: an empty value, which MAX_LIFETIME takes (its default).
            expect(&out, 0);
            c.execute(
                "DELETE FROM pepsi.settings WHERE address <> 'keep@x.example'",
                &[],
            )
            .unwrap();
            continue;
        }
        expect(&out, 65);
        assert_has!(stderr(&out), says, "{}", both(&out));
        assert_eq!(table(&mut c), before);
    }
    let out = settings(&s.conf, &["import", "/nonexistent/settings.tsv"]);
    expect(&out, 66);
}

#[test]
fn hostile_addresses_and_values_are_refused_or_shown_escaped() {
    let (s, mut c) = Scenario::new("settings-hostile").stages(STAGES).connect();
    let huge = format!("{}@x.example", "a".repeat(100 * 1024));
    let raw = |out: &Output| {
        let err = stderr(out);
        assert!(
            !err.contains(['\r', '\u{202e}', '\u{1b}']),
            "raw control on stderr: {err:?}"
        );
        assert!(err.len() < 4096, "the refusal quotes little: {}", err.len());
    };
    for address in [
        "a\r\nb@x.example",
        "a\u{202e}b@x.example",
        "\u{1b}[2J@x.example",
        &huge,
    ] {
        let out = settings(&s.conf, &["set", address, "route", "MAX_LIFETIME", "1h"]);
        expect(&out, 65);
        assert_has!(stderr(&out), "the address", "{}", both(&out));
        raw(&out);
        let out = settings(&s.conf, &["get", address]);
        expect(&out, 0);
        assert!(
            !stdout(&out).contains(['\r', '\u{202e}', '\u{1b}']),
            "{}",
            both(&out)
        );
        let out = settings(&s.conf, &["unset", address, "route", "MAX_LIFETIME"]);
        expect(&out, 65);
        raw(&out);
    }
    let huge_value = format!("subject contains \"{}\"", "v".repeat(100 * 1024));
    let out = settings(
        &s.conf,
        &["set", "a@x.example", "route", "MATCH", &huge_value],
    );
    expect(&out, 65);
    assert_has!(stderr(&out), "at most 8192 are allowed", "{}", both(&out));
    raw(&out);
    assert_eq!(table(&mut c), []);

    // A value the stage takes may hold anything: kept exactly, shown escaped.
    let value = "subject contains \"a\r\nb \u{202e}c\u{1b}[2J\"";
    let out = settings(&s.conf, &["set", "a@x.example", "route", "MATCH", value]);
    expect(&out, 0);
    assert_eq!(table(&mut c), [row("a@x.example", "route", "MATCH", value)]);
    let escaped = "subject contains \"a\\r\\nb \\u{202e}c\\u{1b}[2J\"";
    assert_has!(stdout(&out), escaped, "{}", both(&out));
    for args in [&["list"][..], &["get", "a@x.example"], &["export"]] {
        let out = settings(&s.conf, args);
        expect(&out, 0);
        let text = stdout(&out);
        assert!(
            !text.contains(['\r', '\u{202e}', '\u{1b}']),
            "{args:?}: {text:?}"
        );
        assert_has!(text, escaped, "{args:?}");
    }
    let doc = json(&settings(&s.conf, &["list", "--json"]));
    assert_eq!(doc["settings"][0]["value"], value, "JSON gives it exactly");
    // An import line with an escaped control in its address is refused by line.
    let file = s.dir.write(
        "hostile.tsv",
        "# x\nr\\u{202e}@x.example\troute\tMAX_LIFETIME\t1h\n",
    );
    let out = settings(&s.conf, &["import", file.to_str().unwrap()]);
    expect(&out, 65);
    assert_has!(stderr(&out), "line 2: the address \"r\\u{202e}@x.example\"");
    raw(&out);
}

#[test]
fn pepsi_config_check_json_prints_what_pepsi_queue_config_check_json_prints() {
    let s = Scenario::new("settings-config").stages(STAGES).build();
    let bad = s.dir.write(
        "bad.conf",
        "[stage-a]\nNEXT = nowhere\n\n[stage-b]\nPROGRAM = /bin/true\nFROB = 1\n",
    );
    for (conf, code) in [(s.conf.clone(), 0), (bad, 78)] {
        for extra in [&["--json"][..], &[]] {
            let mut args = vec!["config", "check"];
            args.extend_from_slice(extra);
            let theirs = queue(&conf, &args);
            let ours: Vec<OsString> = args[1..].iter().map(OsString::from).collect();
            let ours = linked("pepsi-config", &conf, &ours, b"");
            expect(&ours, code);
            assert_eq!(ours.status.code(), theirs.status.code(), "{}", both(&ours));
            assert_eq!(stdout(&ours), stdout(&theirs), "{}", both(&ours));
            assert!(!stdout(&ours).is_empty());
        }
    }
    let help = linked("pepsi-config", &s.conf, &[OsString::from("--help")], b"");
    expect(&help, 0);
    assert!(
        stdout(&help).starts_with("usage: pepsi-config "),
        "{}",
        both(&help)
    );
    let out = linked("pepsi-config", &s.conf, &[OsString::from("frob")], b"");
    expect(&out, 64);
    assert_has!(stderr(&out), "usage: pepsi-config [GLOBAL OPTIONS]");
}

#[test]
fn a_running_dispatchers_workers_use_a_new_setting_after_set_without_restart() {
    let scenario = Scenario::new("settings-live");
    let out = scenario.dir().path("out");
    let mut stages = String::from(
        "[stage-route]\nPROGRAM = {if}\nMATCH = recipient-domain is a.example\nNEXT = ta\nELSE_STAGE = tb\n\n",
    );
    for stage in ["ta", "tb"] {
        let dir = out.join(stage);
        crate::util::shared_dir(&dir);
        let script = scenario.dir().write(
            &format!("{stage}.sh"),
            &format!("#!/bin/sh\ncat > {}/$PEPSI_ID\n", dir.display()),
        );
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        stages.push_str(&format!(
            "[stage-{stage}]\nPROGRAM = {{exec}}\nCOMMAND = {}\n\n",
            script.display()
        ));
    }
    let (s, mut c) = scenario.timers("").stages(&stages).connect();
    let mut d = s.start();
    let went = |c: &mut Client, id: i64| -> &'static str {
        wait_until(Duration::from_secs(30), "the message is delivered", || {
            crate::util::row_at(c, id).is_none()
        });
        match (
            out.join("ta").join(id.to_string()).exists(),
            out.join("tb").join(id.to_string()).exists(),
        ) {
            (true, false) => "ta",
            (false, true) => "tb",
            other => panic!("message {id} went to {other:?}"),
        }
    };
    let first = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(went(&mut c, first), "tb", "{}", d.log());
    let pid = d.pid();
    let out_set = settings(
        &s.conf,
        &[
            "set",
            "R@B.example",
            "route",
            "MATCH",
            "recipient-domain is b.example",
        ],
    );
    expect(&out_set, 0);
    let second = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(
        went(&mut c, second),
        "ta",
        "the new setting applies: {}",
        d.log()
    );
    let other = inject(&mut c, "route", "s@x.example", &["q@b.example"]);
    assert_eq!(went(&mut c, other), "tb", "only for that address");
    expect(
        &settings(&s.conf, &["unset", "r@b.example", "route", "MATCH"]),
        0,
    );
    let third = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(went(&mut c, third), "tb", "and no more once unset");
    assert_eq!(d.pid(), pid);
    assert!(d.terminate().success(), "{}", d.log());
}
