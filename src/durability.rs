//! How long a commit waits before it counts as done: PostgreSQL's `synchronous_commit`
//! levels, as a stage's `SYNCHRONOUS_COMMIT` and `[pepsi-dispatch] SYNCHRONOUS_COMMIT`
//! choose them (§12.2). A stage with side effects outside the database (exec,
//! relay) sets `on` (or `remote_apply`) with a synchronous standby, so that an outcome a
//! worker saw committed survives a failover and the stage is not run again for it.
//!
//! Pure and a leaf: the configuration reads the levels, the programs that open sessions
//! turn one into its session option (a named constant per level, never text from the
//! file).

use std::fmt;

/// A `synchronous_commit` level, weakest first (the order is what a commit waits for:
/// nothing, the local flush, the standby's write, its flush, its replay).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SynchronousCommit {
    /// `off`: no wait for the local WAL flush (group commit; a crash may lose the last
    /// fraction of a second of commits, which are then run again).
    Off,
    /// `local`: the local flush, no standby.
    Local,
    /// `remote_write`: the local flush and the synchronous standby's write.
    RemoteWrite,
    /// `on`: the local flush and the synchronous standby's flush.
    On,
    /// `remote_apply`: the standby has also applied it (visible to its readers).
    RemoteApply,
}

/// Every level, weakest first.
pub const LEVELS: [SynchronousCommit; 5] = [
    SynchronousCommit::Off,
    SynchronousCommit::Local,
    SynchronousCommit::RemoteWrite,
    SynchronousCommit::On,
    SynchronousCommit::RemoteApply,
];

impl SynchronousCommit {
    /// PostgreSQL's name of the level.
    pub fn name(self) -> &'static str {
        match self {
            SynchronousCommit::Off => "off",
            SynchronousCommit::Local => "local",
            SynchronousCommit::RemoteWrite => "remote_write",
            SynchronousCommit::On => "on",
            SynchronousCommit::RemoteApply => "remote_apply",
        }
    }

    /// The level named `text` (PostgreSQL's names, any case); the error says which
    /// names there are.
    pub fn parse(text: &str) -> Result<SynchronousCommit, String> {
        LEVELS
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(text.trim()))
            .ok_or_else(|| {
                let names: Vec<&str> = LEVELS.iter().map(|l| l.name()).collect();
                format!(
                    "{text:?} is not a synchronous_commit level (one of {})",
                    names.join(", ")
                )
            })
    }

    /// The session option that sets the level, appended to a connection's options.
    pub fn option(self) -> &'static str {
        match self {
            SynchronousCommit::Off => "-c synchronous_commit=off",
            SynchronousCommit::Local => "-c synchronous_commit=local",
            SynchronousCommit::RemoteWrite => "-c synchronous_commit=remote_write",
            SynchronousCommit::On => "-c synchronous_commit=on",
            SynchronousCommit::RemoteApply => "-c synchronous_commit=remote_apply",
        }
    }
}

impl SynchronousCommit {
    /// The statement that sets the level on a session made without its option (a
    /// worker's start-up session, kept in its pool).
    pub fn set_statement(self) -> &'static str {
        match self {
            SynchronousCommit::Off => "SET synchronous_commit = off",
            SynchronousCommit::Local => "SET synchronous_commit = local",
            SynchronousCommit::RemoteWrite => "SET synchronous_commit = remote_write",
            SynchronousCommit::On => "SET synchronous_commit = on",
            SynchronousCommit::RemoteApply => "SET synchronous_commit = remote_apply",
        }
    }
}

impl fmt::Display for SynchronousCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_reads_back_from_its_name_and_sets_itself() {
        for level in LEVELS {
            assert_eq!(SynchronousCommit::parse(level.name()), Ok(level));
            assert_eq!(
                SynchronousCommit::parse(&level.name().to_uppercase()),
                Ok(level)
            );
            assert_eq!(
                level.option(),
                format!("-c synchronous_commit={}", level.name())
            );
        }
        assert!(LEVELS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn an_unknown_level_names_itself_and_the_levels() {
        let e = SynchronousCommit::parse("always").unwrap_err();
        assert_eq!(
            e,
            "\"always\" is not a synchronous_commit level (one of off, local, remote_write, on, remote_apply)"
        );
        assert!(SynchronousCommit::parse("on -c fsync=off").is_err());
        assert!(SynchronousCommit::parse("").is_err());
    }
}
