//! The integration test modules, one per area.

mod config_check;
mod dispatch;
mod foundation;
mod guarantees;
mod poison;
mod recovery;
mod worker;
