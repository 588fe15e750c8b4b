//! Logging to stderr with `env_logger` (SPEC §11).
//!
//! The default level is info; `-L` sets it. Without `-v` only Pepsi's own modules log,
//! so a chatty dependency does not flood the journal. Under systemd (`JOURNAL_STREAM`
//! set) the journal stamps the time itself, so the line carries none.

use std::io::Write;

use crate::cli::Globals;

/// Installs the logger. Safe to call once per process; later calls are ignored.
pub fn init(globals: &Globals) {
    let mut builder = env_logger::Builder::new();
    builder.target(env_logger::Target::Stderr);
    if globals.verbose {
        builder.filter_level(globals.log_level);
    } else {
        builder.filter_level(log::LevelFilter::Off);
        builder.filter_module("pepsi", globals.log_level);
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
        if journal {
            writeln!(
                buf,
                "{program}[{pid}] {}: {}",
                record.level(),
                record.args()
            )
        } else {
            writeln!(
                buf,
                "{} {program}[{pid}] {}: {}",
                buf.timestamp_millis(),
                record.level(),
                record.args()
            )
        }
    });
    let _ = builder.try_init();
}
