//! STARTTLS in a session of `pepsi-ingress` (RFC 3207, §21): offered in the EHLO or
//! LHLO reply of a listener with a certificate (`TLS_CERT`, `TLS_KEY`) until TLS is on;
//! 220, then the handshake within `TIMEOUT`, then the session starts over (RFC 3207 §4.2):
//! whatever the client said before (its EHLO name, a transaction, XFORWARD)
//! is forgotten, and whatever it sent after the STARTTLS line before the handshake is
//! discarded unread, so nothing an attacker injects in clear text is taken as if it
//! came inside TLS. A listener that `REQUIRE_TLS` names answers MAIL 530 before it
//! (`session.rs`).

use std::io::{BufRead, Read, Write};
use std::time::Instant;

use super::counters::Counters;
use super::reply::Reply;
use super::session::{End, Session};

impl<R: Read, W: Write> Session<'_, R, W> {
    /// STARTTLS with `arg` (which must be empty): `Some` when the session ends (a
    /// handshake that failed: the connection is in no state to go on).
    pub(super) fn starttls(&mut self, arg: &str) -> Option<End> {
        if !arg.trim().is_empty() {
            return self.error(Reply::new(501, "5.5.4", "Syntax: STARTTLS"));
        }
        if self.io.get_ref().is_tls() {
            return self.error(Reply::new(554, "5.5.1", "Error: TLS already active"));
        }
        let Some(config) = self.settings.tls.clone() else {
            return self.error(Reply::new(500, "5.5.2", "Error: command not recognized"));
        };
        self.say(&Reply::new(220, "2.0.0", "Ready to start TLS"));
        if let Err(e) = self.flush() {
            return Some(End::Failed(e.to_string()));
        }
        // What the client sent after STARTTLS, in clear text: never read as a command.
        let pipelined = self.io.buffer().len();
        self.io.consume(pipelined);
        if pipelined > 0 {
            log::info!(
                "session: {pipelined} bytes sent after STARTTLS before the handshake discarded"
            );
        }
        let due = Instant::now() + self.settings.timeout;
        match self.io.get_mut().start_tls(&config, due) {
            Ok(negotiated) => {
                Counters::bump(&self.counters.tls_sessions, 1);
                self.summary.tls = Some(negotiated);
                self.helo = None;
                self.reset();
                None
            }
            Err(e) => Some(End::Failed(e)),
        }
    }
}
