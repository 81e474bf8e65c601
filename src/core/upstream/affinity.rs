//! HolySheep's prompt cache, kept warm: the `prompt_cache_key` a call carries to HolySheep.
//!
//! - A call without one, on a model or by a tenant with `prompt_cache_affinity`, gets one:
//!   a digest of its tenant, its model and its stable prefix (a chat's leading system and
//!   developer messages and its tools; a Responses call's instructions, tools and leading
//!   system and developer input items). Calls that share that prefix then share a key, and
//!   HolySheep looks for the prefix where it served it before. A call with no stable prefix
//!   gets none.
//! - A verified tenant's own key is kept, scoped to the tenant (a digest of both): two
//!   tenants under the operator's one account never share a key.
//!
//! The key does not change the answer: the edge's own cache key leaves it out
//! (`request::canonical`).

use crate::core::api::endpoint::Endpoint;
use crate::core::request::canonical::canonical_body;
use crate::core::wire::digest::sha256;
use crate::core::wire::{json, scan, write};
use serde_json::{Map, Value};

const FIELD: &str = "prompt_cache_key";
/// Hex digits of a key the edge makes (128 bits).
const DIGITS: usize = 32;

/// What became of a call's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keyed {
    /// Sent as it came.
    Unchanged,
    /// The edge set the key (`affinity` on, the call carried none).
    Set(Vec<u8>),
    /// The tenant's own key, scoped to the tenant.
    Scoped(Vec<u8>),
}

/// The body of a call on `model` to `endpoint` in the tenant scope `tenant` (the verified
/// tenant, else the trusted tenant header's value), with the `prompt_cache_key` it goes
/// with (`on`: affinity is turned on for it). Only the key's member changes: the rest of
/// the body goes byte for byte as it came (the order of a schema's properties is the
/// order a structured answer is written in).
pub fn keyed(body: &[u8], endpoint: Endpoint, model: &str, tenant: Option<&str>, on: bool) -> Keyed {
    if !matches!(endpoint, Endpoint::Chat | Endpoint::Responses) || (!on && tenant.is_none()) {
        return Keyed::Unchanged;
    }
    // The member as the intake read it (a name spelled with escapes among them); a body
    // that names it twice never gets here (the intake refuses a repeated member).
    let Some([own]) = scan::read_fields(body, [FIELD]) else { return Keyed::Unchanged };
    match own {
        Some(raw) => {
            let Some(tenant) = tenant else { return Keyed::Unchanged };
            // Any value, a string or not, becomes the tenant's own string.
            let scoped = digest(&[b"tenant-key", tenant.as_bytes(), raw.text().as_bytes()]);
            spliced(body, raw.text(), &scoped).map_or(Keyed::Unchanged, Keyed::Scoped)
        }
        None if !on => Keyed::Unchanged,
        None => {
            let Some(Value::Object(map)) = json::parse(body) else { return Keyed::Unchanged };
            let Some(prefix) = stable_prefix(&map, endpoint) else { return Keyed::Unchanged };
            let key = digest(&[b"prefix", tenant.unwrap_or_default().as_bytes(), model.as_bytes(), &prefix]);
            first_member(body, &key).map_or(Keyed::Unchanged, Keyed::Set)
        }
    }
}

/// `body` with `value` (a slice of it) replaced by the JSON string `key`.
fn spliced(body: &[u8], value: &str, key: &str) -> Option<Vec<u8>> {
    let start = (value.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(value.len()).filter(|end| *end <= body.len())?;
    let mut out = Vec::with_capacity(body.len() + key.len());
    out.extend_from_slice(&body[..start]);
    write::string_into(key, &mut out);
    out.extend_from_slice(&body[end..]);
    Some(out)
}

/// `body` (an object) with `"prompt_cache_key":"<key>"` as its first member.
fn first_member(body: &[u8], key: &str) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace()).filter(|&i| body[i] == b'{')?;
    let next = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace())?;
    let mut out = Vec::with_capacity(body.len() + key.len() + FIELD.len() + 6);
    out.extend_from_slice(&body[..=open]);
    write::string_into(FIELD, &mut out);
    out.push(b':');
    write::string_into(key, &mut out);
    if *next != b'}' {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}

/// `hs-` and the digest of `parts` (each length-prefixed).
fn digest(parts: &[&[u8]]) -> String {
    let mut message = Vec::new();
    for part in parts {
        message.extend_from_slice(&(part.len() as u64).to_be_bytes());
        message.extend_from_slice(part);
    }
    let hex: String = sha256(message).iter().map(|b| format!("{b:02x}")).collect();
    format!("hs-{}", &hex[..DIGITS])
}

/// The canonical bytes of what every call that shares a prefix sends first: `None` when
/// there is nothing stable to share.
fn stable_prefix(map: &Map<String, Value>, endpoint: Endpoint) -> Option<Vec<u8>> {
    let leading = |items: Option<&Value>| -> Vec<Value> {
        let items = items.and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        let stable = |m: &&Value| matches!(m.get("role").and_then(Value::as_str), Some("system" | "developer"));
        items.iter().take_while(stable).cloned().collect()
    };
    let mut prefix = Map::new();
    let messages = match endpoint {
        Endpoint::Responses => {
            if let Some(instructions) = map.get("instructions").filter(|v| !v.is_null()) {
                prefix.insert("instructions".to_owned(), instructions.clone());
            }
            leading(map.get("input"))
        }
        _ => leading(map.get("messages")),
    };
    if !messages.is_empty() {
        prefix.insert("leading".to_owned(), Value::Array(messages));
    }
    if let Some(tools) = map.get("tools").filter(|t| t.as_array().is_some_and(|t| !t.is_empty())) {
        prefix.insert("tools".to_owned(), tools.clone());
    }
    (!prefix.is_empty()).then(|| canonical_body(prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(system: &str, question: &str, extra: &str) -> Vec<u8> {
        format!(
            r#"{{"model":"gpt-4.1","messages":[{{"role":"system","content":"{system}"}},
                {{"role":"user","content":"{question}"}}]{extra}}}"#
        )
        .into_bytes()
    }

    fn key(keyed: &Keyed) -> String {
        let (Keyed::Set(body) | Keyed::Scoped(body)) = keyed else { panic!("{keyed:?}") };
        let v: Value = serde_json::from_slice(body).expect("the body stays JSON");
        v[FIELD].as_str().unwrap().to_owned()
    }

    #[test]
    fn calls_that_share_a_prefix_share_a_key_and_no_two_tenants_do() {
        let on = |body: &[u8], tenant| keyed(body, Endpoint::Chat, "gpt-4.1", tenant, true);
        let a = key(&on(&chat("You are terse.", "first question", ""), Some("a")));
        assert_eq!(a, key(&on(&chat("You are terse.", "another question", ""), Some("a"))), "same prefix");
        assert!(a.starts_with("hs-") && a.len() == 3 + DIGITS, "{a}");
        assert_ne!(a, key(&on(&chat("You are terse.", "first question", ""), Some("b"))), "another tenant");
        assert_ne!(a, key(&on(&chat("You are verbose.", "first question", ""), Some("a"))), "another prefix");
        let tools = r#","tools":[{"type":"function","function":{"name":"f"}}]"#;
        assert_ne!(a, key(&on(&chat("You are terse.", "first question", tools), Some("a"))), "tools are prefix");
        // Off, or nothing stable to share: as it came.
        let plain = chat("You are terse.", "q", "");
        assert_eq!(keyed(&plain, Endpoint::Chat, "gpt-4.1", Some("a"), false), Keyed::Unchanged);
        let bare = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(on(bare, Some("a")), Keyed::Unchanged);
        assert_eq!(keyed(&plain, Endpoint::Embeddings, "gpt-4.1", Some("a"), true), Keyed::Unchanged);
    }

    #[test]
    fn only_the_keys_member_changes_and_an_escaped_name_is_the_same_name() {
        let body = br#"{"model":"gpt-4.1","response_format":{"type":"json_schema","json_schema":{"schema":
            {"properties":{"reasoning":{"type":"string"},"answer":{"type":"string"}}}}},
            "messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#;
        let Keyed::Set(set) = keyed(body, Endpoint::Chat, "gpt-4.1", Some("a"), true) else { panic!("set") };
        let text = String::from_utf8(set).unwrap();
        let k = text.find("hs-").unwrap();
        assert_eq!(
            text.replacen(&format!(r#""prompt_cache_key":"{}","#, &text[k..k + 3 + DIGITS]), "", 1).as_bytes(),
            body
        );
        let escaped = br#"{"model":"gpt-4.1","prompt_cache_ke\u0079":"x","messages":[{"role":"user","content":"q"}]}"#;
        let Keyed::Scoped(out) = keyed(escaped, Endpoint::Chat, "gpt-4.1", Some("a"), false) else { panic!("scoped") };
        assert!(!String::from_utf8(out).unwrap().contains(r#":"x""#), "the tenant's key does not go as it came");
        let number = br#"{"model":"gpt-4.1","prompt_cache_key":7,"messages":[]}"#;
        assert!(matches!(keyed(number, Endpoint::Chat, "gpt-4.1", Some("a"), false), Keyed::Scoped(_)));
    }

    #[test]
    fn a_tenants_own_key_is_scoped_to_it_and_kept_without_tenants() {
        let own = chat("s", "q", r#","prompt_cache_key":"shared-by-all""#);
        let scoped = |tenant| key(&keyed(&own, Endpoint::Chat, "gpt-4.1", Some(tenant), false));
        assert_ne!(scoped("a"), scoped("b"));
        assert_eq!(scoped("a"), scoped("a"));
        assert_eq!(keyed(&own, Endpoint::Chat, "gpt-4.1", None, true), Keyed::Unchanged, "no tenants: its own");
    }

    #[test]
    fn a_responses_calls_prefix_is_its_instructions_tools_and_leading_items() {
        let body = |instructions: &str, question: &str| {
            format!(
                r#"{{"model":"gpt-4.1","instructions":"{instructions}","input":[{{"role":"developer","content":"d"}},
                    {{"role":"user","content":"{question}"}}],"store":false}}"#
            )
            .into_bytes()
        };
        let on = |b: &[u8]| key(&keyed(b, Endpoint::Responses, "gpt-4.1", Some("t"), true));
        assert_eq!(on(&body("Be brief.", "one")), on(&body("Be brief.", "two")));
        assert_ne!(on(&body("Be brief.", "one")), on(&body("Be long.", "one")));
        let text_input = br#"{"model":"gpt-4.1","input":"just text"}"#;
        assert_eq!(keyed(text_input, Endpoint::Responses, "gpt-4.1", Some("t"), true), Keyed::Unchanged);
    }
}
