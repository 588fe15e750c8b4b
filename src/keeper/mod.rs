//! The keeper: how an exec stage's command runs apart from the worker that handles the
//! message (§4 "Containment", §12.7), as Postfix's `pipe(8)` runs its command as
//! the `user=` of `master.cf`.
//!
//! A worker never starts its command itself. It asks its keeper, over a Unix socket,
//! to run the command with the message's `PEPSI_*` variables, passing the command's
//! stdin and stderr pipes and the pipe of its recipients along; the keeper starts it in
//! a process group of its own, with a clean environment (those variables, `PATH`,
//! `HOME`, `LANG`), no descriptor but the three and its recipients' ([`RECIPIENTS_FD`]),
//! as the stage's `USER` when it may switch accounts, reports its start
//! and its exit status, kills it when the worker's `TIMEOUT` runs out, and kills
//! whatever it left behind when it ends, detached or not ([`serve`]).
//!
//! Where the keeper comes from:
//! - **The dispatcher started as root**: its launcher ([`crate::launcher`]), which keeps
//!   root, forks a keeper for every worker of a stage whose section sets `COMMAND`,
//!   which runs exactly the configuration file's `COMMAND` as the account its `USER`
//!   names (never root, never `RUN_AS` or `WORKER_AS`), read from the file itself
//!   ([`mandate`]). The worker gets its end of the keeper's socket as descriptor 3
//!   (`PEPSI_KEEPER_FD`). So the worker, which handles message data and holds the
//!   database role, cannot choose what runs or as whom, and the command, running as
//!   another account without the worker's environment or descriptors, reaches neither
//!   the configuration nor the database.
//! - **Otherwise** (a dispatcher not started as root, a worker started by hand) the
//!   worker starts a keeper of its own ([`client::Keeper::private`]), running as the
//!   worker: it can switch to `USER` only when the worker is root; else `USER` must be
//!   absent or the worker's own account.
//!
//! The messages ([`wire`]) are NUL-separated fields, the first naming the message.

pub mod client;
pub mod mandate;
pub mod serve;
pub mod wire;

/// A worker's request: run a command (fields: user, argc, argv…, `NAME=value`…; with
/// its stdin and stderr descriptors and the read end of its recipients' pipe).
pub const RUN: &[u8] = b"RUN";
/// A worker's request: kill the running command (its `TIMEOUT` ran out).
pub const KILL: &[u8] = b"KILL";
/// The keeper's greeting: it serves.
pub const READY: &[u8] = b"READY";
/// The keeper's greeting: it will not serve, and why (the worker refuses to run).
pub const REFUSED: &[u8] = b"REFUSED";
/// The command started (field: its pid).
pub const STARTED: &[u8] = b"STARTED";
/// The command could not start (fields: an errno or 0, the reason).
pub const START_ERROR: &[u8] = b"ERROR";
/// The command ended (field: its raw wait status).
pub const EXIT: &[u8] = b"EXIT";

/// The environment variables a command gets from the worker's request; the keeper adds
/// `PATH` and `HOME`, and drops everything else a request names.
pub const ALLOWED_ENV: &[&str] = &[
    "PEPSI_ID",
    "PEPSI_STAGE",
    "PEPSI_SENDER",
    "PEPSI_RECIPIENTS",
    "PEPSI_SENDER_KEY",
    "LANG",
];

/// The descriptor a command reads its recipients on, one per line, from a pipe of its
/// own (the worker writes them; no size limit, unlike a variable).
pub const RECIPIENTS_FD: i32 = 3;

/// The environment variable that names [`RECIPIENTS_FD`] to the command; the keeper
/// sets it when it passes the descriptor.
pub const RECIPIENTS_FD_ENV: &str = "PEPSI_RECIPIENTS_FD";

/// The environment variable that gives a worker its keeper's descriptor.
pub const KEEPER_FD_ENV: &str = "PEPSI_KEEPER_FD";

/// The descriptor a worker finds its keeper on.
pub const KEEPER_FD: i32 = 3;

/// The environment variable that starts the stage binary as a worker's private keeper
/// serving the descriptor it names (set by [`client::Keeper::private`] only).
pub const SERVE_FD_ENV: &str = "PEPSI_KEEPER_SERVE_FD";

/// The account an exec command runs as when its section sets no `USER` and the keeper
/// may switch accounts: the package creates it, with no login, no home and no group
/// but its own.
pub const DEFAULT_USER: &str = "pepsi-exec";

/// The accounts of Pepsi's own programs, which a command never runs as: `[pepsi]
/// RUN_AS`, which reads the configuration and reaches the database, and `[pepsi]
/// WORKER_AS`, which the stage workers run as.
#[derive(Clone, Copy, Debug)]
pub struct Reserved<'a> {
    /// `[pepsi] RUN_AS`.
    pub run_as: &'a str,
    /// `[pepsi] WORKER_AS`.
    pub worker_as: &'a str,
}

impl<'a> Reserved<'a> {
    /// The accounts of a configuration.
    pub fn of(pepsi: &'a crate::config::PepsiOptions) -> Reserved<'a> {
        Reserved {
            run_as: &pepsi.run_as,
            worker_as: &pepsi.worker_as,
        }
    }

    /// Each account with the key that names it.
    fn each(self) -> [(&'static str, &'a str, &'static str); 2] {
        [
            (
                "[pepsi] RUN_AS",
                self.run_as,
                "the account that reads the configuration and reaches the database",
            ),
            (
                "[pepsi] WORKER_AS",
                self.worker_as,
                "the account the stage workers run as",
            ),
        ]
    }
}

/// The account an exec command runs as when the keeper may switch accounts: the
/// section's `USER`, else [`DEFAULT_USER`]; never root, never `[pepsi] RUN_AS` nor
/// `[pepsi] WORKER_AS` (nor an account with their user id), and it must exist.
pub fn exec_account(
    user: Option<&str>,
    reserved: Reserved<'_>,
) -> Result<crate::privilege::Passwd, String> {
    let name = user.unwrap_or(DEFAULT_USER);
    if name == "root" {
        return Err("USER root is refused: a command never runs as root".into());
    }
    for (key, account, what) in reserved.each() {
        if name == account {
            return Err(format!(
                "USER {name} is refused: it is {key}, {what}; a command runs as an account of its own"
            ));
        }
    }
    let account = crate::privilege::lookup(name).map_err(|e| {
        if user.is_none() {
            format!(
                "{e}: a command runs as USER, by default {DEFAULT_USER} (the package creates \
                 it: adduser --system --group --no-create-home --home /nonexistent {DEFAULT_USER}); \
                 or set USER to an existing unprivileged account"
            )
        } else {
            format!("USER {name}: {e}")
        }
    })?;
    if account.uid == 0 {
        return Err(format!("USER {name} is refused: it has user id 0, root's"));
    }
    for (key, other, _) in reserved.each() {
        if crate::privilege::lookup(other).is_ok_and(|r| r.uid == account.uid) {
            return Err(format!(
                "USER {name} is refused: it has the user id of {key} {other}"
            ));
        }
    }
    // The configuration file is RUN_AS's group's to read (root:pepsi 0640): a member
    // of that group would read its connection strings.
    if let Ok(run_as) = crate::privilege::lookup(reserved.run_as) {
        if reserved.run_as != "root" && account.groups.contains(&run_as.gid) {
            return Err(format!(
                "USER {name} is refused: it is in the group of [pepsi] RUN_AS {} (gid {}), \
                 which may read the configuration",
                reserved.run_as, run_as.gid
            ));
        }
    }
    Ok(account)
}

/// The account a stage's command runs as, judged where it will be started: `as_root`,
/// the account [`exec_account`] gives (`Some`, its name); otherwise nothing may
/// switch, so `USER` must be absent or the current account (`None`: the command runs
/// as this process's account).
pub fn command_account(
    user: Option<&str>,
    reserved: Reserved<'_>,
    as_root: bool,
) -> Result<Option<String>, String> {
    if as_root {
        return exec_account(user, reserved).map(|a| Some(a.name));
    }
    let me = crate::privilege::current_account();
    match user {
        None => Ok(None),
        Some(u) if me.as_deref() == Some(u) => Ok(None),
        Some(u) => Err(format!(
            "USER {u} cannot be switched to: not started as root, commands run as the \
             account {} (leave USER out or name that account)",
            me.unwrap_or_else(|| "of this process".into())
        )),
    }
}
