//! `holysheep-admin`: the operators' command line of holysheep-edge. It keeps the tenants
//! table in the spend store's etcd (`<prefix>/tenants/<name>`), where every node that runs
//! with `budget_store.tenants` reads it, and writes an audit record of every change
//! (`<prefix>/audit/...`): who, when, what and why. See docs/operations.md#the-admin-command.

mod etcd;

use etcd::{Etcd, Kv};
use holysheep_edge::core::limits::budget_store::tenants::{self, MAX_RECORD_BYTES};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

const USAGE: &str = "usage: holysheep-admin [--etcd URL] [--prefix PREFIX] [--operator NAME] COMMAND

  tenant add NAME [FIELDS] --reason TEXT     a new tenant, with its first key: its token is printed once
  tenant set NAME [FIELDS] --reason TEXT     change a tenant's fields
  tenant remove NAME --reason TEXT           remove a tenant and every key of it
  tenant show NAME                           its record, as JSON
  tenant list                                every tenant, one per line
  key add NAME --reason TEXT                 a new key: its token is printed once
  key rotate NAME DIGEST --reason TEXT       a new key in place of the one whose digest starts with DIGEST
  key revoke NAME DIGEST --reason TEXT       revoke the key whose digest starts with DIGEST
  audit [--limit N]                          the latest changes, oldest first, as JSON lines

FIELDS (\"none\" clears one): --usd-per-day X  --usd-per-month X  --requests-per-minute N
  --tokens-per-minute N  --burst N  --models a,b  --priority CLASS  --prompt-cache-affinity true|false

--etcd defaults to $HOLYSHEEP_ETCD or http://127.0.0.1:2379, --prefix to $HOLYSHEEP_PREFIX or
holysheep (budget_store.prefix), --operator to $HOLYSHEEP_OPERATOR or $USER.";

/// The tenant fields the command line sets, and the configuration's name of each.
const FIELDS: [(&str, &str); 8] = [
    ("--usd-per-day", "usd_per_day"),
    ("--usd-per-month", "usd_per_month"),
    ("--requests-per-minute", "requests_per_minute"),
    ("--tokens-per-minute", "tokens_per_minute"),
    ("--burst", "burst"),
    ("--models", "models"),
    ("--priority", "priority"),
    ("--prompt-cache-affinity", "prompt_cache_affinity"),
];

/// The least of a key's digest that names it.
const DIGEST_PREFIX_MIN: usize = 8;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            if !out.is_empty() {
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("holysheep-admin: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The command line, read.
struct Args {
    etcd: String,
    prefix: String,
    operator: String,
    reason: Option<String>,
    limit: u64,
    /// The tenant fields given (configuration name, value as typed).
    fields: Vec<(&'static str, String)>,
    words: Vec<String>,
}

impl Args {
    fn read(args: &[String]) -> Result<Args, String> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut a = Args {
            etcd: env("HOLYSHEEP_ETCD").unwrap_or_else(|| "http://127.0.0.1:2379".into()),
            prefix: env("HOLYSHEEP_PREFIX").unwrap_or_else(|| "holysheep".into()),
            operator: env("HOLYSHEEP_OPERATOR").or_else(|| env("USER")).unwrap_or_default(),
            reason: None,
            limit: 100,
            fields: Vec::new(),
            words: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = || it.next().cloned().ok_or_else(|| format!("{arg} needs a value"));
            match arg.as_str() {
                "--etcd" => a.etcd = value()?,
                "--prefix" => a.prefix = value()?,
                "--operator" => a.operator = value()?,
                "--reason" => a.reason = Some(value()?),
                "--limit" => a.limit = value()?.parse().map_err(|_| "--limit: a whole number")?,
                "-h" | "--help" => return Err(USAGE.into()),
                flag if flag.starts_with("--") => {
                    let (_, field) =
                        FIELDS.iter().find(|(f, _)| *f == flag).ok_or_else(|| format!("{flag}?\n{USAGE}"))?;
                    a.fields.push((field, value()?));
                }
                _ => a.words.push(arg.clone()),
            }
        }
        if a.operator.is_empty() {
            return Err("who makes the change: --operator NAME (or $HOLYSHEEP_OPERATOR)".into());
        }
        Ok(a)
    }

    /// The reason a change must give.
    fn reason(&self) -> Result<&str, String> {
        self.reason.as_deref().filter(|r| !r.trim().is_empty()).ok_or_else(|| "a change needs --reason TEXT".into())
    }
}

fn run(args: &[String]) -> Result<String, String> {
    let a = Args::read(args)?;
    let admin = Admin { etcd: Etcd::new(&a.etcd)?, prefix: a.prefix.clone(), operator: a.operator.clone() };
    let words: Vec<&str> = a.words.iter().map(String::as_str).collect();
    match words[..] {
        ["tenant", "add", name] => {
            let (token, digest) = new_key()?;
            admin.change(name, "tenant add", a.reason()?, |record| {
                if record.is_some() {
                    return Err(format!("tenant {name} exists: change it with tenant set"));
                }
                let mut tenant = json!({"keys_sha256": [digest]});
                set_fields(&mut tenant, &a.fields)?;
                Ok((Some(tenant), format!("{}, added {}", fields_detail(&a.fields), &digest[..12])))
            })?;
            Ok(shown_once(&token, &digest, name))
        }
        ["tenant", "set", name] => admin.change(name, "tenant set", a.reason()?, |record| {
            let mut tenant = existing(name, record)?;
            if a.fields.is_empty() {
                return Err("nothing to set: name a field".into());
            }
            set_fields(&mut tenant, &a.fields)?;
            Ok((Some(tenant), fields_detail(&a.fields)))
        }),
        ["tenant", "remove", name] => admin.change(name, "tenant remove", a.reason()?, |_| Ok((None, String::new()))),
        ["tenant", "show", name] => {
            let record = admin.record(name)?.ok_or_else(|| format!("no tenant {name}"))?;
            Ok(serde_json::to_string_pretty(&record.1).unwrap_or_default())
        }
        ["tenant", "list"] => admin.list(),
        ["key", "add", name] => admin.key(name, None, a.reason()?),
        ["key", "rotate", name, digest] => admin.key(name, Some((digest, true)), a.reason()?),
        ["key", "revoke", name, digest] => admin.key(name, Some((digest, false)), a.reason()?),
        ["audit"] => admin.audit(a.limit),
        _ => Err(USAGE.into()),
    }
}

struct Admin {
    etcd: Etcd,
    prefix: String,
    operator: String,
}

impl Admin {
    fn key_of(&self, name: &str) -> String {
        format!("{}/tenants/{name}", self.prefix)
    }

    /// A tenant's record and its revision (a record that is not JSON reads as `null`: it
    /// can be shown, and removed, but not changed).
    fn record(&self, name: &str) -> Result<Option<(u64, Value)>, String> {
        let Some(Kv { value, mod_revision, .. }) = self.etcd.get(&self.key_of(name))? else { return Ok(None) };
        Ok(Some((mod_revision, serde_json::from_slice(&value).unwrap_or(Value::Null))))
    }

    /// Changes tenant `name`'s record as `edit` says (its new `tenant`, `None` to remove
    /// it; and what the audit record says changed), with an audit record beside it, in one
    /// transaction that lands only if the record did not change meanwhile.
    fn change(
        &self,
        name: &str,
        action: &str,
        why: &str,
        edit: impl FnOnce(Option<&Value>) -> Result<(Option<Value>, String), String>,
    ) -> Result<String, String> {
        if !tenants::valid_name(name) {
            return Err(format!("{name}: a tenant's name is 1 to {} of a-z, A-Z, 0-9, '-' and '_'", tenants::MAX_NAME));
        }
        let found = self.record(name)?;
        if found.is_none() && action == "tenant remove" {
            return Err(format!("no tenant {name}"));
        }
        let tenant = found.as_ref().map(|(_, r)| &r["tenant"]);
        let (tenant, detail) = edit(tenant)?;
        let at_ms = now_ms();
        let audit = json!({"at_ms": at_ms, "by": self.operator, "action": action, "tenant": name, "why": why,
            "detail": detail});
        let audit_key = format!("{}/audit/{at_ms:013}-{}", self.prefix, hex(&random::<4>()?));
        let puts = |extra: Option<(String, Vec<u8>)>| {
            let mut puts: Vec<(String, Vec<u8>)> = extra.into_iter().collect();
            puts.push((audit_key.clone(), audit.to_string().into_bytes()));
            puts
        };
        let revision = found.as_ref().map_or(0, |(r, _)| *r);
        let landed = match tenant {
            Some(tenant) => {
                self.check_with(name, &tenant)?;
                let changed = json!({"by": self.operator, "at_ms": at_ms, "why": why});
                let record = json!({"tenant": tenant, "changed": changed}).to_string().into_bytes();
                if record.len() > MAX_RECORD_BYTES {
                    return Err(format!("the record would be longer than {MAX_RECORD_BYTES} bytes"));
                }
                self.etcd.put_if(&self.key_of(name), revision, &puts(Some((self.key_of(name), record))))?
            }
            None => self.etcd.delete_if(&self.key_of(name), revision, &puts(None))?,
        };
        if !landed {
            return Err(format!("tenant {name} changed meanwhile: nothing was written, try again"));
        }
        Ok(String::new())
    }

    /// Whether the table with `tenant` as `name`'s is one every node takes (its name and
    /// its keys clash with no other tenant's).
    fn check_with(&self, name: &str, tenant: &Value) -> Result<(), String> {
        let prefix = format!("{}/tenants/", self.prefix);
        let mut table = Map::new();
        for kv in self.etcd.list(&prefix, 100_000)? {
            let other: Value = serde_json::from_slice(&kv.value).unwrap_or(Value::Null);
            let other_name = kv.key.strip_prefix(&prefix).unwrap_or(&kv.key).to_owned();
            // A record nodes refuse anyway is no clash: it is not in their table.
            let taken = other["tenant"].is_object() && tenants::check(&other_name, &other["tenant"]).is_ok();
            if taken && other_name != name {
                table.insert(other_name, other["tenant"].clone());
            }
        }
        table.insert(name.to_owned(), tenant.clone());
        tenants::check_all(&table)
    }

    /// Adds a key to tenant `name`, or rotates or revokes the one whose digest starts with
    /// `old` (`(digest, rotate)`): a new key's token is printed, once; only its digest is
    /// stored.
    fn key(&self, name: &str, old: Option<(&str, bool)>, why: &str) -> Result<String, String> {
        let (token, digest) = new_key()?;
        let new = old.is_none_or(|(_, rotate)| rotate);
        let action = match old {
            None => "key add",
            Some((_, true)) => "key rotate",
            Some((_, false)) => "key revoke",
        };
        self.change(name, action, why, |record| {
            let mut tenant = existing(name, record)?;
            let mut keys: Vec<String> = tenant["keys_sha256"]
                .as_array()
                .map(|k| k.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                .unwrap_or_default();
            let mut detail = Vec::new();
            if let Some((prefix, _)) = old {
                let prefix = prefix.to_ascii_lowercase();
                if prefix.len() < DIGEST_PREFIX_MIN {
                    return Err(format!("name a key by at least {DIGEST_PREFIX_MIN} hex digits of its digest"));
                }
                let starts = |k: &String| k.to_ascii_lowercase().starts_with(&prefix);
                let matching: Vec<usize> = (0..keys.len()).filter(|i| starts(&keys[*i])).collect();
                let [at] = matching[..] else {
                    return Err(format!("{} keys of {name} have a digest starting {prefix}", matching.len()));
                };
                detail.push(format!("revoked {}", keys[at].chars().take(12).collect::<String>()));
                keys.remove(at);
            }
            if new {
                detail.push(format!("added {}", &digest[..12]));
                keys.push(digest.clone());
            }
            tenant["keys_sha256"] = json!(keys);
            Ok((Some(tenant), detail.join(", ")))
        })?;
        Ok(match new {
            true => shown_once(&token, &digest, name),
            false => String::new(),
        })
    }

    fn list(&self) -> Result<String, String> {
        let prefix = format!("{}/tenants/", self.prefix);
        let lines: Vec<String> = self
            .etcd
            .list(&prefix, 100_000)?
            .iter()
            .map(|kv| {
                let name = kv.key.strip_prefix(&prefix).unwrap_or(&kv.key);
                let record: Value = serde_json::from_slice(&kv.value).unwrap_or(Value::Null);
                let t = &record["tenant"];
                let keys = t["keys_sha256"].as_array().map_or(0, Vec::len);
                let day = t["usd_per_day"].as_f64().map_or("-".into(), |d| format!("{d}"));
                let month = t["usd_per_month"].as_f64().map_or("-".into(), |d| format!("{d}"));
                format!("{name}\tkeys {keys}\tusd_per_day {day}\tusd_per_month {month}")
            })
            .collect();
        Ok(lines.join("\n"))
    }

    /// The latest `limit` audit records, oldest first, one JSON object a line.
    fn audit(&self, limit: u64) -> Result<String, String> {
        let mut records = self.etcd.latest(&format!("{}/audit/", self.prefix), limit)?;
        records.reverse();
        let lines: Vec<String> = records.iter().map(|kv| String::from_utf8_lossy(&kv.value).into_owned()).collect();
        Ok(lines.join("\n"))
    }
}

/// A tenant's `tenant` object, which must exist.
fn existing(name: &str, tenant: Option<&Value>) -> Result<Value, String> {
    tenant.cloned().filter(Value::is_object).ok_or_else(|| format!("no tenant {name}"))
}

/// Sets each of `fields` on `tenant` ("none" removes it), typed as the configuration reads
/// it.
fn set_fields(tenant: &mut Value, fields: &[(&'static str, String)]) -> Result<(), String> {
    let Some(t) = tenant.as_object_mut() else { return Err("a tenant is an object".into()) };
    for (field, text) in fields {
        if text == "none" {
            t.remove(*field);
            continue;
        }
        let value = match *field {
            "usd_per_day" | "usd_per_month" => text.parse::<f64>().ok().map(Value::from),
            "requests_per_minute" | "tokens_per_minute" | "burst" => text.parse::<u64>().ok().map(Value::from),
            "models" => Some(Value::from(text.split(',').map(str::trim).filter(|m| !m.is_empty()).collect::<Vec<_>>())),
            "prompt_cache_affinity" => text.parse::<bool>().ok().map(Value::from),
            _ => Some(Value::from(text.as_str())),
        };
        t.insert((*field).to_owned(), value.ok_or_else(|| format!("{field}: {text:?} is not its kind of value"))?);
    }
    Ok(())
}

/// What the audit record says a tenant change set.
fn fields_detail(fields: &[(&'static str, String)]) -> String {
    let set: Map<String, Value> = fields.iter().map(|(f, v)| ((*f).to_owned(), Value::from(v.as_str()))).collect();
    Value::Object(set).to_string()
}

/// A new key: its token, and the digest that alone is stored.
fn new_key() -> Result<(String, String), String> {
    let token = format!("hs-{}", hex(&random::<24>()?));
    let digest = hex(&Sha256::digest(token.as_bytes()));
    Ok((token, digest))
}

/// What a new key's command prints: the token, then which key it is.
fn shown_once(token: &str, digest: &str, name: &str) -> String {
    format!("{token}\n(key {} of tenant {name}: the token is shown only now)", &digest[..12])
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `N` bytes from the system's random source (a token is never made without it).
fn random<const N: usize>() -> Result<[u8; N], String> {
    let mut bytes = [0u8; N];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    read.map(|()| bytes).map_err(|e| format!("no random bytes from /dev/urandom: {e}"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Result<Args, String> {
        let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        Args::read(&words)
    }

    #[test]
    fn fields_are_typed_as_the_configuration_reads_them_and_checked_before_a_write() {
        let a =
            args("--operator ops tenant set acme --usd-per-day 2.5 --models gpt-4.1,deepseek-v3 --burst none").unwrap();
        let digest = "ab".repeat(32);
        let mut tenant = json!({"keys_sha256": [digest], "burst": 4});
        set_fields(&mut tenant, &a.fields).unwrap();
        assert_eq!(tenant, json!({"keys_sha256": [digest], "usd_per_day": 2.5, "models": ["gpt-4.1", "deepseek-v3"]}));
        assert!(tenants::check("acme", &tenant).is_ok());
        let bad = args("--operator ops tenant set acme --priority urgent").unwrap();
        let mut t = json!({"keys_sha256": [digest]});
        set_fields(&mut t, &bad.fields).unwrap();
        assert!(tenants::check("acme", &t).unwrap_err().contains("priority"), "refused before it is written");
        assert!(set_fields(&mut json!({}), &args("--operator o x --burst many").unwrap().fields).is_err());
        assert!(args("tenant list --colour red --operator o").is_err(), "an unknown flag");
        assert!(args("--operator o key add acme").unwrap().reason().is_err(), "a change gives a reason");
    }
}
