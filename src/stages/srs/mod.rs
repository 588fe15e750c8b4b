//! The `srs` stage's rewriting core (§19): the Sender Rewriting Scheme's addresses,
//! byte-compatible with postsrsd 1.10 (`scheme.rs`), and the secrets file they are
//! signed with (`secrets.rs`). Pure apart from reading that file; what a stage does
//! with a result (keep a sender, fail a recipient) is decided by the stage.

pub mod scheme;
pub mod secrets;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod postsrsd_tests;
#[cfg(test)]
mod scheme_tests;
