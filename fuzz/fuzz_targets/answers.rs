//! Any answer from HolySheep to any endpoint (embeddings and Responses among them), with
//! any status and content type: reading it never panics; HolySheep's JSON error is the only
//! answer read as billed nothing (and Envoy's own 503, through Envoy, as never sent); a
//! Responses answer signed for a tenant verifies for that tenant only.
#![no_main]

use holysheep_edge::core::api::endpoint;
use holysheep_edge::core::api::objects::{ObjectKey, Signer};
use holysheep_edge::core::api::usage::{self, Billed};
use holysheep_edge::core::upstream::{self, Sent};
use libfuzzer_sys::fuzz_target;

const TYPES: [&str; 5] =
    ["application/json", "text/event-stream", "text/html", "application/json; charset=utf-8", "text/plain"];
const STATUSES: [u16; 8] = [200, 400, 401, 404, 429, 500, 502, 503];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let Some((&how, body)) = rest.split_first() else { return };
    let status = STATUSES[usize::from(pick) % STATUSES.len()];
    let content_type = TYPES[usize::from(pick >> 3) % TYPES.len()];
    let (endpoint, stream, envoy) = (endpoint::ALL[usize::from(pick >> 5) % 4], pick & 0x80 != 0, how & 1 != 0);
    let sent = Sent { endpoint, stream, operator_key: true, envoy };
    let mut headers =
        vec![("content-type".to_owned(), content_type.to_owned()), ("retry-after".to_owned(), "1".to_owned())];
    let timed = how & 4 != 0;
    if how & 2 != 0 {
        headers.push(("x-envoy-overloaded".to_owned(), "true".to_owned()));
    }
    if timed {
        headers.push(("x-envoy-upstream-service-time".to_owned(), "7".to_owned()));
    }
    let (answer, hints) = upstream::response(status, &headers, body.to_vec(), sent);
    assert!(answer.status >= 200, "an answer without a status");
    if hints.billed == Billed::Nothing {
        assert_ne!(status, 200, "a 200 billed nothing");
    }
    if hints.billed == Billed::Unsent {
        assert!(envoy && !timed && status == 503, "only Envoy's own 503 says a request never left");
        assert_eq!(usage::of_answer(body), None, "an answer with usage was billed it");
    }
    let _ = usage::of_answer(body);
    // Any answer is signed without panicking; a Responses answer with an id as HolySheep
    // makes them (`resp_` and letters or digits) has it signed for its tenant alone.
    let signer = Signer { key: ObjectKey::of_operator_key("sk-fuzz"), tenant: "alpha".into() };
    let _ = signer.sign_answer(body);
    let id: String = std::iter::once("resp_".to_owned())
        .chain(body.iter().filter(|b| b.is_ascii_alphanumeric()).take(40).map(|b| char::from(*b).to_string()))
        .collect();
    let text = String::from_utf8_lossy(body);
    let answer = serde_json::json!({"id": id, "object": "response", "output_text": text, "status": "completed"});
    let Some(signed) = signer.sign_answer(answer.to_string().as_bytes()) else { panic!("a response not signed") };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&signed) else { panic!("a signed answer is no longer JSON") };
    let signed_id = v["id"].as_str().unwrap_or_default();
    assert_eq!(signer.key.verify("alpha", signed_id), Some(id.as_str()), "its id does not verify for its tenant");
    assert!(signer.key.verify("beta", signed_id).is_none(), "its id verifies for another tenant");
});
