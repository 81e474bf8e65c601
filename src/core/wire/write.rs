//! JSON objects the edge writes itself (its messages to its peers, what it keeps in the
//! spend store): members appended in order, with nothing built first.

/// A JSON object being written.
pub(crate) struct Object {
    out: String,
}

impl Object {
    pub(crate) fn new() -> Object {
        Object { out: String::from("{") }
    }

    /// Starts the member `name` (a name the edge chose: nothing in it to escape).
    fn name(mut self, name: &str) -> Object {
        if self.out.len() > 1 {
            self.out.push(',');
        }
        self.out.push('"');
        self.out.push_str(name);
        self.out.push_str("\":");
        self
    }

    /// The member `name` holding `json`, a JSON text.
    pub(crate) fn raw(self, name: &str, json: &str) -> Object {
        let mut o = self.name(name);
        o.out.push_str(json);
        o
    }

    pub(crate) fn u64(self, name: &str, n: u64) -> Object {
        let mut o = self.name(name);
        o.out.push_str(&n.to_string());
        o
    }

    pub(crate) fn bool(self, name: &str, b: bool) -> Object {
        self.raw(name, if b { "true" } else { "false" })
    }

    pub(crate) fn str(self, name: &str, text: &str) -> Object {
        let quoted = string(text);
        self.raw(name, &quoted)
    }

    /// A number, or `null` when there is none (or it is not finite, as serde_json writes it).
    pub(crate) fn f64(self, name: &str, n: Option<f64>) -> Object {
        match n.filter(|n| n.is_finite()) {
            Some(n) => self.raw(name, ryu::Buffer::new().format_finite(n)),
            None => self.raw(name, "null"),
        }
    }

    /// A whole number, or `null` when there is none.
    pub(crate) fn opt_u64(self, name: &str, n: Option<u64>) -> Object {
        match n {
            Some(n) => self.u64(name, n),
            None => self.raw(name, "null"),
        }
    }

    pub(crate) fn finish(mut self) -> String {
        self.out.push('}');
        self.out
    }
}

/// `text` as a JSON string, escaped as serde_json escapes it.
pub(crate) fn string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_is_written_as_serde_json_writes_it() {
        let o = Object::new()
            .str("model", "gpt-\"4.1\"\n")
            .u64("id", u64::MAX)
            .u64("zero", 0)
            .bool("waits", true)
            .opt_u64("actual", None)
            .f64("remaining", Some(1.5))
            .f64("nan", Some(f64::NAN))
            .raw("hints", "{}")
            .finish();
        let expected = serde_json::json!({"model": "gpt-\"4.1\"\n", "id": u64::MAX, "zero": 0, "waits": true,
            "actual": null, "remaining": 1.5, "nan": null, "hints": {}});
        assert_eq!(serde_json::from_str::<serde_json::Value>(&o).unwrap(), expected);
        assert!(o.starts_with(r#"{"model":"gpt-\"4.1\"\n","id":18446744073709551615,"zero":0,"#), "{o}");
        assert_eq!(Object::new().finish(), "{}");
    }
}
