//! Exit statuses (sysexits.h) and the one error type programs return to `main`.
//!
//! Library code never exits the process: it returns a [`Failure`] carrying the status,
//! and each binary's `main` turns it into the process exit code.

use std::fmt;
use std::process::ExitCode;

use crate::escape::VisibleLines;

/// Clean exit.
pub const OK: u8 = 0;
/// A general error (bad configuration at start, database unreachable, lock held).
pub const FAILURE: u8 = 1;
/// EX_USAGE: the command line was wrong.
pub const EX_USAGE: u8 = 64;
/// EX_DATAERR: the input data was wrong.
pub const EX_DATAERR: u8 = 65;
/// EX_NOINPUT: an input file did not exist or was not readable.
pub const EX_NOINPUT: u8 = 66;
/// EX_UNAVAILABLE: the operation is not available for what it was asked of (a message
/// in a status the command does not touch).
pub const EX_UNAVAILABLE: u8 = 69;
/// EX_SOFTWARE: an internal error.
pub const EX_SOFTWARE: u8 = 70;
/// EX_CANTCREAT: an output file cannot be created.
pub const EX_CANTCREAT: u8 = 73;
/// EX_IOERR: the database connection broke (worker protocol §5).
pub const EX_IOERR: u8 = 74;
/// EX_TEMPFAIL: the database refused a connection for overload (worker protocol §5).
pub const EX_TEMPFAIL: u8 = 75;
/// EX_NOPERM: the database refused the operation for lack of privileges.
pub const EX_NOPERM: u8 = 77;
/// EX_CONFIG: configuration or schema mismatch.
pub const EX_CONFIG: u8 = 78;

/// An error that ends a program: the exit status and the message for the log.
#[derive(Debug)]
pub struct Failure {
    /// The process exit status.
    pub code: u8,
    /// What went wrong, for stderr / the journal.
    pub message: String,
}

impl Failure {
    /// A failure with the given exit status.
    pub fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// Exit status 1.
    pub fn general(message: impl Into<String>) -> Failure {
        Failure::new(FAILURE, message)
    }

    /// Exit status 64.
    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::new(EX_USAGE, message)
    }

    /// Exit status 78.
    pub fn config(message: impl Into<String>) -> Failure {
        Failure::new(EX_CONFIG, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Turns a program's result into its exit code, logging the failure (or printing it
/// when logging is not yet set up). A failure can quote the database or a message, so
/// it is shown escaped but for its line feeds ([`VisibleLines`]).
pub fn finish(program: &str, result: Result<(), Failure>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::from(OK),
        Err(failure) => {
            let message = VisibleLines(&failure.message);
            if log::log_enabled!(log::Level::Error) {
                log::error!("{message}");
            } else {
                eprintln!("{program}: {message}");
            }
            ExitCode::from(failure.code)
        }
    }
}
