//! Stored responses stay with the tenant that made them. HolySheep keeps every tenant's
//! stored responses in the operator's one account, so its ids alone would let any tenant
//! continue (read and spend on) another's. The edge hands a verified tenant each response
//! id signed for it (`resp_abc` becomes `resp_abc_hs<16 hex>`, an HMAC-SHA256 of the
//! tenant and the id under a key derived from the operator's API key), and takes back only
//! ids signed for the tenant that sends them: it strips the signature before the call, and
//! answers any other id 404 as HolySheep does for one that does not exist, with no call.
//! Nothing is stored: the ids hold across workers, nodes and restarts, as long as the
//! operator's key does.

use crate::core::api::error::ApiError;
use crate::core::wire::digest::{hmac_sha256, sha256};
use crate::core::wire::scan;
use crate::core::wire::write;

/// What joins an id and its signature.
const MARK: &str = "_hs";
/// Hex digits of the signature (64 bits).
const SIGNATURE_HEX: usize = 16;

/// The key ids are signed with. Never printed.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct ObjectKey([u8; 32]);

impl std::fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectKey(..)")
    }
}

impl ObjectKey {
    /// The key derived from the operator's API key (not the key itself, which then signs
    /// nothing a client sees).
    pub fn of_operator_key(api_key: &str) -> ObjectKey {
        let mut m = b"holysheep-edge object ids\0".to_vec();
        m.extend_from_slice(api_key.as_bytes());
        ObjectKey(sha256(m))
    }

    fn signature(&self, tenant: &str, id: &str) -> String {
        let mut m = Vec::with_capacity(tenant.len() + id.len() + 1);
        m.extend_from_slice(tenant.as_bytes());
        m.push(0);
        m.extend_from_slice(id.as_bytes());
        hmac_sha256(&self.0, &m)[..SIGNATURE_HEX / 2].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `id` as `tenant` sees it.
    pub(crate) fn sign(&self, tenant: &str, id: &str) -> String {
        format!("{id}{MARK}{}", self.signature(tenant, id))
    }

    /// HolySheep's id of one `tenant` was handed, when it was signed for that tenant.
    pub fn verify<'a>(&self, tenant: &str, signed: &'a str) -> Option<&'a str> {
        let (id, signature) = signed.rsplit_once(MARK)?;
        let expected = self.signature(tenant, id);
        // Compared whole, without an early exit.
        let same = signature.len() == expected.len()
            && signature.bytes().zip(expected.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
        same.then_some(id)
    }
}

/// A tenant's signer: the key and the tenant its ids are signed for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signer {
    pub key: ObjectKey,
    pub tenant: String,
}

impl Signer {
    /// `body` (an answer of the Responses API, or one of its stream's events) with every
    /// quoted occurrence of the response id `id` signed.
    pub(crate) fn sign_in(&self, body: &[u8], id: &str) -> Vec<u8> {
        let from = format!("\"{id}\"");
        let to = format!("\"{}\"", self.key.sign(&self.tenant, id));
        replace(body, from.as_bytes(), to.as_bytes())
    }

    /// A Responses answer's body with its response id (and the `previous_response_id` it
    /// continued) signed: `None` when it is not a `response` object with an id (an error,
    /// say), which is passed on as it is.
    pub fn sign_answer(&self, body: &[u8]) -> Option<Vec<u8>> {
        let [id, object, previous] = scan::read_fields(body, ["id", "object", "previous_response_id"])?;
        let (id, object) = (id?.as_str()?, object?.as_str()?);
        let previous = match previous {
            Some(p) if !p.is_null() => Some(p.as_str()?),
            _ => None,
        };
        if object != "response" {
            return None;
        }
        let signed = self.sign_in(body, &id);
        Some(match previous {
            Some(previous) => self.sign_in(&signed, &previous),
            None => signed,
        })
    }
}

/// A request body whose top-level `previous_response_id` is HolySheep's `id` in place of
/// the tenant's signed one: that one value is replaced, however the client wrote it (JSON
/// escapes included), and every other byte is the client's (the same id quoted in the
/// input stays as the tenant wrote it).
pub(crate) fn unsign_in(body: &[u8], id: &str) -> Vec<u8> {
    // A body naming it twice is left as it is: which copy HolySheep would read is not the
    // edge's to guess, and the intake refuses such a body (a repeated key) before this.
    let Some([Some(raw)]) = scan::read_fields(body, ["previous_response_id"]) else { return body.to_vec() };
    // The value's place in `body`: a read value is a slice of it.
    let start = (raw.text().as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    let Some(end) = start.checked_add(raw.text().len()).filter(|end| *end <= body.len()) else { return body.to_vec() };
    let mut out = Vec::with_capacity(body.len());
    out.extend_from_slice(&body[..start]);
    write::string_into(id, &mut out);
    out.extend_from_slice(&body[end..]);
    out
}

/// `haystack` with every `from` replaced by `to`.
fn replace(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len() + to.len());
    let mut rest = haystack;
    while let Some(at) = rest.windows(from.len()).position(|w| w == from) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(to);
        rest = &rest[at + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// The 404 of a response id that is not the tenant's, as HolySheep answers one that does
/// not exist.
pub(crate) fn not_found(param: &str, id: &str) -> ApiError {
    let shown: String = id.chars().filter(|c| !c.is_control()).take(128).collect();
    ApiError {
        status: 404,
        message: format!("Previous response with id '{shown}' not found."),
        kind: "invalid_request_error",
        param: Some(param.to_owned()),
        code: "previous_response_not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_signed_for_one_tenant_is_no_other_tenants() {
        let key = ObjectKey::of_operator_key("sk-operator");
        let signed = key.sign("alpha", "resp_123");
        assert!(signed.starts_with("resp_123_hs") && signed.len() == "resp_123_hs".len() + 16, "{signed}");
        assert_eq!(key.verify("alpha", &signed), Some("resp_123"));
        assert_eq!(key.verify("beta", &signed), None, "another tenant");
        assert_eq!(key.verify("alpha", "resp_123"), None, "unsigned");
        assert_eq!(key.verify("alpha", &signed.replace("resp_123", "resp_124")), None, "another id");
        let other = ObjectKey::of_operator_key("sk-another");
        assert_eq!(other.verify("alpha", &signed), None, "another operator key");
        assert_eq!(format!("{key:?}"), "ObjectKey(..)");
    }

    #[test]
    fn only_the_previous_response_id_goes_back_to_holysheeps_id_however_it_was_written() {
        let signed = ObjectKey::of_operator_key("k").sign("alpha", "resp_1");
        let go_on = format!(r#"{{"input":"as in \"{signed}\"","previous_response_id" : "{signed}"}}"#);
        assert_eq!(
            String::from_utf8(unsign_in(go_on.as_bytes(), "resp_1")).unwrap(),
            format!(r#"{{"input":"as in \"{signed}\"","previous_response_id" : "resp_1"}}"#),
            "the id in the input is the tenant's text"
        );
        // Written with JSON escapes (in the key and the value), it is still the field.
        let escaped = signed.replacen('_', "\\u005f", 1);
        let go_on = format!(r#"{{"previous\u005fresponse_id":"{escaped}","input":"x"}}"#);
        let v: serde_json::Value = serde_json::from_str(&go_on).unwrap();
        assert_eq!(v["previous_response_id"], signed.as_str(), "the client's escapes name the signed id");
        let sent = String::from_utf8(unsign_in(go_on.as_bytes(), "resp_1")).unwrap();
        assert_eq!(sent, r#"{"previous\u005fresponse_id":"resp_1","input":"x"}"#);
        assert_eq!(unsign_in(b"not json", "resp_1"), b"not json");
        // Named twice (a body the intake refuses), no copy is chosen to be replaced.
        let twice = format!(r#"{{"previous_response_id":"{signed}","previous_response_id":"resp_other"}}"#);
        assert_eq!(unsign_in(twice.as_bytes(), "resp_1"), twice.as_bytes());
    }

    #[test]
    fn an_answers_response_id_is_signed_wherever_it_appears() {
        let s = Signer { key: ObjectKey::of_operator_key("k"), tenant: "alpha".into() };
        let body = br#"{"id":"resp_9","object":"response","output":[{"id":"msg_1"}],"note":"resp_9 in text","previous_response_id":"resp_8"}"#;
        let signed = String::from_utf8(s.sign_answer(body).unwrap()).unwrap();
        let id = s.key.sign("alpha", "resp_9");
        assert!(signed.contains(&format!(r#""previous_response_id":"{}""#, s.key.sign("alpha", "resp_8"))));
        assert!(signed.starts_with(&format!(r#"{{"id":"{id}","object":"response""#)), "{signed}");
        assert!(signed.contains(r#""msg_1""#) && signed.contains("resp_9 in text"), "only the quoted id");
        assert_eq!(s.sign_answer(br#"{"error":{"message":"x"}}"#), None);
        let event = br#"data: {"type":"response.created","response":{"id":"resp_9","status":"in_progress"}}"#;
        assert!(String::from_utf8(s.sign_in(event, "resp_9")).unwrap().contains(&id));
        assert_eq!(not_found("previous_response_id", "resp_x").status, 404);
    }
}
