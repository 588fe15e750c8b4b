//! Random values from the system's random source: [`hex`], for what nobody may guess
//! or plant beforehand (a report's MIME boundary, a report's Message-ID) and for a
//! random start among a connection string's hosts; [`u64`] for a DNS query's id and
//! the order of equally preferred mail exchangers.
//!
//! Used by the bounce stage's reports (`stages::dsn`, `stages::bounce`) and by
//! `db::hosts`, and by `stages::internet`. Below everything: it uses nothing of this crate.

use std::time::SystemTime;

/// `bytes` random bytes from the system's random source (`getrandom`), in hex.
pub fn hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    fill(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random number from the system's random source: a DNS query's id, a shuffle.
pub fn u64() -> u64 {
    let mut buf = [0u8; 8];
    fill(&mut buf);
    u64::from_le_bytes(buf)
}

/// Fills `buf` from the system's random source (`getrandom`).
fn fill(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: getrandom writes at most the given length into our buffer.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // No random source at all: the time, which is all there is.
            let t = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            for (i, b) in buf.iter_mut().enumerate().skip(filled) {
                *b = (t >> ((i % 16) * 8)) as u8;
            }
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_drawn_not_made() {
        let one = hex(16);
        assert_eq!(one.len(), 32);
        assert!(one.bytes().all(|b| b.is_ascii_hexdigit()), "{one}");
        assert_ne!(one, hex(16), "drawn, not made");
        assert_ne!(u64(), u64(), "drawn, not made");
    }
}
