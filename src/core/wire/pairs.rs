//! proxy-wasm's serialized header map: a little-endian `u32` count, then a `u32` name
//! length and a `u32` value length per pair, then each name and each value followed by a
//! NUL. Read in place: the pairs borrow the buffer, and nothing malformed panics. Written
//! into one buffer of the exact size.

/// The pairs of `bytes`, borrowed; `None` when the buffer does not hold what its lengths say.
pub fn parse(bytes: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let count = usize::try_from(u32_at(bytes, 0)?).ok()?;
    let mut data = count.checked_mul(8)?.checked_add(4)?;
    let mut pairs = Vec::with_capacity(count.min(bytes.len() / 10));
    for i in 0..count {
        let name_len = usize::try_from(u32_at(bytes, 4 + i * 8)?).ok()?;
        let value_len = usize::try_from(u32_at(bytes, 8 + i * 8)?).ok()?;
        let name = bytes.get(data..data.checked_add(name_len)?)?;
        data += name_len + 1;
        let value = bytes.get(data..data.checked_add(value_len)?)?;
        data += value_len + 1;
        pairs.push((name, value));
    }
    Some(pairs)
}

/// The serialized map of `pairs` (walked twice: sizes, then bytes), in one allocation.
pub fn serialize<'a, N, V>(pairs: impl Iterator<Item = (&'a N, &'a V)> + Clone) -> Vec<u8>
where
    N: AsRef<[u8]> + ?Sized + 'a,
    V: AsRef<[u8]> + ?Sized + 'a,
{
    let (mut count, mut data) = (0usize, 0usize);
    for (n, v) in pairs.clone() {
        count += 1;
        data += n.as_ref().len() + v.as_ref().len() + 2;
    }
    let mut out = Vec::with_capacity(4 + count * 8 + data);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for (n, v) in pairs.clone() {
        out.extend_from_slice(&(n.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let word: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serialize_all(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        serialize(pairs.iter().map(|(n, v)| (*n, *v)))
    }

    #[test]
    fn writes_the_hosts_layout() {
        let raw = serialize([("age", "7"), ("x-a", "")].into_iter());
        let mut expected = vec![2, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0];
        expected.extend(b"age\x007\x00x-a\x00\x00");
        assert_eq!(raw, expected);
        assert_eq!(raw.capacity(), raw.len());
        assert_eq!(serialize(std::iter::empty::<(&str, &str)>()), vec![0, 0, 0, 0]);
    }

    #[test]
    fn reads_what_the_host_writes_and_refuses_what_it_cannot_hold() {
        let raw = serialize_all(&[(":path", b"/v1/chat/completions"), ("authorization", b"Bearer \xff"), ("x-e", b"")]);
        let pairs = parse(&raw).unwrap();
        assert_eq!(pairs.len(), 3);
        assert_eq!(pairs[0], (&b":path"[..], &b"/v1/chat/completions"[..]));
        assert_eq!(pairs[1].1, b"Bearer \xff");
        assert_eq!(pairs[2], (&b"x-e"[..], &b""[..]));
        assert_eq!(parse(&[]).unwrap(), vec![]);
        for cut in 1..raw.len() - 1 {
            assert!(parse(&raw[..cut]).is_none(), "a map cut at {cut} bytes is refused");
        }
        let mut huge = raw.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse(&huge).is_none());
    }
}
