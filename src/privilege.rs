//! Dropping root privileges to the `[pepsi] RUN_AS` account (§6, §13.1).
//!
//! `std` cannot change the process's credentials, so this uses libc: look the account
//! up, then `initgroups`, `setgid`, `setuid`, and check that root cannot be regained.
//! Called before any connection or thread that must not keep root is made; on Linux
//! (glibc) threads started earlier follow the change anyway.

use std::ffi::{CStr, CString};

use crate::exit::Failure;

/// The PATH a service account's processes get: the system's, nothing of root's.
pub const SERVICE_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The account a program switched to: what its children's environment must say
/// instead of root's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// Its name.
    pub name: String,
    /// Its home directory.
    pub home: String,
}

impl Account {
    /// `HOME`, `USER`, `LOGNAME` and `PATH` for a child process (a worker, and through
    /// it an exec stage's command), replacing what was inherited from root.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HOME", self.home.clone()),
            ("USER", self.name.clone()),
            ("LOGNAME", self.name.clone()),
            ("PATH", SERVICE_PATH.to_string()),
        ]
    }
}

/// An account of the system's user database, as a process switching to it gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Passwd {
    /// Its name.
    pub name: String,
    /// Its user id.
    pub uid: libc::uid_t,
    /// Its primary group.
    pub gid: libc::gid_t,
    /// The primary group and every supplementary group (what `initgroups` gives it).
    pub groups: Vec<libc::gid_t>,
    /// Its home directory (`/` when it has none).
    pub home: String,
}

/// Looks an account up in the system's user database (`getpwnam`, `getgrouplist`).
/// Call it while no other thread reads the user database (it uses `getpwnam`'s static
/// storage).
pub fn lookup(name: &str) -> Result<Passwd, String> {
    let c_name = CString::new(name).map_err(|_| format!("{name:?} is not a valid account name"))?;
    // SAFETY: c_name is a valid C string; getpwnam returns NULL or a pointer to static
    // storage, read at once.
    let pw = unsafe { libc::getpwnam(c_name.as_ptr()) };
    if pw.is_null() {
        return Err(format!("the account {name:?} does not exist"));
    }
    // SAFETY: pw is non-null and points to a valid passwd entry; pw_dir is a valid C
    // string (or NULL) copied before any other passwd call.
    let (uid, gid, home) = unsafe {
        let dir = (*pw).pw_dir;
        let home = if dir.is_null() {
            "/".to_string()
        } else {
            CStr::from_ptr(dir).to_string_lossy().into_owned()
        };
        ((*pw).pw_uid, (*pw).pw_gid, home)
    };
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut n = groups.len() as libc::c_int;
        // SAFETY: groups has room for n entries; getgrouplist writes at most n and sets
        // n to the number it has (or needs).
        let r = unsafe { libc::getgrouplist(c_name.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
        if r >= 0 {
            groups.truncate(n.max(0) as usize);
            break;
        }
        // Too small: n says how many are needed (grow at least twofold anyway).
        let want = (n.max(0) as usize).max(groups.len() * 2);
        groups.resize(want, 0);
    }
    if !groups.contains(&gid) {
        groups.push(gid);
    }
    Ok(Passwd {
        name: name.to_string(),
        uid,
        gid,
        groups,
        home,
    })
}

/// The name of the account this process runs as (its effective user id), when the
/// user database has one.
pub fn current_account() -> Option<String> {
    // SAFETY: geteuid has no preconditions; getpwuid returns NULL or a pointer to
    // static storage, read at once.
    unsafe {
        let pw = libc::getpwuid(libc::geteuid());
        if pw.is_null() || (*pw).pw_name.is_null() {
            return None;
        }
        Some(CStr::from_ptr((*pw).pw_name).to_string_lossy().into_owned())
    }
}

/// When running as root, switches to `account` (unless it is `root`, which keeps root
/// with a warning) and returns it. Not root, or root kept: nothing to do, `None`.
pub fn drop_to(account: &str) -> Result<Option<Account>, Failure> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    if account == "root" {
        log::warn!(
            "[pepsi] RUN_AS = root: keeping root privileges (meant for tests and containers)"
        );
        return Ok(None);
    }
    let name = CString::new(account).map_err(|_| {
        Failure::general(format!(
            "[pepsi] RUN_AS {account:?} is not a valid account name"
        ))
    })?;
    let Passwd { uid, gid, home, .. } = lookup(account).map_err(|_| {
        Failure::general(format!(
            "[pepsi] RUN_AS: the account {account:?} does not exist (create it, e.g. adduser --system --group {account})"
        ))
    })?;
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
    Ok(Some(Account {
        name: account.to_string(),
        home,
    }))
}

/// The account the stage workers of a dispatcher started as root run as (§4
/// "Containment"): `[pepsi] WORKER_AS`, which must exist and be neither root nor
/// `RUN_AS` (nor share its user id). `Ok(None)`: they keep root, as everything does
/// with `RUN_AS = root` (tests and containers); `WORKER_AS = root` is allowed only then.
pub fn worker_account(run_as: &str, worker_as: &str) -> Result<Option<Passwd>, String> {
    if run_as == "root" {
        return Ok(None);
    }
    if worker_as == "root" {
        return Err(format!(
            "[pepsi] WORKER_AS = root is allowed only with RUN_AS = root: workers would run \
             with more privileges than the dispatcher ({run_as})"
        ));
    }
    if worker_as == run_as {
        return Err(format!(
            "[pepsi] WORKER_AS {worker_as} is [pepsi] RUN_AS: the stage workers run under an \
             account of their own, which cannot read the configuration or log in as another \
             database role"
        ));
    }
    let account = lookup(worker_as).map_err(|e| {
        format!(
            "[pepsi] WORKER_AS: {e} (create it: adduser --system --group --no-create-home \
             --home /nonexistent {worker_as})"
        )
    })?;
    if account.uid == 0 {
        return Err(format!(
            "[pepsi] WORKER_AS {worker_as} has user id 0, root's"
        ));
    }
    if lookup(run_as).is_ok_and(|r| r.uid == account.uid) {
        return Err(format!(
            "[pepsi] WORKER_AS {worker_as} has the user id of [pepsi] RUN_AS {run_as}"
        ));
    }
    Ok(Some(account))
}
