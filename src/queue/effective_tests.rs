//! The tests of `config show` ([`super::effective`]): whole configurations read from
//! text, overlays laid over them, and the text and JSON they give. A file of their own,
//! beside the code, so that neither grows past the length a file may have. Test code
//! only.

use std::path::Path;

use serde_json::{Value as Json, json};

use super::effective::*;
use crate::config::graph::OverrideRow;
use crate::config::{Config, Origin, raw};

/// A configuration read from `/e.conf`.
fn config(text: &str) -> Config {
    let path = Path::new("/e.conf");
    Config::from_sections(path.to_path_buf(), raw::parse(path, text).unwrap()).unwrap()
}

/// An overlay row.
fn row(section: &str, key: &str, value: &str) -> OverrideRow {
    OverrideRow {
        section: section.into(),
        key: key.into(),
        value: value.into(),
    }
}

/// The stages `in` → `out`, with the keys on known lines.
const FILE: &str = "[pepsi]\nRUN_AS = root\n\
                    [stage-in]\nPROGRAM = /bin/true\nNEXT = out\nPARALLELISM = 8\nNOTE = file\n\
                    [stage-out]\nPROGRAM = /bin/true\n";

/// The shown key `key` of `section`.
fn key<'a>(shown: &'a Effective, section: &str, key: &str) -> &'a ShownKey {
    shown
        .sections
        .iter()
        .find(|s| s.name == section)
        .and_then(|s| s.keys.iter().find(|k| k.key == key))
        .unwrap_or_else(|| panic!("no [{section}] {key} in {shown:#?}"))
}

/// Line `line` of `/e.conf`.
fn at(line: u32) -> Origin {
    Origin::File {
        path: Path::new("/e.conf").into(),
        line,
    }
}

#[test]
fn an_overlay_value_names_the_file_value_it_replaces_and_a_file_value_its_line() {
    let shown = Effective::of(
        &config(FILE),
        &[
            row("stage-in", "PARALLELISM", "2"),
            row("stage-new", "PROGRAM", "/bin/true"),
        ],
    );
    assert!(shown.runs(), "{:?}", shown.errors);
    let parallelism = key(&shown, "stage-in", "PARALLELISM");
    assert_eq!(parallelism.value.as_deref(), Some("2"));
    assert_eq!(parallelism.origin, Origin::Override);
    let old = parallelism.replaces.as_ref().unwrap();
    assert_eq!((old.text.as_str(), &old.origin), ("8", &at(6)));
    let next = key(&shown, "stage-in", "NEXT");
    assert_eq!((next.origin.clone(), next.replaces.clone()), (at(5), None));
    let new = shown
        .sections
        .iter()
        .find(|s| s.name == "stage-new")
        .unwrap();
    assert_eq!(new.origin, Origin::Override);
    assert_eq!(shown.sections[0].origin, at(3));

    let text = shown.text();
    assert!(text.contains("the dispatcher runs it as shown\n"), "{text}");
    assert!(text.contains("\n[stage-in]  "), "{text}");
    let line = |start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} in\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        line("  PARALLELISM = 2"),
        "PARALLELISM = 2 overlay, replacing \"8\" from /e.conf:6"
    );
    assert_eq!(line("  NEXT = out"), "NEXT = out /e.conf:5");
    assert_eq!(line("[stage-new]"), "[stage-new] overlay");
    assert!(!text.contains("left out"), "{text}");
}

#[test]
fn the_common_keys_a_section_leaves_out_show_their_defaults() {
    let shown = Effective::of(&config(FILE), &[]);
    let names: Vec<&str> = shown.sections[1]
        .keys
        .iter()
        .map(|k| k.key.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "MAX_LIFETIME",
            "MAX_MESSAGES",
            "PARALLELISM",
            "PROGRAM",
            "QUEUE_LIMIT"
        ]
    );
    let lifetime = key(&shown, "stage-out", "MAX_LIFETIME");
    assert_eq!(lifetime.value.as_deref(), Some("5d"));
    assert_eq!(lifetime.origin, Origin::Default);
    assert_eq!(key(&shown, "stage-in", "PARALLELISM").origin, at(6));
    // A section that fails its check shows what it sets and no default.
    let shown = Effective::of(&config(FILE), &[row("stage-bare", "NEXT", "out")]);
    assert!(!shown.runs());
    let bare = shown
        .sections
        .iter()
        .find(|s| s.name == "stage-bare")
        .unwrap();
    assert_eq!(bare.keys.len(), 1, "{bare:?}");
}

#[test]
fn a_key_the_overlay_unsets_shows_the_file_value_and_any_default() {
    let shown = Effective::of(
        &config(FILE),
        &[
            row("stage-in", "NOTE", ""),
            row("stage-in", "PARALLELISM", " "),
            row("stage-out", "EXTRA", ""),
        ],
    );
    let note = key(&shown, "stage-in", "NOTE");
    assert_eq!((note.value.clone(), note.unset), (None, true));
    assert_eq!(note.origin, Origin::Override);
    assert_eq!(note.replaces.as_ref().unwrap().origin, at(7));
    let parallelism = key(&shown, "stage-in", "PARALLELISM");
    assert_eq!(parallelism.value.as_deref(), Some("4"));
    assert_eq!(
        (parallelism.origin.clone(), parallelism.unset),
        (Origin::Default, true)
    );
    let extra = key(&shown, "stage-out", "EXTRA");
    assert_eq!((extra.unset, extra.replaces.clone()), (true, None));
    let text = shown.text();
    assert!(
        text.contains("  NOTE (unset)  ")
            && text.contains("overlay, replacing \"file\" from /e.conf:7"),
        "{text}"
    );
    assert!(
        text.contains("default (unset in the overlay), replacing \"8\" from /e.conf:6"),
        "{text}"
    );
    let j = shown.json();
    let keys = &j["stages"][0]["keys"];
    let note = keys
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == "NOTE")
        .unwrap();
    assert_eq!(note["value"], Json::Null);
    assert_eq!(note["unset"], true);
    assert_eq!(note["from"], "overlay");
    assert_eq!(
        note["replaces"],
        json!({"value": "file", "from": "file", "file": "/e.conf", "line": 7})
    );
}

#[test]
fn rows_the_dispatcher_leaves_out_are_listed_with_why() {
    let overlay = [
        row("stage-out", "COMMAND", "/bin/sh"),
        row("pepsi", "RUN_AS", "nobody"),
        row("stage-out", "QUEUE_LIMIT", "2"),
    ];
    let shown = Effective::of(&config(FILE), &overlay);
    assert!(
        shown.runs(),
        "a refused or ignored row stops nothing: {:?}",
        shown.errors
    );
    let kinds: Vec<(&str, LeftOutKind)> = shown
        .left_out
        .iter()
        .map(|l| (l.row.key.as_str(), l.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("COMMAND", LeftOutKind::Refused),
            ("RUN_AS", LeftOutKind::Ignored)
        ]
    );
    assert!(
        shown.left_out[0].why.contains("COMMAND"),
        "{:?}",
        shown.left_out
    );
    assert_eq!(
        key(&shown, "stage-out", "QUEUE_LIMIT").origin,
        Origin::Override
    );
    assert!(
        !shown.sections[1].keys.iter().any(|k| k.key == "COMMAND"),
        "a refused row is not laid over"
    );
    let text = shown.text();
    assert!(text.contains("\noverlay rows left out:\n"), "{text}");
    assert!(
        text.contains("  [stage-out] COMMAND = /bin/sh  refused: "),
        "{text}"
    );
    assert!(
        text.contains("  [pepsi] RUN_AS = nobody        ignored: only [stage-*]"),
        "the reasons are aligned: {text}"
    );
    let j = shown.json();
    assert_eq!(j["left_out"][0]["kind"], "refused");
    assert_eq!(j["left_out"][1]["section"], "pepsi");
    assert_eq!(j["left_out"][1]["value"], "nobody");
}

#[test]
fn a_graph_the_dispatcher_refuses_is_shown_with_every_reason() {
    let overlay = [
        row("stage-in", "NEXT", "nowhere"),
        row("stage-a b", "NEXT", "out"),
    ];
    let shown = Effective::of(&config(FILE), &overlay);
    assert!(!shown.runs());
    assert_eq!(shown.left_out.len(), 1);
    assert_eq!(shown.left_out[0].kind, LeftOutKind::Invalid);
    let text = shown.text();
    assert!(
        text.contains("the dispatcher refuses it (exit 1 at start, 78 at a reload):\n"),
        "{text}"
    );
    assert!(
        text.contains("  error: pepsi.config_override: [stage-in] NEXT: names stage \"nowhere\""),
        "{text}"
    );
    assert!(
        text.contains("invalid: the stage name \"a b\" is not valid"),
        "{text}"
    );
    let j = shown.json();
    assert_eq!(j["runs"], false);
    assert_eq!(j["errors"].as_array().unwrap().len(), shown.errors.len());
    // The graph is shown as laid over all the same.
    assert_eq!(
        key(&shown, "stage-in", "NEXT").value.as_deref(),
        Some("nowhere")
    );
}

#[test]
fn hostile_overlay_text_is_escaped_in_the_text_and_exact_in_the_json() {
    let evil = "x\r\nforged line\u{202e}\u{1b}[2J";
    let overlay = [
        row("stage-in", "NOTE", evil),
        row("stage-in\u{202e}", "K\r\nX", evil),
        row("pepsi\u{1b}[1m", "RUN_AS", evil),
    ];
    let shown = Effective::of(&config(FILE), &overlay);
    let text = shown.text();
    for raw in ['\r', '\u{202e}', '\u{1b}'] {
        assert!(!text.contains(raw), "{raw:?} raw in\n{text}");
    }
    assert!(!text.lines().any(|l| l.starts_with("forged")), "{text}");
    let shown_evil = "x\\r\\nforged line\\u{202e}\\u{1b}[2J";
    assert!(
        text.contains(&format!(
            "  NOTE = {shown_evil}  overlay, replacing \"file\""
        )),
        "{text}"
    );
    assert!(text.contains("[stage-in\\u{202e}] K\\r\\nX = "), "{text}");
    assert!(text.contains("[pepsi\\u{1b}[1m] RUN_AS"), "{text}");
    let j = shown.json();
    let note = j["stages"][0]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == "NOTE")
        .unwrap()
        .clone();
    assert_eq!(note["value"], evil);
    assert_eq!(j["left_out"][0]["section"], "stage-in\u{202e}");
}

#[test]
fn a_long_line_does_not_widen_the_column_of_the_others() {
    let long = "x".repeat(60);
    let text = columns(&[
        ("  A = 1".into(), "here".into()),
        (format!("  B = {long}"), "there".into()),
    ]);
    assert_eq!(text, format!("  A = 1  here\n  B = {long}  there\n"));
}
