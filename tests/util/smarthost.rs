//! A scripted SMTP/LMTP smarthost for the relay stage's tests: std threads and a TCP
//! listener on loopback. It records every connection, every command line and every
//! message it took (the data as the client meant it: dot-stuffing undone, the final
//! dot gone, line ends as they arrived), and answers as the test scripts it: per
//! recipient a queue of `RCPT` replies (and, in LMTP, of replies after the data; each
//! queue's replies are used once, then 250), what its EHLO/LHLO offers, how many
//! coming transfers it drops in the middle of the data, and replies to DATA other than
//! 354.
//!
//! Used by the relay suite only; it knows nothing of Pepsi.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What the smarthost offers and how it answers.
#[derive(Clone, Debug)]
pub struct Script {
    /// Speak LMTP (LHLO, one reply per recipient after the data).
    pub lmtp: bool,
    /// EHLO keywords offered.
    pub pipelining: bool,
    pub dsn: bool,
    pub smtputf8: bool,
    pub eightbit: bool,
    /// `SIZE` and its limit (`Some(0)`: no limit).
    pub size: Option<u64>,
    pub xforward: bool,
    /// Per recipient (lower-case): replies to its RCPT, each used once.
    pub rcpt: HashMap<String, VecDeque<String>>,
    /// Per recipient (lower-case), LMTP: replies after the data, each used once.
    pub after_data: HashMap<String, VecDeque<String>>,
    /// How many coming transfers to drop after the first line of their data.
    pub drop_mid_data: u32,
    /// Replies to the coming DATA commands instead of `354` (each used once; the data
    /// phase is not entered), e.g. a broken `250`.
    pub data_replies: VecDeque<String>,
    /// How long it takes over each message before it answers the data (a slow
    /// destination).
    pub data_delay: std::time::Duration,
}

impl Default for Script {
    fn default() -> Script {
        Script {
            lmtp: false,
            pipelining: true,
            dsn: true,
            smtputf8: true,
            eightbit: true,
            size: Some(0),
            xforward: true,
            rcpt: HashMap::new(),
            after_data: HashMap::new(),
            drop_mid_data: 0,
            data_replies: VecDeque::new(),
            data_delay: std::time::Duration::ZERO,
        }
    }
}

impl Script {
    /// Scripts the RCPT replies of `address`, each used once.
    pub fn rcpt(mut self, address: &str, replies: &[&str]) -> Script {
        self.rcpt.insert(
            address.to_lowercase(),
            replies.iter().map(|r| r.to_string()).collect(),
        );
        self
    }

    /// Scripts the LMTP replies after the data for `address`, each used once.
    pub fn after_data(mut self, address: &str, replies: &[&str]) -> Script {
        self.after_data.insert(
            address.to_lowercase(),
            replies.iter().map(|r| r.to_string()).collect(),
        );
        self
    }
}

/// A message the smarthost took.
#[derive(Clone, Debug)]
pub struct Received {
    /// The MAIL command line.
    pub mail: String,
    /// The recipients it answered 2xx for after the data.
    pub delivered: Vec<String>,
    /// The data.
    pub data: Vec<u8>,
}

/// What the smarthost saw.
#[derive(Default, Debug)]
pub struct Seen {
    /// Connections accepted.
    pub connections: usize,
    /// Every command line, in order.
    pub commands: Vec<String>,
    /// Every message taken.
    pub messages: Vec<Received>,
}

/// A running smarthost.
pub struct Smarthost {
    /// `127.0.0.1:PORT`.
    pub address: String,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    accepter: Option<JoinHandle<()>>,
}

impl Smarthost {
    /// Starts listening with this script.
    pub fn start(script: Script) -> Smarthost {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let script = Arc::new(Mutex::new(script));
        let stop = Arc::new(AtomicBool::new(false));
        let accepter = {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    seen.lock().unwrap().connections += 1;
                    let (seen, script) = (seen.clone(), script.clone());
                    std::thread::spawn(move || {
                        let _ = session(stream, &seen, &script);
                    });
                }
            })
        };
        Smarthost {
            address,
            seen,
            stop,
            accepter: Some(accepter),
        }
    }

    /// What it saw so far.
    pub fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }

    /// How many times `address` was delivered.
    pub fn deliveries(&self, address: &str) -> usize {
        self.seen()
            .messages
            .iter()
            .flat_map(|m| &m.delivered)
            .filter(|a| a.eq_ignore_ascii_case(address))
            .count()
    }

    /// The commands seen that start with `prefix`.
    pub fn commands(&self, prefix: &str) -> Vec<String> {
        self.seen()
            .commands
            .iter()
            .filter(|c| c.starts_with(prefix))
            .cloned()
            .collect()
    }
}

impl Drop for Smarthost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting thread so it sees the flag.
        let _ = TcpStream::connect(&self.address);
        if let Some(t) = self.accepter.take() {
            let _ = t.join();
        }
    }
}

/// The next scripted reply of `address` in `table`, or `default`.
fn next_reply(
    table: &mut HashMap<String, VecDeque<String>>,
    address: &str,
    default: &str,
) -> String {
    table
        .get_mut(&address.to_lowercase())
        .and_then(VecDeque::pop_front)
        .unwrap_or_else(|| default.to_string())
}

/// The address between the angle brackets of a MAIL or RCPT line.
fn path_of(line: &str) -> String {
    let start = line.find('<').map_or(0, |i| i + 1);
    let end = line[start..].find('>').map_or(line.len(), |i| start + i);
    line[start..end].to_string()
}

/// One client session, until QUIT, end of file or a scripted drop.
fn session(stream: TcpStream, seen: &Mutex<Seen>, script: &Mutex<Script>) -> std::io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut input = BufReader::new(stream);
    out.write_all(b"220 stub.test ESMTP\r\n")?;
    let mut mail = String::new();
    let mut accepted: Vec<String> = Vec::new();
    loop {
        let mut raw = Vec::new();
        if input.read_until(b'\n', &mut raw)? == 0 {
            return Ok(());
        }
        let line = String::from_utf8_lossy(&raw).trim_end().to_string();
        seen.lock().unwrap().commands.push(line.clone());
        let verb = line.split(' ').next().unwrap_or("").to_ascii_uppercase();
        let verb = verb.split(':').next().unwrap_or("").to_string();
        match verb.as_str() {
            "EHLO" | "LHLO" => {
                let s = script.lock().unwrap().clone();
                let mut offers = vec!["stub.test hello".to_string()];
                for (on, word) in [
                    (s.pipelining, "PIPELINING".to_string()),
                    (s.dsn, "DSN".to_string()),
                    (s.smtputf8, "SMTPUTF8".to_string()),
                    (s.eightbit, "8BITMIME".to_string()),
                    (s.xforward, "XFORWARD NAME ADDR LOGIN".to_string()),
                    (s.size.is_some(), format!("SIZE {}", s.size.unwrap_or(0))),
                ] {
                    if on {
                        offers.push(word);
                    }
                }
                offers.push("ENHANCEDSTATUSCODES".into());
                let n = offers.len();
                let mut reply = String::new();
                for (i, o) in offers.iter().enumerate() {
                    let sep = if i + 1 == n { ' ' } else { '-' };
                    reply.push_str(&format!("250{sep}{o}\r\n"));
                }
                out.write_all(reply.as_bytes())?;
            }
            "HELO" | "NOOP" | "XFORWARD" => out.write_all(b"250 2.0.0 ok\r\n")?,
            "RSET" => {
                mail.clear();
                accepted.clear();
                out.write_all(b"250 2.0.0 ok\r\n")?;
            }
            "MAIL" => {
                mail = line.clone();
                accepted.clear();
                out.write_all(b"250 2.1.0 ok\r\n")?;
            }
            "RCPT" => {
                let address = path_of(&line);
                let reply = next_reply(&mut script.lock().unwrap().rcpt, &address, "250 2.1.5 ok");
                if reply.starts_with('2') {
                    accepted.push(address);
                }
                out.write_all(format!("{reply}\r\n").as_bytes())?;
            }
            "DATA" if accepted.is_empty() => out.write_all(b"554 5.5.1 no valid recipients\r\n")?,
            "DATA" => {
                let scripted = script.lock().unwrap().data_replies.pop_front();
                if let Some(reply) = scripted {
                    out.write_all(format!("{reply}\r\n").as_bytes())?;
                    continue;
                }
                out.write_all(b"354 go ahead\r\n")?;
                let drop_it = {
                    let mut s = script.lock().unwrap();
                    let d = s.drop_mid_data > 0;
                    s.drop_mid_data = s.drop_mid_data.saturating_sub(1);
                    d
                };
                let mut data = Vec::new();
                loop {
                    let mut l = Vec::new();
                    if input.read_until(b'\n', &mut l)? == 0 {
                        return Ok(());
                    }
                    if drop_it {
                        // The connection goes away in the middle of the data.
                        return Ok(());
                    }
                    if l == b".\r\n" || l == b".\n" {
                        break;
                    }
                    let l = if l.starts_with(b".") { &l[1..] } else { &l[..] };
                    data.extend_from_slice(l);
                }
                let (lmtp, delay) = {
                    let s = script.lock().unwrap();
                    (s.lmtp, s.data_delay)
                };
                std::thread::sleep(delay);
                let mut delivered = Vec::new();
                if lmtp {
                    for r in &accepted {
                        let reply = next_reply(
                            &mut script.lock().unwrap().after_data,
                            r,
                            "250 2.1.5 delivered",
                        );
                        if reply.starts_with('2') {
                            delivered.push(r.clone());
                        }
                        out.write_all(format!("{reply}\r\n").as_bytes())?;
                    }
                } else {
                    delivered = accepted.clone();
                    out.write_all(b"250 2.0.0 queued\r\n")?;
                }
                seen.lock().unwrap().messages.push(Received {
                    mail: mail.clone(),
                    delivered,
                    data,
                });
                accepted.clear();
            }
            "QUIT" => {
                out.write_all(b"221 2.0.0 bye\r\n")?;
                return Ok(());
            }
            _ => out.write_all(b"500 5.5.2 what?\r\n")?,
        }
    }
}
