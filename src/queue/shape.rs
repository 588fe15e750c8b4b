//! `pepsi-queue shape`: the queue's messages by age and by a key — recipient domain,
//! sender domain or stage — as Postfix's `qshape(1)` shows its queues: a total column,
//! then the messages in each age bucket (under 5 minutes, 5 to 10, 10 to 20, … 1280 and
//! more), a TOTAL row, then the keys with the most messages.
//!
//! Owns the command's options, its buckets and its rendering. The counting is the
//! server's: one read-only statement ([`sql::QUEUE_SHAPE_BY_KEY`]) groups, ranks and
//! cuts, so a queue of a million messages sends back a few hundred numbers.
//! [`Shape::from_records`], [`Shape::text`] and [`Shape::json`] are pure; only [`run`]
//! touches the database. Keys come from messages (a recipient's domain may hold CR,
//! LF, NUL or U+202E): the text shows them escaped ([`crate::escape`], through the
//! table), the JSON exactly.

use serde_json::{Value, json};

use super::format::{Align, Table};
use super::{Session, db_failure, emit, emit_json};
use crate::db::sql;
use crate::exit::Failure;

/// The upper bounds of the age buckets in minutes, as `qshape`'s default: the first
/// bucket counts the messages younger than 5 minutes, the last those of 1280 and more.
pub const BUCKET_MINUTES: [u32; 9] = [5, 10, 20, 40, 80, 160, 320, 640, 1280];

/// The number of age buckets: one more than the bounds.
pub const BUCKETS: usize = BUCKET_MINUTES.len() + 1;

/// The default `--top`: `qshape`'s 20 domains.
pub const DEFAULT_TOP: i64 = 20;

/// What the messages are counted by (`--by`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum By {
    /// The domains of the recipients: a message counts once in each.
    #[default]
    RecipientDomain,
    /// The sender's domain, `MAILER-DAEMON` for the null sender.
    Sender,
    /// The stage.
    Stage,
}

impl By {
    /// Every key, in the order the usage lists them.
    pub const ALL: [By; 3] = [By::RecipientDomain, By::Sender, By::Stage];

    /// The name on the command line, in the JSON and in the statement's `$1`.
    pub fn name(self) -> &'static str {
        match self {
            By::RecipientDomain => "recipient-domain",
            By::Sender => "sender",
            By::Stage => "stage",
        }
    }

    /// The key named `name`, if any.
    pub fn from_name(name: &str) -> Option<By> {
        By::ALL.into_iter().find(|by| by.name() == name)
    }

    /// The names, for a usage error: `recipient-domain, sender, stage`.
    pub fn names() -> String {
        By::ALL.map(By::name).join(", ")
    }

    /// What a key is, in the plural, for the line that says the list was cut.
    fn plural(self) -> &'static str {
        match self {
            By::RecipientDomain => "recipient domains",
            By::Sender => "sender domains",
            By::Stage => "stages",
        }
    }
}

/// `shape`'s options, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// `--by`.
    pub by: By,
    /// `--top`: at most this many keys (positive).
    pub top: i64,
    /// `--stage`: only the messages at this stage.
    pub stage: Option<String>,
    /// `--status`: only the messages in this status.
    pub status: Option<String>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            by: By::default(),
            top: DEFAULT_TOP,
            stage: None,
            status: None,
        }
    }
}

/// One row of the table: a key (or the total) and its messages per age bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// The key as stored (empty for the total).
    pub key: String,
    /// Messages in each bucket, youngest first.
    pub counts: [i64; BUCKETS],
}

impl Row {
    /// Messages in all buckets: the `T` column.
    pub fn total(&self) -> i64 {
        self.counts.iter().sum()
    }
}

/// One row of [`sql::QUEUE_SHAPE_BY_KEY`]: (total, key, bucket, messages, rank, keys).
pub type Record = (bool, Option<String>, i32, i64, i64, i64);

/// What `shape` shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// The key counted by.
    pub by: By,
    /// Every message, each once.
    pub total: Row,
    /// The top keys, most messages first, then by key.
    pub rows: Vec<Row>,
    /// How many keys there are in all, shown or not.
    pub keys: i64,
}

impl Shape {
    /// The shape from the statement's rows, in its order (the total, then the keys by
    /// rank and bucket). A bucket out of range counts in the nearest one.
    pub fn from_records(by: By, records: impl IntoIterator<Item = Record>) -> Shape {
        let mut shape = Shape {
            by,
            ..Shape::default()
        };
        let mut rank = 0;
        for (total, key, bucket, messages, key_rank, keys) in records {
            let bucket = (bucket.max(0) as usize).min(BUCKETS - 1);
            if total {
                shape.total.counts[bucket] += messages;
                continue;
            }
            shape.keys = keys;
            // A new rank starts a new row: the statement sends a key's buckets together.
            if shape.rows.is_empty() || key_rank != rank {
                rank = key_rank;
                shape.rows.push(Row {
                    key: key.unwrap_or_default(),
                    counts: [0; BUCKETS],
                });
            }
            if let Some(row) = shape.rows.last_mut() {
                row.counts[bucket] += messages;
            }
        }
        shape
    }

    /// The keys left out by `--top`.
    pub fn left_out(&self) -> i64 {
        (self.keys - self.rows.len() as i64).max(0)
    }

    /// The text for people: a header line (`T`, then each bucket by its upper bound in
    /// minutes, the last `1280+`), the TOTAL row, then a row per key, every column
    /// right-aligned as `qshape`'s, each key escaped (by the table); then a line when
    /// `--top` left keys out.
    pub fn text(&self, top: i64) -> String {
        let labels = header_labels();
        let mut columns = vec![("", Align::Right)];
        columns.extend(labels.iter().map(|l| (l.as_str(), Align::Right)));
        let mut table = Table::new(&columns);
        let row_cells = |label: &str, row: &Row| -> Vec<String> {
            let mut cells = vec![label.to_string(), row.total().to_string()];
            cells.extend(row.counts.iter().map(i64::to_string));
            cells
        };
        table.row(row_cells("TOTAL", &self.total));
        for row in &self.rows {
            table.row(row_cells(&row.key, row));
        }
        let mut out = table.render();
        let left_out = self.left_out();
        if left_out > 0 {
            out.push_str(&format!(
                "… {left_out} more {} not shown (--top {top}; --top {} shows them all)\n",
                self.by.plural(),
                self.keys
            ));
        }
        out
    }

    /// The JSON document: `by`, `buckets_minutes` (the upper bounds; `counts` has one
    /// more, the last bucket having none), `rows` (each `key`, exactly, `total` and
    /// `counts`), `total` (`total` and `counts`) and `keys` (how many in all).
    pub fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| json!({"key": r.key, "total": r.total(), "counts": r.counts}))
            .collect();
        json!({
            "by": self.by.name(),
            "buckets_minutes": BUCKET_MINUTES,
            "rows": rows,
            "total": {"total": self.total.total(), "counts": self.total.counts},
            "keys": self.keys,
        })
    }
}

/// The column headers after the key: `T`, `5`, `10`, … `1280`, `1280+`.
fn header_labels() -> Vec<String> {
    let mut labels = vec!["T".to_string()];
    labels.extend(BUCKET_MINUTES.iter().map(u32::to_string));
    labels.push(format!("{}+", BUCKET_MINUTES[BUCKET_MINUTES.len() - 1]));
    labels
}

/// Runs `pepsi-queue shape`: one statement, then the text or the JSON.
pub fn run(session: &mut Session, options: &Options, json: bool) -> Result<(), Failure> {
    let bounds: Vec<f64> = BUCKET_MINUTES.iter().map(|m| f64::from(*m)).collect();
    let rows = session
        .client
        .query(
            sql::QUEUE_SHAPE_BY_KEY,
            &[
                &options.by.name(),
                &bounds,
                &options.stage,
                &options.status,
                &options.top,
            ],
        )
        .map_err(|e| db_failure("counting the queue's shape", &e))?;
    let shape = Shape::from_records(
        options.by,
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))),
    );
    if json {
        emit_json(&shape.json())
    } else {
        emit(shape.text(options.top).as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: Option<&str>, bucket: i32, n: i64, rank: i64, keys: i64) -> Record {
        (
            key.is_none(),
            key.map(str::to_string),
            bucket,
            n,
            rank,
            keys,
        )
    }

    fn counts(pairs: &[(usize, i64)]) -> [i64; BUCKETS] {
        let mut c = [0; BUCKETS];
        for (i, n) in pairs {
            c[*i] = *n;
        }
        c
    }

    #[test]
    fn keys_are_named_as_on_the_command_line() {
        for by in By::ALL {
            assert_eq!(By::from_name(by.name()), Some(by));
        }
        assert_eq!(By::from_name("domain"), None);
        assert_eq!(By::from_name("Sender"), None);
        assert_eq!(By::names(), "recipient-domain, sender, stage");
        assert_eq!(By::default(), By::RecipientDomain);
        assert_eq!(Options::default().top, 20);
    }

    #[test]
    fn records_become_rows_in_rank_order_with_the_total_apart() {
        let shape = Shape::from_records(
            By::Sender,
            [
                record(None, 0, 3, 1, 1),
                record(None, 9, 2, 1, 1),
                record(Some("b.example"), 0, 2, 1, 3),
                record(Some("b.example"), 9, 1, 1, 3),
                record(Some("MAILER-DAEMON"), 0, 1, 2, 3),
                // Out of range: into the nearest bucket.
                record(Some("MAILER-DAEMON"), 12, 1, 2, 3),
            ],
        );
        assert_eq!(shape.total.counts, counts(&[(0, 3), (9, 2)]));
        assert_eq!(shape.total.total(), 5);
        assert_eq!(
            shape.rows,
            [
                Row {
                    key: "b.example".into(),
                    counts: counts(&[(0, 2), (9, 1)])
                },
                Row {
                    key: "MAILER-DAEMON".into(),
                    counts: counts(&[(0, 1), (9, 1)])
                }
            ]
        );
        assert_eq!(shape.left_out(), 1);
        let empty = Shape::from_records(By::Stage, []);
        assert_eq!(
            (empty.total.total(), empty.rows.len(), empty.keys),
            (0, 0, 0)
        );
    }

    #[test]
    fn the_text_is_right_aligned_like_qshape_with_keys_escaped() {
        let shape = Shape::from_records(
            By::RecipientDomain,
            [
                record(None, 0, 12, 1, 1),
                record(None, 9, 1, 1, 1),
                record(Some("example.org"), 0, 10, 1, 2),
                record(Some("ev\r\nil\u{202e}\0"), 0, 2, 2, 2),
                record(Some("ev\r\nil\u{202e}\0"), 9, 1, 2, 2),
            ],
        );
        let text = shape.text(20);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "                        T   5  10  20  40  80  160  320  640  1280  1280+",
                "                TOTAL  13  12   0   0   0   0    0    0    0     0      1",
                "          example.org  10  10   0   0   0   0    0    0    0     0      0",
                "ev\\r\\nil\\u{202e}\\u{0}   3   2   0   0   0   0    0    0    0     0      1",
            ],
            "{text}"
        );
        assert!(!text.contains(['\r', '\u{202e}', '\0']));
    }

    #[test]
    fn a_cut_list_says_how_many_keys_it_left_out() {
        let shape = Shape::from_records(
            By::Stage,
            [record(None, 0, 5, 1, 1), record(Some("relay"), 0, 3, 1, 3)],
        );
        let text = shape.text(1);
        assert!(
            text.ends_with("… 2 more stages not shown (--top 1; --top 3 shows them all)\n"),
            "{text}"
        );
    }

    #[test]
    fn the_json_gives_keys_exactly_with_the_bounds() {
        let shape = Shape::from_records(
            By::RecipientDomain,
            [
                record(None, 3, 1, 1, 1),
                record(Some("a\r\n\u{202e}"), 3, 1, 1, 1),
            ],
        );
        let j = shape.json();
        assert_eq!(j["by"], "recipient-domain");
        assert_eq!(
            j["buckets_minutes"],
            json!([5, 10, 20, 40, 80, 160, 320, 640, 1280])
        );
        assert_eq!(j["rows"][0]["key"], "a\r\n\u{202e}");
        assert_eq!(j["rows"][0]["total"], 1);
        assert_eq!(
            j["rows"][0]["counts"],
            json!([0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
        );
        assert_eq!(
            j["total"],
            json!({"total": 1, "counts": [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]})
        );
        assert_eq!(j["keys"], 1);
    }
}
