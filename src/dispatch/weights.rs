//! Fair-share weights and tenant rates (§7 "Weights, rates and tenants"): the patterns
//! of `pepsi.fair_weights` as the dispatcher holds them between reloads, the weight of
//! a tenant or sender key and the rate of a tenant. A pattern is matched as the schema's `pepsi.pattern_like`
//! reads it: `*` any characters, everything else literal; when several match, the one
//! with the most literal characters wins, then the lower pattern (as `pepsi.tenants`).
//! A key no pattern matches weighs 1. Pure; the fair policy (`fair.rs`) asks it.
//!
//! The answers are kept per key, so a busy sender's weight is matched once per reload,
//! not per claimed row; the cache is emptied when it passes [`CACHE_MAX`] keys.

use std::collections::HashMap;

use crate::db::sql_settings::{WEIGHT_MAX, WEIGHT_MIN};
/// Keys whose weight is remembered before the memory starts over.
const CACHE_MAX: usize = 100_000;

pub use super::scheduler::WeightRow;

/// The weights read from `pepsi.fair_weights`.
#[derive(Debug, Default)]
pub struct Weights {
    /// (pattern, weight, rate), the most literal first.
    patterns: Vec<WeightRow>,
    cache: HashMap<String, (f64, Option<f64>)>,
}

impl Weights {
    /// Weights from the table's rows; a weight outside [`WEIGHT_MIN`, `WEIGHT_MAX`]
    /// (the table refuses it; a NaN never passes) is clamped, a rate that is not a
    /// positive number left out.
    pub fn new(rows: Vec<WeightRow>) -> Weights {
        let mut patterns: Vec<WeightRow> = rows
            .into_iter()
            .map(|(p, w, r)| {
                let w = if w.is_nan() { 1.0 } else { w };
                let r = r.filter(|r| r.is_finite() && *r > 0.0);
                (p, w.clamp(WEIGHT_MIN, WEIGHT_MAX), r)
            })
            .collect();
        patterns.sort_by(|a, b| literal(&b.0).cmp(&literal(&a.0)).then(a.0.cmp(&b.0)));
        Weights {
            patterns,
            cache: HashMap::new(),
        }
    }

    /// No pattern at all: every key weighs 1.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The weight of a tenant or sender key.
    pub fn of(&mut self, key: &str) -> f64 {
        self.lookup(key).0
    }

    /// The rate of a tenant key, messages a second, if its pattern sets one.
    pub fn rate_of(&mut self, key: &str) -> Option<f64> {
        self.lookup(key).1
    }

    /// The weight and rate of the most literal pattern matching `key`.
    fn lookup(&mut self, key: &str) -> (f64, Option<f64>) {
        if self.patterns.is_empty() {
            return (1.0, None);
        }
        if let Some(found) = self.cache.get(key) {
            return *found;
        }
        let found = self
            .patterns
            .iter()
            .find(|(p, _, _)| matches(p, key))
            .map_or((1.0, None), |(_, w, r)| (*w, *r));
        if self.cache.len() >= CACHE_MAX {
            self.cache.clear();
        }
        self.cache.insert(key.to_string(), found);
        found
    }
}

/// The number of characters of a pattern other than `*`.
fn literal(pattern: &str) -> usize {
    pattern.chars().filter(|&c| c != '*').count()
}

/// Whether `key` matches `pattern` (`*` any run of characters, possibly empty).
/// Iterative, with one backtrack point: linear in the key for each `*`.
pub fn matches(pattern: &str, key: &str) -> bool {
    let (p, k): (Vec<char>, Vec<char>) = (pattern.chars().collect(), key.chars().collect());
    let (mut pi, mut ki) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ki < k.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ki));
            pi += 1;
        } else if pi < p.len() && p[pi] == k[ki] {
            pi += 1;
            ki += 1;
        } else if let Some((sp, sk)) = star {
            pi = sp + 1;
            ki = sk + 1;
            star = Some((sp, sk + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_matches_any_run_and_the_rest_is_literal() {
        assert!(matches("from:*.example.com", "from:mail.example.com"));
        assert!(!matches("from:*.example.com", "from:example.com"));
        assert!(matches("ip:192.0.2.*", "ip:192.0.2.7"));
        assert!(matches("*", ""));
        assert!(matches("a*b*c", "aXXbYYc"));
        assert!(!matches("a*b*c", "aXXbYY"));
        // % and _ are literal here, as the schema's pattern_like escapes them.
        assert!(!matches("from:a_b", "from:axb"));
        assert!(matches("from:a%b", "from:a%b"));
        assert!(!matches("from:a%b", "from:aXXb"));
        assert!(matches("tenant:acme", "tenant:acme"));
        assert!(!matches("tenant:acme", "tenant:acme2"));
    }

    #[test]
    fn the_most_literal_pattern_wins_and_an_unmatched_key_weighs_one() {
        let mut w = Weights::new(vec![
            ("domain:*".into(), 0.5, None),
            ("domain:paying.example".into(), 2.0, Some(10.0)),
            ("tenant:*".into(), 3.0, Some(f64::NAN)),
        ]);
        assert_eq!(w.of("domain:paying.example"), 2.0);
        assert_eq!(w.of("domain:free.example"), 0.5);
        assert_eq!(w.of("tenant:acme"), 3.0);
        assert_eq!(w.of("from:x.example"), 1.0);
        // Asked again: the remembered answer.
        assert_eq!(w.of("domain:paying.example"), 2.0);
        assert_eq!(w.rate_of("domain:paying.example"), Some(10.0));
        assert_eq!(w.rate_of("domain:free.example"), None);
        assert_eq!(w.rate_of("tenant:acme"), None, "a NaN rate is none");
        assert!(Weights::default().is_empty());
        assert_eq!(Weights::default().of("anything"), 1.0);
    }

    #[test]
    fn weights_outside_the_range_are_clamped() {
        let mut w = Weights::new(vec![
            ("a".into(), 1e9, None),
            ("b".into(), 0.0, None),
            ("c".into(), f64::NAN, None),
        ]);
        assert_eq!(w.of("a"), WEIGHT_MAX);
        assert_eq!(w.of("b"), WEIGHT_MIN);
        assert_eq!(w.of("c"), 1.0);
    }
}
