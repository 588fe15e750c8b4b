//! A private NSD for the tests of the MX resolver: a real authoritative DNS server on
//! a loopback port, serving zones a test writes, so that the resolver meets real
//! answers (MX, A, CNAME, null MX, NXDOMAIN, SERVFAIL, a UDP reply truncated and the
//! same over TCP). A server that misbehaves on purpose is [`super::hostile_dns`]'s.
//!
//! [`Nsd::start`] runs an instance of its own, apart from any NSD of the machine
//! (Debian's package `nsd`): its configuration, zone files, log, pid file, zone list,
//! xfrd state and cookie secrets all in a private temporary directory, no database
//! (`database: ""`), no remote control, no response rate limiting, listening on
//! `127.0.0.1` on one free port for UDP and TCP alike ([`Nsd::start_at`]: on an
//! address and port the caller gives, such as `127.0.60.53:53`). It stays in the foreground
//! (`nsd -d`), in a process group of its own, under the test's account (`username:
//! ""`: no switch to the account `nsd`, so root and other accounts alike run it).
//! Every zone file is checked with `nsd-checkzone` before NSD reads it, so a zone
//! that NSD would refuse fails the test at once; a zone configured without a file is
//! answered with SERVFAIL. [`Nsd::set_zone`] writes a zone file (a zone's first, a
//! replacement, or a new zone's) and restarts the instance on the same port (NSD
//! reads every zone before it answers the first query, so the first answer after the
//! restart is the new data; a reload by SIGHUP works too, but says nowhere when it is
//! done). NSD's log is printed when a
//! test fails; the instance is stopped when the value is dropped.
//!
//! Whether NSD is here is [`available`]'s question, which fails instead of skipping
//! when `CI` is set.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::TempDir;

/// NSD's server, from Debian's package `nsd`.
pub const NSD: &str = "/usr/sbin/nsd";

/// Its zone file checker, from the same package.
pub const NSD_CHECKZONE: &str = "/usr/sbin/nsd-checkzone";

/// How long NSD has to answer its first query after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Why no private NSD can run here, if it cannot.
pub fn unavailable() -> Option<String> {
    [NSD, NSD_CHECKZONE]
        .iter()
        .find(|p| !Path::new(p).is_file())
        .map(|p| format!("{p} is missing (apt-get install nsd)"))
}

/// May a test that needs a private NSD run? Without NSD it prints a note naming
/// `test` and answers false; with `CI` set it fails instead.
#[track_caller]
pub fn available(test: &str) -> bool {
    let Some(why) = unavailable() else {
        return true;
    };
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run: {why}");
    eprintln!("skipping {test}: {why}");
    false
}

/// A running private NSD; stopped when dropped.
pub struct Nsd {
    /// Everything of the instance: `nsd.conf`, the zone files `ORIGIN.zone`, its log
    /// `nsd.log`, its standard output and error `stderr`, and the rest of its state.
    dir: TempDir,
    /// The `nsd -d` process, the leader of its process group (its server processes
    /// are in the group too); None while stopped.
    child: Option<Child>,
    /// The address and port it listens on, UDP and TCP (`127.0.0.1` but for
    /// [`Nsd::start_at`]).
    ip: IpAddr,
    port: u16,
    /// The origins of its zones, without the final dot, in the order configured.
    zones: Vec<String>,
}

impl Nsd {
    /// Starts a private NSD on `127.0.0.1` on a free port (UDP and TCP) serving
    /// `zones`: each an origin (`"example.test"`; a final dot is optional) and the text
    /// of its zone file (relative names are relative to the origin; the file needs its
    /// SOA record), or None for a zone that is configured but whose file is missing,
    /// which NSD answers with SERVFAIL until [`Nsd::set_zone`] writes it. Returns once
    /// NSD answers; fails with its log if it does not within 10 seconds, or if a zone
    /// file is not one `nsd-checkzone` accepts.
    #[track_caller]
    pub fn start(tag: &str, zones: &[(&str, Option<&str>)]) -> Nsd {
        let mut nsd = Nsd::prepare(tag, IpAddr::V4(Ipv4Addr::LOCALHOST), zones);
        // The port was free when it was chosen; another process may have taken it
        // before NSD binds it: then choose again.
        for _ in 0..5 {
            nsd.port = free_port();
            // Each try's log is its own: "in use" below is this try's.
            for log in ["nsd.log", "stderr"] {
                let _ = std::fs::remove_file(nsd.dir.path(log));
            }
            match nsd.launch() {
                Ok(()) => return nsd,
                Err(_) if nsd.log().contains("Address already in use") => continue,
                Err(status) => panic!(
                    "the private NSD did not start: nsd exited ({status}; its log follows \
                     the test's output)"
                ),
            }
        }
        panic!("the private NSD found no free port (its log follows the test's output)");
    }

    /// Where it listens: `127.0.0.1:PORT` (or [`Nsd::start_at`]'s address), UDP and
    /// TCP.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }

    /// [`Nsd::start`] listening on `addr` instead (UDP and TCP), such as a loopback
    /// address of a test's own on port 53, where a resolver that takes no port
    /// (glibc's, through a `resolv.conf`) can ask it. Fails with NSD's log if the
    /// address is taken.
    #[track_caller]
    pub fn start_at(tag: &str, addr: SocketAddr, zones: &[(&str, Option<&str>)]) -> Nsd {
        let mut nsd = Nsd::prepare(tag, addr.ip(), zones);
        nsd.port = addr.port();
        if let Err(status) = nsd.launch() {
            panic!(
                "the private NSD did not start on {addr}: nsd exited ({status}; its log \
                 follows the test's output)"
            );
        }
        nsd
    }

    /// An instance not started yet, on `ip`, with its zone files written.
    #[track_caller]
    fn prepare(tag: &str, ip: IpAddr, zones: &[(&str, Option<&str>)]) -> Nsd {
        static STALE: std::sync::Once = std::sync::Once::new();
        STALE.call_once(remove_stale);
        let mut nsd = Nsd {
            dir: TempDir::new(&format!("{DIR_TAG}-{tag}")),
            child: None,
            ip,
            port: 0,
            zones: Vec::new(),
        };
        for (origin, text) in zones {
            let origin = origin.trim_end_matches('.');
            assert!(
                !nsd.zones.iter().any(|z| z == origin),
                "the zone {origin} is given twice"
            );
            nsd.zones.push(origin.to_string());
            if let Some(text) = text {
                nsd.write_zone(origin, text);
            }
        }
        nsd
    }

    /// Writes (or replaces) the zone file of `origin`, a zone configured at the start
    /// or a new one, and restarts NSD on the same port to serve it; returns once NSD
    /// answers again, from the new data.
    #[track_caller]
    pub fn set_zone(&mut self, origin: &str, text: &str) {
        let origin = origin.trim_end_matches('.');
        self.write_zone(origin, text);
        if !self.zones.iter().any(|z| z == origin) {
            self.zones.push(origin.to_string());
        }
        self.stop();
        // Its server processes may outlive the one waited for by a moment.
        let deadline = Instant::now() + START_TIMEOUT;
        while !port_free(self.ip, self.port) {
            assert!(
                Instant::now() < deadline,
                "port {} is still taken {START_TIMEOUT:?} after the private NSD stopped",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Err(status) = self.launch() {
            panic!(
                "the private NSD did not start again: nsd exited ({status}; its log follows \
                 the test's output)"
            );
        }
    }

    /// Its log so far (`nsd.log`, then what it wrote to its standard error).
    pub fn log(&self) -> String {
        let read = |name| std::fs::read_to_string(self.dir.path(name)).unwrap_or_default();
        format!("{}{}", read("nsd.log"), read("stderr"))
    }

    /// Checks `text` with `nsd-checkzone` and writes it as the zone file of `origin`.
    #[track_caller]
    fn write_zone(&self, origin: &str, text: &str) {
        let path = self.dir.write(&zone_file(origin), text);
        let out = Command::new(NSD_CHECKZONE)
            .arg(format!("{origin}."))
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {NSD_CHECKZONE}: {e}"));
        assert!(
            out.status.success(),
            "NSD would not load the zone {origin} ({}):\n{}{}\nthe zone file:\n{text}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }

    /// Writes `nsd.conf` for the instance's port and zones, starts `nsd -d` and waits
    /// until it answers a query. Err (how it exited) if it exits first; fails if it
    /// neither answers nor exits in time.
    #[track_caller]
    fn launch(&mut self) -> Result<(), std::process::ExitStatus> {
        use std::os::unix::process::CommandExt;
        let conf = self.dir.write("nsd.conf", &self.config());
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path("stderr"))
            .unwrap();
        let child = Command::new(NSD)
            .arg("-d")
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(stderr.try_clone().unwrap())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {NSD}: {e}"));
        // For remove_stale, should this test process end without stopping it.
        self.dir.write(PID_FILE, &child.id().to_string());
        self.child = Some(child);
        let unspecified: IpAddr = if self.ip.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        let probe = UdpSocket::bind((unspecified, 0)).unwrap();
        probe.connect(self.addr()).unwrap();
        probe
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let origin = self.zones.first().map_or("", String::as_str);
        let deadline = Instant::now() + START_TIMEOUT;
        let mut id = 0u16;
        loop {
            id = id.wrapping_add(1);
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.stop();
                return Err(status);
            }
            // Until NSD binds the port, the kernel refuses: the error says no more.
            let _ = probe.send(&soa_query(id, origin));
            let mut reply = [0u8; 512];
            // A reply to any of the queries sent will do: NSD binds its port before it
            // reads the zones, so the first queries wait there and are answered at
            // once afterwards, while a reply per query is read here.
            if let Ok(n) = probe.recv(&mut reply)
                && n >= 12
                && reply[2] & 0x80 != 0
            {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "the private NSD did not answer on {} within {START_TIMEOUT:?} (its log \
                 follows the test's output)",
                self.addr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The instance's `nsd.conf`.
    fn config(&self) -> String {
        let dir = self.dir.0.display();
        let (ip, port) = (self.ip, self.port);
        let (v4, v6) = if ip.is_ipv4() {
            ("yes", "no")
        } else {
            ("no", "yes")
        };
        let mut conf = format!(
            "\
server:
    ip-address: {ip}
    port: {port}
    do-ip4: {v4}
    do-ip6: {v6}
    # The test's own account, root or not: no switch to the account nsd.
    username: \"\"
    chroot: \"\"
    # Every file of the instance is in its directory.
    zonesdir: \"{dir}\"
    database: \"\"
    zonelistfile: \"{dir}/zone.list\"
    xfrdfile: \"{dir}/xfrd.state\"
    xfrdir: \"{dir}\"
    pidfile: \"{dir}/nsd.pid\"
    logfile: \"{dir}/nsd.log\"
    cookie-secret-file: \"{dir}/cookiesecrets.txt\"
    verbosity: 1
    server-count: 1
    # As many answers as the tests ask for: no response rate limiting.
    rrl-ratelimit: 0
    rrl-whitelist-ratelimit: 0
remote-control:
    control-enable: no
"
        );
        for origin in &self.zones {
            conf.push_str(&format!(
                "zone:\n    name: \"{origin}.\"\n    zonefile: \"{}\"\n",
                zone_file(origin)
            ));
        }
        conf
    }

    /// Stops NSD, if it runs: SIGTERM to its process group (every process of it ends
    /// on that), then SIGKILL if `nsd -d` has not exited after 5 seconds.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = child.id() as i32;
        // SAFETY: kill has no memory-safety preconditions; the group is NSD's own
        // (process_group(0)), and its id is not reused while the leader is unreaped.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                // SAFETY: as above (the leader is still not reaped).
                unsafe { libc::kill(-group, libc::SIGKILL) };
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Nsd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            if !log.is_empty() {
                eprintln!("the private NSD's log:\n{log}");
            }
        }
        self.stop();
    }
}

/// What the name of every instance's directory starts with, after `pepsi-t-`.
const DIR_TAG: &str = "nsd";

/// The file in an instance's directory that holds its `nsd -d` process's id.
const PID_FILE: &str = "nsd-d.pid";

/// The name of the zone file of `origin` (without its final dot) in the instance's
/// directory.
fn zone_file(origin: &str) -> String {
    if origin.is_empty() {
        "root.zone".to_string()
    } else {
        format!("{origin}.zone")
    }
}

/// Stops the instances of test processes that ended without stopping theirs (a test
/// binary killed at a time limit), and removes their directories. A directory is named
/// `pepsi-t-nsd-TAG-PID-N` ([`TempDir::new`]), PID the test process's; the instance is
/// stopped only if the process of its [`PID_FILE`] is still an `nsd` that names that
/// directory's configuration.
fn remove_stale() {
    for dir in super::stale_dirs(DIR_TAG) {
        let nsd = std::fs::read_to_string(dir.join(PID_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let Some(nsd) = nsd {
            let conf = dir.join("nsd.conf");
            let cmdline = std::fs::read(format!("/proc/{nsd}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*conf.to_string_lossy()) {
                // SAFETY: kill has no memory-safety preconditions; the process is
                // that instance's, checked just above.
                unsafe { libc::kill(-nsd, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A loopback port free for both UDP and TCP, closed again for NSD to bind.
fn free_port() -> u16 {
    super::hostile_dns::bind_pair()
        .0
        .local_addr()
        .unwrap()
        .port()
}

/// Can both a UDP socket and a TCP listener bind `ip:port`?
fn port_free(ip: IpAddr, port: u16) -> bool {
    UdpSocket::bind((ip, port)).is_ok() && std::net::TcpListener::bind((ip, port)).is_ok()
}

/// A query for the SOA record of `origin` (without its final dot; "" the root), with
/// id `id` and no flags.
fn soa_query(id: u16, origin: &str) -> Vec<u8> {
    let mut q = Vec::new();
    for word in [id, 0, 1, 0, 0, 0] {
        q.extend_from_slice(&word.to_be_bytes());
    }
    for label in origin.split('.').filter(|l| !l.is_empty()) {
        q.push(u8::try_from(label.len()).expect("a label of at most 63 bytes"));
        q.extend_from_slice(label.as_bytes());
    }
    // The root label, TYPE SOA, CLASS IN.
    q.extend_from_slice(&[0, 0, 6, 0, 1]);
    q
}
