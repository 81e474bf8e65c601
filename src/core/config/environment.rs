//! What a node reads from its environment beside its configuration: the operator's key and
//! the fleet's secrets, never from the configuration itself (which Envoy's admin interface
//! shows); and what the log should say of the two together when the configuration arrives.

use crate::core::api::note::Note;
use crate::core::api::objects::ObjectKey;
use crate::core::config::{Config, Role};

/// The secrets a node holds, read once per configuration; never logged (its `Debug` says
/// only which are set).
#[derive(Clone, Default)]
pub struct Environment {
    /// `Bearer <key>` when the operator's key is set.
    pub bearer: Option<String>,
    /// The fleet's shared secret, and a second one accepted during a rotation.
    pub fleet_secret: Option<String>,
    pub fleet_secret_accepted: Option<String>,
}

impl std::fmt::Debug for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environment")
            .field("bearer", &self.bearer.as_ref().map(|_| "set"))
            .field("fleet_secret", &self.fleet_secret.as_ref().map(|_| "set"))
            .field("fleet_secret_accepted", &self.fleet_secret_accepted.as_ref().map(|_| "set"))
            .finish()
    }
}

impl Environment {
    /// Reads the variables `config` names through `env` (a variable set but empty is
    /// unset), and keys the objects HolySheep stores by the operator's key.
    pub fn read(config: &mut Config, env: impl Fn(&str) -> Option<String>) -> Environment {
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        let api_key = var(&config.upstream.api_key_env);
        config.object_key = api_key.as_deref().map(ObjectKey::of_operator_key);
        Environment {
            bearer: api_key.map(|k| format!("Bearer {k}")),
            fleet_secret: var(&config.fleet.peer_secret_env),
            fleet_secret_accepted: var(&config.fleet.peer_secret_accepted_env),
        }
    }

    /// What the log says of `config` with these secrets: what it runs with, and each
    /// setting that cannot work without a secret that is not set.
    pub fn notes(&self, config: &Config) -> Vec<Note> {
        let owner = config.role == Role::Owner;
        let (key_env, secret_env) = (&config.upstream.api_key_env, &config.fleet.peer_secret_env);
        let (no_key, no_secret) = (self.bearer.is_none(), self.fleet_secret.is_none());
        let mut notes = Vec::new();
        if config.fleet.internal && config.fleet.peer_sans.is_empty() && no_secret {
            notes.push(Note::Error(format!(
                "holysheep: fleet.internal is set with no fleet.peer_sans and ${secret_env} is not set: every API \
                 request on this listener is refused"
            )));
        }
        if owner && !config.keys.is_empty() && no_key {
            notes.push(Note::Error(format!(
                "holysheep: tenants are configured but ${key_env} is not set: calls go to HolySheep without a key"
            )));
        }
        if owner && config.fleet.shared_limits() && no_secret {
            notes.push(Note::Error(format!(
                "holysheep: fleet.cluster is set but ${secret_env} is not: limits fall back to this node's share"
            )));
        }
        let key = if no_key { "absent: forwarding client authorization" } else { "from environment" };
        notes.push(Note::Info(format!(
            "holysheep: configured (cluster '{}', upstream key {key})",
            config.upstream.cluster
        )));
        if owner && config.semantic.enabled && no_key {
            notes.push(Note::Error(format!(
                "holysheep: semantic.enabled is set but ${key_env} is not: the semantic tier is off (it embeds with \
                 the operator's key only)"
            )));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn the_key_and_secrets_come_from_the_variables_the_configuration_names() {
        let mut config = Config::parse(br#"{"upstream":{"api_key_env":"MY_KEY"}}"#).unwrap();
        let read = Environment::read(&mut config, env(&[("MY_KEY", "sk-1"), ("HOLYSHEEP_PEER_SECRET", "")]));
        assert_eq!(read.bearer.as_deref(), Some("Bearer sk-1"));
        assert!(read.fleet_secret.is_none(), "a variable set but empty is unset");
        assert!(config.object_key.is_some(), "objects are keyed by the operator's key");
        let notes = read.notes(&config);
        assert_eq!(
            notes,
            vec![Note::Info("holysheep: configured (cluster 'holysheep', upstream key from environment)".into())]
        );
        assert!(!format!("{notes:?}").contains("sk-1"), "the key is never in the log");
        assert!(!format!("{read:?}").contains("sk-1"), "nor in what a debug line would print");
    }

    #[test]
    fn a_setting_that_needs_a_missing_secret_is_an_error_in_the_log() {
        let mut config = Config::parse(br#"{"semantic":{"enabled":true}}"#).unwrap();
        let notes = Environment::read(&mut config, env(&[])).notes(&config);
        assert!(config.object_key.is_none());
        let errors: Vec<_> = notes.iter().filter(|n| matches!(n, Note::Error(_))).collect();
        assert_eq!(errors.len(), 1, "{notes:?}");
        assert!(format!("{errors:?}").contains("the semantic tier is off"), "{errors:?}");
    }
}
