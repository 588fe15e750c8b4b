//! The Postfix lines the README gives (and the manual pages that repeat them), checked
//! against the code, so that a reader who copies them gets a working setup: the
//! `content_filter` names the address `pepsi-ingress` listens on by default
//! (`[pepsi-ingress] LISTEN`, from the key table), and every `pipe(8)` transport that
//! runs `pepsi-queue inject` keeps the null sender null (`null_sender=`: without it
//! Postfix passes `MAILER-DAEMON`, which `inject` refuses). Reads files only: no
//! database, no program run. `cargo test --test readme`.

use std::path::Path;

use pepsi::config::fixed;

/// A file of this source tree as its lines, roff's `\-` read as `-`.
fn lines(relative: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| l.replace("\\-", "-"))
        .collect()
}

/// The files that give the Postfix recipe.
const FILES: [&str; 3] = [
    "README.md",
    "packaging/man/pepsi-ingress.8",
    "packaging/man/pepsi-queue.8",
];

/// `HOST:PORT` of the default `LISTEN`, an LMTP listener on TCP.
fn default_lmtp_address() -> &'static str {
    let listen = fixed::LISTEN
        .kind
        .0
        .expect("[pepsi-ingress] LISTEN has a default");
    listen
        .strip_prefix("lmtp:")
        .filter(|a| !a.starts_with("unix:") && !a.contains([' ', ',']))
        .unwrap_or_else(|| panic!("the default LISTEN {listen:?} is one LMTP listener on TCP"))
}

#[test]
fn the_content_filter_names_the_address_pepsi_ingress_listens_on_by_default() {
    let address = default_lmtp_address();
    let mut seen = 0;
    for file in FILES {
        for (n, line) in lines(file).iter().enumerate() {
            // `content_filter = TRANSPORT:inet:HOST:PORT`, in main.cf or quoted in text;
            // master.cf's `-o content_filter=` (empty, after the filter) has no blanks.
            for (at, _) in line.match_indices("content_filter = ") {
                let value = line[at + "content_filter = ".len()..]
                    .split(|c: char| c.is_whitespace() || c == '`')
                    .next()
                    .unwrap_or_default();
                let (transport, next_hop) = value.split_once(':').unwrap_or_else(|| {
                    panic!("{file}:{}: {value:?} is no TRANSPORT:NEXTHOP", n + 1)
                });
                assert!(
                    ["lmtp", "pepsi"].contains(&transport),
                    "{file}:{}: content_filter names the transport {transport:?}",
                    n + 1
                );
                assert_eq!(
                    next_hop,
                    format!("inet:{address}"),
                    "{file}:{}: the content_filter names the address of [pepsi-ingress] \
                     LISTEN's default",
                    n + 1
                );
                seen += 1;
            }
            // The pepsi.conf the recipe shows listens where the filter delivers.
            if let Some(value) = line.trim().strip_prefix("LISTEN = ") {
                assert_eq!(
                    value,
                    format!("lmtp:{address}"),
                    "{file}:{}: the recipe's LISTEN",
                    n + 1
                );
            }
        }
    }
    assert!(
        seen >= 3,
        "the README and pepsi-ingress(8) give a content_filter line ({seen} found)"
    );
    let readme = lines("README.md");
    assert!(
        readme
            .iter()
            .any(|l| l.trim() == format!("content_filter = lmtp:inet:{address}")),
        "the README's main.cf line is content_filter = lmtp:inet:{address}"
    );
}

#[test]
fn every_pipe_transport_running_pepsi_queue_inject_keeps_the_null_sender_null() {
    let mut seen = 0;
    for file in FILES {
        let lines = lines(file);
        for (n, line) in lines.iter().enumerate() {
            if !line.contains("argv=/usr/bin/pepsi-queue") {
                continue;
            }
            // The attributes before argv= (user=, flags=, null_sender=) are on this line.
            let attributes = line.split("argv=").next().unwrap_or_default();
            assert!(
                attributes.split_whitespace().any(|a| a == "null_sender="),
                "{file}:{}: the pipe(8) transport sets null_sender= (empty): {line:?}",
                n + 1
            );
            assert!(
                line.contains("-f ${sender}") || lines[n + 1].contains("-f ${sender}"),
                "{file}:{}: the transport passes the sender with -f ${{sender}}",
                n + 1
            );
            seen += 1;
        }
    }
    assert!(
        seen >= 2,
        "the README and pepsi-queue(8) show the pipe(8) transport ({seen} found)"
    );
}
