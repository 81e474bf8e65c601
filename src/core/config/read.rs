//! The configuration's JSON read into its types field by field: every field optional (its
//! type's default otherwise), an unknown field or a value of the wrong kind refused with
//! the setting's path (`lock.lease_ms: must be a whole number of at least 0`). Each type's
//! `read` lives with the type; this file holds what they share. (serde's derived readers,
//! run through `serde_json::from_value` and tried field by field to name the one at fault,
//! cost the plugin tens of kilobytes of code.)

use super::named::Named;
use super::ConfigError;
use serde_json::{Map, Value};

pub(crate) type Read<T> = Result<T, ConfigError>;

/// One JSON object of the configuration at `path` (empty at the top).
pub(crate) struct Section<'a> {
    path: &'a str,
    map: &'a Map<String, Value>,
}

impl<'a> Section<'a> {
    pub(crate) fn of(path: &'a str, v: &'a Value) -> Read<Section<'a>> {
        match v {
            Value::Object(map) => Ok(Section { path, map }),
            _ => Err(wrong(path, "an object")),
        }
    }

    /// `read(name, value, path)` for each field; a field it does not know (`false`) is
    /// refused.
    pub(crate) fn fields(&self, mut read: impl FnMut(&str, &Value, &str) -> Read<bool>) -> Read<()> {
        for (name, v) in self.map {
            let path = if self.path.is_empty() { name.clone() } else { format!("{}.{name}", self.path) };
            if !read(name, v, &path)? {
                return Err(ConfigError(format!("{path}: unknown field")));
            }
        }
        Ok(())
    }
}

/// The section at `path` read into `T`'s defaults: `field(section, name, value, path)` for
/// each field, which says whether it knows it (`Section::fields`).
pub(crate) fn section<T: Default>(
    path: &str,
    v: &Value,
    mut field: impl FnMut(&mut T, &str, &Value, &str) -> Read<bool>,
) -> Read<T> {
    let mut read = T::default();
    Section::of(path, v)?.fields(|name, v, p| field(&mut read, name, v, p))?;
    Ok(read)
}

/// An object of named entries (`models`, `tenants`), each read by `entry`.
pub(crate) fn entries<T>(path: &str, v: &Value, entry: impl Fn(&str, &Value) -> Read<T>) -> Read<Named<T>> {
    let Value::Object(map) = v else { return Err(wrong(path, "an object")) };
    let mut read = Named::default();
    for (name, v) in map {
        read.insert(name.clone(), entry(&format!("{path}.{name}"), v)?);
    }
    Ok(read)
}

fn wrong(path: &str, what: &str) -> ConfigError {
    ConfigError(format!("{path}: must be {what}"))
}

pub(crate) fn whole(path: &str, v: &Value) -> Read<u64> {
    v.as_u64().ok_or_else(|| wrong(path, "a whole number of at least 0"))
}

pub(crate) fn whole32(path: &str, v: &Value) -> Read<u32> {
    u32::try_from(whole(path, v)?).map_err(|_| wrong(path, "at most 4294967295"))
}

pub(crate) fn size(path: &str, v: &Value) -> Read<usize> {
    usize::try_from(whole(path, v)?).map_err(|_| wrong(path, "at most 4294967295"))
}

pub(crate) fn number(path: &str, v: &Value) -> Read<f64> {
    v.as_f64().ok_or_else(|| wrong(path, "a number"))
}

pub(crate) fn flag(path: &str, v: &Value) -> Read<bool> {
    v.as_bool().ok_or_else(|| wrong(path, "true or false"))
}

pub(crate) fn text(path: &str, v: &Value) -> Read<String> {
    v.as_str().map(str::to_owned).ok_or_else(|| wrong(path, "a string"))
}

pub(crate) fn texts(path: &str, v: &Value) -> Read<Vec<String>> {
    let list = v.as_array().ok_or_else(|| wrong(path, "a list of strings"))?;
    let mut read = Vec::with_capacity(list.len());
    for s in list {
        read.push(s.as_str().ok_or_else(|| wrong(path, "a list of strings"))?.to_owned());
    }
    Ok(read)
}

/// `null` as `None`, anything else read by `read`.
pub(crate) fn maybe<T>(path: &str, v: &Value, read: fn(&str, &Value) -> Read<T>) -> Read<Option<T>> {
    if v.is_null() {
        return Ok(None);
    }
    read(path, v).map(Some)
}

/// One of `options`, by its name.
pub(crate) fn choice<T: Copy>(path: &str, v: &Value, options: &[(&str, T)]) -> Read<T> {
    let found = v.as_str().and_then(|s| options.iter().find(|(name, _)| *name == s));
    found.map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = options.iter().map(|(name, _)| *name).collect();
        wrong(path, &format!("one of {}", names.join(", ")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_of_the_wrong_kind_are_refused_with_their_path() {
        let refused = |r: Read<()>| r.unwrap_err().0;
        assert_eq!(refused(whole("a.b", &json!(-1)).map(drop)), "a.b: must be a whole number of at least 0");
        assert_eq!(refused(whole("a.b", &json!(1.5)).map(drop)), "a.b: must be a whole number of at least 0");
        assert_eq!(refused(whole32("a", &json!(1u64 << 32)).map(drop)), "a: must be at most 4294967295");
        assert_eq!(refused(texts("a", &json!(["x", 1])).map(drop)), "a: must be a list of strings");
        assert_eq!(
            refused(choice("r", &json!("edge"), &[("owner", 0), ("forward", 1)]).map(drop)),
            "r: must be one of owner, forward"
        );
        assert_eq!(
            (whole32("a", &json!(7)), number("a", &json!(7)), maybe("a", &json!(null), whole)),
            (Ok(7), Ok(7.0), Ok(None))
        );
    }

    #[test]
    fn an_unknown_field_is_named_by_its_path() {
        let v = json!({"known": 1, "ttl": 2});
        let e = Section::of("cache", &v).and_then(|s| s.fields(|name, _, _| Ok(name == "known"))).unwrap_err();
        assert_eq!(e.0, "cache.ttl: unknown field");
        let top = json!({"upstreams": {}});
        let e = Section::of("", &top).and_then(|s| s.fields(|_, _, _| Ok(false))).unwrap_err();
        assert_eq!(e.0, "upstreams: unknown field");
    }
}
