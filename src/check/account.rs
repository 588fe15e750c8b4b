//! What `pepsi-dispatch check` asks of the `[pepsi] RUN_AS` account (§4
//! "Strictness"): may it read the configuration file, and execute each stage's
//! `PROGRAM` (a path, or a bare name found on `PATH` as `execvp` would)? When this
//! process runs as the account the kernel answers; otherwise the permission bits of
//! the file and of every directory on the way to it do.
//!
//! Called by `check` (its `mod.rs`) only. It reads the user database and file
//! metadata and changes nothing; switching to the account is `crate::privilege`'s.

use std::ffi::{CString, OsStr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// What an account wants to do with a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    Read,
    Execute,
}

/// The `[pepsi] RUN_AS` account, as the kernel will see it once the dispatcher has
/// switched to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Account {
    pub(super) name: String,
    uid: u32,
    /// The primary group and every supplementary group (`initgroups` gives it these).
    groups: Vec<u32>,
}

impl Account {
    /// Looks an account up in the system's user database.
    pub(super) fn lookup(name: &str) -> Result<Account, String> {
        let pw = crate::privilege::lookup(name)?;
        Ok(Account {
            name: pw.name,
            uid: pw.uid,
            groups: pw.groups,
        })
    }

    /// May this account read or execute `path`? When this process runs as the account
    /// (or both are root) the kernel answers (`faccessat`, which also sees ACLs);
    /// otherwise the mode bits of the file and the search bits of every directory on
    /// the way to it do.
    pub(super) fn may(&self, path: &Path, access: Access) -> Result<(), String> {
        let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
        if access == Access::Execute && !meta.is_file() {
            return Err("not a regular file".into());
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == self.uid {
            let c_path = CString::new(path.as_os_str().as_encoded_bytes())
                .map_err(|_| "the path contains a NUL byte".to_string())?;
            let mode = match access {
                Access::Read => libc::R_OK,
                Access::Execute => libc::X_OK,
            };
            // SAFETY: c_path is a valid C string.
            let r =
                unsafe { libc::faccessat(libc::AT_FDCWD, c_path.as_ptr(), mode, libc::AT_EACCESS) };
            return if r == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error().to_string())
            };
        }
        let absolute = std::path::absolute(path).map_err(|e| e.to_string())?;
        let canonical = std::fs::canonicalize(path).map_err(|e| e.to_string())?;
        // The directories of the path as written and of the file it leads to.
        for dir in absolute
            .ancestors()
            .skip(1)
            .chain(canonical.ancestors().skip(1))
        {
            let dm = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if !self.permits(dm.uid(), dm.gid(), dm.mode(), true, Access::Execute) {
                return Err(format!(
                    "permission denied: the directory {} cannot be searched",
                    dir.display()
                ));
            }
        }
        if self.permits(meta.uid(), meta.gid(), meta.mode(), meta.is_dir(), access) {
            Ok(())
        } else {
            Err(format!(
                "permission denied (mode {:o}, owner {}, group {})",
                meta.mode() & 0o7777,
                meta.uid(),
                meta.gid()
            ))
        }
    }

    /// The permission bits' answer for this account: the owner's bits if it owns the
    /// file, else the group's if it is in the file's group, else the others'. Root
    /// reads anything, searches any directory, and executes a file with any `x` bit.
    fn permits(&self, uid: u32, gid: u32, mode: u32, dir: bool, access: Access) -> bool {
        let bit = match access {
            Access::Read => 0o4,
            Access::Execute => 0o1,
        };
        if self.uid == 0 {
            return access == Access::Read || dir || mode & 0o111 != 0;
        }
        let shift = if uid == self.uid {
            6
        } else if self.groups.contains(&gid) {
            3
        } else {
            0
        };
        (mode >> shift) & bit != 0
    }
}

/// May this process execute `path` (a regular file, `access(X_OK)` as it is now)?
fn self_may_execute(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "the path contains a NUL byte".to_string())?;
    // SAFETY: c_path is a valid C string.
    let r = unsafe {
        libc::faccessat(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::X_OK,
            libc::AT_EACCESS,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

/// Can `program` be started by `account` (`None`: this process, as it is): an absolute
/// (or relative) path must be an executable file; a bare name is looked up on `path`
/// (the `PATH` the program will be started with) like `execvp`, the first executable
/// match winning. `who` names the account in a message (`RUN_AS pepsi`, `USER vmail`).
pub(super) fn program_runs(
    program: &str,
    account: Option<&Account>,
    who: &str,
    path: &OsStr,
) -> Result<(), String> {
    let executable = |file: &Path| match account {
        Some(a) => a.may(file, Access::Execute),
        None => self_may_execute(file),
    };
    let run_as = if who.is_empty() {
        String::new()
    } else {
        format!(" by {who}")
    };
    if program.contains('/') {
        return executable(Path::new(program))
            .map_err(|e| format!("{program} cannot be executed{run_as}: {e}"));
    }
    let candidates: Vec<PathBuf> = std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .filter(|p| p.is_file())
        .collect();
    let mut refused = Vec::new();
    for candidate in &candidates {
        match executable(candidate) {
            Ok(()) => return Ok(()),
            Err(e) => refused.push(format!("{}: {e}", candidate.display())),
        }
    }
    if refused.is_empty() {
        Err(format!(
            "{program} is not found on PATH ({})",
            path.to_string_lossy()
        ))
    } else {
        Err(format!(
            "{program} cannot be executed{run_as}: {}",
            refused.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(uid: u32, groups: &[u32]) -> Account {
        Account {
            name: "t".into(),
            uid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn the_owner_group_or_other_bits_decide_for_an_ordinary_account() {
        let a = account(1000, &[1000, 27]);
        let x = Access::Execute;
        assert!(a.permits(1000, 0, 0o700, false, x), "owner");
        assert!(
            !a.permits(1000, 1000, 0o070, false, x),
            "the owner's bits, not the group's"
        );
        assert!(a.permits(0, 27, 0o750, false, x), "a supplementary group");
        assert!(!a.permits(0, 0, 0o750, false, x), "neither owner nor group");
        assert!(a.permits(0, 0, 0o755, false, x), "others");
        assert!(a.permits(0, 0, 0o644, false, Access::Read));
        assert!(!a.permits(0, 0, 0o640, false, Access::Read));
    }

    #[test]
    fn root_executes_a_file_with_any_x_bit_and_searches_any_directory() {
        let root = account(0, &[0]);
        assert!(root.permits(1000, 1000, 0o001, false, Access::Execute));
        assert!(!root.permits(1000, 1000, 0o644, false, Access::Execute));
        assert!(root.permits(1000, 1000, 0o700, true, Access::Execute));
        assert!(root.permits(1000, 1000, 0o000, false, Access::Read));
    }

    #[test]
    fn a_program_is_found_on_path_or_named_missing() {
        let path = OsStr::new("/usr/local/bin:/usr/bin:/bin");
        assert!(program_runs("/nonexistent/prog", None, "", path).is_err());
        let e = program_runs("pepsi-no-such-program", None, "", path).unwrap_err();
        assert!(e.contains("not found on PATH"), "{e}");
        assert!(program_runs("/bin/sh", None, "", path).is_ok());
        assert!(program_runs("sh", None, "", path).is_ok());
        // Looked up on the PATH given, not this process's.
        let e = program_runs("sh", None, "", OsStr::new("/nonexistent")).unwrap_err();
        assert!(e.contains("not found on PATH (/nonexistent)"), "{e}");
        // A file that is not executable, for an account that is not root.
        let file = std::env::temp_dir().join(format!("pepsi-not-a-program-{}", std::process::id()));
        std::fs::write(&file, "text\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let vmail = account(64999, &[64999]);
        let e = program_runs(file.to_str().unwrap(), Some(&vmail), "USER vmail", path);
        std::fs::remove_file(&file).unwrap();
        let e = e.unwrap_err();
        assert!(e.contains("cannot be executed by USER vmail"), "{e}");
    }
}
