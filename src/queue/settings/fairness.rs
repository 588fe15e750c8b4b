//! The fair-share commands of `pepsi-settings` (§7, §20): `weight`, `rate`, `weights`,
//! `tenant`, `tenants` and `tenant-of` on `pepsi.fair_weights` and `pepsi.tenants`.
//!
//! What a pattern, a weight and a tenant's name may be is checked here before anything
//! is connected (pure: [`pattern`], [`weight`], [`tenant_name`]), with the rules the
//! tables' CHECKs state, so a refusal names the value (escaped) and exits 65 with
//! nothing written. Each write is one statement in its own transaction; the tables'
//! triggers do the rest: a weight notifies the dispatcher, which reads the weights
//! again, and a tenant sets the tenant of every queue row it changes, in the same
//! transaction. Called by `settings::run` only.

use crate::db::sql_settings::{self, WEIGHT_MAX, WEIGHT_MIN};
use crate::escape::Visible;
use crate::exit::{EX_DATAERR, Failure};
use crate::queue::{Session, db_failure, emit, emit_json};

/// The longest pattern (the tables' CHECK).
const PATTERN_MAX: usize = 200;
/// The longest tenant name (the table's CHECK).
const TENANT_MAX: usize = 100;

/// A refused value: exit 65, naming the command and the value, escaped.
fn refused(command: &str, what: &str, value: &str, why: &str) -> Failure {
    Failure::new(
        EX_DATAERR,
        format!(
            "{command}: the {what} \"{}\" is refused: {why}; nothing changed",
            Visible(value)
        ),
    )
}

/// A tenant-key or sender-key pattern: 1 to 200 printable ASCII characters, no space.
pub fn pattern(command: &str, given: &str) -> Result<String, Failure> {
    if given.is_empty() || given.len() > PATTERN_MAX {
        return Err(refused(
            command,
            "pattern",
            given,
            "it must have 1 to 200 characters",
        ));
    }
    if !given.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(refused(
            command,
            "pattern",
            given,
            "it may hold printable ASCII characters only, without spaces",
        ));
    }
    Ok(given.to_string())
}

/// A weight: a decimal number from 0.01 to 100.
pub fn weight(command: &str, given: &str) -> Result<f64, Failure> {
    let plain = !given.is_empty()
        && given.len() <= 32
        && given.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let value = given.parse::<f64>().ok().filter(|_| plain);
    match value {
        Some(w) if (WEIGHT_MIN..=WEIGHT_MAX).contains(&w) => Ok(w),
        Some(_) => Err(refused(
            command,
            "weight",
            given,
            "a weight is from 0.01 to 100",
        )),
        None => Err(refused(
            command,
            "weight",
            given,
            "a weight is a decimal number such as 2 or 0.5",
        )),
    }
}

/// A rate: `N/s`, `N/min` or `N/h` (`config::rate`), messages a second.
pub fn rate(command: &str, given: &str) -> Result<f64, Failure> {
    crate::config::rate::parse(given).map_err(|why| {
        // The parser quotes the text with Rust's escapes; the message names it again
        // escaped as every refusal does.
        let why = why
            .split_once(": ")
            .map_or("write N/s, N/min or N/h", |(_, w)| w);
        refused(command, "rate", given, why)
    })
}

/// A tenant's name: a letter or digit, then letters, digits and `. _ @ + -`, at most
/// 100 characters.
pub fn tenant_name(command: &str, given: &str) -> Result<String, Failure> {
    let mut bytes = given.bytes();
    let first = bytes.next().is_some_and(|b| b.is_ascii_alphanumeric());
    let rest = bytes.all(|b| b.is_ascii_alphanumeric() || b".-_@+".contains(&b));
    if !first || !rest || given.len() > TENANT_MAX {
        return Err(refused(
            command,
            "tenant name",
            given,
            "a name is a letter or digit, then letters, digits and . _ @ + -, at most 100 \
             characters",
        ));
    }
    Ok(given.to_string())
}

/// `weight PATTERN WEIGHT` (`Some`) or `weight --unset PATTERN` (`None`), checked.
pub fn set_weight(session: &mut Session, pattern: &str, w: Option<f64>) -> Result<(), Failure> {
    let failed = |e: postgres::Error| db_failure("changing pepsi.fair_weights", &e);
    match w {
        Some(w) => {
            session
                .client
                .execute(sql_settings::SET_WEIGHT, &[&pattern, &w])
                .map_err(failed)?;
            emit(
                format!(
                    "weight {} = {w}; the dispatcher reads the weights again now\n",
                    Visible(pattern)
                )
                .as_bytes(),
            )
        }
        None => {
            let mut tx = session.client.transaction().map_err(failed)?;
            let gone = tx
                .query(sql_settings::UNSET_WEIGHT, &[&pattern])
                .map_err(failed)?;
            if gone.is_empty() {
                return Err(refused("weight", "pattern", pattern, "it has no weight"));
            }
            tx.execute(sql_settings::DROP_PLAIN_WEIGHT, &[&pattern])
                .map_err(failed)?;
            tx.commit().map_err(failed)?;
            emit(format!("weight {} removed (1 again)\n", Visible(pattern)).as_bytes())
        }
    }
}

/// `rate PATTERN RATE` (`Some`, messages a second) or `rate --unset PATTERN` (`None`).
pub fn set_rate(session: &mut Session, pattern: &str, r: Option<f64>) -> Result<(), Failure> {
    let failed = |e: postgres::Error| db_failure("changing pepsi.fair_weights", &e);
    match r {
        Some(r) => {
            session
                .client
                .execute(sql_settings::SET_RATE, &[&pattern, &r])
                .map_err(failed)?;
            let shown = crate::config::rate::show(r);
            emit(
                format!(
                    "rate {} = {shown} per tenant at each stage; the dispatcher reads it now\n",
                    Visible(pattern)
                )
                .as_bytes(),
            )
        }
        None => {
            let mut tx = session.client.transaction().map_err(failed)?;
            let gone = tx
                .query(sql_settings::UNSET_RATE, &[&pattern])
                .map_err(failed)?;
            if gone.is_empty() {
                return Err(refused("rate", "pattern", pattern, "it has no rate"));
            }
            tx.execute(sql_settings::DROP_PLAIN_WEIGHT, &[&pattern])
                .map_err(failed)?;
            tx.commit().map_err(failed)?;
            emit(format!("rate {} removed\n", Visible(pattern)).as_bytes())
        }
    }
}

/// `tenant PATTERN NAME` (`Some`) or `tenant --unset PATTERN` (`None`), checked.
pub fn set_tenant(session: &mut Session, pattern: &str, name: Option<&str>) -> Result<(), Failure> {
    let failed = |e: postgres::Error| db_failure("changing pepsi.tenants", &e);
    match name {
        Some(name) => {
            session
                .client
                .execute(sql_settings::SET_TENANT, &[&pattern, &name])
                .map_err(failed)?;
            emit(
                format!(
                    "senders {} belong to tenant:{}; the queue's rows follow\n",
                    Visible(pattern),
                    Visible(name)
                )
                .as_bytes(),
            )
        }
        None => {
            let gone = session
                .client
                .query(sql_settings::UNSET_TENANT, &[&pattern])
                .map_err(failed)?;
            if gone.is_empty() {
                return Err(refused("tenant", "pattern", pattern, "it names no tenant"));
            }
            emit(
                format!(
                    "senders {} belong to their default tenants again\n",
                    Visible(pattern)
                )
                .as_bytes(),
            )
        }
    }
}

/// `weights` and `tenants`: one row a line (pattern, weight and rate or tenant, when
/// changed; TAB separated, escaped), or with `json` one document.
pub fn list(session: &mut Session, tenants: bool, json: bool) -> Result<(), Failure> {
    let (statement, table) = if tenants {
        (sql_settings::READ_TENANTS, "pepsi.tenants")
    } else {
        (sql_settings::READ_WEIGHTS, "pepsi.fair_weights")
    };
    let rows = session
        .client
        .query(statement, &[])
        .map_err(|e| db_failure(&format!("reading {table}"), &e))?;
    // Tenants: (pattern, tenant, changed); weights: (pattern, weight, rate, changed).
    let changed = |r: &postgres::Row| r.get::<_, String>(if tenants { 2 } else { 3 });
    let rate = |r: &postgres::Row| r.get::<_, Option<f64>>(2);
    if json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let pattern = r.get::<_, String>(0);
                if tenants {
                    let tenant = format!("tenant:{}", r.get::<_, String>(1));
                    serde_json::json!({"pattern": pattern, "tenant": tenant,
                                       "changed": changed(r)})
                } else {
                    serde_json::json!({"pattern": pattern, "weight": r.get::<_, f64>(1),
                                       "rate_per_second": rate(r), "changed": changed(r)})
                }
            })
            .collect();
        return emit_json(&serde_json::Value::from(list));
    }
    let mut out = String::new();
    for r in &rows {
        let value = if tenants {
            format!("tenant:{}", r.get::<_, String>(1))
        } else {
            let shown = rate(r).map_or("-".to_string(), crate::config::rate::show);
            format!("{}\t{shown}", r.get::<_, f64>(1))
        };
        let line = format!(
            "{}\t{}\t{}\n",
            Visible(&r.get::<_, String>(0)),
            Visible(&value),
            changed(r)
        );
        out.push_str(&line);
    }
    emit(out.as_bytes())
}

/// `tenant-of SENDER_KEY`: the tenant a sender key belongs to now.
pub fn tenant_of(session: &mut Session, key: &str) -> Result<(), Failure> {
    let row = session
        .client
        .query_one(sql_settings::TENANT_OF, &[&key])
        .map_err(|e| db_failure("reading pepsi.tenants", &e))?;
    let tenant: String = row.get(0);
    emit(format!("{}\t{}\n", Visible(key), Visible(&tenant)).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_printable_ascii_without_spaces() {
        assert_eq!(
            pattern("weight", "from:*.example.com").unwrap(),
            "from:*.example.com"
        );
        for bad in ["", "from: x", "from:\u{1b}[31m", "from:é", &"x".repeat(201)] {
            let e = pattern("weight", bad).unwrap_err();
            assert_eq!(e.code, 65, "{bad:?}");
            assert!(!e.message.contains('\u{1b}'), "{}", e.message);
        }
    }

    #[test]
    fn weights_are_plain_decimals_within_the_range() {
        assert_eq!(weight("weight", "2").unwrap(), 2.0);
        assert_eq!(weight("weight", "0.5").unwrap(), 0.5);
        assert_eq!(weight("weight", "100").unwrap(), 100.0);
        assert_eq!(weight("weight", "0.01").unwrap(), 0.01);
        for bad in [
            "0", "0.001", "101", "-1", "1e2", "NaN", "inf", "", "2 ", "½", "1.0.0",
        ] {
            assert_eq!(weight("weight", bad).unwrap_err().code, 65, "{bad:?}");
        }
        assert!(
            weight("weight", "\u{7}9")
                .unwrap_err()
                .message
                .contains("\\u{7}9")
        );
    }

    #[test]
    fn rates_are_refused_with_their_text_escaped() {
        assert_eq!(rate("rate", "10/s").unwrap(), 10.0);
        for bad in ["10", "0/s", "\u{1b}[2J10/s", "10/\u{1b}"] {
            let e = rate("rate", bad).unwrap_err();
            assert_eq!(e.code, 65, "{bad:?}");
            assert!(!e.message.contains('\u{1b}'), "{}", e.message);
        }
    }

    #[test]
    fn tenant_names_are_words() {
        assert_eq!(
            tenant_name("tenant", "acme.example").unwrap(),
            "acme.example"
        );
        assert_eq!(tenant_name("tenant", "Customer-42").unwrap(), "Customer-42");
        for bad in ["", "-x", "a b", "a:b", "a\nb", &"a".repeat(101)] {
            assert_eq!(tenant_name("tenant", bad).unwrap_err().code, 65, "{bad:?}");
        }
    }
}
