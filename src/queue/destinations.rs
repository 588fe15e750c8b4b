//! `pepsi-queue destinations [--json]` and `pepsi-queue destinations lift DESTINATION
//! [--json]`: relay-to-internet's destinations in trouble (§22, schema 21, the rows of
//! `pepsi.destinations`), listed suspended first, and one lifted (its row deleted: the
//! suspension ends and its failures are forgotten).
//!
//! Called by `queue::run` (the two commands), `queue::args` ([`checked`], the check of
//! `lift`'s argument) and `queue::status` ([`read`], inside the snapshot `metrics`
//! renders). [`read`] and the one DELETE of [`lift`] (the statements of
//! `db::sql_destinations`) are its only database access; the rest is pure rendering.
//! Every value read was written by a worker (a reason may hold CR, LF, ESC, U+202E):
//! the text shows each escaped ([`crate::escape`]), the JSON gives them exactly. It
//! must not write anything else and renders no metrics (those are `metrics`', with its
//! label escaping).

use std::time::SystemTime;

use serde_json::{Value, json};

use super::args::usage;
use super::format::age;
use super::{Session, db_failure, emit, emit_json};
use crate::db::{Queries, sql_destinations as sql};
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, Failure};

/// The longest destination the schema takes.
pub const MAX_LEN: usize = 255;

/// One row of `pepsi.destinations`.
#[derive(Clone, Debug, PartialEq)]
pub struct Destination {
    /// The destination: a recipient domain in lower case, or an address literal.
    pub destination: String,
    /// Connection attempts failed in a row.
    pub failures: i32,
    /// The end of its (last) suspension, which may be past; `None`: never suspended
    /// since its first failure.
    pub suspended_until: Option<SystemTime>,
    /// Seconds suspended still, by the database's clock (0 when not suspended).
    pub seconds_left: f64,
    /// The last failure, as a worker saw it.
    pub reason: String,
    /// When the last failure was counted.
    pub updated: SystemTime,
}

impl Destination {
    /// Is it suspended now (its suspension ends in the future)?
    pub fn suspended(&self) -> bool {
        self.seconds_left > 0.0
    }
}

/// Reads every row, suspended first, then by name (one statement, so it can run in a
/// caller's transaction, as the status snapshot does).
pub fn read(client: &mut impl Queries) -> Result<Vec<Destination>, postgres::Error> {
    Ok(client
        .query(sql::LIST_DESTINATIONS, &[])?
        .iter()
        .map(|r| Destination {
            destination: r.get(0),
            failures: r.get(1),
            suspended_until: r.get(2),
            seconds_left: r
                .get::<_, Option<f64>>(3)
                .filter(|s| s.is_finite())
                .unwrap_or(0.0)
                .max(0.0),
            reason: r.get(4),
            updated: r.get(5),
        })
        .collect())
}

/// `lift`'s argument, checked: in lower case, 1 to [`MAX_LEN`] characters, each an
/// ASCII letter, a digit or one of `. - _ : [ ]` (a domain, or an address literal such
/// as `[192.0.2.1]`); anything else is a usage error naming the value escaped.
pub fn checked(value: &str) -> Result<String, Failure> {
    let lower = value.to_ascii_lowercase();
    let plausible = (1..=MAX_LEN).contains(&lower.len())
        && lower
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_:[]".contains(&b));
    if plausible {
        Ok(lower)
    } else {
        Err(usage(format!(
            "destinations lift: \"{}\" is not a destination (a domain or an address literal: \
             1 to {MAX_LEN} ASCII letters, digits and . - _ : [ ]; a domain with other \
             letters in its A-label form, xn--…)",
            Visible(value)
        )))
    }
}

/// A time as the other commands write it in JSON: RFC 3339 in UTC, whole seconds
/// (`2026-05-04T03:02:01Z`); a time beyond what it can write is clamped.
fn rfc3339(time: SystemTime) -> String {
    let at = jiff::Timestamp::try_from(time).unwrap_or(if time < SystemTime::UNIX_EPOCH {
        jiff::Timestamp::MIN
    } else {
        jiff::Timestamp::MAX
    });
    jiff::Timestamp::from_second(at.as_second())
        .unwrap_or(at)
        .to_string()
}

/// The rows as `destinations --json` prints them: an array of objects.
pub fn to_json(rows: &[Destination]) -> Value {
    Value::Array(
        rows.iter()
            .map(|d| {
                json!({
                    "destination": d.destination,
                    "failures": d.failures,
                    "suspended": d.suspended(),
                    "suspended_until": d.suspended_until.map(rfc3339),
                    "seconds_left": d.seconds_left,
                    "reason": d.reason,
                    "updated": rfc3339(d.updated),
                })
            })
            .collect(),
    )
}

/// The rows for people: one line each, the destinations in a column, every value
/// escaped; a line saying so when there is none.
pub fn to_text(rows: &[Destination]) -> String {
    if rows.is_empty() {
        return "no destination in trouble\n".to_string();
    }
    let names: Vec<String> = rows
        .iter()
        .map(|d| Visible(&d.destination).to_string())
        .collect();
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (d, name) in rows.iter().zip(&names) {
        let failures = match d.failures {
            1 => "1 failure in a row".to_string(),
            n => format!("{n} failures in a row"),
        };
        let state = if d.suspended() {
            // Rounded up: a destination suspended still never says "0s more".
            format!(
                "suspended for {} more, {failures}",
                age(d.seconds_left.ceil())
            )
        } else {
            format!("{failures}, not suspended")
        };
        let reason = if d.reason.is_empty() {
            String::new()
        } else {
            format!(": {}", Visible(&d.reason))
        };
        let pad = width - name.chars().count();
        out.push_str(&format!("{name}{:pad$}  {state}{reason}\n", ""));
    }
    out
}

/// Runs `pepsi-queue destinations`.
pub fn run(session: &mut Session, json: bool) -> Result<(), Failure> {
    let rows =
        read(&mut session.client).map_err(|e| db_failure("reading pepsi.destinations", &e))?;
    if json {
        emit_json(&to_json(&rows))
    } else {
        emit(to_text(&rows).as_bytes())
    }
}

/// What `lift` says: the JSON document, and the text or the failure (65, as for a
/// message id without a message).
fn lifted(destination: &str, found: bool) -> (Value, Result<String, Failure>) {
    let doc = json!({
        "command": "destinations lift",
        "destination": destination,
        "lifted": found,
    });
    let shown = Visible(destination);
    let outcome = if found {
        Ok(format!("lifted {shown}\n"))
    } else {
        Err(Failure::new(
            EX_DATAERR,
            format!("{shown} is not in trouble (no suspension to lift)"),
        ))
    };
    (doc, outcome)
}

/// Runs `pepsi-queue destinations lift DESTINATION` (`destination` already
/// [`checked`]): deletes its row, one statement.
pub fn lift(session: &mut Session, destination: &str, json: bool) -> Result<(), Failure> {
    let found = session
        .client
        .query_opt(sql::LIFT_DESTINATION, &[&destination])
        .map_err(|e| db_failure(&format!("lifting {}", Visible(destination)), &e))?
        .is_some();
    let (doc, outcome) = lifted(destination, found);
    if json {
        emit_json(&doc)?;
        return outcome.map(drop);
    }
    emit(outcome?.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
    }

    fn suspended() -> Destination {
        Destination {
            destination: "example.org".into(),
            failures: 5,
            suspended_until: Some(at(1_780_000_252) + Duration::from_millis(400)),
            seconds_left: 251.6,
            reason: "connect to mx.example.org[192.0.2.7]:25: timed out".into(),
            updated: at(1_780_000_000),
        }
    }

    fn failing() -> Destination {
        Destination {
            destination: "[192.0.2.1]".into(),
            failures: 3,
            suspended_until: None,
            seconds_left: 0.0,
            reason: "421 4.7.0 slow down".into(),
            updated: at(1_780_000_100),
        }
    }

    #[test]
    fn the_text_has_a_line_per_destination_suspended_ones_saying_for_how_long() {
        assert_eq!(to_text(&[]), "no destination in trouble\n");
        assert_eq!(
            to_text(&[suspended(), failing()]),
            "example.org  suspended for 4m12s more, 5 failures in a row: connect to \
             mx.example.org[192.0.2.7]:25: timed out\n\
             [192.0.2.1]  3 failures in a row, not suspended: 421 4.7.0 slow down\n"
        );
        let once = Destination {
            destination: "a.example".into(),
            failures: 1,
            // A suspension that ended: not suspended any more.
            suspended_until: Some(at(1_779_999_000)),
            reason: String::new(),
            ..failing()
        };
        assert_eq!(
            to_text(&[suspended(), once]),
            "example.org  suspended for 4m12s more, 5 failures in a row: connect to \
             mx.example.org[192.0.2.7]:25: timed out\n\
             a.example    1 failure in a row, not suspended\n"
        );
    }

    #[test]
    fn the_json_is_an_array_of_the_rows_with_rfc_3339_times() {
        let j = to_json(&[suspended(), failing()]);
        assert_eq!(
            j,
            json!([
                {
                    "destination": "example.org",
                    "failures": 5,
                    "suspended": true,
                    "suspended_until": "2026-05-28T20:30:52Z",
                    "seconds_left": 251.6,
                    "reason": "connect to mx.example.org[192.0.2.7]:25: timed out",
                    "updated": "2026-05-28T20:26:40Z",
                },
                {
                    "destination": "[192.0.2.1]",
                    "failures": 3,
                    "suspended": false,
                    "suspended_until": null,
                    "seconds_left": 0.0,
                    "reason": "421 4.7.0 slow down",
                    "updated": "2026-05-28T20:28:20Z",
                },
            ])
        );
        assert_eq!(to_json(&[]), json!([]));
    }

    #[test]
    fn a_hostile_reason_is_escaped_in_the_text_and_exact_in_the_json() {
        let hostile = "550 no\r\nexample.org  0 failures\u{1b}[2J\u{202e}gro.elpmaxe";
        let d = Destination {
            reason: hostile.into(),
            destination: "x\u{1b}]0;y".into(),
            ..failing()
        };
        let text = to_text(std::slice::from_ref(&d));
        assert_eq!(
            text,
            "x\\u{1b}]0;y  3 failures in a row, not suspended: 550 no\\r\\nexample.org  \
             0 failures\\u{1b}[2J\\u{202e}gro.elpmaxe\n"
        );
        assert_eq!(text.lines().count(), 1);
        assert!(!text.contains(['\r', '\u{1b}', '\u{202e}']));
        let j = to_json(&[d]);
        assert_eq!(j[0]["reason"], hostile);
        assert_eq!(j[0]["destination"], "x\u{1b}]0;y");
    }

    #[test]
    fn lift_takes_a_domain_or_address_literal_in_lower_case() {
        assert_eq!(checked("Example.ORG").unwrap(), "example.org");
        assert_eq!(checked("[IPv6:2001:DB8::1]").unwrap(), "[ipv6:2001:db8::1]");
        assert_eq!(checked("[192.0.2.1]").unwrap(), "[192.0.2.1]");
        assert_eq!(
            checked("xn--bcher-kva.example").unwrap(),
            "xn--bcher-kva.example"
        );
        assert_eq!(checked("a_b-c.example").unwrap(), "a_b-c.example");
        assert_eq!(checked(&"a".repeat(255)).unwrap(), "a".repeat(255));
        for bad in [
            "",
            &"a".repeat(256),
            "bücher.example",
            "user@example.org",
            "example.org ",
            "a/b",
            "%",
        ] {
            let e = checked(bad).unwrap_err();
            assert_eq!(e.code, 64, "{bad:?}");
        }
        let e = checked("evil\r\n\u{1b}[2J\u{202e}.example").unwrap_err();
        assert!(
            e.message.starts_with(
                "destinations lift: \"evil\\r\\n\\u{1b}[2J\\u{202e}.example\" is not a destination"
            ),
            "{}",
            e.message
        );
        assert!(!e.message.contains(['\r', '\u{1b}', '\u{202e}']));
        assert!(e.message.contains("\nusage: pepsi-queue"), "{}", e.message);
    }

    #[test]
    fn lift_says_lifted_or_fails_as_an_unknown_id_does() {
        let (doc, outcome) = lifted("example.org", true);
        assert_eq!(outcome.unwrap(), "lifted example.org\n");
        assert_eq!(
            doc,
            json!({"command": "destinations lift", "destination": "example.org", "lifted": true})
        );
        let (doc, outcome) = lifted("example.net", false);
        let e = outcome.unwrap_err();
        assert_eq!(e.code, 65);
        assert_eq!(
            e.message,
            "example.net is not in trouble (no suspension to lift)"
        );
        assert_eq!(doc["lifted"], false);
    }
}
