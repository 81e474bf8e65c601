//! A line for the operator's log, with its level: what a host writes where it logs.

/// A line for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// Something that refuses calls until the configuration changes.
    Critical(String),
    /// Something that cannot work as configured, or fails every call.
    Error(String),
    /// Something worth a look that the edge works around.
    Warn(String),
    Info(String),
}
