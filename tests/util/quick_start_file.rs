//! The quick start's configuration file, as an operator makes it: the shipped example
//! (`packaging/pepsi.conf`) edited by the shell commands the README's quick start (and
//! doc/postfix.md, for the Postfix recipe) give. Used by `tests/readme.rs` (the result
//! checks) and the Postfix loop (`suite/postfix.rs`: the result delivers).

use std::path::{Path, PathBuf};

/// The commands of a text that edit `/etc/pepsi/pepsi.conf` (`sed -i …`, and lines
/// that append to it), each whole (continued lines joined), in order.
pub fn config_edits(text: &[String]) -> Vec<String> {
    let mut edits = Vec::new();
    let mut current = String::new();
    for line in text {
        let line = line.trim();
        if current.is_empty() && !line.starts_with("sed -i") && !line.starts_with("printf ") {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(start) => current.push_str(start),
            None => {
                current.push_str(line);
                if current.contains("/etc/pepsi/pepsi.conf") {
                    edits.push(std::mem::take(&mut current));
                }
                current.clear();
            }
        }
    }
    edits
}

/// Runs `edits` (shell commands) on a copy of the shipped example configuration and
/// returns the copy's path (in `dir`).
pub fn edited_example(dir: &Path, edits: &[String]) -> PathBuf {
    let copy = dir.join("pepsi.conf");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/pepsi.conf"),
        &copy,
    )
    .unwrap();
    for edit in edits {
        let edit = edit.replace("/etc/pepsi/pepsi.conf", copy.to_str().unwrap());
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&edit)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{edit}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    copy
}
