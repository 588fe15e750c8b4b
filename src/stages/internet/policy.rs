//! Which TLS level a destination gets (§21, §22): the `TLS_POLICY` file's line for it,
//! else the section's `TLS` (`may` by default).
//!
//! The file has one destination a line, as Postfix's smtp_tls_policy_maps: `DOMAIN
//! LEVEL`, where DOMAIN is a recipient domain (`example.com`) or, with a leading dot,
//! every domain below one (`.example.com`), and LEVEL one of `none`, `may`, `encrypt`,
//! `verify`; `#` starts a comment. An exact line wins over a parent's dotted one, a
//! nearer parent over a farther one. At `verify` the certificate must name the
//! exchanger's host name (the MX target), as Postfix's default `match=hostname`.
//!
//! A lookup answers a [`Policy`] with where it came from, so sources added later (DANE
//! TLSA records, MTA-STS, RFC 7672 and RFC 8461) slot in between the file and the
//! default without changing the callers: each either answers for the destination or
//! passes to the next.
//!
//! Read when the worker starts (`mod.rs`), by the stage's account; a line that cannot
//! be read is a configuration error naming the file and the line.

use std::path::Path;

use crate::tls::Level;

/// Where a destination's level came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A line of `TLS_POLICY`.
    File,
    /// The section's `TLS`.
    Default,
}

/// A destination's TLS policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub level: Level,
    pub source: Source,
}

/// The lines of a `TLS_POLICY` file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyTable {
    /// (domain in lower case, with its leading dot for a parent entry; level).
    entries: Vec<(String, Level)>,
}

impl PolicyTable {
    /// Reads the file at `path`.
    pub fn load(path: &Path) -> Result<PolicyTable, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        PolicyTable::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses the text of a policy file; an error names the line.
    pub fn parse(text: &str) -> Result<PolicyTable, String> {
        let mut entries: Vec<(String, Level)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let [domain, level] = words[..] else {
                return Err(format!(
                    "line {n}: expected DOMAIN LEVEL, found {} word(s)",
                    words.len()
                ));
            };
            let bare = domain.strip_prefix('.').unwrap_or(domain);
            if super::dns::name(bare).is_err() {
                return Err(format!(
                    "line {n}: {:?} is not a domain (or .domain)",
                    crate::escape::Visible(domain).to_string()
                ));
            }
            let level = Level::parse(level).map_err(|e| format!("line {n}: {e}"))?;
            let domain = domain.to_ascii_lowercase();
            if entries.iter().any(|(d, _)| *d == domain) {
                return Err(format!("line {n}: {domain} is listed twice"));
            }
            entries.push((domain, level));
        }
        Ok(PolicyTable { entries })
    }

    /// Every level the file names.
    pub fn levels(&self) -> impl Iterator<Item = Level> + '_ {
        self.entries.iter().map(|(_, level)| *level)
    }

    /// The level the file gives `domain` (lower case), if any.
    fn level_of(&self, domain: &str) -> Option<Level> {
        if let Some((_, level)) = self.entries.iter().find(|(d, _)| d == domain) {
            return Some(*level);
        }
        // Parents, nearest first: `.b.c` then `.c` for `a.b.c`.
        let mut rest = domain;
        while let Some((_, parent)) = rest.split_once('.') {
            let dotted = format!(".{parent}");
            if let Some((_, level)) = self.entries.iter().find(|(d, _)| *d == dotted) {
                return Some(*level);
            }
            rest = parent;
        }
        None
    }

    /// The policy of `domain`: the file's, else `default`.
    pub fn policy(&self, domain: &str, default: Level) -> Policy {
        match self.level_of(domain) {
            Some(level) => Policy {
                level,
                source: Source::File,
            },
            None => Policy {
                level: default,
                source: Source::Default,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_lines_win_over_parents_and_the_nearest_parent_over_farther_ones() {
        let t = PolicyTable::parse(
            "# policies\nexample.com verify\n.example.com encrypt\n.com may\n\nBANK.example none # shouting\n",
        )
        .unwrap();
        let level = |d: &str| t.policy(d, Level::May);
        assert_eq!(level("example.com").level, Level::Verify);
        assert_eq!(level("example.com").source, Source::File);
        assert_eq!(level("mx.example.com").level, Level::Encrypt);
        assert_eq!(level("other.com").level, Level::May);
        assert_eq!(level("other.com").source, Source::File);
        assert_eq!(level("bank.example").level, Level::None);
        assert_eq!(level("example.org").source, Source::Default);
    }

    #[test]
    fn a_bad_line_is_refused_with_its_number() {
        for (text, line) in [
            ("a.example verify\nb.example\n", "line 2"),
            ("a.example always\n", "line 1"),
            ("\n\nexa mple.com may extra\n", "line 3"),
            ("a\u{202e}b.example may\n", "line 1"),
            ("a.example may\nA.example verify\n", "line 2"),
        ] {
            let e = PolicyTable::parse(text).unwrap_err();
            assert!(e.contains(line), "{text:?}: {e}");
            assert!(!e.contains('\u{202e}'), "escaped: {e}");
        }
    }
}
