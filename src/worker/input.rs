//! Reading assignments from stdin, `ID TOKEN` per line (see [`crate::protocol`]), with
//! the greedy batch take of §12.3: block for the first, then take every further line
//! already buffered or readable without blocking, up to a limit, so a lone id is
//! handled at once.
//!
//! Reads the raw file descriptor (no `std::io::Stdin` buffer in between) so that
//! "readable without blocking" can be asked of the kernel with `poll`.
//!
//! Owns the read buffer of stdin; used by `runtime.rs` (which hands it to the serve
//! loop) and `batch.rs`, and by test worker programs. A leaf: it uses no other file of
//! the worker, must not write to stdout and knows nothing of messages or the database.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

use crate::protocol::{Assignment, parse_assignment};

/// Reads assignment lines from a file descriptor.
pub struct IdReader {
    file: std::mem::ManuallyDrop<std::fs::File>,
    fd: RawFd,
    buf: Vec<u8>,
    eof: bool,
}

/// A line that is not an assignment.
#[derive(Debug)]
pub enum InputError {
    /// Reading failed.
    Io(io::Error),
    /// The line is not `ID TOKEN`.
    NotAnAssignment(String),
}

impl std::fmt::Display for InputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InputError::Io(e) => write!(f, "cannot read stdin: {e}"),
            InputError::NotAnAssignment(l) => write!(
                f,
                "stdin line {:?} is not a message id and its claim token",
                crate::escape::Visible(l)
            ),
        }
    }
}

impl IdReader {
    /// Reads the process's stdin.
    pub fn stdin() -> IdReader {
        IdReader::from_fd(io::stdin().as_raw_fd())
    }

    /// Reads an inherited descriptor, which stays open after the reader is dropped.
    pub fn from_fd(fd: RawFd) -> IdReader {
        IdReader {
            // SAFETY: the descriptor is valid for the life of the process; ManuallyDrop
            // keeps the File from closing it.
            file: std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) }),
            fd,
            buf: Vec::with_capacity(4096),
            eof: false,
        }
    }

    fn complete_lines(&self) -> usize {
        self.buf.iter().filter(|&&b| b == b'\n').count()
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.file.read(&mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn readable_now(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0
    }

    /// The next batch of up to `max` assignments (at least one), or `None` at end of
    /// input.
    pub fn next_batch(&mut self, max: usize) -> Result<Option<Vec<Assignment>>, InputError> {
        while self.complete_lines() == 0 && !self.eof {
            self.fill().map_err(InputError::Io)?;
        }
        if self.complete_lines() == 0 {
            // End of input: a last id without its newline still counts.
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                return Ok(None);
            }
            self.buf.push(b'\n');
        }
        while self.complete_lines() < max && !self.eof && self.readable_now() {
            self.fill().map_err(InputError::Io)?;
        }
        let mut ids = Vec::new();
        while ids.len() < max {
            let Some(end) = self.buf.iter().position(|&b| b == b'\n') else {
                break;
            };
            let line: Vec<u8> = self.buf.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line);
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            match parse_assignment(text) {
                Some(a) => ids.push(a),
                // The ids before it are answered first; the next call reports it.
                None if !ids.is_empty() => {
                    self.buf.splice(0..0, line);
                    break;
                }
                None => return Err(InputError::NotAnAssignment(text.to_string())),
            }
        }
        if ids.is_empty() {
            // Only blank lines so far: wait for the next.
            return self.next_batch(max);
        }
        Ok(Some(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The ids of a batch.
    fn ids(batch: Result<Option<Vec<Assignment>>, InputError>) -> Option<Vec<i64>> {
        batch.unwrap().map(|b| b.iter().map(|a| a.id).collect())
    }

    fn pipe() -> (IdReader, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the write end is ours.
        let w = unsafe { std::fs::File::from_raw_fd(fds[1]) };
        (IdReader::from_fd(fds[0]), w)
    }

    #[test]
    fn takes_what_is_buffered_up_to_the_limit() {
        let (mut r, mut w) = pipe();
        w.write_all(b"1 11\n2 12\n3 13\n4 14\n5 15\n").unwrap();
        assert_eq!(ids(r.next_batch(4)), Some(vec![1, 2, 3, 4]));
        assert_eq!(ids(r.next_batch(4)), Some(vec![5]));
        w.write_all(b"6 16\n").unwrap();
        assert_eq!(
            ids(r.next_batch(4)),
            Some(vec![6]),
            "a lone id is taken at once"
        );
        w.write_all(b"\n7 -17").unwrap();
        drop(w);
        assert_eq!(
            r.next_batch(4).unwrap(),
            Some(vec![Assignment { id: 7, token: -17 }])
        );
        assert_eq!(r.next_batch(4).unwrap(), None);
        // SAFETY: closing our read end.
        unsafe { libc::close(r.fd) };
    }

    #[test]
    fn an_id_without_its_token_is_an_error() {
        let (mut r, mut w) = pipe();
        w.write_all(b"8\n").unwrap();
        assert!(matches!(r.next_batch(4), Err(InputError::NotAnAssignment(l)) if l == "8"));
        // SAFETY: closing our read end.
        unsafe { libc::close(r.fd) };
    }

    #[test]
    fn a_garbage_line_is_an_error_after_the_ids_before_it() {
        let (mut r, mut w) = pipe();
        w.write_all(b"5 1\n6 1\n12x 1\n7 1\n8\n").unwrap();
        assert_eq!(ids(r.next_batch(4)), Some(vec![5, 6]));
        assert!(matches!(r.next_batch(4), Err(InputError::NotAnAssignment(l)) if l == "12x 1"));
        // SAFETY: closing our read end.
        unsafe { libc::close(r.fd) };
    }
}
