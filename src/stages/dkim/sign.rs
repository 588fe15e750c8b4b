//! DKIM signing (RFC 6376, Ed25519 by RFC 8463): the `DKIM-Signature` fields to prepend
//! to a stored header block, covering the message exactly as the relay sends it
//! (`relay::transaction::as_sent` of that block and the body).
//!
//! Used by the `dkim-sign` stage, with the keys `keys.rs` chose. Relaxed/relaxed
//! canonicalization (`canon.rs`) over the fields `fields.rs` reads; tags `v a c d s t`,
//! `x` when an expiry is set, `h bh b`, never `l`, `i` or `z`. The body is hashed once,
//! streaming, and the selected header fields canonicalized once, whatever the number of
//! keys; each key then signs its own field independently (a second signature does not
//! cover the first). No I/O; nothing but the returned fields is built from the body.
//!
//! Which fields are signed: for each name in `h=`, the last not yet used instance of it,
//! bottom-up (RFC 6376 §5.4.2). A name is listed once per signable instance present,
//! and once more when it is oversigned, so an instance added later breaks the
//! signature. Entries of the header section that are no field (no colon, a bad name)
//! and fields holding a NUL byte are never signed nor counted (see
//! `fields::Field::signable`).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::canon;
use super::fields::{self, Field};
use super::keys::KeyEntry;

/// The header fields signed when present (§18 `HEADERS`); `list-*` is every field whose
/// name starts with `list-`.
pub const DEFAULT_HEADERS: &[&str] = &[
    "from",
    "sender",
    "reply-to",
    "subject",
    "date",
    "message-id",
    "to",
    "cc",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "in-reply-to",
    "references",
    "list-*",
];

/// The fields signed once more than they are present (§18).
pub const OVERSIGNED: &[&str] = &["from", "subject", "date", "to"];

/// The widest line of a signature field, in octets before its CRLF.
const WIDTH: usize = 78;

/// The name a signature field starts with.
const FIELD_NAME: &[u8] = b"DKIM-Signature:";

/// What to sign, besides the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The names of the fields to sign when present, in `h=` order; a name ending in
    /// `*` stands for every field whose name starts with what precedes it. `from` is
    /// always signed, first when this list does not name it. Names that are no field
    /// names (see [`Options::parse_names`]) are left out.
    pub headers: Vec<String>,
    /// The names signed once more than they are present (also when absent: once).
    pub oversign: Vec<String>,
    /// How long after signing a signature expires (`x=`), in whole seconds rounded
    /// up; none when unset.
    pub expire: Option<Duration>,
}

impl Default for Options {
    /// The defaults of §18: [`DEFAULT_HEADERS`], [`OVERSIGNED`], no expiry.
    fn default() -> Options {
        Options {
            headers: DEFAULT_HEADERS.iter().map(|s| s.to_string()).collect(),
            oversign: OVERSIGNED.iter().map(|s| s.to_string()).collect(),
            expire: None,
        }
    }
}

impl Options {
    /// Reads a list of field names as a `HEADERS` value writes it: names separated by
    /// commas, colons or whitespace, each of printable ASCII without `:` or `;`, the
    /// last character perhaps `*` (a prefix, not empty). Lower case; duplicates
    /// dropped. The error names the first bad name.
    pub fn parse_names(list: &str) -> Result<Vec<String>, String> {
        let mut names: Vec<String> = Vec::new();
        for word in list
            .split(|c: char| c == ',' || c == ':' || c.is_ascii_whitespace())
            .filter(|w| !w.is_empty())
        {
            let name = word.to_ascii_lowercase();
            let stem = name.strip_suffix('*').unwrap_or(&name);
            if !field_name(stem) {
                return Err(format!(
                    "\"{}\" is not a header field name (or a prefix of one followed by *)",
                    word.escape_debug()
                ));
            }
            if !names.contains(&name) {
                names.push(name);
            }
        }
        if names.is_empty() {
            return Err("no header field names".into());
        }
        Ok(names)
    }
}

/// Could this be the name of a signable field: printable ASCII without `:` or `;`?
fn field_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| (33..=126).contains(&b) && b != b':' && b != b';')
}

/// Why a message was not signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignError {
    /// No key was given.
    NoKeys,
    /// The signing time is before 1970 (`t=` cannot say it).
    ClockBeforeEpoch,
    /// The cryptographic library failed to sign with a key it had loaded.
    Crypto {
        /// The key's domain.
        domain: String,
        /// The key's selector.
        selector: String,
    },
}

impl fmt::Display for SignError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SignError::NoKeys => f.write_str("no key to sign with"),
            SignError::ClockBeforeEpoch => f.write_str("the clock is before 1970"),
            SignError::Crypto { domain, selector } => write!(
                f,
                "signing with the key of {domain} (selector {selector}) failed"
            ),
        }
    }
}

impl std::error::Error for SignError {}

/// The `DKIM-Signature` fields to prepend to `headers`, one per key in key order, each
/// folded at 78 columns with CRLF line ends and ending CRLF; they sign the message
/// exactly as `as_sent(headers, body)` renders it, at time `now` (`t=`).
pub fn sign(
    headers: &[u8],
    body: &[u8],
    keys: &[&KeyEntry],
    options: &Options,
    now: SystemTime,
) -> Result<Vec<u8>, SignError> {
    if keys.is_empty() {
        return Err(SignError::NoKeys);
    }
    let t = now
        .duration_since(UNIX_EPOCH)
        .map_err(|_| SignError::ClockBeforeEpoch)?
        .as_secs();
    let x = options.expire.map(|e| {
        let secs = e.as_secs() + u64::from(e.subsec_nanos() > 0);
        t.saturating_add(secs.max(1))
    });
    let rendered = fields::split(headers, body);
    let selected = select(rendered.header, options);
    let bh = STANDARD.encode(canon::body_hash(&rendered.body));
    let mut out = Vec::with_capacity(keys.len() * 512);
    let mut data = Vec::with_capacity(selected.canonical.len() + 512);
    for key in keys {
        let mut field = Folder::new();
        field.word(b"v=1;", true);
        field.word(format!("a={};", key.algorithm).as_bytes(), true);
        field.word(b"c=relaxed/relaxed;", true);
        field.word(format!("d={};", key.domain).as_bytes(), true);
        field.word(format!("s={};", key.selector).as_bytes(), true);
        field.word(format!("t={t};").as_bytes(), true);
        if let Some(x) = x {
            field.word(format!("x={x};").as_bytes(), true);
        }
        let last = selected.names.len().saturating_sub(1);
        for (i, name) in selected.names.iter().enumerate() {
            let end = if i == last { ";" } else { ":" };
            if i == 0 {
                field.word(format!("h={name}{end}").as_bytes(), true);
            } else {
                // Folding whitespace may stand around a colon of h= (RFC 6376 §3.5).
                field.word(format!("{name}{end}").as_bytes(), false);
            }
        }
        field.word(format!("bh={bh};").as_bytes(), true);
        field.word(b"b=", true);
        // The signature covers the selected fields, then this field with b= empty and
        // no line end (RFC 6376 §3.7).
        data.clear();
        data.extend_from_slice(&selected.canonical);
        canon::relaxed_header(
            b"DKIM-Signature",
            &field.text[FIELD_NAME.len()..],
            &mut data,
        );
        let signature = key.signature(&data).ok_or_else(|| SignError::Crypto {
            domain: key.domain.clone(),
            selector: key.selector.clone(),
        })?;
        field.fill(STANDARD.encode(signature).as_bytes());
        out.extend_from_slice(&field.text);
        out.extend_from_slice(b"\r\n");
    }
    Ok(out)
}

/// The fields a signature covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selected {
    /// The `h=` names, lower case, in order, each as often as listed.
    pub names: Vec<String>,
    /// The canonical fields the names select, each ending CRLF, in `h=` order.
    pub canonical: Vec<u8>,
}

/// Which fields of a header section a signature with these options covers, and their
/// canonical text.
pub fn select(section: &[u8], options: &Options) -> Selected {
    let signable: Vec<Field> = fields::fields(section).filter(Field::signable).collect();
    // Each lower-case name's instances, top to bottom.
    let mut instances: HashMap<String, Vec<usize>> = HashMap::new();
    let mut appearance: Vec<String> = Vec::new();
    for (i, f) in signable.iter().enumerate() {
        let name = String::from_utf8_lossy(f.name.unwrap_or_default()).to_ascii_lowercase();
        let list = instances.entry(name.clone()).or_default();
        if list.is_empty() {
            appearance.push(name);
        }
        list.push(i);
    }
    let lower =
        |v: &[String]| -> Vec<String> { v.iter().map(|s| s.to_ascii_lowercase()).collect() };
    let wanted = lower(&options.headers);
    let oversign: HashSet<String> = lower(&options.oversign).into_iter().collect();
    // The distinct names to list, in order.
    let mut order: Vec<String> = Vec::new();
    let mut listed: HashSet<String> = HashSet::new();
    let mut add = |name: &str| {
        if field_name(name) && listed.insert(name.to_string()) {
            order.push(name.to_string());
        }
    };
    if !wanted.iter().any(|n| n == "from") {
        add("from");
    }
    for entry in &wanted {
        match entry.strip_suffix('*') {
            Some("") => {}
            Some(prefix) => appearance
                .iter()
                .filter(|n| n.starts_with(prefix))
                .for_each(|n| add(n)),
            None => add(entry),
        }
    }
    for name in lower(&options.oversign) {
        add(&name);
    }
    let mut names = Vec::new();
    let mut canonical = Vec::new();
    for name in order {
        let present = instances.get(&name).map_or(&[][..], Vec::as_slice);
        // From is always listed, so that h= is never without it (RFC 6376 §5.4).
        let extra = oversign.contains(&name) || (name == "from" && present.is_empty());
        for &i in present.iter().rev() {
            if let Some(f) = signable.get(i) {
                canon::relaxed_header(f.name.unwrap_or_default(), f.value, &mut canonical);
                canonical.extend_from_slice(b"\r\n");
            }
        }
        let count = present.len() + usize::from(extra);
        names.extend(std::iter::repeat_n(name, count));
    }
    Selected { names, canonical }
}

/// A header field being written, folded at [`WIDTH`] columns.
struct Folder {
    /// The field so far, from its name on.
    text: Vec<u8>,
    /// The column after the last byte of the current line.
    col: usize,
}

impl Folder {
    /// A field holding only its name.
    fn new() -> Folder {
        let mut text = Vec::with_capacity(1024);
        text.extend_from_slice(FIELD_NAME);
        Folder {
            text,
            col: FIELD_NAME.len(),
        }
    }

    /// Appends a word that is never split, after a space if `space`; a word that would
    /// pass the last column starts a new line instead (CRLF SP, the SP standing for
    /// the space).
    fn word(&mut self, word: &[u8], space: bool) {
        if self.col + usize::from(space) + word.len() > WIDTH && self.col > 1 {
            self.text.extend_from_slice(b"\r\n ");
            self.col = 1;
        } else if space {
            self.text.push(b' ');
            self.col += 1;
        }
        self.text.extend_from_slice(word);
        self.col += word.len();
    }

    /// Appends text that may be split anywhere (base64), filling each line.
    fn fill(&mut self, mut text: &[u8]) {
        while !text.is_empty() {
            if self.col >= WIDTH {
                self.text.extend_from_slice(b"\r\n ");
                self.col = 1;
            }
            let n = (WIDTH - self.col).min(text.len());
            self.text.extend_from_slice(&text[..n]);
            self.col += n;
            text = &text[n..];
        }
    }
}
