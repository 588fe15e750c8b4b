//! The overlay's tests ([`super::overlay::lay_over`] and the stage graph it gives): a
//! file of their own, since they build whole graphs (`super::graph`) and the graph
//! module uses the overlay's, so neither module's tests can live in the other without a
//! circle. Test code only.

use super::graph::StageGraph;
use super::graph::tests::{PIPE, build, row, sections};
use super::overlay::*;
use super::program_path::ProgramPath;
use super::raw::Origin;

#[test]
fn the_overlay_beats_the_file_and_can_add_stages() {
    let overlay = [
        row("stage-pass", "PARALLELISM", "7"),
        row("stage-pass", "NEXT", "extra"),
        row("stage-extra", "PROGRAM", "pepsi-stage-pass"),
        row("stage-extra", "NEXT", "discard"),
        row("pepsi", "ALLOW_FUSION", "yes"),
    ];
    let g = build(&sections(PIPE), &overlay).unwrap();
    assert_eq!(g.get("pass").unwrap().parallelism, 7);
    assert_eq!(g.get("pass").unwrap().next.as_deref(), Some("extra"));
    assert_eq!(
        g.get("pass")
            .unwrap()
            .section
            .value("PARALLELISM")
            .unwrap()
            .origin,
        Origin::Override
    );
    assert!(g.contains("extra"));
}

#[test]
fn an_overlay_error_names_the_overlay() {
    let errs = build(&sections(PIPE), &[row("stage-pass", "QUEUE_LIMIT", "lots")]).unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        "pepsi.config_override: [stage-pass] QUEUE_LIMIT: \"lots\" is not a whole number"
    );
    let errs = build(&sections(PIPE), &[row("stage-pass", "next", "x")]).unwrap_err();
    assert!(
        errs[0]
            .to_string()
            .starts_with("pepsi.config_override: [stage-pass] \"next\"")
    );
}

#[test]
fn an_overlay_stage_with_a_bad_name_is_an_error_naming_the_row() {
    let errs = build(
        &sections(PIPE),
        &[
            row("stage-ev\u{1b}[2Jil", "PROGRAM", "pepsi-stage-pass"),
            row("stage-a b", "NEXT", "pass"),
        ],
    )
    .unwrap_err();
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "pepsi.config_override: [stage-ev\\u{1b}[2Jil] PROGRAM: the stage name \
             \"ev\\u{1b}[2Jil\" is not valid (a stage name is one or more ASCII letters, \
             digits, '.', '_' and '-')",
            "pepsi.config_override: [stage-a b] NEXT: the stage name \"a b\" is not valid \
             (a stage name is one or more ASCII letters, digits, '.', '_' and '-')",
        ],
        "in the overlay's order, shown escaped"
    );
    let laid = lay_over(
        &sections(PIPE),
        &[row("stage-a b", "PROGRAM", "pepsi-stage-pass")],
        &ProgramPath::default(),
    );
    assert!(!laid.sections.contains_key("stage-a b"), "left out");
    assert_eq!(laid.errors.len(), 1);
}

#[test]
fn overlay_rows_outside_stage_sections_are_warnings() {
    let laid = lay_over(
        &sections(PIPE),
        &[row("pepsi", "ALLOW_FUSION", "yes")],
        &ProgramPath::default(),
    );
    assert!(laid.errors.is_empty());
    assert_eq!(
        laid.warnings[0].to_string(),
        "pepsi.config_override: [pepsi] ALLOW_FUSION: only [stage-*] sections can be overridden; ignored"
    );
}

#[test]
fn unknown_stage_keys_are_warned_about_for_built_in_programs_only() {
    const IF: &[&str] = &["MATCH", "ELSE_STAGE"];
    let keys = |program: &str| match program.rsplit('/').next() {
        Some("pepsi-stage-if") => Some(IF),
        Some("pepsi-stage-pass") => Some(&[][..]),
        _ => None,
    };
    let laid = lay_over(
        &sections(
            "[stage-if]\nPROGRAM = pepsi-stage-if\nMATCHES = sender is x\nPARALLELSIM = 4\nELSE_STAGE = a\n\
             [stage-a]\nPROGRAM = /usr/bin/pepsi-stage-pass\nMATCH = x\n\
             [stage-ext]\nPROGRAM = /usr/lib/relay\nSMARTHOST = mx\nPARALLELSIM = 2\n",
        ),
        &[row("stage-a", "QUEUE_LIMT", "2")],
        &ProgramPath::default(),
    );
    let text: Vec<String> = crate::config::keys::unknown_keys(laid.sections.values(), keys)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        text,
        [
            "/g.conf:8: [stage-a] MATCH: unknown key of pepsi-stage-pass, ignored",
            "pepsi.config_override: [stage-a] QUEUE_LIMT: unknown key of pepsi-stage-pass, ignored; did you mean QUEUE_LIMIT?",
            "/g.conf:3: [stage-if] MATCHES: unknown key of pepsi-stage-if, ignored; did you mean MATCH?",
            "/g.conf:4: [stage-if] PARALLELSIM: unknown key of pepsi-stage-if, ignored; did you mean PARALLELISM?",
        ]
    );
}

#[test]
fn an_overlay_command_or_user_is_left_out_and_an_overlay_exec_stage_has_no_command() {
    let file =
        sections("[stage-deliver]\nPROGRAM = pepsi-stage-exec\nCOMMAND = /usr/lib/pepsi/deliver\n");
    let laid = lay_over(
        &file,
        &[
            row("stage-deliver", "COMMAND", "/bin/sh -c id"),
            row("stage-deliver", "USER", "root"),
            row("stage-new", "PROGRAM", "/usr/bin/pepsi-stage-exec"),
            row("stage-new", "COMMAND", "/bin/sh -c id"),
            row("stage-deliver", "TIMEOUT", "5s"),
        ],
        &ProgramPath::default(),
    );
    let refused: Vec<String> = laid.refused.iter().map(ToString::to_string).collect();
    assert_eq!(refused.len(), 3, "{refused:?}");
    assert!(
        refused[0].starts_with(
            "pepsi.config_override: [stage-deliver] COMMAND: COMMAND is refused: the overlay may not set"
        ),
        "{}",
        refused[0]
    );
    assert!(refused[1].contains("[stage-deliver] USER: USER is refused"));
    assert!(refused[2].contains("[stage-new] COMMAND: COMMAND is refused"));
    assert_eq!(
        laid.sections["stage-deliver"].get("COMMAND"),
        Some("/usr/lib/pepsi/deliver"),
        "the file's command stays"
    );
    assert_eq!(laid.sections["stage-deliver"].get("TIMEOUT"), Some("5s"));
    assert_eq!(
        laid.sections["stage-new"].get("COMMAND"),
        None,
        "an overlay-only exec stage gets no command"
    );
}

#[test]
fn an_overlay_program_outside_program_path_is_left_out_unless_the_file_names_it() {
    let file = sections(
        "[stage-a]\nPROGRAM = /opt/site/relay\nNEXT = b\n[stage-b]\nPROGRAM = pepsi-stage-discard\n",
    );
    let default = ProgramPath::default();
    // Refused: outside, relative, with "..", a prefix that is no directory.
    for value in [
        "/tmp/x",
        "/usr/bin/sh",
        "/usr/bin/../../tmp/x",
        "/usr/binx/foo",
        "/opt/site/relay2",
        "/tmp/pepsi-stage-pass",
    ] {
        let laid = lay_over(&file, &[row("stage-a", "PROGRAM", value)], &default);
        assert_eq!(laid.refused.len(), 1, "{value}");
        let text = laid.refused[0].to_string();
        assert!(
            text.starts_with(&format!(
                "pepsi.config_override: [stage-a] PROGRAM: {value:?} is refused: "
            )),
            "{text}"
        );
        assert_eq!(
            laid.sections["stage-a"].get("PROGRAM"),
            Some("/opt/site/relay"),
            "the file's PROGRAM stays: {value}"
        );
    }
    // Accepted: a built-in stage program, under PROGRAM_PATH, or exactly as the file
    // names it (any stage).
    for value in [
        "/usr/bin/pepsi-stage-pass",
        "pepsi-stage-pass",
        "/usr/lib/pepsi/relay",
        "/opt/site/relay",
        "pepsi-stage-discard",
        "",
    ] {
        let laid = lay_over(&file, &[row("stage-a", "PROGRAM", value)], &default);
        assert!(laid.refused.is_empty(), "{value}: {:?}", laid.refused);
    }
    // none: only what the file names.
    let none = ProgramPath::none();
    let laid = lay_over(
        &file,
        &[
            row("stage-a", "PROGRAM", "/usr/bin/pepsi-stage-pass"),
            row("stage-c", "PROGRAM", "pepsi-stage-discard"),
            row("stage-c", "NEXT", "a"),
        ],
        &none,
    );
    assert_eq!(laid.refused.len(), 1);
    assert!(laid.refused[0].to_string().contains("PROGRAM_PATH is none"));
    assert_eq!(
        laid.sections["stage-c"].get("PROGRAM"),
        Some("pepsi-stage-discard"),
        "the rest of the overlay applies"
    );
    // The graph is built without the refused row.
    let g = StageGraph::build(&file, &[row("stage-a", "PROGRAM", "/tmp/x")], &default).unwrap();
    assert_eq!(g.get("a").unwrap().program, "/opt/site/relay");
    // An overlay-only stage whose PROGRAM is refused has none: an invalid graph.
    let errs = StageGraph::build(
        &file,
        &[
            row("stage-n", "PROGRAM", "/tmp/x"),
            row("stage-n", "NEXT", "b"),
        ],
        &default,
    )
    .unwrap_err();
    assert!(
        errs[0]
            .to_string()
            .contains("[stage-n] PROGRAM: is required but not set"),
        "{errs:?}"
    );
}

#[test]
fn an_empty_overlay_value_unsets_a_key() {
    let g = build(&sections(PIPE), &[row("stage-pass", "PARALLELISM", "")]).unwrap();
    assert_eq!(g.get("pass").unwrap().parallelism, 4);
}
