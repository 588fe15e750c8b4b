//! The writing commands of `pepsi-settings`: `set`, `unset` and `import`, each one
//! transaction that checks the whole change before it writes anything.
//!
//! The order, every time: lock `pepsi.settings` against other writers and hold the
//! overlay as read (`db::sql_settings`), build the stage graph of the file and the
//! overlay, judge every setting (`judge.rs`: the stage, the key, then the address's
//! settings at that stage laid over its section), and only then write and commit. A
//! refused change lists every problem (an import's by line) and exits 78 with nothing
//! written; the setting's own data (a malformed address, a value too long, a line
//! that is no setting) is refused before anything is connected, with 65.
//!
//! No notification: the workers read an address's settings with each message they
//! load (§12.5) and cache configured stages by the settings' content, and the
//! dispatcher keeps nothing of the table, so a committed change applies from the next
//! message on. Called by `settings::run` only.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::import::{Line, Problems};
use super::judge::{self, Judge};
use crate::config::graph::OverrideRow;
use crate::config::raw::join_errors;
use crate::config::{Config, ConfigError};
use crate::db::{self, Transaction, sql_settings};
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, Failure};
use crate::queue::{Session, db_failure, emit};
use crate::worker::settings::{Overrides, SettingRow};

/// A database error while changing the table.
fn failed(e: postgres::Error) -> Failure {
    db_failure("changing pepsi.settings", &e)
}

/// A change refused: exit 78, every problem listed, nothing written.
fn refused(command: &str, problems: &str) -> Failure {
    Failure::config(format!("{command}: refused; nothing changed:\n{problems}"))
}

/// Bad data of the setting itself: exit 65, nothing written.
fn bad_data(command: &str, why: &str) -> Failure {
    Failure::new(EX_DATAERR, format!("{command}: {why}; nothing changed"))
}

/// Starts the change: locks the table against other writers, holds the overlay, and
/// reads it.
fn begin(tx: &mut Transaction<'_>) -> Result<Vec<OverrideRow>, Failure> {
    tx.batch_execute(sql_settings::LOCK_SETTINGS)
        .map_err(failed)?;
    tx.batch_execute(sql_settings::HOLD_CONFIG_OVERRIDE)
        .map_err(failed)?;
    db::read_overlay(tx).map_err(failed)
}

/// The stage graph to judge by, or the refusal of every write when the dispatcher
/// would not run it.
fn judge_for(command: &str, config: &Config, overlay: &[OverrideRow]) -> Result<Judge, Failure> {
    Judge::new(config, overlay).map_err(|errors| {
        refused(
            command,
            &format!(
                "the stage graph of the file and the overlay is invalid, so no stage can be \
                 judged (pepsi-config check lists its problems):\n{}",
                join_errors(&errors)
            ),
        )
    })
}

/// Reads rows of `sql` with `params` as settings.
fn read(
    tx: &mut Transaction<'_>,
    sql: &str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> Result<Vec<SettingRow>, Failure> {
    Ok(tx
        .query(sql, params)
        .map_err(failed)?
        .iter()
        .map(|r| SettingRow {
            address: r.get(0),
            stage: r.get(1),
            key: r.get(2),
            value: r.get(3),
        })
        .collect())
}

/// The settings of `address` at `stage`.
fn read_group(
    tx: &mut Transaction<'_>,
    address: &str,
    stage: &str,
) -> Result<Vec<SettingRow>, Failure> {
    read(
        tx,
        sql_settings::READ_SETTINGS,
        &[&Some(address), &Some(stage)],
    )
}

/// Writes `rows` (each new one added, each existing one's value replaced).
fn write(tx: &mut Transaction<'_>, rows: &[&SettingRow]) -> Result<(), Failure> {
    if rows.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&SettingRow) -> &str| rows.iter().map(|r| f(r)).collect::<Vec<&str>>();
    let (a, s, k, v) = (
        column(|r| &r.address),
        column(|r| &r.stage),
        column(|r| &r.key),
        column(|r| &r.value),
    );
    tx.execute(sql_settings::WRITE_SETTINGS, &[&a, &s, &k, &v])
        .map_err(failed)?;
    Ok(())
}

/// Removes the settings `ids` (address, stage, key).
fn delete(tx: &mut Transaction<'_>, ids: &[(&str, &str, &str)]) -> Result<(), Failure> {
    if ids.is_empty() {
        return Ok(());
    }
    let a: Vec<&str> = ids.iter().map(|i| i.0).collect();
    let s: Vec<&str> = ids.iter().map(|i| i.1).collect();
    let k: Vec<&str> = ids.iter().map(|i| i.2).collect();
    tx.execute(sql_settings::DELETE_SETTINGS, &[&a, &s, &k])
        .map_err(failed)?;
    Ok(())
}

/// The overrides the workers would lay over a section from `rows` (those they would
/// not drop).
fn applied<'a>(judge: &Judge, rows: impl IntoIterator<Item = &'a SettingRow>) -> Overrides {
    rows.into_iter()
        .filter(|r| judge.applies(r))
        .map(|r| (r.key.clone(), r.value.clone()))
        .collect()
}

/// Logs warnings (a setting that makes a stage outlast `MAX_RUNTIME`).
fn warn(warnings: &[ConfigError]) {
    for w in warnings.iter().take(super::import::LISTED) {
        log::warn!("{w}");
    }
}

/// The data of a setting to set, checked before anything is connected: its address
/// lower-cased and a mailbox, its value not too long.
pub fn checked(given: SettingRow) -> Result<SettingRow, Failure> {
    let address = judge::address(&given.address).map_err(|why| bad_data("set", &why))?;
    judge::value(&given.value).map_err(|why| bad_data("set", &why))?;
    Ok(SettingRow { address, ..given })
}

/// `set ADDRESS STAGE KEY VALUE`, for a setting [`checked`] already.
pub fn set(session: &mut Session, row: SettingRow) -> Result<(), Failure> {
    let mut tx = session.client.transaction().map_err(failed)?;
    let overlay = begin(&mut tx)?;
    let judge = judge_for("set", &session.config, &overlay)?;
    if let Some(why) = judge.names(&row) {
        return Err(refused("set", &why));
    }
    let current = read_group(&mut tx, &row.address, &row.stage)?;
    let mut overrides = applied(&judge, &current);
    overrides.insert(row.key.clone(), row.value.clone());
    let (errors, warnings) = judge.values(&row.address, &row.stage, &overrides);
    if !errors.is_empty() {
        return Err(refused("set", &join_errors(&errors)));
    }
    write(&mut tx, &[&row])?;
    tx.commit().map_err(failed)?;
    warn(&warnings);
    emit(
        format!(
            "{} = {}; the workers apply it from the next message\n",
            judge::named(&row.address, &row.stage, &row.key),
            Visible(&row.value)
        )
        .as_bytes(),
    )
}

/// `unset ADDRESS STAGE KEY`. Refused when the address's other settings at the stage
/// would then break its section; a setting of a stage without a section, or one the
/// workers ignore, is always removed.
pub fn unset(session: &mut Session, address: &str, stage: &str, key: &str) -> Result<(), Failure> {
    let address = address.to_lowercase();
    let name = judge::named(&address, stage, key);
    let mut tx = session.client.transaction().map_err(failed)?;
    let overlay = begin(&mut tx)?;
    let current = read_group(&mut tx, &address, stage)?;
    let Some(removed) = current.iter().find(|r| r.key == key) else {
        return Err(bad_data("unset", &format!("there is no setting {name}")));
    };
    // With a graph the dispatcher would refuse, nothing is judged: removing a setting
    // is how one is repaired. Nor is the removal of a row the workers ignore, which
    // changes nothing they lay over the section.
    if let Ok(judge) = Judge::new(&session.config, &overlay) {
        let rest = applied(&judge, current.iter().filter(|r| r.key != key));
        if judge.has_stage(stage) && judge.applies(removed) && !rest.is_empty() {
            let (errors, _) = judge.values(&address, stage, &rest);
            if !errors.is_empty() {
                return Err(refused("unset", &join_errors(&errors)));
            }
        }
    }
    delete(&mut tx, &[(&address, stage, key)])?;
    tx.commit().map_err(failed)?;
    emit(format!("{name} removed; the workers apply it from the next message\n").as_bytes())
}

/// `import [--replace]`: the checked settings of the file (`lines`, from `source`)
/// written in one transaction, all or nothing. Merged into the table (each setting of
/// the file added or its value replaced; the others kept), or with `replace` the table
/// made exactly the file (every setting the file lacks removed).
pub fn import(
    session: &mut Session,
    lines: &[Line],
    replace: bool,
    source: &str,
) -> Result<(), Failure> {
    let mut tx = session.client.transaction().map_err(failed)?;
    let overlay = begin(&mut tx)?;
    let judge = judge_for("import", &session.config, &overlay)?;
    let mut problems: Vec<(u64, String)> = lines
        .iter()
        .filter_map(|l| judge.names(&l.row).map(|why| (l.number, why)))
        .collect();
    // The table as it is: all of it to replace it, else the groups (address, stage)
    // the file touches.
    let touched: BTreeSet<(&str, &str)> = lines
        .iter()
        .map(|l| (l.row.address.as_str(), l.row.stage.as_str()))
        .collect();
    let current = if replace {
        read(
            &mut tx,
            sql_settings::READ_SETTINGS,
            &[&None::<&str>, &None::<&str>],
        )?
    } else {
        let a: Vec<&str> = touched.iter().map(|g| g.0).collect();
        let s: Vec<&str> = touched.iter().map(|g| g.1).collect();
        read(&mut tx, sql_settings::READ_SETTINGS_OF, &[&a, &s])?
    };
    // Each touched group as it would be after the import, and the file's line of each
    // of its settings (its first line for a problem of the whole group).
    let mut groups: BTreeMap<(&str, &str), Vec<&SettingRow>> = BTreeMap::new();
    if !replace {
        for row in &current {
            groups
                .entry((&row.address, &row.stage))
                .or_default()
                .push(row);
        }
    }
    let mut line_of: HashMap<(&str, &str, &str), u64> = HashMap::new();
    for l in lines {
        let rows = groups.entry((&l.row.address, &l.row.stage)).or_default();
        rows.retain(|r| r.key != l.row.key);
        rows.push(&l.row);
        line_of.insert((&l.row.address, &l.row.stage, &l.row.key), l.number);
    }
    let mut warnings = Vec::new();
    for ((address, stage), rows) in &groups {
        if !judge.has_stage(stage) {
            continue;
        }
        let (errors, warned) = judge.values(address, stage, &applied(&judge, rows.iter().copied()));
        warnings.extend(warned);
        let first = rows
            .iter()
            .filter_map(|r| line_of.get(&(address, stage, r.key.as_str())))
            .min()
            .copied()
            .unwrap_or(0);
        for e in errors {
            let number = e
                .key
                .as_deref()
                .and_then(|k| line_of.get(&(address, stage, k)))
                .copied()
                .unwrap_or(first);
            problems.push((number, e.to_string()));
        }
    }
    if !problems.is_empty() {
        problems.sort();
        let mut listed = Problems::default();
        for (number, text) in problems {
            listed.push(number, text);
        }
        return Err(refused("import", &listed.report()));
    }
    // What changes: the file's settings that are new or have another value, and with
    // --replace the table's settings the file lacks.
    let before: HashMap<(&str, &str, &str), &str> = current
        .iter()
        .map(|r| ((&*r.address, &*r.stage, &*r.key), &*r.value))
        .collect();
    let mut writes = Vec::new();
    let (mut added, mut changed) = (0usize, 0usize);
    for l in lines {
        let id = (&*l.row.address, &*l.row.stage, &*l.row.key);
        match before.get(&id) {
            None => added += 1,
            Some(v) if *v != l.row.value => changed += 1,
            Some(_) => continue,
        }
        writes.push(&l.row);
    }
    let removals: Vec<(&str, &str, &str)> = if replace {
        before
            .keys()
            .filter(|id| !line_of.contains_key(id))
            .copied()
            .collect()
    } else {
        Vec::new()
    };
    delete(&mut tx, &removals)?;
    write(&mut tx, &writes)?;
    tx.commit().map_err(failed)?;
    warn(&warnings);
    let unchanged = lines.len() - added - changed;
    let removed = if replace {
        format!(", {} removed", removals.len())
    } else {
        String::new()
    };
    emit(
        format!(
            "{source}: {} settings imported ({added} added, {changed} changed, {unchanged} \
             unchanged{removed}); the workers apply them from the next message\n",
            lines.len()
        )
        .as_bytes(),
    )
}
