//! Embeddings item by item. A `/v1/embeddings` request's items (each string or token list
//! of its `input`) are keyed as each would be alone (`request::item_keys`), and every answered item is kept in
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

use crate::core::api::error::ApiError;
use crate::core::api::key::Key;
use crate::core::api::response::Response;
use crate::core::cache::{self, Evict, Fresh};
use crate::core::config::Config;
use crate::core::store::CasStore;
use crate::core::wire::digest::sha256;
use crate::core::wire::write;
use crate::core::wire::{json, scan};
use serde_json::Value;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, DefaultHasher};
use std::rc::Rc;

/// The most bytes of cached vectors one list takes from the cache; items past it are
/// embedded again (a bound on what one request holds in memory).
const MAX_CACHED_BYTES: usize = 8 << 20;

/// One cached item: its vector (the JSON text the answer wrote, never parsed), the model
/// that made it, the call it came from, and when it was stored.
#[derive(Debug, Clone, PartialEq)]
struct Item {
    embedding: String,
    model: String,
    group: String,
    size: usize,
    tokens: u64,
    stored_at_ms: u64,
}

/// What an item entry says besides its vector, which follows it after a newline.
struct Head {
    model: String,
    group: String,
    size: usize,
    tokens: u64,
}

impl Item {
    fn read(body: &[u8], stored_at_ms: u64) -> Option<Item> {
        let at = body.iter().position(|&b| b == b'\n')?;
        let [model, group, size, tokens] = scan::read_fields(&body[..at], ["model", "group", "size", "tokens"])?;
        let (model, group) = (model?.as_str()?.into_owned(), group?.as_str()?.into_owned());
        let size = usize::try_from(size?.as_u64()?).ok()?;
        let tokens = tokens?.as_u64()?;
        let embedding = String::from_utf8(body[at + 1..].to_vec()).ok()?;
        Some(Item { embedding, model, group, size, tokens, stored_at_ms })
    }

    fn body(head: &Head, embedding: &str) -> Vec<u8> {
        let Head { model, group, size, tokens } = head;
        let (model, group) = (write::string(model), write::string(group));
        let mut out = format!(r#"{{"model":{model},"group":{group},"size":{size},"tokens":{tokens}}}"#).into_bytes();
        out.push(b'\n');
        out.extend_from_slice(embedding.as_bytes());
        out
    }
}

/// What a leader of a list request does.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// Every item is cached, exactly: the whole answer with no call, as old as its oldest
    /// item (`Fresh`: when that one was stored, and the cache's TTL).
    Answered(Response, Fresh),
    /// A call embeds the items `Batch` does not hold (with this body, when that is fewer
    /// than all of them); its answer is completed and its items learned by `Batch::finish`.
    Call(Rc<Batch>, Option<Vec<u8>>),
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

    /// HolySheep's answer to the call: for a call that sent every item, that answer as it
    /// is (its items kept when it can be read); else the whole list's answer, the cached
    /// items at their indices and `usage` theirs and the call's together. An answer that
    /// does not fit the items sent cannot be completed: it is the edge's 502.
    pub fn finish(&self, store: &impl CasStore, config: &Config, answer: Response, now_ms: u64) -> Response {
        let missing: Vec<usize> = self.missing().collect();
        let read = read_answer(&answer.body, missing.len());
        if let Some(new) = read.as_ref().filter(|_| self.learn) {
            self.keep(store, config, &missing, new, now_ms);
        }
        if missing.len() == self.keys.len() {
            return answer;
        }
        let Some(new) = read else {
            let e = ApiError::upstream(
                502,
                "HolySheep's embeddings do not match the inputs sent",
                "upstream_invalid_answer",
            );
            return Response::json(e.status, e.body());
        };
        let mut vectors = new.vectors.iter();
        let data: Vec<&str> = self
            .cached
            .iter()
            .map(|c| {
                c.as_ref()
                    .map(|i| i.embedding.as_str())
                    .or_else(|| vectors.next().map(String::as_str))
                    .unwrap_or("null")
            })
            .collect();
        list(&data, &new.model, self.cached_tokens.saturating_add(new.tokens))
    }

    /// The call's items, kept as one group (unless an item came twice: its share of the
    /// total could not be told).
    fn keep(&self, store: &impl CasStore, config: &Config, missing: &[usize], new: &Answer, now_ms: u64) {
        let keys: Vec<&Key> = missing.iter().filter_map(|&i| self.keys.get(i)).collect();
        // Told by a map: a sort of up to 2,048 digests would compile its own copy.
        let mut seen = Counts::with_capacity_and_hasher(keys.len(), BuildHasherDefault::default());
        if !keys.iter().all(|k| seen.insert(k.hex(), 0).is_none()) || keys.len() != new.vectors.len() {
            return;
        }
        let head = Head { model: new.model.clone(), group: group_id(&keys), size: keys.len(), tokens: new.tokens };
        let mut share = evictions_allowed(config);
        for (key, embedding) in keys.iter().zip(&new.vectors) {
            let evict = if share > 0 { Evict::Asked } else { Evict::Never };
            let body = Response::json(200, Item::body(&head, embedding));
            if cache::put(store, config, key, &body, now_ms, evict).is_some_and(|s| s.evicted) {
                share -= 1;
            }
        }
    }
}

/// Fresh answers of other keys one list may displace: a sixteenth of the cache (at least
/// one), so no single request flushes it.
fn evictions_allowed(config: &Config) -> u32 {
    (config.cache.max_entries / 16).max(1)
}

/// An id for the group of `keys` (the same items in the same order make the same group):
/// 128 bits of SHA-256, so no two groups share one.
fn group_id(keys: &[&Key]) -> String {
    let joined: Vec<u8> = keys.iter().flat_map(|k| k.hex().bytes()).collect();
    sha256(joined).iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// An embeddings answer read: its vectors (their JSON text) in index order, its model and
/// the tokens it was billed.
struct Answer {
    vectors: Vec<String>,
    model: String,
    tokens: u64,
}

/// The answer's parts, when it has exactly `count` vectors, indexed 0 to `count - 1`.
fn read_answer(body: &[u8], count: usize) -> Option<Answer> {
    let [data, model, usage] = scan::read_fields(body, ["data", "model", "usage"])?;
    let model = match model {
        Some(m) if !m.is_null() => m.as_str()?.into_owned(),
        _ => String::new(),
    };
    let [tokens] = usage?.fields(["prompt_tokens"])?;
    let tokens = tokens?.as_u64()?;
    let data = data?;
    if !data.is_array() {
        return None;
    }
    let mut vectors: Vec<Option<String>> = vec![None; count];
    for datum in data.items() {
        let [index, embedding] = datum.fields(["index", "embedding"])?;
        let index = usize::try_from(index?.as_u64()?).ok()?;
        let slot = vectors.get_mut(index).filter(|s| s.is_none())?;
        *slot = Some(embedding?.text().to_owned());
    }
    let vectors: Option<Vec<String>> = vectors.into_iter().collect();
    Some(Answer { vectors: vectors?, model, tokens })
}

/// The list answer OpenAI writes for `data` (each vector's JSON text).
fn list(data: &[&str], model: &str, tokens: u64) -> Response {
    let mut out = Vec::with_capacity(64 + data.iter().map(|d| d.len() + 48).sum::<usize>());
    out.extend_from_slice(br#"{"object":"list","data":["#);
    for (i, embedding) in data.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(format!(r#"{{"object":"embedding","index":{i},"embedding":"#).as_bytes());
        out.extend_from_slice(embedding.as_bytes());
        out.push(b'}');
    }
    let model = write::string(model);
    out.extend_from_slice(
        format!(r#"],"model":{model},"usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}"#).as_bytes(),
    );
    Response::json(200, out)
}

/// How a list request may use the items: take cached ones (`read`, no older than
/// `max_age_s` seconds when set) and keep new ones (`learn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Use {
    pub read: bool,
    pub max_age_s: Option<u64>,
    pub learn: bool,
}

/// What the leader of a list request whose items are `keys` does; `body` is the
/// request's. `None` when the items change nothing: a list of one (its whole answer is
/// its item's), or none cached and none to keep.
pub(crate) fn plan(
    store: &impl CasStore,
    config: &Config,
    keys: &[Key],
    body: &[u8],
    using: Use,
    now_ms: u64,
) -> Option<Plan> {
    if keys.len() < 2 {
        return None;
    }
    let mut budget = MAX_CACHED_BYTES;
    let found: Vec<Option<Item>> = keys
        .iter()
        .map(|k| {
            let young = |e: &cache::Entry| using.max_age_s.is_none_or(|m| e.age_ms(now_ms) <= m.saturating_mul(1000));
            let entry = cache::get(store, config, k).filter(|e| using.read && e.is_fresh(now_ms) && young(e))?;
            budget = budget.checked_sub(entry.response.body.len())?;
            Item::read(&entry.response.body, entry.stored_at_ms)
        })
        .collect();
    let cached = whole_groups(keys, found);
    let cached_tokens = tokens_of(&cached);
    let batch = Batch { keys: keys.to_vec(), cached, cached_tokens, learn: using.learn };
    let missing: Vec<usize> = batch.missing().collect();
    if missing.is_empty() {
        let items: Vec<&Item> = batch.cached.iter().flatten().collect();
        let oldest = items.iter().map(|i| i.stored_at_ms).min().unwrap_or(now_ms);
        let model = items.first().map(|i| i.model.as_str()).unwrap_or_default();
        let data: Vec<&str> = items.iter().map(|i| i.embedding.as_str()).collect();
        let fresh = Fresh { stored_at_ms: oldest, ttl_ms: config.cache.ttl_seconds.saturating_mul(1000) };
        return Some(Plan::Answered(list(&data, model, cached_tokens), fresh));
    }
    if missing.len() == keys.len() {
        return using.learn.then(|| Plan::Call(Rc::new(batch), None));
    }
    let rewritten = subset(body, &missing)?;
    Some(Plan::Call(Rc::new(batch), Some(rewritten)))
}

/// The cached items that can be used: those of groups present whole in the request, each
/// member once, and all of one model; the others are left to the call.
fn whole_groups(keys: &[Key], found: Vec<Option<Item>>) -> Vec<Option<Item>> {
    let mut seen = Counts::default();
    for k in keys {
        *seen.entry(k.hex()).or_default() += 1;
    }
    let once = |k: &Key| seen.get(k.hex()) == Some(&1);
    let mut members = Counts::default();
    for (k, item) in keys.iter().zip(&found) {
        if let Some(i) = item.as_ref().filter(|_| once(k)) {
            *members.entry(&i.group).or_default() += 1;
        }
    }
    let whole = |k: &Key, i: &Item| once(k) && members.get(i.group.as_str()) == Some(&(i.size as u64));
    let model = keys.iter().zip(&found).find_map(|(k, i)| i.as_ref().filter(|i| whole(k, i)).map(|i| i.model.clone()));
    let kept: Vec<bool> = keys
        .iter()
        .zip(&found)
        .map(|(k, i)| i.as_ref().is_some_and(|i| whole(k, i) && Some(&i.model) == model.as_ref()))
        .collect();
    found.into_iter().zip(kept).map(|(item, keep)| item.filter(|_| keep)).collect()
}

/// The tokens of the groups the cached items belong to, each group once.
fn tokens_of(cached: &[Option<Item>]) -> u64 {
    let mut groups = Counts::default();
    for i in cached.iter().flatten() {
        groups.insert(&i.group, i.tokens);
    }
    groups.values().sum()
}

/// A number per name: the one map type this file uses (each type compiles its own copy
/// of the map's code into the plugin). Its hasher has fixed keys: a random one would make
/// the component import `wasi:random/insecure-seed`; the names are SHA-256 digests and the
/// edge's group ids, at most 2,048 of them.
type Counts<'a> = HashMap<&'a str, u64, BuildHasherDefault<DefaultHasher>>;

/// The request body with only the items at `positions` in its `input`.
fn subset(body: &[u8], positions: &[usize]) -> Option<Vec<u8>> {
    let Value::Object(mut map) = json::parse(body)? else { return None };
    let items = map.get("input")?.as_array()?;
    let kept: Vec<Value> = positions.iter().filter_map(|&i| items.get(i).cloned()).collect();
    map.insert("input".into(), Value::Array(kept));
    Some(write::value(&Value::Object(map)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::item_keys;
    use crate::core::store::MemStore;
    use serde_json::json;
    use serde_json::Map;

    const ALL: Use = Use { read: true, max_age_s: None, learn: true };

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
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&first), &body(&first), ALL, 0) else {
            panic!("nothing cached: the whole request goes")
        };
        let whole = answer(&first);
        assert_eq!(batch.finish(&store, &config, whole.clone(), 0), whole, "HolySheep's own answer");
        let second = ["alpha", "new", "beta", "gamma"];
        let Some(Plan::Call(batch, Some(sent))) = plan(&store, &config, &keys(&second), &body(&second), ALL, 1) else {
            panic!("three cached, one to embed")
        };
        assert_eq!(sent, body(&["new"]), "only the new item is sent");
        let assembled = batch.finish(&store, &config, answer(&["new"]), 1);
        assert_eq!(read(&assembled), read(&answer(&second)), "vectors at their indices, usage of the whole list");
        // Both calls' items are cached now: the list again needs no call.
        let Some(Plan::Answered(r, _)) = plan(&store, &config, &keys(&second), &body(&second), ALL, 2) else {
            panic!("all cached")
        };
        assert_eq!(read(&r), read(&answer(&second)));
    }

    #[test]
    fn one_list_displaces_at_most_a_sixteenth_of_a_full_cache_however_often_it_comes() {
        let (store, config) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let entries = crate::core::cache::tests::entries;
        let hot: Vec<Key> =
            (0..400u32).map(|i| crate::core::request::request_key("/p", "s", &i.to_le_bytes())).collect();
        for k in &hot {
            for _ in 0..2 {
                cache::put(&store, &config, k, &Response::json(200, b"{}".to_vec()), 0, Evict::Asked);
            }
        }
        let held: Vec<&Key> = hot.iter().filter(|k| cache::get(&store, &config, k).is_some()).collect();
        assert_eq!((entries(&store), held.len()), (64, 64), "a full cache of answers asked again");
        let inputs: Vec<String> = (0..40).map(|i| format!("scan {i}")).collect();
        let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        for (round, still) in [(1, 64), (2, 60), (3, 56)] {
            let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&inputs), &body(&inputs), ALL, round)
            else {
                panic!("round {round}: a list the cache does not hold goes whole")
            };
            batch.finish(&store, &config, answer(&inputs), round);
            let kept = held.iter().filter(|k| cache::get(&store, &config, k).is_some()).count();
            assert_eq!(kept, still, "round {round}: at most 64 / 16 = 4 answers displaced by one list");
        }
    }

    #[test]
    fn cached_items_whose_group_is_not_whole_are_embedded_again() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta", "gamma"];
        let Some(Plan::Call(batch, _)) = plan(&store, &config, &keys(&first), &body(&first), ALL, 0) else { panic!() };
        batch.finish(&store, &config, answer(&first), 0);
        // Only two of the group's three: their share of its tokens cannot be told.
        let part = ["alpha", "beta", "delta"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&part), &body(&part), ALL, 1) else {
            panic!("the whole list goes")
        };
        assert_eq!(read(&batch.finish(&store, &config, answer(&part), 1)), read(&answer(&part)));
        // An item twice: HolySheep bills it twice, which no group says, so its group is not
        // whole once and the list goes as it is (and is not learned: alpha's share is unknown).
        let (fresh, twice) = (MemStore::new(), ["alpha", "beta", "gamma", "alpha"]);
        let Some(Plan::Call(batch, _)) = plan(&fresh, &config, &keys(&first), &body(&first), ALL, 0) else { panic!() };
        batch.finish(&fresh, &config, answer(&first), 0);
        assert!(matches!(plan(&fresh, &config, &keys(&twice), &body(&twice), ALL, 2), Some(Plan::Call(_, None))));
        // No read (no-cache): nothing is taken from the cache.
        assert!(matches!(
            plan(&store, &config, &keys(&first), &body(&first), Use { read: false, ..ALL }, 3),
            Some(Plan::Call(_, None))
        ));
        assert_eq!(
            plan(&store, &config, &keys(&["zeta", "eta"]), &body(&["zeta", "eta"]), Use { learn: false, ..ALL }, 3),
            None
        );
    }

    #[test]
    fn an_answer_that_does_not_fit_the_items_sent_is_refused_and_a_whole_one_passes_as_it_is() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&first), &body(&first), ALL, 0) else {
            panic!()
        };
        let odd = Response::json(200, br#"{"object":"list","data":[],"model":"e"}"#.to_vec());
        assert_eq!(batch.finish(&store, &config, odd.clone(), 0), odd, "the request itself: HolySheep's answer");
        assert!(cache::get(&store, &config, &keys(&first)[0]).is_none(), "nothing learned from it");
        batch.finish(&store, &config, answer(&first), 0);
        let more = ["alpha", "beta", "gamma"];
        let Some(Plan::Call(batch, Some(_))) = plan(&store, &config, &keys(&more), &body(&more), ALL, 1) else {
            panic!()
        };
        assert_eq!(batch.finish(&store, &config, answer(&["gamma", "delta"]), 1).status, 502, "two vectors for one");
    }

    #[test]
    fn a_cached_item_older_than_the_requests_max_age_is_embedded_again() {
        let (store, config) = (MemStore::new(), Config::default());
        let first = ["alpha", "beta"];
        let Some(Plan::Call(batch, None)) = plan(&store, &config, &keys(&first), &body(&first), ALL, 0) else {
            panic!()
        };
        batch.finish(&store, &config, answer(&first), 0);
        let Some(Plan::Answered(r, fresh)) = plan(&store, &config, &keys(&first), &body(&first), ALL, 5_000) else {
            panic!()
        };
        assert_eq!((read(&r), fresh.stored_at_ms), (read(&answer(&first)), 0), "as old as its items");
        let strict = Use { max_age_s: Some(4), ..ALL };
        assert!(matches!(
            plan(&store, &config, &keys(&first), &body(&first), strict, 5_000),
            Some(Plan::Call(_, None))
        ));
        assert_eq!(
            plan(&store, &config, &keys(&["one"]), &body(&["one"]), ALL, 0),
            None,
            "a list of one is its own entry"
        );
    }
}
