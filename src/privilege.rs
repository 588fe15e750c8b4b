//! Dropping root privileges to the `[pepsi] RUN_AS` account (SPEC §6, §13.1).
//!
//! `std` cannot change the process's credentials, so this uses libc: look the account
//! up, then `initgroups`, `setgid`, `setuid`, and check that root cannot be regained.
//! Called before any connection or thread that must not keep root is made; on Linux
//! (glibc) threads started earlier follow the change anyway.

use std::ffi::CString;

use crate::exit::Failure;

/// When running as root, switches to `account` (unless it is `root`, which keeps root
/// with a warning). Not root: nothing to do.
pub fn drop_to(account: &str) -> Result<(), Failure> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    if account == "root" {
        log::warn!(
            "[pepsi] RUN_AS = root: keeping root privileges (meant for tests and containers)"
        );
        return Ok(());
    }
    let name = CString::new(account).map_err(|_| {
        Failure::general(format!(
            "[pepsi] RUN_AS {account:?} is not a valid account name"
        ))
    })?;
    // SAFETY: name is a valid C string; getpwnam returns NULL or a pointer to static
    // storage that we read before any other passwd call.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(Failure::general(format!(
            "[pepsi] RUN_AS: the account {account:?} does not exist (create it, e.g. adduser --system --group {account})"
        )));
    }
    // SAFETY: pw is non-null and points to a valid passwd entry.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    let os = |what: &str| {
        Failure::general(format!(
            "cannot switch to the account {account:?}: {what} failed: {}",
            std::io::Error::last_os_error()
        ))
    };
    // Order matters: supplementary groups and the group while still root, the user last.
    // SAFETY: plain libc calls with valid arguments.
    unsafe {
        if libc::initgroups(name.as_ptr(), gid) != 0 {
            return Err(os("initgroups"));
        }
        if libc::setgid(gid) != 0 {
            return Err(os("setgid"));
        }
        if libc::setuid(uid) != 0 {
            return Err(os("setuid"));
        }
        if uid != 0 && libc::setuid(0) == 0 {
            return Err(Failure::general(format!(
                "switched to {account:?} but root could be regained; refusing to run"
            )));
        }
    }
    log::debug!("running as {account} (uid {uid}, gid {gid})");
    Ok(())
}
