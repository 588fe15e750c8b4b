//! `pepsi-queue config set SECTION KEY VALUE` and `config unset SECTION KEY`: change
//! `pepsi.config_override` only after the stage graph it would give has passed the
//! dispatcher's own checks (`check::dispatchable_graph`: the graph, then
//! every built-in stage's section as its workers check it).
//!
//! One transaction: lock the overlay against other writers, read it, lay the change
//! over it and the file's stage sections, check (also that `[pepsi-failure-bouncer]
//! BOUNCE_STAGE` keeps its section), then write or roll back. A refused change lists
//! every problem and exits 78 with nothing written; the written change notifies
//! `config_changed` (the table's trigger) and the dispatcher reloads. `unset` removes
//! the overlay's row, so the file's value (or the default) applies again; `set` with
//! an empty VALUE overrides the file's key with nothing, which unsets it.
//! A row the overlay may not set (`COMMAND`, `USER`, or a `PROGRAM` that `[pepsi]
//! PROGRAM_PATH` does not allow and the file does not name; see
//! `config::graph::lay_over`, which the dispatcher applies too) is refused the same
//! way. The written change also rewrites the stages an injecting role may inject into
//! (`[pepsi] INJECT_STAGES`), which may follow the graph.
//! `config check` is `check::check` itself.

use crate::bouncer;
use crate::check;
use crate::config::graph::{self, OverrideRow};
use crate::config::raw::join_errors;
use crate::config::{Config, ConfigError, Origin};
use crate::db::{self, sql};
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, Failure};

use super::args::usage;
use super::{Session, db_failure, emit};

/// Checks the section and key names of a change: a `[stage-NAME]` section and an
/// upper-case key, as the overlay takes them.
fn check_names(section: &str, key: &str) -> Result<(), Failure> {
    let name = section.strip_prefix(graph::STAGE_PREFIX).unwrap_or("");
    if name.is_empty() {
        return Err(usage(format!(
            "config: {section:?} is not a stage section; only [stage-NAME] sections can be set in the overlay"
        )));
    }
    if !graph::valid_stage_name(name) {
        return Err(usage(format!(
            "config: {section:?}: {}",
            graph::STAGE_NAME_RULE
        )));
    }
    let key_ok = key.starts_with(|c: char| c.is_ascii_uppercase())
        && key
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !key_ok {
        return Err(usage(format!(
            "config: {key:?} is not a key (upper-case letters, digits and '_')"
        )));
    }
    Ok(())
}

/// The problem when a change takes away the section `[pepsi-failure-bouncer]
/// BOUNCE_STAGE` names (an overlay-only stage whose last key is unset): the bouncer
/// refuses to start without it, and failed messages would stay failed. A target that
/// was missing before the change is not this change's doing.
fn bouncer_target_lost(
    config: &Config,
    before: &[OverrideRow],
    after: &[OverrideRow],
) -> Option<ConfigError> {
    let stage = config.bouncer.bounce_stage.as_deref()?;
    let origin = config.bouncer.origin.clone().unwrap_or(Origin::Default);
    let problem = |overlay: &[OverrideRow]| {
        bouncer::bounce_stage_error(stage, &origin, &config.lay_over(overlay).sections)
    };
    match problem(before) {
        Some(_) => None,
        None => problem(after),
    }
}

/// Sets (`Some(value)`) or unsets (`None`) an overlay key after checking the result.
pub fn change(
    session: &mut Session,
    section: &str,
    key: &str,
    value: Option<&str>,
) -> Result<(), Failure> {
    check_names(section, key)?;
    let failed = |e: postgres::Error| db_failure("changing pepsi.config_override", &e);
    let mut tx = session.client.transaction().map_err(failed)?;
    tx.batch_execute(sql::LOCK_CONFIG_OVERRIDE)
        .map_err(failed)?;
    let mut overlay = db::read_overlay(&mut tx).map_err(failed)?;
    let existed = overlay.iter().any(|r| r.section == section && r.key == key);
    if value.is_none() && !existed {
        return Err(Failure::new(
            EX_DATAERR,
            format!("config unset: the overlay has no [{section}] {key}; nothing changed"),
        ));
    }
    let before = overlay.clone();
    overlay.retain(|r| !(r.section == section && r.key == key));
    if let Some(v) = value {
        overlay.push(OverrideRow {
            section: section.to_string(),
            key: key.to_string(),
            value: v.to_string(),
        });
    }
    // The dispatcher would leave this row out (and say so at every reload): refused
    // here, before anything else, with why.
    if let Some(refused) = session
        .config
        .lay_over(&overlay)
        .refused
        .into_iter()
        .find(|e| e.section.as_deref() == Some(section) && e.key.as_deref() == Some(key))
    {
        return Err(Failure::config(format!(
            "config: refused, the dispatcher would ignore this row; nothing changed:\n{refused}"
        )));
    }
    let stage_sections = &session.config.stage_sections;
    let programs = &session.config.pepsi.program_path;
    let graph = check::dispatchable_graph(stage_sections, programs, &overlay).map_err(|errors| {
        Failure::config(format!(
            "config: refused, the dispatcher would not run this stage configuration; nothing changed:\n{}",
            join_errors(&errors)
        ))
    })?;
    if let Some(lost) = bouncer_target_lost(&session.config, &before, &overlay) {
        return Err(Failure::config(format!(
            "config: refused, the failure bouncer would lose its target; nothing changed:\n{lost}"
        )));
    }
    match value {
        Some(v) => tx.execute(sql::SET_CONFIG_OVERRIDE, &[&section, &key, &v]),
        None => tx.execute(sql::UNSET_CONFIG_OVERRIDE, &[&section, &key]),
    }
    .map_err(failed)?;
    // The entry stages may change with the graph; the dispatcher writes them again at
    // its reload, but it may not be running.
    db::write_inject_stages(&mut tx, &session.config.inject_stages(&graph)).map_err(failed)?;
    tx.commit().map_err(failed)?;
    for w in check::graph_warnings(stage_sections, programs, &overlay, Some(&graph)) {
        log::warn!("{w}");
    }
    let what = match value {
        Some("") => format!("[{section}] {key} unset over the file (empty value in the overlay)"),
        Some(v) => format!("[{section}] {key} = {}", Visible(v)),
        None => format!("[{section}] {key} removed from the overlay"),
    };
    emit(format!("{what}; the dispatcher reloads\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stage_sections_and_upper_case_keys() {
        assert!(check_names("stage-a", "NEXT").is_ok());
        assert!(check_names("stage-a", "FAIR_2").is_ok());
        assert_eq!(check_names("pepsi", "RUN_AS").unwrap_err().code, 64);
        assert_eq!(check_names("stage-", "NEXT").unwrap_err().code, 64);
        assert_eq!(check_names("stage-a b", "NEXT").unwrap_err().code, 64);
        assert_eq!(check_names("stage-a\u{1b}", "NEXT").unwrap_err().code, 64);
        assert_eq!(check_names("stage-a", "next").unwrap_err().code, 64);
        assert_eq!(check_names("stage-a", "").unwrap_err().code, 64);
    }
}
