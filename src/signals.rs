//! Signal handling, one place for the three daemons: SIGINT and SIGTERM ask for
//! shutdown, SIGHUP for a configuration reload.
//!
//! [`install`] gives the read ends of sockets signal-hook writes a byte to from the
//! handler, for a poll loop: the dispatcher's loop (`dispatch::event_loop`) drains them
//! and acts on the flag (SIGHUP there is the same as a `config_changed` notification),
//! and the ingress waits on both ([`wait_any`]: SIGHUP reloads its certificate); both install them before their wait for
//! the database. [`stop_flag`] is the failure bouncer's form: a flag its loop reads
//! between calls, and [`hup_flag`] its SIGHUP, which must not end it (the default
//! action). Below the programs that use it; it decides nothing.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::exit::Failure;

/// The read ends, registered with the poller.
pub struct Signals {
    /// Readable on SIGINT / SIGTERM.
    pub shutdown: mio::net::UnixStream,
    /// Readable on SIGHUP.
    pub reload: mio::net::UnixStream,
}

fn pair(signals: &[libc::c_int]) -> Result<mio::net::UnixStream, Failure> {
    let err = |e: std::io::Error| Failure::general(format!("cannot set up signal handling: {e}"));
    let (read, write) = UnixStream::pair().map_err(err)?;
    for &signal in signals {
        let w = write.try_clone().map_err(err)?;
        signal_hook::low_level::pipe::register(signal, w).map_err(err)?;
    }
    read.set_nonblocking(true).map_err(err)?;
    Ok(mio::net::UnixStream::from_std(read))
}

/// Installs the handlers.
pub fn install() -> Result<Signals, Failure> {
    Ok(Signals {
        shutdown: pair(&[libc::SIGINT, libc::SIGTERM])?,
        reload: pair(&[libc::SIGHUP])?,
    })
}

/// Waits up to `timeout` for a shutdown signal (before the loop runs: the start-up's
/// wait for the database); true when one arrived.
pub fn wait_for(stream: &mut mio::net::UnixStream, timeout: std::time::Duration) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd. An interrupted poll is a spurious wake-up: the caller
    // waits again.
    unsafe { libc::poll(&mut pfd, 1, ms) };
    drain(stream)
}

/// What [`wait_any`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrived {
    /// SIGINT or SIGTERM (first, when both came).
    Shutdown,
    /// SIGHUP.
    Reload,
    /// Nothing within the time.
    Nothing,
}

/// Waits up to `timeout` for any of the signals (the ingress's main thread, which has
/// nothing else to wait for).
pub fn wait_any(signals: &mut Signals, timeout: std::time::Duration) -> Arrived {
    use std::os::fd::AsRawFd;
    let mut pfds =
        [signals.shutdown.as_raw_fd(), signals.reload.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: two valid pollfds. An interrupted poll is a spurious wake-up.
    unsafe { libc::poll(pfds.as_mut_ptr(), 2, ms) };
    if drain(&mut signals.shutdown) {
        Arrived::Shutdown
    } else if drain(&mut signals.reload) {
        Arrived::Reload
    } else {
        Arrived::Nothing
    }
}

/// Reads everything pending on a signal socket; true when a signal arrived.
pub fn drain(stream: &mut mio::net::UnixStream) -> bool {
    let mut any = false;
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return any,
            Ok(_) => any = true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return any,
        }
    }
}

/// A flag set on SIGINT or SIGTERM, for a loop that reads it between calls.
pub fn stop_flag() -> Result<Arc<AtomicBool>, Failure> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [libc::SIGINT, libc::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())
            .map_err(|e| Failure::general(format!("cannot set up signal handling: {e}")))?;
    }
    Ok(stop)
}

/// A flag set on SIGHUP, for a daemon that reads its loop's flags between calls (the
/// failure bouncer): the signal no longer ends the process, as its default action
/// would; the loop says what it did with it.
pub fn hup_flag() -> Result<Arc<AtomicBool>, Failure> {
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(libc::SIGHUP, hup.clone())
        .map_err(|e| Failure::general(format!("cannot set up signal handling: {e}")))?;
    Ok(hup)
}
