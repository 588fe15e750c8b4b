//! A database server that stops answering (§8.4 "A server that hangs"): each
//! program's connection to a server that accepts and never says a word ends within
//! `connect_timeout`, naming the host, and a statement whose server process is stopped
//! is abandoned within its `statement_timeout` and the grace. Without the watchdog
//! every one of these waits for ever (the client library bounds only the socket's
//! connect).

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::util::bouncer::Bouncer;
use crate::util::dispatcher::Dispatcher;
use crate::util::ingress::{Ingress, free_port, section};
use crate::util::pg::{TestDb, is_throwaway, process_alive};
use crate::util::worker::Worker;
use crate::util::{TempDir, bin, stage, stderr, stdout};

/// The `connect_timeout` of these tests.
const CONNECT_TIMEOUT: u64 = 3;
/// What a program may take beyond it (a machine that is busy with other tests).
const SLACK: Duration = Duration::from_secs(6);

/// A "server" on a socket file that accepts every connection and never answers.
struct Silent {
    dir: TempDir,
    stop: Arc<AtomicBool>,
    accepter: Option<std::thread::JoinHandle<Vec<UnixStream>>>,
}

impl Silent {
    fn start(tag: &str) -> Silent {
        let dir = TempDir::new(tag);
        let listener = UnixListener::bind(dir.path(".s.PGSQL.5432")).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        // Holds every connection open, and reads nothing.
        let accepter = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => held.push(s),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            held
        });
        Silent {
            dir,
            stop,
            accepter: Some(accepter),
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path(".s.PGSQL.5432")
    }

    fn conninfo(&self) -> String {
        format!(
            "host={} port=5432 user=pepsi dbname=pepsi connect_timeout={CONNECT_TIMEOUT}",
            self.dir.0.display()
        )
    }

    /// A configuration whose every connection goes to this server.
    fn config(&self, extra: &str) -> PathBuf {
        self.dir.write(
            "pepsi.conf",
            &format!(
                "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n\
                 [pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\n\
                 [stage-in]\nPROGRAM = {}\nNEXT = bounce\n\n\
                 [stage-bounce]\nPROGRAM = {}\n\n{extra}",
                self.conninfo(),
                stage("pass").display(),
                stage("discard").display()
            ),
        )
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(a) = self.accepter.take() {
            let _ = a.join();
        }
    }
}

/// Runs a command-line tool; returns its output and how long it took.
fn timed(program: &str, args: &[&str]) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let out = Command::new(bin(program))
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (out, started.elapsed())
}

#[test]
fn every_program_gives_up_on_a_server_that_accepts_and_never_answers_within_connect_timeout() {
    let silent = Silent::start("hung-connect");
    let conf = silent.config("");
    let c = conf.to_str().unwrap();
    let socket = silent.socket().display().to_string();
    let bound = Duration::from_secs(CONNECT_TIMEOUT) + SLACK;

    // The command-line tools: 75 (try again later), naming the socket.
    for (program, args) in [
        ("pepsi-queue", vec!["-c", c, "status"]),
        ("pepsi-setup", vec!["-c", c, "schema"]),
        ("pepsi-dispatch", vec!["-c", c, "check"]),
    ] {
        let (out, took) = timed(program, &args);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert_eq!(out.status.code(), Some(75), "{program}: {text}");
        assert!(took < bound, "{program} took {took:?}: {text}");
        assert!(text.contains(&socket), "{program} names {socket}: {text}");
    }

    // A worker started by hand: its pool gives up at its checkout timeout (10 s), every
    // connection having ended within connect_timeout; 74, the database out of reach.
    let started = Instant::now();
    let mut worker = Worker::start(&stage("pass"), &conf);
    let (status, log) = worker.finish();
    assert_eq!(status.code(), Some(74), "{log}");
    assert!(started.elapsed() < Duration::from_secs(10) + SLACK, "{log}");
    assert!(log.contains(&socket), "{log}");

    // The daemons keep trying, and say why, naming the socket, within the bound.
    let d = Dispatcher::start(&conf, &[]);
    d.wait_log(
        &format!("the database is not available (cannot connect to socket {socket}"),
        bound,
    );
    let b = Bouncer::serve(&conf, &[]);
    b.wait_log(&socket, bound);
    let port = free_port();
    let ingress_conf = silent.dir.write(
        "ingress.conf",
        &format!(
            "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {}\n\n[pepsi-ingress]\n{}\n[stage-in]\nPROGRAM = {}\n",
            silent.conninfo(),
            section(&format!("lmtp:127.0.0.1:{port}"), ""),
            stage("pass").display()
        ),
    );
    let i = Ingress::start(&ingress_conf);
    i.wait_log("the database is unavailable at start", bound);
    assert!(i.log().contains(&socket), "{}", i.log());
}

#[test]
fn a_statement_whose_server_process_is_stopped_is_abandoned_within_statement_timeout_and_grace() {
    if !is_throwaway() {
        println!("skipped: needs the throwaway cluster, whose server processes it may stop");
        return;
    }
    let db = TestDb::new();
    let conninfo = format!("{} options='-c statement_timeout=1s'", db.connection());
    let mut client = pepsi::db::connect(&conninfo, "pepsi-test").unwrap();
    assert!(client.is_watched(), "the session's socket was found");
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    assert!(process_alive(pid as u32));
    // SAFETY: stopping (and below resuming) a server process of the throwaway cluster.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let started = Instant::now();
    let result = client.query_one("SELECT 1", &[]);
    let took = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let e = result.expect_err("no answer can come from a stopped server process");
    assert_eq!(
        pepsi::db::classify(&e),
        pepsi::db::ErrorKind::Connection,
        "{e}"
    );
    assert!(client.abandoned());
    // 1 s of statement_timeout and 2 s of grace; the server, whose postmaster still
    // answers, is not taken for unresponsive, so nothing ends it earlier.
    assert!(took >= Duration::from_millis(2900), "{took:?}");
    assert!(took < Duration::from_secs(3) + SLACK, "{took:?}");
    // The server is fine: a new session works at once.
    let mut again = pepsi::db::connect(&conninfo, "pepsi-test").unwrap();
    assert_eq!(
        again.query_one("SELECT 1", &[]).unwrap().get::<_, i32>(0),
        1
    );
}
