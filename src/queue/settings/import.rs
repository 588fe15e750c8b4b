//! The file of `pepsi-settings import`, read and checked line by line before anything
//! is connected: each line in the format of `line.rs`, each setting's address a
//! mailbox (lower-cased) and its value not too long (`judge.rs`), no setting twice.
//! Every problem is named by its line; the first [`LISTED`] are listed and the rest
//! counted, so a hostile file costs bounded output, and a line longer than
//! [`MAX_LINE_BYTES`] is refused without being held.
//!
//! Reads its input and nothing else; `write.rs` checks the settings against the stage
//! graph and writes them.

use std::collections::HashMap;
use std::io::{self, BufRead};

use super::judge;
use super::line;
use crate::worker::settings::SettingRow;

/// The longest line read, in bytes: a setting's longest address and value, each
/// written with every character escaped, fit.
pub const MAX_LINE_BYTES: usize = 128 * 1024;

/// How many problems are listed one by one; the rest are counted in one more line.
pub const LISTED: usize = 100;

/// One setting of the file, with the number of its line (from 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// The line number.
    pub number: u64,
    /// The setting, its address lower-cased.
    pub row: SettingRow,
}

/// Problems named by line: the first [`LISTED`] kept, the rest counted.
#[derive(Debug, Default)]
pub struct Problems {
    /// The problems listed, each `line N: …`.
    pub listed: Vec<String>,
    /// How many more there were.
    pub more: usize,
}

impl Problems {
    /// Records a problem of line `number`.
    pub fn push(&mut self, number: u64, text: impl std::fmt::Display) {
        if self.listed.len() < LISTED {
            self.listed.push(format!("line {number}: {text}"));
        } else {
            self.more += 1;
        }
    }

    /// No problem recorded.
    pub fn is_empty(&self) -> bool {
        self.listed.is_empty()
    }

    /// The problems, one a line.
    pub fn report(&self) -> String {
        let mut text = self.listed.join("\n");
        if self.more > 0 {
            text.push_str(&format!("\n{} more problems (not listed)", self.more));
        }
        text
    }
}

/// Reads the next line into `buf` (without its line feed): `None` at the end of the
/// input, else whether the line was longer than [`MAX_LINE_BYTES`] (then `buf` is
/// empty: the line was skipped, not held).
fn next_line(input: &mut impl BufRead, buf: &mut Vec<u8>) -> io::Result<Option<bool>> {
    buf.clear();
    let (mut any, mut too_long) = (false, false);
    loop {
        let available = match input.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(any.then_some(too_long));
        }
        any = true;
        let (chunk, used, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], i + 1, true),
            None => (available, available.len(), false),
        };
        if !too_long {
            if buf.len() + chunk.len() > MAX_LINE_BYTES {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        input.consume(used);
        if done {
            return Ok(Some(too_long));
        }
    }
}

/// Reads every setting of `input`, checking each line; the settings of the lines
/// without problems, and the problems. An error reading the input is returned as it
/// is (the caller names the input).
pub fn read(mut input: impl BufRead) -> io::Result<(Vec<Line>, Problems)> {
    let mut lines = Vec::new();
    let mut problems = Problems::default();
    // Where each (address, stage, key) was first seen.
    let mut seen: HashMap<(String, String, String), u64> = HashMap::new();
    let mut buf = Vec::new();
    let mut number = 0u64;
    while let Some(too_long) = next_line(&mut input, &mut buf)? {
        number += 1;
        if too_long {
            problems.push(
                number,
                format!("longer than {MAX_LINE_BYTES} bytes; not read"),
            );
            continue;
        }
        let Ok(text) = std::str::from_utf8(&buf) else {
            problems.push(number, "not valid UTF-8");
            continue;
        };
        let mut row = match line::decode(text) {
            Ok(Some(row)) => row,
            Ok(None) => continue,
            Err(why) => {
                problems.push(number, why);
                continue;
            }
        };
        match judge::address(&row.address) {
            Ok(lower) => row.address = lower,
            Err(why) => {
                problems.push(number, why);
                continue;
            }
        }
        if let Err(why) = judge::value(&row.value) {
            problems.push(
                number,
                format!(
                    "{}: {why}",
                    judge::named(&row.address, &row.stage, &row.key)
                ),
            );
            continue;
        }
        let id = (row.address.clone(), row.stage.clone(), row.key.clone());
        if let Some(first) = seen.get(&id) {
            problems.push(
                number,
                format!(
                    "{}: the same setting as line {first}",
                    judge::named(&row.address, &row.stage, &row.key)
                ),
            );
            continue;
        }
        seen.insert(id, number);
        lines.push(Line { number, row });
    }
    Ok((lines, problems))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_text(text: &[u8]) -> (Vec<Line>, Problems) {
        read(io::BufReader::with_capacity(7, text)).unwrap()
    }

    #[test]
    fn settings_are_read_with_their_lines_and_addresses_lower_cased() {
        let (lines, problems) = read_text(
            b"# header\n\nAlice@X.example\troute\tMATCH\tsender is b@y\r\nb@y\troute\tMAX_LIFETIME\t1h",
        );
        assert!(problems.is_empty(), "{}", problems.report());
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].number, 3);
        assert_eq!(lines[0].row.address, "alice@x.example");
        assert_eq!(lines[0].row.value, "sender is b@y");
        assert_eq!(lines[1].number, 4, "a last line without a line feed");
        assert_eq!(lines[1].row.value, "1h");
    }

    #[test]
    fn every_bad_line_is_named_and_the_good_ones_kept() {
        let long_value = format!("a@x\ts\tK\t{}\n", "v".repeat(judge::MAX_VALUE_BYTES + 1));
        let long_line = format!("a@x\ts\tK\t{}\n", "v".repeat(MAX_LINE_BYTES));
        let mut text = Vec::new();
        text.extend_from_slice(b"a@x\ts\tK\tone\n");
        text.extend_from_slice(b"not a setting\n");
        text.extend_from_slice(b"A@X\ts\tK\ttwice\n");
        text.extend_from_slice(b"bad\xff\ts\tK\tv\n");
        text.extend_from_slice(b"r\xe2\x80\xae@x\ts\tK\tv\n");
        text.extend_from_slice(long_value.as_bytes());
        text.extend_from_slice(long_line.as_bytes());
        text.extend_from_slice(b"b@x\ts\tK\tgood\n");
        let (lines, problems) = read_text(&text);
        let numbers: Vec<u64> = lines.iter().map(|l| l.number).collect();
        assert_eq!(numbers, [1, 8]);
        let report = problems.report();
        for says in [
            "line 2: 1 field;",
            "line 3: a@x [stage-s] K: the same setting as line 1",
            "line 4: not valid UTF-8",
            "line 5: the address",
            "line 6: a@x [stage-s] K: the value is 8193 bytes long",
            "line 7: longer than",
        ] {
            assert!(report.contains(says), "{says}: {report}");
        }
        assert!(!report.contains('\u{202e}'), "{report}");
        assert!(
            report.len() < 2000,
            "nothing long is quoted: {}",
            report.len()
        );
    }

    #[test]
    fn problems_past_the_listed_ones_are_counted() {
        let text = "junk\n".repeat(LISTED + 5);
        let (lines, problems) = read_text(text.as_bytes());
        assert!(lines.is_empty());
        assert_eq!(problems.listed.len(), LISTED);
        assert_eq!(problems.more, 5);
        assert!(problems.report().ends_with("5 more problems (not listed)"));
    }
}
