//! Connecting (§12.2, §8.4): the hosts of a conninfo are tried in order, as the
//! client library does (in a random order with `load_balance_hosts=random`), one at a
//! time, each attempt bounded as a whole — socket, startup and authentication — by
//! `connect_timeout` and watched by [`super::watch`], which ends it early when the
//! host stops answering; a host already found unresponsive is skipped. A failure names
//! every host's reason, not only the last one's ("socket /a/.s.PGSQL.5432: connection
//! refused; db2:5432: database does not allow writes"), and is classified by all of
//! them: an unreachable host next to one that refuses for its own reasons may be a
//! failover under way, which is waited out. A connection made is registered with the
//! watchdog, which bounds its statements by its `statement_timeout` and the grace.
//!
//! Used by [`super::open`] and the pool's connection manager.

use std::time::Duration;

use postgres::NoTls;
use postgres::config::{Config, LoadBalanceHosts};

use super::client::Client;
use super::watch::{self, Host};
use super::{ConnectError, ErrorKind, classify, describe, target};

/// `connect_timeout` when the connection string gives none (`connection_config` sets
/// it for every program).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens one connection to the first host of `config` that takes it.
pub fn connect_any(config: &Config) -> Result<Client, ConnectError> {
    let hosts = config.get_hosts().len().max(config.get_hostaddrs().len());
    if hosts <= 1 {
        return connect_one(config).map_err(|(kind, _, why)| ConnectError {
            kind,
            message: format!("cannot connect to {}: {why}", target(config)),
        });
    }
    let mut order: Vec<usize> = (0..hosts).collect();
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        let seed = u64::from_str_radix(&crate::random::hex(8), 16).unwrap_or(0);
        let offset = (seed % hosts as u64) as usize;
        order.rotate_left(offset);
    }
    let mut failures = Vec::with_capacity(hosts);
    for i in order {
        match connect_one(&single_host(config, i)) {
            Ok(client) => return Ok(client),
            Err(failure) => failures.push(failure),
        }
    }
    Err(combined(config, &failures))
}

/// One attempt at the one host of `one`: the client, watched, or the failure's kind,
/// the host and the reason.
fn connect_one(one: &Config) -> Result<Client, (ErrorKind, String, String)> {
    let Some(host) = Host::of(one) else {
        // No host: the library says what is missing.
        return match one.connect(NoTls) {
            Ok(c) => Ok(Client::unwatched(c)),
            Err(e) => Err((classify(&e), host_of(one), describe(&e))),
        };
    };
    if let Some(why) = watch::unresponsive(&host) {
        return Err((ErrorKind::Connection, host_of(one), why));
    }
    let limit = one
        .get_connect_timeout()
        .copied()
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let attempt = watch::attempt(&host, limit);
    match one.connect(NoTls) {
        Ok(client) => {
            let socket = attempt.socket();
            drop(attempt);
            let statement_timeout = watch::statement_timeout(one.get_options().unwrap_or(""));
            let name = one.get_application_name().unwrap_or("pepsi");
            let watched = socket.map(|s| watch::register(s, &host, statement_timeout, name));
            Ok(Client::watched(client, watched))
        }
        Err(e) if attempt.fired() => {
            let why = match watch::unresponsive(&host) {
                Some(why) => format!("does not answer: {why}"),
                None => format!(
                    "no answer within connect_timeout ({:.0}s)",
                    limit.as_secs_f64()
                ),
            };
            drop(attempt);
            log::debug!(
                "connection to {} ended by the watchdog: {}",
                host.key(),
                describe(&e)
            );
            Err((ErrorKind::Connection, host_of(one), why))
        }
        Err(e) => Err((classify(&e), host_of(one), describe(&e))),
    }
}

/// The failure of every host: `Overload` if one refused for overload, else
/// `Connection` if one could not be reached (or was not what `target_session_attrs`
/// asks, which the library reports as an I/O error), else the first host's kind.
fn combined(config: &Config, failures: &[(ErrorKind, String, String)]) -> ConnectError {
    let kinds = || failures.iter().map(|(k, _, _)| *k);
    let kind = if kinds().any(|k| k == ErrorKind::Overload) {
        ErrorKind::Overload
    } else if kinds().any(|k| k == ErrorKind::Connection) {
        ErrorKind::Connection
    } else {
        kinds().next().unwrap_or(ErrorKind::Connection)
    };
    let reasons: Vec<String> = failures
        .iter()
        .map(|(_, host, why)| format!("{host}: {why}"))
        .collect();
    ConnectError {
        kind,
        message: format!(
            "cannot connect to any of {} hosts ({}): {}",
            failures.len(),
            target(config),
            reasons.join("; ")
        ),
    }
}

/// Host `i` of `config` (its port, its `hostaddr`) with every other setting.
fn single_host(config: &Config, i: usize) -> Config {
    let mut one = Config::new();
    if let Some(host) = config.get_hosts().get(i) {
        match host {
            postgres::config::Host::Tcp(name) => one.host(name),
            postgres::config::Host::Unix(dir) => one.host_path(dir),
        };
    }
    if let Some(addr) = config.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    let ports = config.get_ports();
    if let Some(port) = ports.get(i).or(ports.first()) {
        one.port(*port);
    }
    if let Some(user) = config.get_user() {
        one.user(user);
    }
    if let Some(password) = config.get_password() {
        one.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        one.options(options);
    }
    if let Some(name) = config.get_application_name() {
        one.application_name(name);
    }
    if let Some(t) = config.get_connect_timeout() {
        one.connect_timeout(*t);
    }
    if let Some(t) = config.get_tcp_user_timeout() {
        one.tcp_user_timeout(*t);
    }
    one.ssl_mode(config.get_ssl_mode())
        .ssl_negotiation(config.get_ssl_negotiation())
        .keepalives(config.get_keepalives())
        .keepalives_idle(config.get_keepalives_idle())
        .target_session_attrs(config.get_target_session_attrs())
        .channel_binding(config.get_channel_binding());
    if let Some(t) = config.get_keepalives_interval() {
        one.keepalives_interval(t);
    }
    if let Some(n) = config.get_keepalives_retries() {
        one.keepalives_retries(n);
    }
    one
}

/// The one host of a single-host configuration, as [`target`] shows hosts.
fn host_of(one: &Config) -> String {
    let all = target(one);
    all.split(" as user ").next().unwrap_or(&all).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(conninfo: &str) -> Config {
        conninfo.parse().unwrap()
    }

    #[test]
    fn each_host_keeps_every_other_setting_and_its_own_port() {
        let all = parsed(
            "host=/a,db2 port=5521,5522 user=u password=p dbname=d options='-c x=1' \
             application_name=n connect_timeout=7 keepalives_idle=30 keepalives_interval=5 \
             keepalives_retries=2 target_session_attrs=read-write",
        );
        let second = single_host(&all, 1);
        let want = parsed(
            "host=db2 port=5522 user=u password=p dbname=d options='-c x=1' \
             application_name=n connect_timeout=7 keepalives_idle=30 keepalives_interval=5 \
             keepalives_retries=2 target_session_attrs=read-write",
        );
        assert_eq!(format!("{second:?}"), format!("{want:?}"));
        assert_eq!(second.get_password(), Some(&b"p"[..]));
        assert_eq!(host_of(&single_host(&all, 0)), "socket /a/.s.PGSQL.5521");
        // One port for every host.
        let shared = parsed("host=h1,h2 port=6000 hostaddr=127.0.0.1,127.0.0.2");
        let second = single_host(&shared, 1);
        assert_eq!(second.get_ports(), [6000]);
        assert_eq!(
            second.get_hostaddrs(),
            ["127.0.0.2".parse::<std::net::IpAddr>().unwrap()]
        );
    }

    #[test]
    fn a_failed_multi_host_connect_names_every_hosts_reason() {
        let dir = std::env::temp_dir().join(format!("pepsi-hosts-{}", std::process::id()));
        let config = parsed(&format!(
            "host={d}/one,{d}/two port=5521,5522 user=u dbname=d connect_timeout=2",
            d = dir.display()
        ));
        let Err(e) = connect_any(&config) else {
            panic!("connected to a socket that does not exist")
        };
        assert_eq!(e.kind, ErrorKind::Connection);
        assert!(
            e.message.starts_with("cannot connect to any of 2 hosts ("),
            "{}",
            e.message
        );
        for socket in ["one/.s.PGSQL.5521: ", "two/.s.PGSQL.5522: "] {
            assert!(e.message.contains(socket), "{socket} in {}", e.message);
        }
        assert_eq!(
            e.message.matches("No such file or directory").count(),
            2,
            "{}",
            e.message
        );
    }

    #[test]
    fn the_kind_of_a_multi_host_failure_is_the_most_hopeful() {
        let config = parsed("host=a,b");
        let f = |kinds: &[ErrorKind]| {
            let failures: Vec<_> = kinds
                .iter()
                .map(|k| (*k, "h".to_string(), "why".to_string()))
                .collect();
            combined(&config, &failures).kind
        };
        use ErrorKind::*;
        assert_eq!(f(&[Other, Connection]), Connection);
        assert_eq!(f(&[Connection, Overload]), Overload);
        assert_eq!(f(&[Other, Other]), Other);
    }
}
