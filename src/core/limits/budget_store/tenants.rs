//! The tenants table kept in the spend store (`budget_store.tenants`), sans-IO. Each tenant
//! is a record at `<prefix>/tenants/<name>`, as `holysheep-admin` writes it:
//!
//! ```json
//! {"tenant": {"keys_sha256": ["…"], "usd_per_day": 5},
//!  "changed": {"by": "alice", "at_ms": 1765152000000, "why": "onboarding"}}
//! ```
//!
//! `tenant` is what the configuration's `tenants.<name>` holds. One worker of a process
//! reads every record each `budget_store.tenants_poll_ms` (`poll_due`, `read_call`);
//! `polled` turns the answer into the table the process serves, kept in shared data
//! (`TABLE_KEY`), from which every worker rebuilds its configuration
//! (`Config::with_tenants`). A record that is not one (too long, not JSON, a field the
//! configuration refuses, a name that is no tenant's) is refused, logged and counted by its
//! name, and that tenant's last good record stays; a table the configuration refuses as a
//! whole (one key digest under two tenants, more than `max_tenants`) leaves the last good
//! table in force. So does a store that does not answer.

use super::{base64, EtcdCall};
use crate::core::api::call::HttpCall;
use crate::core::api::note::Note;
use crate::core::config::named::Named;
use crate::core::config::tenants::{Keys, Tenant};
use crate::core::config::Config;
use crate::core::store::{cas_after, CasStore};
use crate::core::wire::{json, write};
use serde_json::{Map, Value};

/// When the last read of the table began (one worker of the process claims each).
pub const POLL_KEY: &str = "holysheep/tenants/poll";
/// The table the process serves (`Table::to_json`).
pub const TABLE_KEY: &str = "holysheep/tenants/table";
/// The most bytes one record may hold.
pub const MAX_RECORD_BYTES: usize = 16 << 10;
/// The longest tenant name (names go into metric names, so only letters, digits, `-`, `_`).
pub const MAX_NAME: usize = 64;

/// The most bytes an answer to `read_call` may hold: every record at its largest, in
/// base64, with room for etcd's fields. A longer one is not read.
pub fn max_answer_bytes(config: &Config) -> usize {
    (config.budget_store.max_tenants as usize + 1) * (MAX_RECORD_BYTES * 4 / 3 + 1024)
}

/// The keys of the table's records.
pub fn records_prefix(config: &Config) -> String {
    format!("{}/tenants/", config.budget_store.prefix)
}

/// Whether `name` may name a tenant of the store's table: as in the configuration.
pub use crate::core::config::tenants::valid_name;

/// Whether `tenant` is a tenant the configuration reads under `name` (its own fields; the
/// models and prices it meets are each node's): what `holysheep-admin` checks before it
/// writes a record.
pub fn check(name: &str, tenant: &Value) -> Result<(), String> {
    if !valid_name(name) {
        return Err(format!("a tenant's name is 1 to {MAX_NAME} of a-z, A-Z, 0-9, '-' and '_'"));
    }
    let tenant = Tenant::read(&format!("tenants.{name}"), tenant).map_err(|e| e.to_string())?;
    // Its keys as every node takes them: 1 to 16 digests of 64 hex digits, none twice.
    Keys::of(&Named::from([(name.to_owned(), tenant)])).map(|_| ())
}

/// Whether `tenants` (name to tenant: a whole table) is one every node takes as a table:
/// each tenant as `check` says, no two whose counters would be one, no key digest under
/// two tenants, at most 1,024 of them.
pub fn check_all(tenants: &Map<String, Value>) -> Result<(), String> {
    let mut read = Named::default();
    for (name, tenant) in tenants {
        check(name, tenant)?;
        read.insert(name.clone(), Tenant::read(&format!("tenants.{name}"), tenant).map_err(|e| e.to_string())?);
    }
    Keys::of(&read).map(|_| ())
}

/// Whether this worker reads the table now (at most one read a `tenants_poll_ms` per
/// process).
pub fn poll_due(store: &impl CasStore, config: &Config, now_ms: u64) -> bool {
    super::claim_period(store, POLL_KEY, config.budget_store.tenants_poll_ms, now_ms)
}

/// The read of every record (one more than `max_tenants`, to see a table past it).
pub fn read_call(config: &Config) -> HttpCall {
    let prefix = records_prefix(config);
    let end = format!("{}0", &prefix[..prefix.len() - 1]);
    let body = json::object([
        ("key", Value::from(base64::encode(prefix.as_bytes()))),
        ("range_end", Value::from(base64::encode(end.as_bytes()))),
        ("limit", Value::from((u64::from(config.budget_store.max_tenants) + 1).to_string())),
    ]);
    EtcdCall { path: "/v3/kv/range", body: write::value(&body) }.http(config)
}

/// The table the process serves: each tenant's last good record with the store's
/// revision of its key (`{"mod_revision": n, "record": {...}}`), and the records refused,
/// by name, at the revision refused (each is logged and counted once). Kept as JSON
/// objects: shared data holds it as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    pub records: Map<String, Value>,
    pub refused: Map<String, Value>,
    /// etcd's revision of the read it came from: an older read's answer, arriving late,
    /// never replaces it.
    pub revision: u64,
}

impl Table {
    /// As shared data keeps it.
    pub fn to_json(&self) -> Vec<u8> {
        let records = Value::Object(self.records.clone());
        let refused = Value::Object(self.refused.clone());
        write::value(&json::object([("records", records), ("refused", refused), ("revision", self.revision.into())]))
    }

    pub fn read(bytes: &[u8]) -> Option<Table> {
        let Value::Object(mut v) = json::parse(bytes)? else { return None };
        let revision = v.get("revision").and_then(Value::as_u64).unwrap_or(0);
        let mut take = |f: &str| match v.remove(f) {
            Some(Value::Object(m)) => Some(m),
            _ => None,
        };
        Some(Table { records: take("records")?, refused: take("refused")?, revision })
    }

    /// The `tenants` section it amounts to (`Config::with_tenants`).
    pub fn tenants(&self) -> Value {
        let tenants = self.records.iter().map(|(name, k)| (name.clone(), k["record"]["tenant"].clone()));
        Value::Object(tenants.collect())
    }

    /// The store's revision of `name`'s kept record.
    fn revision(&self, name: &str) -> Option<u64> {
        self.records.get(name)?.get("mod_revision")?.as_u64()
    }
}

/// What a read of the table did.
#[derive(Debug, Default, PartialEq)]
pub struct Polled {
    /// The table to serve from now on (`None`: the one served stays).
    pub table: Option<Table>,
    /// What the log says: each tenant added, changed or removed, by whom and why; each
    /// record refused, and why.
    pub notes: Vec<Note>,
    /// The names of the records refused by this read (each counted once).
    pub refused: Vec<String>,
}

/// Reads the store's answer to `read_call` (`status`, `body`) against `last`, the table
/// served now; `config` is the configuration the table goes into.
pub fn polled(config: &Config, last: &Table, status: u16, body: &[u8]) -> Polled {
    let mut out = Polled::default();
    let Some(v) = json::parse(body).filter(|v| status == 200 && v.get("header").is_some()) else { return out };
    let revision = v["header"].get("revision").and_then(super::number).unwrap_or(0);
    if revision < last.revision {
        return out; // an earlier read's answer, come late
    }
    let kvs = v.get("kvs").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    if kvs.len() > config.budget_store.max_tenants as usize {
        let why = format!(
            "holysheep: the spend store's tenants table holds more than budget_store.max_tenants ({}): the last good \
             table stays in force",
            config.budget_store.max_tenants
        );
        out.notes.push(Note::Error(why));
        return out;
    }
    let prefix = records_prefix(config);
    // Each record: its name, revision, and the versions that may serve (its new one if
    // it reads, else why not; its last good one).
    let mut entries = Vec::with_capacity(kvs.len());
    for kv in kvs {
        let key = kv.get("key").and_then(Value::as_str).and_then(base64::decode).unwrap_or_default();
        let name = String::from_utf8_lossy(&key).strip_prefix(prefix.as_str()).unwrap_or_default().to_owned();
        let mod_revision = kv.get("mod_revision").and_then(super::number).unwrap_or(0);
        let good = last.records.get(&name).cloned();
        let new = match last.revision(&name) == Some(mod_revision) {
            true => good.clone().ok_or_else(String::new),
            false => {
                let value = kv.get("value").and_then(Value::as_str).and_then(base64::decode).unwrap_or_default();
                let kept = |record| json::object([("mod_revision", Value::from(mod_revision)), ("record", record)]);
                record(config, &name, &value).map(kept)
            }
        };
        entries.push((name, mod_revision, new, good));
    }
    let mut table = Table { revision, ..Table::default() };
    let mut all = Map::new();
    for (name, _, new, good) in &entries {
        if let Some(kept) = new.as_ref().ok().or(good.as_ref()) {
            all.insert(name.clone(), kept.clone());
        }
    }
    let fits = |records: &Map<String, Value>| {
        let mut tenants = Map::new();
        for (name, kept) in records {
            tenants.insert(name.clone(), kept["record"]["tenant"].clone());
        }
        config.with_tenants(&Value::Object(tenants))
    };
    if fits(&all).is_ok() {
        table.records = all;
    } else {
        // Records that clash with others (a name whose counters would be another's, a key
        // digest under two tenants): the records served before come first, then the
        // changed ones in key order; one that clashes with those taken before it is
        // refused, and its last good version serves if that fits.
        let served_before = |(name, rev, _, _): &(String, u64, _, _)| last.revision(name) == Some(*rev);
        let (before, changed): (Vec<_>, Vec<_>) = entries.into_iter().partition(served_before);
        entries = before;
        entries.extend(changed);
        for (name, _, new, good) in &mut entries {
            let taken = |kept: &Value| {
                let mut with = table.records.clone();
                with.insert(name.clone(), kept.clone());
                fits(&with).map(|_| with)
            };
            if let Ok(kept) = new.as_ref().map(Clone::clone) {
                match taken(&kept) {
                    Ok(with) => {
                        table.records = with;
                        continue;
                    }
                    Err(e) => *new = Err(e.to_string()),
                }
            }
            if let Some(with) = good.as_ref().and_then(|g| taken(g).ok()) {
                table.records = with;
            }
        }
    }
    for (name, mod_revision, new, good) in entries {
        let Err(why) = new else {
            if last.revision(&name) != Some(mod_revision) {
                let record = table.records.get(&name).map(|k| &k["record"]).unwrap_or(&Value::Null);
                out.notes.push(Note::Info(changed(&name, record, good.is_some())));
            }
            continue;
        };
        if last.refused.get(&name).and_then(Value::as_u64) != Some(mod_revision) {
            let kept = match table.records.contains_key(&name) {
                true => "its last good record stays",
                false => "it is left out",
            };
            out.notes.push(Note::Error(format!(
                "holysheep: the spend store's record of tenant {name:?} is refused ({why}): {kept}"
            )));
            out.refused.push(name.clone());
        }
        table.refused.insert(name, Value::from(mod_revision));
    }
    for gone in last.records.keys().filter(|n| !kvs_hold(&table, n)) {
        out.notes.push(Note::Info(format!("holysheep: tenant {gone:?} removed from the spend store's table")));
    }
    if table.records == last.records && table.refused == last.refused {
        return Polled { notes: Vec::new(), ..out };
    }
    out.table = Some(table);
    out
}

/// The store answered a read of the table (`status`, `body`; `None`: no answer): the table
/// the process serves is replaced in `store` (shared data) when it changed. What the read
/// did, for the shell's log and counter.
pub fn answered(store: &impl CasStore, config: &Config, heard: Option<(u16, &[u8])>) -> Polled {
    let Some((status, body)) = heard else { return Polled::default() };
    let Ok(read) = store.get(TABLE_KEY) else { return Polled::default() };
    let last = read.value.as_deref().and_then(Table::read).unwrap_or_default();
    let polled = polled(config, &last, status, body);
    if let Some(table) = &polled.table {
        // A worker that wrote the table since reads it again next period.
        let _ = store.set(TABLE_KEY, &table.to_json(), cas_after(&read));
    }
    polled
}

/// The configuration a worker serves under `base` (the file's), when the table in `store`
/// is not the one it applied last (`applied`: the table's shared-data version): that
/// version, and the configuration with the table's tenants and the names of the records
/// left out because they do not fit `base` (a reload that took a price away, say), or why
/// no table fits it.
pub fn served(store: &impl CasStore, base: &Config, applied: Option<u32>) -> Option<(u32, Served)> {
    let read = store.get(TABLE_KEY).ok()?;
    let (value, cas) = (read.value?, read.cas?);
    if applied == Some(cas) {
        return None;
    }
    let table = Table::read(&value).unwrap_or_default();
    let served = match base.with_tenants(&table.tenants()) {
        Ok(config) => Ok((config, Vec::new())),
        Err(whole) => {
            let mut fit = Map::new();
            let mut left_out = Vec::new();
            for (name, kept) in &table.records {
                let mut with = fit.clone();
                with.insert(name.clone(), kept["record"]["tenant"].clone());
                match base.with_tenants(&Value::Object(with.clone())) {
                    Ok(_) => fit = with,
                    Err(_) => left_out.push(name.clone()),
                }
            }
            base.with_tenants(&Value::Object(fit)).map(|c| (c, left_out)).map_err(|_| whole)
        }
    };
    Some((cas, served))
}

/// What a worker serves of the table: the configuration with it, and the tenants left out;
/// or why none of it fits.
pub type Served = Result<(Config, Vec<String>), crate::core::config::ConfigError>;

fn kvs_hold(table: &Table, name: &str) -> bool {
    table.records.contains_key(name) || table.refused.contains_key(name)
}

/// One record, checked: a tenant the configuration takes on its own.
fn record(config: &Config, name: &str, value: &[u8]) -> Result<Value, String> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(format!("longer than {MAX_RECORD_BYTES} bytes"));
    }
    let Some(Value::Object(record)) = json::parse(value) else { return Err("not a JSON object".into()) };
    let Some(tenant) = record.get("tenant").filter(|t| t.is_object()) else {
        return Err("no \"tenant\" object".into());
    };
    check(name, tenant)?;
    let mut one = Map::new();
    one.insert(name.to_owned(), tenant.clone());
    config.with_tenants(&Value::Object(one)).map_err(|e| e.to_string())?;
    Ok(Value::Object(record))
}

/// What the log says of a record added or changed: by whom, when and why (as the record
/// says, on one line of at most 200 characters each).
fn changed(name: &str, record: &Value, before: bool) -> String {
    let c = &record["changed"];
    let what = if before { "changed" } else { "added" };
    let line = |t: &str| t.chars().take(200).map(|ch| if ch.is_control() { ' ' } else { ch }).collect::<String>();
    let by = c["by"].as_str().map_or("an unnamed operator".into(), line);
    let why = c["why"].as_str().map_or(String::new(), |w| format!(": {}", line(w)));
    let at = c["at_ms"].as_u64().map_or(String::new(), |ms| format!(" at {ms} ms"));
    format!("holysheep: tenant {name:?} {what} in the spend store's table by {by}{at}{why}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::MemStore;
    use serde_json::json;

    fn config() -> Config {
        Config::parse(br#"{"budget_store":{"cluster":"etcd","tenants":true},"models":{"gpt-4.1":{}}}"#).unwrap()
    }

    /// etcd's answer holding these records (name, mod_revision, value).
    fn answer(records: &[(&str, u64, Vec<u8>)]) -> Vec<u8> {
        let kvs: Vec<Value> = records
            .iter()
            .map(|(name, rev, value)| {
                json!({"key": base64::encode(format!("holysheep/tenants/{name}").as_bytes()),
                       "mod_revision": rev.to_string(), "value": base64::encode(value)})
            })
            .collect();
        json!({"header": {"revision": "99"}, "kvs": kvs, "count": records.len().to_string()}).to_string().into_bytes()
    }

    fn tenant(digest: char, by: &str) -> Vec<u8> {
        json!({"tenant": {"keys_sha256": [digest.to_string().repeat(64)]}, "changed": {"by": by, "why": "test"}})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn the_stores_records_become_the_table_and_a_bad_one_keeps_its_last_good_record() {
        let c = config();
        let first = polled(&c, &Table::default(), 200, &answer(&[("acme", 5, tenant('a', "alice"))]));
        let table = first.table.expect("a table");
        assert_eq!(table.tenants(), json!({"acme": {"keys_sha256": ["a".repeat(64)]}}));
        assert!(matches!(&first.notes[..], [Note::Info(n)] if n.contains("\"acme\" added") && n.contains("by alice")));
        let served = c.with_tenants(&table.tenants()).unwrap();
        assert!(served.keys.verify(Some("Bearer nope")).is_err(), "a table is in force");
        assert_eq!(Table::read(&table.to_json()), Some(table.clone()), "kept in shared data as it is");

        // The same answer again: nothing changes, nothing is logged.
        assert_eq!(polled(&c, &table, 200, &answer(&[("acme", 5, tenant('a', "alice"))])), Polled::default());

        // A malformed change is refused once, by name; the last good record stays.
        let bad = br#"{"tenant":{"usd_per_day":"five"}}"#.to_vec();
        let refused = polled(&c, &table, 200, &answer(&[("acme", 6, bad.clone()), ("beta", 7, b"{".to_vec())]));
        assert_eq!(refused.refused, ["acme", "beta"]);
        let kept = refused.table.expect("the refusals are remembered");
        assert_eq!(kept.tenants(), table.tenants(), "acme's last good record, and no beta");
        let again = polled(&c, &kept, 200, &answer(&[("acme", 6, bad), ("beta", 7, b"{".to_vec())]));
        assert_eq!(again, Polled::default(), "logged and counted once");

        // A record that clashes with one before it (a key digest under two tenants, a name
        // whose counters would be another's) is refused alone; the rest goes on.
        let clash = answer(&[
            ("Acme", 9, tenant('c', "x")),
            ("acme", 5, tenant('a', "x")),
            ("beta", 8, tenant('a', "x")),
            ("gamma", 3, tenant('d', "x")),
        ]);
        let p = polled(&c, &table, 200, &clash);
        assert_eq!(p.refused, ["Acme", "beta"], "{:?}", p.notes);
        let served = p.table.expect("the rest is served").tenants();
        let names: Vec<&String> = served.as_object().unwrap().keys().collect();
        assert_eq!(names, ["acme", "gamma"], "the tenant served before stays; Acme and beta clash with it");
        // An earlier read's answer, arriving after a later one, changes nothing.
        let newer = Table { revision: 120, ..table.clone() };
        assert_eq!(polled(&c, &newer, 200, &answer(&[])), Polled::default());

        // Removed: the table goes; a store that does not answer changes nothing.
        let removed = polled(&c, &table, 200, &answer(&[]));
        assert_eq!(removed.table.map(|t| t.tenants()), Some(json!({})));
        assert_eq!(polled(&c, &table, 503, b"unavailable"), Polled::default());
        assert_eq!(polled(&c, &table, 200, b"{}"), Polled::default(), "not etcd's answer");
    }

    #[test]
    fn an_empty_table_still_requires_a_tenants_key_and_names_and_sizes_are_bounded() {
        let c = config();
        let empty = c.with_tenants(&json!({})).unwrap();
        assert!(!empty.keys.is_empty(), "no tenant listed never opens the edge");
        assert!(empty.keys.verify(Some("Bearer anything")).is_err());
        let long = vec![b' '; MAX_RECORD_BYTES + 1];
        let p = polled(&c, &Table::default(), 200, &answer(&[("a.b", 1, tenant('a', "x")), ("big", 2, long)]));
        assert_eq!(p.refused, ["a.b", "big"]);
        let many = Config::parse(br#"{"budget_store":{"cluster":"etcd","tenants":true,"max_tenants":1}}"#).unwrap();
        let two = answer(&[("a", 1, tenant('a', "x")), ("b", 2, tenant('b', "x"))]);
        assert!(polled(&many, &Table::default(), 200, &two).table.is_none());
    }

    #[test]
    fn an_answer_replaces_the_table_in_shared_data_and_each_worker_serves_it_once() {
        let (s, c) = (MemStore::default(), config());
        assert!(served(&s, &c, None).is_none(), "no table yet: the file's tenants serve");
        let body = answer(&[("acme", 5, tenant('a', "alice"))]);
        assert!(answered(&s, &c, Some((200, &body))).table.is_some());
        let (version, served_config) = served(&s, &c, None).expect("a table to serve");
        assert!(served_config.unwrap().0.tenants.contains_key("acme"));
        // A reload that no longer fits one record leaves that one out, not the table.
        let strict = Config::parse(br#"{"budget_store":{"cluster":"etcd","tenants":true},"models":{"m":{}}}"#).unwrap();
        let two = answer(&[("acme", 5, tenant('a', "x")), ("beta", 6, tenant('b', "x"))]);
        let s2 = MemStore::default();
        assert!(answered(&s2, &c, Some((200, &two))).table.is_some());
        let mut budgeted: Table = Table::read(&s2.get(TABLE_KEY).unwrap().value.unwrap()).unwrap();
        budgeted.records["beta"]["record"]["tenant"]["usd_per_day"] = Value::from(5);
        s2.set(TABLE_KEY, &budgeted.to_json(), None).unwrap();
        let (_, fitted) = served(&s2, &strict, None).unwrap();
        let (config, left_out) = fitted.unwrap();
        assert_eq!((config.tenants.contains_key("acme"), left_out), (true, vec!["beta".to_owned()]));
        assert!(served(&s, &c, Some(version)).is_none(), "served once per change");
        assert_eq!(answered(&s, &c, Some((200, &body))), Polled::default(), "unchanged: not written again");
        assert!(served(&s, &c, Some(version)).is_none());
        assert_eq!(answered(&s, &c, None), Polled::default(), "no answer: the table stays");
    }

    #[test]
    fn one_worker_of_a_process_reads_the_table_each_period() {
        let (s, c) = (MemStore::default(), config());
        assert!(poll_due(&s, &c, 10_000));
        assert!(!poll_due(&s, &c, 10_500), "within the period");
        assert!(poll_due(&s, &c, 11_000));
        let call = read_call(&c);
        let body: Value = serde_json::from_slice(&call.body).unwrap();
        let decoded = |f: &str| String::from_utf8(base64::decode(body[f].as_str().unwrap()).unwrap()).unwrap();
        assert_eq!((decoded("key"), decoded("range_end")), ("holysheep/tenants/".into(), "holysheep/tenants0".into()));
        assert_eq!(body["limit"], "1001");
    }
}
