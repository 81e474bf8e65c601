//! A spend record's text: decimal numbers and the separators between them, read and
//! written without formatting machinery (a budgeted call reads and writes its tenant's
//! record twice).

use crate::core::wire::codec;

/// Exactly `N` decimal numbers, `sep` between them.
pub(super) fn numbers<const N: usize>(text: &[u8], sep: u8) -> Option<[u64; N]> {
    let mut out = [0; N];
    (read_numbers(text, sep, &mut out)? == N).then_some(out)
}

/// Decimal numbers (as `codec::number` reads each) with `sep` between them into `out`, in
/// one pass over the bytes; how many, `None` for more than `out` holds or any other byte.
pub(super) fn read_numbers(text: &[u8], sep: u8, out: &mut [u64]) -> Option<usize> {
    let (mut at, mut digits) = (0, 0);
    for &b in text {
        if b == sep {
            if digits == 0 {
                return None;
            }
            (at, digits) = (at + 1, 0);
            continue;
        }
        let (d, n) = (u64::from(b.wrapping_sub(b'0')), out.get_mut(at)?);
        if d > 9 {
            return None;
        }
        // Nineteen digits cannot overflow; only past them is each step checked (a branch,
        // so that the division is not made for every digit).
        if digits < 19 {
            *n = *n * 10 + d;
        } else {
            *n = n.checked_mul(10)?.checked_add(d)?;
            if digits >= 20 {
                return None;
            }
        }
        digits += 1;
    }
    (digits > 0).then_some(at + 1)
}

/// A record's text as it is written: decimal numbers and their separators.
pub(super) struct Record(pub(super) Vec<u8>);

impl Record {
    pub(super) fn with_capacity(bytes: usize) -> Record {
        Record(Vec::with_capacity(bytes))
    }

    /// `numbers` in decimal, `sep` between them.
    pub(super) fn numbers(&mut self, sep: u8, numbers: &[u64]) {
        for (i, n) in numbers.iter().enumerate() {
            if i > 0 {
                self.0.push(sep);
            }
            self.0.extend_from_slice(codec::decimal(*n).as_bytes());
        }
    }

    /// The entries' list: each `mark` and its numbers joined by `:`, entries by `,`.
    pub(super) fn list(&mut self) -> Entries<'_> {
        Entries { out: self, first: true }
    }
}

/// A record's list of entries, being written.
pub(super) struct Entries<'a> {
    out: &'a mut Record,
    first: bool,
}

impl Entries<'_> {
    /// One entry: `mark`, then `numbers` joined by `:`.
    pub(super) fn entry(&mut self, mark: &str, numbers: &[u64]) {
        self.separate();
        self.out.0.extend_from_slice(mark.as_bytes());
        self.out.numbers(b':', numbers);
    }

    /// Entries already written as text (`,` between them), as they are.
    pub(super) fn text(&mut self, entries: &[u8]) {
        if !entries.is_empty() {
            self.separate();
            self.out.0.extend_from_slice(entries);
        }
    }

    fn separate(&mut self) {
        if !std::mem::replace(&mut self.first, false) {
            self.out.0.push(b',');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_records_numbers_read_as_codec_reads_each() {
        for one in [
            "0",
            "7",
            "007",
            "1844674407370955161",
            "18446744073709551615",
            "18446744073709551616",
            "28446744073709551615",
            "99999999999999999999",
            "000000000000000000001",
            "0000000000000000000001",
            "",
            "+1",
            "-1",
            "1x",
            " 1",
            "1.0",
        ] {
            assert_eq!(numbers::<1>(one.as_bytes(), b' ').map(|[n]| n), codec::number(one), "{one:?}");
        }
        assert_eq!(numbers::<3>(b"1 22 333", b' '), Some([1, 22, 333]));
        for bad in ["1 22", "1 22 333 4", "1  22 333", " 1 22 333", "1 22 333 ", "1:22:333"] {
            assert_eq!(numbers::<3>(bad.as_bytes(), b' '), None, "{bad:?}");
        }
    }

    #[test]
    fn entries_are_joined_by_commas_whatever_wrote_them() {
        let mut r = Record::with_capacity(16);
        let mut list = r.list();
        list.text(b"");
        list.entry("~a", &[1, 2]);
        list.text(b"3:4,5:6");
        list.entry("", &[7]);
        assert_eq!(r.0, b"~a1:2,3:4,5:6,7");
    }
}
