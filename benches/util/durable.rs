//! A durable server for the benchmarks that measure commits: the test harness starts
//! its throwaway cluster with `fsync` and `full_page_writes` off, which a production
//! server never has, so a benchmark whose figure is what a commit costs turns them on
//! first. An external server (`DATABASE_URL`) is left as it is configured.

use std::time::{Duration, Instant};

use postgres::Client;

use super::pg;

/// Makes the throwaway cluster durable (fsync and full-page writes on, WAL I/O timed)
/// and says which server it is, with `shown` settings as the server has them now.
pub fn durable_server(shown: &[&str]) -> String {
    let how = if pg::is_throwaway() {
        let mut admin = pg::admin();
        for sql in [
            "ALTER SYSTEM SET fsync = on",
            "ALTER SYSTEM SET full_page_writes = on",
            "ALTER SYSTEM SET track_wal_io_timing = on",
        ] {
            // One by one: ALTER SYSTEM cannot run in a transaction block.
            admin
                .batch_execute(sql)
                .unwrap_or_else(|e| panic!("{sql}: {}", pepsi::db::describe(&e)));
        }
        admin.batch_execute("SELECT pg_reload_conf()").unwrap();
        // The postmaster rereads its file, then signals every process; a new session
        // sees the new values once it has.
        let deadline = Instant::now() + Duration::from_secs(10);
        while setting(&mut pg::admin(), "fsync") != "on" {
            assert!(
                Instant::now() < deadline,
                "fsync is still off 10 s after ALTER SYSTEM and a reload"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        "throwaway cluster (tests/util/pg.rs starts it with fsync and full_page_writes off: \
         turned on here with ALTER SYSTEM + reload)"
    } else {
        "external server (DATABASE_URL), used as configured"
    };
    let mut c = pg::admin();
    let version = setting(&mut c, "server_version");
    let shown: Vec<String> = shown
        .iter()
        .map(|name| format!("{name}={}", setting(&mut c, name)))
        .collect();
    format!("server: PostgreSQL {version}, {how}: {}", shown.join(" "))
}

/// A setting's current value (or why it could not be read).
pub fn setting(c: &mut Client, name: &str) -> String {
    c.query_one("SELECT current_setting($1)", &[&name])
        .map(|r| r.get(0))
        .unwrap_or_else(|e| format!("? ({e})"))
}
