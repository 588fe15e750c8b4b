//! The signing core of the `dkim-sign` stage (§18): everything but the stage itself.
//! `keys.rs` reads the `KEY_TABLE` and loads each key file (`keyfile.rs`, with the DER
//! of `der.rs`) and answers which keys sign a domain; `from.rs` finds the domain of a
//! message's one `From:` address; `sign.rs` writes the `DKIM-Signature` fields that
//! cover the message exactly as the relay sends it, with the canonicalization of
//! `canon.rs` over the header fields and body `fields.rs` reads.
//!
//! The stage (its `worker::Stage`, configuration and outcome) uses these; nothing here
//! reads the database, the configuration file or the clock (the signing time is given),
//! and only `keys.rs` and `keyfile.rs` read files.

pub mod canon;
pub mod der;
pub mod fields;
pub mod from;
pub mod keyfile;
pub mod keys;
pub mod sign;

#[cfg(test)]
mod keys_tests;
#[cfg(test)]
mod sign_tests;
#[cfg(test)]
mod test_keys;
#[cfg(test)]
mod verify_tests;
