//! The signing and rewriting benchmark: `cargo bench --bench signing` (release build).
//! Prints, measured in one run against one PostgreSQL server (a throwaway cluster, or
//! `DATABASE_URL`):
//!
//! - the machine's own signing limit: `openssl speed -seconds 3 rsa2048 ed25519`, signs/s
//!   of one core, times the cores;
//! - the signer alone: `dkim::sign::sign` on a 4 KiB message in one thread per core for
//!   3 s, no database, against that limit (what the crypto and the canonicalization cost);
//! - messages/s through one stage (then `discard`, fused into the same pass) for 4 KiB
//!   messages at `PARALLELISM` = the cores: `dkim-sign` with an RSA-2048 key, with an
//!   Ed25519 key, `srs` in forward mode, and `pass` for comparison; each `dkim-sign` rate
//!   as a share of the limit of its algorithm, `srs` as a share of `pass`.
//!
//! The database shares the machine's cores with the stages, as on a single-host
//! install: the limit is what the cores could sign with nothing else to do.
//! `BENCH_MESSAGES` (default 4000) sets the messages per stage, `BENCH_PARALLELISM`
//! the stages' `PARALLELISM` (default the cores). Figures, never assertions.

#[allow(dead_code)]
#[path = "../tests/util/pg.rs"]
mod pg;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pg::TestDb;
use postgres::Client;

/// The stages measured: (stage, the sender's domain, what it is).
const RUNS: [(&str, &str, &str); 4] = [
    ("rsa", "rsa.example", "dkim-sign, RSA-2048"),
    ("ed", "ed.example", "dkim-sign, Ed25519"),
    ("srs", "remote.example", "srs, forward"),
    ("pass", "remote.example", "pass"),
];

/// Runs `openssl` in `dir`; its standard output.
fn openssl(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One core's signs/s for RSA-2048 and Ed25519, from `openssl speed`.
fn signing_speed(dir: &Path) -> (f64, f64) {
    let text = openssl(dir, &["speed", "-seconds", "3", "rsa2048", "ed25519"]);
    let rate = |marker: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.contains(marker))
            .unwrap_or_else(|| panic!("no {marker:?} line in openssl speed's output:\n{text}"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields[fields.len() - 2].parse().expect("sign/s")
    };
    (rate("rsa 2048 bits"), rate("(Ed25519)"))
}

/// The files of the run: stage links, keys, secrets, the configuration.
fn files(dir: &Path, db: &TestDb, parallelism: usize) -> PathBuf {
    for s in ["dkim-sign", "srs", "pass", "discard"] {
        std::os::unix::fs::symlink(
            env!("CARGO_BIN_EXE_pepsi-stage"),
            dir.join(format!("pepsi-stage-{s}")),
        )
        .unwrap();
    }
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            "rsa.pem",
        ],
    );
    openssl(dir, &["genpkey", "-algorithm", "ed25519", "-out", "ed.pem"]);
    let private = |name: &str| {
        std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    private("rsa.pem");
    private("ed.pem");
    let d = dir.display();
    std::fs::write(
        dir.join("keys"),
        format!("rsa.example s rsa-sha256 {d}/rsa.pem\ned.example s ed25519-sha256 {d}/ed.pem\n"),
    )
    .unwrap();
    std::fs::write(dir.join("secrets"), "b3nch-s3cret\n").unwrap();
    private("secrets");
    let stage = |name: &str| {
        dir.join(format!("pepsi-stage-{name}"))
            .display()
            .to_string()
    };
    let conf = dir.join("pepsi.conf");
    let text = format!(
        "[pepsi]\nRUN_AS = root\n\n[pepsi-postgres]\nCONNECTION = {conn}\n\n\
         [pepsi-dispatch]\nSTATS_INTERVAL = 60s\nWORKER_IDLE_TIMEOUT = 600s\n\n\
         [stage-rsa]\nPROGRAM = {sign}\nKEY_TABLE = {d}/keys\nNEXT = done\nPARALLELISM = {parallelism}\n\n\
         [stage-ed]\nPROGRAM = {sign}\nKEY_TABLE = {d}/keys\nNEXT = done\nPARALLELISM = {parallelism}\n\n\
         [stage-srs]\nPROGRAM = {srs}\nMODE = forward\nSRS_DOMAIN = fwd.example\n\
         SECRETS_FILE = {d}/secrets\nNEXT = done\nPARALLELISM = {parallelism}\n\n\
         [stage-pass]\nPROGRAM = {pass}\nNEXT = done\nPARALLELISM = {parallelism}\n\n\
         [stage-done]\nPROGRAM = {discard}\n",
        conn = db.conninfo,
        sign = stage("dkim-sign"),
        srs = stage("srs"),
        pass = stage("pass"),
        discard = stage("discard"),
    );
    std::fs::write(&conf, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pepsi-setup"))
        .arg("-c")
        .arg(&conf)
        .arg("schema")
        .output()
        .expect("run pepsi-setup");
    assert!(
        out.status.success(),
        "pepsi-setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    conf
}

/// A 4 KiB body: lines of text.
fn body() -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    let mut i = 0;
    while b.len() < 4096 - 80 {
        b.extend_from_slice(
            format!("Line {i:04} of the benchmark's message, long enough to look like mail.\r\n")
                .as_bytes(),
        );
        i += 1;
    }
    b
}

/// Injects `n` messages at `stage` from `domain`, one statement.
fn inject(c: &mut Client, stage: &str, domain: &str, n: i64) {
    let headers = format!(
        "From: Sender <s@{domain}>\r\nTo: r@dest.example\r\nSubject: benchmark\r\n\
         Date: Fri, 04 Dec 2026 12:00:00 +0000\r\nMessage-ID: <bench@{domain}>\r\n\
         MIME-Version: 1.0\r\nContent-Type: text/plain; charset=us-ascii\r\n"
    );
    c.execute(
        "SELECT count(pepsi.workqueue_inject($1, 's' || g || '@' || $2, ARRAY['r@dest.example'], \
             $3::bytea, $4::bytea)) FROM generate_series(1, $5::int8) g",
        &[&stage, &domain, &headers.as_bytes(), &body(), &n],
    )
    .unwrap();
}

fn queued(c: &mut Client) -> i64 {
    c.query_one("SELECT count(*) FROM pepsi.workqueue", &[])
        .unwrap()
        .get(0)
}

/// Messages/s of `n` messages through `stage`, after 200 to warm its workers up.
fn rate(c: &mut Client, stage: &str, domain: &str, n: i64) -> f64 {
    let drain = |c: &mut Client| {
        while queued(c) > 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    inject(c, stage, domain, 200);
    drain(c);
    inject(c, stage, domain, n);
    let t0 = Instant::now();
    drain(c);
    n as f64 / t0.elapsed().as_secs_f64()
}

/// Messages/s of `sign` alone for a 4 KiB message from `domain`, one thread per core for
/// three seconds.
fn signer_alone(keys: &Path, domain: &str, cores: usize) -> f64 {
    use pepsi::stages::dkim::{keys::KeyTable, sign};
    let table = KeyTable::load(keys).expect("the key table loads");
    let headers =
        format!("From: Sender <s@{domain}>\r\nTo: r@dest.example\r\nSubject: benchmark\r\n");
    let body = body();
    let until = Instant::now() + Duration::from_secs(3);
    let t0 = Instant::now();
    let signed: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cores)
            .map(|_| {
                scope.spawn(|| {
                    let keys = table.keys_for(domain, false);
                    let options = sign::Options::default();
                    let mut n = 0u64;
                    while Instant::now() < until {
                        sign::sign(
                            headers.as_bytes(),
                            &body,
                            &keys,
                            &options,
                            std::time::SystemTime::now(),
                        )
                        .expect("signed");
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    signed as f64 / t0.elapsed().as_secs_f64()
}

fn stop(mut child: Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let n: i64 = std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let parallelism: usize = std::env::var("BENCH_PARALLELISM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cores);
    let dir = std::env::temp_dir().join(format!("pepsi-signing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (rsa_core, ed_core) = signing_speed(&dir);
    let db = TestDb::empty();
    let conf = files(&dir, &db, parallelism);
    let log = std::fs::File::create(dir.join("dispatch.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_pepsi-dispatch"))
        .arg("-c")
        .arg(&conf)
        .args(["-L", "warn", "serve"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start pepsi-dispatch");
    std::thread::sleep(Duration::from_millis(700));
    let alone = [
        signer_alone(&dir.join("keys"), "rsa.example", cores),
        signer_alone(&dir.join("keys"), "ed.example", cores),
    ];
    let mut c = db.client();
    let rates: Vec<f64> = RUNS
        .iter()
        .map(|(stage, domain, _)| rate(&mut c, stage, domain, n))
        .collect();
    stop(child);
    let limit = |per_core: f64| per_core * cores as f64;
    println!(
        "{n} messages of 4 KiB per stage, PARALLELISM = {parallelism} ({cores} cores), each stage then discard in the same pass"
    );
    println!(
        "openssl speed: RSA-2048 {rsa_core:.0} signs/s per core, Ed25519 {ed_core:.0}; limit at {cores} cores: {:.0} and {:.0}",
        limit(rsa_core),
        limit(ed_core)
    );
    println!(
        "the signer alone, {cores} threads: RSA-2048 {:.0} messages/s ({:.0} % of the limit), Ed25519 {:.0} ({:.0} %)",
        alone[0],
        100.0 * alone[0] / limit(rsa_core),
        alone[1],
        100.0 * alone[1] / limit(ed_core)
    );
    println!("{:<22} | {:>10} | against", "stage", "messages/s");
    for ((_, _, what), rate) in RUNS.iter().zip(&rates) {
        let against = match *what {
            "dkim-sign, RSA-2048" => format!(
                "{:.0} % of the RSA-2048 limit",
                100.0 * rate / limit(rsa_core)
            ),
            "dkim-sign, Ed25519" => format!(
                "{:.0} % of the Ed25519 limit",
                100.0 * rate / limit(ed_core)
            ),
            "srs, forward" => format!("{:.0} % of pass", 100.0 * rate / rates[3]),
            _ => String::new(),
        };
        println!("{what:<22} | {rate:>10.0} | {against}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
