//! The manual pages and the example configuration under `packaging/`, checked against
//! the code: every configuration key is documented in its place in `pepsi.conf.5`,
//! every built-in stage has its entry in `pepsi-stage.8`, every command, option and
//! exit status of `pepsi-queue` (as the program itself lists them) is in
//! `pepsi-queue.8`, every program of `src/bin/` has its page (and `pepsi.conf.5` names
//! it), every page another page refers to exists, the example `pepsi.conf` loads as
//! shipped and with everything in it uncommented (its `[pepsi-ingress] STAGE` an entry
//! stage of its pipeline), and `mandoc -T lint -W warning` finds nothing. No
//! database: `pepsi-queue` is only asked for its help and run with a configuration file
//! that does not exist.
//!
//! A page is read the way a reader scans it: an item is a `.TP` entry (or a further tag
//! of it, `.TQ`), named by the first word of its tag line, under the `.SH` and `.SS`
//! headings it follows.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pepsi::config::graph::STAGE_KEYS;
use pepsi::config::{Config, DbRole, keys, known_keys, raw};
use pepsi::stages::{self, BUILTINS};
use pepsi::worker::settings;

/// A file under `packaging/`.
fn packaging(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("packaging")
        .join(relative)
}

/// The pages of `packaging/man/`, sorted.
fn pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(packaging("man"))
        .expect("packaging/man exists")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    pages.sort();
    pages
}

/// Roff text as it reads: font changes dropped, `\-` a hyphen, `\&` nothing, `\e` a
/// backslash.
fn plain(roff: &str) -> String {
    let mut out = String::new();
    let mut chars = roff.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('-') => out.push('-'),
            Some('e') => out.push('\\'),
            Some('&') | None => {}
            // A font change: `\fB`, `\fI`, `\fR`, `\fP`.
            Some('f') => {
                chars.next();
            }
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
        }
    }
    out
}

/// The arguments of a macro line after its name, double quotes grouping words.
fn arguments(rest: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.next_if(|c| *c == ' ').is_some() {}
        let Some(&first) = chars.peek() else {
            return args;
        };
        let mut arg = String::new();
        if first == '"' {
            chars.next();
            for c in chars.by_ref() {
                if c == '"' {
                    break;
                }
                arg.push(c);
            }
        } else {
            while let Some(c) = chars.next_if(|c| *c != ' ') {
                arg.push(c);
            }
        }
        args.push(arg);
    }
}

/// One documented item: a `.TP` entry's name and the headings it is under.
#[derive(Debug)]
struct Item {
    /// The `.SH` heading.
    section: String,
    /// The `.SS` heading, if any since the `.SH`.
    subsection: Option<String>,
    /// The first word of the tag line.
    name: String,
    /// The whole tag line as it reads.
    tag: String,
    /// The text of its paragraph as it reads (up to the next item, paragraph or
    /// heading), lines joined by spaces.
    body: String,
}

/// A page: its text and its items.
struct Page {
    file: PathBuf,
    text: String,
    items: Vec<Item>,
    /// Every (`.SH`, `.SS`) pair, in order.
    subsections: Vec<(String, String)>,
}

impl Page {
    fn read(name: &str) -> Page {
        let file = packaging(&format!("man/{name}"));
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut items = Vec::new();
        let mut subsections = Vec::new();
        let mut section = String::new();
        let mut subsection: Option<String> = None;
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if let Some(rest) = line.strip_prefix(".SH ") {
                section = plain(&arguments(rest).join(" "));
                subsection = None;
            } else if let Some(rest) = line.strip_prefix(".SS ") {
                let name = plain(&arguments(rest).join(" "));
                subsections.push((section.clone(), name.clone()));
                subsection = Some(name);
            } else if line == ".TP" || line == ".TQ" {
                let tag = lines.next().unwrap_or_default();
                let (args, separator) = match tag.strip_prefix('.') {
                    // A font macro: its arguments, which `.B` and `.I` set apart with
                    // spaces and the alternating macros (`.BR`, `.IR`, …) run together.
                    Some(call) => {
                        let (name, rest) = call.split_once(' ').unwrap_or((call, ""));
                        let separator = if matches!(name, "B" | "I") { " " } else { "" };
                        (arguments(rest), separator)
                    }
                    None => (vec![tag.to_string()], ""),
                };
                let tag = plain(&args.join(separator));
                let name = plain(args.first().map_or("", String::as_str))
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let mut body = Vec::new();
                while let Some(next) = lines.next_if(|l| {
                    ![".TP", ".TQ", ".PP", ".IP", ".SS", ".SH"]
                        .iter()
                        .any(|m| l.split(' ').next() == Some(*m))
                }) {
                    body.push(match next.strip_prefix('.') {
                        Some(call) => plain(
                            &arguments(call.split_once(' ').map_or("", |(_, rest)| rest)).join(""),
                        ),
                        None => plain(next),
                    });
                }
                items.push(Item {
                    section: section.clone(),
                    subsection: subsection.clone(),
                    name,
                    tag,
                    body: body.join(" "),
                });
            }
        }
        Page {
            file,
            text,
            items,
            subsections,
        }
    }

    /// The names of the items under `.SH section` / `.SS subsection`.
    fn items_under(&self, section: &str, subsection: &str) -> BTreeSet<&str> {
        assert!(
            self.subsections
                .iter()
                .any(|(sh, ss)| sh == section && ss == subsection),
            "{} has no subsection {subsection:?} under {section:?}",
            self.file.display()
        );
        self.items
            .iter()
            .filter(|i| i.section == section && i.subsection.as_deref() == Some(subsection))
            .map(|i| i.name.as_str())
            .collect()
    }

    /// The `.SS` headings under `.SH section`.
    fn subsections_under(&self, section: &str) -> BTreeSet<&str> {
        self.subsections
            .iter()
            .filter(|(sh, _)| sh == section)
            .map(|(_, ss)| ss.as_str())
            .collect()
    }
}

fn set<'a>(keys: impl IntoIterator<Item = &'a str>) -> BTreeSet<&'a str> {
    keys.into_iter().collect()
}

#[test]
fn every_fixed_key_is_documented_in_its_own_section_of_pepsi_conf_5() {
    let page = Page::read("pepsi.conf.5");
    for (section, keys) in known_keys() {
        let heading = format!("[{section}]");
        assert_eq!(
            page.items_under("FIXED SECTIONS", &heading),
            set(keys.iter().copied()),
            "{heading} in pepsi.conf.5 documents exactly the keys the program knows"
        );
    }
    let sections: Vec<String> = known_keys().iter().map(|(s, _)| format!("[{s}]")).collect();
    assert_eq!(
        page.subsections_under("FIXED SECTIONS"),
        set(sections.iter().map(String::as_str)),
        "pepsi.conf.5 documents exactly the fixed sections the program knows"
    );
}

#[test]
fn every_common_stage_key_is_documented_under_stage_name() {
    let page = Page::read("pepsi.conf.5");
    assert_eq!(
        page.items_under("STAGE SECTIONS", "[stage-NAME]"),
        set(STAGE_KEYS.iter().copied())
    );
}

#[test]
fn every_built_in_stage_key_is_documented_under_its_program() {
    let page = Page::read("pepsi.conf.5");
    let mut programs = BTreeSet::new();
    for stage in BUILTINS {
        let program = format!("pepsi-stage-{}", stage.name());
        assert_eq!(
            page.items_under("BUILT-IN STAGE KEYS", &program),
            set(stage.keys().iter().copied()),
            "the keys of {program} in pepsi.conf.5"
        );
        programs.insert(program);
    }
    assert_eq!(
        page.subsections_under("BUILT-IN STAGE KEYS"),
        set(programs.iter().map(String::as_str)),
        "pepsi.conf.5 documents exactly the built-in stages"
    );
}

#[test]
fn every_built_in_stages_overridable_keys_are_documented_under_per_address_settings() {
    let page = Page::read("pepsi.conf.5");
    let heading = ("PER-ADDRESS SETTINGS", "Overridable keys");
    let mut programs = BTreeSet::new();
    for stage in BUILTINS {
        let program = format!("pepsi-stage-{}", stage.name());
        let item = page
            .items
            .iter()
            .find(|i| {
                (i.section.as_str(), i.subsection.as_deref()) == (heading.0, Some(heading.1))
                    && i.name == program
            })
            .unwrap_or_else(|| panic!("pepsi.conf.5 has no {program} under {heading:?}"));
        // The upper-case words of its paragraph are the keys.
        let documented: BTreeSet<&str> = item
            .body
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.len() > 1 && w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            .collect();
        assert_eq!(
            documented,
            set(settings::overridable_keys(stages::REGISTRY, &program)),
            "the overridable keys of {program} in pepsi.conf.5 ({:?})",
            item.body
        );
        programs.insert(program);
    }
    assert_eq!(
        page.items_under(heading.0, heading.1),
        set(programs.iter().map(String::as_str)),
        "pepsi.conf.5 lists exactly the built-in stages' overridable keys"
    );
    let section = page
        .text
        .split(".SH PER-ADDRESS SETTINGS")
        .nth(1)
        .and_then(|rest| rest.split("\n.SH ").next())
        .map(plain)
        .expect("pepsi.conf.5 has a PER-ADDRESS SETTINGS section");
    let words: BTreeSet<&str> = section
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    for key in settings::NEVER_OVERRIDABLE.iter().chain(["_STAGE"].iter()) {
        assert!(
            words.contains(key),
            "PER-ADDRESS SETTINGS in pepsi.conf.5 names {key} as never overridable"
        );
    }
}

#[test]
fn every_built_in_stage_has_its_entry_in_pepsi_stage_8() {
    let page = Page::read("pepsi-stage.8");
    let names = set(BUILTINS.iter().map(|s| s.name()));
    assert_eq!(page.subsections_under("STAGES"), names);
    let name_section = page
        .text
        .split(".SH SYNOPSIS")
        .next()
        .expect("a NAME section");
    for stage in BUILTINS {
        let program = format!("pepsi-stage-{}", stage.name());
        assert!(
            name_section.contains(&format!("{program},"))
                || name_section.contains(&format!("{program}\n")),
            "pepsi-stage.8 names {program} in its NAME section"
        );
    }
}

/// Runs `pepsi-queue` with `args` and no standard input; returns (exit status,
/// stdout, stderr).
fn pepsi_queue(args: &[&str]) -> (Option<i32>, String, String) {
    run_as("pepsi-queue", args)
}

/// Runs the `pepsi-queue` binary under `name` (through a link of that name, as the
/// package installs `pepsi-settings` and `pepsi-config`) with `args` and no standard
/// input; returns (exit status, stdout, stderr).
fn run_as(name: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let binary = Path::new(env!("CARGO_BIN_EXE_pepsi-queue"));
    let dir = std::env::temp_dir().join(format!(
        "pepsi-man-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let program = if name == "pepsi-queue" {
        binary.to_path_buf()
    } else {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the link");
        std::os::unix::fs::symlink(binary, dir.join(name)).expect("a link to pepsi-queue");
        dir.join(name)
    };
    let out = Command::new(&program)
        .args(args)
        .env_remove("PEPSI_CONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{name} runs: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A configuration file that does not exist: a command the program accepts fails on it
/// (78) without reaching a database, after its arguments were checked.
const NO_CONFIG: &str = "/nonexistent/pepsi-man-test/pepsi.conf";

/// The list in parentheses that `pepsi-queue` gives for an unknown command (`words`
/// followed by an unknown word), or `None` when it has no such list: the commands its
/// parser takes at that point.
fn accepted_after(words: &[&str]) -> Option<Vec<String>> {
    accepted_by("pepsi-queue", words)
}

/// [`accepted_after`] for the program under `name`.
fn accepted_by(name: &str, words: &[&str]) -> Option<Vec<String>> {
    let mut args = vec!["-c", NO_CONFIG];
    args.extend_from_slice(words);
    args.push("pepsi-man-test-unknown");
    let (code, _, stderr) = run_as(name, &args);
    let (_, after) = stderr.split_once("unknown command \"pepsi-man-test-unknown\" (")?;
    assert_eq!(
        code,
        Some(64),
        "an unknown command is a usage error: {stderr}"
    );
    let list = after.split_once(')').expect("the list ends").0;
    Some(list.split(", ").map(str::to_string).collect())
}

/// The `pepsi-queue` command that is the program `pepsi-settings` under another name:
/// one entry of `pepsi-queue.8`, its commands documented in `pepsi-settings.1`.
const SETTINGS_COMMAND: &str = "settings";

/// Every command `pepsi-queue` takes, as the program lists them when it refuses an
/// unknown one, a command with commands of its own (`config`) as one entry for each
/// (`config check`, …), but [`SETTINGS_COMMAND`] as one.
fn queue_commands() -> BTreeSet<String> {
    let top = accepted_after(&[]).expect("pepsi-queue lists its commands for an unknown one");
    let mut commands = BTreeSet::new();
    for command in top {
        if command == SETTINGS_COMMAND {
            commands.insert(command);
            continue;
        }
        match accepted_after(&[&command]) {
            Some(subs) => commands.extend(subs.iter().map(|s| format!("{command} {s}"))),
            None => {
                commands.insert(command);
            }
        }
    }
    commands
}

/// `pepsi-queue --help` up to its global options: the program's own part.
fn queue_help() -> String {
    help_of("pepsi-queue")
}

/// `--help` of the program under `name` up to its global options: its own part.
fn help_of(name: &str) -> String {
    let (code, stdout, stderr) = run_as(name, &["--help"]);
    assert_eq!(code, Some(0), "{name} --help: {stderr}");
    assert!(
        stdout.starts_with(&format!("usage: {name} ")),
        "{name} --help names it: {stdout}"
    );
    stdout
        .split("global options")
        .next()
        .expect("the help text")
        .to_string()
}

/// The commands `--help` shows: each line that starts with two spaces and a word names
/// one by its synopsis (up to two spaces, where its description starts); a second word
/// in lower case names a command of a command (`config check`).
fn help_commands(help: &str) -> BTreeSet<String> {
    let mut commands = BTreeSet::new();
    for line in help.lines() {
        let Some(rest) = line.strip_prefix("  ") else {
            continue;
        };
        if !rest.starts_with(|c: char| c.is_ascii_lowercase()) {
            continue;
        }
        let synopsis = rest.split("  ").next().unwrap_or_default();
        let mut words = synopsis.split_whitespace();
        let first = words.next().unwrap_or_default();
        match words.next() {
            Some(second) if second.chars().all(|c| c.is_ascii_lowercase()) => {
                commands.insert(format!("{first} {second}"));
            }
            _ => {
                commands.insert(first.to_string());
            }
        }
    }
    commands
}

#[test]
fn every_pepsi_queue_command_is_its_own_item_in_pepsi_queue_8() {
    let commands = queue_commands();
    assert!(
        commands.len() >= 10,
        "pepsi-queue lists its commands: {commands:?}"
    );
    // The list the parser gives is the list --help gives.
    assert_eq!(
        help_commands(&queue_help()),
        commands,
        "pepsi-queue --help shows the commands its parser takes"
    );
    for command in &commands {
        let mut args = vec!["-c", NO_CONFIG];
        args.extend(command.split(' '));
        let (_, _, stderr) = pepsi_queue(&args);
        assert!(
            !stderr.contains("unknown command"),
            "pepsi-queue takes {command:?}: {stderr}"
        );
    }
    let page = Page::read("pepsi-queue.8");
    // The entries of COMMANDS that are not options of a command (those of inject).
    let entries: Vec<&Item> = page
        .items
        .iter()
        .filter(|i| i.section == "COMMANDS" && !i.name.starts_with('-'))
        .collect();
    let documented: BTreeSet<String> = entries
        .iter()
        .map(|i| {
            if commands.contains(&i.name) {
                return i.name.clone();
            }
            // A command of a command: its first two words.
            let two: Vec<&str> = i.tag.split_whitespace().take(2).collect();
            two.join(" ")
        })
        .collect();
    assert_eq!(
        documented, commands,
        "pepsi-queue.8 has an entry under COMMANDS for exactly the commands pepsi-queue takes"
    );
}

/// The options (`--json`, `-f`, …) a help text names.
fn help_options(help: &str) -> BTreeSet<&str> {
    help.split_whitespace()
        .map(|w| w.trim_matches(|c: char| matches!(c, '[' | ']' | '(' | ')' | ',' | '.')))
        .flat_map(|w| w.split('|'))
        .filter(|w| w.len() > 1 && w.starts_with('-'))
        .collect()
}

/// Asserts that the page `page` names every option of `help`.
fn documents_options(page: &str, help: &str) {
    let options = help_options(help);
    assert!(options.contains("--json"), "options found: {options:?}");
    let page_text = plain(&Page::read(page).text);
    let words: BTreeSet<&str> = page_text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .collect();
    for option in options {
        assert!(
            words.contains(option),
            "{page} documents the option {option}"
        );
    }
}

/// The exit statuses a help text lists after `Exit status:`.
fn help_exit_codes(help: &str) -> BTreeSet<String> {
    let statuses = help
        .split_once("Exit status:")
        .expect("--help lists its exit statuses")
        .1;
    let codes: BTreeSet<String> = statuses
        .split(';')
        .filter_map(|clause| clause.split_whitespace().next())
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_ascii_digit())
                .to_string()
        })
        .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_digit()))
        .collect();
    for code in ["0", "64", "65", "75", "78"] {
        assert!(codes.contains(code), "--help lists {code}: {codes:?}");
    }
    codes
}

/// Asserts that the page `page` has an entry under EXIT STATUS for every status of
/// `help`, and none for a status `src/exit.rs` does not define.
fn documents_exit_codes(page: &str, help: &str) {
    let codes = help_exit_codes(help);
    let page_read = Page::read(page);
    let documented: BTreeSet<&str> = page_read
        .items
        .iter()
        .filter(|i| i.section == "EXIT STATUS")
        .map(|i| i.name.as_str())
        .collect();
    for code in &codes {
        assert!(
            documented.contains(code.as_str()),
            "{page} has an entry under EXIT STATUS for {code}, which --help lists"
        );
    }
    // And it documents no status the program does not have.
    let known = [
        pepsi::exit::OK,
        pepsi::exit::FAILURE,
        pepsi::exit::EX_USAGE,
        pepsi::exit::EX_DATAERR,
        pepsi::exit::EX_NOINPUT,
        pepsi::exit::EX_UNAVAILABLE,
        pepsi::exit::EX_SOFTWARE,
        pepsi::exit::EX_CANTCREAT,
        pepsi::exit::EX_IOERR,
        pepsi::exit::EX_TEMPFAIL,
        pepsi::exit::EX_NOPERM,
        pepsi::exit::EX_CONFIG,
    ]
    .map(|c| c.to_string());
    for code in documented {
        assert!(
            known.iter().any(|k| k == code),
            "{page} documents exit status {code}, which src/exit.rs does not define"
        );
    }
}

#[test]
fn every_option_in_pepsi_queue_help_is_in_pepsi_queue_8() {
    documents_options("pepsi-queue.8", &queue_help());
}

#[test]
fn every_exit_status_in_pepsi_queue_help_is_in_pepsi_queue_8() {
    documents_exit_codes("pepsi-queue.8", &queue_help());
}

#[test]
fn every_pepsi_settings_command_option_and_exit_status_is_in_pepsi_settings_1() {
    let name = pepsi::queue::multicall::SETTINGS;
    let commands: BTreeSet<String> = accepted_by(name, &[])
        .expect("pepsi-settings lists its commands for an unknown one")
        .into_iter()
        .collect();
    assert!(commands.contains("import"), "{commands:?}");
    // `pepsi-queue settings` is the same program.
    assert_eq!(
        accepted_after(&[SETTINGS_COMMAND]).map(|c| c.into_iter().collect::<BTreeSet<_>>()),
        Some(commands.clone())
    );
    let help = help_of(name);
    assert_eq!(
        help_commands(&help),
        commands,
        "pepsi-settings --help shows the commands its parser takes"
    );
    let page = format!("{name}.1");
    let documented: BTreeSet<String> = Page::read(&page)
        .items
        .iter()
        .filter(|i| i.section == "COMMANDS")
        .map(|i| i.name.clone())
        .collect();
    assert_eq!(
        documented, commands,
        "{page} has an entry under COMMANDS for exactly the commands pepsi-settings takes"
    );
    documents_options(&page, &help);
    documents_exit_codes(&page, &help);
}

#[test]
fn every_page_a_page_refers_to_exists() {
    let files: BTreeSet<String> = pages()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for path in pages() {
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(".BR ") else {
                continue;
            };
            let args = arguments(rest);
            let (Some(name), Some(section)) = (args.first(), args.get(1)) else {
                continue;
            };
            let name = plain(name);
            let Some(number) = section.strip_prefix('(').and_then(|s| s.split(')').next()) else {
                continue;
            };
            if name.starts_with("pepsi") {
                assert!(
                    files.contains(&format!("{name}.{number}")),
                    "{} refers to {name}({number}), which packaging/man lacks",
                    path.display()
                );
            }
        }
    }
}

/// The programs of the package: one per `src/bin/*.rs`, as `packaging/build-deb`
/// makes them.
fn programs() -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin"))
            .expect("src/bin exists")
            .map(|e| e.expect("a directory entry").file_name())
            .filter_map(|n| n.to_str()?.strip_suffix(".rs").map(str::to_string))
            .collect();
    names.sort();
    names
}

#[test]
fn every_program_has_its_page_and_pepsi_conf_5_names_it() {
    let files: BTreeSet<String> = pages()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let conf = Page::read("pepsi.conf.5");
    let description = plain(
        conf.text
            .split(".SH DESCRIPTION")
            .nth(1)
            .and_then(|rest| rest.split("\n.SH ").next())
            .expect("pepsi.conf.5 has a DESCRIPTION"),
    );
    let programs = programs();
    assert!(
        programs.iter().any(|p| p == "pepsi-ingress"),
        "{programs:?}"
    );
    for program in &programs {
        let page = format!("{program}.8");
        assert!(
            files.contains(&page),
            "packaging/man has no page {page} for the program {program}"
        );
        // The page names its program in NAME.
        let text = std::fs::read_to_string(packaging(&format!("man/{page}"))).unwrap();
        let name = text
            .split(".SH NAME\n")
            .nth(1)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_default();
        assert!(
            name.starts_with(program.as_str()),
            "{page} names {program} in NAME: {name:?}"
        );
        // `.BR program (8)` reads `program (8)` here, its macro name left in.
        assert!(
            description.contains(&format!("{program} (8)")),
            "pepsi.conf.5 names {program}(8) among the programs that read the file"
        );
    }
    // The other names of pepsi-queue, links the package installs: each a page of
    // section 1 that names it, and its --help under its name.
    for link in pepsi::queue::multicall::LINKS {
        let page = format!("{link}.1");
        assert!(
            files.contains(&page),
            "packaging/man has no page {page} for {link}, a link to pepsi-queue"
        );
        let text = std::fs::read_to_string(packaging(&format!("man/{page}"))).unwrap();
        let name = text
            .split(".SH NAME\n")
            .nth(1)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_default();
        assert!(
            name.starts_with(link),
            "{page} names {link} in NAME: {name:?}"
        );
        assert!(
            description.contains(&format!("{link} (1)")),
            "pepsi.conf.5 names {link}(1) among the programs that read the file"
        );
        help_of(link);
    }
}

/// The example configuration's text.
fn example() -> (PathBuf, String) {
    let path = packaging("pepsi.conf");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path, text)
}

/// The example with every commented-out setting (`#KEY = …`, `#[section]`) switched on;
/// explanations (`# …`) stay comments.
fn uncommented(text: &str) -> String {
    text.lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest)
                if rest.starts_with('[') || rest.starts_with(|c: char| c.is_ascii_uppercase()) =>
            {
                rest
            }
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_example_configuration_loads_as_shipped() {
    let (path, text) = example();
    let sections = raw::parse(&path, &text).unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
    let config = Config::from_sections(path, sections)
        .unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
    assert!(
        config.warnings.is_empty(),
        "{}",
        raw::join_errors(&config.warnings)
    );
    config
        .file_graph()
        .unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
}

#[test]
fn the_example_configuration_uncommented_is_a_valid_pipeline_without_warnings() {
    let (path, text) = example();
    let text = uncommented(&text);
    let sections = raw::parse(&path, &text).unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
    let config = Config::from_sections(path, sections)
        .unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
    assert!(
        config.warnings.is_empty(),
        "{}",
        raw::join_errors(&config.warnings)
    );
    let graph = config
        .file_graph()
        .unwrap_or_else(|e| panic!("{}", raw::join_errors(&e)));
    assert!(graph.stages().count() > 0, "the example has a pipeline");
    // What `pepsi-dispatch check` and the dispatcher would warn about or refuse.
    let laid = config.lay_over(&[]);
    let mut problems = keys::unknown_keys(laid.sections.values(), stages::program_keys);
    problems.extend(graph.cycle_warnings());
    problems.extend(stages::check_sections(graph.stages()));
    assert!(problems.is_empty(), "{}", raw::join_errors(&problems));
    let bounce = config
        .bouncer
        .bounce_stage
        .as_deref()
        .expect("the example sets BOUNCE_STAGE");
    assert!(
        graph.contains(bounce),
        "BOUNCE_STAGE {bounce} names a stage"
    );
    // pepsi-ingress would start with it: STAGE is an entry stage of the pipeline.
    let (stage, _) = config
        .ingress
        .stage
        .as_ref()
        .expect("the example sets [pepsi-ingress] STAGE");
    assert_eq!(
        pepsi::ingress::stage_problem(&config, &graph, stage),
        None,
        "[pepsi-ingress] STAGE of the example"
    );
}

#[test]
fn the_example_shows_every_fixed_key_at_its_default() {
    let (path, text) = example();
    let on = raw::parse(&path, &uncommented(&text)).unwrap();
    for (section, keys) in known_keys() {
        let found = on
            .iter()
            .find(|s| s.name == *section)
            .unwrap_or_else(|| panic!("the example has a [{section}] section"));
        for key in *keys {
            assert!(
                found.get(key).is_some(),
                "the example shows [{section}] {key}"
            );
        }
    }
    // The values shown are the defaults, except where there is no fixed default.
    let shown = Config::from_sections(path.clone(), on).unwrap();
    let default = Config::from_sections(path, Vec::new()).unwrap();
    assert_eq!(shown.pepsi.allow_fusion, default.pepsi.allow_fusion);
    assert_eq!(shown.pepsi.share_telemetry, default.pepsi.share_telemetry);
    assert_eq!(shown.pepsi.run_as, default.pepsi.run_as);
    assert_eq!(shown.pepsi.program_path, default.pepsi.program_path);
    // Each program's connection shown is the one it has by default: CONNECTION's.
    assert_eq!(shown.postgres.connection, default.postgres.connection);
    for role in DbRole::ALL {
        assert_eq!(
            shown.postgres.connection_for(role),
            default.postgres.connection_for(role),
            "{}",
            role.key()
        );
    }
    assert_eq!(
        shown.postgres.worker_synchronous_commit,
        default.postgres.worker_synchronous_commit
    );
    let (s, d) = (&shown.dispatch, &default.dispatch);
    assert_eq!(s.max_runtime, d.max_runtime, "MAX_RUNTIME");
    assert_eq!(s.worker_idle_timeout, d.worker_idle_timeout);
    assert_eq!(s.poll_interval, d.poll_interval, "POLL_INTERVAL");
    assert_eq!(s.stats_interval, d.stats_interval, "STATS_INTERVAL");
    assert_eq!(s.db_pool_size, d.db_pool_size, "DB_POOL_SIZE");
    assert_eq!(s.fair_scheduling, d.fair_scheduling, "FAIR_SCHEDULING");
    assert_eq!(s.fair_half_life, d.fair_half_life, "FAIR_HALF_LIFE");
    assert_eq!(
        s.fair_fifo_percent, d.fair_fifo_percent,
        "FAIR_FIFO_PERCENT"
    );
    assert_eq!(s.max_hops, d.max_hops, "MAX_HOPS");
    assert_eq!(
        s.synchronous_commit, d.synchronous_commit,
        "SYNCHRONOUS_COMMIT"
    );
    assert_eq!(s.snapshot_warning, d.snapshot_warning, "SNAPSHOT_WARNING");
    // STAGE and XFORWARD_FROM have no default: the example shows what a Postfix
    // content filter on this host would set.
    let (s, d) = (&shown.ingress, &default.ingress);
    assert_eq!(s.listen, d.listen, "LISTEN");
    assert_eq!(s.max_message_size, d.max_message_size, "MAX_MESSAGE_SIZE");
    assert_eq!(s.max_recipients, d.max_recipients, "MAX_RECIPIENTS");
    assert_eq!(s.max_sessions, d.max_sessions, "MAX_SESSIONS");
    assert_eq!(s.timeout, d.timeout, "TIMEOUT");
    assert_eq!(s.max_errors, d.max_errors, "MAX_ERRORS");
}

/// Is this a CI run (where mandoc must be installed)?
fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

#[test]
fn mandoc_lint_finds_nothing_in_any_page() {
    let pages = pages();
    assert!(!pages.is_empty(), "packaging/man has pages");
    let probe = Command::new("mandoc").arg("-V").output();
    if probe.is_err() {
        assert!(
            !in_ci(),
            "mandoc is not installed, and CI is set: the pages must be linted (apt-get install mandoc)"
        );
        eprintln!(
            "note: mandoc is not installed; the pages were not linted (apt-get install mandoc)"
        );
        return;
    }
    for page in &pages {
        let out = Command::new("mandoc")
            .args(["-T", "lint", "-W", "warning"])
            .arg(page)
            .output()
            .expect("mandoc runs");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && said.trim().is_empty(),
            "mandoc -T lint -W warning {} ({}):\n{said}",
            page.display(),
            out.status
        );
    }
}
