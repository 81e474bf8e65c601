//! What a host does to a head: an answer's coming back along its route (`:status` among
//! what it sets), or a request's going on. The core decides every header; the host only
//! carries the edit out.

/// The headers taken out, then those set (each replacing any of its name).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct HeadEdit {
    pub remove: Vec<String>,
    pub set: Vec<(String, String)>,
}

impl HeadEdit {
    pub(crate) fn set(&mut self, name: &str, value: impl Into<String>) {
        self.set.push((name.to_owned(), value.into()));
    }
}
