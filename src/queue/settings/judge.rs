//! What a per-address setting must be before `pepsi-settings` writes it, judged by the
//! same rules the workers and `pepsi-dispatch check` apply to the rows they read
//! (§4 "Least privilege", §12.5):
//! - its address, lower-cased, a mailbox ([`crate::mailbox::check`]), and its value at
//!   most [`MAX_VALUE_BYTES`] long — the setting's own data ([`address`], [`value`]);
//! - its stage a stage of the graph the dispatcher would run with the file and the
//!   overlay, and its key one that stage lets a correspondent override
//!   ([`settings::refusal`]) — [`Judge::names`];
//! - the address's settings at that stage, laid over the stage's section exactly as a
//!   worker lays them ([`settings::apply`]), passing the section's own check and the
//!   built-in stage's `configure` ([`stages::check_section`]) — [`Judge::values`], as
//!   `check/address_settings.rs` judges the rows already written.
//!
//! Pure: the caller reads the overlay and the rows; nothing here touches the database.
//! Used by `write.rs` (set, unset, import), `import.rs` (the data of each line) and
//! `show.rs` (which rows the workers ignore, and why).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::graph::{self, OverrideRow};
use crate::config::{Config, ConfigError, StageGraph};
use crate::escape::Visible;
use crate::mailbox;
use crate::queue::format::shown;
use crate::stages;
use crate::worker::settings::{self, Overrides, SettingRow};

/// The longest value a setting may have, in bytes (UTF-8). The workers load an
/// address's settings with every one of its messages; no option of a stage a
/// correspondent may override needs more.
pub const MAX_VALUE_BYTES: usize = 8192;

/// How many characters of a refused value or address a message quotes.
const QUOTED: usize = 80;

/// The address as the table holds it (lower-cased, as the workers look it up), or why
/// it is no mailbox.
pub fn address(given: &str) -> Result<String, String> {
    let lower = given.to_lowercase();
    mailbox::check(&lower)
        .map(|()| lower)
        .map_err(|why| format!("the address {} {why}", quoted(given)))
}

/// Checks a value's length.
pub fn value(given: &str) -> Result<(), String> {
    if given.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "the value is {} bytes long; at most {MAX_VALUE_BYTES} are allowed",
            given.len()
        ));
    }
    Ok(())
}

/// A text from the command line, a file or the database, quoted for a message:
/// escaped and cut short ([`shown`]).
pub fn quoted(text: &str) -> String {
    format!("\"{}\"", shown(text, QUOTED))
}

/// A setting named for people: `ADDRESS [stage-STAGE] KEY`, escaped.
pub fn named(address: &str, stage: &str, key: &str) -> String {
    format!(
        "{} [{}{}] {}",
        shown(address, QUOTED),
        graph::STAGE_PREFIX,
        shown(stage, QUOTED),
        shown(key, QUOTED)
    )
}

/// The stages a change is judged against: the graph the dispatcher would run with the
/// file and the overlay, and its `MAX_RUNTIME`.
pub struct Judge {
    graph: StageGraph,
    max_runtime: Duration,
}

impl Judge {
    /// The graph of `config`'s file with `overlay` laid over it; every problem when the
    /// dispatcher would not run it (no stage of it can then be judged).
    pub fn new(config: &Config, overlay: &[OverrideRow]) -> Result<Judge, Vec<ConfigError>> {
        let graph = StageGraph::build(&config.stage_sections, overlay, &config.pepsi.program_path)?;
        Ok(Judge {
            graph,
            max_runtime: config.dispatch.max_runtime,
        })
    }

    /// Is there a stage of this name.
    pub fn has_stage(&self, stage: &str) -> bool {
        self.graph.contains(stage)
    }

    /// Why a setting's stage or key is refused: a stage without a section, or a key
    /// the stage does not let a correspondent override (the workers would ignore it).
    pub fn names(&self, row: &SettingRow) -> Option<String> {
        let Some(section) = self.graph.get(&row.stage) else {
            return Some(format!(
                "{}: there is no stage {} (no [stage-{}] section in the file or the overlay)",
                named(&row.address, &row.stage, &row.key),
                quoted(&row.stage),
                shown(&row.stage, QUOTED)
            ));
        };
        settings::refusal(stages::REGISTRY, row, Some(&section.program))
            .map(|e| format!("the workers would ignore it: {e}"))
    }

    /// Does a row apply at its stage (the rows the workers would drop do not count when
    /// an address's settings are laid over a section)?
    pub fn applies(&self, row: &SettingRow) -> bool {
        let program = self.graph.get(&row.stage).map(|s| s.program.as_str());
        settings::applies(stages::REGISTRY, &row.key, program)
    }

    /// The problems (errors, then warnings) of `address`'s `overrides` at `stage` laid
    /// over its section, as a worker lays them for a message of that address. A stage
    /// without a section has none here ([`Judge::names`] refuses it).
    pub fn values(
        &self,
        address: &str,
        stage: &str,
        overrides: &Overrides,
    ) -> (Vec<ConfigError>, Vec<ConfigError>) {
        let Some(section) = self.graph.get(stage) else {
            return (Vec::new(), Vec::new());
        };
        match settings::apply(section, overrides, address, &self.graph) {
            Ok(applied) => {
                // A setting may make the stage outlast MAX_RUNTIME (a command's
                // TIMEOUT), as the file's section may: the warning `check` gives,
                // unless the file's section draws it already.
                let warnings = stages::for_program(&applied.program)
                    .filter(|b| {
                        b.runtime_warning(&section.section, self.max_runtime)
                            .is_none()
                    })
                    .and_then(|b| b.runtime_warning(&applied.section, self.max_runtime))
                    .into_iter()
                    .collect();
                let errors = stages::check_section(&applied)
                    .and_then(Result::err)
                    .into_iter()
                    .collect();
                (errors, warnings)
            }
            Err(errors) => (errors, Vec::new()),
        }
    }
}

/// The programs of the stage sections of the file with the overlay laid over them, by
/// stage name, whether or not they make a valid graph: what `list` and `get` judge the
/// rows by, as `pepsi-dispatch check` does.
pub fn programs(config: &Config, overlay: &[OverrideRow]) -> BTreeMap<String, String> {
    config
        .lay_over(overlay)
        .sections
        .values()
        .filter_map(|s| {
            let stage = s.name.strip_prefix(graph::STAGE_PREFIX)?;
            Some((stage.to_string(), s.get("PROGRAM")?.to_string()))
        })
        .collect()
}

/// Why the workers ignore a row read from the table, given the stages' programs
/// ([`programs`]); `None` when they apply it.
pub fn ignored(programs: &BTreeMap<String, String>, row: &SettingRow) -> Option<String> {
    let program = programs.get(&row.stage).map(String::as_str);
    if let Some(e) = settings::refusal(stages::REGISTRY, row, program) {
        return Some(e.message);
    }
    program.is_none().then(|| {
        format!(
            "there is no [stage-{}] section; unused until there is",
            Visible(&row.stage)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw;
    use std::path::PathBuf;

    fn config() -> Config {
        let path = PathBuf::from("/t.conf");
        let text = "[stage-route]\nPROGRAM = pepsi-stage-if\nMATCH = recipient-domain is a.example\n\
                    NEXT = ta\nELSE_STAGE = tb\n\n[stage-ta]\nPROGRAM = pepsi-stage-discard\n\n\
                    [stage-tb]\nPROGRAM = pepsi-stage-discard\n\n\
                    [stage-run]\nPROGRAM = pepsi-stage-exec\nCOMMAND = /bin/cat\nNEXT = ta\n";
        Config::from_sections(path.clone(), raw::parse(&path, text).unwrap()).unwrap()
    }

    fn row(address: &str, stage: &str, key: &str, value: &str) -> SettingRow {
        SettingRow {
            address: address.into(),
            stage: stage.into(),
            key: key.into(),
            value: value.into(),
        }
    }

    #[test]
    fn an_address_is_lower_cased_and_must_be_a_mailbox_shown_escaped() {
        assert_eq!(address("Alice@Example.ORG"), Ok("alice@example.org".into()));
        for hostile in ["a\r\nb@x.example", "a\u{202e}b@x.example", "no-at-sign", ""] {
            let err = address(hostile).unwrap_err();
            assert!(!err.contains(['\r', '\n', '\u{202e}']), "{err:?}");
        }
        let long = format!("{}@x.example", "a".repeat(100_000));
        let err = address(&long).unwrap_err();
        assert!(err.contains("at most 256"), "{err}");
        assert!(
            err.len() < 400,
            "the message quotes it cut short: {}",
            err.len()
        );
        assert!(value(&"v".repeat(MAX_VALUE_BYTES)).is_ok());
        assert!(value(&"v".repeat(MAX_VALUE_BYTES + 1)).is_err());
    }

    #[test]
    fn the_stage_must_exist_and_the_key_be_overridable_there() {
        let judge = Judge::new(&config(), &[]).unwrap();
        assert_eq!(judge.names(&row("a@x", "route", "MATCH", "v")), None);
        assert_eq!(judge.names(&row("a@x", "run", "TIMEOUT", "5s")), None);
        let no_stage = judge.names(&row("a@x", "gone", "MATCH", "v")).unwrap();
        assert!(
            no_stage.contains("there is no stage \"gone\""),
            "{no_stage}"
        );
        for key in ["NEXT", "COMMAND", "ELSE_STAGE", "PROGRAM"] {
            let stage = if key == "COMMAND" { "run" } else { "route" };
            let why = judge.names(&row("a@x", stage, key, "v")).unwrap();
            assert!(
                why.contains(&format!("{key} is never overridable per address")),
                "{why}"
            );
        }
        let why = judge.names(&row("a@x", "route", "TIMEOUT", "5s")).unwrap();
        assert!(
            why.contains("pepsi-stage-if allows only MAX_LIFETIME, MATCH"),
            "{why}"
        );
        assert!(judge.applies(&row("a@x", "route", "MATCH", "")));
        assert!(!judge.applies(&row("a@x", "route", "NEXT", "")));
    }

    #[test]
    fn values_are_judged_by_the_stages_own_parser_over_its_section() {
        let judge = Judge::new(&config(), &[]).unwrap();
        let over = |pairs: &[(&str, &str)]| -> Overrides {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let (errors, _) = judge.values("a@x", "route", &over(&[("MATCH", "sender is b@y")]));
        assert!(errors.is_empty(), "{errors:?}");
        let (errors, _) = judge.values("a@x", "route", &over(&[("MATCH", "sender is b@y junk")]));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().contains("MATCH"), "{}", errors[0]);
        let (errors, _) = judge.values("a@x", "route", &over(&[("MAX_LIFETIME", "soon")]));
        assert_eq!(errors.len(), 1, "{errors:?}");
        // An empty MATCH removes the key for the address: the if stage requires it.
        let (errors, _) = judge.values("a@x", "route", &over(&[("MATCH", "")]));
        assert_eq!(errors.len(), 1, "{errors:?}");
        // TIMEOUT beyond MAX_RUNTIME (default 300s) is a warning, as in check.
        let (errors, warnings) = judge.values("a@x", "run", &over(&[("TIMEOUT", "2h")]));
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
    }

    #[test]
    fn a_graph_the_dispatcher_would_refuse_judges_nothing() {
        let broken = [OverrideRow {
            section: "stage-ta".into(),
            key: "NEXT".into(),
            value: "nowhere".into(),
        }];
        assert!(Judge::new(&config(), &broken).is_err());
    }

    #[test]
    fn listed_rows_say_why_the_workers_ignore_them() {
        let programs = programs(&config(), &[]);
        assert_eq!(ignored(&programs, &row("a@x", "route", "MATCH", "v")), None);
        let why = ignored(&programs, &row("a@x", "route", "NEXT", "v")).unwrap();
        assert!(why.contains("never overridable"), "{why}");
        let why = ignored(&programs, &row("a@x", "gone\u{1b}", "MATCH", "v")).unwrap();
        assert!(why.contains("no [stage-gone\\u{1b}] section"), "{why}");
    }
}
