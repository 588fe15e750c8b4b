//! The checks `pepsi-dispatch check` makes as the stage workers connect (§4
//! "Containment"): through their own connection (`WORKER_CONNECTION`), and, when the
//! dispatcher runs them as `[pepsi] WORKER_AS`, as that account — with peer
//! authentication the database sees the account, and only it may log in as the
//! workers' role. Started as root, `check` runs these in a child that switches to the
//! account before its parent switches to `RUN_AS` ([`in_account`]); the child hands
//! its findings back through a pipe.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};

use super::{
    Findings, address_settings, check_schemas, checked_sections, read_database, with_rows,
};
use crate::config::Section;
use crate::config::graph::{self, OverrideRow, ProgramPath, StageGraph};

/// The workers' database checks: their connection, the schema as they see it, the
/// overlay they read (with `extra` laid over it), and the per-address settings they
/// would load, against the stage sections those give.
pub(super) fn worker_database(
    worker: &(&str, String),
    stage_sections: &[Section],
    programs: &ProgramPath,
    extra: &[OverrideRow],
    max_runtime: Option<std::time::Duration>,
    found: &mut Findings,
) {
    let (overlay, client) = read_database(worker, found);
    let Some(mut client) = client else {
        return;
    };
    check_schemas(&mut client, found);
    let overlay = with_rows(overlay, extra.to_vec());
    let laid = graph::lay_over(stage_sections, &overlay, programs);
    let checked = checked_sections(&laid);
    let graph = StageGraph::build(stage_sections, &overlay, programs).ok();
    address_settings::check_settings(
        &mut client,
        &laid.sections,
        &checked,
        graph.as_ref(),
        max_runtime,
        found,
    );
}

/// Runs `checks` as the account `name` in a child process and returns what it found.
/// Call it as root, while this process has one thread.
pub(super) fn in_account(name: &str, checks: impl FnOnce(&mut Findings)) -> Findings {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return failed(name, &std::io::Error::last_os_error().to_string());
    }
    // SAFETY: fresh descriptors, ours alone.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the caller's promise: one thread, so the child may run any code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return failed(name, &std::io::Error::last_os_error().to_string());
    }
    if pid == 0 {
        drop(read);
        let mut found = Findings::default();
        match crate::privilege::drop_to(name) {
            Ok(_) => checks(&mut found),
            Err(e) => found
                .errors
                .push(format!("[pepsi] WORKER_AS: {}", e.message)),
        }
        let document = serde_json::json!({
            "errors": found.errors,
            "warnings": found.warnings,
            "unreachable": found.unreachable,
        });
        let _ = std::fs::File::from(write).write_all(document.to_string().as_bytes());
        // SAFETY: ending the forked child without the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    drop(write);
    let mut text = String::new();
    let read_ok = std::fs::File::from(read).read_to_string(&mut text).is_ok();
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let parsed = serde_json::from_str::<serde_json::Value>(&text).ok();
    let list = |v: &serde_json::Value, key: &str| -> Vec<String> {
        v[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    match parsed {
        Some(v) if read_ok => Findings {
            errors: list(&v, "errors"),
            warnings: list(&v, "warnings"),
            unreachable: v["unreachable"].as_u64().unwrap_or(0) as usize,
        },
        _ => failed(name, "the check as that account ended without its findings"),
    }
}

/// The finding of a child that could not run.
fn failed(name: &str, why: &str) -> Findings {
    Findings {
        errors: vec![format!(
            "database (as WORKER_AS {name}): not checked: {why}"
        )],
        warnings: Vec::new(),
        unreachable: 0,
    }
}
