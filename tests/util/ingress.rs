//! `pepsi-ingress serve` as a child process with its log captured, listening on
//! loopback ports the system hands out or on a Unix socket; the configuration the
//! ingress tests share (the `[pepsi-ingress]` section and a pipeline `in` → `out` that
//! no dispatcher runs, so accepted mail stays pending at `in`); the clients that talk
//! to it: a Python script on the standard library's `smtplib` (an implementation of
//! the protocols that is not ours) and a raw line client for what no library sends.
//!
//! Used by the ingress suite and the fault suite; it asserts nothing about the
//! daemon's behaviour itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::logged::Logged;

/// The stages the ingress tests queue into: `in` (the entry stage, `STAGE = in`) passes
/// on to `out`, which discards. No dispatcher runs them.
pub const PIPELINE: &str =
    "[stage-in]\nPROGRAM = {pass}\nNEXT = out\n\n[stage-out]\nPROGRAM = {discard}\n";

/// A loopback port that was free a moment ago: the system picks it for a listener
/// that is closed again at once.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// The body of the `[pepsi-ingress]` section: `LISTEN = listen`, `STAGE = in`, then the
/// lines of `extra` (each ending in a line feed).
pub fn section(listen: &str, extra: &str) -> String {
    format!("LISTEN = {listen}\nSTAGE = in\n{extra}")
}

/// A running `pepsi-ingress`: its log, signals and exit are [`Logged`]'s.
pub struct Ingress(Logged);

impl Ingress {
    /// Starts `pepsi-ingress -c conf -L debug serve` and waits until it says it
    /// accepts mail.
    pub fn start(conf: &Path) -> Ingress {
        let mut cmd = Command::new(super::bin("pepsi-ingress"));
        cmd.arg("-c").arg(conf).args(["-L", "debug", "serve"]);
        let ingress = Ingress(Logged::spawn("pepsi-ingress", &mut cmd));
        ingress.wait_log("accepting mail", Duration::from_secs(30));
        ingress
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(Duration::from_secs(30))
    }
}

impl Deref for Ingress {
    type Target = Logged;

    fn deref(&self) -> &Logged {
        &self.0
    }
}

impl DerefMut for Ingress {
    fn deref_mut(&mut self) -> &mut Logged {
        &mut self.0
    }
}

/// The Python interpreter of the client scripts (its standard library is all they
/// need).
pub const PYTHON: &str = "/usr/bin/python3";

/// What every client script starts with: `lmtp(target)` and `smtp(target)` open a
/// greeted session (`target` is `HOST:PORT` or a Unix socket's path), and
/// `transaction(…)` runs one LMTP transaction by hand, as `smtplib.LMTP.sendmail`
/// cannot: it reads only one reply after the data, where LMTP sends one per accepted
/// recipient.
const PRELUDE: &str = r#"
import json
import smtplib
import sys


def lmtp(target, **kw):
    kw.setdefault("timeout", 30)
    if target.startswith("/"):
        session = smtplib.LMTP(target, **kw)
    else:
        host, port = target.rsplit(":", 1)
        session = smtplib.LMTP(host, int(port), **kw)
    code, _ = session.ehlo("client.example")
    assert code == 250, code
    return session


def smtp(target, **kw):
    kw.setdefault("timeout", 30)
    host, port = target.rsplit(":", 1)
    session = smtplib.SMTP(host, int(port), **kw)
    code, _ = session.ehlo("client.example")
    assert code == 250, code
    return session


def text(reply):
    code, msg = reply
    return [code, msg.decode("utf-8", "replace")]


def transaction(session, sender, rcpts, data, mail_options=(), rcpt_options=()):
    """One transaction by hand: the replies to MAIL, to each RCPT, and after the data
    (LMTP: one per accepted recipient; SMTP: one); no data is sent when MAIL or every
    RCPT was refused."""
    out = {"mail": text(session.mail(sender, list(mail_options))), "rcpt": [], "data": []}
    if out["mail"][0] != 250:
        return out
    accepted = 0
    for i, r in enumerate(rcpts):
        options = rcpt_options[i] if i < len(rcpt_options) else []
        reply = text(session.rcpt(r, list(options)))
        out["rcpt"].append(reply)
        accepted += reply[0] == 250
    if accepted == 0:
        session.rset()
        return out
    # data() sends DATA, then (once it is answered 354) the data dot-stuffed, and
    # returns the first reply after it.
    out["data"].append(text(session.data(data)))
    if isinstance(session, smtplib.LMTP):
        for _ in range(accepted - 1):
            out["data"].append(text(session.getreply()))
    return out
"#;

/// Starts a client script (`PRELUDE` then `script`) with `args`, its stdout and
/// stderr piped.
pub fn python_child(script: &str, args: &[&str]) -> Child {
    Command::new(PYTHON)
        .arg("-c")
        .arg(format!("{PRELUDE}\n{script}"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {PYTHON}: {e}"))
}

/// Reads a pipe to its end on a thread of its own.
pub fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Waits up to `timeout` for a child to exit; kills it and fails after that.
#[track_caller]
pub fn wait_child(child: &mut Child, timeout: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran longer than {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a client script (`PRELUDE` then `script`) with `args` and returns the JSON
/// value of the last line it printed; fails with its output when it fails or runs
/// longer than `timeout`.
#[track_caller]
pub fn python(script: &str, args: &[&str], timeout: Duration) -> serde_json::Value {
    let mut child = python_child(script, args);
    // Both pipes are read beside the wait, so that a chatty script cannot block.
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let status = wait_child(&mut child, timeout, "the client script");
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    assert!(
        status.success(),
        "the client script failed ({status}):\n{stdout}\n{stderr}"
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("the client script printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// Sends one small LMTP message from `a@x.example` to `rcpts` in a session of its own
/// at `target` (`HOST:PORT` or a socket's path); returns the transaction's replies
/// (`{"mail": [code, text], "rcpt": [...], "data": [...]}`).
#[track_caller]
pub fn send_lmtp(target: &str, rcpts: &[&str]) -> serde_json::Value {
    let mut args = vec![target];
    args.extend_from_slice(rcpts);
    python(
        r#"
l = lmtp(sys.argv[1], timeout=30)
msg = b"From: a@x.example\r\nSubject: one\r\n\r\nOne message.\r\n"
out = transaction(l, "a@x.example", sys.argv[2:], msg)
l.quit()
print(json.dumps(out))
"#,
        &args,
        Duration::from_secs(60),
    )
}

/// The codes of a transaction's replies after the data (see [`send_lmtp`]).
pub fn data_codes(transaction: &serde_json::Value) -> Vec<u64> {
    transaction["data"]
        .as_array()
        .map(|replies| replies.iter().map(|r| r[0].as_u64().unwrap()).collect())
        .unwrap_or_default()
}

/// The id in a reply `250 2.0.0 Ok: queued as ID` (or LMTP's `250 2.1.5 …`).
pub fn queued_id(reply_text: &str) -> Option<i64> {
    reply_text
        .rsplit_once("queued as ")
        .and_then(|(_, id)| id.trim().parse().ok())
}

/// A client that writes bytes as given and reads replies as they come: for pipelined
/// bursts, garbage and clients that stop half-way.
pub struct Raw {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Raw {
    /// Connects to `127.0.0.1:port` and reads the greeting, which must be 220; reads
    /// time out after `timeout`.
    #[track_caller]
    pub fn connect(port: u16, timeout: Duration) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the ingress");
        stream.set_read_timeout(Some(timeout)).unwrap();
        let mut raw = Raw {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        };
        let (code, text) = raw.reply();
        assert_eq!(code, 220, "the greeting: {text}");
        raw
    }

    /// Writes `bytes` in one write.
    pub fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("write to the ingress");
    }

    /// Reads one reply, all its lines: its code and its text (the lines after their
    /// code and separator, joined by line feeds). Fails on the end of the connection.
    #[track_caller]
    pub fn reply(&mut self) -> (u16, String) {
        self.try_reply()
            .unwrap_or_else(|e| panic!("no reply from the ingress: {e}"))
    }

    /// [`Raw::reply`], or why there is none (the end of the connection, a timeout).
    pub fn try_reply(&mut self) -> std::io::Result<(u16, String)> {
        let mut text = Vec::new();
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let line = line.trim_end_matches(['\r', '\n']);
            let code: u16 = line
                .get(..3)
                .and_then(|c| c.parse().ok())
                .unwrap_or_else(|| panic!("not a reply line: {line:?}"));
            text.push(line.get(4..).unwrap_or_default().to_string());
            if line.as_bytes().get(3) != Some(&b'-') {
                return Ok((code, text.join("\n")));
            }
        }
    }

    /// Sends `command` and a line end, and returns the reply.
    #[track_caller]
    pub fn command(&mut self, command: &str) -> (u16, String) {
        self.send(format!("{command}\r\n").as_bytes());
        self.reply()
    }

    /// Does the server end the connection (reads the end of input, after `timeout`
    /// at most)?
    pub fn closed(&mut self) -> bool {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).is_ok() && rest.is_empty()
    }

    /// Does the server end the connection, whatever it sends before (a TLS alert),
    /// within the read timeout?
    pub fn ended(&mut self) -> bool {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).is_ok()
    }
}
