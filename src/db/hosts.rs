//! Connecting to a conninfo of several hosts (a primary and its standbys, with
//! `target_session_attrs=read-write`; SPEC §12.2): the hosts are tried in order, as the
//! client library does, but a failure names every host's reason, not only the last
//! one's ("socket /a/.s.PGSQL.5432: connection refused; db2:5432: database does not
//! allow writes"), and is classified by all of them: an unreachable host next to one
//! that refuses for its own reasons may be a failover under way, which is waited out.
//!
//! Used by [`super::open`] and the pool's connection manager; a single host, or
//! `load_balance_hosts=random`, goes through the library unchanged.

use postgres::config::{Config, LoadBalanceHosts};
use postgres::{Client, NoTls};

use super::{ConnectError, ErrorKind, classify, describe, describe_connect, target};

/// Opens one connection to the first host of `config` that takes it.
pub fn connect_any(config: &Config) -> Result<Client, ConnectError> {
    let hosts = config.get_hosts().len().max(config.get_hostaddrs().len());
    if hosts <= 1 || config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        return config.connect(NoTls).map_err(|e| ConnectError {
            kind: classify(&e),
            message: describe_connect(config, &e),
        });
    }
    let mut failures = Vec::with_capacity(hosts);
    for i in 0..hosts {
        let one = single_host(config, i);
        match one.connect(NoTls) {
            Ok(client) => return Ok(client),
            Err(e) => failures.push((classify(&e), host_of(&one), describe(&e))),
        }
    }
    Err(combined(config, &failures))
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
