//! SHA-256 of a whole message, the one digest the core takes (request keys, tenant keys),
//! and HMAC-SHA256 on it (the ids the edge signs for a tenant).

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

/// HMAC-SHA256 (RFC 2104) of `message` under `key`.
pub(crate) fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&sha256(key.to_vec()));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let mut inner = pad(0x36);
    inner.extend_from_slice(message);
    let mut outer = pad(0x5c);
    outer.extend_from_slice(&sha256(inner));
    sha256(outer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: [u8; 32]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 1 and 2 of RFC 4231.
        assert_eq!(
            hex(hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than a block is hashed first.
        assert_eq!(
            hex(hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }
}
