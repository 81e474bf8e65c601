//! Byte comparison eight bytes at a time. In wasm, `==` on slices calls the C library's
//! `memcmp`, which wasi-libc compiles to a loop over single bytes: equal 64-digit keys and
//! whole request bodies are compared on every request, so the word-wise loop pays.

/// Whether `a` and `b` hold the same bytes.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, b_words) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_equal = a_words.remainder() == b_words.remainder();
    tails_equal && a_words.zip(b_words).all(|(x, y)| word(x) == word(y))
}

fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(bytes);
    u64::from_ne_bytes(w)
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
