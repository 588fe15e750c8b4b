//! `[pepsi] PROGRAM_PATH` and the one rule about what an overlay may run (§4
//! "Least privilege" and "Containment"): an overlay `PROGRAM` must be a built-in stage
//! program or an absolute path under one of its directories, unless a stage section of
//! the file names that very program; and the overlay may never set the keys that say
//! what a program runs or as whom (`COMMAND`, `USER`). [`overlay_refusal`] is that
//! rule; [`super::graph::lay_over`] applies it, and so `pepsi-dispatch check`, a
//! reload and `pepsi-queue config set` judge a row with the same function.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use super::raw::{STAGE_PREFIX, Section};

/// `[pepsi] PROGRAM_PATH`'s default: the built-in stage programs and the package's
/// stage directory, the place for a site's own stage programs (`/usr/lib/pepsi`).
pub const DEFAULT_PROGRAM_PATH: &str = "builtin:/usr/lib/pepsi";

/// The entry of `PROGRAM_PATH` that stands for the built-in stage programs.
pub const BUILTIN_ENTRY: &str = "builtin";

/// The built-in stages' names (`pass` for `pepsi-stage-pass`): the programs the
/// `builtin` entry of `PROGRAM_PATH` allows. The stage registry (`stages::BUILTINS`) is
/// checked against this list by a test.
pub const BUILTIN_STAGES: &[&str] = &[
    "pass",
    "if",
    "discard",
    "exec",
    "bounce",
    "relay",
    "relay-to-internet",
    "dkim-sign",
    "srs",
];

/// The file-name prefix of a stage program (`pepsi-stage-NAME`).
pub const STAGE_PROGRAM_PREFIX: &str = "pepsi-stage-";

/// The keys an overlay row may never set, whatever the stage (§4 "Containment"):
/// what an exec stage runs and the account it runs as, and the files a stage reads its
/// keys and secrets from as its account (`dkim-sign`'s `KEY_TABLE`, `srs`'s
/// `SECRETS_FILE`: an overlay writer who named a file it knows the content of would
/// sign mail with its own key, or forge SRS addresses that make the forwarder relay
/// for anyone), and the relay's transport security (`TLS`, `TLS_WRAPPER`, `TLS_NAME`,
/// `CA_FILE`: lowered or pointed at a trust store of its own, mail would go in clear
/// or to whoever it likes; `AUTH_FILE`: the login; relay-to-internet's `TLS_POLICY`,
/// which raises a destination to `verify`). The file alone says those.
pub const FILE_ONLY_KEYS: &[&str] = &[
    "COMMAND",
    "USER",
    "KEY_TABLE",
    "SECRETS_FILE",
    "TLS",
    "TLS_WRAPPER",
    "TLS_NAME",
    "CA_FILE",
    "AUTH_FILE",
    "TLS_POLICY",
];

/// `[pepsi] PROGRAM_PATH`: the directories an overlay `PROGRAM` may name a program
/// under (at any depth) and, with the entry `builtin`, the built-in stage programs; or
/// none at all (`none`). Set in the file only: the overlay overrides `[stage-*]`
/// sections alone, so it cannot widen this.
///
/// A built-in stage program is `pepsi-stage-NAME` for a built-in NAME, by that bare
/// name (the dispatcher finds it on its own `PATH`, `/usr/local/bin:/usr/bin:/bin`) or
/// at an absolute path in one of those directories.
///
/// The check is by text, never by the file system: an absolute path without `..`
/// components, `.` components and repeated slashes normalised away, whose directory
/// components begin with those of one of the directories (`/usr/binx/foo` is not under
/// `/usr/bin`). A link under a listed directory is followed when the program runs, so
/// only directories that only root can write belong in the list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramPath {
    /// The directories, normalised; empty for `none`.
    dirs: Vec<PathBuf>,
    /// Are the built-in stage programs allowed (the entry `builtin`)?
    builtins: bool,
}

/// An absolute path with `.` components and repeated or trailing slashes normalised
/// away; `..` components are refused (the check is by text, and `..` after a link
/// means something else to the kernel than to the text).
fn normalised(path: &str) -> Result<PathBuf, &'static str> {
    if !path.starts_with('/') {
        return Err("it is not an absolute path");
    }
    let mut out = PathBuf::from("/");
    for component in Path::new(path).components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            Component::ParentDir => return Err("it has a \"..\" component"),
            Component::Prefix(_) => return Err("it is not an absolute path"),
        }
    }
    Ok(out)
}

impl ProgramPath {
    /// Reads a `PROGRAM_PATH` value: `none`, or `builtin` and absolute directories
    /// joined by `:`.
    pub fn parse(text: &str) -> Result<ProgramPath, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("none") {
            return Ok(ProgramPath::none());
        }
        let mut dirs = Vec::new();
        let mut builtins = false;
        for entry in text.split(':') {
            if entry.is_empty() {
                return Err(format!(
                    "{text:?} has an empty entry (directories are joined by ':'; none for no directory)"
                ));
            }
            if entry == BUILTIN_ENTRY {
                builtins = true;
                continue;
            }
            let dir = normalised(entry)
                .map_err(|why| format!("{entry:?} is not a directory for it: {why}"))?;
            if dir == Path::new("/") {
                return Err(format!(
                    "{entry:?} would allow every program; name the directories"
                ));
            }
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        Ok(ProgramPath { dirs, builtins })
    }

    /// No directory: the overlay may name only programs the file names.
    pub fn none() -> ProgramPath {
        ProgramPath {
            dirs: Vec::new(),
            builtins: false,
        }
    }

    /// The directories, normalised, in order; empty for `none`.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Is `program` a built-in stage program (when allowed) or an absolute path under
    /// one of the directories? `Err` says why not.
    pub fn check(&self, program: &str) -> Result<(), String> {
        if self.builtins && is_builtin_program(program) {
            return Ok(());
        }
        if self.dirs.is_empty() {
            return Err(if self.builtins {
                format!("it is not a built-in stage program ({self})")
            } else {
                "[pepsi] PROGRAM_PATH is none".into()
            });
        }
        let path = normalised(program)?;
        if program.ends_with('/') {
            return Err("it ends in '/', which names a directory".into());
        }
        if self
            .dirs
            .iter()
            .any(|dir| path.starts_with(dir) && path != *dir)
        {
            Ok(())
        } else {
            Err(format!("it is not under [pepsi] PROGRAM_PATH ({self})"))
        }
    }
}

impl Default for ProgramPath {
    fn default() -> ProgramPath {
        ProgramPath::parse(DEFAULT_PROGRAM_PATH).expect("the default PROGRAM_PATH parses")
    }
}

impl fmt::Display for ProgramPath {
    /// As it would be written in the file.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dirs.is_empty() && !self.builtins {
            return f.write_str("none");
        }
        let entries: Vec<String> = self
            .builtins
            .then(|| BUILTIN_ENTRY.to_string())
            .into_iter()
            .chain(self.dirs.iter().map(|d| d.display().to_string()))
            .collect();
        f.write_str(&entries.join(":"))
    }
}

/// Is `program` a built-in stage program: `pepsi-stage-NAME` for a built-in NAME, bare
/// or in one of the directories of the dispatcher's own `PATH` (which only root may
/// write)?
pub fn is_builtin_program(program: &str) -> bool {
    let (dir, name) = match program.rsplit_once('/') {
        Some((dir, name)) => (Some(dir), name),
        None => (None, program),
    };
    let builtin = name
        .strip_prefix(STAGE_PROGRAM_PREFIX)
        .is_some_and(|n| BUILTIN_STAGES.contains(&n));
    let placed = match dir {
        None => true,
        Some(dir) => normalised(&format!("{dir}/")).is_ok_and(|d| {
            crate::privilege::SERVICE_PATH
                .split(':')
                .any(|system| Path::new(system) == d)
        }),
    };
    builtin && placed
}

/// Why the overlay may not set `key` to `value`, or `None` when it may (§4
/// "Least privilege", "Containment"): never a [`FILE_ONLY_KEYS`] key (unsetting one
/// included: the file's value stays what runs); a `PROGRAM` only when empty (which
/// unsets it; the graph check decides about the section), a program a stage section of
/// the file names exactly as written, or one `programs` allows; never the `SMARTHOST`
/// of a section `section` of the file that logs in (`AUTH_FILE`: the password goes
/// only where the file sends it). Every other key may be set.
pub fn overlay_refusal(
    file: &[Section],
    programs: &ProgramPath,
    section: &str,
    key: &str,
    value: &str,
) -> Option<String> {
    if FILE_ONLY_KEYS.contains(&key) {
        return Some(format!(
            "{key} is refused: the overlay may not set what a stage runs, as whom, the \
             files it reads its keys and secrets from, or how securely it sends; only the \
             file ({}) may",
            FILE_ONLY_KEYS.join(", ")
        ));
    }
    let logs_in = file
        .iter()
        .any(|s| s.name == section && s.get("AUTH_FILE").is_some());
    if key == "SMARTHOST" && logs_in {
        return Some(format!(
            "SMARTHOST is refused: [{section}] logs in with the file's AUTH_FILE, and its \
             password goes only to the smarthost the file names"
        ));
    }
    if key != "PROGRAM" {
        return None;
    }
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    let named_by_file = file
        .iter()
        .filter(|s| s.name.starts_with(STAGE_PREFIX))
        .any(|s| s.get("PROGRAM") == Some(value));
    if named_by_file {
        return None;
    }
    let why = programs.check(value).err()?;
    Some(format!(
        "{value:?} is refused: {why}; an overlay PROGRAM must be allowed by [pepsi] \
         PROGRAM_PATH ({programs}) or be a program a [stage-*] section of the file names"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_path_takes_absolute_directories_or_none() {
        let p = ProgramPath::parse("/usr/bin:/usr/lib/pepsi/:/opt//pepsi/./bin").unwrap();
        assert_eq!(
            p.dirs(),
            [
                PathBuf::from("/usr/bin"),
                PathBuf::from("/usr/lib/pepsi"),
                PathBuf::from("/opt/pepsi/bin")
            ],
            "trailing and repeated slashes and . components are normalised"
        );
        assert_eq!(p.to_string(), "/usr/bin:/usr/lib/pepsi:/opt/pepsi/bin");
        assert_eq!(ProgramPath::default().to_string(), DEFAULT_PROGRAM_PATH);
        let b = ProgramPath::parse("/srv/stages:builtin").unwrap();
        assert_eq!(b.to_string(), "builtin:/srv/stages");
        assert_eq!(
            ProgramPath::parse("builtin").unwrap().to_string(),
            "builtin"
        );
        assert!(ProgramPath::parse("none").unwrap().dirs().is_empty());
        assert_eq!(ProgramPath::parse("NONE").unwrap(), ProgramPath::none());
        for (bad, says) in [
            ("usr/bin", "not an absolute path"),
            ("/usr/bin:bin", "not an absolute path"),
            ("/usr/lib/pepsi/../../tmp", "\"..\" component"),
            ("/usr/bin::/usr/lib/pepsi", "empty entry"),
            ("/usr/bin:", "empty entry"),
            ("/", "every program"),
            ("//.", "every program"),
        ] {
            let e = ProgramPath::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_default_allows_the_built_in_stages_and_the_package_stage_directory_only() {
        let p = ProgramPath::default();
        for good in [
            "pepsi-stage-pass",
            "pepsi-stage-exec",
            "/usr/bin/pepsi-stage-if",
            "/usr/local/bin/pepsi-stage-bounce",
            "/bin/pepsi-stage-discard",
            "/usr/lib/pepsi/relay",
        ] {
            assert_eq!(p.check(good), Ok(()), "{good}");
        }
        for bad in [
            "/usr/bin/sh",
            "/usr/bin/pepsi-stage-nosuch",
            "pepsi-stage-nosuch",
            "/tmp/pepsi-stage-pass",
            "/usr/bin/../../tmp/pepsi-stage-pass",
            "/usr/bin/x/pepsi-stage-pass",
            "sh",
        ] {
            assert!(p.check(bad).is_err(), "{bad}");
        }
        let only = ProgramPath::parse("builtin").unwrap();
        assert!(
            only.check("/usr/lib/pepsi/relay")
                .unwrap_err()
                .contains("not a built-in stage program")
        );
        let none = ProgramPath::none();
        assert!(none.check("pepsi-stage-pass").is_err());
    }

    #[test]
    fn the_overlay_may_never_set_command_or_user_and_programs_only_as_allowed() {
        let file = super::super::raw::parse(
            Path::new("/f.conf"),
            "[stage-x]\nPROGRAM = /opt/mine\nCOMMAND = /bin/true\n",
        )
        .unwrap();
        let p = ProgramPath::default();
        for key in ["COMMAND", "USER"] {
            for value in ["/bin/sh -c id", "/bin/true", ""] {
                let why = overlay_refusal(&file, &p, "stage-x", key, value).expect("refused");
                assert!(why.starts_with(&format!("{key} is refused")), "{why}");
            }
        }
        assert_eq!(
            overlay_refusal(&file, &p, "stage-x", "PROGRAM", "/opt/mine"),
            None
        );
        assert_eq!(
            overlay_refusal(&file, &p, "stage-x", "PROGRAM", "pepsi-stage-exec"),
            None
        );
        assert_eq!(overlay_refusal(&file, &p, "stage-x", "PROGRAM", ""), None);
        assert_eq!(overlay_refusal(&file, &p, "stage-x", "TIMEOUT", "5s"), None);
        assert!(overlay_refusal(&file, &p, "stage-x", "PROGRAM", "/usr/bin/env").is_some());
    }

    #[test]
    fn the_overlay_may_not_touch_the_relays_security_nor_move_a_login_elsewhere() {
        let file = super::super::raw::parse(
            Path::new("/f.conf"),
            "[stage-out]\nPROGRAM = pepsi-stage-relay\nSMARTHOST = smtp.example.net:587\n\
             AUTH_FILE = /etc/pepsi/relay-auth\n\n\
             [stage-local]\nPROGRAM = pepsi-stage-relay\nSMARTHOST = 127.0.0.1:10026\n",
        )
        .unwrap();
        let p = ProgramPath::default();
        for key in ["TLS", "TLS_WRAPPER", "TLS_NAME", "CA_FILE", "AUTH_FILE"] {
            let why = overlay_refusal(&file, &p, "stage-local", key, "none").expect("refused");
            assert!(why.starts_with(&format!("{key} is refused")), "{why}");
        }
        let why = overlay_refusal(&file, &p, "stage-out", "SMARTHOST", "evil.example:587")
            .expect("refused");
        assert!(why.contains("AUTH_FILE"), "{why}");
        assert_eq!(
            overlay_refusal(&file, &p, "stage-local", "SMARTHOST", "127.0.0.1:10027"),
            None,
            "a section that does not log in may be moved"
        );
    }

    #[test]
    fn the_overlay_cannot_lower_relay_to_internets_tls_policy_nor_unset_it() {
        let file = super::super::raw::parse(
            Path::new("/f.conf"),
            "[stage-out]\nPROGRAM = pepsi-stage-relay-to-internet\nTLS_POLICY = /etc/pepsi/tls-policy\n",
        )
        .unwrap();
        let p = ProgramPath::default();
        for value in ["/tmp/planted-policy", ""] {
            let why =
                overlay_refusal(&file, &p, "stage-out", "TLS_POLICY", value).expect("refused");
            assert!(why.starts_with("TLS_POLICY is refused"), "{why}");
        }
        assert_eq!(
            overlay_refusal(&file, &p, "stage-out", "NAMESERVER", "127.0.0.1:5353"),
            None
        );
    }

    #[test]
    fn a_program_must_be_an_absolute_path_under_a_program_path_directory() {
        let p = ProgramPath::parse("/usr/bin:/usr/lib/pepsi/").unwrap();
        for good in [
            "/usr/bin/pepsi-stage-pass",
            "/usr/lib/pepsi/relay",
            "/usr/lib/pepsi/stages/relay",
            "/usr/bin//pepsi-stage-if",
            "/usr/bin/./pepsi-stage-if",
        ] {
            assert_eq!(p.check(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("pepsi-stage-pass", "not an absolute path"),
            ("usr/bin/pepsi-stage-pass", "not an absolute path"),
            ("./pepsi-stage-pass", "not an absolute path"),
            ("/usr/bin/../../tmp/x", "\"..\" component"),
            ("/usr/lib/pepsi/../x", "\"..\" component"),
            ("/usr/bin/x/", "names a directory"),
            ("/usr/bin", "not under"),
            ("/usr/bin/", "names a directory"),
            ("/usr/binx/foo", "not under"),
            ("/usr/lib/pepsix", "not under"),
            ("/usr/lib/pepsi-evil/x", "not under"),
            (
                "/tmp/x",
                "not under [pepsi] PROGRAM_PATH (/usr/bin:/usr/lib/pepsi)",
            ),
        ] {
            let e = p.check(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let none = ProgramPath::none();
        assert!(
            none.check("/usr/bin/pepsi-stage-pass")
                .unwrap_err()
                .contains("is none")
        );
    }
}
