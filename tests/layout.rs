//! The shape of `src/` that keeps the code readable, checked by reading the files (no
//! database, no build of anything): the top-level modules form layers in the order
//! [`LAYERS`] declares, each using only those below it; no two files use each other's
//! items, directly or through a chain (an import circle); the worker library, which any
//! stage program links, never names the built-in stages (`crate::stages`), and
//! `check` names none of them either (it reads their rules from their declarations);
//! no file is over 700 lines; every `§N` a comment cites is a heading of `doc/`. Run
//! alone with `cargo test --test layout`.
//!
//! A file's references are the module paths it names in code or in `use` items:
//! `crate::a::b`, `super::x`, `self::x`, and a bare `child::x` of a module it declares.
//! Each resolves to the longest prefix that is a file of `src/` (`crate::dispatch::ledger`
//! is `src/dispatch/ledger.rs`; `crate::dispatch` is `src/dispatch/mod.rs`). A module
//! file naming its own submodules (`mod.rs` or `lib.rs` calling `child::run`) is how a
//! module is composed, not an import, so an edge from a module to a file below it does
//! not count. The binaries under `src/bin/` are crates of their own and use the library
//! from outside.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a file of `src/` may have.
const MAX_LINES: usize = 700;

/// The top-level modules of `src/`, lowest first: a module may use only those before
/// it. The small shared pieces first, then the database, the configuration, the
/// keeper and launcher, the worker library and the stages built on it, the failure
/// bouncer and the ingress, `check` above everything it checks, and the programs that
/// run `check` on top. A new top-level module gets its place here.
const LAYERS: &[&str] = &[
    "escape",
    "exit",
    "logging",
    "cli",
    "privilege",
    "random",
    "conninfo",
    "durability",
    "protocol",
    "mailbox",
    "signals",
    "tls",
    "db",
    "intake",
    "config",
    "keeper",
    "launcher",
    "worker",
    "stages",
    "bouncer",
    "ingress",
    "check",
    "queue",
    "dispatch",
    "setup",
];

/// `src/` of this package.
fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// A library file's module path: `src/dispatch/claims.rs` is `["dispatch", "claims"]`,
/// `src/dispatch/mod.rs` and `src/dispatch.rs` are `["dispatch"]`, `src/lib.rs` is `[]`.
fn module_of(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod" || l == "lib") {
        parts.pop();
    }
    parts
}

/// The text with comments, string literals and character literals blanked out, so that
/// a path in a doc comment or a message is not taken for a reference.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
            continue;
        }
        // Raw strings: r"…", r#"…"#.
        if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&b, i) {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) == Some(&'"') {
                j += 1;
                loop {
                    if j >= b.len() {
                        break;
                    }
                    if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
                continue;
            }
        }
        if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
            continue;
        }
        // A character literal ('x', '\n', '\u{1b}'), not a lifetime ('a).
        if c == '\'' {
            let close = if next == Some('\\') {
                (i + 2..b.len().min(i + 12)).find(|&j| b[j] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            if let Some(end) = close {
                out.push_str("' '");
                i = end + 1;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    out
}

fn ident_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// Expands one `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else {
        return vec![tree];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(expand_use)
        .map(|p| {
            if p == "self" {
                prefix.trim_end_matches("::").to_string()
            } else {
                format!("{prefix}{p}")
            }
        })
        .collect()
}

/// Every path the code names: the expanded `use` items and every `a::b::c` run.
fn paths_in(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    // `use` items, whose braces hide paths from the plain scan below.
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let starts_item = at == 0
            || rest[..at]
                .chars()
                .last()
                .is_some_and(|c| !(c.is_alphanumeric() || c == '_'));
        let after = &rest[at + 4..];
        let end = after.find(';').unwrap_or(after.len());
        if starts_item {
            out.extend(expand_use(&after[..end]));
        }
        rest = &after[end.min(after.len())..];
    }
    // Paths in code: identifiers joined by `::`.
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if (chars[i].is_alphabetic() || chars[i] == '_')
            && !(i > 0
                && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_' || chars[i - 1] == ':'))
        {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric()
                    || chars[i] == '_'
                    || (chars[i] == ':' && chars.get(i + 1) == Some(&':'))
                    || (chars[i] == ':' && i > 0 && chars[i - 1] == ':'))
            {
                i += 1;
            }
            let path: String = chars[start..i].iter().collect();
            if path.contains("::") {
                out.push(path.trim_end_matches(':').to_string());
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The modules a module declares (`mod name;` / `pub mod name;`).
fn children_of(code: &str) -> BTreeSet<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")
                .and_then(|r| r.strip_suffix(';'))
                .map(|n| n.trim().to_string())
        })
        .collect()
}

/// A file's module graph: by module path, the file and the modules it references.
type Graph = BTreeMap<Vec<String>, (PathBuf, BTreeSet<Vec<String>>)>;

/// By module path, the file and the modules it references, each with the first path
/// in the file that names it.
type References = BTreeMap<Vec<String>, (PathBuf, BTreeMap<Vec<String>, String>)>;

/// The library's files by module path, and each file's module references resolved to
/// files, each with the first path in the file that names it.
fn references() -> References {
    let lib: Vec<PathBuf> = files(&src())
        .into_iter()
        .filter(|f| !f.starts_with(src().join("bin")))
        .collect();
    let modules: BTreeMap<Vec<String>, PathBuf> =
        lib.iter().map(|f| (module_of(f), f.clone())).collect();
    let mut out = BTreeMap::new();
    for (module, file) in &modules {
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let children = children_of(&code);
        // A module file: lib.rs, a mod.rs, or x.rs beside a folder x/ of submodules.
        let is_module_file = file.ends_with("mod.rs")
            || file.ends_with("lib.rs")
            || file.with_extension("").is_dir();
        let mut refs = BTreeMap::new();
        for path in paths_in(&code) {
            let segs: Vec<&str> = path.split("::").collect();
            let mut base: Vec<String>;
            let mut rest: &[&str] = &segs;
            match segs[0] {
                "crate" => {
                    base = Vec::new();
                    rest = &segs[1..];
                }
                // `super` is the module's parent: for claims.rs (`dispatch::claims`)
                // `dispatch`, for dispatch/mod.rs (`dispatch`) the crate.
                "super" => {
                    base = module.clone();
                    while rest.first() == Some(&"super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                }
                "self" => {
                    base = module.clone();
                    rest = &segs[1..];
                }
                first if children.contains(first) => {
                    base = module.clone();
                }
                _ => continue,
            }
            // The longest prefix that is a module file.
            let mut target = base.clone();
            let mut found = modules.contains_key(&target).then(|| target.clone());
            for seg in rest {
                target.push(seg.to_string());
                if modules.contains_key(&target) {
                    found = Some(target.clone());
                }
            }
            if let Some(t) = found {
                // A module composing its own submodules is no import.
                let below =
                    t.len() > module.len() && t[..module.len()] == module[..] && is_module_file;
                if t != *module && !below {
                    refs.entry(t).or_insert(path);
                }
            }
        }
        out.insert(module.clone(), (file.clone(), refs));
    }
    out
}

/// The library's files by module path, and each file's module references resolved to
/// files.
fn graph() -> Graph {
    references()
        .into_iter()
        .map(|(m, (f, refs))| (m, (f, refs.into_keys().collect())))
        .collect()
}

/// The graph folded to the top-level modules (`src/x.rs` with `src/x/` is `x`); the
/// crate root, which only composes them, left out.
fn folded(g: &Graph) -> Graph {
    let mut out: Graph = BTreeMap::new();
    for (module, (_, refs)) in g {
        let Some(top) = module.first() else { continue };
        let entry = out
            .entry(vec![top.clone()])
            .or_insert_with(|| (PathBuf::from(top), BTreeSet::new()));
        for t in refs {
            if let Some(other) = t.first().filter(|o| *o != top) {
                entry.1.insert(vec![other.clone()]);
            }
        }
    }
    out
}

/// Every reference from a top-level module to one at or above it in `layers`, or to
/// or from one `layers` does not list: `file: path (from → to)` and why.
fn against_layers(refs: &References, layers: &[&str]) -> Vec<String> {
    let rank = |m: &str| layers.iter().position(|l| *l == m);
    let mut out = Vec::new();
    for (module, (file, targets)) in refs {
        let Some(from) = module.first() else { continue };
        let shown = file
            .strip_prefix(src())
            .unwrap_or(file)
            .display()
            .to_string();
        let Some(from_rank) = rank(from) else {
            out.push(format!("src/{shown}: module {from} has no place in LAYERS"));
            continue;
        };
        for (target, path) in targets {
            let Some(to) = target.first().filter(|t| *t != from) else {
                continue;
            };
            match rank(to) {
                None => out.push(format!(
                    "src/{shown}: `{path}` ({from} → {to}): {to} has no place in LAYERS"
                )),
                Some(to_rank) if to_rank > from_rank => out.push(format!(
                    "src/{shown}: `{path}` ({from} → {to}): {to} is above {from}"
                )),
                Some(_) => {}
            }
        }
    }
    out
}

/// The strongly connected groups of more than one file (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<PathBuf>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        next: usize,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Vec<String>) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v].1 {
            let Some((w, _)) = t.g.get_key_value(w) else {
                continue;
            };
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low[v];
                t.low.insert(v, lv.min(lw));
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low[v];
                t.low.insert(v, lv.min(iw));
            }
        }
        if t.low[v] == t.index[v] {
            let mut group = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                group.push(t.g[w].0.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                t.out.push(group);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn shown_modules(modules: &[PathBuf]) -> String {
    modules
        .iter()
        .map(|m| m.display().to_string())
        .collect::<Vec<_>>()
        .join(" ↔ ")
}

fn shown(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|f| f.strip_prefix(src()).unwrap().display().to_string())
        .collect::<Vec<_>>()
        .join(" ↔ ")
}

#[test]
fn no_two_files_of_src_use_each_other_directly_or_through_a_chain() {
    let g = graph();
    assert!(g.len() > 50, "the library's files were read");
    let found: Vec<String> = circles(&g).iter().map(|c| shown(c)).collect();
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_top_level_modules_use_only_the_layers_below_them() {
    let refs = references();
    let tops: BTreeSet<&String> = refs.keys().filter_map(|m| m.first()).collect();
    let unused: Vec<&&str> = LAYERS
        .iter()
        .filter(|l| !tops.iter().any(|t| t == *l))
        .collect();
    assert!(
        unused.is_empty(),
        "LAYERS names no module of src/: {unused:?}"
    );
    let found = against_layers(&refs, LAYERS);
    assert!(
        found.is_empty(),
        "imports against the layer order (LAYERS in tests/layout.rs):\n{}",
        found.join("\n")
    );
    let knots: Vec<String> = circles(&folded(&graph()))
        .iter()
        .map(|c| shown_modules(c))
        .collect();
    assert!(
        knots.is_empty(),
        "circles among top-level modules:\n{}",
        knots.join("\n")
    );
}

#[test]
fn the_layer_check_finds_an_import_upwards_and_a_module_without_a_place() {
    let file = src().join("db/mod.rs");
    let refs: References = [(
        vec!["db".to_string()],
        (
            file,
            [
                (
                    vec!["config".to_string(), "graph".to_string()],
                    "crate::config::graph::OverrideRow".to_string(),
                ),
                (
                    vec!["escape".to_string()],
                    "crate::escape::Visible".to_string(),
                ),
                (vec!["nowhere".to_string()], "crate::nowhere::X".to_string()),
            ]
            .into(),
        ),
    )]
    .into();
    let found = against_layers(&refs, &["escape", "db", "config"]);
    assert_eq!(
        found,
        [
            "src/db/mod.rs: `crate::config::graph::OverrideRow` (db → config): config is above db",
            "src/db/mod.rs: `crate::nowhere::X` (db → nowhere): nowhere has no place in LAYERS",
        ]
    );
    let mut g: Graph = BTreeMap::new();
    let m = |a: &str, b: &str| vec![a.to_string(), b.to_string()];
    g.insert(m("a", "x"), (PathBuf::from("a/x"), [m("b", "y")].into()));
    g.insert(m("b", "y"), (PathBuf::from("b/y"), [m("a", "z")].into()));
    g.insert(m("a", "z"), (PathBuf::from("a/z"), BTreeSet::new()));
    assert!(circles(&g).is_empty(), "no circle between files");
    assert_eq!(
        circles(&folded(&g)),
        [[PathBuf::from("a"), PathBuf::from("b")]],
        "but one between their top-level modules"
    );
}

#[test]
fn check_names_no_built_in_stage() {
    for (module, (file, targets)) in references() {
        if module.first().is_none_or(|m| m != "check") {
            continue;
        }
        for (target, path) in targets {
            assert!(
                !(target.len() > 1 && target[0] == "stages"),
                "{}: `{path}` names a stage: its rules belong in its declaration (worker::Stage)",
                file.display()
            );
        }
    }
}

#[test]
fn the_worker_library_never_names_the_built_in_stages() {
    for file in files(&src().join("worker")) {
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        assert!(
            !paths_in(&code)
                .iter()
                .any(|p| p.starts_with("crate::stages")),
            "{} names crate::stages: the stage registry is passed in",
            file.display()
        );
    }
}

#[test]
fn no_file_of_src_is_over_700_lines() {
    let long: Vec<String> = files(&src())
        .into_iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_circle_check_finds_a_circle_and_reads_paths_as_rust_does() {
    // Two files that use each other, in every form the check reads.
    let code = code_only(
        "use super::{ledger::Claim, pool::{self, Pick}};\n// use super::nothing::Here;\n\
         let x = \"super::quoted::Path\"; crate::db::sql::CLAIM; self::inner::f();",
    );
    let paths = paths_in(&code);
    for want in [
        "super::ledger::Claim",
        "super::pool",
        "super::pool::Pick",
        "crate::db::sql::CLAIM",
        "self::inner::f",
    ] {
        assert!(paths.iter().any(|p| p == want), "{want}: {paths:?}");
    }
    assert!(
        !paths
            .iter()
            .any(|p| p.contains("nothing") || p.contains("quoted")),
        "{paths:?}"
    );
    let mut g: Graph = BTreeMap::new();
    let m = |s: &str| vec!["d".to_string(), s.to_string()];
    g.insert(m("a"), (PathBuf::from("a"), [m("b")].into()));
    g.insert(m("b"), (PathBuf::from("b"), [m("c")].into()));
    g.insert(m("c"), (PathBuf::from("c"), [m("a")].into()));
    g.insert(m("e"), (PathBuf::from("e"), [m("a")].into()));
    let found = circles(&g);
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0],
        [PathBuf::from("a"), PathBuf::from("b"), PathBuf::from("c")]
    );
}

/// Every `§N` / `§N.M` in `text` that cites the design (not one following `RFC NNNN `,
/// a section of that RFC), with its line number.
fn design_references(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for (at, _) in line.match_indices('§') {
            let number: String = line[at + '§'.len_utf8()..]
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let number = number.trim_end_matches('.');
            if number.is_empty() {
                continue;
            }
            let before = line[..at].trim_end();
            let rfc = before
                .trim_end_matches(|c: char| c.is_ascii_digit())
                .trim_end()
                .ends_with("RFC")
                && before.ends_with(|c: char| c.is_ascii_digit());
            if !rfc {
                out.push((n + 1, number.to_string()));
            }
        }
    }
    out
}

/// The section numbers of `doc/`'s headings (`## §8.4 Lost database connection`).
fn design_headings() -> BTreeSet<String> {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("doc");
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(&doc).expect("doc/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let Some(title) = line.strip_prefix('#') else {
                continue;
            };
            let title = title.trim_start_matches('#').trim_start();
            if let Some(rest) = title.strip_prefix('§') {
                let number: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.')
                    .collect();
                out.insert(number.trim_end_matches('.').to_string());
            }
        }
    }
    out
}

#[test]
fn every_section_a_comment_cites_is_a_heading_of_doc() {
    let headings = design_headings();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cited = BTreeSet::new();
    let mut missing = Vec::new();
    let mut read = files(&src());
    read.extend(
        std::fs::read_dir(root.join("schema"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "sql")),
    );
    for file in read {
        let text = std::fs::read_to_string(&file).unwrap();
        for (line, number) in design_references(&text) {
            if !headings.contains(&number) {
                missing.push(format!(
                    "{}:{line}: §{number}",
                    file.strip_prefix(root).unwrap().display()
                ));
            }
            cited.insert(number);
        }
    }
    assert!(cited.len() > 20, "the citations were read: {cited:?}");
    assert!(
        missing.is_empty(),
        "sections cited that no heading of doc/ has:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_section_after_an_rfc_is_the_rfcs() {
    let found = design_references(
        "// (RFC 5321 §4.5.3.2) and §8.4 \"A server that hangs\"; RFC5321 §2, §12.3.\n\
         // SPEC-less § alone, §6–§11",
    );
    assert_eq!(
        found,
        [
            (1, "8.4".to_string()),
            (1, "12.3".to_string()),
            (2, "6".to_string()),
            (2, "11".to_string())
        ]
    );
}
