//! Hostile input through [`super::scheme`]: whatever comes in, the answer is an
//! `Ok(None)`, an address `mailbox::check` accepts, or an error with a reason; never a
//! panic.
