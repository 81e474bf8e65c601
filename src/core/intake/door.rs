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
    /// A governed request, its head checked (`Head::check`): its body is read.
    Governed,
    /// Passed on as it came.
    Pass,
    /// Passed on with the operator's key, only along a route to `upstream.cluster` (a host
    /// whose route leads elsewhere refuses it: `ApiError::misdirected`).
    WithOperatorKey,
    /// Answered here (the models list).
    Answer(Response),
}

/// A request's door, the edit of its head, and the configuration digest of the fleet node
/// that sent it when it is not this node's own (`Head::foreign_config`): counted and logged
/// by the host.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub door: Door,
    /// What of the head changes, whatever the door (the host makes it first). The fleet's
    /// proofs come off every request: what an owner received, what a client sent a forward
    /// node. A forward node's own secret and digest go on only where the request goes on,
    /// and the operator's key only through `Door::WithOperatorKey`, so that no local reply's
    /// request (an access log may show its headers) carries a secret.
    pub edit: HeadEdit,
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
        let mut edit = head.fleet_edit(config, env.fleet_secret.as_deref(), names);
        let (door, foreign) = door(config, env, head, sans);
        match door {
            Door::Governed | Door::Pass => {}
            Door::WithOperatorKey => {
                let keyed = with_operator_key(env.bearer.as_deref());
                edit.remove.extend(keyed.remove);
                edit.set.extend(keyed.set);
            }
            Door::Refused { .. } | Door::Peer | Door::Answer(_) => edit.set.clear(),
        }
        Entry { door, edit, foreign }
    }
}

/// The door alone (`Door::of`), and the digest of a node with other settings.
fn door(
    config: &Config,
    env: &Environment,
    head: &mut Head,
    sans: impl FnOnce() -> Vec<String>,
) -> (Door, Option<String>) {
    if head.method.is_empty() {
        // Unreadable headers: nothing can be said of the request, so it goes nowhere.
        let error = ApiError::invalid("the request headers could not be read", None, "invalid_headers");
        return (Door::Refused { error, counted: false }, None);
    }
    let hop = head.config_digest.is_some() && config.role == Role::Owner;
    let sans = if config.fleet.internal || hop { sans() } else { Vec::new() };
    let peer = Peer { sans, secrets: [env.fleet_secret.as_deref(), env.fleet_secret_accepted.as_deref()] };
    if let Err(error) = head.from_fleet(config, &peer) {
        return (Door::Refused { error, counted: true }, None);
    }
    let foreign = match head.foreign_config(config, &peer) {
        Some(Err(error)) => return (Door::Refused { error, counted: false }, head.config_digest.clone()),
        Some(Ok(_)) => head.config_digest.clone(),
        None => None,
    };
    let door = match head.route() {
        Route::Internal => match head.internal(config, &peer) {
            Ok(()) => Door::Peer,
            Err(error) => Door::Refused { error, counted: false },
        },
        Route::Governed(_) => match head.check(config) {
            Ok(()) => Door::Governed,
            Err(error) => Door::Refused { error, counted: true },
        },
        Route::Other => match head.ungoverned(config) {
            Ungoverned::Pass => Door::Pass,
            // A forward node leaves the operator's key to the owner.
            Ungoverned::WithOperatorKey if config.role == Role::Forward => Door::Pass,
            Ungoverned::WithOperatorKey => Door::WithOperatorKey,
            Ungoverned::Answer(Ok(list)) => Door::Answer(list),
            Ungoverned::Answer(Err(error)) => Door::Refused { error, counted: true },
        },
    };
    (door, foreign)
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

    /// The entry of `h` on `config`, its header names passed as a host reads them.
    fn enter(config: &Config, h: &mut Head, names: &[&str], sans: &[&str]) -> Entry {
        let sans = || sans.iter().map(|s| (*s).to_owned()).collect();
        Door::of(config, &env(), h, names.iter().copied(), sans)
    }

    fn refused(entry: &Entry) -> (u16, &str, bool) {
        match &entry.door {
            Door::Refused { error, counted } => (error.status, error.code, *counted),
            other => panic!("not refused: {other:?}"),
        }
    }

    /// A configuration with one tenant (token `hs-t`) and one passthrough path.
    fn tenants(role: &str) -> Config {
        let digest: String =
            crate::core::wire::digest::sha256(b"hs-t".to_vec()).iter().map(|b| format!("{b:02x}")).collect();
        let raw = format!(
            r#"{{"role":"{role}","tenants":{{"t":{{"keys_sha256":["{digest}"]}}}},"passthrough_paths":["/v1/files"]}}"#
        );
        Config::parse(raw.as_bytes()).unwrap()
    }

    #[test]
    fn unreadable_headers_are_refused_uncounted_and_a_governed_request_is_checked() {
        let config = Config::default();
        assert_eq!(refused(&enter(&config, &mut Head::default(), &[], &[])), (400, "invalid_headers", false));
        let entry = enter(&config, &mut chat(&[("content-length", "999999999999")]), &[], &[]);
        assert_eq!(refused(&entry), (413, "request_too_large", true));
        let entry = enter(&config, &mut chat(&[]), &[], &[]);
        assert_eq!(entry, Entry { door: Door::Governed, edit: HeadEdit::default(), foreign: None });
    }

    #[test]
    fn the_certificate_is_read_only_where_it_proves_something() {
        let mut config = Config::default();
        let mut read = 0;
        Door::of(&config, &env(), &mut chat(&[]), std::iter::empty(), || {
            read += 1;
            Vec::new()
        });
        assert_eq!(read, 0, "neither an internal listener nor a hop");
        config.fleet.peer_sans = vec!["node-b".into()];
        // A hop that only its certificate proves: its digest counts.
        let mut hop = chat(&[(headers::CONFIG, "0123456789abcdef")]);
        assert_eq!(enter(&config, &mut hop.clone(), &[], &["node-b"]).foreign.as_deref(), Some("0123456789abcdef"));
        assert_eq!(enter(&config, &mut hop, &[], &[]).foreign, None, "nothing proves it");
        config.fleet.internal = true;
        assert_eq!(refused(&enter(&config, &mut chat(&[]), &[], &[])), (403, "peer_required", true));
        assert_eq!(enter(&config, &mut chat(&[]), &[], &["node-b"]).door, Door::Governed);
    }

    #[test]
    fn a_hop_from_a_node_with_other_settings_is_named_and_served_or_refused() {
        let mut config = Config::default();
        let sent = [(headers::CONFIG, "0123456789abcdef"), (headers::PEER_SECRET, "s3cret")];
        let entry = enter(&config, &mut chat(&sent), &[], &[]);
        assert_eq!((entry.door, entry.foreign.as_deref()), (Door::Governed, Some("0123456789abcdef")));
        config.fleet.config_mismatch = crate::core::config::Mismatch::Refuse;
        let entry = enter(&config, &mut chat(&sent), &[], &[]);
        assert_eq!(entry.foreign.as_deref(), Some("0123456789abcdef"));
        assert_eq!(refused(&entry), (503, "fleet_config_mismatch", false));
        // The proofs come off even the request of a local reply.
        assert_eq!(entry.edit.remove, [headers::PEER_SECRET, headers::CONFIG]);
        // Without the secret, the digest is nobody's and is ignored; it still comes off.
        let entry = enter(&config, &mut chat(&sent[..1]), &[], &[]);
        assert_eq!(entry.foreign, None);
        assert_eq!(entry.edit, HeadEdit { remove: vec![headers::CONFIG.into()], set: vec![] });
    }

    #[test]
    fn the_fleets_calls_are_served_only_with_the_secret() {
        let config = Config::default();
        let peer = [(":method", "POST"), (":path", crate::core::request::PEER_PATH), (headers::PEER_SECRET, "s3cret")];
        assert_eq!(enter(&config, &mut head(&peer), &[], &[]).door, Door::Peer);
        assert_eq!(refused(&enter(&config, &mut head(&peer[..2]), &[], &[])).0, 403);
        let health = [(":method", "GET"), (":path", "/healthz")];
        assert_eq!(enter(&config, &mut head(&health), &[], &[]).door, Door::Pass);
    }

    #[test]
    fn only_an_owner_passes_a_listed_path_with_the_operators_key() {
        let tenant = [(":method", "GET"), (":path", "/v1/files"), ("authorization", "Bearer hs-t")];
        let names = ["authorization", "openai-project", headers::PEER_SECRET];
        let owner = enter(&tenants("owner"), &mut head(&tenant), &names, &[]);
        assert_eq!(owner.door, Door::WithOperatorKey);
        assert!(owner.edit.remove.iter().any(|n| n == "authorization"), "the tenant's token comes off");
        assert!(owner.edit.remove.iter().any(|n| n == "openai-project"));
        assert_eq!(owner.edit.set, [("authorization".to_owned(), "Bearer sk-op".to_owned())]);
        // A forward node passes it on to the owner, with the fleet's word and no key.
        let forward = enter(&tenants("forward"), &mut head(&tenant), &names, &[]);
        assert_eq!(forward.door, Door::Pass);
        assert_eq!(forward.edit.remove, [headers::PEER_SECRET], "a client's fleet header comes off");
        let set: Vec<&str> = forward.edit.set.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(set, [headers::PEER_SECRET, headers::CONFIG]);
    }

    #[test]
    fn a_local_answer_or_refusal_carries_no_secret_of_this_node() {
        let config = tenants("forward");
        let models = [(":method", "GET"), (":path", "/v1/models"), ("authorization", "Bearer hs-t")];
        let entry = enter(&config, &mut head(&models), &[], &[]);
        assert!(matches!(entry.door, Door::Answer(_)), "{:?}", entry.door);
        assert!(entry.edit.set.is_empty(), "{:?}", entry.edit);
        let batches = [(":method", "GET"), (":path", "/v1/batches"), ("authorization", "Bearer hs-t")];
        let entry = enter(&config, &mut head(&batches), &[], &[]);
        assert_eq!(refused(&entry), (404, "unknown_url", true));
        assert!(entry.edit.set.is_empty());
        let entry = enter(&config, &mut chat(&[("authorization", "Bearer nobody")]), &[], &[]);
        assert_eq!(refused(&entry), (401, "invalid_api_key", true));
        assert!(entry.edit.set.is_empty());
    }
}
