//! `SECRETS_FILE` (§19): the secrets the `srs` stage signs and verifies with, one per
//! line, the first signs and all verify (rotation: put the new secret first and keep
//! the old one below it for `MAX_AGE` days). Read by the `srs` stage at start with
//! [`load`]; the secrets go to [`super::scheme::Srs::new`]. It reads one file and
//! decides nothing else; it must not log a secret nor put one in an error.
//!
//! A line is read as postsrsd 1.10 reads its secret file (`postsrsd.c`, `main`: `fgets`
//! into a 1024-byte buffer, then `strtok` on `"\r\n"`), so both read the same secrets
//! from the same file:
//! - lines end at `\n`; the last line needs none;
//! - the secret is the first run of bytes other than `\r` on its line: leading `\r`s
//!   are skipped and the secret ends at the next `\r` (a CRLF line's `\r` is dropped;
//!   anything after a `\r` inside a line is ignored, as postsrsd ignores it);
//! - spaces and tabs are part of the secret (nothing is trimmed);
//! - a line with no such byte (empty, or only `\r`) is ignored.
//!
//! Refused, where postsrsd would read something else than the line: a NUL byte (its
//! secret ends there) and a line longer than 1023 bytes (postsrsd reads it as two
//! secrets). The file must be a regular file of at most [`MAX_FILE`] bytes with no
//! permission for its group or others, and hold at least one secret.

use std::path::Path;

use crate::stages::read_at_start::read_private;

/// The largest secrets file read, in bytes: a few secrets are a few lines.
pub const MAX_FILE: u64 = 64 * 1024;

/// The longest line postsrsd reads as one secret (its buffer of 1024 bytes, less the
/// terminating NUL).
pub const MAX_LINE: usize = 1023;

/// Reads `SECRETS_FILE`: its secrets in order, the first signs. Errors name the file:
/// missing, unreadable, not a regular file, open to its group or others
/// (`chmod 600`), too large, a line postsrsd would read differently, or no secret.
pub fn load(path: &Path) -> Result<Vec<Vec<u8>>, String> {
    let name = path.display();
    let bytes = read_private(path, "secrets file", MAX_FILE).map_err(|e| {
        if e.ends_with(" bytes") {
            format!("{e}; it holds one secret a line")
        } else {
            e
        }
    })?;
    parse(&bytes).map_err(|why| format!("secrets file {name}: {why}"))
}

/// The secrets of a file's bytes, in order; why not (a line by its number).
fn parse(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut secrets = Vec::new();
    for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let number = n + 1;
        if line.contains(&0) {
            return Err(format!(
                "line {number} holds a NUL byte, where postsrsd would end the secret"
            ));
        }
        if line.len() > MAX_LINE {
            return Err(format!(
                "line {number} is longer than {MAX_LINE} bytes, which postsrsd reads as \
                 two secrets"
            ));
        }
        if let Some(secret) = line.split(|&b| b == b'\r').find(|run| !run.is_empty()) {
            secrets.push(secret.to_vec());
        }
    }
    if secrets.is_empty() {
        return Err("holds no secret (one secret a line)".into());
    }
    Ok(secrets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A file of these bytes and mode in a directory of its own, removed on drop.
    struct Scratch {
        dir: PathBuf,
        file: PathBuf,
    }

    impl Scratch {
        fn new(bytes: &[u8], mode: u32) -> Scratch {
            static COUNT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "pepsi-srs-secrets-{}-{}",
                std::process::id(),
                COUNT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            let file = dir.join("secrets");
            fs::write(&file, bytes).unwrap();
            fs::set_permissions(&file, fs::Permissions::from_mode(mode)).unwrap();
            Scratch { dir, file }
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn secrets_are_read_in_order_so_the_first_signs_and_the_rest_verify() {
        let f = Scratch::new(b"new-secret\nold-secret\n", 0o600);
        assert_eq!(
            load(&f.file),
            Ok(vec![b"new-secret".to_vec(), b"old-secret".to_vec()])
        );
        let f = Scratch::new(b"only", 0o400);
        assert_eq!(
            load(&f.file),
            Ok(vec![b"only".to_vec()]),
            "no final newline"
        );
    }

    #[test]
    fn lines_are_read_as_postsrsd_reads_them() {
        let f = Scratch::new(
            b"\n\r\n crlf with spaces \r\n\r\rafter-crs\nab\rignored\n\t\n\xff\xfe\n",
            0o600,
        );
        assert_eq!(
            load(&f.file),
            Ok(vec![
                b" crlf with spaces ".to_vec(),
                b"after-crs".to_vec(),
                b"ab".to_vec(),
                b"\t".to_vec(),
                b"\xff\xfe".to_vec(),
            ])
        );
        let longest = vec![b's'; MAX_LINE];
        let f = Scratch::new(&[&longest[..], b"\n"].concat(), 0o600);
        assert_eq!(load(&f.file), Ok(vec![longest]));
    }

    #[test]
    fn a_missing_file_is_named() {
        let f = Scratch::new(b"x\n", 0o600);
        let missing = f.dir.join("nonesuch");
        let err = load(&missing).unwrap_err();
        assert_eq!(
            err,
            format!("secrets file {}: no such file", missing.display())
        );
    }

    #[test]
    fn a_file_without_a_secret_is_refused() {
        for bytes in [&b""[..], b"\n", b"\r\n\r\n", b"\n\n\r"] {
            let f = Scratch::new(bytes, 0o600);
            assert_eq!(
                load(&f.file),
                Err(format!(
                    "secrets file {}: holds no secret (one secret a line)",
                    f.file.display()
                )),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn a_file_open_to_group_or_others_is_refused_with_chmod_600() {
        for (mode, why) in [
            (0o644, "readable by others (mode 0644): chmod 600"),
            (0o640, "readable by others (mode 0640): chmod 600"),
            (0o604, "readable by others (mode 0604): chmod 600"),
            (0o620, "open to its group or others (mode 0620): chmod 600"),
            (0o601, "open to its group or others (mode 0601): chmod 600"),
        ] {
            let f = Scratch::new(b"secret\n", mode);
            assert_eq!(
                load(&f.file),
                Err(format!("secrets file {}: {why}", f.file.display()))
            );
        }
    }

    #[test]
    fn a_file_that_cannot_be_opened_is_named_with_the_reason() {
        let f = Scratch::new(b"secret\n", 0o600);
        // A path through a regular file: refused whoever asks, root included.
        let through = f.file.join("secrets");
        let err = load(&through).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "secrets file {}: cannot be opened: ",
                through.display()
            )),
            "{err}"
        );
        assert!(err.contains("Not a directory"), "{err}");
    }

    #[test]
    fn a_directory_a_fifo_and_an_oversized_file_are_refused() {
        let f = Scratch::new(b"x\n", 0o600);
        let err = load(&f.dir).unwrap_err();
        assert!(err.ends_with("not a regular file"), "{err}");

        let fifo = f.dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = load(&fifo).unwrap_err();
        assert!(err.ends_with("not a regular file"), "{err}");

        let big = vec![b'\n'; MAX_FILE as usize + 1];
        let f = Scratch::new(&big, 0o600);
        let err = load(&f.file).unwrap_err();
        assert!(err.contains("larger than 65536 bytes"), "{err}");
    }

    #[test]
    fn a_nul_byte_or_a_line_postsrsd_would_split_is_refused_by_its_number() {
        let f = Scratch::new(b"first\nsec\0ret\n", 0o600);
        let err = load(&f.file).unwrap_err();
        assert!(err.ends_with("line 2 holds a NUL byte, where postsrsd would end the secret"));
        let long = [&b"ok\n"[..], &vec![b's'; MAX_LINE + 1]].concat();
        let f = Scratch::new(&long, 0o600);
        let err = load(&f.file).unwrap_err();
        assert!(err.contains("line 2 is longer than 1023 bytes"), "{err}");
        assert!(!err.contains("sss"), "no secret in an error: {err}",);
    }
}
