//! A small r2d2 pool that remembers why its last connection attempt failed, so a
//! checkout timeout can be told apart: a refused-for-overload connection (worker status
//! 75) from an unreachable server (status 74).
//!
//! Connections are not tested on checkout: that test is a round trip, and every queue
//! write must be one. A broken connection fails its statement instead, is classified
//! there, and is discarded by r2d2 on return (`is_closed`).
//!
//! Each connection keeps the statements prepared on it ([`Connection::query_prepared`]):
//! a worker's load, advance and finish are parsed and planned once per connection, and
//! from then on each is one round trip that the server neither parses nor plans again.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postgres::types::{ToSql, Type};
use postgres::{Client, NoTls, Row, Statement};
use r2d2_postgres::PostgresConnectionManager;

use super::{ErrorKind, classify, describe};

/// The pool type.
pub type PgPool = r2d2::Pool<Manager>;
/// A checked-out connection.
pub type PgConn = r2d2::PooledConnection<Manager>;

/// A client and the statements prepared on it, by their text.
pub struct Connection {
    client: Client,
    prepared: HashMap<&'static str, Statement>,
}

impl Deref for Connection {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl Connection {
    /// A connection made elsewhere (the dispatcher's coordinator session), with no
    /// statement prepared yet.
    pub fn new(client: Client) -> Connection {
        Connection {
            client,
            prepared: HashMap::new(),
        }
    }

    /// Runs `sql` (one of the program's constants) with parameters of `types`, prepared
    /// on this connection the first time (one more round trip, once) and reused after.
    /// A statement that fails is forgotten, so that one a schema change made stale is
    /// prepared afresh on the next call.
    pub fn query_prepared(
        &mut self,
        sql: &'static str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error> {
        let statement = match self.prepared.get(sql) {
            Some(s) => s.clone(),
            None => {
                let s = self.client.prepare_typed(sql, types)?;
                self.prepared.insert(sql, s.clone());
                s
            }
        };
        let rows = self.client.query(&statement, params);
        if rows.is_err() {
            self.prepared.remove(sql);
        }
        rows
    }
}

/// r2d2's manager for [`Connection`]s: postgres clients with their prepared statements.
#[derive(Debug)]
pub struct Manager(PostgresConnectionManager<NoTls>);

impl r2d2::ManageConnection for Manager {
    type Connection = Connection;
    type Error = postgres::Error;

    fn connect(&self) -> Result<Connection, postgres::Error> {
        Ok(Connection::new(self.0.connect()?))
    }

    fn is_valid(&self, conn: &mut Connection) -> Result<(), postgres::Error> {
        self.0.is_valid(&mut conn.client)
    }

    fn has_broken(&self, conn: &mut Connection) -> bool {
        self.0.has_broken(&mut conn.client)
    }
}

#[derive(Debug, Default, Clone)]
struct LastError {
    last: Arc<Mutex<Option<(ErrorKind, String)>>>,
    /// Where the pool connects, for the message.
    target: Arc<str>,
}

impl r2d2::HandleError<postgres::Error> for LastError {
    fn handle_error(&self, error: postgres::Error) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let message = format!("cannot connect to {}: {}", self.target, describe(&error));
        *last = Some((classify(&error), message));
    }
}

/// A checkout failure, classified.
#[derive(Debug)]
pub struct CheckoutError {
    /// `Overload` for too_many_connections or a plain timeout, `Connection` when the
    /// server could not be reached.
    pub kind: ErrorKind,
    /// What happened.
    pub message: String,
}

/// A pool plus the last connection error it saw.
#[derive(Clone)]
pub struct Pool {
    pool: PgPool,
    last: LastError,
}

impl Pool {
    /// Builds a pool of up to `size` connections. No connection is opened yet.
    pub fn new(config: postgres::Config, size: u32, checkout_timeout: Duration) -> Pool {
        let last = LastError {
            last: Arc::default(),
            target: super::target(&config).into(),
        };
        let pool = r2d2::Pool::builder()
            .max_size(size)
            .min_idle(Some(0))
            .test_on_check_out(false)
            .connection_timeout(checkout_timeout)
            .error_handler(Box::new(last.clone()))
            .build_unchecked(Manager(PostgresConnectionManager::new(config, NoTls)));
        Pool { pool, last }
    }

    /// Checks out a connection.
    pub fn get(&self) -> Result<PgConn, CheckoutError> {
        match self.pool.get() {
            Ok(conn) => Ok(conn),
            Err(timeout) => {
                let last = self
                    .last
                    .last
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                Err(match last {
                    Some((ErrorKind::Overload, m)) => CheckoutError {
                        kind: ErrorKind::Overload,
                        message: m,
                    },
                    Some((_, m)) => CheckoutError {
                        kind: ErrorKind::Connection,
                        message: m,
                    },
                    // Every connection was busy for the whole timeout: overload.
                    None => CheckoutError {
                        kind: ErrorKind::Overload,
                        message: format!("database pool checkout timed out: {timeout}"),
                    },
                })
            }
        }
    }
}
