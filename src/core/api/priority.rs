//! Priority classes. A verified tenant's configuration sets its class; a request may lower
//! its own with `x-holysheep-priority`, never raise it. The class orders the admission line
//! (`line`) and decides whether a call may dip into the part of a bucket kept for
//! interactive traffic (`rate_limit.reserve`).

use crate::core::api::error::ApiError;
use crate::core::api::headers;
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Class {
    Critical,
    #[default]
    Standard,
    Sheddable,
}

/// Every class, highest first.
pub const CLASSES: [Class; 3] = [Class::Critical, Class::Standard, Class::Sheddable];

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Standard => "standard",
            Class::Sheddable => "sheddable",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        CLASSES.into_iter().find(|c| s.trim().eq_ignore_ascii_case(c.as_str()))
    }

    /// The class named exactly `name` (as peers write it).
    pub(crate) fn named(name: &str) -> Option<Class> {
        CLASSES.into_iter().find(|c| c.as_str() == name)
    }

    /// Its place in `CLASSES`: 0 is admitted first.
    pub fn rank(self) -> usize {
        self as usize
    }

    /// Whether a call of this class may only use what lies above the bucket's reserve.
    pub(crate) fn keeps_reserve(self) -> bool {
        self == Class::Sheddable
    }

    /// The class of a request whose tenant is granted `granted` (`Config::class_of`)
    /// asking for `requested`: the lower of the two. An unknown value is refused.
    pub fn of(granted: Class, requested: Option<&str>) -> Result<Class, ApiError> {
        let Some(value) = requested else { return Ok(granted) };
        let asked = Class::parse(value).ok_or_else(|| {
            ApiError::invalid(
                format!("{} must be critical, standard or sheddable", headers::PRIORITY),
                Some(headers::PRIORITY),
                "invalid_priority",
            )
        })?;
        Ok(granted.max(asked))
    }
}

/// A stable number for a tenant's name (0: no verified tenant), the same on every node:
/// the admission line takes turns between these.
pub(crate) fn tenant_tag(tenant: Option<&str>) -> u64 {
    let Some(name) = tenant else { return 0 };
    let d = crate::core::wire::digest::sha256(name.as_bytes().to_vec());
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::Config;

    #[test]
    fn a_request_lowers_its_class_and_never_raises_it() {
        let c = Config::parse(
            br#"{"tenants":{"search":{"keys_sha256":["0000000000000000000000000000000000000000000000000000000000000001"],"priority":"critical"},
                "batch":{"keys_sha256":["0000000000000000000000000000000000000000000000000000000000000002"],"priority":"sheddable"}}}"#,
        )
        .unwrap();
        let of = |tenant: Option<&str>, asked| Class::of(c.class_of(tenant), asked);
        assert_eq!(of(Some("search"), None), Ok(Class::Critical));
        assert_eq!(of(Some("search"), Some("Sheddable")), Ok(Class::Sheddable));
        assert_eq!(of(Some("batch"), Some("critical")), Ok(Class::Sheddable), "never raised");
        assert_eq!(of(None, Some("critical")), Ok(Class::Standard), "unverified: standard at most");
        assert_eq!(of(None, Some("sheddable")), Ok(Class::Sheddable));
        let e = of(None, Some("urgent")).unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_priority"));
    }

    #[test]
    fn tenant_tags_are_stable_and_distinct() {
        assert_eq!(tenant_tag(None), 0);
        assert_eq!(tenant_tag(Some("a")), tenant_tag(Some("a")));
        assert_ne!(tenant_tag(Some("a")), tenant_tag(Some("b")));
        assert_ne!(tenant_tag(Some("a")), 0);
    }
}
