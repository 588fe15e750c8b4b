//! The integration test modules, one per area.

mod batching;
mod bounce;
mod bouncer;
mod config_check;
mod containment;
mod dispatch;
mod fair;
mod fair_sql;
mod foundation;
mod guarantees;
mod poison;
mod queue;
mod recovery;
mod roles;
mod worker;
