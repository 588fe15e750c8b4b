//! The destinations as every worker sees them (§22, schema 21): a connection slot of
//! `DESTINATION_CONCURRENCY` for each connection open, a destination's failures
//! counted, and its suspension honoured.
//!
//! The slots are session-level advisory locks, so they belong to one database session:
//! this worker's own, [`Session`], opened beside the worker's pool with the same
//! settings (the dispatcher ends it with the others when it kills the worker) and used
//! for nothing else. A slot taken on it is given back on it, by the message's run or
//! by the janitor that closes idle connections; when the session is lost, so are its
//! slots, and the connections they stood for are closed with it (`mod.rs`).
//!
//! Used by `mod.rs`; it knows nothing of SMTP.

use std::time::Duration;

use crate::db::sql_destinations as sql;
use crate::db::{self, Client};
use crate::escape::Visible;

/// This worker's session for the slots, opened when first needed.
pub struct Session {
    settings: postgres::Config,
    client: Option<Client>,
    /// Bumped each time a session is opened: a slot taken on an earlier one is gone.
    pub generation: u64,
}

/// `DESTINATION_CONCURRENCY` and the first slot to try, as the functions take them.
fn bounded(limit: u32, start: u32) -> (i32, i32) {
    let limit = limit.clamp(1, i32::MAX as u32);
    (limit as i32, (start % limit) as i32)
}

/// A slot held: the destination and its number, on the session of `generation`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub destination: String,
    pub number: i32,
    pub generation: u64,
}

/// What asking for a slot gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened {
    /// A slot; and whether failures were counted against the destination (a
    /// connection that works then clears them).
    Slot(Slot, bool),
    /// Every slot is taken.
    Busy,
    /// Suspended for this long still.
    Suspended(Duration),
}

impl Session {
    /// A session to be opened with the worker's `settings`.
    pub fn new(settings: postgres::Config) -> Session {
        Session {
            settings,
            client: None,
            generation: 0,
        }
    }

    /// The client, connecting when there is none.
    fn client(&mut self) -> Result<&mut Client, String> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        if self.client.is_none() {
            let client = db::hosts::connect_any(&self.settings)
                .map_err(|e| format!("database: {}", e.message))?;
            self.generation += 1;
            self.client = Some(client);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Runs `f` on the client; a failure drops the session (and with it every slot).
    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, String> {
        let client = self.client()?;
        match f(client) {
            Ok(v) => Ok(v),
            Err(e) => {
                let why = format!("database: {}", db::describe(&e));
                if client.is_closed() || db::classify(&e) == db::ErrorKind::Connection {
                    self.client = None;
                }
                Err(why)
            }
        }
    }

    /// Takes a slot of `destination`, one of `limit`, trying from `start` on.
    pub fn open(&mut self, destination: &str, limit: u32, start: u32) -> Result<Opened, String> {
        let (limit, start) = bounded(limit, start);
        let row =
            self.with(|c| c.query_one(sql::DESTINATION_OPEN, &[&destination, &limit, &start]))?;
        Ok(self.opened(destination, &row))
    }

    /// Takes a slot of `destination` for a kept connection that holds `from` (a slot of
    /// another destination), and gives `from` back when it got one, in one round trip;
    /// `from` stays held otherwise.
    pub fn reassign(
        &mut self,
        from: &Slot,
        destination: &str,
        limit: u32,
        start: u32,
    ) -> Result<Opened, String> {
        if from.generation != self.generation || self.client.is_none() {
            return self.open(destination, limit, start);
        }
        let (limit, start) = bounded(limit, start);
        let row = self.with(|c| {
            c.query_one(
                sql::DESTINATION_MOVE,
                &[
                    &from.destination,
                    &from.number,
                    &destination,
                    &limit,
                    &start,
                ],
            )
        })?;
        Ok(self.opened(destination, &row))
    }

    /// What a row of `destination_open` or `destination_move` says.
    fn opened(&self, destination: &str, row: &postgres::Row) -> Opened {
        let slot: Option<i32> = row.get(0);
        let until: Option<std::time::SystemTime> = row.get(1);
        let failures: i32 = row.get(2);
        if let Some(until) = until {
            let left = until
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
            return Opened::Suspended(left.max(Duration::from_secs(1)));
        }
        match slot {
            Some(number) => Opened::Slot(
                Slot {
                    destination: destination.to_string(),
                    number,
                    generation: self.generation,
                },
                failures > 0,
            ),
            None => Opened::Busy,
        }
    }

    /// Gives `slot` back; a slot of a session gone went with it.
    pub fn close(&mut self, slot: &Slot) {
        if slot.generation != self.generation || self.client.is_none() {
            return;
        }
        if let Err(e) =
            self.with(|c| c.execute(sql::DESTINATION_CLOSE, &[&slot.destination, &slot.number]))
        {
            log::warn!(
                "relay-to-internet: cannot give back slot {} of {}: {}",
                slot.number,
                slot.destination,
                Visible(&e)
            );
        }
    }

    /// Counts a failed connection to `destination`: the suspension it caused, if any.
    pub fn failed(
        &mut self,
        destination: &str,
        reason: &str,
        dead_after: u32,
        dead_time: Duration,
    ) -> Result<Option<Duration>, String> {
        let dead_after = dead_after.min(i32::MAX as u32) as i32;
        let seconds = dead_time.as_secs_f64();
        let row = self.with(|c| {
            c.query_one(
                sql::DESTINATION_FAILED,
                &[&destination, &reason, &dead_after, &seconds],
            )
        })?;
        let until: Option<std::time::SystemTime> = row.get(0);
        Ok(until.map(|u| {
            u.duration_since(std::time::SystemTime::now())
                .unwrap_or_default()
        }))
    }

    /// A connection to `destination` succeeded after failures: they are forgotten.
    pub fn succeeded(&mut self, destination: &str) {
        if let Err(e) = self.with(|c| c.execute(sql::DESTINATION_SUCCEEDED, &[&destination])) {
            log::warn!(
                "relay-to-internet: cannot clear the failures of {destination}: {}",
                Visible(&e)
            );
        }
    }
}
