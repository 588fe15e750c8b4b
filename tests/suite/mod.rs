//! The integration test modules, one per area.

mod foundation;
mod worker;
