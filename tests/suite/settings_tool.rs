//! `pepsi-settings` (`src/queue/settings/`), run through a link named after it to the
//! `pepsi-queue` binary as the package installs it: the per-address settings read and
//! written, every write checked by the stage's own rules before anything is written,
//! `export` and `import` round-tripping the table, hostile input refused or shown
//! escaped, and a running dispatcher's workers using a new setting at once. Also
//! `pepsi-config`, the other name of the binary, whose `check` is `pepsi-queue config
//! check`.

mod live;
mod transfer;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use postgres::Client;

use crate::util::notify::notified;
use crate::util::queue::{both, expect, json, listener, queue};
use crate::util::{Scenario, assert_has, bin, stderr, stdout};

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
        "unknown command \"frob\" (list, get, set, unset, export, import, weight, rate, \
         weights, tenant, tenants, tenant-of)"
    );
    assert_has!(stderr(&out), "usage: pepsi-settings [GLOBAL OPTIONS]");
    expect(&settings(&s.conf, &["set", "bob@b.example", "route"]), 64);
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
