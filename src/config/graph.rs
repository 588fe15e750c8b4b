//! The stage graph: the file's `[stage-*]` sections with `pepsi.config_override` laid
//! over them, checked (SPEC §4). Valid when every section has a `PROGRAM`, every number,
//! duration and boolean parses, and every stage reference (`NEXT` and any key ending in
//! `_STAGE`) names an existing section.
//!
//! The overlay is laid over the file in one place, [`lay_over`], which also applies the
//! one rule about what an overlay may run (SPEC §4 "Least privilege" and
//! "Containment", the rule itself in `program_path.rs`): an overlay may never set
//! `COMMAND` or `USER`, and an overlay `PROGRAM` must be a built-in stage program or an
//! absolute path under `[pepsi] PROGRAM_PATH` ([`ProgramPath`]), unless a stage section
//! of the file names that very program; any other such row is left out (and reported),
//! the rest of the overlay still applies.
//!
//! Also here, pure: the cycles of the graph ([`StageGraph::cycles`]), a warning, never
//! an error. The unknown keys of stage sections are [`super::keys::unknown_keys`]'s.
//!
//! Used by the dispatcher (routing, pool sizes) and by workers (their own options).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

pub use super::program_path::{DEFAULT_PROGRAM_PATH, FILE_ONLY_KEYS, ProgramPath, overlay_refusal};
use super::raw::{ConfigError, Origin, Problems, Section};

/// The prefix of a stage section's name: `[stage-NAME]` is stage `NAME`.
pub const STAGE_PREFIX: &str = "stage-";

/// Is this a valid stage name: one or more ASCII letters, digits, `.`, `_` and `-`, the
/// characters a section name of the file may hold. Stage names reach logs, terminals and
/// metrics labels as they are, so nothing else is taken, from the file or the overlay.
pub fn valid_stage_name(name: &str) -> bool {
    super::raw::valid_section(name)
}

/// Why a stage name is refused, for a message.
pub const STAGE_NAME_RULE: &str =
    "a stage name is one or more ASCII letters, digits, '.', '_' and '-'";

/// The most worker processes a stage may run (each holds a database connection).
pub const MAX_PARALLELISM: u32 = 10_000;
/// The most ids pipelined to one worker.
pub const MAX_QUEUE_LIMIT: u32 = 10_000;
/// Fusion depth cap: a chain longer than this (a misconfigured cycle) commits a hop.
pub const MAX_FUSION_DEPTH: usize = 16;

/// The keys every stage section may set, whatever its program (SPEC §4).
pub const STAGE_KEYS: &[&str] = &[
    "PROGRAM",
    "NEXT",
    "PARALLELISM",
    "QUEUE_LIMIT",
    "MAX_MESSAGES",
    "FUSION",
    "MAX_LIFETIME",
    "BOUNCE_STAGE",
];

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

/// The stage sections with the overlay laid over them, before their values are checked.
#[derive(Clone, Debug, Default)]
pub struct LaidOver {
    /// Every `[stage-*]` section, by section name.
    pub sections: BTreeMap<String, Section>,
    /// Overlay rows that cannot be laid over (an invalid stage name or key).
    pub errors: Vec<ConfigError>,
    /// Overlay rows that are ignored (a section other than `[stage-*]`).
    pub warnings: Vec<ConfigError>,
    /// Overlay rows that are refused and left out, the rest of the overlay applying:
    /// a `COMMAND` or `USER`, or a `PROGRAM`, that [`overlay_refusal`] refuses. The dispatcher logs them
    /// as errors, `pepsi-dispatch check` reports them as errors, `pepsi-queue config
    /// set` refuses to write one.
    pub refused: Vec<ConfigError>,
}

/// Lays `overlay` over the file's stage sections (the first phase of
/// [`StageGraph::build`]): a row sets its key, an empty value unsets it, and a
/// row the overlay may not set (see [`overlay_refusal`]: `COMMAND`, `USER`, a `PROGRAM`
/// outside `PROGRAM_PATH`) is left out.
pub fn lay_over(file: &[Section], overlay: &[OverrideRow], programs: &ProgramPath) -> LaidOver {
    let mut sections: BTreeMap<String, Section> = file
        .iter()
        .filter(|s| s.name.starts_with(STAGE_PREFIX))
        .map(|s| (s.name.clone(), s.clone()))
        .collect();
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let mut refused = Vec::new();
    for row in overlay {
        if !row.section.starts_with(STAGE_PREFIX) || row.section.len() == STAGE_PREFIX.len() {
            warnings.push(ConfigError {
                section: Some(row.section.clone()),
                key: Some(row.key.clone()),
                ..ConfigError::at(
                    Origin::Override,
                    "only [stage-*] sections can be overridden; ignored",
                )
            });
            continue;
        }
        let name = &row.section[STAGE_PREFIX.len()..];
        if !valid_stage_name(name) {
            errors.push(ConfigError {
                section: Some(row.section.clone()),
                key: Some(row.key.clone()),
                ..ConfigError::at(
                    Origin::Override,
                    format!("the stage name {name:?} is not valid ({STAGE_NAME_RULE})"),
                )
            });
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
        if let Some(why) = overlay_refusal(file, programs, &row.key, &row.value) {
            refused.push(ConfigError {
                section: Some(row.section.clone()),
                key: Some(row.key.clone()),
                ..ConfigError::at(Origin::Override, why)
            });
            continue;
        }
        sections
            .entry(row.section.clone())
            .or_insert_with(|| Section::new(row.section.clone(), Origin::Override))
            .set(&row.key, row.value.trim(), Origin::Override);
    }
    LaidOver {
        sections,
        errors,
        warnings,
        refused,
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

    /// The stages a stage's references (`NEXT` and every `*_STAGE` key) name.
    fn successors(&self, name: &str) -> BTreeSet<&str> {
        self.stages
            .get(name)
            .into_iter()
            .flat_map(|s| s.references().map(|(_, target)| target))
            .filter(|target| self.stages.contains_key(*target))
            .collect()
    }

    /// Every stage reachable from `start` through references, `start` itself only when
    /// a path leads back to it.
    fn reachable(&self, start: &str) -> BTreeSet<&str> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&str> = self.successors(start).into_iter().collect();
        while let Some(name) = todo.pop() {
            if seen.insert(name) {
                todo.extend(self.successors(name));
            }
        }
        seen
    }

    /// The cycles of the graph through its stage references (`NEXT` and every `*_STAGE`
    /// key): one per group of stages that all reach one another, each as the stage names
    /// along one shortest cycle through the group's first stage, that stage repeated at
    /// the end (`["loop1", "loop2", "loop1"]`). A cycle is legal — the hop limit bounds a
    /// message that keeps going round — but worth a warning.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let reach: BTreeMap<&str, BTreeSet<&str>> = self
            .stages
            .keys()
            .map(|name| (name.as_str(), self.reachable(name)))
            .collect();
        let mut grouped: BTreeSet<&str> = BTreeSet::new();
        let mut cycles = Vec::new();
        // Stages in name order, so each group is found from its first stage.
        for (&start, from_start) in &reach {
            if grouped.contains(start) || !from_start.contains(start) {
                continue;
            }
            let group: BTreeSet<&str> = from_start
                .iter()
                .copied()
                .filter(|other| reach[other].contains(start))
                .collect();
            grouped.extend(group.iter().copied());
            // Breadth first from `start` inside the group, back to `start`.
            let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start]);
            let mut last = None;
            'search: while let Some(name) = queue.pop_front() {
                for next in self.successors(name) {
                    if next == start {
                        last = Some(name);
                        break 'search;
                    }
                    if group.contains(next) && !parent.contains_key(next) {
                        parent.insert(next, name);
                        queue.push_back(next);
                    }
                }
            }
            // Walk the parents back from the stage that leads to `start`.
            let mut middle = Vec::new();
            let mut at = last.expect("a stage in a group reaches itself");
            while at != start {
                middle.push(at.to_string());
                at = parent[at];
            }
            middle.reverse();
            let mut path = vec![start.to_string()];
            path.extend(middle);
            path.push(start.to_string());
            cycles.push(path);
        }
        cycles
    }

    /// A warning for each cycle of the graph (see [`StageGraph::cycles`]), located at
    /// its first stage's section.
    pub fn cycle_warnings(&self) -> Vec<ConfigError> {
        self.cycles()
            .into_iter()
            .map(|cycle| {
                let first = &self.stages[&cycle[0]].section;
                ConfigError {
                    section: Some(first.name.clone()),
                    ..ConfigError::at(
                        first.origin.clone(),
                        format!(
                            "the stage references form a cycle: {} (legal, but a message can go round until [pepsi-dispatch] MAX_HOPS stops it)",
                            cycle.join(" → ")
                        ),
                    )
                }
            })
            .collect()
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

    fn build(file: &[Section], overlay: &[OverrideRow]) -> Result<StageGraph, Vec<ConfigError>> {
        StageGraph::build(file, overlay, &ProgramPath::default())
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

    #[test]
    fn cycles_are_found_once_each_as_a_path_back_to_their_first_stage() {
        let g = build(&sections(PIPE), &[]).unwrap();
        assert!(g.cycles().is_empty(), "a pipeline without a loop");
        let g = build(
            &sections(
                "[stage-loop1]\nPROGRAM = p\nNEXT = loop2\n\
                 [stage-loop2]\nPROGRAM = p\nNEXT = out\nELSE_STAGE = loop1\n\
                 [stage-out]\nPROGRAM = p\n\
                 [stage-self]\nPROGRAM = p\nBOUNCE_STAGE = self\n\
                 [stage-x]\nPROGRAM = p\nNEXT = y\n[stage-y]\nPROGRAM = p\nNEXT = z\nFAIL_STAGE = x\n\
                 [stage-z]\nPROGRAM = p\nNEXT = x\n",
            ),
            &[],
        )
        .unwrap();
        assert_eq!(
            g.cycles(),
            vec![
                vec!["loop1", "loop2", "loop1"],
                vec!["self", "self"],
                vec!["x", "y", "x"],
            ],
            "x→y→x is shorter than x→y→z→x; the group is reported once"
        );
        let w = g.cycle_warnings();
        assert_eq!(w.len(), 3);
        assert!(
            w[0].to_string().starts_with(
                "/g.conf:1: [stage-loop1] the stage references form a cycle: loop1 → loop2 → loop1"
            ),
            "{}",
            w[0]
        );
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
        let file = sections(
            "[stage-deliver]\nPROGRAM = pepsi-stage-exec\nCOMMAND = /usr/lib/pepsi/deliver\n",
        );
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
}
