//! `pepsi-settings export` and `import`: ten thousand settings round-trip, and an
//! import with one bad line writes nothing and names the line.

use postgres::Client;

use super::{STAGES, linked, row, settings, table};
use crate::util::queue::{both, expect};
use crate::util::{Scenario, assert_has, assert_lacks, stderr, stdout};
use std::ffi::OsString;

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
