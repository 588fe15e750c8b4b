//! Per-address settings (SPEC §12.5): the overrides from `pepsi.settings` that came
//! with the row, grouped by the effective override set of each recipient for a stage,
//! and laid over the stage's section.
//!
//! The correspondent is the envelope sender for a `state.local_origin` message, else
//! each recipient. Pure: no database access here.

use std::collections::BTreeMap;

use serde_json::Value;

use super::Message;
use crate::config::{ConfigError, Origin, StageGraph, StageSection};

/// One row of `pepsi.settings`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingRow {
    /// The address, lower-case.
    pub address: String,
    /// The stage name.
    pub stage: String,
    /// The option.
    pub key: String,
    /// Its value for this address.
    pub value: String,
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
    fn parse_ignores_malformed_entries() {
        let rows = parse(Some(r#"[["a@x","s","K","v"],["bad"],7]"#));
        assert_eq!(rows.len(), 1);
        assert!(parse(None).is_empty());
        assert!(parse(Some("not json")).is_empty());
    }
}
