//! A table of named entries (`models`, `tenants`): read once with the configuration, then
//! only looked up and walked. Kept as one vector sorted by name, so it walks in the order
//! a `BTreeMap` would (the configuration's digest and the counters' names depend on it),
//! looks up by binary search, and costs the plugin one small instantiation per entry
//! type instead of a B-tree's.

/// Entries by name, sorted, each name once.
#[derive(Debug, Clone, PartialEq)]
pub struct Named<T> {
    entries: Vec<(String, T)>,
}

impl<T> Default for Named<T> {
    fn default() -> Named<T> {
        Named { entries: Vec::new() }
    }
}

impl<T> Named<T> {
    fn position(&self, name: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }

    /// Sets `name`'s entry (replacing one of that name).
    pub fn insert(&mut self, name: String, entry: T) {
        match self.position(&name) {
            Ok(at) => {
                if let Some(slot) = self.entries.get_mut(at) {
                    slot.1 = entry;
                }
            }
            Err(at) => self.entries.insert(at, (name, entry)),
        }
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.get_key_value(name).map(|(_, entry)| entry)
    }

    pub fn get_key_value(&self, name: &str) -> Option<(&String, &T)> {
        let at = self.position(name).ok()?;
        self.entries.get(at).map(pair)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_ok()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in name order.
    pub fn iter(&self) -> Entries<'_, T> {
        self.entries.iter().map(pair)
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.entries.iter().map(|(n, _)| n)
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|(_, entry)| entry)
    }
}

impl<T, const N: usize> From<[(String, T); N]> for Named<T> {
    fn from(entries: [(String, T); N]) -> Named<T> {
        entries.into_iter().collect()
    }
}

/// A table's entries in name order.
pub type Entries<'a, T> = std::iter::Map<std::slice::Iter<'a, (String, T)>, fn(&'a (String, T)) -> (&'a String, &'a T)>;

fn pair<T>((name, entry): &(String, T)) -> (&String, &T) {
    (name, entry)
}

impl<'a, T> IntoIterator for &'a Named<T> {
    type Item = (&'a String, &'a T);
    type IntoIter = Entries<'a, T>;

    fn into_iter(self) -> Entries<'a, T> {
        self.iter()
    }
}

impl<T> FromIterator<(String, T)> for Named<T> {
    fn from_iter<I: IntoIterator<Item = (String, T)>>(entries: I) -> Named<T> {
        let mut named = Named::default();
        for (name, entry) in entries {
            named.insert(name, entry);
        }
        named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_walk_in_name_order_and_a_name_is_held_once() {
        let named: Named<u32> = [("beta", 2), ("alpha", 1), ("gamma", 3), ("alpha", 4)]
            .into_iter()
            .map(|(n, v)| (n.to_owned(), v))
            .collect();
        assert_eq!(named.keys().map(String::as_str).collect::<Vec<_>>(), ["alpha", "beta", "gamma"]);
        assert_eq!(named.get("alpha"), Some(&4));
        assert_eq!(named.get("delta"), None);
        assert!(named.contains_key("gamma") && !named.contains_key("gam"));
        assert_eq!(named.len(), 3);
    }
}
