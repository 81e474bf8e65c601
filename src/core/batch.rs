//! Embeddings item by item. A `/v1/embeddings` request's items (each string or token list
//! of its `input`) are keyed as each would be alone, and every answered item is kept in
//! the cache with the call it came from: its group, the group's size and the tokens the
//! group was billed. A list that misses the cache as a whole is then answered from the
//! cached items where that is exact, and only the rest is embedded:
//!
//! - a vector is the same whatever list it came in (HolySheep embeds each input on its
//!   own), so a cached item's vector is the answer's;
//! - `usage` adds up over inputs, but a call bills its items together: a cached item's
//!   tokens are known only as its group's total. Cached items are used where whole groups
//!   come again, each member once; the others are embedded again.
//!
//! So the answer is the one HolySheep would have given the whole list: every vector at
//! its index, and `usage` the groups' totals plus what the call for the rest was billed.

use super::cache::{self, Response};
use super::canonical::canonical_body;
use super::config::Config;
use super::digest::sha256;
use super::error::ApiError;
use super::request::{request_key, Key};
use super::store::CasStore;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// The path items are keyed under (never a request's own).
pub const ITEM_PATH: &str = "/v1/embeddings#item";

/// The most items of one list the edge keys one by one (OpenAI takes 2048).
pub const MAX_ITEMS: usize = 2048;

/// The keys of a request's items, in order: each is the key of the request with that item
/// alone as its `input`. `None` for an `input` that is no list of items.
pub fn item_keys(map: &Map<String, Value>, scope: &str) -> Option<Vec<Key>> {
    let items = items(map.get("input")?)?;
    let mut rest = map.clone();
    rest.remove("input");
    let keys = items
        .iter()
        .map(|item| {
            let mut one = rest.clone();
            one.insert("input".into(), (*item).clone());
            request_key(ITEM_PATH, scope, &canonical_body(one))
        })
        .collect();
    Some(keys)
}

/// An `input`'s items: a string or a list of token numbers is one; a list of strings or
/// of token lists is one per member.
fn items(input: &Value) -> Option<Vec<&Value>> {
    match input {
        Value::String(_) => Some(vec![input]),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => Some(vec![input]),
        Value::Array(a) if (1..=MAX_ITEMS).contains(&a.len()) && a.iter().all(|i| i.is_string() || i.is_array()) => {
            Some(a.iter().collect())
        }
        _ => None,
    }
}

/// One cached item: its vector (as the answer wrote it), the model that made it, and the
/// call it came from.
#[derive(Debug, Clone, PartialEq)]
struct Item {
    embedding: Value,
    model: String,
    group: String,
    size: usize,
    tokens: u64,
}

impl Item {
    fn read(body: &[u8]) -> Option<Item> {
        let v: Value = serde_json::from_slice(body).ok()?;
        Some(Item {
            embedding: v.get("embedding")?.clone(),
            model: v.get("model")?.as_str()?.to_owned(),
            group: v.get("group")?.as_str()?.to_owned(),
            size: usize::try_from(v.get("size")?.as_u64()?).ok()?,
            tokens: v.get("tokens")?.as_u64()?,
        })
    }

    fn body(&self) -> Vec<u8> {
        let v = json!({"embedding": self.embedding, "model": self.model, "group": self.group,
            "size": self.size, "tokens": self.tokens});
        serde_json::to_vec(&v).unwrap_or_default()
    }
}

/// What a leader of a list request does.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Every item is cached, exactly: the whole answer, with no call.
    Answered(Response),
    /// A call embeds the items `Batch` does not hold (with this body, when that is fewer
    /// than all of them); its answer is completed and its items learned by `Batch::finish`.
    Call(Batch, Option<Vec<u8>>),
}

/// A list request's items, what the cache holds of them, and whether answered ones are kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    keys: Vec<Key>,
    /// By position: the item served from the cache, or `None` for one the call embeds.
    cached: Vec<Option<Item>>,
    /// The tokens the cached items' groups were billed.
    cached_tokens: u64,
    /// The items a call embeds are kept (the request may be stored).
    learn: bool,
}

impl Batch {
    fn missing(&self) -> impl Iterator<Item = usize> + '_ {
        self.cached.iter().enumerate().filter(|(_, c)| c.is_none()).map(|(i, _)| i)
    }

    /// HolySheep's answer to the call: the whole list's answer (the cached items at their
    /// indices, `usage` theirs and the call's together), its new items kept. An answer that
    /// does not fit the items asked for is the edge's 502.
    pub fn finish(&self, store: &impl CasStore, config: &Config, answer: Response, now_ms: u64) -> Response {
        let Some((new, model, tokens)) = read_answer(&answer.body, self.missing().count()) else {
            let e = ApiError::upstream(
                502,
                "HolySheep's embeddings do not match the inputs sent",
                "upstream_invalid_answer",
            );
            return Response::json(e.status, e.body());
        };
        let missing: Vec<usize> = self.missing().collect();
        if self.learn {
            self.keep(store, config, &missing, &new, (&model, tokens), now_ms);
        }
        if missing.len() == self.keys.len() {
            // The call was the request itself: its answer is HolySheep's own.
            return answer;
        }
        let mut new = new.into_iter();
        let data: Vec<Value> = self
            .cached
            .iter()
            .map(|c| c.as_ref().map(|i| i.embedding.clone()).or_else(|| new.next()).unwrap_or(Value::Null))
            .collect();
        list(data, &model, self.cached_tokens.saturating_add(tokens))
    }

    /// The call's items, kept as one group (unless an item came twice: its share of the
    /// total could not be told).
    fn keep(
        &self,
        store: &impl CasStore,
        config: &Config,
        missing: &[usize],
        new: &[Value],
        (model, tokens): (&str, u64),
        now_ms: u64,
    ) {
        let keys: Vec<&Key> = missing.iter().filter_map(|&i| self.keys.get(i)).collect();
        let mut distinct: Vec<&str> = keys.iter().map(|k| k.hex()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != keys.len() {
            return;
        }
        let group = group_id(&keys);
        for (key, embedding) in keys.iter().zip(new) {
            let item = Item {
                embedding: embedding.clone(),
                model: model.to_owned(),
                group: group.clone(),
                size: keys.len(),
                tokens,
            };
            cache::put(store, config, key, &Response::json(200, item.body()), now_ms, None);
        }
    }
}

/// An id for the group of `keys` (the same items in the same order make the same group).
fn group_id(keys: &[&Key]) -> String {
    let joined: Vec<u8> = keys.iter().flat_map(|k| k.hex().bytes()).collect();
    sha256(joined).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// An embeddings answer's vectors in index order, its model and its tokens, when it has
/// exactly `count` of them, indexed 0 to `count - 1`.
fn read_answer(body: &[u8], count: usize) -> Option<(Vec<Value>, String, u64)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    let mut vectors: Vec<Option<Value>> = vec![None; count];
    for d in data {
        let index = usize::try_from(d.get("index")?.as_u64()?).ok()?;
        let slot = vectors.get_mut(index).filter(|s| s.is_none())?;
        *slot = Some(d.get("embedding")?.clone());
    }
    let vectors: Option<Vec<Value>> = vectors.into_iter().collect();
    let model = v.get("model").and_then(Value::as_str).unwrap_or_default().to_owned();
    let tokens = v.get("usage")?.get("prompt_tokens")?.as_u64()?;
    Some((vectors?, model, tokens))
}

/// The list answer OpenAI writes for `data`.
fn list(data: Vec<Value>, model: &str, tokens: u64) -> Response {
    let data: Vec<Value> =
        data.into_iter().enumerate().map(|(i, e)| json!({"object": "embedding", "index": i, "embedding": e})).collect();
    let v = json!({"object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Response::json(200, serde_json::to_vec(&v).unwrap_or_default())
}

/// What the leader of a list request whose items are `keys` does: `read` says whether it
/// may take cached items, `learn` whether it may keep new ones; `body` is the request's.
/// `None` when the items change nothing (none cached, none to keep).
pub fn plan(
    store: &impl CasStore,
    config: &Config,
    keys: &[Key],
    body: &[u8],
    (read, learn): (bool, bool),
    now_ms: u64,
) -> Option<Plan> {
    let found: Vec<Option<Item>> = keys
        .iter()
        .map(|k| {
            let entry = cache::get(store, config, k).filter(|e| read && e.is_fresh(now_ms))?;
            Item::read(&entry.response.body)
        })
        .collect();
    let cached = whole_groups(keys, found);
    let cached_tokens = tokens_of(&cached);
    let batch = Batch { keys: keys.to_vec(), cached, cached_tokens, learn };
    let missing: Vec<usize> = batch.missing().collect();
    if missing.is_empty() {
        let model = batch.cached.iter().flatten().map(|i| i.model.clone()).next().unwrap_or_default();
        let data = batch.cached.iter().flatten().map(|i| i.embedding.clone()).collect();
        return Some(Plan::Answered(list(data, &model, cached_tokens)));
    }
    if missing.len() == keys.len() {
        return learn.then_some(Plan::Call(batch, None));
    }
    let rewritten = subset(body, &missing)?;
    Some(Plan::Call(batch, Some(rewritten)))
}

/// The cached items that can be used: those of groups present whole in the request, each
/// member once, and all of one model; the others are left to the call.
fn whole_groups(keys: &[Key], found: Vec<Option<Item>>) -> Vec<Option<Item>> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for k in keys {
        *seen.entry(k.hex()).or_default() += 1;
    }
    let mut members: BTreeMap<String, usize> = BTreeMap::new();
    for (k, item) in keys.iter().zip(&found) {
        if let Some(i) = item.as_ref().filter(|_| seen.get(k.hex()) == Some(&1)) {
            *members.entry(i.group.clone()).or_default() += 1;
        }
    }
    let model = found.iter().flatten().map(|i| i.model.clone()).next();
    keys.iter()
        .zip(found)
        .map(|(k, item)| {
            item.filter(|i| {
                seen.get(k.hex()) == Some(&1)
                    && members.get(&i.group) == Some(&i.size)
                    && Some(&i.model) == model.as_ref()
            })
        })
        .collect()
}

/// The tokens of the groups the cached items belong to, each group once.
fn tokens_of(cached: &[Option<Item>]) -> u64 {
    let mut groups: BTreeMap<&str, u64> = BTreeMap::new();
    for i in cached.iter().flatten() {
        groups.insert(&i.group, i.tokens);
    }
    groups.values().sum()
}

/// The request body with only the items at `positions` in its `input`.
fn subset(body: &[u8], positions: &[usize]) -> Option<Vec<u8>> {
    let Value::Object(mut map) = serde_json::from_slice::<Value>(body).ok()? else { return None };
    let items = map.get("input")?.as_array()?;
    let kept: Vec<Value> = positions.iter().filter_map(|&i| items.get(i).cloned()).collect();
    map.insert("input".into(), Value::Array(kept));
    serde_json::to_vec(&Value::Object(map)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::MemStore;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    /// HolySheep's answer for `inputs`: a vector of the input's length, a token a byte.
    fn answer(inputs: &[&str]) -> Response {
        let data: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"object":"embedding","index":i,"embedding":[t.len()]}))
            .collect();
        let tokens: usize = inputs.iter().map(|t| t.len()).sum();
        let v = json!({"object":"list","data":data,"model":"e","usage":{"prompt_tokens":tokens,"total_tokens":tokens}});
        Response::json(200, serde_json::to_vec(&v).unwrap())
    }

    fn body(inputs: &[&str]) -> Vec<u8> {
        serde_json::to_vec(&json!({"model":"e","input":inputs})).unwrap()
    }

    fn keys(inputs: &[&str]) -> Vec<Key> {
        item_keys(&map(json!({"model":"e","input":inputs})), "s").unwrap()
    }

    fn read(r: &Response) -> (Vec<Value>, u64) {
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let data = v["data"].as_array().unwrap().iter().map(|d| d["embedding"].clone()).collect();
        (data, v["usage"]["prompt_tokens"].as_u64().unwrap())
    }

    #[test]
    fn an_item_is_keyed_as_it_would_be_alone() {
        let alone = item_keys(&map(json!({"model":"e","input":"abc","user":"u"})), "s").unwrap();
        let listed = item_keys(&map(json!({"input":["x","abc"],"model":"e"})), "s").unwrap();
        assert_eq!(listed[1], alone[0], "the same item, the same key, whatever list it came in");
        assert_ne!(item_keys(&map(json!({"model":"e","input":"abc","dimensions":8})), "s").unwrap()[0], alone[0]);
        assert_ne!(item_keys(&map(json!({"model":"e","input":"abc"})), "t").unwrap()[0], alone[0], "the scope");
        assert_eq!(item_keys(&map(json!({"model":"e","input":[1,2,3]})), "s").unwrap().len(), 1, "one token list");
        assert_eq!(item_keys(&map(json!({"model":"e","input":[[1],[2]]})), "s").unwrap().len(), 2);
        assert!(item_keys(&map(json!({"model":"e","input":[]})), "s").is_none());
    }

    #[test]
    fn a_list_whose_earlier_call_comes_again_whole_is_answered_with_one_call_for_the_rest() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta", "gamma"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&first), &body(&first), (true, true), 0) else {
            panic!("nothing cached: the whole request goes")
        };
        let whole = answer(&first);
        assert_eq!(batch.finish(&store, &config, whole.clone(), 0), whole, "HolySheep's own answer");
        let second = ["alpha", "new", "beta", "gamma"];
        let Some(Plan::Call(batch, Some(sent))) =
            plan(&store, &config, &keys(&second), &body(&second), (true, true), 1)
        else {
            panic!("three cached, one to embed")
        };
        assert_eq!(sent, body(&["new"]), "only the new item is sent");
        let assembled = batch.finish(&store, &config, answer(&["new"]), 1);
        assert_eq!(read(&assembled), read(&answer(&second)), "vectors at their indices, usage of the whole list");
        // Both calls' items are cached now: the list again needs no call.
        let Some(Plan::Answered(r)) = plan(&store, &config, &keys(&second), &body(&second), (true, true), 2) else {
            panic!("all cached")
        };
        assert_eq!(read(&r), read(&answer(&second)));
    }

    #[test]
    fn cached_items_whose_group_is_not_whole_are_embedded_again() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta", "gamma"];
        let Some(Plan::Call(batch, _)) = plan(&store, &config, &keys(&first), &body(&first), (true, true), 0) else {
            panic!()
        };
        batch.finish(&store, &config, answer(&first), 0);
        // Only two of the group's three: their share of its tokens cannot be told.
        let part = ["alpha", "beta", "delta"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&part), &body(&part), (true, true), 1) else {
            panic!("the whole list goes")
        };
        assert_eq!(read(&batch.finish(&store, &config, answer(&part), 1)), read(&answer(&part)));
        // An item twice: HolySheep bills it twice, which no group says, so its group is not
        // whole once and the list goes as it is (and is not learned: alpha's share is unknown).
        let (fresh, twice) = (MemStore::new(), ["alpha", "beta", "gamma", "alpha"]);
        let Some(Plan::Call(batch, _)) = plan(&fresh, &config, &keys(&first), &body(&first), (true, true), 0) else {
            panic!()
        };
        batch.finish(&fresh, &config, answer(&first), 0);
        assert!(matches!(
            plan(&fresh, &config, &keys(&twice), &body(&twice), (true, true), 2),
            Some(Plan::Call(_, None))
        ));
        // No read (no-cache): nothing is taken from the cache.
        assert!(matches!(
            plan(&store, &config, &keys(&first), &body(&first), (false, true), 3),
            Some(Plan::Call(_, None))
        ));
        assert_eq!(plan(&store, &config, &keys(&["zeta", "eta"]), &body(&["zeta", "eta"]), (true, false), 3), None);
    }

    #[test]
    fn an_answer_that_does_not_fit_the_items_sent_is_refused() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&first), &body(&first), (true, true), 0) else {
            panic!()
        };
        let short = batch.finish(&store, &config, answer(&["alpha"]), 0);
        assert_eq!(short.status, 502);
        assert!(cache::get(&store, &config, &keys(&first)[0]).is_none(), "nothing learned from it");
    }
}
