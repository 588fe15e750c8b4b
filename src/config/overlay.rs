//! Laying `pepsi.config_override` over the file's stage sections, in one place,
//! [`lay_over`]: the first phase of [`super::StageGraph::build`], and what
//! `Config::lay_over`, the failure bouncer and `crate::check` call for the sections
//! without the graph.
//!
//! It also applies the one rule about what an overlay may run (§4 "Least
//! privilege" and "Containment", the rule itself in `program_path.rs`): an overlay may
//! never set `COMMAND` or `USER`, and an overlay `PROGRAM` must be a built-in stage
//! program or an absolute path under `[pepsi] PROGRAM_PATH` ([`ProgramPath`]), unless a
//! stage section of the file names that very program; any other such row is left out
//! (and reported), the rest of the overlay still applies.
//!
//! Pure: it reads the rows it is given (the database is read by `db`) and checks no
//! value; that is [`super::graph`]'s.

use std::collections::BTreeMap;

use super::program_path::{ProgramPath, overlay_refusal};
use super::raw::{ConfigError, Origin, STAGE_NAME_RULE, STAGE_PREFIX, Section, valid_stage_name};
pub use crate::db::OverrideRow;

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
/// [`super::StageGraph::build`]): a row sets its key, an empty value unsets it, and a
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
        if let Some(why) = overlay_refusal(file, programs, &row.section, &row.key, &row.value) {
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
