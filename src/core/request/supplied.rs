//! What a request names that HolySheep bills beyond the body the edge sees: input it
//! supplies itself (a stored response or conversation, a stored prompt, a file by id or
//! URL, an image by URL, a stored item), and hosted tools it runs and bills per call (web
//! search, file search, code interpreter, ...). Each is named by its `param` path, as
//! OpenAI's errors name a field.

use crate::core::api::endpoint::Endpoint;
use serde_json::{Map, Value};

/// The first member of a request that makes HolySheep bill input the edge cannot see.
pub(crate) fn supplied_input(endpoint: Endpoint, map: &Map<String, Value>) -> Option<String> {
    let set = |f: &str| map.get(f).is_some_and(|v| !v.is_null());
    match endpoint {
        Endpoint::Responses => {
            if let Some(f) = ["previous_response_id", "conversation", "prompt"].into_iter().find(|f| set(f)) {
                return Some(f.to_owned());
            }
            let items = map.get("input").and_then(Value::as_array)?;
            items.iter().enumerate().find_map(|(i, item)| {
                if is_reference(item) {
                    return Some(format!("input[{i}]"));
                }
                parts(item).find_map(|(j, part)| by_reference(part).map(|f| format!("input[{i}].content[{j}].{f}")))
            })
        }
        Endpoint::Chat => {
            let messages = map.get("messages").and_then(Value::as_array)?;
            messages.iter().enumerate().find_map(|(i, m)| {
                parts(m).find_map(|(j, part)| by_reference(part).map(|f| format!("messages[{i}].content[{j}].{f}")))
            })
        }
        Endpoint::Completions | Endpoint::Embeddings => None,
    }
}

/// The first member naming a stored object of the operator's account other than a
/// response (a conversation, a stored item, a file by id): objects no tenant's call makes
/// through the edge, whose owner it cannot tell.
pub(crate) fn foreign_object(endpoint: Endpoint, map: &Map<String, Value>) -> Option<String> {
    let items = match endpoint {
        Endpoint::Responses if map.get("conversation").is_some_and(|v| !v.is_null()) => {
            return Some("conversation".into())
        }
        Endpoint::Responses if stored_by_tool(map).is_some() => return stored_by_tool(map),
        Endpoint::Responses => ("input", map.get("input").and_then(Value::as_array)?),
        Endpoint::Chat => ("messages", map.get("messages").and_then(Value::as_array)?),
        Endpoint::Completions | Endpoint::Embeddings => return None,
    };
    items.1.iter().enumerate().find_map(|(i, item)| {
        if is_reference(item) {
            return Some(format!("{}[{i}]", items.0));
        }
        parts(item).find_map(|(j, part)| match by_reference(part) {
            Some(f @ ("file_id" | "file")) => Some(format!("{}[{i}].content[{j}].{f}", items.0)),
            _ => None,
        })
    })
}

/// The first hosted tool a request enables: any Responses tool but the caller's own
/// (`function`, `custom`), and chat's `web_search_options`.
pub(crate) fn hosted_tool(endpoint: Endpoint, map: &Map<String, Value>) -> Option<String> {
    match endpoint {
        Endpoint::Responses => {
            let tools = map.get("tools").and_then(Value::as_array)?;
            tools.iter().enumerate().find_map(|(i, t)| {
                let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
                (!matches!(kind, "function" | "custom")).then(|| format!("tools[{i}]"))
            })
        }
        Endpoint::Chat => map.get("web_search_options").filter(|v| !v.is_null()).map(|_| "web_search_options".into()),
        Endpoint::Completions | Endpoint::Embeddings => None,
    }
}

/// An input item that names a stored item instead of carrying one: an `item_reference`,
/// or an item of nothing but its `id` (and `type`).
fn is_reference(item: &Value) -> bool {
    let Some(o) = item.as_object() else { return false };
    o.get("type").and_then(Value::as_str) == Some("item_reference")
        || (o.contains_key("id") && o.keys().all(|k| k == "id" || k == "type"))
}

/// A hosted tool run on stored objects: `file_search`'s vector stores, a code
/// interpreter's container by id.
fn stored_by_tool(map: &Map<String, Value>) -> Option<String> {
    let tools = map.get("tools").and_then(Value::as_array)?;
    tools.iter().enumerate().find_map(|(i, t)| match t.get("type").and_then(Value::as_str) {
        Some("file_search") => Some(format!("tools[{i}].vector_store_ids")),
        Some("code_interpreter") if t.get("container").is_some_and(Value::is_string) => {
            Some(format!("tools[{i}].container"))
        }
        _ => None,
    })
}

/// The content parts of a message or input item, with their indexes.
fn parts(item: &Value) -> impl Iterator<Item = (usize, &Value)> {
    item.get("content").and_then(Value::as_array).into_iter().flatten().enumerate()
}

/// The field of a content part that names input by reference: a file by id or URL, or
/// an image by URL (an image inline as a `data:` URL is in the body).
fn by_reference(part: &Value) -> Option<&'static str> {
    let remote =
        |url: Option<&Value>| url.and_then(Value::as_str).is_some_and(|u| !u.trim_start().starts_with("data:"));
    let set = |f: &str| part.get(f).is_some_and(|v| !v.is_null());
    if set("file_id") {
        return Some("file_id");
    }
    if set("file_url") {
        return Some("file_url");
    }
    match part.get("image_url") {
        // Responses: `"image_url": "https://..."`; chat: `"image_url": {"url": "https://..."}`.
        Some(Value::String(_)) if remote(part.get("image_url")) => Some("image_url"),
        Some(Value::Object(o)) if remote(o.get("url")) => Some("image_url"),
        _ => match part.get("file") {
            Some(Value::Object(f)) if f.get("file_id").is_some_and(|v| !v.is_null()) => Some("file"),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn input_holysheep_supplies_is_named_by_its_field() {
        let r = |v| supplied_input(Endpoint::Responses, &map(v));
        assert_eq!(r(json!({"input": "hi"})), None);
        assert_eq!(
            r(json!({"input": "hi", "previous_response_id": "resp_1"})).as_deref(),
            Some("previous_response_id")
        );
        assert_eq!(r(json!({"input": "hi", "previous_response_id": null})), None);
        assert_eq!(r(json!({"input": "hi", "conversation": "conv_1"})).as_deref(), Some("conversation"));
        assert_eq!(r(json!({"prompt": {"id": "pmpt_1", "version": "2"}})).as_deref(), Some("prompt"));
        let file = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
            {"type": "input_file", "file_id": "file-1"}]}]});
        assert_eq!(r(file).as_deref(), Some("input[0].content[1].file_id"));
        let url =
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}]});
        assert_eq!(r(url).as_deref(), Some("input[0].content[0].image_url"));
        let inline = json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]});
        assert_eq!(r(inline), None, "an inline image is in the body");
        assert_eq!(r(json!({"input": [{"type": "item_reference", "id": "msg_1"}]})).as_deref(), Some("input[0]"));
        let c = |v| supplied_input(Endpoint::Chat, &map(v));
        let chat_url = json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]});
        assert_eq!(c(chat_url).as_deref(), Some("messages[1].content[0].image_url"));
        let chat_file =
            json!({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]});
        assert_eq!(c(chat_file).as_deref(), Some("messages[0].content[0].file"));
        assert_eq!(c(json!({"messages": [{"role": "user", "content": "a"}]})), None);
    }

    #[test]
    fn stored_objects_other_than_responses_are_named() {
        let r = |v| foreign_object(Endpoint::Responses, &map(v));
        assert_eq!(r(json!({"input": "a", "previous_response_id": "resp_1"})), None, "a response: signed ids");
        assert_eq!(r(json!({"input": "a", "conversation": "conv_1"})).as_deref(), Some("conversation"));
        assert_eq!(r(json!({"input": [{"type": "item_reference", "id": "msg_1"}]})).as_deref(), Some("input[0]"));
        assert_eq!(r(json!({"input": ["x", {"id": "msg_1"}]})).as_deref(), Some("input[1]"), "a bare id");
        assert_eq!(r(json!({"input": [{"type": "reasoning", "id": "rs_1"}]})).as_deref(), Some("input[0]"));
        let carried = json!({"input": [{"type": "message", "id": "msg_1", "role": "user", "content": "hi"}]});
        assert_eq!(r(carried), None, "an item that carries itself");
        assert_eq!(
            r(json!({"input": "a", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]})).as_deref(),
            Some("tools[0].vector_store_ids")
        );
        assert_eq!(
            r(json!({"input": "a", "tools": [{"type": "code_interpreter", "container": "cntr_1"}]})).as_deref(),
            Some("tools[0].container")
        );
        assert_eq!(
            r(json!({"input": "a", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]})),
            None
        );
        let url = json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]});
        assert_eq!(r(url), None, "a URL is no stored object");
        let file =
            json!({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]});
        assert_eq!(foreign_object(Endpoint::Chat, &map(file)).as_deref(), Some("messages[0].content[0].file"));
    }

    #[test]
    fn hosted_tools_are_named_and_the_callers_own_are_not() {
        let r = |v| hosted_tool(Endpoint::Responses, &map(v));
        assert_eq!(r(json!({"tools": [{"type": "function", "name": "f"}]})), None);
        assert_eq!(r(json!({"tools": [{"type": "function"}, {"type": "web_search"}]})).as_deref(), Some("tools[1]"));
        assert_eq!(r(json!({"tools": [{"type": "code_interpreter"}]})).as_deref(), Some("tools[0]"));
        let c = |v| hosted_tool(Endpoint::Chat, &map(v));
        assert_eq!(c(json!({"web_search_options": {}})).as_deref(), Some("web_search_options"));
        assert_eq!(c(json!({"tools": [{"type": "function"}]})), None);
    }
}
