//! A real PostgreSQL for the tests, with nothing to set up by hand.
//!
//! With `PEPSI_TEST_DATABASE_URL` or `DATABASE_URL` set, that server is used (the role
//! needs CREATEDB). Otherwise one throwaway cluster is started for the whole test
//! binary: initdb + pg_ctl from `PATH` or `/usr/lib/postgresql/*/bin`, a Unix socket in
//! a private temporary directory, run as the `postgres` account when the tests run as
//! root (initdb refuses root). It is stopped and removed when the test binary exits.
//! Each test gets its own database, cloned from a template that already holds the
//! schema. A test binary that owns its cluster may also restart it ([`restart`]), stop
//! it and start it again ([`stop`], [`start_again`]) and change its settings
//! ([`admin`] with `ALTER SYSTEM`): every test binary has a cluster of its own, so this
//! disturbs no other binary's tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use postgres::{Client, NoTls};

/// The server every test uses.
pub struct Server {
    /// The connection string before a database name is added.
    base: String,
    /// The template database with the schema installed.
    template: String,
    /// The throwaway cluster's directory, when we started one.
    cluster: Option<PathBuf>,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
static CLUSTER_DIR: OnceLock<PathBuf> = OnceLock::new();
static NEXT_DB: AtomicU32 = AtomicU32::new(0);

/// The shared server, set up once. A failure of that set-up is reported by every test
/// (and the set-up is not retried by each of them).
pub fn server() -> &'static Server {
    match SERVER.get_or_init(|| {
        std::panic::catch_unwind(start)
            .unwrap_or_else(|_| Err("the test server set-up panicked".into()))
    }) {
        Ok(s) => s,
        Err(e) => panic!("no PostgreSQL for the tests: {e}"),
    }
}

/// Runs a command to its end; its output in the error when it fails.
pub(super) fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A command run as the cluster's owner: `postgres` when we are root.
pub(super) fn as_owner(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn find_bindir() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                return Ok(dir);
            }
        }
    }
    let mut candidates: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((v, bin))
        })
        .collect();
    candidates.sort();
    candidates.pop().map(|(_, p)| p).ok_or_else(|| {
        "PostgreSQL server binaries (initdb, pg_ctl) were not found on PATH or under \
         /usr/lib/postgresql/*/bin; install them (apt-get install postgresql) or set \
         DATABASE_URL to a server where this role may create databases"
            .to_string()
    })
}

/// Stops clusters left behind by test processes that no longer exist.
fn remove_stale(bindir: &Path) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("pepsi-test-")
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = as_owner(&bindir.join("pg_ctl"))
            .args(["-D"])
            .arg(e.path().join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(e.path());
    }
}

extern "C" fn stop_cluster() {
    if let Some(dir) = CLUSTER_DIR.get() {
        if let Ok(bindir) = find_bindir() {
            let _ = as_owner(&bindir.join("pg_ctl"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-m", "immediate", "-w", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn start_cluster() -> Result<(String, PathBuf), String> {
    let bindir = find_bindir()?;
    remove_stale(&bindir);
    let dir = std::env::temp_dir().join(format!("pepsi-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = dir.join("data");
    let sock = dir.join("sock");
    std::fs::create_dir_all(&sock).map_err(|e| format!("cannot create {}: {e}", sock.display()))?;
    CLUSTER_DIR.set(dir.clone()).ok();
    // SAFETY: registering a plain extern "C" function.
    unsafe { libc::atexit(stop_cluster) };
    if is_root() {
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir))?;
        // The socket's directory admits the cluster's owner, root and the group
        // `nogroup` (the account `nobody`, which tests use as a service account), and
        // nobody else: an exec command running as another account (`daemon`) cannot
        // reach the database even though the cluster trusts local connections.
        if run(Command::new("chgrp").arg("nogroup").arg(&sock)).is_ok() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o750))
                .map_err(|e| format!("cannot restrict {}: {e}", sock.display()))?;
        }
    }
    run(as_owner(&bindir.join("initdb")).arg("-D").arg(&data).args([
        "-U",
        "postgres",
        "--auth=trust",
        "-E",
        "UTF8",
        "--no-sync",
        "--locale=C",
    ]))?;
    let conf = format!(
        "\nlisten_addresses = ''\nunix_socket_directories = '{}'\nfsync = off\nfull_page_writes = off\n\
         max_connections = 300\nmax_prepared_transactions = 10\nshared_preload_libraries = 'pg_stat_statements'\n\
         pg_stat_statements.track = all\npg_stat_statements.track_planning = on\nlog_min_messages = warning\n",
        sock.display()
    );
    std::fs::OpenOptions::new()
        .append(true)
        .open(data.join("postgresql.conf"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
        .map_err(|e| format!("cannot configure the cluster: {e}"))?;
    run(as_owner(&bindir.join("pg_ctl"))
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("server.log"))
        .args(["-w", "-t", "60", "start"]))?;
    Ok((
        format!("host={} port=5432 user=postgres", sock.display()),
        dir,
    ))
}

fn start() -> Result<Server, String> {
    let external = std::env::var("PEPSI_TEST_DATABASE_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .ok()
        .filter(|s| !s.is_empty());
    let (base, cluster) = match external {
        Some(url) => (url, None),
        None => {
            let (base, dir) = start_cluster()?;
            (base, Some(dir))
        }
    };
    let template = format!("pepsi_template_{}", std::process::id());
    let mut admin = Client::connect(&with_db(&base, "postgres"), NoTls)
        .map_err(|e| format!("cannot connect to the test server: {e}"))?;
    if cluster.is_none() {
        // On a server that outlives the run: what earlier runs left (killed, or a
        // panic before the exit), and at this run's exit what it made.
        drop_test_databases(&mut admin, |pid| !process_alive(pid));
        EXTERNAL_BASE.set(base.clone()).ok();
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(drop_own_databases) };
    }
    // Two statements: CREATE DATABASE cannot run inside the implicit transaction of a
    // multi-statement query.
    for sql in [
        format!("DROP DATABASE IF EXISTS {template}"),
        format!("CREATE DATABASE {template}"),
    ] {
        admin.batch_execute(&sql).map_err(|e| {
            format!(
                "cannot create the template database: {}",
                pepsi::db::describe(&e)
            )
        })?;
    }
    let mut t = pepsi::db::Client::unwatched(
        Client::connect(&with_db(&base, &template), NoTls).map_err(|e| e.to_string())?,
    );
    pepsi::db::schema::install(&mut t).map_err(|e| format!("cannot install the schema: {e}"))?;
    // Statement counting for the round-trip tests; optional on an external server.
    let _ = t.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
    drop(t);
    Ok(Server {
        base,
        template,
        cluster,
    })
}

/// The server's connection string without a database (`DATABASE_URL`'s form), for a
/// child test run pointed at this one's server.
pub fn base_conninfo() -> &'static str {
    &server().base
}

/// The external server's connection string, for the clean-up at exit.
static EXTERNAL_BASE: OnceLock<String> = OnceLock::new();

/// The process whose test databases these are: `pepsi_template_PID`, `pepsi_tPID_N`,
/// `pepsi_ePID_N`, `pepsi_oPID_N` (see [`TestDb`]); `None` for any other name.
pub fn test_database_run(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("pepsi_")?;
    let digits = |s: &str| (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then_some(());
    if let Some(pid) = rest.strip_prefix("template_") {
        digits(pid)?;
        return pid.parse().ok();
    }
    let rest = rest.strip_prefix(['t', 'e', 'o'])?;
    let (pid, n) = rest.split_once('_')?;
    digits(pid)?;
    digits(n)?;
    pid.parse().ok()
}

/// Is a process of this machine alive (a test run still going)?
pub fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 checks only whether the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Drops every test database of the server whose run `gone` says is over.
fn drop_test_databases(admin: &mut Client, gone: impl Fn(u32) -> bool) {
    let Ok(rows) = admin.query(
        "SELECT datname::text FROM pg_catalog.pg_database WHERE datname LIKE 'pepsi\\_%'",
        &[],
    ) else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        if test_database_run(&name).is_some_and(&gone) {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
        }
    }
}

/// At exit, on an external server: drops this run's template and whatever test
/// databases it still has (a panic does not drop the template, nor a database of a
/// test that did not unwind).
extern "C" fn drop_own_databases() {
    let Some(base) = EXTERNAL_BASE.get() else {
        return;
    };
    // On a thread of its own: the exiting thread's thread-locals, the database
    // client's runtime among them, may already be gone.
    let clean_up = std::thread::Builder::new().spawn(move || {
        if let Ok(mut admin) = Client::connect(&with_db(base, "postgres"), NoTls) {
            let own = std::process::id();
            drop_test_databases(&mut admin, |pid| pid == own);
        }
    });
    if let Ok(handle) = clean_up {
        let _ = handle.join();
    }
}

/// `base` pointed at database `name`.
fn with_db(base: &str, name: &str) -> String {
    if base.starts_with("postgres://") || base.starts_with("postgresql://") {
        let (head, query) = base
            .split_once('?')
            .map_or((base, None), |(h, q)| (h, Some(q)));
        let scheme_end = head.find("://").unwrap() + 3;
        let host_end = head[scheme_end..]
            .find('/')
            .map_or(head.len(), |i| scheme_end + i);
        let mut url = format!("{}/{name}", &head[..host_end]);
        if let Some(q) = query {
            url.push('?');
            url.push_str(q);
        }
        url
    } else {
        format!("{base} dbname={name}")
    }
}

/// The password of every login role the tests create, so that they also work on a
/// server that asks for one.
pub const LOGIN_PASSWORD: &str = "pepsi-test";

/// `conninfo` (key=value or URL) connecting as `user` with [`LOGIN_PASSWORD`].
fn as_user(conninfo: &str, user: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let sep = if conninfo.contains('?') { '&' } else { '?' };
        format!("{conninfo}{sep}user={user}&password={LOGIN_PASSWORD}")
    } else {
        format!("{conninfo} user={user} password={LOGIN_PASSWORD}")
    }
}

/// Creates the login role `name` (with [`LOGIN_PASSWORD`]), a member of each of
/// `groups`, unless it exists. Roles are cluster-wide: tests running at the same time
/// may create the same one, and that is fine. Returns the name.
pub fn login_role(name: &str, groups: &[&str]) -> String {
    let mut admin = admin();
    let member_of = if groups.is_empty() {
        String::new()
    } else {
        format!(" IN ROLE {}", groups.join(", "))
    };
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN                CREATE ROLE {name} LOGIN PASSWORD '{LOGIN_PASSWORD}'{member_of};              EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;              END $$"
        ))
        .unwrap_or_else(|e| panic!("cannot create the login role {name}: {e}"));
    name.to_string()
}

/// A fresh database for one test, dropped when the test ends.
pub struct TestDb {
    /// The database name.
    pub name: String,
    /// A connection string for it.
    pub conninfo: String,
}

impl TestDb {
    /// Clones the template.
    pub fn new() -> TestDb {
        let server = server();
        let name = format!(
            "pepsi_t{}_{}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = Client::connect(&with_db(&server.base, "postgres"), NoTls)
            .expect("connect to the test server");
        // CREATE DATABASE … TEMPLATE fails while another session is connected to the
        // template; nothing but the set-up connects to it, so one retry is plenty.
        let sql = format!("CREATE DATABASE {name} TEMPLATE {}", server.template);
        if let Err(e) = admin.batch_execute(&sql) {
            std::thread::sleep(std::time::Duration::from_millis(200));
            admin
                .batch_execute(&sql)
                .unwrap_or_else(|_| panic!("cannot create a test database: {e}"));
        }
        TestDb {
            conninfo: with_db(&server.base, &name),
            name,
        }
    }

    /// A fresh database without the Pepsi schema (for `pepsi-setup` itself).
    pub fn empty() -> TestDb {
        let server = server();
        let name = format!(
            "pepsi_e{}_{}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = Client::connect(&with_db(&server.base, "postgres"), NoTls)
            .expect("connect to the test server");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create an empty test database");
        TestDb {
            conninfo: with_db(&server.base, &name),
            name,
        }
    }

    /// A fresh database without the Pepsi schema, owned by `owner` (a role of
    /// [`login_role`]), for `pepsi-setup` run as a role that is not a superuser.
    pub fn empty_owned_by(owner: &str) -> TestDb {
        let server = server();
        let name = format!(
            "pepsi_o{}_{}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = Client::connect(&with_db(&server.base, "postgres"), NoTls)
            .expect("connect to the test server");
        admin
            .batch_execute(&format!("CREATE DATABASE {name} OWNER {owner}"))
            .expect("create an empty test database");
        TestDb {
            conninfo: with_db(&server.base, &name),
            name,
        }
    }

    /// A connection string for this database as `role` (a role of [`login_role`]).
    pub fn conninfo_as(&self, role: &str) -> String {
        as_user(&self.conninfo, role)
    }

    /// A new client connection as `role`.
    pub fn client_as(&self, role: &str) -> Client {
        Client::connect(&self.conninfo_as(role), NoTls)
            .unwrap_or_else(|e| panic!("connect to the test database as {role}: {e}"))
    }

    /// A new client connection.
    pub fn client(&self) -> Client {
        Client::connect(&self.conninfo, NoTls).expect("connect to the test database")
    }

    /// The connection string as a `pepsi.conf` CONNECTION value.
    pub fn connection(&self) -> &str {
        &self.conninfo
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let server = server();
        if let Ok(mut admin) = Client::connect(&with_db(&server.base, "postgres"), NoTls) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// Is this the throwaway cluster (so tests may configure it freely)?
pub fn is_throwaway() -> bool {
    server().cluster.is_some()
}

/// The throwaway cluster's data directory, or None on an external server.
pub fn data_dir() -> Option<PathBuf> {
    server().cluster.as_ref().map(|dir| dir.join("data"))
}

/// The directory holding `initdb` and `pg_ctl`.
pub fn bindir() -> Result<PathBuf, String> {
    find_bindir()
}

/// The `psql` of the server binaries: beside `initdb` (followed through a symbolic
/// link, as a `PATH` directory may hold links to only some of them), else `psql` from
/// `PATH`. For tests that need what the `postgres` client does not expose (notices).
pub fn psql() -> PathBuf {
    let beside = |dir: &Path| Some(dir.join("psql")).filter(|p| p.is_file());
    find_bindir()
        .ok()
        .and_then(|dir| {
            beside(&dir).or_else(|| {
                let initdb = std::fs::canonicalize(dir.join("initdb")).ok()?;
                beside(initdb.parent()?)
            })
        })
        .unwrap_or_else(|| PathBuf::from("psql"))
}

/// A superuser connection to the server's `postgres` database (for `ALTER SYSTEM`,
/// `pg_terminate_backend` and the like).
pub fn admin() -> Client {
    Client::connect(&with_db(&server().base, "postgres"), NoTls)
        .expect("connect to the test server's postgres database")
}

/// Restarts the throwaway cluster and waits until it accepts connections again:
/// `pg_ctl restart`, with `-m fast` (every session terminated at once) when `fast`,
/// else `-m smart` (waits for every session to end). As the `postgres` account when
/// run as root. Every open connection breaks. Fails on an external server.
pub fn restart(fast: bool) -> Result<(), String> {
    let Some(dir) = server().cluster.as_ref() else {
        return Err("the tests use an external server: it cannot be restarted".into());
    };
    let bindir = find_bindir()?;
    // `-l` again: without it the new postmaster would write to pg_ctl's stdout, which
    // `run` reads to its end, so it would wait for the server to exit.
    run(as_owner(&bindir.join("pg_ctl"))
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-l")
        .arg(dir.join("server.log"))
        .args(["-m", if fast { "fast" } else { "smart" }])
        .args(["-w", "-t", "60", "restart"]))
}

/// Stops the throwaway cluster (`pg_ctl stop -m fast`: every session terminated) and
/// leaves it stopped until [`start_again`]. Only for a test binary that owns its
/// cluster and runs nothing else against it meanwhile. Fails on an external server.
pub fn stop() -> Result<(), String> {
    let Some(dir) = server().cluster.as_ref() else {
        return Err("the tests use an external server: it cannot be stopped".into());
    };
    run(as_owner(&find_bindir()?.join("pg_ctl"))
        .arg("-D")
        .arg(dir.join("data"))
        .args(["-m", "fast", "-w", "-t", "60", "stop"]))
}

/// Starts the throwaway cluster again after [`stop`] and waits until it accepts
/// connections.
pub fn start_again() -> Result<(), String> {
    let Some(dir) = server().cluster.as_ref() else {
        return Err("the tests use an external server: it cannot be started".into());
    };
    // `-l` for the reason `restart` gives.
    run(as_owner(&find_bindir()?.join("pg_ctl"))
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-l")
        .arg(dir.join("server.log"))
        .args(["-w", "-t", "60", "start"]))
}
