//! Decimals written from whole numbers of their smallest unit (micro-dollars, ten-thousandths
//! of a similarity), so that no float formatting with a precision is compiled in.

/// `units` of `10^-places`, rounded half up to `shown` places (`shown <= places`):
/// `fixed(1_234_567, 6, 2)` is `"1.23"`.
pub(crate) fn fixed(units: u64, places: u32, shown: u32) -> String {
    let drop = 10u64.pow(places.saturating_sub(shown));
    let rounded = units / drop + u64::from(units % drop >= drop.div_ceil(2) && drop > 1);
    let scale = 10u64.pow(shown.min(places));
    if shown == 0 {
        return rounded.to_string();
    }
    format!("{}.{:0width$}", rounded / scale, rounded % scale, width = shown as usize)
}

/// A similarity (a cosine, -1 to 1) with four places.
pub(crate) fn similarity(value: f32) -> String {
    let units = (f64::from(value).abs() * 10_000.0).round() as u64;
    let sign = if value < 0.0 && units > 0 { "-" } else { "" };
    format!("{sign}{}", fixed(units, 4, 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_units_are_written_as_decimals_rounded_half_up() {
        assert_eq!(fixed(1_234_567, 6, 2), "1.23");
        assert_eq!(fixed(1_235_000, 6, 2), "1.24");
        assert_eq!(fixed(999_999, 6, 2), "1.00");
        assert_eq!(fixed(5_000, 6, 2), "0.01");
        assert_eq!(fixed(4_999, 6, 2), "0.00");
        assert_eq!(fixed(1_000_000_000_000, 6, 2), "1000000.00");
        assert_eq!(fixed(7, 0, 0), "7");
        for v in [0.93126_f32, 0.9, 1.0, 0.12346, 0.0] {
            assert_eq!(similarity(v), format!("{v:.4}"), "{v}");
        }
        assert_eq!(similarity(-0.5), "-0.5000");
    }
}
