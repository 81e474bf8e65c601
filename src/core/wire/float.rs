//! Decimal text read as the nearest `f64` (ties to even), as `str::parse::<f64>` reads it,
//! without its 10 KB table of powers of five: a number of at most 19 significant digits
//! whose value and power of ten are exact in an `f64` is one correctly rounded
//! multiplication or division (Clinger's fast path: every number a client or an upstream
//! usually writes); any other is converted exactly, digit by digit, by shifting its
//! decimal digits by powers of two (the "simple decimal conversion" of Go's strconv and
//! Rust's own fallback).

/// Decimal digits kept of a long number; any beyond only say that it is not exact
/// (enough to round every `f64` correctly).
const MAX_DIGITS: usize = 768;
/// A decimal point this far out is zero or infinite.
const DECIMAL_POINT_RANGE: i32 = 2047;
/// The largest shift by a power of two at once (digits times `2^60` fit a `u64`).
const MAX_SHIFT: u32 = 60;
/// The biased exponent of an infinity.
const INFINITE_POWER: i32 = 0x7ff;
/// The exponent of the smallest normal `f64`, less one.
const MINIMUM_EXPONENT: i32 = -1023;
/// An exponent is read up to this: far past any `f64` even after the point moves by every
/// digit a body can hold, so the clamp never changes a value.
const MAX_EXPONENT: i64 = 1 << 40;
const EXACT_POWERS: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20,
    1e21, 1e22,
];

/// `text` as `[+-]digits[.digits][(e|E)[+-]digits]` (a digit on at least one side of the
/// point; a JSON number is one), as the nearest `f64`; infinite when it is out of range.
/// `None` for any other text.
pub fn parse(text: &str) -> Option<f64> {
    let b = text.as_bytes();
    let (negative, digits) = match b.first() {
        Some(b'-') => (true, b.get(1..)?),
        Some(b'+') => (false, b.get(1..)?),
        _ => (false, b),
    };
    let magnitude = magnitude(digits)?;
    Some(if negative { -magnitude } else { magnitude })
}

fn magnitude(b: &[u8]) -> Option<f64> {
    // One walk checks the grammar and reads up to 19 significant digits exactly.
    let (mut i, mut mantissa, mut significant, mut any) = (0, 0u64, 0usize, false);
    let mut exponent: i64 = 0;
    let mut point = false;
    while let Some(&c) = b.get(i) {
        match c {
            b'0'..=b'9' => {
                any = true;
                if significant > 0 || c != b'0' {
                    significant += 1;
                    if significant <= 19 {
                        mantissa = mantissa * 10 + u64::from(c - b'0');
                    }
                }
                if point {
                    exponent -= 1;
                } else if significant > 19 {
                    exponent += 1;
                }
            }
            b'.' if !point => point = true,
            _ => break,
        }
        i += 1;
    }
    if !any {
        return None;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        i += 1;
        let negative = b.get(i) == Some(&b'-');
        if matches!(b.get(i), Some(b'-' | b'+')) {
            i += 1;
        }
        let start = i;
        let mut e: i64 = 0;
        while let Some(&c @ b'0'..=b'9') = b.get(i) {
            e = (e * 10 + i64::from(c - b'0')).min(MAX_EXPONENT);
            i += 1;
        }
        if i == start {
            return None;
        }
        exponent += if negative { -e } else { e };
    }
    if i != b.len() {
        return None;
    }
    if mantissa == 0 {
        return Some(0.0);
    }
    if significant <= 19 && mantissa <= 1 << 53 {
        let power = usize::try_from(exponent.unsigned_abs()).ok().and_then(|e| EXACT_POWERS.get(e));
        if let Some(&power) = power {
            // Both exact: one correctly rounded operation.
            return Some(if exponent < 0 { mantissa as f64 / power } else { mantissa as f64 * power });
        }
    }
    Some(Decimal::read(b).into_f64())
}

/// A number as decimal digits: `0.d1d2d3... × 10^decimal_point`.
struct Decimal {
    digits: [u8; MAX_DIGITS],
    /// Digits held (`digits[..count]`), without trailing zeros.
    count: usize,
    decimal_point: i32,
    /// Nonzero digits were dropped past `MAX_DIGITS`.
    truncated: bool,
}

impl Decimal {
    /// The digits of text `parse` has checked (no sign).
    fn read(b: &[u8]) -> Decimal {
        let mut d = Decimal { digits: [0; MAX_DIGITS], count: 0, decimal_point: 0, truncated: false };
        let mut all = 0usize;
        let mut i = 0;
        let mut point = None;
        while let Some(&c) = b.get(i) {
            match c {
                b'0'..=b'9' => {
                    if all > 0 || c != b'0' {
                        if let Some(slot) = d.digits.get_mut(all) {
                            *slot = c - b'0';
                        } else if c != b'0' {
                            d.truncated = true;
                        }
                        all += 1;
                    } else if point.is_some() {
                        // A zero between the point and the first significant digit.
                        d.decimal_point -= 1;
                    }
                }
                b'.' => point = Some(all),
                _ => break,
            }
            i += 1;
        }
        d.decimal_point += point.unwrap_or(all) as i32;
        if let Some(b'e' | b'E') = b.get(i) {
            let rest = b.get(i + 1..).unwrap_or_default();
            let (negative, rest) = match rest.first() {
                Some(b'-') => (true, rest.get(1..).unwrap_or_default()),
                Some(b'+') => (false, rest.get(1..).unwrap_or_default()),
                _ => (false, rest),
            };
            let e = rest.iter().fold(0i64, |e, &c| (e * 10 + i64::from(c - b'0')).min(MAX_EXPONENT));
            let point = i64::from(d.decimal_point) + if negative { -e } else { e };
            d.decimal_point = point.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32;
        }
        d.count = all.min(MAX_DIGITS);
        d.trim();
        d
    }

    fn trim(&mut self) {
        while self.count > 0 && self.digits.get(self.count - 1) == Some(&0) {
            self.count -= 1;
        }
    }

    fn digit(&self, i: usize) -> u64 {
        self.digits.get(i).map_or(0, |&d| u64::from(d))
    }

    /// The value as the nearest `f64` (positive).
    fn into_f64(mut self) -> f64 {
        if self.count == 0 || self.decimal_point < -324 {
            return 0.0;
        }
        if self.decimal_point >= 310 {
            return f64::INFINITY;
        }
        let mut exp2: i32 = 0;
        // Into [1/2, 1): divide by powers of two while there are whole digits, multiply
        // while the first digit after the point is too small.
        while self.decimal_point > 0 {
            let shift = shift_for(self.decimal_point.unsigned_abs());
            self.right_shift(shift);
            if self.decimal_point < -DECIMAL_POINT_RANGE {
                return 0.0;
            }
            exp2 += shift as i32;
        }
        while self.decimal_point <= 0 {
            let shift = if self.decimal_point == 0 {
                match self.digit(0) {
                    5.. => break,
                    0 | 1 => 2,
                    _ => 1,
                }
            } else {
                shift_for(self.decimal_point.unsigned_abs())
            };
            self.left_shift(shift);
            if self.decimal_point > DECIMAL_POINT_RANGE {
                return f64::INFINITY;
            }
            exp2 -= shift as i32;
        }
        // Into [1, 2).
        exp2 -= 1;
        while MINIMUM_EXPONENT + 1 > exp2 {
            let n = ((MINIMUM_EXPONENT + 1 - exp2) as u32).min(MAX_SHIFT);
            self.right_shift(n);
            exp2 += n as i32;
        }
        if exp2 - MINIMUM_EXPONENT >= INFINITE_POWER {
            return f64::INFINITY;
        }
        // 53 bits of mantissa, rounded.
        self.left_shift(53);
        let mut mantissa = self.round();
        if mantissa >= 1 << 53 {
            self.right_shift(1);
            exp2 += 1;
            mantissa = self.round();
            if exp2 - MINIMUM_EXPONENT >= INFINITE_POWER {
                return f64::INFINITY;
            }
        }
        let mut power2 = exp2 - MINIMUM_EXPONENT;
        if mantissa < 1 << 52 {
            // A subnormal.
            power2 -= 1;
        }
        f64::from_bits((mantissa & ((1 << 52) - 1)) | ((power2 as u64) << 52))
    }

    /// The whole part, rounded half to even (the digits past the point decide).
    fn round(&self) -> u64 {
        if self.count == 0 || self.decimal_point < 0 {
            return 0;
        }
        if self.decimal_point > 18 {
            return u64::MAX;
        }
        let point = self.decimal_point as usize;
        let mut n = (0..point).fold(0u64, |n, i| n * 10 + if i < self.count { self.digit(i) } else { 0 });
        if point < self.count {
            let next = self.digit(point);
            let up = if next == 5 && point + 1 == self.count {
                self.truncated || (point > 0 && self.digit(point - 1) % 2 == 1)
            } else {
                next >= 5
            };
            n += u64::from(up);
        }
        n
    }

    /// Multiplies by `2^shift`.
    fn left_shift(&mut self, shift: u32) {
        if self.count == 0 {
            return;
        }
        // The product's digits, least significant first.
        let mut out = [0u8; MAX_DIGITS + 20];
        let (mut written, mut n) = (0, 0u64);
        for i in (0..self.count).rev() {
            n += self.digit(i) << shift;
            if let Some(slot) = out.get_mut(written) {
                *slot = (n % 10) as u8;
            }
            n /= 10;
            written += 1;
        }
        while n > 0 {
            if let Some(slot) = out.get_mut(written) {
                *slot = (n % 10) as u8;
            }
            n /= 10;
            written += 1;
        }
        let added = written - self.count;
        let kept = written.min(MAX_DIGITS);
        for (j, slot) in self.digits.iter_mut().take(kept).enumerate() {
            *slot = out.get(written - 1 - j).copied().unwrap_or(0);
        }
        if out.iter().take(written - kept).any(|&d| d != 0) {
            self.truncated = true;
        }
        self.count = kept;
        self.decimal_point += added as i32;
        self.trim();
    }

    /// Divides by `2^shift`.
    fn right_shift(&mut self, shift: u32) {
        let (mut read, mut written, mut n) = (0, 0, 0u64);
        while n >> shift == 0 {
            if read < self.count {
                n = 10 * n + self.digit(read);
                read += 1;
            } else if n == 0 {
                return;
            } else {
                while n >> shift == 0 {
                    n *= 10;
                    read += 1;
                }
                break;
            }
        }
        self.decimal_point -= read as i32 - 1;
        if self.decimal_point < -DECIMAL_POINT_RANGE {
            *self = Decimal { digits: [0; MAX_DIGITS], count: 0, decimal_point: 0, truncated: false };
            return;
        }
        let mask = (1u64 << shift) - 1;
        while read < self.count {
            let digit = (n >> shift) as u8;
            n = 10 * (n & mask) + self.digit(read);
            read += 1;
            if let Some(slot) = self.digits.get_mut(written) {
                *slot = digit;
            }
            written += 1;
        }
        while n > 0 {
            let digit = (n >> shift) as u8;
            n = 10 * (n & mask);
            if let Some(slot) = self.digits.get_mut(written) {
                *slot = digit;
                written += 1;
            } else if digit > 0 {
                self.truncated = true;
            }
        }
        self.count = written;
        self.trim();
    }
}

/// How far to shift a decimal point `n` places from where it belongs: the largest power
/// of two whose decimal digits number at most `n` (capped at `MAX_SHIFT`).
fn shift_for(n: u32) -> u32 {
    const POWERS: [u8; 19] = [0, 3, 6, 9, 13, 16, 19, 23, 26, 29, 33, 36, 39, 43, 46, 49, 53, 56, 59];
    POWERS.get(n as usize).map_or(MAX_SHIFT, |&p| u32::from(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agree(text: &str) {
        let ours = parse(text);
        let std = text.parse::<f64>().ok();
        assert_eq!(ours.map(f64::to_bits), std.map(f64::to_bits), "{text}: {ours:?} against {std:?}");
    }

    #[test]
    fn hard_cases_round_as_the_standard_reader_does() {
        for text in [
            "0",
            "-0",
            "0.0",
            "0e10",
            "1",
            "-1",
            "1.5",
            "0.1",
            "0.7",
            "1e23",
            "9007199254740993",
            "9007199254740992.5",
            "9007199254740993.0000000000000000000001",
            "2.2250738585072011e-308",
            "2.2250738585072012e-308",
            "2.2250738585072014e-308",
            "1.7976931348623157e308",
            "1.7976931348623158e308",
            "1.7976931348623159e308",
            "4.9e-324",
            "5e-324",
            "2.4703282292062327e-324",
            "2.4703282292062328e-324",
            "1e-400",
            "1e400",
            "1e-2000000",
            "1e2000000",
            "123456789012345678901234567890",
            "0.000000000000000000000000000001",
            "8.98846567431158e307",
            "1.00000000000000011102230246251565404236316680908203125",
            "1.00000000000000011102230246251565404236316680908203124",
            "1.00000000000000011102230246251565404236316680908203126",
            "7.2057594037927933e16",
            "3.4028235677973366e38",
            "+1",
            "1.",
            ".5",
            "-.5e1",
            "1E5",
            "1e+5",
            "00012.500",
            "1e22",
            "1e-22",
            "9007199254740993e22",
        ] {
            agree(text);
        }
        let long = format!("0.{}1", "0".repeat(800));
        agree(&long);
        agree(&format!("1{}", "0".repeat(320)));
        agree(&format!("{}e-700", "3".repeat(1000)));
        // A point moved by a million digits and then back by the exponent.
        let far = format!("0.{}1e1048600", "0".repeat(1 << 20));
        assert_eq!(parse(&far), Some(1e23));
        assert_eq!(parse(&format!("1{}e-1048600", "0".repeat(1 << 20))), parse("1e-24"));
    }

    #[test]
    fn what_is_no_number_is_refused() {
        for text in ["", "-", "+", ".", "e5", "1e", "1e+", "1.2.3", "1x", "inf", "NaN", "--1", "1 ", " 1", "0x10"] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn random_numbers_round_as_the_standard_reader_does() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            // Every f64, written shortest and at 17 and at 25 significant digits (near halfway).
            let x = f64::from_bits(next());
            if x.is_finite() {
                for text in [format!("{x}"), format!("{x:e}"), format!("{x:.16e}"), format!("{x:.24e}")] {
                    agree(&text);
                }
            }
            // Random digits with a random point and exponent.
            let digits: String = (0..1 + next() % 40).map(|_| char::from(b'0' + (next() % 10) as u8)).collect();
            let at = (next() as usize) % (digits.len() + 1);
            let exponent = (next() % 700) as i64 - 350;
            agree(&format!("{}.{}e{exponent}", &digits[..at], &digits[at..]).replace(".e", "e"));
            agree(&format!("{digits}e{exponent}"));
        }
    }
}
