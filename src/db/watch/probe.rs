//! The watchdog's question to a host ([`super`]): does it answer a new connection at
//! all? A probe connects (its own non-blocking socket), sends the 8-byte SSL request
//! of the PostgreSQL protocol and waits for the first byte back, within a deadline. A
//! refused or unreachable connection is an answer too: such a host fails connections
//! at once and hangs nothing. Runs on a thread of its own; touches only its socket.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::host::Host;

/// The SSL request of the PostgreSQL protocol: any live server answers it with one
/// byte (`S` or `N`) before it reads anything else.
pub(super) const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// Does `host` answer a new connection within `wait`? A refused connection is an
/// answer (the server is down, not hung: connections to it fail at once).
pub fn probe_host(host: &Host, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    match host {
        Host::Unix(path) => probe_unix(path, deadline),
        Host::Tcp { .. } => {
            let addresses = host.addresses();
            if addresses.is_empty() {
                // A name that does not resolve: connections fail at once.
                return true;
            }
            addresses.iter().any(|a| probe_tcp(a, deadline))
        }
    }
}

/// The outcome of one step of a probe.
enum Step {
    /// The server answered, or refused: not hung.
    Answered,
    /// Go on.
    Next,
    /// No answer in time.
    Silent,
}

fn probe_unix(path: &Path, deadline: Instant) -> bool {
    let Some(fd) = Fd::socket(libc::AF_UNIX) else {
        return true;
    };
    // SAFETY: a zeroed sockaddr_un with the path copied in, within its bounds.
    let mut un: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    un.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= un.sun_path.len() {
        return true;
    }
    for (d, s) in un.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: connecting our socket to a valid address.
    let rc = unsafe { libc::connect(fd.0, (&raw const un).cast(), len) };
    if rc != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        // A full listen queue: nobody accepts.
        return e != Some(libc::EAGAIN) && e != Some(libc::EINPROGRESS);
    }
    exchange(&fd, deadline)
}

fn probe_tcp(addr: &SocketAddr, deadline: Instant) -> bool {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let Some(fd) = Fd::socket(family) else {
        return true;
    };
    // SAFETY: socket addresses built field by field, their sizes passed along.
    let rc = unsafe {
        match addr {
            SocketAddr::V4(a) => {
                let mut sin: libc::sockaddr_in = std::mem::zeroed();
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = a.port().to_be();
                sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
                libc::connect(
                    fd.0,
                    (&raw const sin).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            }
            SocketAddr::V6(a) => {
                let mut sin6: libc::sockaddr_in6 = std::mem::zeroed();
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = a.port().to_be();
                sin6.sin6_addr.s6_addr = a.ip().octets();
                sin6.sin6_scope_id = a.scope_id();
                libc::connect(
                    fd.0,
                    (&raw const sin6).cast(),
                    std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                )
            }
        }
    };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return true;
    }
    match fd.wait(libc::POLLOUT, deadline) {
        Step::Silent => return false,
        Step::Answered => return true,
        Step::Next => {}
    }
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: reading an int socket option into an int.
    unsafe {
        libc::getsockopt(
            fd.0,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &mut len,
        )
    };
    if err != 0 {
        // Refused or unreachable: an answer of the network, not a hang.
        return true;
    }
    exchange(&fd, deadline)
}

/// Sends the SSL request on a connected socket and waits for the first byte back.
fn exchange(fd: &Fd, deadline: Instant) -> bool {
    // SAFETY: writing our own buffer to our socket.
    let sent = unsafe {
        libc::send(
            fd.0,
            SSL_REQUEST.as_ptr().cast(),
            SSL_REQUEST.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if sent != SSL_REQUEST.len() as isize {
        // A full buffer means nobody reads; an error is an answer.
        return sent < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN);
    }
    !matches!(fd.wait(libc::POLLIN, deadline), Step::Silent)
}

/// A socket the probe owns.
struct Fd(RawFd);

impl Fd {
    fn socket(family: libc::c_int) -> Option<Fd> {
        // SAFETY: a new socket, ours alone.
        let fd = unsafe {
            libc::socket(
                family,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        (fd >= 0).then_some(Fd(fd))
    }

    /// Waits for `events` until `deadline`.
    fn wait(&self, events: libc::c_short, deadline: Instant) -> Step {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Step::Silent;
            }
            let mut pfd = libc::pollfd {
                fd: self.0,
                events,
                revents: 0,
            };
            // SAFETY: polling one descriptor we own.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as libc::c_int) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Step::Answered;
            }
            if n == 0 {
                continue;
            }
            if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 && events == libc::POLLOUT {
                return Step::Answered;
            }
            return if events == libc::POLLOUT {
                Step::Next
            } else {
                Step::Answered
            };
        }
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: closing the socket we opened.
        unsafe { libc::close(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_tells_a_silent_listener_from_one_that_answers_or_refuses() {
        let dir = std::env::temp_dir().join(format!("pepsi-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let silent = dir.join(".s.PGSQL.1");
        let _ = std::fs::remove_file(&silent);
        // Accepts (the kernel does) and never says a word.
        let _quiet = std::os::unix::net::UnixListener::bind(&silent).unwrap();
        let started = Instant::now();
        assert!(!probe_host(&Host::Unix(silent), Duration::from_millis(300)));
        assert!(started.elapsed() < Duration::from_secs(2));
        // Answers one byte.
        let speaking = dir.join(".s.PGSQL.2");
        let _ = std::fs::remove_file(&speaking);
        let talker = std::os::unix::net::UnixListener::bind(&speaking).unwrap();
        let answer = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut s, _) = talker.accept().unwrap();
            let mut request = [0u8; 8];
            s.read_exact(&mut request).unwrap();
            assert_eq!(request, SSL_REQUEST);
            s.write_all(b"N").unwrap();
        });
        assert!(probe_host(&Host::Unix(speaking), Duration::from_secs(5)));
        answer.join().unwrap();
        // Nothing there: refused at once, which is no hang.
        assert!(probe_host(
            &Host::Unix(dir.join(".s.PGSQL.3")),
            Duration::from_secs(5)
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
