//! Any byte stream, cut anywhere: the reassembler never panics, passes bytes on without
//! inventing any, and a completion it yields replays into events that reassemble to the
//! same completion.
#![no_main]

use holysheep_edge::core::stream::{replay, Reassembler};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else { return };
    let mut r = Reassembler::new(true);
    let mut out = Vec::new();
    for piece in bytes.chunks(usize::from(split).max(1)) {
        out.extend(r.push(piece));
    }
    out.extend(r.flush());
    assert_eq!(out, bytes, "with the usage forwarded, every byte passes on unchanged");
    if let Some(completion) = r.completion() {
        let events = replay(&completion.body, true).expect("a completion replays");
        let mut again = Reassembler::new(true);
        again.push(&events);
        assert_eq!(again.completion().map(|c| c.body), Some(completion.body));
    }
});
