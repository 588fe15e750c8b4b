//! The reading commands of `pepsi-settings`: `list` (one setting a line), `get` (one
//! address's settings as the sections they are laid over) and `export` (the import
//! format of `line.rs`). Each reads the table in one statement and writes as it reads,
//! so a large table is never held whole.
//!
//! Text for people escapes every value ([`Visible`]): an address, a stage or a value
//! written by another tool may hold anything. `--json` gives values exactly. `list`
//! and `get` say which rows the workers ignore and why (`judge::ignored`), judged by
//! the stage sections of the file and the overlay, as `pepsi-dispatch check` judges
//! them. Reads only; called by `settings::run`.

use std::io::{BufWriter, ErrorKind, StdoutLock, Write};

use postgres::fallible_iterator::FallibleIterator;
use serde_json::json;

use super::judge;
use super::line;
use crate::db::{self, sql_settings};
use crate::escape::Visible;
use crate::exit::{EX_IOERR, Failure};
use crate::queue::{Session, db_failure};
use crate::worker::settings::SettingRow;

/// Standard output, buffered; a reader that went away (`| head`) ends the output
/// without an error, as `queue::emit` has it.
struct Out {
    writer: BufWriter<StdoutLock<'static>>,
    gone: bool,
}

impl Out {
    fn new() -> Out {
        Out {
            writer: BufWriter::new(std::io::stdout().lock()),
            gone: false,
        }
    }

    /// Writes `text`; whether the reader is still there.
    fn write(&mut self, text: &str) -> Result<bool, Failure> {
        if !self.gone {
            if let Err(e) = self.writer.write_all(text.as_bytes()) {
                self.failed(e)?;
            }
        }
        Ok(!self.gone)
    }

    /// Flushes what is left.
    fn finish(mut self) -> Result<(), Failure> {
        if !self.gone {
            if let Err(e) = self.writer.flush() {
                self.failed(e)?;
            }
        }
        Ok(())
    }

    fn failed(&mut self, e: std::io::Error) -> Result<(), Failure> {
        if e.kind() == ErrorKind::BrokenPipe {
            self.gone = true;
            return Ok(());
        }
        Err(Failure::new(
            EX_IOERR,
            format!("cannot write to standard output: {e}"),
        ))
    }
}

/// Hands every row of `READ_SETTINGS` for `address` and `stage` (`None`: all) to
/// `each`, in order, until it answers false.
fn each_row(
    session: &mut Session,
    address: Option<&str>,
    stage: Option<&str>,
    mut each: impl FnMut(SettingRow) -> Result<bool, Failure>,
) -> Result<(), Failure> {
    let failed = |e: postgres::Error| db_failure("reading pepsi.settings", &e);
    let params: [&(dyn postgres::types::ToSql + Sync); 2] = [&address, &stage];
    let mut rows = session
        .client
        .query_raw(sql_settings::READ_SETTINGS, params)
        .map_err(failed)?;
    while let Some(row) = rows.next().map_err(failed)? {
        let row = SettingRow {
            address: row.try_get(0).map_err(failed)?,
            stage: row.try_get(1).map_err(failed)?,
            key: row.try_get(2).map_err(failed)?,
            value: row.try_get(3).map_err(failed)?,
        };
        if !each(row)? {
            break;
        }
    }
    Ok(())
}

/// The programs of the stage sections (file and overlay), to judge rows by.
fn programs(session: &mut Session) -> Result<std::collections::BTreeMap<String, String>, Failure> {
    let overlay = db::read_overlay(&mut session.client)
        .map_err(|e| db_failure("reading pepsi.config_override", &e))?;
    Ok(judge::programs(&session.config, &overlay))
}

/// `list [ADDRESS] [--stage S] [--json]`: the settings, ordered by address, stage and
/// key; in text `ADDRESS [stage-STAGE] KEY = VALUE`, a row the workers ignore followed
/// by `# ` and why.
pub fn list(
    session: &mut Session,
    address: Option<&str>,
    stage: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let address = address.map(str::to_lowercase);
    let programs = programs(session)?;
    let mut out = Out::new();
    let mut first = true;
    if json {
        out.write("{\"settings\":[")?;
    }
    each_row(session, address.as_deref(), stage, |row| {
        let ignored = judge::ignored(&programs, &row);
        let text = if json {
            let item = json!({
                "address": row.address,
                "stage": row.stage,
                "key": row.key,
                "value": row.value,
                "ignored": ignored,
            });
            format!("{}{item}", if first { "" } else { "," })
        } else {
            let mut text = format!(
                "{} [stage-{}] {} = {}",
                Visible(&row.address),
                Visible(&row.stage),
                Visible(&row.key),
                Visible(&row.value)
            );
            if let Some(why) = ignored {
                text.push_str(&format!("  # {}", Visible(&why)));
            }
            text.push('\n');
            text
        };
        first = false;
        out.write(&text)
    })?;
    if json {
        out.write("]}\n")?;
    }
    out.finish()
}

/// `get ADDRESS [--json]`: one address's settings, in text as the sections of the
/// stages they are laid over (`[stage-STAGE]`, then `KEY = VALUE` lines), a row the
/// workers ignore followed by `# ` and why.
pub fn get(session: &mut Session, address: &str, json: bool) -> Result<(), Failure> {
    let address = address.to_lowercase();
    let programs = programs(session)?;
    let mut out = Out::new();
    let mut stage_now: Option<String> = None;
    if json {
        out.write(&format!(
            "{{\"address\":{},\"settings\":[",
            serde_json::Value::String(address.clone())
        ))?;
    }
    each_row(session, Some(&address), None, |row| {
        let ignored = judge::ignored(&programs, &row);
        let mut text = String::new();
        if json {
            if stage_now.is_some() {
                text.push(',');
            }
            let item = json!({
                "stage": row.stage,
                "key": row.key,
                "value": row.value,
                "ignored": ignored,
            });
            text.push_str(&item.to_string());
        } else {
            if stage_now.as_deref() != Some(row.stage.as_str()) {
                if stage_now.is_some() {
                    text.push('\n');
                }
                text.push_str(&format!("[stage-{}]\n", Visible(&row.stage)));
            }
            text.push_str(&format!("{} = {}", Visible(&row.key), Visible(&row.value)));
            if let Some(why) = ignored {
                text.push_str(&format!("  # {}", Visible(&why)));
            }
            text.push('\n');
        }
        stage_now = Some(row.stage);
        out.write(&text)
    })?;
    if json {
        out.write("]}\n")?;
    } else if stage_now.is_none() {
        out.write(&format!("# {} has no settings\n", Visible(&address)))?;
    }
    out.finish()
}

/// `export`: [`line::HEADER`], then every setting a line ([`line::encode`]), ordered
/// by address, stage and key.
pub fn export(session: &mut Session) -> Result<(), Failure> {
    let mut out = Out::new();
    out.write(&format!("{}\n", line::HEADER))?;
    each_row(session, None, None, |row| {
        let mut text = line::encode(&row);
        text.push('\n');
        out.write(&text)
    })?;
    out.finish()
}
