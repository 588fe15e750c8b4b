//! The Postfix lines the README and its Postfix guide, doc/postfix.md, give (and the
//! manual pages that repeat them), checked against the code, so that a reader who
//! copies them gets a working setup: the `content_filter` names the address
//! `pepsi-ingress` listens on by default (`[pepsi-ingress] LISTEN`, from the key
//! table), and every `pipe(8)` transport that runs `pepsi-queue inject` keeps the null
//! sender null (`null_sender=`: without it Postfix passes `MAILER-DAEMON`, which
//! `inject` refuses). The README's quick start is checked against the package and its
//! delivery script run. And the documentation holds together: the README stays short
//! (at most 300 lines, the rest in the guides under doc/), and every relative link of
//! the README and the guides reaches a file that exists and, for a `#anchor` into a
//! Markdown file, one of its headings. Reads files only (the delivery script aside): no
//! database. `cargo test --test readme`.

#[path = "util/quick_start_file.rs"]
mod quick_start_file;

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

/// The files that give the Postfix recipe, or lines of it: the README (the quick start
/// names the `content_filter`), the guide with the whole recipe, and the manual pages.
const FILES: [&str; 4] = [
    "README.md",
    "doc/postfix.md",
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
        "the README, doc/postfix.md and pepsi-ingress(8) give a content_filter line ({seen} found)"
    );
    let guide = lines("doc/postfix.md");
    assert!(
        guide
            .iter()
            .any(|l| l.trim() == format!("content_filter = lmtp:inet:{address}")),
        "the recipe's main.cf line (doc/postfix.md) is content_filter = lmtp:inet:{address}"
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
        "doc/postfix.md and pepsi-queue(8) show the pipe(8) transport ({seen} found)"
    );
}

/// The quick start: the README from its quick start heading up to its next section of
/// that level (the quick start stays whole in the README; the guides hold the rest).
fn quick_start() -> Vec<String> {
    let readme = lines("README.md");
    let start = readme
        .iter()
        .position(|l| l.starts_with("## ") && l.to_lowercase().contains("quick start"))
        .expect("the README has a quick start");
    readme[start..]
        .iter()
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .cloned()
        .collect()
}

/// The quick start's delivery script, from its here-document.
fn deliver_script() -> String {
    let quick = quick_start();
    let start = quick
        .iter()
        .position(|l| l.trim() == "cat >/usr/local/lib/pepsi/deliver <<'EOF'")
        .expect("the quick start writes /usr/local/lib/pepsi/deliver");
    quick[start + 1..]
        .iter()
        .take_while(|l| l.trim() != "EOF")
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect()
}

#[test]
fn the_quick_start_installs_the_package_where_build_deb_puts_it_and_names_the_system() {
    let quick = quick_start();
    let install = quick
        .iter()
        .find_map(|l| l.trim().strip_prefix("apt install ./"))
        .expect("an apt install line of the package");
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        install.starts_with(&format!("target/debian/pepsi_{version}-"))
            && install.ends_with(".deb"),
        "the path build-deb prints, from the repository's root: {install}"
    );
    let build =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/build-deb"))
            .unwrap();
    assert!(
        build.contains("out=${1:-$target/debian}"),
        "build-deb writes to target/debian"
    );
    // HOSTNAME is set, by a sed the example configuration's line matches.
    let sed = quick
        .iter()
        .find(|l| l.contains("s/^#HOSTNAME = .*/HOSTNAME = "))
        .expect("the quick start sets [pepsi] HOSTNAME");
    assert!(sed.contains("/etc/pepsi/pepsi.conf"), "{sed}");
    assert!(
        lines("packaging/pepsi.conf")
            .iter()
            .any(|l| l.starts_with("#HOSTNAME = ")),
        "the example configuration has the #HOSTNAME line the sed replaces"
    );
    // The example configuration points at the README's delivery program rather than
    // showing another.
    let example = lines("packaging/pepsi.conf").join("\n");
    assert!(example.contains("/usr/local/lib/pepsi/deliver: the README's quick start"));
    assert!(!example.contains("#!/bin/sh"), "no second delivery script");
}

#[test]
fn every_address_the_quick_start_sends_from_or_to_has_a_folder() {
    let quick = quick_start();
    let folders: Vec<String> = quick
        .iter()
        .filter(|l| l.trim().starts_with("install -d -o pepsi-exec"))
        .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter_map(|w| w.strip_prefix("/var/spool/pepsi/mail/").map(str::to_string))
        .collect();
    let mut addresses = Vec::new();
    for line in quick.iter().filter(|l| l.contains("pepsi-queue inject")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2) {
            if pair[0] == "--from" || pair[0] == "--to" {
                addresses.push(pair[1].to_string());
            }
        }
    }
    assert!(addresses.len() >= 2, "{addresses:?}");
    for address in addresses {
        assert!(
            folders.contains(&address),
            "{address} has a folder in the quick start (it sends or receives there, and a report goes back to a sender): {folders:?}"
        );
    }
}

#[test]
fn the_delivery_script_takes_a_recipient_that_looks_like_a_pattern_as_an_address() {
    let dir = std::env::temp_dir().join(format!("pepsi-readme-deliver-{}", std::process::id()));
    let mail = dir.join("mail");
    std::fs::create_dir_all(mail.join("bob@example.org")).unwrap();
    let script = deliver_script().replace("/var/spool/pepsi/mail", mail.to_str().unwrap());
    let path = dir.join("deliver");
    std::fs::write(&path, script).unwrap();
    // A recipient `*@example.org`, which the shell would expand to bob's folder name in
    // the mail directory: no such folder, so it is refused (67), and bob gets nothing.
    let run = |recipients: &str| {
        let list = dir.join("recipients");
        std::fs::write(&list, recipients).unwrap();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3<'{}'; exec sh '{}' </dev/null",
                list.display(),
                path.display()
            ))
            .current_dir(&mail)
            .env("PEPSI_ID", "7")
            .env("PEPSI_RECIPIENTS", recipients.trim().replace('\n', ","))
            .status()
            .unwrap();
        status.code()
    };
    let refused = run("*@example.org\n");
    let delivered = run("bob@example.org\n");
    let bob: Vec<_> = std::fs::read_dir(mail.join("bob@example.org"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(refused, Some(67), "a pattern is no folder");
    assert_eq!(delivered, Some(0));
    assert_eq!(bob, ["7.eml"], "bob got only his own message");
}

#[test]
fn the_readme_is_at_most_300_lines() {
    let count = lines("README.md").len();
    assert!(
        count <= 300,
        "README.md has {count} lines, more than 300: the detail belongs in a guide under doc/"
    );
}

/// The Markdown files whose links are checked: the README and every file of doc/.
fn markdown_files() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("doc");
    let mut guides: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.ends_with(".md").then(|| format!("doc/{name}"))
        })
        .collect();
    guides.sort();
    assert!(
        guides.contains(&"doc/README.md".to_string()),
        "doc/ has its index, doc/README.md"
    );
    let mut files = vec!["README.md".to_string()];
    files.extend(guides);
    files
}

/// The lines of a Markdown text outside its fenced code blocks, each with its number
/// (from 1). Indented code blocks are kept: none of them holds a heading (a `#` in the
/// first column) or a `](`.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut kept = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            kept.push((n + 1, line));
        }
    }
    kept
}

/// GitHub's anchor of a heading's text: lower case, every character dropped but
/// letters, digits, `_`, `-` and spaces, each space a `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text's headings; a repeated one gets `-1`, `-2` … as on
/// GitHub.
fn anchors(text: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for (_, line) in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = anchor(heading);
        let mut name = base.clone();
        let mut repeat = 0;
        while found.contains(&name) {
            repeat += 1;
            name = format!("{base}-{repeat}");
        }
        found.push(name);
    }
    found
}

/// The targets of a Markdown text's inline links (`[text](TARGET)`), with their line
/// numbers.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            found.push((n, after[..end].to_string()));
            rest = &after[end..];
        }
    }
    found
}

#[test]
fn every_relative_link_of_the_readme_and_the_guides_reaches_a_file_and_heading_that_exist() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in markdown_files() {
        let path = top.join(&file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (n, target) in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if target.is_empty() || target.contains(char::is_whitespace) {
                broken.push(format!("{file}:{n}: ({target}) is no link target"));
                continue;
            }
            let (relative, fragment) = match target.split_once('#') {
                Some((relative, fragment)) => (relative, Some(fragment)),
                None => (target.as_str(), None),
            };
            let linked = if relative.is_empty() {
                path.clone()
            } else {
                path.parent().unwrap().join(relative)
            };
            if !linked.exists() {
                broken.push(format!(
                    "{file}:{n}: {target}: no file {}",
                    linked.display()
                ));
                continue;
            }
            if let Some(fragment) = fragment {
                if linked.extension().and_then(|e| e.to_str()) != Some("md") {
                    broken.push(format!(
                        "{file}:{n}: {target}: an anchor into no Markdown file"
                    ));
                    continue;
                }
                let linked_text = std::fs::read_to_string(&linked).unwrap();
                let headings = anchors(&linked_text);
                if !headings.iter().any(|h| h == fragment) {
                    broken.push(format!(
                        "{file}:{n}: {target}: no heading with the anchor #{fragment} in {}",
                        linked.display()
                    ));
                    continue;
                }
            }
            checked += 1;
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked >= 20,
        "the README and the guides link to each other ({checked} links)"
    );
}

#[test]
fn the_index_of_doc_lists_every_guide_and_the_readme_links_to_it() {
    let index =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("doc/README.md"))
            .unwrap();
    let listed: Vec<String> = link_targets(&index).into_iter().map(|(_, t)| t).collect();
    for file in markdown_files() {
        let Some(name) = file.strip_prefix("doc/") else {
            continue;
        };
        if name != "README.md" {
            assert!(
                listed.iter().any(|t| t == name),
                "doc/README.md lists {file} ({listed:?})"
            );
        }
    }
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    assert!(
        link_targets(&readme)
            .iter()
            .any(|(_, t)| t == "doc/README.md"),
        "the README links to the index of the guides"
    );
}

#[test]
fn headings_get_github_anchors() {
    assert_eq!(
        anchor(" Operating the queue: `pepsi-queue`"),
        "operating-the-queue-pepsi-queue"
    );
    assert_eq!(
        anchor(" The oldest snapshot, and `pg_dump`"),
        "the-oldest-snapshot-and-pg_dump"
    );
    assert_eq!(
        anchors("# A\n```\n# not a heading\n```\n## A\n#nope\n"),
        ["a", "a-1"]
    );
}

/// Every problem `pepsi-dispatch check` finds in a file without the database: errors,
/// warnings (unknown and unread keys), the stage graph, each built-in stage's section.
fn file_problems(path: &Path) -> Vec<String> {
    use pepsi::config::{Config, keys};
    let config = match Config::load(Some(path)) {
        Ok(config) => config,
        Err(errors) => return errors.iter().map(ToString::to_string).collect(),
    };
    let mut problems: Vec<String> = config.warnings.iter().map(ToString::to_string).collect();
    match config.file_graph() {
        Err(errors) => problems.extend(errors.iter().map(ToString::to_string)),
        Ok(graph) => {
            problems.extend(
                pepsi::stages::check_sections(graph.stages())
                    .iter()
                    .map(ToString::to_string),
            );
            let sections: Vec<_> = graph.stages().map(|s| &s.section).collect();
            problems.extend(
                keys::unknown_keys(sections.iter().copied(), pepsi::stages::program_keys)
                    .iter()
                    .map(ToString::to_string),
            );
            problems.extend(
                keys::ignored_keys(sections, pepsi::stages::ignored_keys)
                    .iter()
                    .map(ToString::to_string),
            );
        }
    }
    problems
}

#[test]
fn the_quick_starts_edits_of_the_shipped_file_give_a_file_check_accepts() {
    let dir = std::env::temp_dir().join(format!("pepsi-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let edits = quick_start_file::config_edits(&quick_start());
    assert!(
        edits.len() >= 3,
        "the quick start edits the file: {edits:?}"
    );
    let path = quick_start_file::edited_example(&dir, &edits);
    let problems = file_problems(&path);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let text = std::fs::read_to_string(&path).unwrap();
    for line in [
        "[stage-filter]",
        "[stage-deliver]",
        "BOUNCE_STAGE = bounce",
        "STAGE = filter",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} is on");
    }
    assert!(
        text.lines()
            .any(|l| l == "# The account the command runs as (never root, RUN_AS or WORKER_AS)."),
        "the explanations stay comments"
    );
    // The Postfix guide's edits for the quick start's pipeline: the recipe's reinject
    // takes what filter discarded, and the result still checks.
    let guide = lines("doc/postfix.md");
    let with_postfix: Vec<String> = edits
        .iter()
        .cloned()
        .chain(quick_start_file::config_edits(&guide))
        .collect();
    let path = quick_start_file::edited_example(&dir, &with_postfix);
    let problems = file_problems(&path);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.lines().any(|l| l == "ELSE_STAGE = reinject"), "{text}");
    assert!(text.lines().any(|l| l == "[stage-reinject]"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
