//! `pepsi-config`, run as `pepsi-queue config` (the same program): `show` prints the
//! stage graph the dispatcher runs, each value with where it comes from (`FILE:LINE`,
//! `overlay` with the file's value it replaces, `default`), and the overlay rows it
//! leaves out; `show --json` gives the same as one document; a hostile value stored in
//! the overlay reaches the terminal escaped (`src/queue/effective.rs`).

use std::path::Path;

use crate::util::queue::{STAGES, both, expect, json, nothing_raw, queue};
use crate::util::{Scenario, assert_has, stdout};

/// The stages `in` → `relay`, `in` with its own `PARALLELISM`.
const PIPE: &str = "[stage-in]\nPROGRAM = /bin/true\nNEXT = relay\nPARALLELISM = 3\n\n\
                    [stage-relay]\nPROGRAM = /bin/true\n";

/// `FILE:LINE` of the line of `conf` that is exactly `text`.
#[track_caller]
fn place(conf: &Path, text: &str) -> String {
    let file = std::fs::read_to_string(conf).unwrap();
    let line = file
        .lines()
        .position(|l| l == text)
        .unwrap_or_else(|| panic!("no line {text:?} in\n{file}"));
    format!("{}:{}", conf.display(), line + 1)
}

/// The line of `text` that starts with `start`, its runs of spaces made one.
#[track_caller]
fn line_of(text: &str, start: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?} in\n{text}"))
        .split(' ')
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn pepsi_config_show_marks_overlay_values_and_the_file_values_they_replace() {
    let s = Scenario::new("cfg-show").stages(PIPE).build();
    let conf = &s.conf;
    let file_parallelism = place(conf, "PARALLELISM = 3");
    let file_next = place(conf, "NEXT = relay");

    // The file alone: every value from its line, the common keys it leaves out at their
    // defaults.
    let out = queue(conf, &["config", "show"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert_has!(text, "the dispatcher runs it as shown\n");
    assert_eq!(
        line_of(&text, "  PARALLELISM = "),
        format!("PARALLELISM = 3 {file_parallelism}")
    );
    assert_eq!(
        line_of(&text, "  QUEUE_LIMIT = "),
        "QUEUE_LIMIT = 4 default"
    );

    expect(
        &queue(conf, &["config", "set", "stage-in", "PARALLELISM", "7"]),
        0,
    );
    expect(
        &queue(
            conf,
            &["config", "set", "stage-new", "PROGRAM", "/bin/true"],
        ),
        0,
    );
    let out = queue(conf, &["config", "show"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert_eq!(
        line_of(&text, "  PARALLELISM = 7"),
        format!("PARALLELISM = 7 overlay, replacing \"3\" from {file_parallelism}"),
        "{}",
        both(&out)
    );
    assert_eq!(
        line_of(&text, "  NEXT = "),
        format!("NEXT = relay {file_next}"),
        "a key only the file sets shows its line"
    );
    assert_eq!(
        line_of(&text, "[stage-in]"),
        format!("[stage-in] {}", place(conf, "[stage-in]"))
    );
    assert_eq!(line_of(&text, "[stage-new]"), "[stage-new] overlay");
    assert!(!text.contains("PARALLELISM = 3"), "{text}");

    // An overlay row with an empty value unsets the file's key: the default applies.
    expect(
        &queue(conf, &["config", "set", "stage-in", "PARALLELISM", ""]),
        0,
    );
    let text = stdout(&queue(conf, &["config", "show"]));
    assert_eq!(
        line_of(&text, "  PARALLELISM = "),
        format!(
            "PARALLELISM = 4 default (unset in the overlay), replacing \"3\" from {file_parallelism}"
        )
    );
    // Unset from the overlay, the file's value is back.
    expect(
        &queue(conf, &["config", "unset", "stage-in", "PARALLELISM"]),
        0,
    );
    let text = stdout(&queue(conf, &["config", "show"]));
    assert_eq!(
        line_of(&text, "  PARALLELISM = "),
        format!("PARALLELISM = 3 {file_parallelism}")
    );
    // `show` takes no operand, and nothing but --json.
    expect(&queue(conf, &["config", "show", "stage-in"]), 64);
    expect(&queue(conf, &["config", "show", "--all"]), 64);
}

#[test]
fn pepsi_config_show_json_parses_and_has_the_overlay_value() {
    let (s, mut c) = Scenario::new("cfg-show-json").stages(PIPE).connect();
    let conf = &s.conf;
    expect(
        &queue(conf, &["config", "set", "stage-in", "PARALLELISM", "7"]),
        0,
    );
    // A row the dispatcher leaves out, written as any writer of the overlay could.
    c.execute(
        "INSERT INTO pepsi.config_override (section, key, value) \
         VALUES ('stage-relay', 'COMMAND', '/bin/sh')",
        &[],
    )
    .unwrap();
    let out = queue(conf, &["config", "show", "--json"]);
    expect(&out, 0);
    let doc = json(&out);
    assert_eq!(doc["file"], conf.display().to_string());
    assert_eq!(doc["runs"], true, "{}", both(&out));
    assert_eq!(doc["errors"], serde_json::json!([]));
    let stage = |name: &str| {
        doc["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("no stage {name} in {doc}"))
            .clone()
    };
    let key = |stage: &serde_json::Value, key: &str| {
        stage["keys"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["key"] == key)
            .unwrap_or_else(|| panic!("no {key} in {stage}"))
            .clone()
    };
    let line = |text: &str| -> u64 {
        place(conf, text)
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let inbound = stage("in");
    assert_eq!(inbound["section"], "stage-in");
    assert_eq!(inbound["from"], "file");
    assert_eq!(inbound["line"], line("[stage-in]"));
    let parallelism = key(&inbound, "PARALLELISM");
    assert_eq!(parallelism["value"], "7");
    assert_eq!(parallelism["from"], "overlay");
    assert_eq!(parallelism["file"], serde_json::Value::Null);
    assert_eq!(parallelism["unset"], false);
    assert_eq!(
        parallelism["replaces"],
        serde_json::json!({
            "value": "3",
            "from": "file",
            "file": conf.display().to_string(),
            "line": line("PARALLELISM = 3"),
        })
    );
    let next = key(&inbound, "NEXT");
    assert_eq!(next["value"], "relay");
    assert_eq!(next["from"], "file");
    assert_eq!(next["line"], line("NEXT = relay"));
    assert_eq!(next["replaces"], serde_json::Value::Null);
    assert_eq!(key(&inbound, "QUEUE_LIMIT")["from"], "default");
    let relay = stage("relay");
    assert!(
        relay["keys"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["key"] != "COMMAND"),
        "a row the dispatcher leaves out is not in the graph: {relay}"
    );
    let left_out = doc["left_out"].as_array().unwrap();
    assert_eq!(left_out.len(), 1, "{doc}");
    assert_eq!(left_out[0]["section"], "stage-relay");
    assert_eq!(left_out[0]["key"], "COMMAND");
    assert_eq!(left_out[0]["value"], "/bin/sh");
    assert_eq!(left_out[0]["kind"], "refused");
    assert!(
        left_out[0]["why"].as_str().unwrap().contains("COMMAND"),
        "{doc}"
    );

    // A graph the dispatcher would refuse is shown all the same, with why; show exits 0.
    c.execute(
        "INSERT INTO pepsi.config_override (section, key, value) \
         VALUES ('stage-in', 'NEXT', 'nowhere')",
        &[],
    )
    .unwrap();
    let out = queue(conf, &["config", "show", "--json"]);
    expect(&out, 0);
    let doc = json(&out);
    assert_eq!(doc["runs"], false);
    let errors = doc["errors"].as_array().unwrap();
    assert!(
        errors
            .iter()
            .any(|e| e.as_str().unwrap().contains("names stage \"nowhere\"")),
        "{doc}"
    );
    let text = stdout(&queue(conf, &["config", "show"]));
    assert_has!(
        text,
        "the dispatcher refuses it (exit 1 at start, 78 at a reload):\n  error: "
    );
}

#[test]
fn a_hostile_value_in_the_overlay_is_shown_escaped() {
    let (s, mut c) = Scenario::new("cfg-show-odd").stages(STAGES).connect();
    let conf = &s.conf;
    let odd = "x\r\nil forged\u{202e}txt.exe\u{1b}[2J";
    let odd_shown = "x\\r\\nil forged\\u{202e}txt.exe\\u{1b}[2J";
    // Set through the tool: the stage's program has no keys of its own to refuse it.
    let out = queue(conf, &["config", "set", "stage-relay", "NOTE", odd]);
    expect(&out, 0);
    // And rows the dispatcher leaves out, with hostile names, as any writer of the
    // overlay could store them.
    c.execute(
        "INSERT INTO pepsi.config_override (section, key, value) VALUES \
         ('stage-in' || chr(8238), 'K' || chr(13) || chr(10) || 'il', $1), \
         ('pepsi' || chr(27) || '[1m', 'RUN_AS', $1)",
        &[&odd],
    )
    .unwrap();
    let out = queue(conf, &["config", "show"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert_eq!(
        line_of(&text, "  NOTE = "),
        format!("NOTE = {odd_shown} overlay"),
        "{}",
        both(&out)
    );
    assert_has!(
        text,
        &format!("  [stage-in\\u{{202e}}] K\\r\\nil = {odd_shown}")
    );
    assert_has!(text, &format!("  [pepsi\\u{{1b}}[1m] RUN_AS = {odd_shown}"));
    assert_has!(text, "the dispatcher refuses it");
    // The JSON gives the value exactly.
    let doc = json(&queue(conf, &["config", "show", "--json"]));
    let relay = doc["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "relay")
        .unwrap()
        .clone();
    let note = relay["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == "NOTE")
        .unwrap()
        .clone();
    assert_eq!(note["value"], odd);
}
