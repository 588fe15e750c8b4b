//! What a stage's worker reads from a file when it starts ([`Stage::start`]): the key
//! tables of `dkim-sign` and the secrets of `srs`, kept by path for the messages of any
//! section that names that path. The keys that name such files are never overridable,
//! per address or by the overlay, so a message's section names a file that was read.
//!
//! Used by `dkim/mod.rs` and `srs/mod.rs`; it reads no file itself (each stage reads
//! and checks its own) and must not know what the values are.
//!
//! [`Stage::start`]: crate::worker::Stage::start

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::worker::StageError;

/// The values read from files at start, by path.
pub struct ReadAtStart<T> {
    /// The key that names the files (`KEY_TABLE`), for the error of a file not read.
    key: &'static str,
    values: Mutex<Vec<(PathBuf, Arc<T>)>>,
}

impl<T> ReadAtStart<T> {
    /// Nothing read yet, of files named by `key`.
    pub const fn new(key: &'static str) -> ReadAtStart<T> {
        ReadAtStart {
            key,
            values: Mutex::new(Vec::new()),
        }
    }

    /// Keeps what was read from `path` (again: the newer reading).
    pub fn put(&self, path: PathBuf, value: T) {
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        values.retain(|(p, _)| *p != path);
        values.push((path, Arc::new(value)));
    }

    /// What was read from `path` at start; a host error when nothing was (a section
    /// this worker did not start with).
    pub fn get(&self, path: &Path) -> Result<Arc<T>, StageError> {
        let values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        values
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| Arc::clone(v))
            .ok_or_else(|| {
                StageError::host(format!(
                    "{} {} was not read when the worker started",
                    self.key,
                    path.display()
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_found_by_its_path_a_newer_reading_wins_and_an_unread_path_is_a_host_error() {
        let read: ReadAtStart<u32> = ReadAtStart::new("KEY_TABLE");
        read.put("/a".into(), 1);
        read.put("/b".into(), 2);
        read.put("/a".into(), 3);
        assert_eq!(*read.get(Path::new("/a")).unwrap(), 3);
        assert_eq!(*read.get(Path::new("/b")).unwrap(), 2);
        let e = read.get(Path::new("/c")).err().unwrap();
        assert_eq!(e.class, crate::worker::ErrorClass::Host);
        assert_eq!(
            e.message,
            "KEY_TABLE /c was not read when the worker started"
        );
    }
}
