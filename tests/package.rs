//! The Debian package, built and installed for real on this machine.
//!
//! `packaging/build-deb` builds it (or `PEPSI_DEB` names a `.deb` built already);
//! `lintian` must report no error and no warning beyond `packaging/lintian-overrides`;
//! `dpkg -i` installs it (systemd need not be running); then the test checks the
//! `pepsi` account, every file's place, owner and mode, the stage links against the
//! built-in stages, the links `pepsi-settings` and `pepsi-config` to `pepsi-queue`,
//! `systemd-analyze verify` of every installed unit, and runs the installed programs —
//! started as root, so they switch to `pepsi` — against a throwaway database:
//! `pepsi-setup schema`, `pepsi-dispatch check`, `pepsi-queue status`,
//! `pepsi-settings` and `pepsi-config check` when the package has them,
//! `pepsi-failure-bouncer sweep`, a dispatcher that runs a message through two stages,
//! and, when the package has it, `pepsi-ingress` taking a message over LMTP on a Unix
//! socket it made as root before switching. Last,
//! `dpkg --purge` and what must and must not remain.
//!
//! It needs root, dpkg, lintian, systemd-analyze and adduser, and a machine where
//! `pepsi` is not installed; without them it says so and passes, except with `CI`
//! set, where it fails. The machine is left as it was found: a guard purges the
//! package, and removes the `pepsi` account if the test created it, even when an
//! assertion fails.

mod util;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use pepsi::stages::BUILTINS;
use util::logged::Logged;
use util::{TempDir, TestDb, wait_until};

/// Where Debian 12's packages keep systemd units (and where build-deb puts them).
const UNIT_DIR: &str = "/lib/systemd/system";

/// The keys of the restart back-off that systemd learnt in version 254.
const KEYS_FROM_254: &[&str] = &["RestartSteps", "RestartMaxDelaySec"];

/// A file of this source tree.
fn source(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Runs a command to its end.
fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command that must succeed; its stdout.
#[track_caller]
fn succeed(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn have(tool: &str) -> bool {
    output(Command::new("sh").args(["-c", &format!("command -v {tool}")]))
        .status
        .success()
}

/// Is the package installed (or left configured) on this machine?
fn pepsi_installed() -> bool {
    let out = output(Command::new("dpkg-query").args(["-W", "-f", "${db:Status-Abbrev}", "pepsi"]));
    out.status.success() && !String::from_utf8_lossy(&out.stdout).starts_with("un")
}

/// An account as `getent passwd` gives it: (uid, gid, home, shell).
fn account(name: &str) -> Option<(u32, u32, String, String)> {
    let out = output(Command::new("getent").args(["passwd", name]));
    if !out.status.success() {
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let f: Vec<&str> = line.split(':').collect();
    Some((
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
        f[5].to_string(),
        f[6].to_string(),
    ))
}

/// A group's id.
fn group(name: &str) -> Option<u32> {
    let out = output(Command::new("getent").args(["group", name]));
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .split(':')
            .nth(2)
            .unwrap()
            .parse()
            .unwrap()
    })
}

/// Held while the test installs and purges the system package: a second run of it on
/// this machine (another checkout's `cargo test`) waits instead of finding the package
/// installed, or purging it from under the first.
struct MachineLock(#[allow(dead_code)] std::fs::File);

fn machine_lock() -> MachineLock {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/run/lock/pepsi-package-test.lock")
        .expect("open /run/lock/pepsi-package-test.lock");
    // SAFETY: flock on a descriptor we own; the lock goes with the file.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
    MachineLock(file)
}

/// dpkg with a few tries: another package manager may hold its lock for a moment.
fn dpkg(args: &[&str]) -> Output {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let out = output(Command::new("dpkg").args(args));
        let locked = String::from_utf8_lossy(&out.stderr).contains("lock");
        if out.status.success() || !locked || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The accounts the package creates, each with its group of the same name.
const ACCOUNTS: [&str; 3] = ["pepsi", "pepsi-exec", "pepsi-worker"];

/// Purges the package when dropped, and removes the accounts and groups the test
/// created: the machine is left as it was found, whatever failed.
struct Installation {
    /// For each of [`ACCOUNTS`]: did the account, and its group, exist before?
    existed: Vec<(bool, bool)>,
}

impl Drop for Installation {
    fn drop(&mut self) {
        let _ = dpkg(&["--purge", "pepsi"]);
        for (name, (account_existed, group_existed)) in ACCOUNTS.iter().zip(&self.existed) {
            if !account_existed && account(name).is_some() {
                let _ = output(Command::new("userdel").arg(name));
            }
            if !group_existed && group(name).is_some() {
                let _ = output(Command::new("groupdel").arg(name));
            }
        }
    }
}

/// Owner, group and permission bits of a path (not following a symbolic link).
fn stat(path: &str) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

/// The programs the package must hold: one per `src/bin/*.rs`, as build-deb makes them.
fn programs() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(source("src/bin"))
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .collect();
    names.sort();
    names
}

/// The files of a source folder, sorted.
fn files_of(folder: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(source(folder))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    files
}

/// The program a unit's `ExecStart=` runs.
fn exec_start(unit: &Path) -> String {
    let text = std::fs::read_to_string(unit).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{} has no ExecStart=", unit.display()));
    line.trim_start_matches(['-', '@', ':', '+', '!'])
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// systemd's version number.
fn systemd_version() -> u32 {
    let text = succeed(Command::new("systemd-analyze").arg("--version"));
    text.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no version in {text:?}"))
}

/// A connection string for `db` that only the `pepsi` account can use, as on a Debian
/// server after `createuser pepsi; createdb -O pepsi pepsi`: a role `pepsi` owning the
/// database, reached by peer authentication, so that a program connecting as root is
/// refused. (On an external server, `DATABASE_URL`, the harness's own connection.)
fn as_pepsi(db: &TestDb) -> String {
    let Some(data) = util::pg::data_dir() else {
        return db.connection().to_string();
    };
    // The cluster is this test binary's own: its socket's directory admits the pepsi
    // account too (the harness admits only root, postgres and nogroup).
    if let Some(sock) = db
        .connection()
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("host="))
    {
        std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut admin = util::pg::admin();
    // The README's quick start: the owner, and the workers' role (named after their
    // account, a member of pepsi_worker) that the owner may signal.
    admin
        .batch_execute(
            "DO $$ BEGIN \
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'pepsi') \
                 THEN CREATE ROLE pepsi LOGIN; END IF; \
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'pepsi_worker') \
                 THEN CREATE ROLE pepsi_worker NOLOGIN; END IF; \
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'pepsi-worker') \
                 THEN CREATE ROLE \"pepsi-worker\" LOGIN IN ROLE pepsi_worker; END IF; \
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$; \
             GRANT \"pepsi-worker\" TO pepsi",
        )
        .unwrap();
    admin
        .batch_execute(&format!("ALTER DATABASE {} OWNER TO pepsi", db.name))
        .unwrap();
    // The first matching line decides: pepsi and pepsi-worker by peer, everyone else
    // as before.
    let hba = data.join("pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).unwrap();
    let ours = "local all pepsi,pepsi-worker peer\n";
    if !rules.starts_with(ours) {
        std::fs::write(&hba, format!("{ours}{rules}")).unwrap();
        admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    }
    let connection = db.connection().replace("user=postgres", "user=pepsi");
    assert!(connection.contains("user=pepsi"), "{connection}");
    // Root is refused now.
    assert!(postgres::Client::connect(&connection, postgres::NoTls).is_err());
    connection
}

/// The real user ids of a running process (`Uid:` of `/proc/PID/status`).
fn uids(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace()
        .skip(1)
        .map(|u| u.parse().unwrap())
        .collect()
}

/// Hands one message from `from` to `to` to `pepsi-ingress` over LMTP on the Unix
/// socket `socket`; the id it says the message was queued as.
fn deliver_over_lmtp(socket: &Path, from: &str, to: &str) -> i64 {
    let stream = UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connect to {}: {e}", socket.display()));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    // One reply, its continuation lines included; it must have the code `code`.
    let mut expect = |code: &str| -> String {
        let mut reply = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            assert!(
                line.starts_with(code),
                "pepsi-ingress answered {line:?}, not {code}"
            );
            reply.push_str(&line);
            if line.as_bytes().get(3) != Some(&b'-') {
                return reply;
            }
        }
    };
    expect("220");
    let mut say = |text: &str| writer.write_all(text.as_bytes()).unwrap();
    say("LHLO package.test\r\n");
    expect("250");
    say(&format!("MAIL FROM:<{from}>\r\n"));
    expect("250");
    say(&format!("RCPT TO:<{to}>\r\n"));
    expect("250");
    say("DATA\r\n");
    expect("354");
    say("From: <sender@example.org>\r\nSubject: over LMTP\r\n\r\nHello by LMTP.\r\n.\r\n");
    let queued = expect("250");
    say("QUIT\r\n");
    expect("221");
    queued
        .trim_end()
        .rsplit(' ')
        .next()
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no id in {queued:?}"))
}

/// The `.deb` to test: `PEPSI_DEB`, else one built by `packaging/build-deb` into `out`.
fn package(out: &TempDir) -> PathBuf {
    if let Some(deb) = std::env::var_os("PEPSI_DEB").filter(|v| !v.is_empty()) {
        return PathBuf::from(deb);
    }
    let stdout = succeed(Command::new(source("packaging/build-deb")).arg(&out.0));
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("build-deb printed the package's path"),
    )
}

#[test]
fn pepsi_stage_lists_every_built_in_stage() {
    let out = succeed(Command::new(env!("CARGO_BIN_EXE_pepsi-stage")).arg("list"));
    let listed: Vec<&str> = out.lines().collect();
    let builtins: Vec<&str> = BUILTINS.iter().map(|s| s.name()).collect();
    assert_eq!(listed, builtins);
}

#[test]
fn the_package_installs_runs_and_purges_cleanly() {
    let mut missing: Vec<&str> = [
        "dpkg",
        "dpkg-deb",
        "lintian",
        "systemd-analyze",
        "adduser",
        "runuser",
    ]
    .into_iter()
    .filter(|t| !have(t))
    .collect();
    if !is_root() {
        missing.insert(0, "root");
    }
    let _machine = missing.is_empty().then(machine_lock);
    if !missing.is_empty() || pepsi_installed() {
        let why = if missing.is_empty() {
            "the package pepsi is installed on this machine already (dpkg --purge pepsi first)"
                .to_string()
        } else {
            format!(
                "it needs {} (apt-get install lintian dpkg-dev systemd adduser)",
                missing.join(", ")
            )
        };
        assert!(
            std::env::var_os("CI").is_none(),
            "the package test cannot run: {why}"
        );
        eprintln!("skipping the package test: {why}");
        return;
    }

    let out = TempDir::new("deb");
    let deb = package(&out);
    let deb = deb.to_str().unwrap();

    // lintian: no error, and no warning the overrides do not accept with a reason.
    let lint = output(Command::new("lintian").args(["--fail-on", "none", deb]));
    let lint_text = String::from_utf8_lossy(&lint.stdout).into_owned();
    let tags: Vec<&str> = lint_text
        .lines()
        .filter(|l| l.starts_with("E: ") || l.starts_with("W: "))
        .collect();
    assert!(
        lint.status.success() && tags.is_empty(),
        "lintian {deb}:\n{lint_text}{}",
        String::from_utf8_lossy(&lint.stderr)
    );

    let _installation = Installation {
        existed: ACCOUNTS
            .iter()
            .map(|name| (account(name).is_some(), group(name).is_some()))
            .collect(),
    };
    let installed = dpkg(&["-i", deb]);
    assert!(
        installed.status.success(),
        "dpkg -i {deb}:\n{}{}",
        String::from_utf8_lossy(&installed.stdout),
        String::from_utf8_lossy(&installed.stderr)
    );

    // The account: a system user with its own group, no login, home /var/lib/pepsi.
    let (uid, gid, home, shell) = account("pepsi").expect("postinst created the pepsi account");
    assert!(uid < 1000, "pepsi is a system account (uid {uid})");
    assert_eq!(group("pepsi"), Some(gid), "pepsi's primary group is pepsi");
    assert_eq!(home, "/var/lib/pepsi");
    assert_eq!(shell, "/usr/sbin/nologin");
    // The account exec commands run as: no login, no home, outside the pepsi group.
    let (exec_uid, exec_gid, exec_home, exec_shell) =
        account("pepsi-exec").expect("postinst created the pepsi-exec account");
    assert!(
        exec_uid < 1000 && exec_uid != uid,
        "pepsi-exec is a system account of its own"
    );
    assert_eq!(group("pepsi-exec"), Some(exec_gid));
    assert_eq!(exec_home, "/nonexistent");
    assert_eq!(exec_shell, "/usr/sbin/nologin");
    // The account stage workers run as: the same, an account of its own.
    let (worker_uid, worker_gid, worker_home, worker_shell) =
        account("pepsi-worker").expect("postinst created the pepsi-worker account");
    assert!(
        worker_uid < 1000 && worker_uid != uid && worker_uid != exec_uid,
        "pepsi-worker is a system account of its own"
    );
    assert_eq!(group("pepsi-worker"), Some(worker_gid));
    assert_eq!(worker_home, "/nonexistent");
    assert_eq!(worker_shell, "/usr/sbin/nologin");

    // Programs and stage links.
    for name in programs() {
        assert_eq!(
            stat(&format!("/usr/bin/{name}")),
            (0, 0, 0o755),
            "/usr/bin/{name}"
        );
    }
    let mut links = BTreeSet::new();
    for e in std::fs::read_dir("/usr/bin").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(stage) = name.strip_prefix("pepsi-stage-") {
            let path = e.path();
            assert!(path.is_symlink(), "{} is a link", path.display());
            assert_eq!(
                std::fs::canonicalize(&path).unwrap(),
                Path::new("/usr/bin/pepsi-stage"),
                "{} leads to pepsi-stage",
                path.display()
            );
            links.insert(stage.to_string());
        }
    }
    let builtins: BTreeSet<String> = BUILTINS.iter().map(|s| s.name().to_string()).collect();
    assert_eq!(
        links, builtins,
        "one /usr/bin/pepsi-stage-NAME per built-in stage"
    );
    // Each link works: the stage answers to its name.
    for stage in &builtins {
        let help = succeed(Command::new(format!("/usr/bin/pepsi-stage-{stage}")).arg("-h"));
        assert!(help.contains(&format!("pepsi-stage-{stage}")), "{help}");
    }
    // The other names of pepsi-queue: links to it, each answering to its name.
    if Path::new("/usr/bin/pepsi-queue").exists() {
        for name in pepsi::queue::multicall::LINKS {
            let path = format!("/usr/bin/{name}");
            assert!(Path::new(&path).is_symlink(), "{path} is a link");
            assert_eq!(
                std::fs::canonicalize(&path).unwrap(),
                Path::new("/usr/bin/pepsi-queue"),
                "{path} leads to pepsi-queue"
            );
            let help = succeed(Command::new(&path).arg("-h"));
            assert!(help.starts_with(&format!("usage: {name} ")), "{help}");
        }
    }

    // Manual pages, a link per stage to pepsi-stage(8).
    for page in files_of("packaging/man") {
        let name = page.file_name().unwrap().to_str().unwrap();
        let section = name.rsplit('.').next().unwrap();
        let installed = format!("/usr/share/man/man{section}/{name}.gz");
        assert_eq!(stat(&installed), (0, 0, 0o644), "{installed}");
    }
    for stage in &builtins {
        let link = format!("/usr/share/man/man8/pepsi-stage-{stage}.8.gz");
        assert_eq!(
            std::fs::canonicalize(&link).unwrap(),
            Path::new("/usr/share/man/man8/pepsi-stage.8.gz"),
            "{link}"
        );
    }

    // The configuration: the example, a conffile, readable by root and group pepsi.
    assert_eq!(stat("/etc/pepsi/pepsi.conf"), (0, gid, 0o640));
    assert_eq!(
        std::fs::read_to_string("/etc/pepsi/pepsi.conf").unwrap(),
        std::fs::read_to_string(source("packaging/pepsi.conf")).unwrap()
    );
    let conffiles = succeed(Command::new("dpkg-query").args(["-W", "-f", "${Conffiles}", "pepsi"]));
    assert!(conffiles.contains("/etc/pepsi/pepsi.conf "), "{conffiles}");
    let read_as = |user: &str| {
        output(Command::new("runuser").args(["-u", user, "--", "cat", "/etc/pepsi/pepsi.conf"]))
            .status
            .success()
    };
    assert!(read_as("pepsi"), "pepsi reads pepsi.conf");
    assert!(!read_as("nobody"), "nobody else reads pepsi.conf");
    assert_eq!(stat("/var/lib/pepsi"), (uid, gid, 0o750));

    // The schema and the documentation.
    for file in files_of("schema") {
        let installed = Path::new("/usr/share/pepsi/schema").join(file.file_name().unwrap());
        assert_eq!(
            std::fs::read(&installed).unwrap(),
            std::fs::read(&file).unwrap(),
            "{}",
            installed.display()
        );
    }
    for doc in [
        "copyright",
        "changelog.Debian.gz",
        "changelog.gz",
        "README.md.gz",
    ] {
        let path = format!("/usr/share/doc/pepsi/{doc}");
        assert_eq!(stat(&path), (0, 0, 0o644), "{path}");
    }
    // The guides the README links to (doc/NAME.md), each compressed beside it, and
    // nothing else in that folder.
    let guides: Vec<String> = files_of("doc")
        .iter()
        .filter_map(|f| {
            f.file_name()?
                .to_str()?
                .strip_suffix(".md")
                .map(str::to_string)
        })
        .collect();
    assert!(guides.contains(&"install".to_string()), "{guides:?}");
    let mut installed: Vec<String> = std::fs::read_dir("/usr/share/doc/pepsi/doc")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    installed.sort();
    let expected: Vec<String> = guides.iter().map(|g| format!("{g}.md.gz")).collect();
    assert_eq!(installed, expected, "/usr/share/doc/pepsi/doc");
    for name in &installed {
        let path = format!("/usr/share/doc/pepsi/doc/{name}");
        assert_eq!(stat(&path), (0, 0, 0o644), "{path}");
        succeed(Command::new("gzip").args(["-t", &path]));
    }
    assert_eq!(
        std::fs::read_to_string("/usr/share/lintian/overrides/pepsi").unwrap(),
        std::fs::read_to_string(source("packaging/lintian-overrides")).unwrap()
    );

    // The units: every one whose program is installed, each verified by systemd. Any
    // word from systemd-analyze is a failure, but for the back-off keys an older
    // systemd does not know yet.
    let old_systemd = systemd_version() < 254;
    let mut units = Vec::new();
    for unit in files_of("packaging/systemd") {
        let name = unit.file_name().unwrap().to_str().unwrap().to_string();
        let service = unit.with_extension("service");
        if Path::new(&exec_start(&service)).exists() {
            units.push(name);
        }
    }
    assert!(
        units.contains(&"pepsi-dispatch.service".to_string()),
        "{units:?}"
    );
    assert!(
        units.contains(&"pepsi-failure-bouncer.service".to_string()),
        "{units:?}"
    );
    if Path::new("/usr/bin/pepsi-queue").exists() {
        assert!(
            units.contains(&"pepsi-metrics.timer".to_string()),
            "{units:?}"
        );
    }
    let ingress = Path::new("/usr/bin/pepsi-ingress").exists();
    if ingress {
        assert!(
            units.contains(&"pepsi-ingress.service".to_string()),
            "{units:?}"
        );
    }
    for unit in &units {
        let path = format!("{UNIT_DIR}/{unit}");
        assert_eq!(stat(&path), (0, 0, 0o644), "{path}");
        let verify = output(Command::new("systemd-analyze").arg("verify").arg(&path));
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&verify.stdout),
            String::from_utf8_lossy(&verify.stderr)
        );
        let unexpected: Vec<&str> = said
            .lines()
            .filter(|l| {
                !(old_systemd
                    && KEYS_FROM_254
                        .iter()
                        .any(|k| l.contains(&format!("Unknown key '{k}' in section [Service]"))))
            })
            .collect();
        assert!(
            verify.status.success() && unexpected.is_empty(),
            "systemd-analyze verify {path}:\n{said}"
        );
    }
    let wants = Path::new("/etc/systemd/system/multi-user.target.wants");
    for enabled in ["pepsi-dispatch.service", "pepsi-failure-bouncer.service"] {
        assert!(wants.join(enabled).is_symlink(), "{enabled} is enabled");
    }
    // The ingress is not: it needs [pepsi-ingress] STAGE, and opens a port.
    assert!(
        !wants.join("pepsi-ingress.service").is_symlink(),
        "pepsi-ingress.service is not enabled by the package"
    );
    // A unit the package does not enable, enabled by the administrator (systemctl
    // enable works without a running systemd): purge must remove its links too.
    for unit in units.iter().filter(|u| u.ends_with(".timer")) {
        succeed(Command::new("systemctl").args(["enable", unit]));
        let link = format!("/etc/systemd/system/timers.target.wants/{unit}");
        assert!(Path::new(&link).is_symlink(), "{link}");
    }

    // The installed programs against a database, started as root with the default
    // [pepsi] RUN_AS: they switch to pepsi before they connect.
    let db = TestDb::empty();
    let connection = as_pepsi(&db);
    let dir = TempDir::new("package");
    // An exec stage delivering into a folder of pepsi-exec's: the command runs as the
    // default USER, through the installed dispatcher's keeper.
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let delivered = dir.path("delivered");
    std::fs::create_dir(&delivered).unwrap();
    succeed(
        Command::new("chown")
            .arg("pepsi-exec:pepsi-exec")
            .arg(&delivered),
    );
    let deliver = dir.write(
        "deliver",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID.eml\n", delivered.display()),
    );
    std::fs::set_permissions(&deliver, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The ingress's socket, in a directory only root may write: pepsi-ingress makes it
    // before it switches to pepsi.
    let socket = dir.path("lmtp");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi-postgres]\nCONNECTION = {connection}\n\n\
             [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n\
             [pepsi-ingress]\nLISTEN = unix:{}\nSTAGE = in\n\n\
             [stage-in]\nPROGRAM = pepsi-stage-pass\nNEXT = deliver\n\n\
             [stage-deliver]\nPROGRAM = pepsi-stage-exec\nCOMMAND = {}\nNEXT = out\n\n\
             [stage-out]\nPROGRAM = pepsi-stage-discard\n\n\
             [stage-bounce]\nPROGRAM = pepsi-stage-bounce\nNEXT = out\n",
            socket.display(),
            deliver.display()
        ),
    );
    let conf = conf.to_str().unwrap();
    let run = |program: &str, args: &[&str]| {
        succeed(
            Command::new(format!("/usr/bin/{program}"))
                .arg("-c")
                .arg(conf)
                .args(args)
                .env_remove("PEPSI_CONFIG"),
        )
    };
    run("pepsi-setup", &["schema"]);
    let mut client = db.client();
    let version: i32 = client
        .query_one(pepsi::db::sql::READ_SCHEMA_VERSION, &[])
        .unwrap()
        .get(0);
    assert_eq!(version, pepsi::db::schema::version());
    let check = run("pepsi-dispatch", &["check"]);
    assert!(!check.contains("error"), "{check}");
    if Path::new("/usr/bin/pepsi-queue").exists() {
        run("pepsi-queue", &["status"]);
        // Its other names, through the installed links: a setting written, read back
        // and removed; the configuration checked as pepsi-dispatch checks it.
        run(
            "pepsi-settings",
            &["set", "Rcpt@example.org", "in", "MAX_LIFETIME", "2h"],
        );
        assert_eq!(
            run("pepsi-settings", &["list"]),
            "rcpt@example.org [stage-in] MAX_LIFETIME = 2h\n"
        );
        run(
            "pepsi-settings",
            &["unset", "rcpt@example.org", "in", "MAX_LIFETIME"],
        );
        assert_eq!(run("pepsi-config", &["check"]), check);
    }
    run("pepsi-failure-bouncer", &["sweep"]);

    // Mail flows: a message through pass and discard, by workers the installed
    // dispatcher starts through the installed links, all as pepsi.
    let mut dispatcher = Logged::spawn(
        "pepsi-dispatch",
        Command::new("/usr/bin/pepsi-dispatch").args(["-c", conf, "serve"]),
    );
    let id = util::inject(
        &mut client,
        "in",
        "sender@example.org",
        &["rcpt@example.org"],
    );
    wait_until(Duration::from_secs(30), "the message is delivered", || {
        util::row_at(&mut client, id).is_none()
    });
    let mail = delivered.join(format!("{id}.eml"));
    assert!(mail.exists(), "{}", dispatcher.log());
    assert_eq!(
        std::fs::metadata(&mail).unwrap().uid(),
        exec_uid,
        "the command ran as pepsi-exec"
    );
    let dispatcher_uids = uids(dispatcher.pid());
    assert!(
        dispatcher_uids.iter().all(|u| *u == uid),
        "the dispatcher runs as pepsi: {dispatcher_uids:?}"
    );

    // A message over LMTP, through the installed pepsi-ingress: started as root, it
    // makes its socket and then runs as pepsi; the dispatcher delivers the message.
    if ingress {
        let mut ingress = Logged::spawn(
            "pepsi-ingress",
            Command::new("/usr/bin/pepsi-ingress").args(["-c", conf, "serve"]),
        );
        ingress.wait_log("accepting mail for stage in", Duration::from_secs(30));
        let ingress_uids = uids(ingress.pid());
        assert!(
            ingress_uids.iter().all(|u| *u == uid),
            "pepsi-ingress runs as pepsi: {ingress_uids:?}"
        );
        assert_eq!(
            stat(socket.to_str().unwrap()).0,
            0,
            "the socket was made as root"
        );
        let id = deliver_over_lmtp(&socket, "sender@example.org", "rcpt@example.org");
        wait_until(
            Duration::from_secs(30),
            "the LMTP message is delivered",
            || util::row_at(&mut client, id).is_none(),
        );
        let mail = std::fs::read_to_string(delivered.join(format!("{id}.eml")))
            .unwrap_or_else(|e| panic!("message {id}: {e}\n{}", dispatcher.log()));
        assert!(mail.contains("Hello by LMTP."), "{mail}");
        ingress.signal(libc::SIGTERM);
        let exit = ingress.wait(Duration::from_secs(30));
        assert!(exit.success(), "{exit}:\n{}", ingress.log());
        // It wrote its counters at shutdown, as pepsi.
        let accepted: i64 = client
            .query_one("SELECT accepted FROM pepsi.ingress_stats", &[])
            .unwrap()
            .get(0);
        assert_eq!(accepted, 1, "{}", ingress.log());
    }
    dispatcher.signal(libc::SIGTERM);
    let exit = dispatcher.wait(Duration::from_secs(30));
    assert!(exit.success(), "{exit}:\n{}", dispatcher.log());
    drop(client);

    // Purge: the files and the units go, the account stays (Debian keeps system
    // accounts: files it owns elsewhere must not pass to a later account).
    let purged = dpkg(&["--purge", "pepsi"]);
    assert!(
        purged.status.success(),
        "dpkg --purge pepsi:\n{}{}",
        String::from_utf8_lossy(&purged.stdout),
        String::from_utf8_lossy(&purged.stderr)
    );
    assert!(!pepsi_installed());
    assert!(account("pepsi").is_some(), "the pepsi account stays");
    for gone in [
        "/etc/pepsi",
        "/var/lib/pepsi",
        "/usr/share/pepsi",
        "/usr/share/doc/pepsi",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} is gone");
    }
    for name in programs() {
        assert!(
            !Path::new(&format!("/usr/bin/{name}")).exists(),
            "/usr/bin/{name} is gone"
        );
    }
    for stage in &builtins {
        let link = format!("/usr/bin/pepsi-stage-{stage}");
        assert!(!Path::new(&link).is_symlink(), "{link} is gone");
    }
    for name in pepsi::queue::multicall::LINKS {
        let link = format!("/usr/bin/{name}");
        assert!(!Path::new(&link).is_symlink(), "{link} is gone");
    }
    for unit in &units {
        for path in [
            format!("{UNIT_DIR}/{unit}"),
            format!("/etc/systemd/system/{unit}"),
            format!("/etc/systemd/system/multi-user.target.wants/{unit}"),
            format!("/etc/systemd/system/timers.target.wants/{unit}"),
        ] {
            assert!(
                !Path::new(&path).is_symlink() && !Path::new(&path).exists(),
                "{path} is gone"
            );
        }
    }
    let overrides = succeed(Command::new("dpkg-statoverride").arg("--list"));
    assert!(
        !overrides.contains("pepsi"),
        "the overrides are gone:\n{overrides}"
    );
}
