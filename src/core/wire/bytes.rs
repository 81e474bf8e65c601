//! Byte comparison eight bytes at a time. In wasm, `==` on slices calls the C library's
//! `memcmp`, which wasi-libc compiles to a loop over single bytes: equal 64-digit keys and
//! whole request bodies are compared on every request, so the word-wise loop pays.

/// Whether `a` and `b` hold the same bytes.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, b_words) = (a.chunks_exact(8), b.chunks_exact(8));
    tail(a_words.remainder()) == tail(b_words.remainder()) && a_words.zip(b_words).all(|(x, y)| word(x) == word(y))
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
    use super::same;

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
