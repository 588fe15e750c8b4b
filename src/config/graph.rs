//! The stage graph: the file's `[stage-*]` sections with `pepsi.config_override` laid
//! over them ([`super::overlay`]), each checked ([`StageSection::check`]), then as a
//! whole (§4): valid when every section has a `PROGRAM`, every number, duration
//! and boolean parses, and every stage reference (`NEXT` and any key ending in
//! `_STAGE`) names an existing section.
//!
//! Used by the dispatcher (routing, pool sizes), by workers (their own options), by
//! `pepsi-queue` and by `crate::check`. Pure: it reads sections and overlay rows it is
//! given, never a file or the database. Its cycles (a warning, never an error) are
//! [`super::cycles`]'s, the unknown keys of stage sections [`super::keys`]'s, and what
//! an overlay may run [`super::program_path`]'s. The items of [`super::overlay`],
//! [`super::program_path`] and [`super::raw`] that callers have always found here are
//! re-exported.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

pub use super::overlay::{LaidOver, OverrideRow, lay_over};
pub use super::program_path::{DEFAULT_PROGRAM_PATH, FILE_ONLY_KEYS, ProgramPath, overlay_refusal};
use super::raw::{ConfigError, Problems, Section};
pub use super::raw::{STAGE_NAME_RULE, STAGE_PREFIX, valid_stage_name};
use crate::durability::SynchronousCommit;

/// The most worker processes a stage may run (each holds a database connection).
pub const MAX_PARALLELISM: u32 = 10_000;
/// The most ids pipelined to one worker.
pub const MAX_QUEUE_LIMIT: u32 = 10_000;
/// Fusion depth cap: a chain longer than this (a misconfigured cycle) commits a hop.
pub const MAX_FUSION_DEPTH: usize = 16;

pub use super::keys::STAGE_KEYS;

/// Why `FUSION = yes` is refused on a stage that sets `COMMAND`: fused into another
/// stage's pass, its command would run through that worker's keeper instead of its own
/// stage's (§4 "Containment").
pub const NO_FUSION_INTO_A_COMMAND: &str = "a stage that runs a COMMAND is never fused into: \
     its command runs only through its own stage's keeper, as its USER (remove FUSION or set it to no)";

/// May a stage be fused into another's pass at all? Not when it runs a `COMMAND` (see
/// [`NO_FUSION_INTO_A_COMMAND`]), whatever its `FUSION` says.
pub fn may_be_fused_into(section: &StageSection) -> bool {
    section.section.get("COMMAND").is_none()
}

/// One checked `[stage-NAME]` section.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSection {
    /// The stage name (the section name without `stage-`), as in `workqueue.stage`.
    pub name: String,
    /// The program, looked up on `PATH` unless absolute.
    pub program: String,
    /// The stage a success advances to.
    pub next: Option<String>,
    /// Maximum worker processes.
    pub parallelism: u32,
    /// Ids pipelined to one worker at once.
    pub queue_limit: u32,
    /// A worker's process is recycled after this many messages.
    pub max_messages: u64,
    /// `FUSION`, when set; otherwise the program's default applies.
    pub fusion: Option<bool>,
    /// Host-error retries give up after this.
    pub max_lifetime: Duration,
    /// Where given-up messages go.
    pub bounce_stage: Option<String>,
    /// `SYNCHRONOUS_COMMIT`, when set: the level of the commits of this stage's
    /// outcomes; otherwise `[pepsi-postgres] WORKER_SYNCHRONOUS_COMMIT` decides.
    pub synchronous_commit: Option<SynchronousCommit>,
    /// `RATE`, messages a second: the most each tenant may start here (§7 "Rates").
    pub rate: Option<f64>,
    /// Every key of the section, for the program's own options.
    pub section: Section,
}

impl StageSection {
    /// Checks the common keys of a stage section (not its references, which need the
    /// whole graph). Returns every problem.
    pub fn check(section: &Section) -> Result<StageSection, Vec<ConfigError>> {
        let mut p = Problems::default();
        let program = p.ok(section.required("PROGRAM").map(str::to_string));
        let parallelism = p.ok(section.number("PARALLELISM", 4u32, 1..=MAX_PARALLELISM));
        let queue_limit = p.ok(section.number("QUEUE_LIMIT", 4u32, 1..=MAX_QUEUE_LIMIT));
        let max_messages = p.ok(section.number("MAX_MESSAGES", 1000u64, 1..=u64::MAX));
        let fusion = p.ok(section.optional_boolean("FUSION"));
        if fusion == Some(Some(true)) && section.get("COMMAND").is_some() {
            p.push(section.error("FUSION", NO_FUSION_INTO_A_COMMAND));
        }
        let max_lifetime = p.ok(section.duration("MAX_LIFETIME", Duration::from_secs(120 * 3600)));
        let synchronous_commit = p.ok(section.optional_synchronous_commit("SYNCHRONOUS_COMMIT"));
        let rate = p.ok(match section.get("RATE") {
            None => Ok(None),
            Some(text) => super::rate::parse(text)
                .map(Some)
                .map_err(|m| section.error("RATE", m)),
        });
        match (
            program,
            parallelism,
            queue_limit,
            max_messages,
            fusion,
            max_lifetime,
            synchronous_commit,
            rate,
        ) {
            (
                Some(program),
                Some(parallelism),
                Some(queue_limit),
                Some(max_messages),
                Some(fusion),
                Some(max_lifetime),
                Some(synchronous_commit),
                Some(rate),
            ) if p.is_empty() => Ok(StageSection {
                name: section.name[STAGE_PREFIX.len()..].to_string(),
                program,
                next: section.get("NEXT").map(str::to_string),
                parallelism,
                queue_limit,
                max_messages,
                fusion,
                max_lifetime,
                bounce_stage: section.get("BOUNCE_STAGE").map(str::to_string),
                synchronous_commit,
                rate,
                section: section.clone(),
            }),
            _ => Err(p.0),
        }
    }

    /// The stage references of this section: `NEXT` and every `*_STAGE` key.
    pub fn references(&self) -> impl Iterator<Item = (&str, &str)> {
        self.section
            .entries()
            .filter(|(k, _)| *k == "NEXT" || k.ends_with("_STAGE"))
            .map(|(k, v)| (k, v.text.as_str()))
    }

    /// The program's file name, without its directory.
    pub fn program_name(&self) -> &str {
        self.program.rsplit('/').next().unwrap_or(&self.program)
    }
}

/// The checked stage graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageGraph {
    stages: BTreeMap<String, StageSection>,
}

impl StageGraph {
    /// Lays `overlay` over the file's stage sections (leaving out the rows
    /// [`LaidOver::refused`] lists, which the caller reports) and checks the result.
    /// Every problem is returned, one message each.
    pub fn build(
        file: &[Section],
        overlay: &[OverrideRow],
        programs: &ProgramPath,
    ) -> Result<StageGraph, Vec<ConfigError>> {
        let LaidOver {
            sections,
            mut errors,
            ..
        } = lay_over(file, overlay, programs);
        let mut stages = BTreeMap::new();
        for section in sections.values() {
            let name = &section.name[STAGE_PREFIX.len()..];
            if name.is_empty() {
                errors.push(ConfigError::at(
                    section.origin.clone(),
                    "[stage-] has no stage name",
                ));
                continue;
            }
            // The file's parse refuses such a section already; a section made by other
            // code is held to the same rule.
            if !valid_stage_name(name) {
                errors.push(ConfigError {
                    section: Some(section.name.clone()),
                    ..ConfigError::at(
                        section.origin.clone(),
                        format!("the stage name {name:?} is not valid ({STAGE_NAME_RULE})"),
                    )
                });
                continue;
            }
            match StageSection::check(section) {
                Ok(stage) => {
                    stages.insert(stage.name.clone(), stage);
                }
                Err(mut e) => errors.append(&mut e),
            }
        }
        for stage in stages.values() {
            for (key, target) in stage.references() {
                if !stages.contains_key(target)
                    && !sections.contains_key(&format!("{STAGE_PREFIX}{target}"))
                {
                    errors.push(stage.section.error(
                        key,
                        format!("names stage {target:?}, which has no [stage-{target}] section"),
                    ));
                }
            }
        }
        if errors.is_empty() {
            Ok(StageGraph { stages })
        } else {
            Err(errors)
        }
    }

    /// A stage's section.
    pub fn get(&self, name: &str) -> Option<&StageSection> {
        self.stages.get(name)
    }

    /// Every stage, by name.
    pub fn stages(&self) -> impl Iterator<Item = &StageSection> {
        self.stages.values()
    }

    /// Is there a stage of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.stages.contains_key(name)
    }

    /// The entry stages: those no stage's reference (`NEXT` and every `*_STAGE` key)
    /// names, by name. `[pepsi] INJECT_STAGES`'s default, less the failure bouncer's
    /// target (see `Config::inject_stages`).
    pub fn entry_stages(&self) -> Vec<&str> {
        let named: BTreeSet<&str> = self
            .stages
            .values()
            .flat_map(|s| s.references().map(|(_, target)| target))
            .collect();
        self.stages
            .keys()
            .map(String::as_str)
            .filter(|name| !named.contains(name))
            .collect()
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::raw;
    use super::*;
    use std::path::Path;

    /// The sections of `text`, as read from `/g.conf`.
    pub(in crate::config) fn sections(text: &str) -> Vec<Section> {
        raw::parse(Path::new("/g.conf"), text).unwrap()
    }

    /// The graph of `file` and `overlay` under the default `PROGRAM_PATH`.
    pub(in crate::config) fn build(
        file: &[Section],
        overlay: &[OverrideRow],
    ) -> Result<StageGraph, Vec<ConfigError>> {
        StageGraph::build(file, overlay, &ProgramPath::default())
    }

    /// An overlay row.
    pub(in crate::config) fn row(section: &str, key: &str, value: &str) -> OverrideRow {
        OverrideRow {
            section: section.into(),
            key: key.into(),
            value: value.into(),
        }
    }

    /// A pipeline of three stages, and a fixed section.
    pub(in crate::config) const PIPE: &str = "[stage-if]\nPROGRAM = pepsi-stage-if\nMATCH = sender is a@b\nNEXT = pass\nELSE_STAGE = discard\n\
                        [stage-pass]\nPROGRAM = pepsi-stage-pass\nNEXT = discard\nPARALLELISM = 2\n\
                        [stage-discard]\nPROGRAM = /usr/bin/pepsi-stage-discard\n[pepsi]\nALLOW_FUSION = no\n";

    #[test]
    fn entry_stages_are_those_no_stage_routes_to() {
        let g = build(&sections(PIPE), &[]).unwrap();
        assert_eq!(g.entry_stages(), ["if"]);
        let looped = "[stage-a]\nPROGRAM = p\nNEXT = b\n[stage-b]\nPROGRAM = p\nNEXT = a\n\
                      [stage-in]\nPROGRAM = p\nNEXT = a\nBOUNCE_STAGE = bounce\n\
                      [stage-bounce]\nPROGRAM = p\n[stage-self]\nPROGRAM = p\nNEXT = self\n";
        let g = build(&sections(looped), &[]).unwrap();
        assert_eq!(
            g.entry_stages(),
            ["in"],
            "a stage in a cycle, one a BOUNCE_STAGE names and one routing to itself are no entries"
        );
    }

    #[test]
    fn a_valid_graph_with_defaults() {
        let g = build(&sections(PIPE), &[]).unwrap();
        assert_eq!(g.stages().count(), 3);
        let pass = g.get("pass").unwrap();
        assert_eq!(pass.parallelism, 2);
        assert_eq!(pass.queue_limit, 4);
        assert_eq!(pass.max_messages, 1000);
        assert_eq!(pass.max_lifetime, Duration::from_secs(432_000));
        assert_eq!(pass.next.as_deref(), Some("discard"));
        assert_eq!(
            g.get("discard").unwrap().program_name(),
            "pepsi-stage-discard"
        );
    }

    #[test]
    fn a_dangling_next_is_rejected_with_file_and_line() {
        let errs = build(&sections("[stage-a]\nPROGRAM = p\nNEXT = nowhere\n"), &[]).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(
            errs[0].to_string(),
            "/g.conf:3: [stage-a] NEXT: names stage \"nowhere\", which has no [stage-nowhere] section"
        );
    }

    #[test]
    fn any_stage_reference_key_is_checked() {
        let errs = build(
            &sections("[stage-a]\nPROGRAM = p\nBOUNCE_STAGE = gone\nELSE_STAGE = a\n"),
            &[],
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0]
                .to_string()
                .contains("BOUNCE_STAGE: names stage \"gone\"")
        );
    }

    #[test]
    fn a_missing_program_is_rejected() {
        let errs = build(&sections("[stage-a]\nNEXT = a\n"), &[]).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "/g.conf:1: [stage-a] PROGRAM: is required but not set"
        );
    }

    #[test]
    fn bad_values_are_each_reported() {
        let errs = build(
            &sections("[stage-a]\nPROGRAM = p\nMAX_LIFETIME = forever\nPARALLELISM = 0\nFUSION = sometimes\n"),
            &[],
        )
        .unwrap_err();
        let text = raw::join_errors(&errs);
        assert_eq!(errs.len(), 3, "{text}");
        assert!(text.contains("/g.conf:3: [stage-a] MAX_LIFETIME: \"forever\" is not a duration"));
        assert!(text.contains("/g.conf:4: [stage-a] PARALLELISM:"));
        assert!(text.contains("/g.conf:5: [stage-a] FUSION:"));
    }

    #[test]
    fn fusion_into_a_stage_that_runs_a_command_is_refused_where_it_was_set() {
        let file = "[stage-relay]\nPROGRAM = pepsi-stage-pass\nNEXT = archive\n\
                    [stage-archive]\nPROGRAM = pepsi-stage-exec\nCOMMAND = /bin/cat\nFUSION = yes\n";
        let errs = build(&sections(file), &[]).unwrap_err();
        assert_eq!(errs.len(), 1, "{}", raw::join_errors(&errs));
        assert_eq!(
            errs[0].to_string(),
            format!("/g.conf:7: [stage-archive] FUSION: {NO_FUSION_INTO_A_COMMAND}")
        );
        let file = file.replace("FUSION = yes\n", "");
        let g = build(&sections(&file), &[]).unwrap();
        assert!(!may_be_fused_into(g.get("archive").unwrap()));
        assert!(may_be_fused_into(g.get("relay").unwrap()));
        let errs = build(&sections(&file), &[row("stage-archive", "FUSION", "on")]).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            format!("pepsi.config_override: [stage-archive] FUSION: {NO_FUSION_INTO_A_COMMAND}")
        );
        let no = build(&sections(&file), &[row("stage-archive", "FUSION", "no")]);
        assert!(no.is_ok(), "FUSION = no is what it means anyway");
    }

    #[test]
    fn a_stage_name_is_letters_digits_dots_underscores_and_hyphens() {
        for good in ["a", "relay-2", "dkim.sign", "in_1", "A-Z.0_9"] {
            assert!(valid_stage_name(good), "{good:?}");
        }
        for bad in [
            "",
            "a b",
            "a/b",
            "a\u{1b}[31m",
            "a\r\nb",
            "a\u{202e}b",
            "a\u{2028}b",
            "é",
            "a\"b",
            "a{b}",
            "a=b",
        ] {
            assert!(!valid_stage_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_section_with_a_bad_stage_name_is_refused_at_its_line() {
        let mut file = sections("[stage-a]\nPROGRAM = p\n");
        file[0].name = "stage-a\u{202e}b".into();
        let errs = build(&file, &[]).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "/g.conf:1: [stage-a\\u{202e}b] the stage name \"a\\u{202e}b\" is not valid \
             (a stage name is one or more ASCII letters, digits, '.', '_' and '-')"
        );
        let errs =
            raw::parse(std::path::Path::new("/g.conf"), "[pepsi]\n[stage-a b]\n").unwrap_err();
        assert!(
            errs[0]
                .to_string()
                .starts_with("/g.conf:2: section name \"stage-a b\""),
            "{}",
            errs[0]
        );
    }
}
