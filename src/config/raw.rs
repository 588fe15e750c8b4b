//! The raw parse of `pepsi.conf`: sections of `KEY = value` entries, each remembering
//! the file and line it came from, and [`Section`], the view every later phase reads.
//!
//! Nothing here knows what a key means; [`super`] checks the fixed sections and
//! [`super::graph`] the stage sections. It knows one thing about section names: a
//! stage's is `stage-NAME` ([`STAGE_PREFIX`], [`valid_stage_name`]).
//!
//! A leaf of the configuration: `Config::load` and `crate::check` read the file with
//! [`search`] and [`read`], every other file of `config` reads through [`Section`], and
//! this one uses none of them (only `crate::escape`, to show values in messages).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::durability::SynchronousCommit;
use crate::escape::Visible;

/// Where a configuration value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A line of a configuration file.
    File {
        /// The file.
        path: Arc<Path>,
        /// The 1-based line number.
        line: u32,
    },
    /// A row of `pepsi.config_override`.
    Override,
    /// A row of `pepsi.settings` for this address.
    Address(String),
    /// A built-in default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line } => write!(f, "{}:{line}", path.display()),
            Origin::Override => f.write_str("pepsi.config_override"),
            Origin::Address(a) => write!(f, "pepsi.settings for {}", Visible(a)),
            Origin::Default => f.write_str("default"),
        }
    }
}

/// One configuration problem, naming where it is and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// Where: a file and line, the overlay, or an address's settings.
    pub origin: Origin,
    /// The section, when the problem is inside one.
    pub section: Option<String>,
    /// The key, when the problem is one key's value.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    /// A problem at a place, outside any section or key.
    pub fn at(origin: Origin, message: impl Into<String>) -> ConfigError {
        ConfigError {
            origin,
            section: None,
            key: None,
            message: message.into(),
        }
    }
}

/// A problem as one line. Overlay rows and per-address settings come from the
/// database, so every part is shown escaped ([`Visible`]).
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.origin)?;
        if let Some(section) = &self.section {
            write!(f, " [{}]", Visible(section))?;
        }
        if let Some(key) = &self.key {
            write!(f, " {}:", Visible(key))?;
        }
        write!(f, " {}", Visible(&self.message))
    }
}

/// Collects problems while a section is checked, so every one is reported.
#[derive(Debug, Default)]
pub struct Problems(pub Vec<ConfigError>);

impl Problems {
    /// The value, or `None` after recording the problem.
    pub fn ok<T>(&mut self, result: Result<T, ConfigError>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.0.push(e);
                None
            }
        }
    }

    /// Records a problem.
    pub fn push(&mut self, e: ConfigError) {
        self.0.push(e);
    }

    /// No problem so far.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Joins several problems into one message, one per line.
pub fn join_errors(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// A value with its origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    /// The text after `=`, trimmed.
    pub text: String,
    /// Where it was set.
    pub origin: Origin,
}

/// A section: its name and its keys, each with where it was set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// The name between the brackets, e.g. `stage-if`.
    pub name: String,
    /// Where the section header is (for "missing key" errors).
    pub origin: Origin,
    entries: BTreeMap<String, Value>,
}

impl Section {
    /// An empty section.
    pub fn new(name: impl Into<String>, origin: Origin) -> Section {
        Section {
            name: name.into(),
            origin,
            entries: BTreeMap::new(),
        }
    }

    /// Sets a key; an empty value unsets it (an overlay's way to remove a file's key).
    pub fn set(&mut self, key: &str, text: &str, origin: Origin) {
        if text.is_empty() {
            self.entries.remove(key);
        } else {
            self.entries.insert(
                key.to_string(),
                Value {
                    text: text.to_string(),
                    origin,
                },
            );
        }
    }

    /// The raw text of a key.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.get(key).map(|v| v.text.as_str())
    }

    /// The value of a key with its origin.
    pub fn value(&self, key: &str) -> Option<&Value> {
        self.entries.get(key)
    }

    /// Every key and value, in key order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// An error about a key of this section, located at the key (or the header when
    /// the key is not set).
    pub fn error(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            origin: self
                .entries
                .get(key)
                .map_or_else(|| self.origin.clone(), |v| v.origin.clone()),
            section: Some(self.name.clone()),
            key: Some(key.to_string()),
            message: message.into(),
        }
    }

    /// A required key.
    pub fn required(&self, key: &str) -> Result<&str, ConfigError> {
        self.get(key)
            .ok_or_else(|| self.error(key, "is required but not set"))
    }

    /// A duration (`300s`, `5m`, `120h`, a bare number of seconds), or the default.
    pub fn duration(&self, key: &str, default: Duration) -> Result<Duration, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(text) => parse_duration(text).map_err(|m| self.error(key, m)),
        }
    }

    /// A boolean (yes/no, true/false, on/off, 1/0), or the default.
    pub fn boolean(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        self.optional_boolean(key).map(|b| b.unwrap_or(default))
    }

    /// A boolean, or `None` when the key is not set.
    pub fn optional_boolean(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(text) => parse_bool(text).map(Some).map_err(|m| self.error(key, m)),
        }
    }

    /// A `synchronous_commit` level, or `None` when the key is not set.
    pub fn optional_synchronous_commit(
        &self,
        key: &str,
    ) -> Result<Option<SynchronousCommit>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(text) => SynchronousCommit::parse(text)
                .map(Some)
                .map_err(|m| self.error(key, m)),
        }
    }

    /// A whole number within `range`, or the default.
    pub fn number<T>(
        &self,
        key: &str,
        default: T,
        range: RangeInclusive<T>,
    ) -> Result<T, ConfigError>
    where
        T: FromStr + PartialOrd + fmt::Display + Copy,
    {
        match self.get(key) {
            None => Ok(default),
            Some(text) => match text.parse::<T>() {
                Ok(n) if n < *range.start() => Err(self.error(
                    key,
                    format!("{text:?} is below the minimum {}", range.start()),
                )),
                Ok(n) if n > *range.end() => Err(self.error(
                    key,
                    format!("{text:?} is above the maximum {}", range.end()),
                )),
                Ok(n) => Ok(n),
                Err(_) => Err(self.error(key, format!("{text:?} is not a whole number"))),
            },
        }
    }
}

/// A duration as the file would write it: the largest of `d`, `h`, `m`, `s` that
/// divides it, else milliseconds (`90s`, `5m`, `2h`, `1500ms`).
pub fn show_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 1000 != 0 {
        return format!("{ms}ms");
    }
    let s = ms / 1000;
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if s >= size && s % size == 0 {
            return format!("{}{unit}", s / size);
        }
    }
    format!("{s}s")
}

/// Parses a duration: a number with an optional unit `ms`, `s`, `m`, `h`, `d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let bad = || format!("{text:?} is not a duration (a number with ms, s, m, h or d, e.g. 300s)");
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let secs = |factor: u64| n.checked_mul(factor).map(Duration::from_secs);
    let d = match unit.trim() {
        "" | "s" | "sec" | "secs" => secs(1),
        "ms" => Some(Duration::from_millis(n)),
        "m" | "min" | "mins" => secs(60),
        "h" => secs(3600),
        "d" => secs(86_400),
        _ => None,
    };
    match d {
        Some(d) if d > MAX_DURATION => Err(format!(
            "{text:?} is longer than the maximum of {} days",
            MAX_DURATION.as_secs() / 86_400
        )),
        Some(d) => Ok(d),
        None => Err(bad()),
    }
}

/// The longest duration a setting takes: ten years, far beyond any sensible timer and
/// far below what the clock arithmetic overflows at.
pub const MAX_DURATION: Duration = Duration::from_secs(3650 * 86_400);

/// Parses a boolean: yes/no, true/false, on/off, 1/0 (any case).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "yes" | "true" | "on" | "1" => Ok(true),
        "no" | "false" | "off" | "0" => Ok(false),
        _ => Err(format!(
            "{text:?} is not a boolean (yes/no, true/false, on/off, 1/0)"
        )),
    }
}

/// Is this a valid key: upper-case letters, digits and `_`, starting with a letter.
fn valid_key(key: &str) -> bool {
    let mut chars = key.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_uppercase())
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// The prefix of a stage section's name: `[stage-NAME]` is stage `NAME`.
pub const STAGE_PREFIX: &str = "stage-";

/// Is this a valid stage name: one or more ASCII letters, digits, `.`, `_` and `-`, the
/// characters a section name of the file may hold. Stage names reach logs, terminals and
/// metrics labels as they are, so nothing else is taken, from the file or the overlay.
pub fn valid_stage_name(name: &str) -> bool {
    valid_section(name)
}

/// Why a stage name is refused, for a message.
pub const STAGE_NAME_RULE: &str =
    "a stage name is one or more ASCII letters, digits, '.', '_' and '-'";

/// Is this a valid section name: one or more ASCII letters, digits, `-`, `_`, `.`.
pub fn valid_section(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Parses configuration text. Every problem is returned, not only the first.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Section>, Vec<ConfigError>> {
    let (sections, errors) = parse_all(path, text);
    if errors.is_empty() {
        Ok(sections)
    } else {
        Err(errors)
    }
}

/// Parses configuration text as far as it goes: the sections of every line that could
/// be read (a key set twice keeps its first value), and every problem, so that the
/// checks of later phases still run on the rest and report their problems too.
pub fn parse_all(path: &Path, text: &str) -> (Vec<Section>, Vec<ConfigError>) {
    let path: Arc<Path> = Arc::from(path);
    let mut sections: Vec<Section> = Vec::new();
    let mut errors = Vec::new();
    for (index, raw_line) in text.lines().enumerate() {
        let origin = Origin::File {
            path: path.clone(),
            line: index as u32 + 1,
        };
        let line = raw_line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(inner) = line.strip_prefix('[') {
            let Some(name) = inner.strip_suffix(']').map(str::trim) else {
                errors.push(ConfigError::at(
                    origin,
                    format!("section header {line:?} lacks its closing ']'"),
                ));
                continue;
            };
            if !valid_section(name) {
                errors.push(ConfigError::at(
                    origin,
                    format!("section name {name:?} is not valid (letters, digits, '-', '_', '.')"),
                ));
                continue;
            }
            // A section named twice continues where it left off; a key set twice is
            // still an error below.
            if let Some(pos) = sections.iter().position(|s| s.name == name) {
                let s = sections.remove(pos);
                sections.push(s);
            } else {
                sections.push(Section::new(name, origin));
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            errors.push(ConfigError {
                section: sections.last().map(|s| s.name.clone()),
                ..ConfigError::at(
                    origin,
                    format!("expected [section] or KEY = value, found {line:?}"),
                )
            });
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        let Some(section) = sections.last_mut() else {
            errors.push(ConfigError {
                key: Some(key.to_string()),
                ..ConfigError::at(origin, "is set outside any [section]")
            });
            continue;
        };
        if !valid_key(key) {
            errors.push(ConfigError {
                section: Some(section.name.clone()),
                ..ConfigError::at(
                    origin,
                    format!("{key:?} is not a valid key (upper-case letters, digits and '_')"),
                )
            });
            continue;
        }
        if let Some(previous) = section.entries.get(key) {
            errors.push(ConfigError {
                section: Some(section.name.clone()),
                key: Some(key.to_string()),
                ..ConfigError::at(origin, format!("is already set at {}", previous.origin))
            });
            continue;
        }
        section.set(key, value, origin);
    }
    (sections, errors)
}

/// The UTF-8 byte order mark, which some editors write at the start of a file.
const BOM: &str = "\u{feff}";

/// A configuration file as read: its sections, its problems, and its text.
#[derive(Debug)]
pub struct FileRead {
    /// Every section that could be read.
    pub sections: Vec<Section>,
    /// Every problem of the parse.
    pub errors: Vec<ConfigError>,
    /// The text parsed (a line that is not UTF-8 left empty, the byte order mark gone).
    pub text: String,
}

/// Reads and parses a configuration file as far as it goes (see [`parse_all`]); `Err`
/// only when the file cannot be read at all. A line that is not UTF-8 is an error
/// naming it, and is read as empty; a byte order mark at the start is ignored.
pub fn read_all(path: &Path) -> Result<FileRead, Vec<ConfigError>> {
    let bytes = std::fs::read(path).map_err(|e| {
        vec![ConfigError::at(
            Origin::File {
                path: Arc::from(path),
                line: 0,
            },
            format!("cannot read the configuration file: {e}"),
        )]
    })?;
    // Problems name the file the text came from, also in a worker's handed copy.
    let shown = shown_path(path);
    let path = shown.as_path();
    let mut errors = Vec::new();
    let mut text = String::with_capacity(bytes.len());
    for (index, line) in bytes.split(|b| *b == b'\n').enumerate() {
        if index > 0 {
            text.push('\n');
        }
        match std::str::from_utf8(line) {
            Ok(line) => text.push_str(line),
            Err(e) => errors.push(ConfigError::at(
                Origin::File {
                    path: Arc::from(path),
                    line: index as u32 + 1,
                },
                format!(
                    "is not UTF-8 (byte {} of the line); the line is ignored",
                    e.valid_up_to() + 1
                ),
            )),
        }
    }
    let text = match text.strip_prefix(BOM) {
        Some(rest) => rest.to_string(),
        None => text,
    };
    let (sections, more) = parse_all(path, &text);
    errors.extend(more);
    errors.sort_by_key(|e| match &e.origin {
        Origin::File { line, .. } => *line,
        _ => 0,
    });
    Ok(FileRead {
        sections,
        errors,
        text,
    })
}

/// The environment variable in which the dispatcher names the file a worker's handed
/// configuration ([`super::handoff`]) was made from; the worker reads the copy at
/// [`HANDED_PREFIX`]`N` and names this file in its messages.
pub const ORIGIN_ENV: &str = "PEPSI_CONFIG_ORIGIN";

/// Where a worker finds its handed configuration: the descriptor the dispatcher gave it.
pub const HANDED_PREFIX: &str = "/proc/self/fd/";

/// The path messages name for the configuration read from `path`: the file named by
/// [`ORIGIN_ENV`] when `path` is a handed copy, else `path` itself.
fn shown_path(path: &Path) -> PathBuf {
    match std::env::var_os(ORIGIN_ENV) {
        Some(origin) if !origin.is_empty() && path.starts_with(HANDED_PREFIX) => {
            PathBuf::from(origin)
        }
        _ => path.to_path_buf(),
    }
}

/// Where the configuration is read from when neither `-c` nor `$PEPSI_CONFIG` is given.
pub const DEFAULT_PATH: &str = "/etc/pepsi/pepsi.conf";

/// The configuration file to read: `-c FILE`, else `$PEPSI_CONFIG`, else
/// `/etc/pepsi/pepsi.conf`.
pub fn search(explicit: Option<&Path>) -> PathBuf {
    if let Some(path) = explicit {
        return path.to_path_buf();
    }
    match std::env::var_os("PEPSI_CONFIG") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(DEFAULT_PATH),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Vec<Section>, Vec<ConfigError>> {
        parse(Path::new("/etc/pepsi/test.conf"), text)
    }

    #[test]
    fn sections_keys_comments_and_blanks() {
        let s = p("# top\n\n[pepsi]\nALLOW_FUSION = no\n  # indented comment\n[stage-if]\nPROGRAM=pepsi-stage-if\nMATCH = subject contains \"a = b\"\n").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].get("ALLOW_FUSION"), Some("no"));
        assert_eq!(s[1].get("PROGRAM"), Some("pepsi-stage-if"));
        assert_eq!(s[1].get("MATCH"), Some("subject contains \"a = b\""));
        assert_eq!(
            s[1].value("PROGRAM").unwrap().origin.to_string(),
            "/etc/pepsi/test.conf:7"
        );
    }

    #[test]
    fn every_syntax_error_names_file_and_line() {
        let errs = p("KEY = 1\n[pepsi\n[bad name]\n[pepsi]\nnot a line\nlower = 1\nA = 1\nA = 2\n")
            .unwrap_err();
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), 6, "{text:#?}");
        assert!(text[0].starts_with("/etc/pepsi/test.conf:1: KEY: is set outside"));
        assert!(text[1].starts_with("/etc/pepsi/test.conf:2: section header"));
        assert!(text[2].starts_with("/etc/pepsi/test.conf:3: section name"));
        assert!(text[3].starts_with("/etc/pepsi/test.conf:5: [pepsi] expected"));
        assert!(
            text[4].starts_with("/etc/pepsi/test.conf:6: [pepsi] \"lower\" is not a valid key")
        );
        assert_eq!(
            text[5],
            "/etc/pepsi/test.conf:8: [pepsi] A: is already set at /etc/pepsi/test.conf:7"
        );
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("300s"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("300"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("120h"), Ok(Duration::from_secs(432_000)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("-5s").is_err());
        assert_eq!(parse_duration("3650d"), Ok(MAX_DURATION));
        assert!(
            parse_duration("3651d")
                .unwrap_err()
                .contains("longer than the maximum of 3650 days")
        );
        assert!(parse_duration("18446744073709551615").is_err());
    }

    #[test]
    fn numbers_are_checked_against_both_bounds() {
        let s = parse(
            Path::new("/etc/pepsi/test.conf"),
            "[stage-x]\nPARALLELISM = 0\nQUEUE_LIMIT = 4000000000\nMAX_MESSAGES = 7\n",
        )
        .unwrap();
        let e = s[0].number("PARALLELISM", 4u32, 1..=10).unwrap_err();
        assert!(
            e.to_string().ends_with("\"0\" is below the minimum 1"),
            "{e}"
        );
        let e = s[0].number("QUEUE_LIMIT", 4u32, 1..=10).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("\"4000000000\" is above the maximum 10"),
            "{e}"
        );
        assert_eq!(s[0].number("MAX_MESSAGES", 1u64, 1..=10), Ok(7));
    }

    #[test]
    fn booleans_take_every_spelling() {
        for t in ["yes", "TRUE", "on", "1"] {
            assert_eq!(parse_bool(t), Ok(true));
        }
        for t in ["no", "False", "OFF", "0"] {
            assert_eq!(parse_bool(t), Ok(false));
        }
        assert!(parse_bool("maybe").is_err());
    }

    #[test]
    fn value_errors_name_file_line_section_and_key() {
        let s = p("[pepsi-dispatch]\nMAX_RUNTIME = 5 years\nDB_POOL_SIZE = many\n").unwrap();
        let e = s[0].duration("MAX_RUNTIME", Duration::ZERO).unwrap_err();
        assert!(e.to_string().starts_with(
            "/etc/pepsi/test.conf:2: [pepsi-dispatch] MAX_RUNTIME: \"5 years\" is not a duration"
        ));
        let e = s[0].number("DB_POOL_SIZE", 8u32, 1..=1000).unwrap_err();
        assert_eq!(
            e.to_string(),
            "/etc/pepsi/test.conf:3: [pepsi-dispatch] DB_POOL_SIZE: \"many\" is not a whole number"
        );
        let e = s[0].required("CONNECTION").unwrap_err();
        assert_eq!(
            e.to_string(),
            "/etc/pepsi/test.conf:1: [pepsi-dispatch] CONNECTION: is required but not set"
        );
    }

    #[test]
    fn an_empty_value_unsets() {
        let mut s = p("[a]\nK = v\n").unwrap().remove(0);
        s.set("K", "", Origin::Override);
        assert_eq!(s.get("K"), None);
    }

    #[test]
    fn durations_are_shown_as_the_file_would_write_them() {
        let show = |ms| show_duration(Duration::from_millis(ms));
        assert_eq!(show(90_000), "90s");
        assert_eq!(show(300_000), "5m");
        assert_eq!(show(7_200_000), "2h");
        assert_eq!(show(86_400_000), "1d");
        assert_eq!(show(1_500), "1500ms");
        assert_eq!(show(0), "0s");
    }
}
