//! Logging to stderr with `env_logger` (§11).
//!
//! The default level is info; `-L` sets it. Without `-v` only Pepsi's own modules log,
//! so a chatty dependency does not flood the journal. Under systemd (`JOURNAL_STREAM`
//! set) the journal stamps the time itself, so the line carries none; instead it starts
//! with the syslog priority `<N>` (so `journalctl -p err` filters), and a message of
//! several lines is kept on one (the journal makes an entry of every line).
//!
//! Values from messages and the database are escaped where a line is written
//! ([`crate::escape::Visible`]: a sender's line break shows as `\n`). Behind that, this
//! formatter shows every control and invisible formatting character of a message
//! escaped but its line feeds ([`VisibleLines`]), so nothing a log line carries can
//! drive a terminal or hide text.
//!
//! [`crate::cli`]'s `start` calls [`init`] with the `-L` level and `-v` it parsed; the
//! threads that repeat a warning pace it with [`Every`]. It uses nothing of the crate
//! but [`crate::escape`]: it knows nothing of the command line or the configuration.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::escape::VisibleLines;

/// A rate limit for a repeated log line: `due()` is true at most once per gap.
pub struct Every {
    gap: Duration,
    last: Option<Instant>,
}

impl Every {
    /// At most once a minute.
    pub fn minute() -> Every {
        Every {
            gap: Duration::from_secs(60),
            last: None,
        }
    }

    /// Is the line due (and is it now said)?
    pub fn due(&mut self) -> bool {
        let now = Instant::now();
        if self.last.is_some_and(|t| t + self.gap > now) {
            return false;
        }
        self.last = Some(now);
        true
    }

    /// The condition ended: the next occurrence is said at once.
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// The syslog priority of a level (sd-daemon(3)): err 3, warning 4, info 6, debug 7.
fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// A journal line: the priority prefix, and the message's line breaks as " | ".
fn journal_line(program: &str, pid: u32, level: log::Level, message: &str) -> String {
    format!(
        "<{}>{program}[{pid}] {level}: {}",
        priority(level),
        message.trim_end().replace('\n', " | ")
    )
}

/// Installs the logger at `level` (`-L`), for every module's messages when `verbose`
/// (`-v`), else for Pepsi's own only. Safe to call once per process; later calls are
/// ignored.
pub fn init(level: log::LevelFilter, verbose: bool) {
    let mut builder = env_logger::Builder::new();
    builder.target(env_logger::Target::Stderr);
    if verbose {
        builder.filter_level(level);
    } else {
        builder.filter_level(log::LevelFilter::Off);
        builder.filter_module("pepsi", level);
    }
    let program = std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "pepsi".to_string());
    let pid = std::process::id();
    let journal = std::env::var_os("JOURNAL_STREAM").is_some();
    builder.format(move |buf, record| {
        let message = record.args().to_string();
        let message = VisibleLines(&message);
        if journal {
            writeln!(
                buf,
                "{}",
                journal_line(&program, pid, record.level(), &message.to_string())
            )
        } else {
            writeln!(
                buf,
                "{} {program}[{pid}] {}: {message}",
                buf.timestamp_millis(),
                record.level(),
            )
        }
    });
    let _ = builder.try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_line_has_its_priority_and_stays_one_line() {
        assert_eq!(
            journal_line(
                "pepsi-dispatch",
                7,
                log::Level::Error,
                "bad:\n/x.conf:3: no\n"
            ),
            "<3>pepsi-dispatch[7] ERROR: bad: | /x.conf:3: no"
        );
        assert!(journal_line("p", 1, log::Level::Warn, "w").starts_with("<4>"));
        assert!(journal_line("p", 1, log::Level::Info, "i").starts_with("<6>"));
        assert!(journal_line("p", 1, log::Level::Debug, "d").starts_with("<7>"));
    }

    #[test]
    fn every_says_a_line_once_per_gap_until_reset() {
        let mut e = Every::minute();
        assert!(e.due());
        assert!(!e.due());
        e.reset();
        assert!(e.due());
    }
}
