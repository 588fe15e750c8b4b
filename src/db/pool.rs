//! A small r2d2 pool that remembers why its last connection attempt failed, so a
//! checkout timeout can be told apart: a refused-for-overload connection (worker status
//! 75) from an unreachable server (status 74).
//!
//! Connections are not tested on checkout with a round trip: every queue write must be
//! one. A broken connection fails its statement instead, is classified there, and is
//! discarded by r2d2 on return (`is_closed`). When a program learns that the database
//! went away (its own statement failed for the connection, or its other session was
//! lost), it calls [`Pool::forget_connections`]: every connection made before is
//! discarded at its next checkout, without a round trip, so none fails once more
//! against a server that is gone (a failover's old primary).
//!
//! Each connection keeps the statements prepared on it ([`Connection::query_prepared`]):
//! a worker's load, advance and finish are parsed and planned once per connection, and
//! from then on each is one round trip that the server neither parses nor plans again.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postgres::types::{ToSql, Type};
use postgres::{Row, Statement};

use super::Client;

use super::reconnect::{self, Reconnect};
use super::{ConnectError, ErrorKind};

/// The pool type.
pub type PgPool = r2d2::Pool<Manager>;
/// A checked-out connection.
pub type PgConn = r2d2::PooledConnection<Manager>;

/// A client and the statements prepared on it, by their text.
pub struct Connection {
    client: Client,
    prepared: HashMap<&'static str, Statement>,
    /// The pool's epoch when it was made ([`Pool::forget_connections`]).
    epoch: u64,
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
            epoch: 0,
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

/// r2d2's manager for [`Connection`]s: postgres clients with their prepared statements,
/// made by [`super::hosts::connect_any`] (each host's reason in a failure).
#[derive(Debug)]
pub struct Manager {
    /// How new connections are made ([`Pool::reconfigure`]).
    config: Arc<Mutex<postgres::Config>>,
    /// Raised by [`Pool::forget_connections`]; a connection of an older epoch is not
    /// valid.
    epoch: Arc<AtomicU64>,
    /// Cleared by a connection made: an old failure must not explain a later timeout.
    last: LastError,
    /// The current outage's waits.
    waits: Mutex<Reconnect>,
}

/// Locks a mutex, also one a panicking thread left.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`Manager::is_valid`]'s refusal of a connection from before the database was lost:
/// not a connection failure (nothing was tried), so not remembered as one.
const STALE: &str = "a connection made before the database was lost";

impl r2d2::ManageConnection for Manager {
    type Connection = Connection;
    type Error = ConnectError;

    /// Early in an outage (its first ten seconds) an unreachable server is tried again
    /// every 250 ms within the call, so that a connection is made within a quarter of a
    /// second of the server's return (a failover's promotion); after that, or for an
    /// overloaded server, the failure goes back to r2d2, which waits longer each time.
    fn connect(&self) -> Result<Connection, ConnectError> {
        loop {
            let epoch = self.epoch.load(Ordering::Acquire);
            let config = lock(&self.config).clone();
            match super::hosts::connect_any(&config) {
                Ok(client) => {
                    lock(&self.waits).reset();
                    *lock(&self.last.last) = None;
                    return Ok(Connection {
                        epoch,
                        ..Connection::new(client)
                    });
                }
                Err(e) if e.kind == ErrorKind::Connection => {
                    let wait = lock(&self.waits).after_failure();
                    if wait > reconnect::FAST {
                        return Err(e);
                    }
                    *lock(&self.last.last) = Some((e.kind, e.message));
                    std::thread::sleep(wait);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// No round trip: a connection is valid unless made before the pool was told the
    /// database went away, closed, or abandoned by the watchdog (its host stopped
    /// answering: its next statement would fail at once).
    fn is_valid(&self, conn: &mut Connection) -> Result<(), ConnectError> {
        if conn.epoch == self.epoch.load(Ordering::Acquire)
            && !conn.client.is_closed()
            && !conn.client.abandoned()
        {
            return Ok(());
        }
        Err(ConnectError {
            kind: ErrorKind::Connection,
            message: STALE.into(),
        })
    }

    fn has_broken(&self, conn: &mut Connection) -> bool {
        conn.client.is_closed() || conn.client.abandoned()
    }
}

#[derive(Debug, Default, Clone)]
struct LastError {
    last: Arc<Mutex<Option<(ErrorKind, String)>>>,
}

impl r2d2::HandleError<ConnectError> for LastError {
    fn handle_error(&self, error: ConnectError) {
        if error.message == STALE {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        *last = Some((error.kind, error.message));
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
    config: Arc<Mutex<postgres::Config>>,
    last: LastError,
    epoch: Arc<AtomicU64>,
}

impl Pool {
    /// Builds a pool of up to `size` connections. No connection is opened yet.
    pub fn new(config: postgres::Config, size: u32, checkout_timeout: Duration) -> Pool {
        let last = LastError::default();
        let epoch = Arc::new(AtomicU64::new(0));
        let config = Arc::new(Mutex::new(config));
        let pool = r2d2::Pool::builder()
            .max_size(size)
            .min_idle(Some(0))
            // `Manager::is_valid`, which makes no round trip.
            .test_on_check_out(true)
            .connection_timeout(checkout_timeout)
            .error_handler(Box::new(last.clone()))
            .build_unchecked(Manager {
                config: config.clone(),
                epoch: epoch.clone(),
                last: last.clone(),
                // r2d2 waits at most half the checkout timeout between its attempts.
                waits: Mutex::new(Reconnect::new(checkout_timeout / 2)),
            });
        Pool {
            pool,
            config,
            last,
            epoch,
        }
    }

    /// Connections made from now on are made with `config`; those in the pool stay as
    /// they are (a worker sets its start-up session's level itself).
    pub fn reconfigure(&self, config: postgres::Config) {
        *lock(&self.config) = config;
    }

    /// The database went away: every connection made so far is discarded at its next
    /// checkout (or return) instead of failing a statement first.
    pub fn forget_connections(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
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
