//! Byte comparison and search eight bytes at a time. In wasm, `==` on slices calls the C
//! library's `memcmp`, which wasi-libc compiles to a loop over single bytes: equal 64-digit
//! keys and whole request bodies are compared on every request, so the word-wise loop pays.
//! A search by `position` is a loop over single bytes too.

/// Whether `a` and `b` hold the same bytes.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, b_words) = (a.chunks_exact(8), b.chunks_exact(8));
    tail(a_words.remainder()) == tail(b_words.remainder()) && a_words.zip(b_words).all(|(x, y)| word(x) == word(y))
}

/// Where `b` first is in `bytes`.
pub(crate) fn find(bytes: &[u8], b: u8) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let pattern = ONES * u64::from(b);
    let words = bytes.chunks_exact(8);
    let rest = words.remainder();
    for (i, w) in words.enumerate() {
        // A byte equal to `b` is a zero byte of `x`; the lowest one found is exact.
        let x = u64::from_le_bytes(w.try_into().unwrap_or([0; 8])) ^ pattern;
        let zeros = x.wrapping_sub(ONES) & !x & HIGHS;
        if zeros != 0 {
            return Some(i * 8 + (zeros.trailing_zeros() / 8) as usize);
        }
    }
    let done = bytes.len() - rest.len();
    rest.iter().position(|&c| c == b).map(|at| done + at)
}

/// Eight bytes as one word.
fn word(bytes: &[u8]) -> u64 {
    u64::from_ne_bytes(bytes.try_into().unwrap_or([0; 8]))
}

/// The last bytes (fewer than eight) as one word, padded alike for slices of one length.
fn tail(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0, |w, &b| (w << 8) | u64::from(b))
}

#[cfg(test)]
mod tests {
    use super::{find, same};

    #[test]
    fn finds_what_position_finds() {
        let text: Vec<u8> = (0..100usize).map(|i| b"0123456789:,"[i * 7 % 12]).collect();
        for len in [0, 1, 7, 8, 9, 15, 16, 17, 64, 100] {
            for start in [0, 1, 3, 8] {
                let s = text.get(start..len.max(start)).unwrap();
                for b in [b',', b':', b'0', b'9', b'|', 0x80, 0xff, 0] {
                    assert_eq!(find(s, b), s.iter().position(|&c| c == b), "{b} in {s:?}");
                }
            }
        }
        assert_eq!(find(&[0x81, 0x80, 0x2c], 0x2c), Some(2), "high bytes are no match");
        assert_eq!(find(&[0x2d, 0x2c, 0x2c, 0, 1, 2, 3, 4, 5], 0x2c), Some(1));
    }

    #[test]
    fn agrees_with_slice_equality() {
        let base: Vec<u8> = (0..=200u8).collect();
        for len in [0, 1, 7, 8, 9, 16, 63, 64, 65, 200] {
            let a = &base[..len];
            assert!(same(a, a));
            assert!(!same(a, &base[..len + 1]), "lengths differ");
            for at in 0..len {
                let mut b = a.to_vec();
                b[at] ^= 1;
                assert!(!same(a, &b), "differs at {at} of {len}");
            }
        }
    }
}
