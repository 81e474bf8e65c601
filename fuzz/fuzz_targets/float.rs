//! Any text read as a number: the edge's reader agrees bit for bit with the standard
//! library's on every text both read, and refuses only what is no decimal number (the
//! standard reader's `inf` and `NaN` words).
#![no_main]

use holysheep_edge::core::wire::float;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let ours = float::parse(text);
    let std = text.parse::<f64>().ok();
    match (ours, std) {
        (Some(x), Some(y)) => assert_eq!(x.to_bits(), y.to_bits(), "{text:?}"),
        (None, Some(_)) => assert!(text.bytes().any(|b| b.is_ascii_alphabetic() && !matches!(b, b'e' | b'E')), "{text:?}"),
        (Some(x), None) => panic!("{text:?} read as {x}, refused by the standard reader"),
        (None, None) => {}
    }
});
