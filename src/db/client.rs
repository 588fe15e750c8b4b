//! The database client every program uses: the `postgres` crate's synchronous client,
//! with each call that waits for the server marked as waiting for the watchdog
//! ([`super::watch`]), which abandons the session when the server does not answer
//! within its `statement_timeout` and the grace, or when its host stops answering
//! (§8.4 "A server that hangs"). The methods are the client library's, by the same
//! names; a session abandoned so fails its call as a lost connection (`is_closed`).
//!
//! Made by `hosts.rs` (a connection it watches) or from a client made elsewhere
//! ([`Client::unwatched`], which only the server's timeouts bound). Waiting for
//! notifications is not a statement: it is not marked, and ends when the host is found
//! unresponsive, like every session to it.

use std::sync::Arc;

use postgres::fallible_iterator::FallibleIterator;
use postgres::types::{BorrowToSql, ToSql, Type};
use postgres::{IsolationLevel, Notifications, Row, SimpleQueryMessage, Statement, ToStatement};

use super::watch::{self, Armed};

/// The session's watch, when the watchdog knows its socket.
type Watch = Option<Arc<watch::Session>>;

fn arm(w: &Watch) -> Option<Armed> {
    w.as_ref().map(watch::Session::arm)
}

/// A database session.
pub struct Client {
    inner: postgres::Client,
    watch: Watch,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("watched", &self.watch.is_some())
            .finish()
    }
}

impl Client {
    /// A session the watchdog bounds.
    pub(crate) fn watched(inner: postgres::Client, watch: Watch) -> Client {
        Client { inner, watch }
    }

    /// A client connected elsewhere: its waits are bounded by the server alone.
    pub fn unwatched(inner: postgres::Client) -> Client {
        Client { inner, watch: None }
    }

    /// Whether the watchdog bounds this session's waits.
    pub fn is_watched(&self) -> bool {
        self.watch.is_some()
    }

    /// Whether the watchdog abandoned this session (its server did not answer).
    pub fn abandoned(&self) -> bool {
        self.watch.as_ref().is_some_and(|w| w.abandoned())
    }

    /// Like `postgres::Client::execute`.
    pub fn execute<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.inner.execute(query, params)
    }

    /// Like `postgres::Client::execute_typed`.
    pub fn execute_typed(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.execute_typed(query, params)
    }

    /// Like `postgres::Client::query`.
    pub fn query<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.inner.query(query, params)
    }

    /// Like `postgres::Client::query_one`.
    pub fn query_one<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.inner.query_one(query, params)
    }

    /// Like `postgres::Client::query_opt`.
    pub fn query_opt<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.inner.query_opt(query, params)
    }

    /// Like `postgres::Client::query_raw`; each row read is a wait of its own.
    pub fn query_raw<T, P, I>(
        &mut self,
        query: &T,
        params: I,
    ) -> Result<RowIter<'_>, postgres::Error>
    where
        T: ?Sized + ToStatement,
        P: BorrowToSql,
        I: IntoIterator<Item = P>,
        I::IntoIter: ExactSizeIterator,
    {
        let a = arm(&self.watch);
        let inner = self.inner.query_raw(query, params)?;
        drop(a);
        Ok(RowIter {
            inner,
            watch: self.watch.clone(),
        })
    }

    /// Like `postgres::Client::query_typed`.
    pub fn query_typed(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.query_typed(query, params)
    }

    /// Like `postgres::Client::query_typed_one`.
    pub fn query_typed_one(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Row, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.query_typed_one(query, params)
    }

    /// Like `postgres::Client::query_typed_opt`.
    pub fn query_typed_opt(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Option<Row>, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.query_typed_opt(query, params)
    }

    /// Like `postgres::Client::prepare_typed`.
    pub fn prepare_typed(
        &mut self,
        query: &str,
        types: &[Type],
    ) -> Result<Statement, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.prepare_typed(query, types)
    }

    /// Like `postgres::Client::simple_query`.
    pub fn simple_query(
        &mut self,
        query: &str,
    ) -> Result<Vec<SimpleQueryMessage>, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.simple_query(query)
    }

    /// Like `postgres::Client::batch_execute`.
    pub fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.batch_execute(query)
    }

    /// Like `postgres::Client::transaction`.
    pub fn transaction(&mut self) -> Result<Transaction<'_>, postgres::Error> {
        let a = arm(&self.watch);
        let inner = self.inner.transaction()?;
        drop(a);
        Ok(Transaction {
            inner: Some(inner),
            watch: self.watch.clone(),
        })
    }

    /// Starts a transaction with these characteristics (`postgres`'s transaction
    /// builder, in one call).
    pub fn transaction_with(
        &mut self,
        isolation: IsolationLevel,
        read_only: bool,
    ) -> Result<Transaction<'_>, postgres::Error> {
        let a = arm(&self.watch);
        let inner = self
            .inner
            .build_transaction()
            .isolation_level(isolation)
            .read_only(read_only)
            .start()?;
        drop(a);
        Ok(Transaction {
            inner: Some(inner),
            watch: self.watch.clone(),
        })
    }

    /// Like `postgres::Client::notifications`: waiting for them is not a statement.
    pub fn notifications(&mut self) -> Notifications<'_> {
        self.inner.notifications()
    }

    /// Like `postgres::Client::is_closed`.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }
}

/// A transaction: rolled back when dropped without a commit, that wait bounded too.
pub struct Transaction<'a> {
    /// `None` once committed.
    inner: Option<postgres::Transaction<'a>>,
    watch: Watch,
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.inner.take() {
            let _a = arm(&self.watch);
            drop(t);
        }
    }
}

impl<'a> Transaction<'a> {
    fn open(&mut self) -> &mut postgres::Transaction<'a> {
        self.inner
            .as_mut()
            .expect("a transaction is open until it is committed")
    }

    /// Like `postgres::Transaction::commit`.
    pub fn commit(mut self) -> Result<(), postgres::Error> {
        let t = self.inner.take().expect("committed once");
        let _a = arm(&self.watch);
        t.commit()
    }

    /// Like `postgres::Client::execute`.
    pub fn execute<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.open().execute(query, params)
    }

    /// Like `postgres::Client::query`.
    pub fn query<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.open().query(query, params)
    }

    /// Like `postgres::Client::query_one`.
    pub fn query_one<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.open().query_one(query, params)
    }

    /// Like `postgres::Client::query_opt`.
    pub fn query_opt<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let _a = arm(&self.watch);
        self.open().query_opt(query, params)
    }

    /// Like `postgres::Client::batch_execute`.
    pub fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error> {
        let _a = arm(&self.watch);
        self.open().batch_execute(query)
    }
}

/// Rows read one at a time; each read is a wait of its own.
pub struct RowIter<'a> {
    inner: postgres::RowIter<'a>,
    watch: Watch,
}

impl FallibleIterator for RowIter<'_> {
    type Item = Row;
    type Error = postgres::Error;

    fn next(&mut self) -> Result<Option<Row>, postgres::Error> {
        let _a = arm(&self.watch);
        self.inner.next()
    }
}

/// What the functions that run on a session or in a transaction need of either.
pub trait Queries {
    /// Like `postgres::Client::query`.
    fn query(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error>;
    /// Like `postgres::Client::query_one`.
    fn query_one(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error>;
    /// Like `postgres::Client::query_opt`.
    fn query_opt(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error>;
    /// Like `postgres::Client::execute`.
    fn execute(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error>;
    /// Like `postgres::Client::batch_execute`.
    fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error>;
}

impl Queries for Client {
    fn query(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error> {
        Client::query(self, query, params)
    }
    fn query_one(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error> {
        Client::query_one(self, query, params)
    }
    fn query_opt(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error> {
        Client::query_opt(self, query, params)
    }
    fn execute(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error> {
        Client::execute(self, query, params)
    }
    fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error> {
        Client::batch_execute(self, query)
    }
}

impl Queries for Transaction<'_> {
    fn query(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error> {
        Transaction::query(self, query, params)
    }
    fn query_one(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error> {
        Transaction::query_one(self, query, params)
    }
    fn query_opt(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error> {
        Transaction::query_opt(self, query, params)
    }
    fn execute(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error> {
        Transaction::execute(self, query, params)
    }
    fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error> {
        Transaction::batch_execute(self, query)
    }
}

/// A client made without this module (tests, tools): its waits are the server's.
impl Queries for postgres::Client {
    fn query(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error> {
        postgres::Client::query(self, query, params)
    }
    fn query_one(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error> {
        postgres::Client::query_one(self, query, params)
    }
    fn query_opt(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error> {
        postgres::Client::query_opt(self, query, params)
    }
    fn execute(
        &mut self,
        query: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error> {
        postgres::Client::execute(self, query, params)
    }
    fn batch_execute(&mut self, query: &str) -> Result<(), postgres::Error> {
        postgres::Client::batch_execute(self, query)
    }
}
