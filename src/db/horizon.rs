//! Who holds the database's oldest snapshot (the MVCC horizon): one read
//! ([`read`], [`super::sql_horizon::HORIZON_HOLDERS`]) and the words for it, shared by
//! the dispatcher's warning (`crate::dispatch::horizon`), `pepsi-queue status` and
//! `pepsi-queue metrics`.
//!
//! Everything a holder's row carries but its kind and numbers comes from other
//! sessions (an `application_name`, a slot name, a prepared transaction's GID): it is
//! hostile text, escaped ([`Visible`]) wherever [`describe`] writes it. Pure but for
//! [`read`].

use serde_json::{Value, json};

use super::sql_horizon;
use crate::escape::Visible;

/// One session, standby, slot or prepared transaction that holds the horizon.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Holder {
    /// `session`, `standby` (a WAL sender carrying a standby's `hot_standby_feedback`),
    /// `replication slot` or `prepared transaction`.
    pub kind: String,
    /// The session's or WAL sender's pid; a slot's active sender's.
    pub pid: Option<i32>,
    /// `application_name`, the slot's name or the prepared transaction's GID.
    pub name: Option<String>,
    /// The role of the session or the prepared transaction.
    pub role: Option<String>,
    /// The client's address, `local` for a Unix socket; `None` when hidden.
    pub client: Option<String>,
    /// The session's state (`active`, `idle in transaction`, …); a slot's `active` or
    /// `inactive`; `prepared`.
    pub state: Option<String>,
    /// The database (a session's, a logical slot's, a prepared transaction's).
    pub database: Option<String>,
    /// Seconds since its transaction began or it was prepared; `None` when unknown (a
    /// slot, a standby, a session this role may not see the details of).
    pub age_seconds: Option<f64>,
    /// Transactions since its oldest xmin or xid.
    pub xid_age: Option<i32>,
    /// That xmin or xid: the same holder with another value holds another snapshot.
    pub xmin: Option<String>,
    /// May this role see the session's state, client and start?
    pub visible: bool,
}

impl Holder {
    /// What tells this snapshot from another: its kind and xmin, and a session's or
    /// standby's pid, or a slot's or prepared transaction's name. Not a session's
    /// application name, which the session may change at will, nor a slot's active
    /// pid, which changes when its standby reconnects.
    pub fn key(&self) -> (String, Option<i32>, Option<String>, Option<String>) {
        let named = matches!(
            self.kind.as_str(),
            "replication slot" | "prepared transaction"
        );
        (
            self.kind.clone(),
            if named { None } else { self.pid },
            if named { self.name.clone() } else { None },
            self.xmin.clone(),
        )
    }
}

/// Every holder, the oldest first, the reading session excluded.
pub fn read(client: &mut impl crate::db::Queries) -> Result<Vec<Holder>, postgres::Error> {
    Ok(client
        .query(sql_horizon::HORIZON_HOLDERS, &[])?
        .iter()
        .map(|r| Holder {
            kind: r.get(0),
            pid: r.get(1),
            name: r.get(2),
            role: r.get(3),
            client: r.get(4),
            state: r.get(5),
            database: r.get(6),
            age_seconds: r.get(7),
            xid_age: r.get(8),
            xmin: r.get(9),
            visible: r.get(10),
        })
        .collect())
}

/// Why a session's details are missing, for a role that may not see them.
pub const HIDDEN: &str = "its state, client and start are hidden from this database role; \
                          a member of pg_read_all_stats would see them";

/// The holder in words, on one line, every value from the database escaped: `session
/// pid 4711 (application "pg_dump", client local, role "postgres", state "active",
/// database "mail")`.
pub fn describe(h: &Holder) -> String {
    let mut out = h.kind.clone();
    if let Some(pid) = h.pid {
        out.push_str(&format!(" pid {pid}"));
    }
    let mut details = Vec::new();
    let name_word = match h.kind.as_str() {
        "replication slot" => "slot",
        "prepared transaction" => "gid",
        _ => "application",
    };
    if let Some(name) = &h.name {
        details.push(format!("{name_word} \"{}\"", Visible(name)));
    }
    if let Some(client) = &h.client {
        details.push(format!("client {}", Visible(client)));
    }
    if let Some(role) = &h.role {
        details.push(format!("role \"{}\"", Visible(role)));
    }
    if let Some(state) = &h.state {
        details.push(format!("state \"{}\"", Visible(state)));
    }
    if let Some(db) = &h.database {
        details.push(format!("database \"{}\"", Visible(db)));
    }
    if !h.visible {
        details.push(HIDDEN.to_string());
    }
    if !details.is_empty() {
        out.push_str(&format!(" ({})", details.join(", ")));
    }
    out
}

/// The holder as JSON, its text as the database has it (JSON escapes it).
pub fn to_json(h: &Holder) -> Value {
    json!({
        "kind": h.kind,
        "pid": h.pid,
        "name": h.name,
        "role": h.role,
        "client": h.client,
        "state": h.state,
        "database": h.database,
        "age_seconds": h.age_seconds,
        "age_transactions": h.xid_age,
        "details_visible": h.visible,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_described_on_one_line_with_its_text_escaped() {
        let h = Holder {
            kind: "session".into(),
            pid: Some(4711),
            name: Some("dump\n\u{1b}[2Jevil".into()),
            role: Some("postgres".into()),
            client: Some("local".into()),
            state: Some("idle in transaction".into()),
            database: Some("mail".into()),
            age_seconds: Some(75.0),
            xid_age: Some(3),
            xmin: Some("750".into()),
            visible: true,
        };
        let text = describe(&h);
        assert_eq!(
            text,
            "session pid 4711 (application \"dump\\n\\u{1b}[2Jevil\", client local, \
             role \"postgres\", state \"idle in transaction\", database \"mail\")"
        );
        assert!(!text.contains('\n') && !text.contains('\u{1b}'));
    }

    #[test]
    fn a_hidden_session_says_why_and_a_slot_names_itself() {
        let hidden = Holder {
            kind: "session".into(),
            pid: Some(9),
            name: Some("psql".into()),
            role: Some("analyst".into()),
            visible: false,
            ..Holder::default()
        };
        let text = describe(&hidden);
        assert!(text.contains("hidden from this database role"), "{text}");
        assert!(text.contains("pg_read_all_stats"), "{text}");
        let slot = Holder {
            kind: "replication slot".into(),
            name: Some("standby1".into()),
            state: Some("inactive".into()),
            visible: true,
            ..Holder::default()
        };
        assert_eq!(
            describe(&slot),
            "replication slot (slot \"standby1\", state \"inactive\")"
        );
        assert_eq!(to_json(&slot)["age_seconds"], Value::Null);
    }
}
