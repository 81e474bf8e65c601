//! Any byte stream, cut anywhere, read as chat's, completions' or the Responses API's: the
//! reassembler never panics, passes bytes on without inventing any, and an answer it yields
//! replays into events that reassemble to the same answer.
#![no_main]

use holysheep_edge::core::api::endpoint::Endpoint;
use holysheep_edge::core::stream::{for_client, Reassembler};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&[which, split], bytes)) = data.split_first_chunk::<2>() else { return };
    let endpoint = [Endpoint::Chat, Endpoint::Completions, Endpoint::Responses][usize::from(which % 3)];
    let mut r = Reassembler::of(endpoint, true);
    let mut out = Vec::new();
    for piece in bytes.chunks(usize::from(split).max(1)) {
        out.extend(r.push(piece));
    }
    out.extend(r.flush());
    assert_eq!(out, bytes, "with the usage forwarded, every byte passes on unchanged");
    if let Some(answer) = r.completion() {
        let events = for_client(answer.clone(), endpoint, true, true);
        assert_ne!(events.body, answer.body, "an answer replays as events");
        let mut again = Reassembler::of(endpoint, true);
        again.push(&events.body);
        assert_eq!(again.completion().map(|c| c.body), Some(answer.body));
    }
});
