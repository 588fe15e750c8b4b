//! `pepsi-stage-if`: routes by a `MATCH` condition on the envelope and metadata to
//! `NEXT` when it holds, else to `ELSE_STAGE`. Metadata only, fusable by default.
//!
//! `MATCH` is one or more conditions, each `FIELD OP VALUE`, joined either all by
//! ` and ` or all by ` or ` (mixing both in one MATCH is an error). FIELD is `sender`,
//! `sender-domain`, `recipient-domain` (per recipient: see below), `sender-key`,
//! `header-from`, `subject` or `state.KEY`; OP is `is`, `is-not`, `ends-with` or
//! `contains`; VALUE is one word or a double-quoted string (`\"` and `\\` escape inside
//! it). Any other word after a VALUE is an error naming it: a MATCH is understood whole
//! or refused (§4 "Strictness"). Addresses, domains and sender keys compare
//! case-insensitively; subject and state values exactly.
//!
//! A `MATCH` with a `recipient-domain` condition is judged for each recipient (its
//! other conditions alike for all): when it holds for some recipients and not for the
//! others, the message is split at this stage (one round trip, the lazy split of
//! §12.5), each part then all one way, so mail for other domains never follows
//! the recipients the condition holds for.
//!
//! Listed in `stages::BUILTINS`; the worker runtime calls its `configure` at start
//! and for each effective section and runs the body it returns, and `pepsi-dispatch
//! check` calls `configure`. It owns its section's keys and its decision (and the
//! split of a per-recipient condition); it must
//! not write to the database (the runtime writes its outcome) nor know about batches,
//! fusion or the protocol.

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

impl std::fmt::Display for Field {
    /// The field as a MATCH names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Field::Sender => f.write_str("sender"),
            Field::SenderDomain => f.write_str("sender-domain"),
            Field::RecipientDomain => f.write_str("recipient-domain"),
            Field::SenderKey => f.write_str("sender-key"),
            Field::HeaderFrom => f.write_str("header-from"),
            Field::Subject => f.write_str("subject"),
            Field::State(key) => write!(f, "state.{key}"),
        }
    }
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

/// How the conditions of a `MATCH` combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Join {
    /// Every condition must hold (` and `, and a single condition).
    All,
    /// One condition is enough (` or `).
    Any,
}

/// A parsed `MATCH`: its conditions and how they combine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match {
    /// The conditions, in order.
    pub conditions: Vec<Condition>,
    /// How they combine.
    pub join: Join,
}

impl Match {
    /// Does the message satisfy the expression (a recipient condition: for any
    /// recipient)?
    pub fn holds(&self, m: &Message) -> bool {
        self.holds_for(m, None)
    }

    /// Does the message satisfy the expression with `recipient` (when given) as its
    /// only recipient?
    pub fn holds_for(&self, m: &Message, recipient: Option<&str>) -> bool {
        match self.join {
            Join::All => self.conditions.iter().all(|c| c.holds_for(m, recipient)),
            Join::Any => self.conditions.iter().any(|c| c.holds_for(m, recipient)),
        }
    }

    /// Does the expression depend on the recipients, and so may hold for some of a
    /// message's recipients and not for others?
    pub fn per_recipient(&self) -> bool {
        self.conditions
            .iter()
            .any(|c| c.field == Field::RecipientDomain)
    }
}

/// One token of a `MATCH`: a bare word, or a double-quoted string with its escapes
/// resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Token {
    Word(String),
    Quoted(String),
}

impl Token {
    /// The token as the operator wrote it, for error messages.
    fn shown(&self) -> String {
        match self {
            Token::Word(w) => format!("{w:?}"),
            Token::Quoted(q) => format!("the quoted {q:?}"),
        }
    }
}

/// Splits a `MATCH` into tokens: words separated by whitespace, and double-quoted
/// strings in which `\"` and `\\` are the only escapes.
fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let Some(&first) = chars.peek() else {
            return Ok(tokens);
        };
        if first == '"' {
            chars.next();
            let mut value = String::new();
            loop {
                match chars.next() {
                    None => {
                        return Err(format!(
                            "the quoted value \"{value} lacks its closing quote"
                        ));
                    }
                    Some('"') => break,
                    Some('\\') => match chars.next() {
                        Some(c @ ('"' | '\\')) => value.push(c),
                        Some(c) => {
                            return Err(format!(
                                "unknown escape \"\\{c}\" in the quoted value \"{value} (only \\\" and \\\\)"
                            ));
                        }
                        None => {
                            return Err(format!(
                                "the quoted value \"{value} lacks its closing quote"
                            ));
                        }
                    },
                    Some(c) => value.push(c),
                }
            }
            // The closing quote ends the token: `"a"b` is not one value.
            if let Some(&c) = chars.peek().filter(|c| !c.is_whitespace()) {
                return Err(format!(
                    "unexpected {c:?} right after the quoted value {value:?} (separate words with a space)"
                ));
            }
            tokens.push(Token::Quoted(value));
        } else {
            let mut word = String::new();
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                word.push(c);
            }
            // A quote inside a bare word is a value written half-quoted.
            if word.contains('"') {
                return Err(format!(
                    "{word:?} has a quote inside a word (quote the whole value: \"...\")"
                ));
            }
            tokens.push(Token::Word(word));
        }
    }
}

/// Parses a field name.
fn field(token: &Token) -> Result<Field, String> {
    let Token::Word(word) = token else {
        return Err(format!(
            "expected a field, found {} (sender, sender-domain, recipient-domain, sender-key, header-from, subject, state.KEY)",
            token.shown()
        ));
    };
    Ok(match word.as_str() {
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
    })
}

/// Parses an operator.
fn op(token: &Token) -> Result<Op, String> {
    match token {
        Token::Word(w) if w == "is" => Ok(Op::Is),
        Token::Word(w) if w == "is-not" => Ok(Op::IsNot),
        Token::Word(w) if w == "ends-with" => Ok(Op::EndsWith),
        Token::Word(w) if w == "contains" => Ok(Op::Contains),
        other => Err(format!(
            "unknown operator {} (is, is-not, ends-with, contains)",
            other.shown()
        )),
    }
}

/// Is this token the join word `and` or `or`?
fn join_of(token: &Token) -> Option<Join> {
    match token {
        Token::Word(w) if w == "and" => Some(Join::All),
        Token::Word(w) if w == "or" => Some(Join::Any),
        _ => None,
    }
}

/// The word of a join, for messages.
fn join_word(join: Join) -> &'static str {
    match join {
        Join::All => "and",
        Join::Any => "or",
    }
}

/// Parses a `MATCH` expression completely: every word must be part of a condition or a
/// join, or the expression is refused naming the word.
pub fn parse_match(text: &str) -> Result<Match, String> {
    let tokens = tokenize(text)?;
    if tokens.is_empty() {
        return Err("is empty".into());
    }
    let mut conditions = Vec::new();
    let mut join: Option<Join> = None;
    let mut rest = tokens.iter();
    loop {
        // A condition: FIELD OP VALUE.
        let Some(f) = rest.next() else {
            let word = join_word(join.unwrap_or(Join::All));
            return Err(format!(
                "ends with a dangling {word:?} (a condition must follow it)"
            ));
        };
        let field = field(f)?;
        let Some(o) = rest.next() else {
            return Err(format!("the condition on \"{field}\" lacks an operator"));
        };
        let op = op(o)?;
        let value = match rest.next() {
            None => return Err(format!("the condition on \"{field}\" lacks a value")),
            Some(t) if join_of(t).is_some() => {
                return Err(format!(
                    "the condition on \"{field}\" lacks a value before {} (to compare with that word, quote it)",
                    t.shown()
                ));
            }
            Some(Token::Word(w) | Token::Quoted(w)) => w.clone(),
        };
        conditions.push(Condition { field, op, value });
        // Then the end, or a join and another condition.
        let Some(next) = rest.next() else {
            return Ok(Match {
                conditions,
                join: join.unwrap_or(Join::All),
            });
        };
        let Some(this) = join_of(next) else {
            let last = &conditions[conditions.len() - 1].value;
            return Err(format!(
                "unexpected {} after the value {last:?} (a value is one word or a quoted string; conditions are joined by \"and\" or \"or\")",
                next.shown()
            ));
        };
        match join {
            Some(earlier) if earlier != this => {
                return Err(format!(
                    "mixes \"and\" and \"or\" (at {:?}); use one kind of join in a MATCH",
                    join_word(this)
                ));
            }
            _ => join = Some(this),
        }
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
        self.holds_for(m, None)
    }

    /// Does the message satisfy this condition, with `recipient` (when given) as its
    /// only recipient? Without one, a recipient condition holds for any recipient.
    pub fn holds_for(&self, m: &Message, recipient: Option<&str>) -> bool {
        let one = |have: Option<&str>, fold: bool| match have {
            Some(h) => compare(self.op, h, &self.value, fold),
            // An absent value "is not" anything and matches nothing else.
            None => self.op == Op::IsNot,
        };
        match &self.field {
            Field::Sender => one(Some(m.mail_from()), true),
            Field::SenderDomain => one(Some(domain(m.mail_from())), true),
            Field::RecipientDomain => match recipient {
                Some(r) => compare(self.op, domain(r), &self.value, true),
                None => m
                    .rcpt_to()
                    .iter()
                    .any(|r| compare(self.op, domain(r), &self.value, true)),
            },
            Field::SenderKey => one(Some(&m.sender_key), true),
            Field::HeaderFrom => one(m.header_from(), true),
            Field::Subject => one(m.subject(), false),
            Field::State(key) => one(m.state_text(key).as_deref(), false),
        }
    }
}

struct ConfiguredIf {
    condition: Match,
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

    fn delivers(&self) -> bool {
        false
    }

    fn keys(&self) -> &'static [&'static str] {
        &["MATCH", "ELSE_STAGE"]
    }

    fn overridable(&self) -> &'static [&'static str] {
        &["MATCH"]
    }

    fn configure(&self, section: &StageSection) -> Result<Box<dyn Configured>, ConfigError> {
        let s = &section.section;
        let condition = parse_match(s.required("MATCH")?).map_err(|e| s.error("MATCH", e))?;
        Ok(Box::new(ConfiguredIf {
            condition,
            next: required_next(section)?,
            otherwise: s.required("ELSE_STAGE")?.to_string(),
        }))
    }
}

impl Configured for ConfiguredIf {
    fn run(&self, message: &mut Message, cx: &mut Context<'_>) -> Result<Outcome, StageError> {
        let holds = if self.condition.per_recipient() {
            let (holding, others): (Vec<String>, Vec<String>) = message
                .rcpt_to()
                .iter()
                .cloned()
                .partition(|r| self.condition.holds_for(message, Some(r)));
            if !holding.is_empty() && !others.is_empty() {
                // Each part comes back to this stage, all one way.
                return Ok(Outcome::Split {
                    groups: vec![holding, others],
                    stage: cx.section.name.clone(),
                });
            }
            others.is_empty()
        } else {
            self.condition.holds(message)
        };
        let target = if holds { &self.next } else { &self.otherwise };
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
            .holds(&msg())
    }

    fn refused(expr: &str) -> String {
        match parse_match(expr) {
            Ok(m) => panic!("{expr:?} should be refused, parsed as {m:?}"),
            Err(e) => e,
        }
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
        let m = parse_match("sender is a and sender is b and sender is c").unwrap();
        assert_eq!((m.conditions.len(), m.join), (3, Join::All));
    }

    #[test]
    fn conditions_join_with_or() {
        assert!(holds(
            "sender-domain is bounce.example or state.spam is true"
        ));
        assert!(holds(
            "state.spam is true or sender-domain is bounce.example"
        ));
        assert!(!holds(
            "sender-domain is bounce.example or state.spam is false"
        ));
        assert!(holds(
            "sender is x@y or sender is z@y or recipient-domain is a.example"
        ));
        let m = parse_match("sender is a or sender is b").unwrap();
        assert_eq!((m.conditions.len(), m.join), (2, Join::Any));
        // The words "and"/"or" inside a quoted value are the value's.
        assert!(holds(
            "subject is \"Hello and welcome\" or sender is nobody"
        ));
    }

    #[test]
    fn quoted_values_keep_spaces_and_resolve_escapes() {
        let m = parse_match(r#"subject contains "say \"hi\" \\ bye""#).unwrap();
        assert_eq!(m.conditions[0].value, r#"say "hi" \ bye"#);
        let m = parse_match("subject is \"  two  spaces \"").unwrap();
        assert_eq!(m.conditions[0].value, "  two  spaces ");
        let m = parse_match("sender is \"\"").unwrap();
        assert_eq!(
            m.conditions[0].value, "",
            "an explicit empty value (the null sender)"
        );
        let m = parse_match("subject is \"or\" and sender is \"and\"").unwrap();
        assert_eq!(m.conditions[0].value, "or");
        assert_eq!(m.conditions[1].value, "and");
        assert_eq!(m.join, Join::All);
    }

    #[test]
    fn a_trailing_join_is_refused_naming_it() {
        let e = refused("sender-domain is bounce.example or");
        assert!(e.contains("dangling \"or\""), "{e}");
        let e = refused("sender is x and");
        assert!(e.contains("dangling \"and\""), "{e}");
    }

    #[test]
    fn a_word_after_a_value_is_refused_naming_it() {
        let e = refused("sender-domain is x garbage");
        assert!(
            e.contains("unexpected \"garbage\" after the value \"x\""),
            "{e}"
        );
        let e = refused("subject is Hello world");
        assert!(
            e.contains("unexpected \"world\" after the value \"Hello\""),
            "{e}"
        );
        // Unquoted, the "and" of a subject joins conditions: the word after it is named.
        let e = refused("subject is Hello and welcome");
        assert!(e.contains("unknown field \"welcome\""), "{e}");
        let e = refused("subject is \"a\" b");
        assert!(e.contains("unexpected \"b\" after the value \"a\""), "{e}");
        let e = refused("sender is x AND sender is y");
        assert!(e.contains("unexpected \"AND\""), "{e}");
        let e = refused("sender is x \"and\" sender is y");
        assert!(e.contains("unexpected the quoted \"and\""), "{e}");
    }

    #[test]
    fn mixing_and_with_or_is_refused() {
        let e = refused("sender is a and sender is b or sender is c");
        assert!(e.contains("mixes \"and\" and \"or\""), "{e}");
        let e = refused("sender is a or sender is b and sender is c");
        assert!(e.contains("mixes \"and\" and \"or\""), "{e}");
    }

    #[test]
    fn an_unterminated_quote_or_a_bad_escape_is_refused() {
        let e = refused("subject is \"open");
        assert!(e.contains("\"open lacks its closing quote"), "{e}");
        let e = refused("subject is \"open\\\"");
        assert!(e.contains("lacks its closing quote"), "{e}");
        let e = refused("subject is \"a\\nb\"");
        assert!(e.contains("unknown escape \"\\n\""), "{e}");
        let e = refused("subject is \"a\"b");
        assert!(e.contains("right after the quoted value \"a\""), "{e}");
        let e = refused("subject is a\"b\"");
        assert!(e.contains("quote inside a word"), "{e}");
    }

    #[test]
    fn unparsable_match_expressions_are_errors() {
        for (bad, why) in [
            ("", "is empty"),
            ("   ", "is empty"),
            ("colour is red", "unknown field \"colour\""),
            (
                "\"sender\" is x",
                "expected a field, found the quoted \"sender\"",
            ),
            ("sender", "lacks an operator"),
            ("sender equals x", "unknown operator \"equals\""),
            ("sender is", "lacks a value"),
            ("sender is or", "lacks a value before \"or\""),
            ("sender is x and and sender is y", "unknown field \"and\""),
            ("state. is x", "unknown field \"state.\""),
            ("or sender is x", "unknown field \"or\""),
        ] {
            let e = refused(bad);
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_bad_match_names_file_line_section_and_key() {
        use crate::config::raw;
        let sections = raw::parse(
            std::path::Path::new("/etc/pepsi/pepsi.conf"),
            "[stage-if]\nPROGRAM = pepsi-stage-if\nNEXT = a\nELSE_STAGE = b\nMATCH = sender-domain is bounce.example or\n",
        )
        .unwrap();
        let section = StageSection::check(&sections[0]).unwrap();
        let e = If.configure(&section).err().expect("refused");
        assert_eq!(
            e.to_string(),
            "/etc/pepsi/pepsi.conf:5: [stage-if] MATCH: ends with a dangling \"or\" (a condition must follow it)"
        );
    }
}
