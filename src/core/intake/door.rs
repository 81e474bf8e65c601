//! The door every request comes through once its headers are read, on a host that runs in
//! a fleet (the proxy-wasm plugin): refused there, read as a fleet peer's call, governed, or
//! passed on (as it came or with the operator's key) or answered, with the edit its head
//! takes on the fleet's terms. The host only reads the headers, and the connection's
//! certificate names when asked. The component, which has no fleet, takes the same ways
//! without the fleet's checks (`Head::route`, `Head::check`, `Head::ungoverned`).

use crate::core::api::error::ApiError;
use crate::core::api::head::HeadEdit;
use crate::core::api::response::Response;
use crate::core::config::environment::Environment;
use crate::core::config::{Config, Role};
use crate::core::intake::{with_operator_key, Head, Peer, Route, Ungoverned};

/// What becomes of a request, from its head (`Door::of`).
#[derive(Debug, PartialEq, Eq)]
pub enum Door {
    /// Refused before any of its body is read; `counted` among the edge's refusals.
    Refused { error: ApiError, counted: bool },
    /// A model owner call from a fleet peer, its secret checked: its body is a `fleet::Op`.
    Peer,
    /// A governed request, its head checked (`Head::check`): its body is read, its head
    /// edited.
    Governed(HeadEdit),
    /// Passed on as it came, but for the edit.
    Pass(HeadEdit),
    /// Passed on with the operator's key, only along a route to `upstream.cluster` (a host
    /// that cannot tell refuses it: `ApiError::misdirected`).
    WithOperatorKey(HeadEdit),
    /// Answered here (the models list).
    Answer(Response),
}

/// A request's door, and the configuration digest of the fleet node that sent it when it
/// is not this node's own (`Head::foreign_config`): counted and logged by the host.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub door: Door,
    pub foreign: Option<String>,
}

impl Door {
    /// The door of a request with `head` (its header `names`, and `sans`: the names in its
    /// connection's verified client certificate, read only when they matter), on a node
    /// with `config` and the secrets of `env`.
    pub fn of<'a>(
        config: &Config,
        env: &Environment,
        head: &mut Head,
        names: impl Iterator<Item = &'a str>,
        sans: impl FnOnce() -> Vec<String>,
    ) -> Entry {
        let refused = |error, counted| Entry { door: Door::Refused { error, counted }, foreign: None };
        if head.method.is_empty() {
            // Unreadable headers: nothing can be said of the request, so it goes nowhere.
            let e = ApiError::invalid("the request headers could not be read", None, "invalid_headers");
            return refused(e, false);
        }
        let hop = head.config_digest.is_some() && config.role == Role::Owner;
        let sans = if config.fleet.internal || hop { sans() } else { Vec::new() };
        let peer = Peer { sans, secrets: [env.fleet_secret.as_deref(), env.fleet_secret_accepted.as_deref()] };
        if let Err(e) = head.from_fleet(config, &peer) {
            return refused(e, true);
        }
        let foreign = match head.foreign_config(config, &peer) {
            Some(Err(error)) => {
                let foreign = head.config_digest.clone();
                return Entry { door: Door::Refused { error, counted: false }, foreign };
            }
            Some(Ok(_)) => head.config_digest.clone(),
            None => None,
        };
        let door = match head.route() {
            Route::Internal => match head.internal(config, &peer) {
                Ok(()) => Door::Peer,
                Err(error) => Door::Refused { error, counted: false },
            },
            route => {
                let edit = head.fleet_edit(config, env.fleet_secret.as_deref(), names);
                match route {
                    Route::Governed(_) => match head.check(config) {
                        Ok(()) => Door::Governed(edit),
                        Err(error) => Door::Refused { error, counted: true },
                    },
                    _ => head.ungoverned_door(config, env, edit),
                }
            }
        };
        Entry { door, foreign }
    }
}

impl Head {
    /// The door of a request the edge does not govern (`Head::ungoverned`), after `edit`:
    /// a forward node leaves the operator's key to the owner.
    fn ungoverned_door(&self, config: &Config, env: &Environment, mut edit: HeadEdit) -> Door {
        match self.ungoverned(config) {
            Ungoverned::Pass => Door::Pass(edit),
            Ungoverned::WithOperatorKey if config.role == Role::Forward => Door::Pass(edit),
            Ungoverned::WithOperatorKey => {
                let keyed = with_operator_key(env.bearer.as_deref());
                edit.remove.extend(keyed.remove);
                edit.set.extend(keyed.set);
                Door::WithOperatorKey(edit)
            }
            Ungoverned::Answer(Ok(list)) => Door::Answer(list),
            Ungoverned::Answer(Err(error)) => Door::Refused { error, counted: true },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::headers;

    fn head(pairs: &[(&str, &str)]) -> Head {
        Head::read(pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())), None)
    }

    fn env() -> Environment {
        Environment { bearer: Some("Bearer sk-op".into()), fleet_secret: Some("s3cret".into()), ..Default::default() }
    }

    fn chat(extra: &[(&'static str, &'static str)]) -> Head {
        let mut pairs = vec![(":method", "POST"), (":path", "/v1/chat/completions")];
        pairs.extend_from_slice(extra);
        head(&pairs)
    }

    #[test]
    fn unreadable_headers_are_refused_uncounted_and_a_governed_request_is_checked() {
        let config = Config::default();
        let entry = Door::of(&config, &env(), &mut Head::default(), std::iter::empty(), Vec::new);
        assert!(matches!(entry.door, Door::Refused { ref error, counted: false } if error.code == "invalid_headers"));
        let mut h = chat(&[("content-length", "999999999999")]);
        let entry = Door::of(&config, &env(), &mut h, std::iter::empty(), Vec::new);
        assert!(matches!(entry.door, Door::Refused { ref error, counted: true } if error.status == 413));
        let entry = Door::of(&config, &env(), &mut chat(&[]), std::iter::empty(), Vec::new);
        assert_eq!(entry, Entry { door: Door::Governed(HeadEdit::default()), foreign: None });
    }

    #[test]
    fn an_internal_listener_reads_the_certificate_only_when_it_matters() {
        let mut config = Config::default();
        let mut read = 0;
        Door::of(&config, &env(), &mut chat(&[]), std::iter::empty(), || {
            read += 1;
            Vec::new()
        });
        assert_eq!(read, 0, "neither an internal listener nor a hop");
        config.fleet.internal = true;
        config.fleet.peer_sans = vec!["node-b".into()];
        let entry = Door::of(&config, &env(), &mut chat(&[]), std::iter::empty(), Vec::new);
        assert!(matches!(entry.door, Door::Refused { ref error, counted: true } if error.code == "peer_required"));
        let entry = Door::of(&config, &env(), &mut chat(&[]), std::iter::empty(), || vec!["node-b".into()]);
        assert!(matches!(entry.door, Door::Governed(_)));
    }

    #[test]
    fn a_hop_from_a_node_with_other_settings_is_named_and_served_or_refused() {
        let mut config = Config::default();
        let sent = [(headers::CONFIG, "0123456789abcdef"), (headers::PEER_SECRET, "s3cret")];
        let entry = Door::of(&config, &env(), &mut chat(&sent), std::iter::empty(), Vec::new);
        assert_eq!(entry.foreign.as_deref(), Some("0123456789abcdef"));
        assert!(matches!(entry.door, Door::Governed(_)), "counted, and served");
        config.fleet.config_mismatch = crate::core::config::Mismatch::Refuse;
        let entry = Door::of(&config, &env(), &mut chat(&sent), std::iter::empty(), Vec::new);
        assert_eq!(entry.foreign.as_deref(), Some("0123456789abcdef"));
        assert!(matches!(entry.door, Door::Refused { ref error, counted: false } if error.status == 503));
        // Without the secret, the digest is nobody's and is ignored; the proofs come off.
        let entry = Door::of(&config, &env(), &mut chat(&sent[..1]), std::iter::empty(), Vec::new);
        assert_eq!(entry.foreign, None);
        assert_eq!(entry.door, Door::Governed(HeadEdit { remove: vec![headers::CONFIG.into()], set: vec![] }));
    }

    #[test]
    fn the_fleets_calls_and_the_ungoverned_go_their_ways() {
        let config = Config::default();
        let peer = [(":method", "POST"), (":path", crate::core::request::PEER_PATH), (headers::PEER_SECRET, "s3cret")];
        assert_eq!(Door::of(&config, &env(), &mut head(&peer), std::iter::empty(), Vec::new).door, Door::Peer);
        let entry = Door::of(&config, &env(), &mut head(&peer[..2]), std::iter::empty(), Vec::new);
        assert!(matches!(entry.door, Door::Refused { ref error, counted: false } if error.status == 403));
        let health = head(&[(":method", "GET"), (":path", "/healthz")]);
        let entry = Door::of(&config, &env(), &mut health.clone(), std::iter::empty(), Vec::new);
        assert_eq!(entry.door, Door::Pass(HeadEdit::default()));
    }
}
