//! A session's byte stream (§16, §21): the connection's two handles joined into one
//! ([`Duplex`]), every read from the connection ending by the session's current
//! deadline, in clear text or, after STARTTLS, inside a TLS session over the same
//! connection ([`Channel`]).
//!
//! The deadline is checked before every read of the connection, not once per line: a
//! client that sends a TLS record (or a handshake) a byte at a time still meets it.
//! Used by `session.rs` (reads and writes) and `starttls.rs` (the switch to TLS); it
//! knows nothing of SMTP.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::{ServerConfig, ServerConnection, StreamOwned};

use crate::tls::{self, Negotiated};

/// The connection's read and write handles as one stream.
pub struct Duplex<'a, R, W> {
    reader: R,
    writer: W,
    /// When the current wait must end (`None`: as the connection's own timeout says).
    pub due: Option<Instant>,
    /// Sets how long the connection's next read may wait.
    read_timeout: &'a dyn Fn(Duration) -> io::Result<()>,
}

impl<'a, R: Read, W: Write> Duplex<'a, R, W> {
    /// `reader` and `writer`, two handles of one connection whose reads wait as long
    /// as `read_timeout` last said.
    pub fn new(reader: R, writer: W, read_timeout: &'a dyn Fn(Duration) -> io::Result<()>) -> Self {
        Duplex {
            reader,
            writer,
            due: None,
            read_timeout,
        }
    }
}

impl<R: Read, W: Write> Read for Duplex<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(due) = self.due {
            let left = due.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
            }
            (self.read_timeout)(left)?;
        }
        self.reader.read(buf)
    }
}

impl<R: Read, W: Write> Write for Duplex<'_, R, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

/// The session's stream: clear text, or TLS over the same connection.
pub enum Channel<'a, R: Read, W: Write> {
    /// Clear text.
    Plain(Duplex<'a, R, W>),
    /// After STARTTLS.
    Tls(Box<StreamOwned<ServerConnection, Duplex<'a, R, W>>>),
    /// Nothing: only while the connection moves into TLS, or after that failed.
    Gone,
}

impl<'a, R: Read, W: Write> Channel<'a, R, W> {
    /// The connection underneath, to set its deadline; `None` once gone.
    pub fn duplex(&mut self) -> Option<&mut Duplex<'a, R, W>> {
        match self {
            Channel::Plain(d) => Some(d),
            Channel::Tls(s) => Some(&mut s.sock),
            Channel::Gone => None,
        }
    }

    /// Is TLS on?
    pub fn is_tls(&self) -> bool {
        matches!(self, Channel::Tls(_))
    }

    /// Moves the connection into a TLS session with `config` and completes the
    /// handshake by `due`; what it negotiated. On an error the channel is gone.
    pub fn start_tls(
        &mut self,
        config: &Arc<ServerConfig>,
        due: Instant,
    ) -> Result<Negotiated, String> {
        let Channel::Plain(mut duplex) = std::mem::replace(self, Channel::Gone) else {
            return Err("TLS is already on".into());
        };
        duplex.due = Some(due);
        let connection =
            ServerConnection::new(Arc::clone(config)).map_err(|e| format!("TLS: {e}"))?;
        let mut stream = StreamOwned::new(connection, duplex);
        tls::handshake(&mut stream.conn, &mut stream.sock)?;
        let negotiated = Negotiated::of(&stream.conn, false);
        *self = Channel::Tls(Box::new(stream));
        Ok(negotiated)
    }

    fn gone() -> io::Error {
        io::Error::new(io::ErrorKind::NotConnected, "the connection is closed")
    }
}

impl<R: Read, W: Write> Read for Channel<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Channel::Plain(d) => d.read(buf),
            Channel::Tls(s) => s.read(buf),
            Channel::Gone => Err(Channel::<R, W>::gone()),
        }
    }
}

impl<R: Read, W: Write> Write for Channel<'_, R, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Channel::Plain(d) => d.write(buf),
            Channel::Tls(s) => s.write(buf),
            Channel::Gone => Err(Channel::<R, W>::gone()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Channel::Plain(d) => d.flush(),
            Channel::Tls(s) => s.flush(),
            Channel::Gone => Err(Channel::<R, W>::gone()),
        }
    }
}
