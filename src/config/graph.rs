//! The stage graph: the file's `[stage-*]` sections with `pepsi.config_override` laid
//! over them, checked (SPEC §4). Valid when every section has a `PROGRAM`, every number,
//! duration and boolean parses, and every stage reference (`NEXT` and any key ending in
//! `_STAGE`) names an existing section.
//!
//! Used by the dispatcher (routing, pool sizes) and by workers (their own options).

use std::collections::BTreeMap;
use std::time::Duration;

use super::raw::{ConfigError, Origin, Problems, Section};

/// The prefix of a stage section's name: `[stage-NAME]` is stage `NAME`.
pub const STAGE_PREFIX: &str = "stage-";

/// The most worker processes a stage may run (each holds a database connection).
pub const MAX_PARALLELISM: u32 = 10_000;
/// The most ids pipelined to one worker.
pub const MAX_QUEUE_LIMIT: u32 = 10_000;
/// Fusion depth cap: a chain longer than this (a misconfigured cycle) commits a hop.
pub const MAX_FUSION_DEPTH: usize = 16;

/// One row of `pepsi.config_override`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverrideRow {
    /// The section, e.g. `stage-if`.
    pub section: String,
    /// The key.
    pub key: String,
    /// The value; empty unsets the file's key.
    pub value: String,
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
        let max_lifetime = p.ok(section.duration("MAX_LIFETIME", Duration::from_secs(120 * 3600)));
        match (
            program,
            parallelism,
            queue_limit,
            max_messages,
            fusion,
            max_lifetime,
        ) {
            (
                Some(program),
                Some(parallelism),
                Some(queue_limit),
                Some(max_messages),
                Some(fusion),
                Some(max_lifetime),
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
    /// Lays `overlay` over the file's stage sections and checks the result. Every
    /// problem is returned, one message each.
    pub fn build(
        file: &[Section],
        overlay: &[OverrideRow],
    ) -> Result<StageGraph, Vec<ConfigError>> {
        let mut sections: BTreeMap<String, Section> = file
            .iter()
            .filter(|s| s.name.starts_with(STAGE_PREFIX))
            .map(|s| (s.name.clone(), s.clone()))
            .collect();
        let mut errors = Vec::new();
        for row in overlay {
            if !row.section.starts_with(STAGE_PREFIX) || row.section.len() == STAGE_PREFIX.len() {
                log::warn!(
                    "pepsi.config_override: [{}] {}: only [stage-*] sections can be overridden; ignored",
                    row.section,
                    row.key
                );
                continue;
            }
            if row.key.is_empty()
                || !row.key.starts_with(|c: char| c.is_ascii_uppercase())
                || !row
                    .key
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                errors.push(ConfigError {
                    section: Some(row.section.clone()),
                    ..ConfigError::at(
                        Origin::Override,
                        format!(
                            "{:?} is not a valid key (upper-case letters, digits and '_')",
                            row.key
                        ),
                    )
                });
                continue;
            }
            sections
                .entry(row.section.clone())
                .or_insert_with(|| Section::new(row.section.clone(), Origin::Override))
                .set(&row.key, row.value.trim(), Origin::Override);
        }
        let mut stages = BTreeMap::new();
        for section in sections.values() {
            if section.name.len() == STAGE_PREFIX.len() {
                errors.push(ConfigError::at(
                    section.origin.clone(),
                    "[stage-] has no stage name",
                ));
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
}

#[cfg(test)]
mod tests {
    use super::super::raw;
    use super::*;
    use std::path::Path;

    fn sections(text: &str) -> Vec<Section> {
        raw::parse(Path::new("/g.conf"), text).unwrap()
    }

    fn row(section: &str, key: &str, value: &str) -> OverrideRow {
        OverrideRow {
            section: section.into(),
            key: key.into(),
            value: value.into(),
        }
    }

    const PIPE: &str = "[stage-if]\nPROGRAM = pepsi-stage-if\nMATCH = sender is a@b\nNEXT = pass\nELSE_STAGE = discard\n\
                        [stage-pass]\nPROGRAM = pepsi-stage-pass\nNEXT = discard\nPARALLELISM = 2\n\
                        [stage-discard]\nPROGRAM = /usr/bin/pepsi-stage-discard\n[pepsi]\nALLOW_FUSION = no\n";

    #[test]
    fn a_valid_graph_with_defaults() {
        let g = StageGraph::build(&sections(PIPE), &[]).unwrap();
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
        let errs = StageGraph::build(&sections("[stage-a]\nPROGRAM = p\nNEXT = nowhere\n"), &[])
            .unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(
            errs[0].to_string(),
            "/g.conf:3: [stage-a] NEXT: names stage \"nowhere\", which has no [stage-nowhere] section"
        );
    }

    #[test]
    fn any_stage_reference_key_is_checked() {
        let errs = StageGraph::build(
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
        let errs = StageGraph::build(&sections("[stage-a]\nNEXT = a\n"), &[]).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "/g.conf:1: [stage-a] PROGRAM: is required but not set"
        );
    }

    #[test]
    fn bad_values_are_each_reported() {
        let errs = StageGraph::build(
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
    fn the_overlay_beats_the_file_and_can_add_stages() {
        let overlay = [
            row("stage-pass", "PARALLELISM", "7"),
            row("stage-pass", "NEXT", "extra"),
            row("stage-extra", "PROGRAM", "pepsi-stage-pass"),
            row("stage-extra", "NEXT", "discard"),
            row("pepsi", "ALLOW_FUSION", "yes"),
        ];
        let g = StageGraph::build(&sections(PIPE), &overlay).unwrap();
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
        let errs = StageGraph::build(&sections(PIPE), &[row("stage-pass", "QUEUE_LIMIT", "lots")])
            .unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "pepsi.config_override: [stage-pass] QUEUE_LIMIT: \"lots\" is not a whole number"
        );
        let errs =
            StageGraph::build(&sections(PIPE), &[row("stage-pass", "next", "x")]).unwrap_err();
        assert!(
            errs[0]
                .to_string()
                .starts_with("pepsi.config_override: [stage-pass] \"next\"")
        );
    }

    #[test]
    fn an_empty_overlay_value_unsets_a_key() {
        let g =
            StageGraph::build(&sections(PIPE), &[row("stage-pass", "PARALLELISM", "")]).unwrap();
        assert_eq!(g.get("pass").unwrap().parallelism, 4);
    }
}
