//! What the log says of what a node sees change, once and not per request (clients must
//! not be able to flood it; the counters count every occurrence): HolySheep's verdict on the
//! operator's key, owner nodes that stop or start answering, an owner that keys a hop
//! otherwise, a node that runs other settings. The key itself is never in a line.

use crate::core::api::note::Note;
use crate::core::config::digest::shown;
use crate::core::config::{Config, Mismatch};

/// How often a worker logs that HolySheep refuses the configured key.
const KEY_REFUSED_LOG_MS: u64 = 10_000;

/// What a worker logged last of each.
#[derive(Debug)]
pub struct Notices {
    /// Whether the last model owner asked answered.
    owners_reached: bool,
    /// When it last logged that HolySheep refuses the configured key.
    key_refused_ms: Option<u64>,
    key_disagreement: bool,
    /// The configuration digest of the fleet node logged last as other than this owner's.
    config_disagreement: Option<String>,
}

impl Default for Notices {
    fn default() -> Self {
        Notices { owners_reached: true, key_refused_ms: None, key_disagreement: false, config_disagreement: None }
    }
}

impl Notices {
    /// HolySheep's answer to the check of the operator's key (`status`: none when it did
    /// not answer).
    pub fn key_checked(config: &Config, status: Option<u16>) -> Note {
        let env = &config.upstream.api_key_env;
        match status {
            Some(200) => Note::Info(format!("holysheep: HolySheep accepted the key from ${env}")),
            Some(s @ (401 | 403)) => Note::Error(format!(
                "holysheep: HolySheep REJECTED the key from ${env} (status {s}): every call will fail"
            )),
            other => Note::Warn(format!(
                "holysheep: could not check the key from ${env} (status {})",
                other.map_or("none".to_owned(), |s| s.to_string())
            )),
        }
    }

    /// HolySheep refused the configured key on a call at `now_ms`: the client got the
    /// edge's own 502, and the log names where the key comes from, at most every
    /// `KEY_REFUSED_LOG_MS`.
    pub fn key_refused(&mut self, config: &Config, status: u16, now_ms: u64) -> Option<Note> {
        if self.key_refused_ms.is_some_and(|at| now_ms.saturating_sub(at) < KEY_REFUSED_LOG_MS) {
            return None;
        }
        self.key_refused_ms = Some(now_ms);
        let env = &config.upstream.api_key_env;
        Some(Note::Error(format!("holysheep: HolySheep refused the key from ${env} (status {status})")))
    }

    /// Whether a model owner answered (`why` it did not): a line when that changes.
    pub fn owners(&mut self, reached: bool, why: &str) -> Option<Note> {
        if std::mem::replace(&mut self.owners_reached, reached) == reached {
            return None;
        }
        Some(match reached {
            true => Note::Info("holysheep: model owners answer again: fleet-wide limits".into()),
            false => Note::Warn(format!("holysheep: {why}: admitting this node's share of the limits")),
        })
    }

    /// An owner keyed a hop's request otherwise than this forward node: a line the first
    /// time (the two configurations disagree on what makes a request the same).
    pub fn key_disagreed(&mut self) -> Option<Note> {
        if std::mem::replace(&mut self.key_disagreement, true) {
            return None;
        }
        Some(Note::Warn(
            "holysheep: an owner keyed a forwarded request otherwise than this forward node: their \
             configurations disagree on what makes two requests the same (cache.tenant_header, models, \
             scopes); owners' answers are not shared between this node's waiters"
                .into(),
        ))
    }

    /// A node that runs other settings (configuration digest `theirs`) sent this owner a
    /// hop: a line for each digest other than the one logged last.
    pub fn config_disagreed(&mut self, config: &Config, theirs: &str) -> Option<Note> {
        let theirs = shown(theirs);
        if self.config_disagreement.as_deref() == Some(theirs.as_str()) {
            return None;
        }
        let refused = config.fleet.config_mismatch == Mismatch::Refuse;
        let line = format!(
            "holysheep: a fleet node runs other settings of keys, scopes or prices (configuration digest {theirs}) \
             than this owner ({}): {}",
            config.digest,
            if refused { "its requests are refused" } else { "its requests are served and counted" }
        );
        self.config_disagreement = Some(theirs);
        Some(Note::Warn(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_line_is_said_once_until_what_it_says_changes() {
        let config = Config::default();
        let mut n = Notices::default();
        assert_eq!(n.owners(true, "x"), None, "owners answer at first: nothing to say");
        assert!(matches!(n.owners(false, "no answer"), Some(Note::Warn(l)) if l.contains("no answer")));
        assert_eq!(n.owners(false, "again"), None);
        assert!(matches!(n.owners(true, ""), Some(Note::Info(_))));
        assert!(n.key_disagreed().is_some() && n.key_disagreed().is_none());
        assert!(n.config_disagreed(&config, "<p>abc</p>").is_some());
        assert!(n.config_disagreed(&config, "abc").is_none(), "the same digest, as shown");
        assert!(n.config_disagreed(&config, "def").is_some());
        assert!(n.key_refused(&config, 401, 0).is_some());
        assert!(n.key_refused(&config, 401, 9_999).is_none(), "at most every 10 s");
        assert!(n.key_refused(&config, 401, 10_000).is_some());
    }

    #[test]
    fn the_key_check_names_where_the_key_comes_from_never_the_key() {
        let config = Config::default();
        assert!(matches!(Notices::key_checked(&config, Some(200)), Note::Info(_)));
        let Note::Error(line) = Notices::key_checked(&config, Some(401)) else { panic!("an error") };
        assert!(line.contains("$HOLYSHEEP_API_KEY") && line.contains("REJECTED"), "{line}");
        assert!(matches!(Notices::key_checked(&config, None), Note::Warn(l) if l.contains("status none")));
    }
}
