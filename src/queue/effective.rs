//! `config show [--json]`: the stage graph the dispatcher would run, read from the file
//! and `pepsi.config_override` as the dispatcher reads them, each value marked with
//! where it comes from — a line of the file, the overlay (with the file's value it
//! replaces or unsets), or a built-in default — and the overlay rows it leaves out,
//! each with why.
//!
//! [`Effective::of`] is pure: it lays the overlay over the file's stage sections with
//! the dispatcher's own functions (`config::graph::lay_over`, `Config::graph`,
//! `check::builtin_errors`), judges each overlay row with `lay_over` alone, and takes
//! the defaults from the checked section (`StageSection::check`), so nothing here
//! decides again what the dispatcher decides. [`run`] reads the overlay and prints.
//! Called by `queue::run` only; it writes nothing.
//!
//! Text is for people: every name, value, path and reason is escaped
//! ([`crate::escape::Visible`]). The JSON document gives them exactly; its field names
//! are documented in `pepsi-config(1)` and stay as they are.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde_json::{Value as Json, json};

use crate::check;
use crate::config::graph::{self, OverrideRow, STAGE_PREFIX, StageSection, valid_stage_name};
use crate::config::raw::{Value, show_duration};
use crate::config::{Config, ConfigError, Origin, Section};
use crate::db;
use crate::escape::Visible;
use crate::exit::Failure;

use super::{Session, db_failure, emit, emit_json};

/// The widest the key column of the text grows; a longer `KEY = value` pushes its
/// origin to the right on its own line only.
const KEY_COLUMN_MAX: usize = 40;

/// Why an overlay row is not laid over the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeftOutKind {
    /// A row the overlay may not set (`COMMAND`, `USER`, a `PROGRAM` outside
    /// `[pepsi] PROGRAM_PATH`): left out, the rest of the graph runs without it.
    Refused,
    /// A row of a section other than `[stage-*]`: ignored.
    Ignored,
    /// A row with an invalid stage name or key: not laid over, and the dispatcher
    /// refuses the whole graph for it.
    Invalid,
}

impl LeftOutKind {
    /// The kind's name, in the text and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            LeftOutKind::Refused => "refused",
            LeftOutKind::Ignored => "ignored",
            LeftOutKind::Invalid => "invalid",
        }
    }
}

/// An overlay row the dispatcher does not lay over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// The row as stored.
    pub row: OverrideRow,
    /// Why, in a word.
    pub kind: LeftOutKind,
    /// Why, in full (the dispatcher's own message).
    pub why: String,
}

/// One key of a stage section as the dispatcher runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShownKey {
    /// The key.
    pub key: String,
    /// The value the stage runs with; `None` when the overlay unsets the key and it
    /// has no default.
    pub value: Option<String>,
    /// Where [`ShownKey::value`] comes from: a line of the file, the overlay, or a
    /// default (never an address's settings).
    pub origin: Origin,
    /// Does an overlay row with an empty value unset the key?
    pub unset: bool,
    /// The file's value the overlay replaces or unsets.
    pub replaces: Option<Value>,
}

/// One stage section as the dispatcher runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShownSection {
    /// The section name, `stage-NAME`.
    pub name: String,
    /// Its header line in the file, or the overlay for a section only the overlay has.
    pub origin: Origin,
    /// Its keys, in key order.
    pub keys: Vec<ShownKey>,
}

/// The stage graph of a file and an overlay, as `config show` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    /// The configuration file.
    pub file: PathBuf,
    /// Every stage section with the overlay laid over it, by name.
    pub sections: Vec<ShownSection>,
    /// The overlay rows not laid over, in the overlay's order.
    pub left_out: Vec<LeftOut>,
    /// Why the dispatcher would refuse the graph (at start or at a reload); empty when
    /// it runs it.
    pub errors: Vec<ConfigError>,
}

/// The effective values of the common keys with a fixed default, read back from the
/// checked section (which applied the defaults where the section does not set them).
fn defaults(stage: &StageSection) -> [(&'static str, String); 4] {
    [
        ("MAX_LIFETIME", show_duration(stage.max_lifetime)),
        ("MAX_MESSAGES", stage.max_messages.to_string()),
        ("PARALLELISM", stage.parallelism.to_string()),
        ("QUEUE_LIMIT", stage.queue_limit.to_string()),
    ]
}

/// A stage section's keys: what it sets, what the overlay unsets, and the defaults of
/// the common keys it leaves out (when the section passes its check).
fn shown_keys(
    section: &Section,
    file: Option<&Section>,
    applied: &[&OverrideRow],
) -> Vec<ShownKey> {
    let file_value = |key: &str| file.and_then(|f| f.value(key)).cloned();
    let mut keys: Vec<ShownKey> = section
        .entries()
        .map(|(key, value)| ShownKey {
            key: key.to_string(),
            value: Some(value.text.clone()),
            origin: value.origin.clone(),
            unset: false,
            replaces: match value.origin {
                Origin::Override => file_value(key),
                _ => None,
            },
        })
        .collect();
    // An applied row whose key the section lacks is one that unset it (an empty value).
    for row in applied {
        if row.section == section.name
            && section.get(&row.key).is_none()
            && !keys.iter().any(|k| k.key == row.key)
        {
            keys.push(ShownKey {
                key: row.key.clone(),
                value: None,
                origin: Origin::Override,
                unset: true,
                replaces: file_value(&row.key),
            });
        }
    }
    let name = section.name.strip_prefix(STAGE_PREFIX).unwrap_or_default();
    // The check slices the stage name off the section name; only a name the graph
    // takes is checked (the graph reports the others).
    if valid_stage_name(name) {
        if let Ok(stage) = StageSection::check(section) {
            for (key, value) in defaults(&stage) {
                if section.get(key).is_some() {
                    continue;
                }
                match keys.iter_mut().find(|k| k.key == key) {
                    Some(unset) => {
                        unset.value = Some(value);
                        unset.origin = Origin::Default;
                    }
                    None => keys.push(ShownKey {
                        key: key.to_string(),
                        value: Some(value),
                        origin: Origin::Default,
                        unset: false,
                        replaces: None,
                    }),
                }
            }
        }
    }
    keys.sort_by(|a, b| a.key.cmp(&b.key));
    keys
}

impl Effective {
    /// The stage graph of `config`'s file with `overlay` laid over it, judged as the
    /// dispatcher judges it at start and at a reload.
    pub fn of(config: &Config, overlay: &[OverrideRow]) -> Effective {
        let programs = &config.pepsi.program_path;
        let laid = config.lay_over(overlay);
        // Each row's fate depends on the row and the file alone: laid over by itself,
        // it lands where it lands among the others.
        let mut left_out = Vec::new();
        let mut applied = Vec::new();
        for row in overlay {
            let alone =
                graph::lay_over(&config.stage_sections, std::slice::from_ref(row), programs);
            let fate = [
                (LeftOutKind::Refused, alone.refused),
                (LeftOutKind::Ignored, alone.warnings),
                (LeftOutKind::Invalid, alone.errors),
            ]
            .into_iter()
            .find_map(|(kind, found)| found.into_iter().next().map(|e| (kind, e.message)));
            match fate {
                Some((kind, why)) => left_out.push(LeftOut {
                    row: row.clone(),
                    kind,
                    why,
                }),
                None => applied.push(row),
            }
        }
        let sections = laid
            .sections
            .values()
            .map(|section| {
                let file = config
                    .stage_sections
                    .iter()
                    .find(|s| s.name == section.name);
                ShownSection {
                    name: section.name.clone(),
                    origin: section.origin.clone(),
                    keys: shown_keys(section, file, &applied),
                }
            })
            .collect();
        // The dispatcher's verdict: the graph with `[pepsi] INJECT_STAGES`, then every
        // built-in stage's section as its workers check it.
        let errors = match config.graph(overlay) {
            Ok(graph) => check::builtin_errors(&graph),
            Err(errors) => errors,
        };
        Effective {
            file: config.path.clone(),
            sections,
            left_out,
            errors,
        }
    }

    /// Would the dispatcher run this graph?
    pub fn runs(&self) -> bool {
        self.errors.is_empty()
    }

    /// The text for people, every value escaped.
    pub fn text(&self) -> String {
        let mut out = format!(
            "stage graph: {} with pepsi.config_override laid over it\n",
            Visible(&self.file.display().to_string())
        );
        if self.runs() {
            out.push_str("the dispatcher runs it as shown\n");
        } else {
            out.push_str("the dispatcher refuses it (exit 1 at start, 78 at a reload):\n");
            for e in &self.errors {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        if self.sections.is_empty() {
            out.push_str("\nno stage sections\n");
        }
        for section in &self.sections {
            let mut lines = vec![(
                format!("[{}]", Visible(&section.name)),
                origin_text(&section.origin, false),
            )];
            for key in &section.keys {
                let left = match &key.value {
                    Some(v) => format!("  {} = {}", Visible(&key.key), Visible(v)),
                    None => format!("  {} (unset)", Visible(&key.key)),
                };
                let mut right = origin_text(&key.origin, key.unset);
                if let Some(old) = &key.replaces {
                    let _ = write!(
                        right,
                        ", replacing \"{}\" from {}",
                        Visible(&old.text),
                        origin_text(&old.origin, false)
                    );
                }
                lines.push((left, right));
            }
            out.push('\n');
            out.push_str(&columns(&lines));
        }
        if !self.left_out.is_empty() {
            out.push_str("\noverlay rows left out:\n");
            let lines: Vec<(String, String)> = self
                .left_out
                .iter()
                .map(|l| {
                    (
                        format!(
                            "  [{}] {} = {}",
                            Visible(&l.row.section),
                            Visible(&l.row.key),
                            Visible(&l.row.value)
                        ),
                        format!("{}: {}", l.kind.name(), Visible(&l.why)),
                    )
                })
                .collect();
            out.push_str(&columns(&lines));
        }
        out
    }

    /// The JSON document (field names in `pepsi-config(1)`), every value exact.
    pub fn json(&self) -> Json {
        let sections: Vec<Json> = self
            .sections
            .iter()
            .map(|s| {
                let keys: Vec<Json> = s
                    .keys
                    .iter()
                    .map(|k| {
                        let mut key = json!({
                            "key": k.key,
                            "value": k.value,
                            "unset": k.unset,
                            "replaces": k.replaces.as_ref().map(|old| {
                                let mut replaced = json!({ "value": old.text });
                                origin_fields(&mut replaced, &old.origin);
                                replaced
                            }),
                        });
                        origin_fields(&mut key, &k.origin);
                        key
                    })
                    .collect();
                let mut section = json!({
                    "section": s.name,
                    "stage": s.name.strip_prefix(STAGE_PREFIX).unwrap_or_default(),
                    "keys": keys,
                });
                origin_fields(&mut section, &s.origin);
                section
            })
            .collect();
        let left_out: Vec<Json> = self
            .left_out
            .iter()
            .map(|l| {
                json!({
                    "section": l.row.section,
                    "key": l.row.key,
                    "value": l.row.value,
                    "kind": l.kind.name(),
                    "why": l.why,
                })
            })
            .collect();
        json!({
            "file": self.file.display().to_string(),
            "runs": self.runs(),
            "errors": self.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "stages": sections,
            "left_out": left_out,
        })
    }
}

/// Where a value comes from, for people: `FILE:LINE`, `overlay` or `default` (`default
/// (unset in the overlay)` for a key the overlay unsets).
fn origin_text(origin: &Origin, unset: bool) -> String {
    match origin {
        Origin::File { .. } => Visible(&origin.to_string()).to_string(),
        Origin::Override => "overlay".to_string(),
        Origin::Default if unset => "default (unset in the overlay)".to_string(),
        Origin::Default => "default".to_string(),
        Origin::Address(_) => Visible(&origin.to_string()).to_string(),
    }
}

/// Adds `from` (`file`, `overlay`, `default`), `file` and `line` (both `null` unless
/// from the file) to a JSON object.
fn origin_fields(object: &mut Json, origin: &Origin) {
    let (from, file, line) = match origin {
        Origin::File { path, line } => ("file", json!(path.display().to_string()), json!(line)),
        Origin::Override => ("overlay", Json::Null, Json::Null),
        Origin::Default => ("default", Json::Null, Json::Null),
        Origin::Address(_) => ("address", Json::Null, Json::Null),
    };
    if let Some(map) = object.as_object_mut() {
        map.insert("from".into(), json!(from));
        map.insert("file".into(), file);
        map.insert("line".into(), line);
    }
}

/// Lines of two columns, the second starting two spaces after the widest first one
/// (at most [`KEY_COLUMN_MAX`] characters), each line ending in a newline.
pub(super) fn columns(lines: &[(String, String)]) -> String {
    let width = lines
        .iter()
        .map(|(left, _)| left.chars().count())
        .filter(|w| *w <= KEY_COLUMN_MAX)
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (left, right) in lines {
        let pad = width.saturating_sub(left.chars().count());
        let _ = writeln!(out, "{left}{}  {right}", " ".repeat(pad));
    }
    out
}

/// Runs `config show [--json]`: reads the overlay and prints the graph. Exits 0
/// whether or not the dispatcher would run the graph (the output says which).
pub fn run(session: &mut Session, json: bool) -> Result<(), Failure> {
    let overlay = db::read_overlay(&mut session.client)
        .map_err(|e| db_failure("reading pepsi.config_override", &e))?;
    let shown = Effective::of(&session.config, &overlay);
    if json {
        emit_json(&shown.json())
    } else {
        emit(shown.text().as_bytes())
    }
}
