//! Unknown keys (§4 "Strictness"): an unknown key is a warning naming where it is
//! and the nearest known key, never an error — an operator's typo must not stop mail,
//! but it must not pass silently either.
//!
//! Pure: [`fixed_warnings`] checks the fixed sections against the key table
//! ([`super::fixed::SECTIONS`]), for `Config::from_sections` and `pepsi-dispatch
//! check`, and [`unknown_keys`] the stage sections; the callers decide whether the
//! warnings are logged or printed.

use super::fixed::SECTIONS;
use super::raw::STAGE_PREFIX;
use super::raw::{ConfigError, Section};

/// The keys every stage section may set, whatever its program (§4).
pub const STAGE_KEYS: &[&str] = &[
    "PROGRAM",
    "NEXT",
    "PARALLELISM",
    "QUEUE_LIMIT",
    "MAX_MESSAGES",
    "FUSION",
    "MAX_LIFETIME",
    "BOUNCE_STAGE",
    "SYNCHRONOUS_COMMIT",
    "RATE",
];

/// The largest edit distance at which a known key is suggested for an unknown one.
const MAX_SUGGESTION_DISTANCE: usize = 2;

/// The Levenshtein distance between two strings: the fewest single-character
/// insertions, deletions and substitutions that turn one into the other.
pub fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    // One row of the dynamic-programming table at a time: row[j] is the distance
    // between the prefix of `a` read so far and the first j characters of `b`.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// The known key nearest to `key`, when it is close enough to be a typo of it (the
/// first of equally near ones).
pub fn nearest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (distance(key, k), *k))
        .filter(|(d, _)| *d <= MAX_SUGGESTION_DISTANCE)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// The message of an unknown-key warning: `unknown key, ignored`, with the nearest
/// known key when there is one (`; did you mean PARALLELISM?`) and `whose` naming
/// whose keys were compared when that helps (`of pepsi-stage-if`).
pub fn unknown_key(key: &str, known: &[&str], whose: Option<&str>) -> String {
    let mut message = match whose {
        Some(whose) => format!("unknown key of {whose}, ignored"),
        None => "unknown key, ignored".to_string(),
    };
    if let Some(k) = nearest(key, known) {
        message.push_str(&format!("; did you mean {k}?"));
    }
    message
}

/// The unknown sections of a file and the unknown keys of its fixed sections, each a
/// warning naming file, line, section and key and the nearest known name.
pub fn fixed_warnings(sections: &[Section]) -> Vec<ConfigError> {
    let names: Vec<&str> = SECTIONS.iter().map(|(n, _)| *n).collect();
    let mut warnings = Vec::new();
    for s in sections {
        if s.name.starts_with(STAGE_PREFIX) {
            continue;
        }
        let Some((_, known)) = SECTIONS.iter().find(|(n, _)| *n == s.name) else {
            let mut message = "unknown section, ignored (a stage is [stage-NAME])".to_string();
            if let Some(n) = nearest(&s.name, &names) {
                message.push_str(&format!("; did you mean [{n}]?"));
            }
            warnings.push(ConfigError {
                section: Some(s.name.clone()),
                ..ConfigError::at(s.origin.clone(), message)
            });
            continue;
        };
        for (key, _) in s.entries() {
            if known.contains(&key) {
                continue;
            }
            let mut message = unknown_key(key, known, None);
            // A key put in the wrong section says where it belongs.
            if let Some((home, _)) = SECTIONS.iter().find(|(_, k)| k.contains(&key)) {
                message.push_str(&format!("; {key} belongs in [{home}]"));
            }
            warnings.push(s.error(key, message));
        }
    }
    warnings
}

/// The unknown keys of stage sections, as warnings naming where each is set (a file
/// and line, or the overlay) and the nearest known key. A section is checked only when
/// `program_keys` knows its `PROGRAM` (a built-in: the keys it declares); any other
/// program's options are its own business.
pub fn unknown_keys<'a>(
    sections: impl IntoIterator<Item = &'a Section>,
    program_keys: impl Fn(&str) -> Option<&'static [&'static str]>,
) -> Vec<ConfigError> {
    let mut warnings = Vec::new();
    for section in sections {
        let Some(program) = section.get("PROGRAM") else {
            continue;
        };
        let Some(own) = program_keys(program) else {
            continue;
        };
        let known: Vec<&str> = STAGE_KEYS.iter().chain(own).copied().collect();
        let name = program.rsplit('/').next().unwrap_or(program);
        for (key, _) in section.entries() {
            if !known.contains(&key) {
                warnings.push(section.error(key, unknown_key(key, &known, Some(name))));
            }
        }
    }
    warnings
}

/// The keys of every stage section ([`STAGE_KEYS`]) that a section's program does not
/// read (`NEXT` of `pepsi-stage-discard`), each a warning naming file, line, section and
/// key: a setting that does nothing is as misleading as a misspelt one. `ignored` gives
/// a program's unread keys with why (none for a program that is not a built-in).
pub fn ignored_keys<'a>(
    sections: impl IntoIterator<Item = &'a Section>,
    ignored: impl Fn(&str) -> &'static [(&'static str, &'static str)],
) -> Vec<ConfigError> {
    let mut warnings = Vec::new();
    for section in sections {
        let Some(program) = section.get("PROGRAM") else {
            continue;
        };
        let name = program.rsplit('/').next().unwrap_or(program);
        for (key, why) in ignored(program) {
            if section.get(key).is_some() {
                warnings.push(
                    section.error(key, format!("{name} does not read {key} ({why}); ignored")),
                );
            }
        }
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_single_character_edits() {
        assert_eq!(distance("", ""), 0);
        assert_eq!(distance("ABC", ""), 3);
        assert_eq!(distance("", "ABC"), 3);
        assert_eq!(distance("NEXT", "NEXT"), 0);
        assert_eq!(distance("NEX", "NEXT"), 1);
        assert_eq!(distance("NEXTT", "NEXT"), 1);
        assert_eq!(distance("NEXD", "NEXT"), 1);
        assert_eq!(
            distance("PARALLELSIM", "PARALLELISM"),
            2,
            "a swap is two edits"
        );
        assert_eq!(distance("KITTEN", "SITTING"), 3);
    }

    #[test]
    fn the_nearest_key_is_suggested_only_when_close() {
        let known = ["PARALLELISM", "QUEUE_LIMIT", "MAX_MESSAGES", "MAX_LIFETIME"];
        assert_eq!(nearest("PARALLELSIM", &known), Some("PARALLELISM"));
        assert_eq!(nearest("QUEUE_LIMITS", &known), Some("QUEUE_LIMIT"));
        assert_eq!(nearest("MAX_MESSAGE", &known), Some("MAX_MESSAGES"));
        assert_eq!(nearest("COLOUR", &known), None);
        assert_eq!(
            unknown_key("PARALLELSIM", &known, None),
            "unknown key, ignored; did you mean PARALLELISM?"
        );
        assert_eq!(
            unknown_key("COLOUR", &known, Some("pepsi-stage-pass")),
            "unknown key of pepsi-stage-pass, ignored"
        );
    }
}
