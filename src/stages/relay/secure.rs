//! TLS and SMTP AUTH on the relay's connection (§21): what a section asks for
//! ([`Security`]: `TLS`, `TLS_WRAPPER`, `TLS_NAME`, `CA_FILE`, `AUTH_FILE`), STARTTLS
//! (RFC 3207) or a wrapper-mode port's handshake, and AUTH PLAIN or LOGIN (RFC 4954,
//! RFC 4616) inside TLS only.
//!
//! The password goes only into the AUTH exchange, inside TLS: never into an error, a
//! log line or a row. [`Credentials`] prints as its user alone. Used by `client.rs`
//! to open a connection (`client.rs` has the steps in clear text); the files are read
//! by `auth_file.rs` at the worker's start.

use std::sync::Arc;
use std::time::Instant;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;

use super::client::{Connection, Target, Timeouts};
use super::reply::Broken;
use super::stream::Transport;
use crate::escape::Visible;
use crate::tls::{self, Level, Negotiated};

/// A user and password for SMTP AUTH (`AUTH_FILE`).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user (authentication identity).
    pub user: String,
    /// The password.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Credentials {{ user: {:?}, password: <hidden> }}",
            self.user
        )
    }
}

/// What a connection's security is to be.
#[derive(Clone)]
pub struct Security {
    /// The level (`TLS`).
    pub level: Level,
    /// TLS from the first byte, as on port 465 (`TLS_WRAPPER`).
    pub wrapper: bool,
    /// The client configuration (none at [`Level::None`]).
    pub config: Option<Arc<ClientConfig>>,
    /// The name the certificate must bear (`TLS_NAME`, else the smarthost's host).
    pub name: Option<ServerName<'static>>,
    /// SMTP AUTH's user and password (`AUTH_FILE`).
    pub auth: Option<Arc<Credentials>>,
}

impl Security {
    /// Clear text, no AUTH.
    pub fn none() -> Security {
        Security {
            level: Level::None,
            wrapper: false,
            config: None,
            name: None,
            auth: None,
        }
    }
}

/// Opens a connection as `security` asks: a wrapper-mode port's handshake before the
/// greeting, else STARTTLS after EHLO (which is said again inside TLS); then AUTH. At
/// `may`, a handshake that fails is tried again in clear text on a new connection (the
/// old one is in no state to go on), as Postfix does.
pub fn open(
    target: &Target,
    lmtp: bool,
    hostname: &str,
    timeouts: Timeouts,
    deadline: Instant,
    security: &Security,
) -> Result<Connection, Broken> {
    if security.level == Level::None {
        let c = Connection::open(target, lmtp, hostname, timeouts, deadline)?;
        authenticate_in(&c, security)?;
        return Ok(c);
    }
    let mut c = Connection::connect(target, timeouts, deadline)?;
    if security.wrapper {
        start_tls(&mut c, security)?;
    }
    c.greeting()?;
    c.hello(lmtp, hostname)?;
    if !security.wrapper {
        match starttls(&mut c, security) {
            Ok(true) => c.hello(lmtp, hostname)?,
            Ok(false) => {}
            Err(e) if security.level == Level::May && c.tls.is_none() => {
                log::info!(
                    "relay: TLS with {target} failed ({}); TLS = may: trying again in clear text",
                    Visible(&e.0)
                );
                let clear = Security {
                    level: Level::None,
                    ..security.clone()
                };
                return open(target, lmtp, hostname, timeouts, deadline, &clear);
            }
            Err(e) => return Err(e),
        }
    }
    authenticate(&mut c, security)?;
    Ok(c)
}

/// A connection in clear text with credentials to send: refused before a word of them.
fn authenticate_in(c: &Connection, security: &Security) -> Result<(), Broken> {
    if security.auth.is_some() && c.tls.is_none() {
        return Err(Broken(CLEAR_TEXT_LOGIN.into()));
    }
    Ok(())
}

/// Why credentials are not sent on a connection in clear text.
const CLEAR_TEXT_LOGIN: &str = "AUTH_FILE is set, but the connection is not encrypted: the password is never sent in clear text";

/// Moves the connection's stream into a TLS session and drives the handshake, within
/// the command timeout; logs what was negotiated, as Postfix does.
pub fn start_tls(c: &mut Connection, security: &Security) -> Result<(), Broken> {
    let (Some(config), Some(name)) = (&security.config, &security.name) else {
        return Err(Broken("TLS is asked for but not configured".into()));
    };
    let connection = tls::client(config, name.clone()).map_err(Broken)?;
    c.arm(c.timeouts().command)?;
    let Transport::Plain(timed) = c.take_transport()? else {
        return Err(Broken("TLS is already on".into()));
    };
    let mut stream = rustls::StreamOwned::new(connection, timed);
    tls::handshake(&mut stream.conn, &mut stream.sock).map_err(Broken)?;
    let negotiated = Negotiated::of(&stream.conn, security.level == Level::Verify);
    log::info!(
        "relay: {} TLS connection established to {}: {negotiated}",
        negotiated.trust(),
        Visible(&name.to_str())
    );
    c.put_transport(Transport::Tls(Box::new(stream)), negotiated);
    Ok(())
}

/// STARTTLS after EHLO, as the level asks: `Ok(true)` when TLS is now on (EHLO must be
/// said again), `Ok(false)` when the connection goes on in clear text (`may`, and the
/// smarthost does not offer STARTTLS or refuses it). At `encrypt` and `verify` a
/// smarthost without STARTTLS is an error: the message waits rather than go in clear.
pub fn starttls(c: &mut Connection, security: &Security) -> Result<bool, Broken> {
    if !c.offers.starttls {
        if security.level == Level::May {
            return Ok(false);
        }
        return Err(Broken(format!(
            "the smarthost does not offer STARTTLS, and TLS = {} does not send in clear text",
            security.level.name()
        )));
    }
    let reply = c.command("STARTTLS")?;
    if reply.code != 220 {
        if security.level == Level::May {
            log::info!(
                "relay: the smarthost refused STARTTLS ({reply}); TLS = may: going on in clear text"
            );
            return Ok(false);
        }
        return Err(Broken(format!("the smarthost refused STARTTLS: {reply}")));
    }
    start_tls(c, security)?;
    Ok(true)
}

/// SMTP AUTH with the section's credentials, if any: only inside TLS (a connection in
/// clear text never sends them; the message waits), PLAIN when offered, else LOGIN. A
/// refusal is an error that says the login was refused (never how).
pub fn authenticate(c: &mut Connection, security: &Security) -> Result<(), Broken> {
    let Some(credentials) = &security.auth else {
        return Ok(());
    };
    authenticate_in(c, security)?;
    let offered = |m: &str| c.offers.auth.iter().any(|o| o == m);
    let reply = if offered("PLAIN") {
        let token = format!("\0{}\0{}", credentials.user, credentials.password);
        c.command(&format!("AUTH PLAIN {}", STANDARD.encode(token)))?
    } else if offered("LOGIN") {
        let first = c.command("AUTH LOGIN")?;
        if first.code != 334 {
            return Err(refused(&first));
        }
        let second = c.command(&STANDARD.encode(&credentials.user))?;
        if second.code != 334 {
            return Err(refused(&second));
        }
        c.command(&STANDARD.encode(&credentials.password))?
    } else if c.offers.auth.is_empty() {
        return Err(Broken(
            "AUTH_FILE is set, but the smarthost does not offer AUTH".into(),
        ));
    } else {
        return Err(Broken(format!(
            "the smarthost offers AUTH {}, none of which this relay speaks (PLAIN, LOGIN)",
            Visible(&c.offers.auth.join(" "))
        )));
    };
    if reply.code == 235 {
        Ok(())
    } else {
        Err(refused(&reply))
    }
}

/// What a reply refusing the login says: the smarthost's own words, never the
/// exchange, nor the user (the error reaches the row and its sender's report).
fn refused(reply: &super::reply::Reply) -> Broken {
    Broken(format!("{LOGIN_REFUSED}: {reply}"))
}

/// How an error of a refused login starts (`mod.rs` pauses the logins of that
/// smarthost for a minute after one).
pub const LOGIN_REFUSED: &str = "the smarthost refused the login";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_print_without_their_password() {
        let c = Credentials {
            user: "relay@example.net".into(),
            password: "s3cret-pass".into(),
        };
        let shown = format!("{c:?}");
        assert!(shown.contains("relay@example.net"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}
