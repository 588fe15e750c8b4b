//! The relay's byte stream to the smarthost: a TCP or unix socket ([`Socket`]) whose
//! every read and write ends by a time the connection sets ([`Timed`]), in clear text
//! or inside a TLS session over it ([`Transport`]).
//!
//! Used by `client.rs` (which sets the time before each wait) and `secure.rs` (which
//! starts TLS on it); it decides nothing about SMTP.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustls::{ClientConnection, StreamOwned};

/// The socket, either kind.
pub enum Socket {
    /// TCP.
    Tcp(TcpStream),
    /// A unix socket.
    Unix(UnixStream),
}

impl Socket {
    /// Sets both timeouts (socket options).
    fn set_timeouts(&self, wait: Duration) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => {
                s.set_read_timeout(Some(wait))?;
                s.set_write_timeout(Some(wait))
            }
            Socket::Unix(s) => {
                s.set_read_timeout(Some(wait))?;
                s.set_write_timeout(Some(wait))
            }
        }
    }
}

/// The socket with every read and write waiting at most until [`Timed::until`], so
/// that a reply dripped a byte at a time, or a handshake that stops half-way, still
/// ends by then.
pub struct Timed {
    socket: Socket,
    /// When the current wait ends.
    pub until: Instant,
}

impl Timed {
    /// `socket`, its first wait ending at `until`.
    pub fn new(socket: Socket, until: Instant) -> Timed {
        Timed { socket, until }
    }

    /// Sets the socket's timeouts to what is left before [`Self::until`].
    fn arm(&self) -> io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the smarthost did not answer in time",
            ));
        }
        self.socket.set_timeouts(left)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        match &mut self.socket {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        match &mut self.socket {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The stream SMTP goes over: clear text, or TLS over the same socket.
pub enum Transport {
    /// Clear text.
    Plain(Timed),
    /// A TLS session (after STARTTLS, or from the start on a wrapper-mode port).
    Tls(Box<StreamOwned<ClientConnection, Timed>>),
    /// Nothing: only while the stream is being moved into a TLS session.
    Gone,
}

impl Transport {
    /// The socket underneath, to set when its waits end; `None` once gone.
    pub fn timed(&mut self) -> Option<&mut Timed> {
        match self {
            Transport::Plain(t) => Some(t),
            Transport::Tls(s) => Some(&mut s.sock),
            Transport::Gone => None,
        }
    }

    fn gone() -> io::Error {
        io::Error::new(io::ErrorKind::NotConnected, "the connection is closed")
    }
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(t) => t.read(buf),
            Transport::Tls(s) => s.read(buf),
            Transport::Gone => Err(Transport::gone()),
        }
    }
}

impl Write for Transport {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(t) => t.write(buf),
            Transport::Tls(s) => s.write(buf),
            Transport::Gone => Err(Transport::gone()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Transport::Plain(t) => t.flush(),
            Transport::Tls(s) => s.flush(),
            Transport::Gone => Err(Transport::gone()),
        }
    }
}
