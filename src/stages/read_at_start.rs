//! What a stage's worker reads from a file when it starts ([`Stage::start`]): the key
//! tables of `dkim-sign` and the secrets of `srs`, kept by path for the messages of any
//! section that names that path. The keys that name such files are never overridable,
//! per address or by the overlay, so a message's section names a file that was read.
//!
//! Used by `dkim/mod.rs`, `srs/mod.rs` and the relay; it reads no file but through
//! [`read_private`] (each stage reads and checks its own) and must not know what the
//! values are.
//!
//! [`Stage::start`]: crate::worker::Stage::start

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::worker::StageError;

/// Reads a file only its owner may read (`srs`'s secrets, the relay's `AUTH_FILE`):
/// a regular file of at most `max` bytes, with no permission for its group or others.
/// Errors start with `what` and the path (missing, unreadable, not a regular file, open
/// to others: `chmod 600`, too large) and hold nothing of the content.
pub fn read_private(path: &Path, what: &str, max: u64) -> Result<Vec<u8>, String> {
    let name = path.display();
    // Non-blocking, so that a FIFO planted at the path fails the checks below instead
    // of holding the open; a regular file reads the same either way.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => format!("{what} {name}: no such file"),
            _ => format!("{what} {name}: cannot be opened: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{what} {name}: cannot be read: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{what} {name}: not a regular file"));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o044 != 0 {
        return Err(format!(
            "{what} {name}: readable by others (mode {mode:04o}): chmod 600"
        ));
    }
    if mode & 0o077 != 0 {
        return Err(format!(
            "{what} {name}: open to its group or others (mode {mode:04o}): chmod 600"
        ));
    }
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{what} {name}: cannot be read: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(format!("{what} {name}: larger than {max} bytes"));
    }
    Ok(bytes)
}

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
