//! Per-address settings (§12.5): the overrides from `pepsi.settings` that came
//! with the row, grouped by the effective override set of each recipient for a stage,
//! and laid over the stage's section.
//!
//! The correspondent is the envelope sender for a `state.local_origin` message, else
//! each recipient. Pure: no database access here.
//!
//! Also here, the one rule of what a per-address setting may override (§4 "Least
//! privilege"): [`refusal`]. A stage kind declares its overridable keys
//! (`Stage::overridable`), every stage allows [`ALWAYS_OVERRIDABLE`], a program that
//! is not a stage of the [`Registry`] allows nothing else, and [`NEVER_OVERRIDABLE`]
//! and every `*_STAGE` key are refused whatever a stage declares. The worker drops the
//! refused rows of a message before it groups its recipients (so they neither apply
//! nor split a message) and warns once per row; `pepsi-dispatch check` lists them,
//! judged against the built-ins' registry, as the workers judge them.
//!
//! Called by `chain.rs` and `batch.rs` in the worker, and by `pepsi-dispatch check`.
//! It must not touch the database nor name a particular stage: which stages exist is
//! the [`Registry`]'s, given by the caller.

use std::collections::BTreeMap;

use serde_json::Value;

use super::message::Message;
pub use super::message::SettingRow;
use super::registry::Registry;
use crate::config::graph::STAGE_PREFIX;
use crate::config::{ConfigError, Origin, StageGraph, StageSection};

/// Keys no per-address setting overrides, whatever its stage declares: what runs
/// (`PROGRAM`, an exec stage's `COMMAND`), where mail goes (`NEXT`; every key ending in
/// `_STAGE` is refused too), and how the dispatcher runs and fuses the stage.
pub const NEVER_OVERRIDABLE: &[&str] = &[
    "PROGRAM",
    "NEXT",
    "COMMAND",
    "PARALLELISM",
    "QUEUE_LIMIT",
    "MAX_MESSAGES",
    "FUSION",
];

/// Keys a per-address setting may override at every stage, whatever its program.
pub const ALWAYS_OVERRIDABLE: &[&str] = &["MAX_LIFETIME"];

/// Is `key` refused to every per-address setting (§4 "Least privilege")?
pub fn never_overridable(key: &str) -> bool {
    NEVER_OVERRIDABLE.contains(&key) || key.ends_with("_STAGE")
}

/// The keys a per-address setting may override at a stage whose `PROGRAM` is
/// `program`: [`ALWAYS_OVERRIDABLE`] and what its stage in `registry` declares, or
/// [`ALWAYS_OVERRIDABLE`] alone for a program that is not one of them (Pepsi cannot
/// know which of its options are safe in a correspondent's hands); never a key of
/// [`never_overridable`].
pub fn overridable_keys(registry: Registry, program: &str) -> Vec<&'static str> {
    let declared = registry
        .for_program(program)
        .map_or(&[][..], |b| b.overridable());
    permitted(declared)
}

/// [`ALWAYS_OVERRIDABLE`] and `declared`, less every key [`never_overridable`] refuses.
fn permitted(declared: &[&'static str]) -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = Vec::new();
    for key in ALWAYS_OVERRIDABLE.iter().chain(declared) {
        if !never_overridable(key) && !keys.contains(key) {
            keys.push(key);
        }
    }
    keys
}

/// Does a `pepsi.settings` row for `key` apply at a stage whose `PROGRAM` is `program`
/// (`None`: a stage without a section), among the stages of `registry`? The rule of
/// [`refusal`], without building its message: what a worker asks of every row of every
/// message it loads.
pub fn applies(registry: Registry, key: &str, program: Option<&str>) -> bool {
    if never_overridable(key) {
        return false;
    }
    let Some(program) = program else {
        return true;
    };
    ALWAYS_OVERRIDABLE.contains(&key)
        || registry
            .for_program(program)
            .is_some_and(|b| b.overridable().contains(&key))
}

/// Why a `pepsi.settings` row is ignored, as a problem naming the row (address, stage
/// and key), or `None` when it applies ([`applies`]). `program` is the `PROGRAM` of the row's stage,
/// `None` when the stage has no section: such a row is refused only for a key no stage
/// may have overridden (it has no effect anyway until the stage exists, and then it is
/// judged by that stage's program). `registry` holds the stages a program may be.
pub fn refusal(registry: Registry, row: &SettingRow, program: Option<&str>) -> Option<ConfigError> {
    if applies(registry, &row.key, program) {
        return None;
    }
    let why = if never_overridable(&row.key) {
        format!("{} is never overridable per address; ignored", row.key)
    } else {
        let program = program?;
        let allowed = overridable_keys(registry, program);
        let name = program.rsplit('/').next().unwrap_or(program);
        let kind = if registry.for_program(program).is_some() {
            format!("{name} allows only {}", allowed.join(", "))
        } else {
            format!(
                "{name} is not a built-in stage, which allows only {}",
                allowed.join(", ")
            )
        };
        format!(
            "{} is not overridable per address at stage {} ({kind}); ignored",
            row.key, row.stage
        )
    };
    Some(ConfigError {
        origin: Origin::Address(row.address.clone()),
        section: Some(format!("{STAGE_PREFIX}{}", row.stage)),
        key: Some(row.key.clone()),
        message: why,
    })
}

/// The overrides of one correspondent for one stage, by key.
pub type Overrides = BTreeMap<String, String>;

/// Parses the settings column of the load query: a JSON array of
/// `[address, stage, key, value]`, or NULL.
pub fn parse(text: Option<&str>) -> Vec<SettingRow> {
    let Some(Ok(Value::Array(items))) = text.map(serde_json::from_str::<Value>) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| match item.as_array().map(Vec::as_slice) {
            Some(
                [
                    Value::String(a),
                    Value::String(s),
                    Value::String(k),
                    Value::String(v),
                ],
            ) => Some(SettingRow {
                address: a.clone(),
                stage: s.clone(),
                key: k.clone(),
                value: v.clone(),
            }),
            _ => None,
        })
        .collect()
}

fn overrides_of(rows: &[SettingRow], address: &str, stage: &str) -> Overrides {
    let address = address.to_lowercase();
    rows.iter()
        .filter(|r| r.stage == stage && r.address == address)
        .map(|r| (r.key.clone(), r.value.clone()))
        .collect()
}

/// One group of recipients sharing the same effective overrides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// The overrides for the stage.
    pub overrides: Overrides,
    /// The address they came from (for error messages): the sender, or the group's
    /// first recipient.
    pub correspondent: String,
    /// The recipients.
    pub recipients: Vec<String>,
}

/// The recipients of `message` grouped by their effective overrides for `stage`, the
/// group of the first recipient first, each group in recipient order.
pub fn groups(message: &Message, stage: &str) -> Vec<Group> {
    if message.local_origin() || message.settings.is_empty() {
        return vec![Group {
            overrides: overrides_of(&message.settings, message.mail_from(), stage),
            correspondent: message.mail_from().to_lowercase(),
            recipients: message.rcpt_to().to_vec(),
        }];
    }
    let mut out: Vec<Group> = Vec::new();
    for rcpt in message.rcpt_to() {
        let overrides = overrides_of(&message.settings, rcpt, stage);
        match out.iter_mut().find(|g| g.overrides == overrides) {
            Some(g) => g.recipients.push(rcpt.clone()),
            None => out.push(Group {
                overrides,
                correspondent: rcpt.to_lowercase(),
                recipients: vec![rcpt.clone()],
            }),
        }
    }
    out
}

/// A stable text key of an override set, for caching configured stages.
pub fn cache_key(overrides: &Overrides) -> String {
    overrides
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("\0")
}

/// The stage's section with a correspondent's overrides laid over it, checked like any
/// section (values and stage references).
pub fn apply(
    section: &StageSection,
    overrides: &Overrides,
    correspondent: &str,
    graph: &StageGraph,
) -> Result<StageSection, Vec<ConfigError>> {
    if overrides.is_empty() {
        return Ok(section.clone());
    }
    let mut raw = section.section.clone();
    for (k, v) in overrides {
        // Trimmed like the file's and the overlay's values.
        raw.set(k, v.trim(), Origin::Address(correspondent.to_string()));
    }
    let checked = StageSection::check(&raw)?;
    let dangling: Vec<ConfigError> = checked
        .references()
        .filter(|(_, target)| !graph.contains(target))
        .map(|(key, target)| {
            raw.error(key, format!("names stage {target:?}, which does not exist"))
        })
        .collect();
    if dangling.is_empty() {
        Ok(checked)
    } else {
        Err(dangling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn message(rcpts: &[&str], local: bool, rows: &[(&str, &str, &str, &str)]) -> Message {
        let mut state = Map::new();
        if local {
            state.insert("local_origin".into(), Value::Bool(true));
        }
        let mut m = Message::new(
            1,
            "s".into(),
            "Sender@X.example".into(),
            rcpts.iter().map(|s| s.to_string()).collect(),
            None,
            None,
            state,
            "k".into(),
        );
        m.settings = rows
            .iter()
            .map(|(a, s, k, v)| SettingRow {
                address: a.to_string(),
                stage: s.to_string(),
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect();
        m
    }

    #[test]
    fn recipients_with_the_same_overrides_stay_together() {
        let m = message(
            &["a@x", "B@y", "c@z"],
            false,
            &[
                ("b@y", "s", "K", "1"),
                ("c@z", "s", "K", "1"),
                ("a@x", "other", "K", "2"),
            ],
        );
        let g = groups(&m, "s");
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].recipients, vec!["a@x"]);
        assert!(
            g[0].overrides.is_empty(),
            "overrides of another stage do not count"
        );
        assert_eq!(g[1].recipients, vec!["B@y", "c@z"]);
        assert_eq!(g[1].overrides.get("K").map(String::as_str), Some("1"));
        assert_eq!(groups(&m, "other").len(), 2);
        assert_eq!(groups(&m, "third").len(), 1);
    }

    #[test]
    fn a_local_message_uses_the_sender() {
        let m = message(
            &["a@x", "b@y"],
            true,
            &[("sender@x.example", "s", "K", "1"), ("b@y", "s", "K", "2")],
        );
        let g = groups(&m, "s");
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].recipients.len(), 2);
        assert_eq!(g[0].overrides.get("K").map(String::as_str), Some("1"));
    }

    #[test]
    fn the_common_deny_rule_wins_over_what_a_stage_declares() {
        // A future stage declaring keys it must not hand to a correspondent.
        let declared: &[&'static str] = &[
            "PROGRAM",
            "NEXT",
            "COMMAND",
            "PARALLELISM",
            "QUEUE_LIMIT",
            "MAX_MESSAGES",
            "FUSION",
            "BOUNCE_STAGE",
            "ELSE_STAGE",
            "SPAM_STAGE",
            "THRESHOLD",
        ];
        assert_eq!(permitted(declared), ["MAX_LIFETIME", "THRESHOLD"]);
    }

    #[test]
    fn parse_ignores_malformed_entries() {
        let rows = parse(Some(r#"[["a@x","s","K","v"],["bad"],7]"#));
        assert_eq!(rows.len(), 1);
        assert!(parse(None).is_empty());
        assert!(parse(Some("not json")).is_empty());
    }
}
