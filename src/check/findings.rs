//! What `pepsi-dispatch check` found ([`Findings`]): its errors and warnings, how
//! many of the errors only say the database is out of reach, and how they are printed
//! (lines, or one JSON document) and turned into the exit status. Used by `check`
//! and `as_worker.rs`; it checks nothing itself.

use std::path::Path;

use crate::config::ConfigError;
use crate::db::{self, ErrorKind};
use crate::exit::Failure;

/// What `check` found.
#[derive(Debug, Default)]
pub(super) struct Findings {
    pub(super) errors: Vec<String>,
    pub(super) warnings: Vec<String>,
    /// How many of the errors say only that the database could not be reached (or
    /// stopped answering): with no other error, `check` exits 75, to be tried again.
    pub(super) unreachable: usize,
}

impl Findings {
    pub(super) fn add_errors(&mut self, errors: impl IntoIterator<Item = ConfigError>) {
        self.errors
            .extend(errors.into_iter().map(|e| e.to_string()));
    }

    pub(super) fn add_warnings(&mut self, warnings: impl IntoIterator<Item = ConfigError>) {
        self.warnings
            .extend(warnings.into_iter().map(|e| e.to_string()));
    }

    /// A statement that failed: out of reach when its session was lost.
    pub(super) fn database_error(&mut self, what: String, e: &postgres::Error) {
        let error = format!("{what}: {}", db::describe(e));
        if db::classify(e) == ErrorKind::Connection {
            self.unreachable(error);
        } else {
            self.errors.push(error);
        }
    }

    /// An error that only says the database is out of reach.
    pub(super) fn unreachable(&mut self, error: String) {
        self.errors.push(error);
        self.unreachable += 1;
    }

    /// The failure for errors: 75 when each only says the database is out of reach (a
    /// check to try again), else 78.
    fn failure(&self, message: String) -> Failure {
        if self.unreachable == self.errors.len() {
            Failure::new(crate::exit::EX_TEMPFAIL, message)
        } else {
            Failure::config(message)
        }
    }

    /// Prints the findings, as lines or (`json`) one JSON document (`file`, `ok`,
    /// `errors`, `warnings`), and exits 0 without errors, else 78 (75 when every error
    /// is a database out of reach).
    pub(super) fn finish(self, path: &Path, json: bool) -> Result<(), Failure> {
        if json {
            let document = serde_json::json!({
                "file": path.display().to_string(),
                "ok": self.errors.is_empty(),
                "errors": self.errors,
                "warnings": self.warnings,
            });
            println!("{document}");
            let errors = self.errors.len();
            return if errors == 0 {
                Ok(())
            } else {
                Err(self.failure(format!(
                    "{}: {errors} error{} found",
                    path.display(),
                    if errors == 1 { "" } else { "s" }
                )))
            };
        }
        for e in &self.errors {
            println!("error: {e}");
        }
        for w in &self.warnings {
            println!("warning: {w}");
        }
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        if self.errors.is_empty() {
            println!(
                "{}: configuration OK ({})",
                path.display(),
                plural(self.warnings.len(), "warning")
            );
            Ok(())
        } else {
            Err(self.failure(format!(
                "{}: {} and {} found",
                path.display(),
                plural(self.errors.len(), "error"),
                plural(self.warnings.len(), "warning")
            )))
        }
    }
}
