//! `[pepsi] PROGRAM_PATH` and the one rule about what an overlay may run (SPEC §4
//! "Least privilege"): an overlay `PROGRAM` must be an absolute path under one of its
//! directories, unless a stage section of the file names that very program.
//! [`super::graph::lay_over`] applies it; `pepsi-dispatch check` and `pepsi-queue
//! config set` judge a row with it too.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use super::graph::STAGE_PREFIX;
use super::raw::Section;

/// `[pepsi] PROGRAM_PATH`'s default: where the package installs its programs and the
/// `pepsi-stage-NAME` links (`/usr/bin`), and the place for a site's own stage programs
/// (`/usr/lib/pepsi`).
pub const DEFAULT_PROGRAM_PATH: &str = "/usr/bin:/usr/lib/pepsi";

/// `[pepsi] PROGRAM_PATH`: the directories an overlay `PROGRAM` may name a program
/// under (at any depth), or none at all (`none`). Set in the file only: the overlay
/// overrides `[stage-*]` sections alone, so it cannot widen this.
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
    /// Reads a `PROGRAM_PATH` value: `none`, or absolute directories joined by `:`.
    pub fn parse(text: &str) -> Result<ProgramPath, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("none") {
            return Ok(ProgramPath { dirs: Vec::new() });
        }
        let mut dirs = Vec::new();
        for entry in text.split(':') {
            if entry.is_empty() {
                return Err(format!(
                    "{text:?} has an empty entry (directories are joined by ':'; none for no directory)"
                ));
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
        Ok(ProgramPath { dirs })
    }

    /// No directory: the overlay may name only programs the file names.
    pub fn none() -> ProgramPath {
        ProgramPath { dirs: Vec::new() }
    }

    /// The directories, normalised, in order; empty for `none`.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Is `program` an absolute path under one of the directories? `Err` says why not.
    pub fn check(&self, program: &str) -> Result<(), String> {
        if self.dirs.is_empty() {
            return Err("[pepsi] PROGRAM_PATH is none".into());
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
        if self.dirs.is_empty() {
            return f.write_str("none");
        }
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        f.write_str(&dirs.join(":"))
    }
}

/// Why the overlay may not set `PROGRAM` to `value`, or `None` when it may: an empty
/// value (which unsets the key; the graph check decides about the section), a program
/// a stage section of the file names exactly as written, or an absolute path under
/// `programs` (SPEC §4 "Least privilege").
pub fn overlay_program_refusal(
    file: &[Section],
    programs: &ProgramPath,
    value: &str,
) -> Option<String> {
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
        "{value:?} is refused: {why}; an overlay PROGRAM must be an absolute path under \
         [pepsi] PROGRAM_PATH ({programs}) or a program a [stage-*] section of the file names"
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
