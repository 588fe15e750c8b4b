//! Database access shared by every program: connecting, classifying errors by
//! SQLSTATE, the retry helper for transient serialization failures, the worker pool,
//! the embedded schema and its check, and every SQL statement as a named constant.
//!
//! Nothing here holds state across calls; callers own their clients and pools.

pub mod claim_sql;
pub mod client;
pub mod horizon;
pub mod hosts;
pub mod pool;
pub mod reconnect;
pub mod schema;
pub mod sql;
pub mod sql_destinations;
pub mod sql_history;
pub mod sql_horizon;
pub mod sql_settings;
pub mod watch;

use std::error::Error as _;
use std::time::Duration;

use postgres::error::SqlState;

pub use client::{Client, Queries, Transaction};

use crate::escape::Visible;

/// How a database error should be handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The connection broke or could not be made: SQLSTATE class 08, 57P01–57P03, an
    /// I/O error, a closed client (worker status 74).
    Connection,
    /// The server refused a connection for overload: too_many_connections (status 75).
    Overload,
    /// A serialization failure or deadlock, worth re-running at once.
    Transient,
    /// Anything else: a statement refused for its own reasons.
    Other,
}

/// Classifies a `postgres` error by SQLSTATE, never by message text.
pub fn classify(err: &postgres::Error) -> ErrorKind {
    if let Some(code) = err.code() {
        return classify_code(code);
    }
    if err.is_closed() {
        return ErrorKind::Connection;
    }
    // No SQLSTATE: an I/O, TLS or protocol failure of the connection, unless it is a
    // conversion error of ours (whose source is not an I/O error).
    let mut source = err.source();
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return ErrorKind::Connection;
        }
        source = s.source();
    }
    ErrorKind::Other
}

/// Classifies a SQLSTATE.
pub fn classify_code(code: &SqlState) -> ErrorKind {
    if code == &SqlState::TOO_MANY_CONNECTIONS {
        ErrorKind::Overload
    } else if code.code().starts_with("08")
        || code == &SqlState::ADMIN_SHUTDOWN
        || code == &SqlState::CRASH_SHUTDOWN
        || code == &SqlState::CANNOT_CONNECT_NOW
    {
        ErrorKind::Connection
    } else if code == &SqlState::T_R_SERIALIZATION_FAILURE
        || code == &SqlState::T_R_DEADLOCK_DETECTED
    {
        ErrorKind::Transient
    } else {
        ErrorKind::Other
    }
}

/// Runs a queue operation, re-running it (up to three more times) when it fails with a
/// transient serialization failure or deadlock.
pub fn retry_transient<T>(
    mut op: impl FnMut() -> Result<T, postgres::Error>,
) -> Result<T, postgres::Error> {
    let mut attempt = 0;
    loop {
        match op() {
            Err(e) if attempt < 3 && classify(&e) == ErrorKind::Transient => {
                attempt += 1;
                log::debug!("transient database error, retrying: {e}");
                std::thread::sleep(Duration::from_millis(5 << attempt));
            }
            other => return other,
        }
    }
}

/// Text as PostgreSQL stores it: `text` and `jsonb` refuse NUL, so each becomes U+FFFD.
/// An error message quoting a program's output must not make its own write fail.
pub fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// The client library's keepalive idle time when `CONNECTION` sets none.
const DEFAULT_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
const KEEPALIVES_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVES_RETRIES: u32 = 3;
/// The same on the server's end of the session.
const SERVER_KEEPALIVES: &str =
    "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3";

/// Every program session's `search_path` (§4 "Containment"): names resolve through
/// the system catalog alone, so an operator or function another role created in a
/// writable schema (`public` on PostgreSQL 14) is never found; the programs' SQL names
/// the schema of everything else. Set after `CONNECTION`'s own options, so it wins.
pub const SEARCH_PATH_OPTION: &str = "-c search_path=pg_catalog,pg_temp";

/// Every session's `statement_timeout` unless its program or `CONNECTION`'s options
/// set another: the server ends a statement that runs longer, and the watchdog
/// abandons a session whose statement gets no answer for that long and the grace
/// (§8.4, [`watch`]).
pub const DEFAULT_STATEMENT_TIMEOUT_OPTION: &str = "-c statement_timeout=60s";
/// `pepsi-setup`'s, unless `CONNECTION`'s options set another: a schema upgrade of a
/// large queue may rewrite it.
pub const SETUP_STATEMENT_TIMEOUT_OPTION: &str = "-c statement_timeout=1h";
/// How long data sent on a TCP session may stay unacknowledged before the connection
/// is dropped (`tcp_user_timeout`), unless `CONNECTION` sets it: a peer that vanished
/// while we were sending is noticed within this.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Parses a conninfo string or URL, naming the program in `application_name`, with
/// keepalives that notice a vanished peer within about a minute, a
/// `tcp_user_timeout`, [`DEFAULT_STATEMENT_TIMEOUT_OPTION`] (before the connection's own
/// options, which may change it) and the fixed [`SEARCH_PATH_OPTION`].
pub fn connection_config(
    conninfo: &str,
    application: &str,
) -> Result<postgres::Config, postgres::Error> {
    connection_config_with(conninfo, application, DEFAULT_STATEMENT_TIMEOUT_OPTION)
}

/// [`connection_config`] with another default `statement_timeout` option.
pub fn connection_config_with(
    conninfo: &str,
    application: &str,
    statement_timeout: &str,
) -> Result<postgres::Config, postgres::Error> {
    // `target_session_attrs=primary` as the library reads it (a value Pepsi refuses
    // was refused with the configuration, naming it).
    let prepared = crate::conninfo::prepared(conninfo).unwrap_or_else(|_| conninfo.to_string());
    let mut config: postgres::Config = prepared.parse()?;
    if config.get_application_name().is_none() {
        config.application_name(application);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    // A peer gone without a word (a dead host, a NAT that forgot the connection) is
    // noticed within about a minute on both ends, instead of the system's two hours:
    // here through the socket, on the server through its settings. Otherwise a stale
    // server session would keep holding the dispatcher lock. Values from `CONNECTION`
    // come later and win (but an explicit keepalives_idle=7200, the library's default,
    // cannot be told from none); over a Unix socket the server ignores them.
    if config.get_keepalives_idle() == DEFAULT_KEEPALIVES_IDLE {
        config.keepalives_idle(KEEPALIVES_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVES_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    let options = format!(
        "{SERVER_KEEPALIVES} {statement_timeout} {} {SEARCH_PATH_OPTION}",
        config.get_options().unwrap_or_default()
    );
    config.options(&options.replace("  ", " "));
    Ok(config)
}

/// Adds server settings (`-c name=value …`) after those of `CONNECTION`, so they win.
pub fn append_options(config: &mut postgres::Config, options: &str) {
    let all = format!("{} {options}", config.get_options().unwrap_or_default());
    config.options(all.trim_start());
}

/// A connection that could not be made, classified and described (where to, why).
#[derive(Debug)]
pub struct ConnectError {
    /// How to handle it: `Connection` (unreachable), `Overload`, or `Other` (refused
    /// for its own reasons: authentication, a missing database, a bad conninfo).
    pub kind: ErrorKind,
    /// What happened, with the socket or host, the user and the database.
    pub message: String,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConnectError {}

/// Opens one connection with a prepared configuration (the first of its hosts that
/// takes it; a failure names each host's reason).
pub fn open(config: &postgres::Config) -> Result<Client, ConnectError> {
    hosts::connect_any(config)
}

/// Opens one connection.
pub fn connect(conninfo: &str, application: &str) -> Result<Client, ConnectError> {
    let config = connection_config(conninfo, application).map_err(|e| ConnectError {
        kind: ErrorKind::Other,
        message: format!("[pepsi-postgres] CONNECTION: {}", describe(&e)),
    })?;
    open(&config)
}

/// Writes the stages an injecting role may inject into ([`sql::SET_INJECT_STAGES`],
/// one round trip); returns whether the list changed.
pub fn write_inject_stages(
    client: &mut impl Queries,
    stages: &[String],
) -> Result<bool, postgres::Error> {
    Ok(client.query_one(sql::SET_INJECT_STAGES, &[&stages])?.get(0))
}

/// One row of `pepsi.config_override`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverrideRow {
    /// The section, e.g. `stage-if`.
    pub section: String,
    /// The key.
    pub key: String,
    /// The value; empty unsets the file's key.
    pub value: String,
}

/// Reads `pepsi.config_override`.
pub fn read_overlay(client: &mut impl Queries) -> Result<Vec<OverrideRow>, postgres::Error> {
    Ok(client
        .query(sql::READ_CONFIG_OVERRIDE, &[])?
        .iter()
        .map(|r| OverrideRow {
            section: r.get(0),
            key: r.get(1),
            value: r.get(2),
        })
        .collect())
}

/// Hands `each` the (address, stage, key) of every `pepsi.settings` row outside the
/// pairs `stages[i]`, `keys[i]` ([`sql::READ_UNLISTED_SETTINGS`]), one row at a time,
/// so a large table is never held whole.
pub fn read_unlisted_settings(
    client: &mut Client,
    stages: &[String],
    keys: &[String],
    mut each: impl FnMut(String, String, String),
) -> Result<(), postgres::Error> {
    use postgres::fallible_iterator::FallibleIterator;
    let params: [&(dyn postgres::types::ToSql + Sync); 2] = [&stages, &keys];
    let mut rows = client.query_raw(sql::READ_UNLISTED_SETTINGS, params)?;
    while let Some(row) = rows.next()? {
        each(row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
    }
    Ok(())
}

/// The per-address settings rows workers apply ([`sql::READ_LISTED_SETTINGS`]) of
/// the allowed (`stages`, `keys`) pairs, streamed to `each` as (address, stage, key,
/// value), grouped by stage and address.
pub fn read_listed_settings(
    client: &mut Client,
    stages: &[String],
    keys: &[String],
    mut each: impl FnMut(String, String, String, String),
) -> Result<(), postgres::Error> {
    use postgres::fallible_iterator::FallibleIterator;
    let params: [&(dyn postgres::types::ToSql + Sync); 2] = [&stages, &keys];
    let mut rows = client.query_raw(sql::READ_LISTED_SETTINGS, params)?;
    while let Some(row) = rows.next()? {
        each(
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
        );
    }
    Ok(())
}

/// A one-line description of a database error: the server's message with its
/// SQLSTATE, or the client's error with its causes ("error connecting to server: No
/// such file or directory (os error 2)"), escaped ([`Visible`]).
pub fn describe(err: &postgres::Error) -> String {
    // The server's message can quote a value of a row (a stage, an address): shown
    // escaped, like everything from the database.
    if let Some(db) = err.as_db_error() {
        return format!("{} (SQLSTATE {})", Visible(db.message()), db.code().code());
    }
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let cause = s.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = s.source();
    }
    Visible(&text).to_string()
}

/// Where a connection goes, for messages: each host as `socket DIR/.s.PGSQL.PORT` or
/// `HOST:PORT`, the user and the database.
pub fn target(config: &postgres::Config) -> String {
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            postgres::config::Host::Tcp(name) => format!("{name}:{}", port(i)),
            postgres::config::Host::Unix(dir) => {
                format!("socket {}/.s.PGSQL.{}", dir.display(), port(i))
            }
        })
        .collect();
    let hosts = if hosts.is_empty() {
        "the default host".to_string()
    } else {
        hosts.join(", ")
    };
    format!(
        "{hosts} as user {} (database {})",
        config.get_user().unwrap_or("?"),
        config.get_dbname().or(config.get_user()).unwrap_or("?")
    )
}

/// A failed connection attempt in words: where to, and why.
pub fn describe_connect(config: &postgres::Config, err: &postgres::Error) -> String {
    format!("cannot connect to {}: {}", target(config), describe(err))
}

#[cfg(test)]
mod tests {
    #[test]
    fn target_session_attrs_primary_is_parsed_as_read_write() {
        let c = super::connection_config("host=/tmp target_session_attrs=primary", "p").unwrap();
        assert_eq!(
            c.get_target_session_attrs(),
            postgres::config::TargetSessionAttrs::ReadWrite
        );
    }

    use super::*;

    #[test]
    fn appended_options_come_after_the_connections_own() {
        let mut c = connection_config("host=/tmp options='-c work_mem=8MB'", "p").unwrap();
        append_options(&mut c, sql::ASYNC_COMMIT_OPTION);
        assert_eq!(
            c.get_options(),
            Some(
                format!(
                    "{SERVER_KEEPALIVES} {DEFAULT_STATEMENT_TIMEOUT_OPTION} -c work_mem=8MB {SEARCH_PATH_OPTION} {}",
                    sql::ASYNC_COMMIT_OPTION
                )
                .as_str()
            )
        );
    }

    #[test]
    fn keepalives_default_to_a_minute_and_connection_settings_win() {
        let c = connection_config("host=/tmp dbname=x", "p").unwrap();
        assert_eq!(c.get_keepalives_idle(), KEEPALIVES_IDLE);
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVES_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVES_RETRIES));
        assert_eq!(
            c.get_options(),
            Some(
                format!(
                    "{SERVER_KEEPALIVES} {DEFAULT_STATEMENT_TIMEOUT_OPTION} {SEARCH_PATH_OPTION}"
                )
                .as_str()
            )
        );
        assert_eq!(c.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let c = connection_config(
            "host=/tmp keepalives_idle=600 options='-c tcp_keepalives_idle=600'",
            "p",
        )
        .unwrap();
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(600));
        // Later -c settings override earlier ones on the server.
        assert_eq!(
            c.get_options(),
            Some(
                format!(
                    "{SERVER_KEEPALIVES} {DEFAULT_STATEMENT_TIMEOUT_OPTION} -c tcp_keepalives_idle=600 {SEARCH_PATH_OPTION}"
                )
                .as_str()
            )
        );
    }

    #[test]
    fn a_connect_failure_names_the_socket_the_user_and_the_reason() {
        let config = connection_config("host=/nowhere port=5999 user=pepsi dbname=q", "t").unwrap();
        let Err(err) = config.connect(postgres::NoTls) else {
            panic!("connected to /nowhere")
        };
        let text = describe_connect(&config, &err);
        assert!(
            text.starts_with("cannot connect to socket /nowhere/.s.PGSQL.5999 as user pepsi (database q): error connecting to server: "),
            "{text}"
        );
        assert!(text.contains("No such file or directory"), "{text}");
        let tcp = connection_config("host=db.example,db2.example port=6000 user=u", "t").unwrap();
        assert_eq!(
            target(&tcp),
            "db.example:6000, db2.example:6000 as user u (database u)"
        );
    }

    #[test]
    fn sqlstates_are_classified() {
        assert_eq!(
            classify_code(&SqlState::TOO_MANY_CONNECTIONS),
            ErrorKind::Overload
        );
        assert_eq!(
            classify_code(&SqlState::ADMIN_SHUTDOWN),
            ErrorKind::Connection
        );
        assert_eq!(
            classify_code(&SqlState::CRASH_SHUTDOWN),
            ErrorKind::Connection
        );
        assert_eq!(
            classify_code(&SqlState::CANNOT_CONNECT_NOW),
            ErrorKind::Connection
        );
        assert_eq!(
            classify_code(&SqlState::CONNECTION_FAILURE),
            ErrorKind::Connection
        );
        assert_eq!(
            classify_code(&SqlState::T_R_SERIALIZATION_FAILURE),
            ErrorKind::Transient
        );
        assert_eq!(
            classify_code(&SqlState::T_R_DEADLOCK_DETECTED),
            ErrorKind::Transient
        );
        assert_eq!(classify_code(&SqlState::UNIQUE_VIOLATION), ErrorKind::Other);
        assert_eq!(classify_code(&SqlState::QUERY_CANCELED), ErrorKind::Other);
    }
}
