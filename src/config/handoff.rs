//! What a stage worker is handed of the configuration (§4 "Containment"): workers
//! run under an account of their own that cannot read `pepsi.conf`, so the dispatcher
//! gives each one the file's text with everything a worker does not need blanked out —
//! every line outside `[pepsi]` and the `[stage-*]` sections, every comment, and of
//! `[pepsi-postgres]` every key but the workers' own connection and
//! `WORKER_SYNCHRONOUS_COMMIT`. The other connection strings (the schema owner's, the
//! dispatcher's, with their passwords) never reach a worker. When the file sets no
//! `WORKER_CONNECTION` and the workers run as an account of their own, their
//! connection is made from `CONNECTION` (see `PostgresOptions::worker_connection`):
//! it is added at the end, after the file's last line, and `CONNECTION` is blanked.
//!
//! A blanked line stays as an empty line, so every line a worker reads keeps its number
//! and a worker's message names the file's own line. Pure: text in, text out; the
//! dispatcher reads the file and passes the result on ([`crate::dispatch`]).

use super::fixed;

/// The worker's copy of configuration text (see the module documentation): as many
/// lines as `text`, each either as it was or empty, and, with `made`, the workers'
/// connection made from `CONNECTION` on lines of its own after them.
pub fn for_workers(text: &str, made: Option<&str>) -> String {
    // The key that holds the workers' connection: their own when the file sets it,
    // else the shared one, unless theirs is made from it.
    let own = sets_key(text, "pepsi-postgres", fixed::WORKER_CONNECTION.name);
    let worker_key = if own {
        fixed::WORKER_CONNECTION.name
    } else if made.is_some() {
        ""
    } else {
        fixed::CONNECTION.name
    };
    let mut section: Option<&str> = None;
    let mut out = String::with_capacity(text.len());
    for (i, raw) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let line = raw.trim();
        if let Some(name) = header(line) {
            section = Some(name);
            if kept_section(name) {
                out.push_str(raw);
            }
            continue;
        }
        let keep = match (section, key(line)) {
            (Some("pepsi-postgres"), Some(k)) => {
                k == worker_key || k == fixed::WORKER_SYNCHRONOUS_COMMIT.name
            }
            (Some(s), Some(_)) => kept_section(s),
            // Comments (which may hold an old password), blank lines and lines that
            // do not parse (the dispatcher refuses those already).
            _ => false,
        };
        if keep {
            out.push_str(raw);
        }
    }
    if let (false, Some(connection)) = (own, made) {
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!(
            "[pepsi-postgres]\n{} = {connection}\n",
            fixed::WORKER_CONNECTION.name
        ));
    }
    out
}

/// Is this a section a worker gets whole?
fn kept_section(name: &str) -> bool {
    name == "pepsi" || name == "pepsi-postgres" || name.starts_with(super::raw::STAGE_PREFIX)
}

/// The name of a `[section]` header line (trimmed), as the parse reads it.
fn header(line: &str) -> Option<&str> {
    line.strip_prefix('[')?.strip_suffix(']').map(str::trim)
}

/// The key of a `KEY = value` line (trimmed), as the parse reads it; `None` for a
/// comment or a line without `=`.
fn key(line: &str) -> Option<&str> {
    if line.starts_with('#') {
        return None;
    }
    line.split_once('=').map(|(k, _)| k.trim())
}

/// Does `text` set `key` in `section`?
fn sets_key(text: &str, section: &str, key_name: &str) -> bool {
    let mut current = None;
    for line in text.lines().map(str::trim) {
        if let Some(name) = header(line) {
            current = Some(name);
        } else if current == Some(section) && key(line) == Some(key_name) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# Pepsi\n\
        [pepsi]\n\
        RUN_AS = pepsi\n\
        \n\
        [pepsi-postgres]\n\
        # old: CONNECTION = host=db password=hunter1\n\
        CONNECTION = host=db user=pepsi password=owner-secret\n\
        WORKER_CONNECTION = host=db user=pepsi-worker\n\
        DISPATCH_CONNECTION = host=db user=d password=dispatch-secret\n\
        WORKER_SYNCHRONOUS_COMMIT = yes\n\
        [pepsi-ingress]\n\
        STAGE = filter\n\
        [stage-filter]\n\
        PROGRAM = pepsi-stage-if\n\
        MATCH = subject contains \"=\"\n\
        [pepsi-dispatch]\n\
        MAX_RUNTIME = 5m\n\
        [pepsi]\n\
        HOSTNAME = mx.example\n";

    #[test]
    fn a_worker_gets_its_sections_and_its_own_connection_on_their_own_lines() {
        let handed = for_workers(FILE, Some("host=db user=made"));
        let lines: Vec<&str> = handed.split('\n').collect();
        assert_eq!(lines.len(), FILE.split('\n').count(), "{handed}");
        let kept: Vec<(usize, &str)> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(i, l)| (i + 1, *l))
            .collect();
        assert_eq!(
            kept,
            [
                (2, "[pepsi]"),
                (3, "RUN_AS = pepsi"),
                (5, "[pepsi-postgres]"),
                (8, "WORKER_CONNECTION = host=db user=pepsi-worker"),
                (10, "WORKER_SYNCHRONOUS_COMMIT = yes"),
                (13, "[stage-filter]"),
                (14, "PROGRAM = pepsi-stage-if"),
                (15, "MATCH = subject contains \"=\""),
                (18, "[pepsi]"),
                (19, "HOSTNAME = mx.example"),
            ]
        );
        for secret in [
            "hunter1",
            "owner-secret",
            "dispatch-secret",
            "STAGE = filter",
        ] {
            assert!(!handed.contains(secret), "{secret}: {handed}");
        }
    }

    #[test]
    fn without_a_connection_of_their_own_workers_get_the_shared_one_or_one_made_from_it() {
        let file = "[pepsi-postgres]\nCONNECTION = host=db password=owner\nADMIN_CONNECTION = x\n";
        assert_eq!(
            for_workers(file, None),
            "[pepsi-postgres]\nCONNECTION = host=db password=owner\n\n"
        );
        // Running as an account of their own, theirs is made from it: the owner's
        // is blanked, the made one follows the file's last line.
        assert_eq!(
            for_workers(file, Some("host=db password=owner user='pepsi-worker'")),
            "[pepsi-postgres]\n\n\n[pepsi-postgres]\nWORKER_CONNECTION = host=db password=owner user='pepsi-worker'\n"
        );
    }

    #[test]
    fn the_handed_text_reads_as_the_same_worker_configuration() {
        let path = std::path::Path::new("/etc/pepsi/pepsi.conf");
        let handed = crate::config::raw::parse(path, &for_workers(FILE, None)).unwrap();
        let full = crate::config::raw::parse(path, FILE).unwrap();
        let stage = |s: &[crate::config::Section]| {
            s.iter()
                .find(|s| s.name == "stage-filter")
                .cloned()
                .unwrap()
        };
        assert_eq!(stage(&handed), stage(&full), "values and their lines alike");
    }
}
