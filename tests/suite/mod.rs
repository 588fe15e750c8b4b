//! The integration test modules, one per area.

mod dispatch;
mod foundation;
mod guarantees;
mod poison;
mod recovery;
mod worker;
