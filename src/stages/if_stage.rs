//! `pepsi-stage-if`: routes by a `MATCH` condition on the envelope and metadata to
//! `NEXT` when it holds, else to `ELSE_STAGE`. Metadata only, fusable by default.
//!
//! `MATCH` is one or more conditions joined by ` and `, each `FIELD OP VALUE`:
//! FIELD is `sender`, `sender-domain`, `recipient-domain` (true if any recipient
//! matches), `sender-key`, `header-from`, `subject` or `state.KEY`; OP is `is`,
//! `is-not`, `ends-with` or `contains`; VALUE is the rest of the condition, optionally in
//! double quotes (`\"` and `\\` escape inside them). Addresses, domains and sender keys
//! compare case-insensitively; subject and state values exactly.

use crate::config::{ConfigError, StageSection};
use crate::worker::{
    Configured, Context, Load, Message, Outcome, Stage, StageError, required_next,
};

/// The stage.
pub struct If;

/// A field a condition reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Field {
    /// The envelope sender.
    Sender,
    /// The envelope sender's domain.
    SenderDomain,
    /// Any recipient's domain.
    RecipientDomain,
    /// The fairness key.
    SenderKey,
    /// The extracted `From:`.
    HeaderFrom,
    /// The extracted `Subject:`.
    Subject,
    /// A key of the state object.
    State(String),
}

/// A comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Equal.
    Is,
    /// Not equal.
    IsNot,
    /// Ends with.
    EndsWith,
    /// Contains.
    Contains,
}

/// One `FIELD OP VALUE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// What is compared.
    pub field: Field,
    /// How.
    pub op: Op,
    /// With what.
    pub value: String,
}

/// Parses a `MATCH` expression.
pub fn parse_match(text: &str) -> Result<Vec<Condition>, String> {
    let mut rest = text.trim();
    if rest.ends_with(" and") {
        return Err("ends with a dangling \"and\"".into());
    }
    let mut out = Vec::new();
    loop {
        if rest.is_empty() {
            return Err(if out.is_empty() {
                "is empty".into()
            } else {
                "ends with a dangling \"and\"".into()
            });
        }
        let (field, after) = split_word(rest);
        let field = match field {
            "sender" => Field::Sender,
            "sender-domain" => Field::SenderDomain,
            "recipient-domain" => Field::RecipientDomain,
            "sender-key" => Field::SenderKey,
            "header-from" => Field::HeaderFrom,
            "subject" => Field::Subject,
            f => match f.strip_prefix("state.") {
                Some(key) if !key.is_empty() => Field::State(key.to_string()),
                _ => {
                    return Err(format!(
                        "unknown field {f:?} (sender, sender-domain, recipient-domain, sender-key, header-from, subject, state.KEY)"
                    ));
                }
            },
        };
        let (op, after) = split_word(after);
        let op = match op {
            "is" => Op::Is,
            "is-not" => Op::IsNot,
            "ends-with" => Op::EndsWith,
            "contains" => Op::Contains,
            "" => return Err(format!("the condition on {field:?} lacks an operator")),
            o => {
                return Err(format!(
                    "unknown operator {o:?} (is, is-not, ends-with, contains)"
                ));
            }
        };
        let after = after.trim_start();
        let (value, after) = if let Some(quoted) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some((_, e)) => value.push(e),
                        None => break,
                    },
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => value.push(c),
                }
            }
            let Some(end) = end else {
                return Err("a quoted value lacks its closing quote".into());
            };
            (value, quoted[end..].trim_start())
        } else {
            match after.find(" and ") {
                Some(i) => (after[..i].trim().to_string(), &after[i + 1..]),
                None => (after.trim().to_string(), ""),
            }
        };
        if value.is_empty() {
            return Err(format!("the condition on {field:?} lacks a value"));
        }
        out.push(Condition { field, op, value });
        if after.is_empty() {
            return Ok(out);
        }
        rest = match after.strip_prefix("and ") {
            Some(r) => r.trim_start(),
            None => return Err(format!("expected \"and\" before {after:?}")),
        };
    }
}

fn split_word(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    match s.find(char::is_whitespace) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, ""),
    }
}

fn domain(address: &str) -> &str {
    address.rsplit_once('@').map_or(address, |(_, d)| d)
}

fn compare(op: Op, have: &str, want: &str, fold: bool) -> bool {
    let (have, want) = if fold {
        (have.to_lowercase(), want.to_lowercase())
    } else {
        (have.to_string(), want.to_string())
    };
    match op {
        Op::Is => have == want,
        Op::IsNot => have != want,
        Op::EndsWith => have.ends_with(&want),
        Op::Contains => have.contains(&want),
    }
}

impl Condition {
    /// Does the message satisfy this condition?
    pub fn holds(&self, m: &Message) -> bool {
        let one = |have: Option<&str>, fold: bool| match have {
            Some(h) => compare(self.op, h, &self.value, fold),
            // An absent value "is not" anything and matches nothing else.
            None => self.op == Op::IsNot,
        };
        match &self.field {
            Field::Sender => one(Some(m.mail_from()), true),
            Field::SenderDomain => one(Some(domain(m.mail_from())), true),
            Field::RecipientDomain => m
                .rcpt_to()
                .iter()
                .any(|r| compare(self.op, domain(r), &self.value, true)),
            Field::SenderKey => one(Some(&m.sender_key), true),
            Field::HeaderFrom => one(m.header_from(), true),
            Field::Subject => one(m.subject(), false),
            Field::State(key) => one(m.state_text(key).as_deref(), false),
        }
    }
}

struct ConfiguredIf {
    conditions: Vec<Condition>,
    next: String,
    otherwise: String,
}

impl Stage for If {
    fn name(&self) -> &'static str {
        "if"
    }

    fn loads(&self) -> Load {
        Load::Metadata
    }

    fn fusion_default(&self) -> bool {
        true
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let conditions = parse_match(s.required("MATCH")?).map_err(|e| s.error("MATCH", e))?;
        Ok(Box::new(ConfiguredIf {
            conditions,
            next: required_next(section)?,
            otherwise: s.required("ELSE_STAGE")?.to_string(),
        }))
    }
}

impl Configured for ConfiguredIf {
    fn run(&self, message: &mut Message, _cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let target = if self.conditions.iter().all(|c| c.holds(message)) {
            &self.next
        } else {
            &self.otherwise
        };
        Ok(Outcome::Advance(target.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn msg() -> Message {
        let mut state = Map::new();
        state.insert("spam".into(), Value::Bool(true));
        state.insert("lang".into(), json!("de"));
        Message::new(
            1,
            "if".into(),
            "Alice@Example.ORG".into(),
            vec!["bob@a.example".into(), "carol@B.example".into()],
            Some("Alice <alice@example.org>".into()),
            Some("Hello and welcome".into()),
            state,
            "ip:192.0.2.1".into(),
        )
    }

    fn holds(expr: &str) -> bool {
        parse_match(expr)
            .unwrap_or_else(|e| panic!("{expr}: {e}"))
            .iter()
            .all(|c| c.holds(&msg()))
    }

    #[test]
    fn fields_and_operators() {
        assert!(holds("sender is alice@example.org"));
        assert!(holds("sender-domain is EXAMPLE.org"));
        assert!(holds("sender-domain ends-with .org"));
        assert!(holds("recipient-domain is b.example"), "any recipient");
        assert!(!holds("recipient-domain is c.example"));
        assert!(holds("sender-key contains 192.0.2."));
        assert!(holds("header-from contains ALICE@"));
        assert!(holds("subject contains \"and welcome\""));
        assert!(!holds("subject contains hello"), "subjects compare exactly");
        assert!(holds("state.spam is true"));
        assert!(holds("state.lang is de"));
        assert!(holds("state.missing is-not x"));
        assert!(!holds("state.missing contains x"));
    }

    #[test]
    fn conditions_join_with_and() {
        assert!(holds("sender-domain is example.org and state.spam is true"));
        assert!(!holds(
            "sender-domain is example.org and state.spam is false"
        ));
        assert!(holds(
            "subject is \"Hello and welcome\" and sender-domain is example.org"
        ));
        let c = parse_match("subject contains \"say \\\"hi\\\"\"").unwrap();
        assert_eq!(c[0].value, "say \"hi\"");
    }

    #[test]
    fn unparsable_match_expressions_are_errors() {
        for bad in [
            "",
            "colour is red",
            "sender",
            "sender equals x",
            "sender is",
            "sender is x and",
            "subject is \"open",
            "subject is \"a\" b",
            "state. is x",
        ] {
            assert!(parse_match(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
