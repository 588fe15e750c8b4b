//! What the pool decisions see of a worker: where it is in its life ([`Phase`]) and a
//! copy of the few facts they read ([`WorkerView`]). Vocabulary only, shared by the
//! process mechanism ([`super::process`], which makes a view of each worker) and the
//! pool decisions ([`super::pool`], which read views); it uses no other file of the
//! dispatcher and decides nothing.

/// Where a worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Started; no `ready` yet.
    Starting,
    /// Ready and taking ids.
    Ready,
    /// Takes no more ids; its stdin is closed once its queue drains.
    Retiring,
    /// Its stdin is closed; it should exit.
    Closing,
}

/// What the pool decisions need to know of a worker.
#[derive(Clone, Copy, Debug)]
pub struct WorkerView {
    /// Its serial.
    pub serial: u64,
    /// Where it is in its life.
    pub phase: Phase,
    /// It is retired as soon as it is ready.
    pub retire_on_ready: bool,
    /// It runs a suspect alone.
    pub isolated: bool,
    /// Ids it was ever handed.
    pub assigned_total: u64,
    /// Ids it holds now.
    pub queued: usize,
}
