//! The sizes of the batches a worker processed, summed up in one log line when its
//! input ends, so an operator (and the benchmark) can see how full the batches ran.
//!
//! Owned and fed by `batch.rs`'s serve loop. A leaf: pure counting, no I/O; its
//! `Display` form is read back by the benchmark, so it must not change lightly.

use std::fmt;

/// Upper bounds of the size classes: 1, 2–3, 4–7, 8–15, 16–31, 32 and more.
const BOUNDS: [usize; 5] = [1, 3, 7, 15, 31];
const LABELS: [&str; 6] = ["1", "2-3", "4-7", "8-15", "16-31", "32+"];

/// Batch sizes by power-of-two class.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchTally {
    counts: [u64; 6],
    batches: u64,
    messages: u64,
}

impl BatchTally {
    /// Counts one batch of `size` ids.
    pub fn add(&mut self, size: usize) {
        let class = BOUNDS
            .iter()
            .position(|&b| size <= b)
            .unwrap_or(BOUNDS.len());
        self.counts[class] = self.counts[class].saturating_add(1);
        self.batches = self.batches.saturating_add(1);
        self.messages = self.messages.saturating_add(size as u64);
    }

    /// How many batches were counted.
    pub fn batches(&self) -> u64 {
        self.batches
    }
}

impl fmt::Display for BatchTally {
    /// `120 messages in 9 batches (sizes 1: 1, 2-3: 0, 4-7: 0, 8-15: 1, 16-31: 7, 32+: 0)`:
    /// the benchmark reads this form back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} messages in {} batches (sizes",
            self.messages, self.batches
        )?;
        for (i, (label, count)) in LABELS.iter().zip(self.counts).enumerate() {
            write!(f, "{} {label}: {count}", if i == 0 { "" } else { "," })?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fall_into_their_classes() {
        let mut t = BatchTally::default();
        for size in [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500] {
            t.add(size);
        }
        assert_eq!(t.counts, [1, 2, 2, 2, 2, 2]);
        assert_eq!(t.batches(), 11);
        assert_eq!(
            t.to_string(),
            "619 messages in 11 batches (sizes 1: 1, 2-3: 2, 4-7: 2, 8-15: 2, 16-31: 2, 32+: 2)"
        );
    }
}
