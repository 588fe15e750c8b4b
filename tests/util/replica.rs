//! A primary and a streaming standby of its own for a failover test: two throwaway
//! clusters in a private temporary directory (owned by `postgres` when the tests run
//! as root), each listening only on a Unix socket in a directory of its own, the
//! standby made with `pg_basebackup -R -X stream`. The test kills the primary (every
//! process of it with SIGKILL), promotes the standby, and afterwards starts the old
//! primary's data directory alone, on a socket no connection string names, to read
//! what it had committed that the standby never received.
//!
//! Independent of the test binary's shared server ([`super::pg`]): it needs the server
//! binaries (`initdb`, `pg_ctl`, `pg_basebackup`, `pg_waldump`), also when the tests
//! use `DATABASE_URL`. Both clusters are stopped and removed when the [`Pair`] is
//! dropped, also when the test fails, and at the start of a later run when a killed run
//! left them behind.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

use super::dispatcher::{alive, children_of};
use super::pg::{as_owner, bindir, run};

/// The database the pair's test uses.
pub const DB: &str = "pepsi";

/// Socket "ports" (only the name of the socket file: nothing listens on TCP).
const PRIMARY_PORT: u16 = 5521;
const STANDBY_PORT: u16 = 5522;
const ALONE_PORT: u16 = 5523;

/// The prefix of a pair's directory under the temporary directory; the pid of the
/// test process that made it follows.
const PREFIX: &str = "pepsi-pair-";

/// One cluster of the pair.
pub struct Node {
    pub data: PathBuf,
    pub sock: PathBuf,
    pub port: u16,
    pub log: PathBuf,
}

impl Node {
    /// A connection string for the pair's database on this node alone.
    pub fn conninfo(&self) -> String {
        format!(
            "host={} port={} user=postgres dbname={DB}",
            self.sock.display(),
            self.port
        )
    }

    /// A client of this node alone (any: also a standby).
    pub fn client(&self) -> Result<Client, String> {
        Client::connect(&self.conninfo(), NoTls)
            .map_err(|e| format!("connect to {}: {e}", self.conninfo()))
    }

    /// The postmaster's pid, from `postmaster.pid`.
    pub fn postmaster(&self) -> Option<u32> {
        std::fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// The server log's last `n` lines.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// A primary and its streaming standby.
pub struct Pair {
    dir: PathBuf,
    bindir: PathBuf,
    pub primary: Node,
    pub standby: Node,
}

fn append(file: &Path, text: &str) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
        .map_err(|e| format!("cannot append to {}: {e}", file.display()))
}

/// The settings of a node of the pair: its own socket, nothing on TCP.
fn node_settings(node: &Node) -> String {
    format!(
        "\nlisten_addresses = ''\nunix_socket_directories = '{}'\nport = {}\n",
        node.sock.display(),
        node.port
    )
}

/// Stops and removes the pairs of test processes that no longer exist.
fn remove_stale(bindir: &Path) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if super::pg::process_alive(pid) {
            continue;
        }
        for data in ["primary", "standby"] {
            let _ = as_owner(&bindir.join("pg_ctl"))
                .arg("-D")
                .arg(e.path().join(data))
                .args(["-m", "immediate", "-w", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(e.path());
    }
}

/// The directory of the server binaries a pair needs (`initdb`, `pg_ctl`,
/// `pg_basebackup`, `pg_waldump`), or why there is none.
pub fn server_binaries() -> Result<PathBuf, String> {
    let dir = bindir()?;
    // A `PATH` directory may hold links to only some of the server binaries: the others
    // are beside the one `initdb` links to.
    let dir = if dir.join("pg_basebackup").is_file() {
        dir
    } else {
        std::fs::canonicalize(dir.join("initdb"))
            .ok()
            .and_then(|initdb| Some(initdb.parent()?.to_path_buf()))
            .unwrap_or(dir)
    };
    for tool in ["initdb", "pg_ctl", "pg_basebackup", "pg_waldump"] {
        if !dir.join(tool).is_file() {
            return Err(format!(
                "{tool} is not in {} (apt-get install postgresql)",
                dir.display()
            ));
        }
    }
    Ok(dir)
}

impl Pair {
    /// Starts a primary (`wal_level = replica`, `fsync = off`: the fault is a process
    /// kill, which keeps the operating system's page cache) with the pair's database,
    /// empty. The standby comes with [`Pair::start_standby`], after the test has set
    /// the database up (or before: it replicates either way).
    pub fn start() -> Result<Pair, String> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let bindir = server_binaries()?;
        remove_stale(&bindir);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{PREFIX}{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let node = |name: &str, port| Node {
            data: dir.join(name),
            sock: dir.join(format!("sock-{name}")),
            port,
            log: dir.join(format!("{name}.log")),
        };
        let pair = Pair {
            primary: node("primary", PRIMARY_PORT),
            standby: node("standby", STANDBY_PORT),
            bindir,
            dir,
        };
        for d in [&pair.primary.sock, &pair.standby.sock] {
            std::fs::create_dir_all(d)
                .map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        if super::is_root() {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&pair.dir))?;
        }
        run(as_owner(&pair.bindir.join("initdb"))
            .arg("-D")
            .arg(&pair.primary.data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ]))?;
        append(
            &pair.primary.data.join("postgresql.conf"),
            &format!(
                "{}fsync = off\nwal_level = replica\nmax_wal_senders = 4\n\
                 max_connections = 100\nlog_min_messages = warning\n",
                node_settings(&pair.primary)
            ),
        )?;
        pair.pg_ctl_start(&pair.primary)?;
        let mut admin = Client::connect(
            &format!(
                "host={} port={} user=postgres dbname=postgres",
                pair.primary.sock.display(),
                pair.primary.port
            ),
            NoTls,
        )
        .map_err(|e| format!("connect to the new primary: {e}"))?;
        admin
            .batch_execute(&format!("CREATE DATABASE {DB}"))
            .map_err(|e| e.to_string())?;
        Ok(pair)
    }

    fn pg_ctl(&self) -> Command {
        as_owner(&self.bindir.join("pg_ctl"))
    }

    fn pg_ctl_start(&self, node: &Node) -> Result<(), String> {
        // `-l`: the server's output goes to its log, not to a pipe `run` reads to its
        // end.
        run(self
            .pg_ctl()
            .arg("-D")
            .arg(&node.data)
            .arg("-l")
            .arg(&node.log)
            .args(["-w", "-t", "60", "start"]))
        .map_err(|e| format!("{e}\nits log:\n{}", node.log_tail(10)))
    }

    /// `pg_basebackup -R -X stream` of the primary, started as its streaming standby
    /// on its own socket. It copies the primary's configuration, so it is told
    /// `synchronous_standby_names = ''`: promoted, it must not wait for a standby of
    /// its own on every commit.
    pub fn start_standby(&self) -> Result<(), String> {
        run(as_owner(&self.bindir.join("pg_basebackup"))
            .args(["-R", "-X", "stream", "-c", "fast", "-U", "postgres", "-D"])
            .arg(&self.standby.data)
            .arg("-h")
            .arg(&self.primary.sock)
            .arg("-p")
            .arg(self.primary.port.to_string()))?;
        append(
            &self.standby.data.join("postgresql.conf"),
            &format!(
                "{}synchronous_standby_names = ''\n",
                node_settings(&self.standby)
            ),
        )?;
        self.pg_ctl_start(&self.standby)?;
        self.wait_replication("streaming", |_| true)
    }

    /// Makes the replication synchronous: every commit of a session with
    /// `synchronous_commit = on` waits until the standby has flushed it.
    pub fn make_synchronous(&self) -> Result<(), String> {
        append(
            &self.primary.data.join("postgresql.conf"),
            "synchronous_standby_names = '*'\n",
        )?;
        run(self
            .pg_ctl()
            .arg("-D")
            .arg(&self.primary.data)
            .arg("reload"))?;
        self.wait_replication("synchronous", |sync| sync == "sync")
    }

    fn wait_replication(&self, what: &str, ok: impl Fn(&str) -> bool) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut c = self.primary.client()?;
        loop {
            let row = c
                .query_opt(
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
                    &[],
                )
                .map_err(|e| e.to_string())?;
            if row.is_some_and(|r| ok(r.get::<_, String>(0).as_str())) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the standby is not {what} after 30 s; its log:\n{}",
                    self.standby.log_tail(20)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The connection string that names both nodes and asks for the one that takes
    /// writes (doc/install.md, "Pointing the programs at a database").
    pub fn multi_host(&self) -> String {
        format!(
            "host={},{} port={},{} target_session_attrs=read-write user=postgres dbname={DB}",
            self.primary.sock.display(),
            self.standby.sock.display(),
            self.primary.port,
            self.standby.port
        )
    }

    /// Waits until the standby has replayed everything the primary wrote so far.
    pub fn wait_caught_up(&self) -> Result<(), String> {
        let mut p = self.primary.client()?;
        let mut s = self.standby.client()?;
        let lsn: String = p
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .map_err(|e| e.to_string())?
            .get(0);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let done: bool = s
                .query_one(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                    &[&lsn],
                )
                .map_err(|e| e.to_string())?
                .get(0);
            if done {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the standby did not replay up to {lsn} in 60 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the primary as a crash does: its postmaster is stopped first (so it forks
    /// nothing more), then every child of it and the postmaster get SIGKILL, one right
    /// after the other. (Each child of a postmaster is a process group of its own, so a
    /// group kill would not reach them.) What the processes wrote to their files stays
    /// in the page cache: the data directory keeps every WAL record written, also
    /// those the standby never received. Returns how many there were, once they are all gone.
    pub fn kill_primary(&self) -> Result<usize, String> {
        let postmaster = self
            .primary
            .postmaster()
            .filter(|&p| alive(p))
            .ok_or("the primary is not running")?;
        // SAFETY: signalling the primary's processes, which this test started.
        unsafe { libc::kill(postmaster as i32, libc::SIGSTOP) };
        let mut victims = children_of(postmaster);
        for &child in &victims {
            // SAFETY: as above.
            unsafe { libc::kill(child as i32, libc::SIGKILL) };
        }
        // SAFETY: as above.
        unsafe { libc::kill(postmaster as i32, libc::SIGKILL) };
        victims.push(postmaster);
        let deadline = Instant::now() + Duration::from_secs(10);
        while victims.iter().any(|&p| alive(p)) {
            if Instant::now() > deadline {
                return Err("the primary's processes outlived SIGKILL by 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // A dead postmaster nobody has reaped yet (the machine's init reaps when it
        // gets to it) still "runs" for a server started on its data directory, which
        // checks its pid file's pid with kill(pid, 0): the file goes once the
        // postmaster is dead, reaped or not.
        let reaped = Instant::now() + Duration::from_secs(2);
        while std::path::Path::new(&format!("/proc/{postmaster}")).exists() {
            if Instant::now() > reaped {
                let _ = std::fs::remove_file(self.primary.data.join("postmaster.pid"));
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(victims.len())
    }

    /// Freezes the primary as a storage freeze or a paused machine does: every process
    /// gets SIGSTOP, the postmaster first (so it forks nothing more). Its sockets stay
    /// open: the kernel still accepts connections, nobody answers them. Returns how
    /// many processes there were; [`Pair::kill_primary`] ends them later.
    pub fn freeze_primary(&self) -> Result<usize, String> {
        let postmaster = self
            .primary
            .postmaster()
            .filter(|&p| alive(p))
            .ok_or("the primary is not running")?;
        // SAFETY: signalling the primary's processes, which this test started.
        unsafe { libc::kill(postmaster as i32, libc::SIGSTOP) };
        let children = children_of(postmaster);
        for &child in &children {
            // SAFETY: as above.
            unsafe { libc::kill(child as i32, libc::SIGSTOP) };
        }
        Ok(children.len() + 1)
    }

    /// How the primary sees the standby (`pg_stat_replication.sync_state`: `sync`,
    /// `async`), or `none` when it is not streaming.
    pub fn sync_state(&self) -> Result<String, String> {
        let row = self
            .primary
            .client()?
            .query_opt(
                "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
                &[],
            )
            .map_err(|e| e.to_string())?;
        Ok(row.map_or_else(|| "none".into(), |r| r.get(0)))
    }

    /// The standby's last received (and flushed) WAL position.
    pub fn standby_received(&self) -> Result<String, String> {
        Ok(self
            .standby
            .client()?
            .query_one("SELECT pg_last_wal_receive_lsn()::text", &[])
            .map_err(|e| e.to_string())?
            .get(0))
    }

    /// `pg_ctl promote -w`: the standby takes writes when it returns.
    pub fn promote(&self) -> Result<(), String> {
        run(self
            .pg_ctl()
            .arg("-D")
            .arg(&self.standby.data)
            .args(["-w", "-t", "60", "promote"]))
    }

    /// The bytes of WAL the killed primary holds beyond `from` (what the standby
    /// received), by `pg_waldump` of its data directory before it is started again,
    /// and how many commit records lie there.
    pub fn wal_beyond(&self, from: &str) -> Result<(u64, usize), String> {
        let out = Command::new(self.bindir.join("pg_waldump"))
            .arg("-p")
            .arg(self.primary.data.join("pg_wal"))
            .args(["-s", from])
            .output()
            .map_err(|e| format!("cannot run pg_waldump: {e}"))?;
        // It ends with an error at the end of the valid WAL (or, when there is
        // nothing beyond `from`, that it finds no record there).
        let text = String::from_utf8_lossy(&out.stdout);
        let lsn = |s: &str| -> Option<u64> {
            let (hi, lo) = s.trim().trim_end_matches(',').split_once('/')?;
            Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
        };
        let start = lsn(from).ok_or_else(|| format!("not an LSN: {from}"))?;
        let mut end = start;
        let mut commits = 0;
        for line in text.lines() {
            let field = |name: &str| {
                line.split_once(name)
                    .map(|(_, rest)| rest.trim_start().split([',', ' ']).next().unwrap_or(""))
            };
            let (Some(at), Some(total)) = (
                field("lsn:").and_then(lsn),
                line.split_once("len (rec/tot):")
                    .and_then(|(_, r)| r.split(',').next())
                    .and_then(|r| r.split('/').nth(1))
                    .and_then(|t| t.trim().parse::<u64>().ok()),
            ) else {
                continue;
            };
            end = end.max(at + total);
            commits += usize::from(line.contains("desc: COMMIT"));
        }
        Ok((end - start, commits))
    }

    /// Starts the killed primary's data directory alone, on a socket of its own that
    /// no connection string names and without waiting for any standby: crash recovery
    /// replays whatever it had written. Returns a node to read it through.
    pub fn start_old_primary_alone(&self) -> Result<Node, String> {
        let node = Node {
            data: self.primary.data.clone(),
            sock: self.dir.join("sock-alone"),
            port: ALONE_PORT,
            log: self.dir.join("alone.log"),
        };
        std::fs::create_dir_all(&node.sock).map_err(|e| e.to_string())?;
        if super::is_root() {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&node.sock))?;
        }
        append(
            &node.data.join("postgresql.conf"),
            &format!("{}synchronous_standby_names = ''\n", node_settings(&node)),
        )?;
        self.pg_ctl_start(&node)?;
        Ok(node)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for node in [&self.primary, &self.standby] {
            // Only a postmaster that runs (a killed primary leaves its pid file, and
            // the pid may be another process's by now).
            let running = node.postmaster().is_some_and(|pid| {
                alive(pid)
                    && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|comm| comm.trim_end() == "postgres")
            });
            if running {
                // A frozen primary (a test that failed before it killed it) is woken,
                // or it would never stop.
                if let Some(pid) = node.postmaster() {
                    for p in children_of(pid).into_iter().chain([pid]) {
                        // SAFETY: waking the test's own server processes.
                        unsafe { libc::kill(p as i32, libc::SIGCONT) };
                    }
                }
                let _ = self
                    .pg_ctl()
                    .arg("-D")
                    .arg(&node.data)
                    .args(["-m", "immediate", "-w", "stop"])
                    .output();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
