//! A throwaway cluster of its own that admits local connections by peer
//! authentication through a `pg_ident.conf` map, as doc/roles-and-containment.md's "Database roles"
//! sets a production server up: the operating-system account decides which roles a
//! session may log in as, one account one role. For the tests of what a compromised
//! worker, running under an account of its own, can reach. Root only (the accounts
//! must be switched to); stopped and removed when dropped.
//!
//! Independent of the test binary's shared server ([`super::pg`]), which trusts every
//! local connection.

use std::path::{Path, PathBuf};
use std::process::Command;

use postgres::{Client, NoTls};

use super::pg::{as_owner, bindir, run};

/// The socket "port" (only the name of the socket file: nothing listens on TCP).
const PORT: u16 = 5531;

/// The prefix of a cluster's directory under the temporary directory.
const PREFIX: &str = "pepsi-peer-";

/// A cluster with peer authentication.
pub struct PeerCluster {
    dir: PathBuf,
    bindir: PathBuf,
    data: PathBuf,
    /// The directory of its socket, which every account may reach.
    pub sock: PathBuf,
}

impl PeerCluster {
    /// Starts a cluster whose only way in is a local connection by peer
    /// authentication through the map `map`: (operating-system account, role) pairs;
    /// `root` and `postgres` may log in as `postgres`.
    pub fn start(map: &[(&str, &str)]) -> Result<PeerCluster, String> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let bindir = bindir()?;
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{PREFIX}{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cluster = PeerCluster {
            data: dir.join("data"),
            sock: dir.join("sock"),
            bindir,
            dir,
        };
        std::fs::create_dir_all(&cluster.sock).map_err(|e| e.to_string())?;
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&cluster.dir))?;
        // Everyone may reach the socket, as on Debian (/var/run/postgresql): the map
        // alone decides who gets in.
        for d in [&cluster.dir, &cluster.sock] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| e.to_string())?;
        }
        run(as_owner(&cluster.bindir.join("initdb"))
            .arg("-D")
            .arg(&cluster.data)
            .args(["-U", "postgres", "-E", "UTF8", "--no-sync", "--locale=C"])
            .args(["--auth-local=peer", "--auth-host=reject"]))?;
        let write = |name: &str, text: &str| -> Result<(), String> {
            let path = cluster.data.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            run(Command::new("chown").arg("postgres:postgres").arg(&path))
        };
        write("pg_hba.conf", "local all all peer map=pepsi\n")?;
        let mut ident = String::from("pepsi root postgres\npepsi postgres postgres\n");
        for (account, role) in map {
            ident.push_str(&format!("pepsi {account} {role}\n"));
        }
        write("pg_ident.conf", &ident)?;
        let conf = format!(
            "\nlisten_addresses = ''\nunix_socket_directories = '{}'\nport = {PORT}\n\
             fsync = off\nlog_min_messages = warning\nmax_connections = 100\n",
            cluster.sock.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(cluster.data.join("postgresql.conf"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
            .map_err(|e| e.to_string())?;
        run(as_owner(&cluster.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(&cluster.data)
            .arg("-l")
            .arg(cluster.dir.join("server.log"))
            .args(["-w", "-t", "60", "start"]))?;
        Ok(cluster)
    }

    /// A connection string for `dbname` as `user`.
    pub fn conninfo(&self, user: &str, dbname: &str) -> String {
        format!(
            "host={} port={PORT} user={user} dbname={dbname}",
            self.sock.display()
        )
    }

    /// A superuser client of `dbname` (this process is root, which the map lets in as
    /// `postgres`).
    pub fn admin(&self, dbname: &str) -> Client {
        Client::connect(&self.conninfo("postgres", dbname), NoTls)
            .unwrap_or_else(|e| panic!("connect to the peer cluster as postgres: {e}"))
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// The directory the cluster lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PeerCluster {
    fn drop(&mut self) {
        let _ = as_owner(&self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
