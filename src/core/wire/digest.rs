//! SHA-256 of a whole message, the one digest the core takes (request keys, tenant keys).

use sha2::digest::generic_array::GenericArray;

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_INITIAL: [u32; 8] =
    [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

/// SHA-256 of a whole message: padded here (FIPS 180-4, 5.1.1), its blocks compressed by
/// sha2's block function. `Sha256`'s streaming buffer is generic code, compiled into this
/// crate rather than with sha2's `opt-level = 3`; it cost a MISS thousands of operators.
/// (`from_slice` cannot fail: `chunks_exact(64)` yields 64 bytes.)
pub fn sha256(mut message: Vec<u8>) -> [u8; 32] {
    let bits = (message.len() as u64).wrapping_mul(8);
    message.push(0x80);
    let padded = (message.len() + 8).next_multiple_of(64);
    message.resize(padded - 8, 0);
    message.extend_from_slice(&bits.to_be_bytes());
    let mut state = SHA256_INITIAL;
    for block in message.chunks_exact(64) {
        sha2::compress256(&mut state, std::slice::from_ref(GenericArray::from_slice(block)));
    }
    let mut digest = [0; 32];
    for (out, word) in digest.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    digest
}
