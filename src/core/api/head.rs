//! What a host does to a head: an answer's coming back along its route (`:status` among
//! what it sets), or a request's going on. The core decides every header; the host only
//! carries the edit out.

/// The headers taken out, then those set (each replacing any of its name).
#[derive(Default, PartialEq, Eq)]
pub struct HeadEdit {
    pub remove: Vec<String>,
    pub set: Vec<(String, String)>,
}

/// Names only: a value set may be the operator's key or the fleet's secret.
impl std::fmt::Debug for HeadEdit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set: Vec<&str> = self.set.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HeadEdit").field("remove", &self.remove).field("set", &set).finish()
    }
}

impl HeadEdit {
    pub(crate) fn set(&mut self, name: &str, value: impl Into<String>) {
        self.set.push((name.to_owned(), value.into()));
    }
}
