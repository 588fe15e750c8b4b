//! `check`'s look at `pepsi.settings` (§4 "Least privilege", §12.5): the rows the
//! workers ignore (a key their stage does not let a correspondent override, a stage
//! without a section), and the value of every row they apply, checked with its stage's
//! own parser exactly as a worker will lay it over the section for that address. A
//! value that breaks the section is a permanent error for every message of that
//! address, so it is an error here.
//!
//! Called by `check` (its `mod.rs`) only, with the session it checks through; it reads the table
//! and changes nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::db::Client;
use postgres::error::SqlState;

use super::Findings;
use crate::config::graph;
use crate::config::{ConfigError, Section, StageGraph, StageSection};
use crate::db;
use crate::stages;
use crate::worker::settings::{self, Overrides, SettingRow};

/// How many `pepsi.settings` rows `check` lists one by one, of each kind (ignored,
/// breaking their section); the rest are counted in one more line.
const SETTINGS_LISTED: usize = 100;

/// Reports the `pepsi.settings` rows the workers ignore, as warnings naming each row,
/// and the addresses whose rows break their stage's section, as errors naming the
/// address and the key: at most [`SETTINGS_LISTED`] of each and a count of the rest.
/// Ignored rows are warnings (the workers run without them): the database answers
/// only the rows outside the (stage, key) pairs the stage sections allow, and
/// [`settings::refusal`] judges those, as the workers do. The others are laid over
/// their section (of `checked`, the stages as the dispatcher runs them) with
/// [`settings::apply`] and the stage's own check, as a worker does for a message of
/// that address.
pub(super) fn check_settings(
    client: &mut Client,
    sections: &BTreeMap<String, Section>,
    checked: &[StageSection],
    graph: Option<&StageGraph>,
    max_runtime: Option<Duration>,
    found: &mut Findings,
) {
    let mut programs: BTreeMap<String, String> = BTreeMap::new();
    let (mut stages, mut keys) = (Vec::new(), Vec::new());
    for section in sections.values() {
        let Some(stage) = section.name.strip_prefix(graph::STAGE_PREFIX) else {
            continue;
        };
        let Some(program) = section.get("PROGRAM") else {
            continue;
        };
        for key in settings::overridable_keys(stages::REGISTRY, program) {
            stages.push(stage.to_string());
            keys.push(key.to_string());
        }
        programs.insert(stage.to_string(), program.to_string());
    }
    let mut refused = Vec::new();
    let mut more = 0usize;
    let read = db::read_unlisted_settings(client, &stages, &keys, |address, stage, key| {
        let row = SettingRow {
            address,
            stage,
            key,
            value: String::new(),
        };
        if let Some(e) = settings::refusal(
            stages::REGISTRY,
            &row,
            programs.get(&row.stage).map(String::as_str),
        ) {
            if refused.len() < SETTINGS_LISTED {
                refused.push(e);
            } else {
                more += 1;
            }
        }
    });
    if !unreadable(read, found) {
        found.add_warnings(refused);
        if more > 0 {
            found.warnings.push(format!(
                "pepsi.settings: {more} more rows are ignored likewise (not listed)"
            ));
        }
    }
    if let Some(graph) = graph {
        check_values(client, &stages, &keys, checked, graph, max_runtime, found);
    }
}

/// Lays every address's applied rows over their stage's section and reports what
/// breaks it.
fn check_values(
    client: &mut Client,
    stages: &[String],
    keys: &[String],
    checked: &[StageSection],
    graph: &StageGraph,
    max_runtime: Option<Duration>,
    found: &mut Findings,
) {
    let by_name: BTreeMap<&str, &StageSection> =
        checked.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut broken: Vec<ConfigError> = Vec::new();
    let mut slow: Vec<ConfigError> = Vec::new();
    let mut more = 0usize;
    // The rows come ordered by stage and address: one group at a time.
    let mut group: Option<(String, String, Overrides)> = None;
    let mut judge = |group: Option<(String, String, Overrides)>| {
        let Some((stage, address, overrides)) = group else {
            return;
        };
        let Some(section) = by_name.get(stage.as_str()) else {
            return;
        };
        let errors = match settings::apply(section, &overrides, &address, graph) {
            Ok(applied) => {
                // An address's settings may make the stage outlast MAX_RUNTIME (a
                // command's TIMEOUT), as the file's may: the same warning, naming the
                // address, unless the file's section draws it already.
                let outlasting = max_runtime
                    .zip(stages::for_program(&applied.program))
                    .filter(|(limit, builtin)| {
                        builtin.runtime_warning(&section.section, *limit).is_none()
                    })
                    .and_then(|(limit, builtin)| builtin.runtime_warning(&applied.section, limit));
                if let Some(w) = outlasting {
                    if slow.len() < SETTINGS_LISTED {
                        slow.push(w);
                    }
                }
                stages::check_section(&applied)
                    .and_then(Result::err)
                    .into_iter()
                    .collect()
            }
            Err(errors) => errors,
        };
        for e in errors {
            if broken.len() < SETTINGS_LISTED {
                broken.push(e);
            } else {
                more += 1;
            }
        }
    };
    let read =
        db::read_listed_settings(
            client,
            stages,
            keys,
            |address, stage, key, value| match &mut group {
                Some((s, a, overrides)) if *s == stage && *a == address => {
                    overrides.insert(key, value);
                }
                _ => {
                    let next = Some((stage, address, Overrides::from([(key, value)])));
                    judge(std::mem::replace(&mut group, next));
                }
            },
        );
    judge(group);
    if !unreadable(read, found) {
        found.add_warnings(slow);
        found.add_errors(broken.into_iter().map(|mut e| {
            e.message.push_str(
                "; every message of that address fails at this stage until the row is fixed",
            );
            e
        }));
        if more > 0 {
            found.errors.push(format!(
                "pepsi.settings: {more} more problems of rows' values (not listed)"
            ));
        }
    }
}

/// Reports a failed read of the table; whether it failed. A role that may not read
/// the table (a split of the roles that keeps the settings from the dispatcher)
/// leaves them unchecked, which is no error of the configuration.
fn unreadable(read: Result<(), postgres::Error>, found: &mut Findings) -> bool {
    match read {
        Ok(()) => false,
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            let warning = format!(
                "database: pepsi.settings is not checked: {}",
                db::describe(&e)
            );
            if !found.warnings.contains(&warning) {
                found.warnings.push(warning);
            }
            true
        }
        Err(e) => {
            let error = format!("database: cannot read pepsi.settings: {}", db::describe(&e));
            if !found.errors.contains(&error) {
                found.errors.push(error);
            }
            true
        }
    }
}
