//! Message rates (§7 "Rates"): `[stage-NAME] RATE` and the per-tenant rates of
//! `pepsi.fair_weights`, written `N/s`, `N/min` or `N/h` (also `second`, `minute`,
//! `hour`), N a plain decimal number. Pure: [`parse`] gives messages per second, and
//! [`show`] writes a rate back in the unit it reads best in. Used by the stage
//! section's check (`graph.rs`) and by `pepsi-settings rate`.

/// The least rate: one message an hour.
pub const RATE_MIN: f64 = 1.0 / 3600.0;
/// The greatest rate: a million messages a second.
pub const RATE_MAX: f64 = 1_000_000.0;

/// A rate as messages per second, or why the text is none.
pub fn parse(text: &str) -> Result<f64, String> {
    let Some((count, unit)) = text.trim().split_once('/') else {
        return Err(format!(
            "{text:?} is not a rate: write N/s, N/min or N/h (say 10/s)"
        ));
    };
    let (count, unit) = (count.trim(), unit.trim());
    let seconds = match unit {
        "s" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hour" => 3600.0,
        _ => {
            return Err(format!(
                "{text:?}: the unit {unit:?} is none of s, min and h"
            ));
        }
    };
    let plain = !count.is_empty()
        && count.len() <= 20
        && count.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let n: f64 = match count.parse() {
        Ok(n) if plain => n,
        _ => return Err(format!("{text:?}: {count:?} is not a plain decimal number")),
    };
    let per_second = n / seconds;
    if !(RATE_MIN..=RATE_MAX).contains(&per_second) {
        return Err(format!("{text:?} is outside 1/h to 1000000/s"));
    }
    Ok(per_second)
}

/// A rate in messages per second as `parse` reads it: per second from 1/s up, else per
/// minute from 1/min up, else per hour.
pub fn show(per_second: f64) -> String {
    let trim = |x: f64| {
        let text = format!("{x:.3}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    if per_second >= 1.0 {
        format!("{}/s", trim(per_second))
    } else if per_second * 60.0 >= 1.0 {
        format!("{}/min", trim(per_second * 60.0))
    } else {
        format!("{}/h", trim(per_second * 3600.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_per_second_minute_or_hour() {
        assert_eq!(parse("10/s"), Ok(10.0));
        assert_eq!(parse(" 10 / second "), Ok(10.0));
        assert_eq!(parse("120/min"), Ok(2.0));
        assert_eq!(parse("3600/h"), Ok(1.0));
        assert_eq!(parse("0.5/s"), Ok(0.5));
        assert_eq!(parse("1/h"), Ok(1.0 / 3600.0));
        for bad in [
            "10",
            "10/d",
            "/s",
            "-1/s",
            "0/s",
            "1e3/s",
            "NaN/s",
            "inf/s",
            "0.5/h",
            "2000000/s",
            "10/s/s",
            "½/s",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_rate_is_shown_in_the_unit_it_reads_best_in_and_reads_back() {
        assert_eq!(show(10.0), "10/s");
        assert_eq!(show(2.5), "2.5/s");
        assert_eq!(show(0.5), "30/min");
        assert_eq!(show(1.0 / 3600.0), "1/h");
        for r in ["10/s", "30/min", "1/h", "2.5/s"] {
            assert_eq!(show(parse(r).unwrap()), r);
        }
    }
}
