//! Text for people: ages, shortened values and aligned tables. Pure; used by the
//! reading and repair commands of `pepsi-queue` when `--json` is not given.
//!
//! Values come from messages and the database, so whatever reaches the terminal through
//! here is escaped ([`crate::escape`]): [`shown`] and [`one_line`] escape the values they
//! shorten, and a [`Table`] escapes every cell it is given.

use crate::escape::Visible;

/// An age in seconds, short: `42s`, `12m05s`, `3h05m`, `2d04h`; `-` when unknown.
pub fn age(seconds: f64) -> String {
    if !seconds.is_finite() {
        return "-".to_string();
    }
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// A value on one line, at most `max` characters: escaped ([`Visible`]: line breaks as
/// `\n`, ESC as `\u{1b}`), and cut with an ellipsis where it is longer, never inside
/// an escape.
pub fn shown(text: &str, max: usize) -> String {
    let all = Visible(text).to_string();
    if all.chars().count() <= max {
        return all;
    }
    let mut cut = String::new();
    let mut used = 0;
    let mut one = String::new();
    for c in text.chars() {
        one.clear();
        let mut buf = [0; 4];
        one.push_str(&Visible(c.encode_utf8(&mut buf)).to_string());
        let width = one.chars().count();
        if used + width > max.saturating_sub(1) {
            break;
        }
        cut.push_str(&one);
        used += width;
    }
    cut.push('…');
    cut
}

/// Free text on one line, at most `max` characters: each run of white space (line
/// breaks and tabs included) as one space, then as [`shown`].
pub fn one_line(text: &str, max: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    shown(&flat, max)
}

/// An envelope sender for people: the null sender as `<>` (to be [`shown`]).
pub fn sender(mail_from: &str) -> String {
    if mail_from.is_empty() {
        "<>".to_string()
    } else {
        mail_from.to_string()
    }
}

/// Column alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    /// Text, padded on the right.
    Left,
    /// Numbers, padded on the left.
    Right,
}

/// A table: a header row and rows of cells, laid out in columns two spaces apart. The
/// last column is not padded.
pub struct Table {
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers and alignments.
    pub fn new(columns: &[(&str, Align)]) -> Table {
        Table {
            align: columns.iter().map(|c| c.1).collect(),
            rows: vec![columns.iter().map(|c| c.0.to_string()).collect()],
        }
    }

    /// Adds a row (as many cells as columns), each cell escaped ([`Visible`]; a cell
    /// escaped already stays as it is).
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.align.len());
        self.rows
            .push(cells.iter().map(|c| Visible(c).to_string()).collect());
    }

    /// The number of rows without the header.
    pub fn len(&self) -> usize {
        self.rows.len() - 1
    }

    /// No rows but the header.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The laid-out text, one line per row, each ending in a newline.
    pub fn render(&self) -> String {
        let columns = self.align.len();
        let width: Vec<usize> = (0..columns)
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = width[i] - cell.chars().count();
                match self.align[i] {
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                    Align::Left if i + 1 == columns => line.push_str(cell),
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_short() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(-3.0), "0s");
        assert_eq!(age(59.9), "59s");
        assert_eq!(age(725.0), "12m05s");
        assert_eq!(age(3.0 * 3600.0 + 300.0), "3h05m");
        assert_eq!(age(2.0 * 86400.0 + 4.0 * 3600.0), "2d04h");
        assert_eq!(age(f64::INFINITY), "-");
    }

    #[test]
    fn one_line_flattens_and_cuts() {
        assert_eq!(one_line("a\nb\tc", 10), "a b c");
        assert_eq!(one_line("abcdefghijkl", 5), "abcd…");
    }

    #[test]
    fn values_are_shown_escaped_and_cut_between_escapes() {
        assert_eq!(one_line("a\nb\tc\u{7}", 10), "a b c\\u{7}");
        assert_eq!(
            shown("a\u{1b}[2J\r\nb\u{202e}c\u{2028}", 80),
            "a\\u{1b}[2J\\r\\nb\\u{202e}c\\u{2028}"
        );
        assert_eq!(shown("ab\u{1b}cd", 7), "ab…", "the escape does not fit");
        assert_eq!(shown("ab\u{1b}cde", 10), "ab\\u{1b}c…");
        assert_eq!(shown("jörg", 4), "jörg");
        assert_eq!(shown(&sender(""), 40), "<>");
        assert_eq!(shown(&sender("a\r\n@x"), 40), "a\\r\\n@x");
    }

    #[test]
    fn a_table_aligns_its_columns() {
        let mut t = Table::new(&[
            ("NAME", Align::Left),
            ("N", Align::Right),
            ("NOTE", Align::Left),
        ]);
        t.row(vec!["relay".into(), "12".into(), "x".into()]);
        t.row(vec!["in".into(), "3".into(), "".into()]);
        assert_eq!(t.render(), "NAME    N  NOTE\nrelay  12  x\nin      3\n");
        assert_eq!(t.len(), 2);
        t.row(vec!["a\u{1b}".into(), "1".into(), "\n".into()]);
        assert!(
            t.render().ends_with("a\\u{1b}   1  \\n\n"),
            "{}",
            t.render()
        );
    }
}
