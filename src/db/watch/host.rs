//! What a database host is to the watchdog ([`super`]): the host a connection
//! string names ([`Host`]), its key for the log and the workers' hint, and how a
//! socket of this process is recognised as leading to it — its socket file's identity
//! or its TCP addresses, read from the socket with `getpeername` among the
//! descriptors of `/proc/self/fd`. Pure apart from those reads; nothing here changes a
//! socket.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A database host as a connection reaches it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Host {
    /// A Unix-domain socket file (`DIR/.s.PGSQL.PORT`).
    Unix(PathBuf),
    /// A TCP host: its name (or address) and port, and the address to use instead of
    /// resolving the name (`hostaddr`).
    Tcp {
        /// The name or address the connection string gives.
        name: String,
        /// The port.
        port: u16,
        /// `hostaddr`, when given.
        addr: Option<IpAddr>,
    },
}

impl Host {
    /// The one host of a single-host configuration, as the client library will reach
    /// it; `None` when it names none.
    pub fn of(config: &postgres::Config) -> Option<Host> {
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let addr = config.get_hostaddrs().first().copied();
        match config.get_hosts().first() {
            Some(postgres::config::Host::Unix(dir)) => {
                Some(Host::Unix(dir.join(format!(".s.PGSQL.{port}"))))
            }
            Some(postgres::config::Host::Tcp(name)) => Some(Host::Tcp {
                name: name.clone(),
                port,
                addr,
            }),
            None => addr.map(|a| Host::Tcp {
                name: a.to_string(),
                port,
                addr: Some(a),
            }),
        }
    }

    /// The host as the log and [`HINT_ENV`] name it: the socket file, or `name:port`.
    pub fn key(&self) -> String {
        match self {
            Host::Unix(path) => path.display().to_string(),
            Host::Tcp { name, port, .. } if name.contains(':') => format!("[{name}]:{port}"),
            Host::Tcp { name, port, .. } => format!("{name}:{port}"),
        }
    }

    /// The TCP addresses the host has (its `hostaddr`, or its name resolved); empty
    /// when it is a socket file or the name does not resolve.
    pub(super) fn addresses(&self) -> Vec<SocketAddr> {
        match self {
            Host::Unix(_) => Vec::new(),
            Host::Tcp {
                addr: Some(a),
                port,
                ..
            } => vec![SocketAddr::new(*a, *port)],
            Host::Tcp { name, port, .. } => (name.as_str(), *port)
                .to_socket_addrs()
                .map(Iterator::collect)
                .unwrap_or_default(),
        }
    }
}

/// What a socket of ours is connected to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Peer {
    /// A Unix-domain socket file, by the path its server bound.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

/// How to recognise a host's sockets: its socket file's identity, or its addresses
/// (the port alone when the name did not resolve).
#[derive(Debug)]
pub(super) struct Matcher {
    unix: Option<(u64, u64)>,
    unix_path: Option<PathBuf>,
    tcp: Vec<SocketAddr>,
    port: Option<u16>,
}

impl Matcher {
    pub(super) fn of(host: &Host) -> Matcher {
        match host {
            Host::Unix(path) => Matcher {
                unix: file_identity(path),
                unix_path: Some(path.clone()),
                tcp: Vec::new(),
                port: None,
            },
            Host::Tcp { port, .. } => Matcher {
                unix: None,
                unix_path: None,
                tcp: host.addresses(),
                port: Some(*port),
            },
        }
    }

    pub(super) fn matches(&self, peer: &Peer) -> bool {
        match peer {
            Peer::Unix(path) => {
                self.unix_path.as_deref() == Some(path.as_path())
                    || (self.unix.is_some() && file_identity(path) == self.unix)
            }
            Peer::Tcp(addr) => {
                if self.tcp.is_empty() {
                    self.port == Some(addr.port())
                } else {
                    self.tcp.iter().any(|a| same_address(a, addr))
                }
            }
        }
    }
}

/// Two TCP addresses alike, an IPv4 address and its IPv6-mapped form included.
fn same_address(a: &SocketAddr, b: &SocketAddr) -> bool {
    let canonical = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    a.port() == b.port() && canonical(a.ip()) == canonical(b.ip())
}

/// A socket file's device and inode.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// A host named by [`Host::key`] in [`HINT_ENV`]: a socket file (an absolute path) or
/// `name:port`.
pub(super) fn host_of_key(key: &OsStr) -> Option<Host> {
    let bytes = key.as_bytes();
    if bytes.first() == Some(&b'/') {
        return Some(Host::Unix(PathBuf::from(key)));
    }
    let text = key.to_str()?;
    let (name, port) = text.rsplit_once(':')?;
    let name = name.trim_start_matches('[').trim_end_matches(']');
    Some(Host::Tcp {
        name: name.to_string(),
        port: port.parse().ok()?,
        addr: name.parse().ok(),
    })
}

/// Every socket descriptor of this process and its inode.
pub(super) fn sockets() -> Vec<(RawFd, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let fd: RawFd = e.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            let inode = target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()?;
            Some((fd, inode))
        })
        .collect()
}

/// The sockets to the host `matcher` recognises that are not in `before`.
pub(super) fn new_sockets_to(before: &HashSet<u64>, matcher: &Matcher) -> Vec<(RawFd, u64)> {
    sockets()
        .into_iter()
        .filter(|(_, inode)| !before.contains(inode))
        .filter(|(fd, _)| peer_of(*fd).is_some_and(|p| matcher.matches(&p)))
        .collect()
}

/// The inode of an open descriptor.
pub(super) fn inode_of(fd: RawFd) -> Option<u64> {
    // SAFETY: fstat fills the struct; a closed descriptor is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// What a connected socket's other end is.
pub(super) fn peer_of(fd: RawFd) -> Option<Peer> {
    // SAFETY: getpeername fills at most `len` bytes of the storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let got =
        unsafe { libc::getpeername(fd, (&raw mut storage).cast::<libc::sockaddr>(), &mut len) };
    if got != 0 {
        return None;
    }
    match libc::c_int::from(storage.ss_family) {
        libc::AF_UNIX => {
            // SAFETY: the family says it is a sockaddr_un.
            let un = unsafe { &*(&raw const storage).cast::<libc::sockaddr_un>() };
            let bytes: Vec<u8> = un
                .sun_path
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            (!bytes.is_empty()).then(|| Peer::Unix(PathBuf::from(OsStr::from_bytes(&bytes))))
        }
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let v4 = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(Peer::Tcp(SocketAddr::new(
                IpAddr::V4(ip),
                u16::from_be(v4.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let v6 = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
            Some(Peer::Tcp(SocketAddr::new(
                IpAddr::V6(ip),
                u16::from_be(v6.sin6_port),
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_key_names_it_and_reads_back() {
        let unix = Host::Unix(PathBuf::from("/run/postgresql/.s.PGSQL.5432"));
        let tcp = Host::Tcp {
            name: "db1.example".into(),
            port: 5433,
            addr: None,
        };
        let v6 = Host::Tcp {
            name: "::1".into(),
            port: 5432,
            addr: "::1".parse().ok(),
        };
        for h in [unix, tcp, v6] {
            assert_eq!(
                host_of_key(OsStr::new(&h.key())),
                Some(h.clone()),
                "{}",
                h.key()
            );
        }
    }

    #[test]
    fn a_socket_is_matched_by_its_file_or_its_address() {
        let dir = std::env::temp_dir().join(format!("pepsi-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(".s.PGSQL.5432");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let client = std::os::unix::net::UnixStream::connect(&path).unwrap();
        use std::os::fd::AsRawFd;
        let peer = peer_of(client.as_raw_fd()).unwrap();
        assert!(Matcher::of(&Host::Unix(path.clone())).matches(&peer));
        assert!(!Matcher::of(&Host::Unix(dir.join(".s.PGSQL.5433"))).matches(&peer));
        let tcp = Matcher::of(&Host::Tcp {
            name: "127.0.0.1".into(),
            port: 5432,
            addr: None,
        });
        assert!(tcp.matches(&Peer::Tcp("127.0.0.1:5432".parse().unwrap())));
        assert!(tcp.matches(&Peer::Tcp("[::ffff:127.0.0.1]:5432".parse().unwrap())));
        assert!(!tcp.matches(&Peer::Tcp("127.0.0.1:5433".parse().unwrap())));
        drop((listener, client));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
