//! Admission: the one door a flight passes before it calls HolySheep, and where it settles
//! when the call ends. `Standing::admit` takes the call's share of its tenant's limits
//! (once per flight), then capacity from the first of its models whose buckets admit it,
//! and answers with a value: `Admitted` (which model), `Wait` (a place in line, a bucket
//! refilling), `AskOwner` (in a fleet, the tenant's or the model's owner node decides) or
//! `Denied` (the answer to give: 429, 400, or the spend store's 503 and 500). What it holds
//! (its places in line, its ticket in a model's bucket, its tenant's hold) is settled by
//! `bill`, `settle` and `close`, here or through the outbox of settlements for owner nodes.
//! It never calls back into the flight: the flight keeps its attempts, the door the rest.

use crate::core::api::error::ApiError;
use crate::core::api::event::Event;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::priority::{self, Class};
use crate::core::api::response::Response;
use crate::core::api::usage::Billed;
use crate::core::config::Config;
use crate::core::limits::fleet::{self, Op, Verdict};
use crate::core::limits::line::{Who, POLL_CAP_MS};
use crate::core::limits::tenant_gate::{self, Ask, Ended, Refusal, Settlement, TenantHold};
use crate::core::limits::{self, duration, Denial, Kind, Limits};
use crate::core::store::CasStore;

pub use crate::core::limits::budget::Left;

/// How often a request held for a concurrency slot looks again.
pub(crate) const CONCURRENCY_POLL_MS: u64 = 20;

/// What the door said.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Admission {
    /// Admitted to call `models()[index]` (a fallback when it is not the model asked for).
    Admitted { index: usize },
    /// Nothing admits the call yet: come back (`admit` again) at this time.
    Wait { until_ms: u64 },
    /// The owner node of `bucket` decides: its verdict goes to `on_verdict`, then `admit`.
    AskOwner { bucket: String, op: Op, timeout_ms: u64 },
    /// Refused: the answer to give.
    Denied(Response),
}

/// What a call is asked to the limits with, fixed for the flight's life.
#[derive(Debug, Clone)]
pub(crate) struct Claim<'a> {
    pub model: &'a str,
    pub tenant: Option<&'a str>,
    pub class: Class,
    /// The call's token estimate, and the most tokens it can be billed.
    pub estimate: u64,
    pub worst_tokens: u64,
    pub started_ms: u64,
}

/// Which bucket admitted the call, so that it is settled where it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ticket {
    /// This node's bucket.
    Local(u64),
    /// The model owner node's bucket.
    Owner(u64),
    /// This node's share, the model owner being out of reach.
    Share(u64),
}

/// What reserving capacity on one model came to.
enum Reservation {
    Reserved,
    Denied(Denial),
    /// The model owner node must be asked.
    Ask(String, Box<Op>),
}

/// A model owner asked for the model at `at`, after the denials of the models before it.
#[derive(Debug, Clone)]
enum Probe {
    Asked {
        at: usize,
        denials: Vec<(usize, Denial)>,
    },
    /// Its answer (`None`: out of reach).
    Heard {
        at: usize,
        denials: Vec<(usize, Denial)>,
        verdict: Option<Verdict>,
    },
}

/// Where the call stands with its tenant's own limits.
#[derive(Debug, Clone)]
enum TenantPass {
    /// Not taken yet (or the tenant has no limits).
    Untaken,
    /// Asked of the tenant's owner node ...
    Asking,
    /// ... which answered this (`None`: out of reach).
    Heard(Option<Verdict>),
    /// Taken: what the call holds (`None`: nothing to settle here).
    Taken(Option<TenantHold>),
}

/// A flight's standing with the limits: the models it may call, what it holds of them and
/// of its tenant's, its places in their lines, and what it has to report.
#[derive(Debug, Clone)]
pub(crate) struct Standing {
    models: Vec<String>,
    tenant: Option<String>,
    /// `priority::tenant_tag` of `tenant`, made when a bucket's line first needs it (a
    /// digest: a call no bucket limits never makes it).
    tenant_tag: Option<u64>,
    class: Class,
    estimate: u64,
    worst_tokens: u64,
    started_ms: u64,
    deadline_ms: u64,
    hold_until_ms: u64,
    /// Its identity in the buckets (its first nonce): place in line, slot.
    id: Option<u64>,
    ticket: Option<Ticket>,
    probe: Option<Probe>,
    pass: TenantPass,
    /// The buckets whose lines it stands in: the bucket, a model it stands there for, and
    /// where that line is.
    lined: Vec<(String, usize, Ticket)>,
    /// It has stood in a line; it has been admitted to a call.
    queued: bool,
    admitted: bool,
    pub events: Vec<Event>,
    /// Settlements for owner nodes, sent by the shell without waiting.
    pub outbox: Vec<Op>,
}

impl Standing {
    /// The standing of `claim`'s call: its model, then the model's fallbacks its tenant (if
    /// any) may call; held for a bucket up to `rate_limit.max_wait_ms`, and never past
    /// `upstream.timeout_ms`.
    pub fn new(config: &Config, claim: &Claim) -> Standing {
        let tenant = claim.tenant.and_then(|t| config.tenants.get(t));
        let mut models = vec![claim.model.to_owned()];
        for f in config.model(claim.model).map(|(_, m)| m.fallback.clone()).unwrap_or_default() {
            if !models.contains(&f) && tenant.is_none_or(|t| t.allows(&f)) {
                models.push(f);
            }
        }
        Standing {
            models,
            tenant: claim.tenant.map(str::to_owned),
            tenant_tag: None,
            class: claim.class,
            estimate: claim.estimate,
            worst_tokens: claim.worst_tokens,
            started_ms: claim.started_ms,
            deadline_ms: claim.started_ms.saturating_add(config.upstream.timeout_ms),
            hold_until_ms: claim.started_ms.saturating_add(config.rate_limit.max_wait_ms),
            id: None,
            ticket: None,
            probe: None,
            pass: TenantPass::Untaken,
            lined: Vec::new(),
            queued: false,
            admitted: false,
            events: Vec::new(),
            outbox: Vec::new(),
        }
    }

    /// The models the call may go to, the one asked for first.
    pub fn models(&self) -> &[String] {
        &self.models
    }

    /// When the flight must end.
    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    /// Takes the call's share of its tenant's limits (once), then capacity from the first of
    /// the models from `from` on whose buckets admit it. With fleet-wide limits an owner
    /// node is asked first (`AskOwner`), and the door goes on from its verdict.
    pub fn admit(&mut self, store: &impl CasStore, config: &Config, from: usize, now_ms: u64, nonce: u64) -> Admission {
        if let Some(refused) = self.admit_tenant(store, config, from, now_ms, nonce) {
            return refused;
        }
        let (start, mut denials, mut heard) = match self.probe.take() {
            None => (from, Vec::new(), None),
            Some(Probe::Asked { at, denials }) => (at, denials, None),
            Some(Probe::Heard { at, denials, verdict }) => (at, denials, Some(verdict)),
        };
        for i in start..self.models.len() {
            match self.reserve(store, config, i, heard.take(), now_ms, nonce) {
                Reservation::Reserved => {
                    self.leave_lines(store, config, now_ms);
                    if !std::mem::replace(&mut self.admitted, true) {
                        let waited_ms = now_ms.saturating_sub(self.started_ms);
                        self.events.push(Event::Admitted { class: self.class, waited_ms });
                    }
                    return Admission::Admitted { index: i };
                }
                Reservation::Denied(d) => denials.push((i, d)),
                Reservation::Ask(bucket, op) => {
                    self.probe = Some(Probe::Asked { at: i, denials });
                    let timeout_ms = config.fleet.timeout_ms.min(self.deadline_ms.saturating_sub(now_ms));
                    return Admission::AskOwner { bucket, op: *op, timeout_ms };
                }
            }
        }
        // A refusal for priority is no reason to wait: only the other models' denials are.
        let waits = denials.iter().filter(|(_, d)| !is_final(d.kind));
        if let Some(soonest) =
            waits.clone().map(|(i, d)| d.wait_ms.unwrap_or_else(|| self.slot_poll(config, *i, d))).min()
        {
            let until = now_ms.saturating_add(soonest);
            // Contention is no refusal: it waits past `max_wait_ms` (within the deadline).
            let contended = waits.clone().any(|(_, d)| d.kind == Kind::Contended);
            if (until <= self.hold_until_ms || contended) && until < self.deadline_ms {
                // A place in line lapses unless its caller comes back in time.
                let poll = if self.lined.is_empty() { soonest } else { soonest.min(POLL_CAP_MS) };
                return Admission::Wait { until_ms: now_ms.saturating_add(poll) };
            }
        }
        let model = self.models.get(from).cloned().unwrap_or_default();
        // A call too large for one model but refused by another only for now is that one's
        // refusal (a 429 to come back with), not a 400.
        let denial = denials
            .iter()
            .map(|(_, d)| *d)
            .find(|d| d.kind != Kind::TooLarge)
            .or(denials.first().map(|(_, d)| *d))
            .unwrap_or(Denial::of(Kind::Requests, None));
        if denial.kind == Kind::TooLarge {
            let tpm = config.model(&model).and_then(|(_, m)| m.tokens_per_minute).unwrap_or(0);
            let refused = ApiError::too_many_tokens(&format!("model {model}"), self.estimate, tpm);
            return Admission::Denied(Response::json(400, refused.body()).with_header(headers::MODEL, model));
        }
        self.events.push(Event::RateLimited { model: model.clone() });
        if matches!(denial.kind, Kind::Shed | Kind::QueueFull) {
            let full = denial.kind == Kind::QueueFull;
            self.events.push(Event::Shed { model: model.clone(), class: self.class, full });
        }
        Admission::Denied(self.rate_limited(config, &model, denial))
    }

    /// An owner node's answer to `AskOwner` (`None`: no answer in time).
    pub fn on_verdict(&mut self, verdict: Option<Verdict>) {
        if matches!(self.pass, TenantPass::Asking) {
            self.pass = TenantPass::Heard(verdict);
        } else if let Some(Probe::Asked { at, denials }) = self.probe.take() {
            self.probe = Some(Probe::Heard { at, denials, verdict });
        }
    }

    /// Whether the last `AskOwner` went to the tenant's owner node.
    pub fn asking_tenant(&self) -> bool {
        matches!(self.pass, TenantPass::Asking)
    }

    /// Whether the call may look for a higher class to wait at (`raise_to`): it stands in a
    /// line, below the top class, and no model owner's verdict is pending (that was given at
    /// the class it asked with).
    pub(crate) fn may_raise(&self) -> bool {
        !self.lined.is_empty() && self.class != Class::Critical && self.probe.is_none()
    }

    /// The call waits at `class` from now on (a waiter of that class joined it).
    pub(crate) fn raise_to(&mut self, class: Class) {
        if class < self.class {
            (self.class, self.queued) = (class, true);
            self.events.push(Event::Queued { class });
        }
    }

    /// What an attempt on `models()[index]` was billed goes on the tenant's account (and is
    /// counted as charged to its budget).
    pub fn bill(&mut self, config: &Config, index: usize, billed: Billed) {
        let model = self.models.get(index).cloned().unwrap_or_default();
        if let TenantPass::Taken(Some(hold)) = &mut self.pass {
            let micro = hold.bill(config, &model, billed);
            if micro > 0 && hold.budgeted(config) {
                self.events.push(Event::BudgetCharged { model, micro });
            }
        }
    }

    /// Whether another attempt may be sent: what the call reserved of its tenant's budget
    /// covers what its attempts were billed so far and the next one's worst case (the
    /// reservation grows to it when the budget is kept here and has room).
    pub fn cover_next(&mut self, store: &impl CasStore, config: &Config, now_ms: u64) -> bool {
        match &mut self.pass {
            TenantPass::Taken(Some(hold)) => hold.cover_next(store, config, now_ms),
            _ => true,
        }
    }

    /// Whether the call holds a reservation of its tenant's dollar budget: one attempt's
    /// worst case, which Envoy's router must not retry beyond (`Flight::stream_retries`).
    pub fn holds_dollars(&self, config: &Config) -> bool {
        matches!(&self.pass, TenantPass::Taken(Some(hold)) if hold.budgeted(config) && hold.dollars().micro > 0)
    }

    /// Settles the call's ticket on `models()[index]` with the tokens it used (`None`:
    /// unknown); `retries`, requests made beyond the first (already taken here from a local
    /// bucket: `charge_retries`), go to a model owner with it.
    pub fn settle(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        index: usize,
        (actual, retries): (Option<u64>, u64),
        hints: &ProviderHints,
        now_ms: u64,
    ) {
        let Some(ticket) = self.ticket.take() else { return };
        let ended = (actual, fleet::capped(config, hints), retries);
        self.settle_at(store, config, index, ticket, ended, now_ms);
    }

    /// Takes `retries` more requests from the bucket of `models()[index]` the call was
    /// admitted from here (a model owner elsewhere in the fleet takes them when it settles).
    pub(crate) fn charge_retries(
        &self,
        store: &impl CasStore,
        config: &Config,
        index: usize,
        retries: u64,
        now_ms: u64,
    ) {
        let Some((bucket, m)) = self.models.get(index).and_then(|name| config.model(name)) else { return };
        let l = Limits::of(m, &config.rate_limit);
        match self.ticket {
            Some(Ticket::Local(_)) => limits::charge_requests(store, bucket, &l, retries, now_ms),
            Some(Ticket::Share(_)) => {
                let share = l.share(config.fleet.nodes);
                limits::charge_requests(store, &limits::share_bucket(bucket), &share, retries, now_ms);
            }
            Some(Ticket::Owner(_)) | None => {}
        }
    }

    /// The flight is over: what it holds of its tenant's limits is settled (here, or a
    /// settlement in the outbox), a verdict it never read is given back, and its places in
    /// line are given up.
    pub fn close(&mut self, store: &impl CasStore, config: &Config, now_ms: u64) {
        match std::mem::replace(&mut self.pass, TenantPass::Taken(None)) {
            TenantPass::Taken(Some(hold)) => {
                let tenant = self.tenant.clone().unwrap_or_default();
                match hold.end(store, now_ms) {
                    Ended::Owner(settlement) => self.outbox.push(Op::TenantSettle(settlement)),
                    // In a fleet the tenant's owner node keeps its gauges: a record here is
                    // this node's share, taken while the owner was out of reach.
                    Ended::Here(Some(s)) if !config.fleet.shared_limits() => {
                        self.events.push(Event::BudgetStanding { tenant, spent: s.spent, keepers: s.keepers })
                    }
                    Ended::Here(_) => {}
                }
            }
            // A verdict never read, or an ask that may have reached the owner all the same
            // (no answer in time): what the owner may have reserved is given back.
            TenantPass::Heard(None) => self.release_tenant(config, now_ms),
            TenantPass::Heard(Some(v)) if v.hold.is_some() => self.release_tenant(config, now_ms),
            _ => {}
        }
        // A model owner's admission never read: the call never went, its place is freed.
        if let Some(Probe::Heard { at, verdict: Some(v), .. }) = self.probe.take() {
            if let (true, Some(id), Some(model)) = (v.admitted, self.id, self.models.get(at)) {
                let (model, estimate) = (model.clone(), self.estimate);
                let hints = ProviderHints::default();
                self.outbox.push(Op::Settle { model, id, estimate, actual: Some(0), hints, retries: 0 });
            }
        }
        self.leave_lines(store, config, now_ms);
    }

    /// Gives back what the tenant's owner may have reserved for the call.
    fn release_tenant(&mut self, config: &Config, now_ms: u64) {
        if let Some(ask) = self.ask(config, 0) {
            self.outbox.push(Op::TenantSettle(Settlement::release(&ask, now_ms)));
        }
    }

    /// The call's ask of its tenant's limits (`None`: no tenant).
    fn ask(&self, config: &Config, hold_ms: u64) -> Option<Ask> {
        let tenant = self.tenant.clone()?;
        let worst_micro = tenant_gate::worst_micro(config, &self.models, self.worst_tokens);
        Some(Ask { tenant, id: self.id.unwrap_or(0), estimate: self.estimate, worst_micro, hold_ms })
    }

    /// Takes the call's share of its tenant's own limits, once; `Some` when they refuse it
    /// (a wait for the bucket, the question to the owner node, or the refusal).
    fn admit_tenant(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        from: usize,
        now_ms: u64,
        nonce: u64,
    ) -> Option<Admission> {
        if matches!(self.pass, TenantPass::Taken(_)) {
            return None;
        }
        let tenant = self.tenant.clone().filter(|t| tenant_gate::is_limited(config, t))?;
        self.id.get_or_insert(nonce);
        let ask = self.ask(config, self.deadline_ms.saturating_sub(now_ms) + 1_000)?;
        let taken = if !config.fleet.shared_limits() {
            tenant_gate::take(store, config, &ask, None, now_ms)
        } else {
            // The tenant's limits live on its owner node: asked first, as a model's are.
            match std::mem::replace(&mut self.pass, TenantPass::Untaken) {
                TenantPass::Heard(Some(v)) => match (v.result(), v.hold) {
                    (Ok(()), Some(dollars)) => Ok(Some(TenantHold::on_owner(&ask, dollars))),
                    (Ok(()), None) => Ok(None),
                    (Err(d), _) => Err(Refusal::of(config, &tenant, d)),
                },
                TenantPass::Heard(None) => {
                    // The ask may have reached the owner all the same: what it reserved is
                    // given back, and this node admits from its share.
                    self.outbox.push(Op::TenantSettle(Settlement::release(&ask, now_ms)));
                    let model = self.models.get(from).cloned().unwrap_or_default();
                    self.events.push(Event::LocalShare { model });
                    tenant_gate::take(store, config, &ask, Some(config.fleet.nodes), now_ms)
                }
                _ => {
                    self.pass = TenantPass::Asking;
                    let timeout_ms = config.fleet.timeout_ms.min(self.deadline_ms.saturating_sub(now_ms));
                    let bucket = tenant_gate::bucket(&tenant);
                    return Some(Admission::AskOwner { bucket, op: Op::TenantTake(ask), timeout_ms });
                }
            }
        };
        let refusal = match taken {
            Ok(hold) => {
                self.pass = TenantPass::Taken(hold);
                return None;
            }
            Err(refusal) => refusal,
        };
        // A store the host does not know will not appear by waiting.
        if let Refusal::Bucket(d) = refusal {
            if d.kind != Kind::StoreMissing {
                let until = now_ms.saturating_add(d.wait_ms.unwrap_or(CONCURRENCY_POLL_MS));
                let contended = d.kind == Kind::Contended;
                if (until <= self.hold_until_ms || contended) && until < self.deadline_ms {
                    return Some(Admission::Wait { until_ms: until });
                }
            }
        }
        let model = self.models.get(from).cloned().unwrap_or_default();
        if refusal != Refusal::TooLarge {
            self.events.push(Event::RateLimited { model: model.clone() });
        }
        Some(Admission::Denied(tenant_gate::refused(config, &tenant, &model, refusal, self.estimate)))
    }

    /// How soon a call refused a slot of model `i` looks again: every `CONCURRENCY_POLL_MS`
    /// near the head of the line, less often the more slots must free before its turn
    /// (every waiter reads the whole line when it looks).
    fn slot_poll(&self, config: &Config, i: usize, d: &Denial) -> u64 {
        let slots = self.models.get(i).and_then(|m| config.model(m)).and_then(|(_, m)| m.max_in_flight);
        let rounds = d.ahead / u64::from(slots.unwrap_or(1).max(1));
        CONCURRENCY_POLL_MS.saturating_mul(rounds.saturating_add(1)).min(POLL_CAP_MS)
    }

    /// Reserves capacity on model `i`, with its owner's verdict when one was heard.
    fn reserve(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        i: usize,
        heard: Option<Option<Verdict>>,
        now_ms: u64,
        nonce: u64,
    ) -> Reservation {
        let name = self.models[i].clone();
        let Some((bucket, m)) = config.model(&name) else { return Reservation::Reserved };
        let l = Limits::of(m, &config.rate_limit);
        if l.unbounded() {
            // Nothing to take, hold or settle: no ticket, no bucket read, no owner asked;
            // except that an admission the model's owner gave before a reload took the
            // limits away is the owner's to settle all the same (its slot is held there).
            if let (Some(Some(v)), Some(id)) = (&heard, self.id) {
                if v.admitted {
                    self.ticket = Some(Ticket::Owner(id));
                    self.take_place(store, config, bucket, &Ticket::Owner(id), now_ms);
                }
            }
            return Reservation::Reserved;
        }
        if !l.fits(self.estimate) {
            // Never: it must not wait at its place, nor take the whole bucket.
            return Reservation::Denied(Denial::of(Kind::TooLarge, None));
        }
        // A call holds its in-flight slot no longer than the flight can last.
        let hold = self.deadline_ms.saturating_sub(now_ms) + 1_000;
        let (estimate, id) = (self.estimate, *self.id.get_or_insert(nonce));
        let tag = *self.tenant_tag.get_or_insert_with(|| priority::tenant_tag(self.tenant.as_deref()));
        let who = Who { id, estimate, class: self.class, tenant: tag };
        // A call that may still wait keeps a place in line while it is refused.
        let waits = now_ms < self.hold_until_ms;
        let (ticket, taken) = if !config.fleet.shared_limits() {
            (Ticket::Local(id), limits::take(store, bucket, &l, &who, now_ms, hold, waits))
        } else {
            match heard {
                None => {
                    let (class, tenant) = (self.class, tag);
                    let op = Op::Take { model: name.clone(), id, estimate, hold_ms: hold, class, tenant, waits };
                    return Reservation::Ask(bucket.to_owned(), Box::new(op));
                }
                Some(Some(verdict)) => (Ticket::Owner(id), verdict.result()),
                Some(None) => {
                    self.events.push(Event::LocalShare { model: name.clone() });
                    let share = l.share(config.fleet.nodes);
                    (
                        Ticket::Share(id),
                        limits::take(store, &limits::share_bucket(bucket), &share, &who, now_ms, hold, waits),
                    )
                }
            }
        };
        self.take_place(store, config, bucket, &ticket, now_ms);
        match taken {
            Ok(()) => {
                self.ticket = Some(ticket);
                Reservation::Reserved
            }
            Err(d) => {
                // A call that lost every race may hold a place from before: it is kept to leave.
                if waits && !is_final(d.kind) {
                    self.lined.push((bucket.to_owned(), i, ticket));
                    if d.kind != Kind::Contended && !std::mem::replace(&mut self.queued, true) {
                        self.events.push(Event::Queued { class: self.class });
                    }
                }
                Reservation::Denied(d)
            }
        }
    }

    /// One place per bucket (fallbacks may share one): the call's place in `bucket`'s line
    /// is now `ticket`'s, and one held elsewhere (the owner's line, or this node's share) is
    /// given up there.
    fn take_place(&mut self, store: &impl CasStore, config: &Config, bucket: &str, ticket: &Ticket, now_ms: u64) {
        if let Some(at) = self.lined.iter().position(|(b, _, _)| b == bucket) {
            let (_, j, held) = self.lined.swap_remove(at);
            if std::mem::discriminant(&held) != std::mem::discriminant(ticket) {
                self.leave(store, config, j, held, now_ms);
            }
        }
    }

    /// Gives up the call's places in the lines of models it was not admitted to.
    fn leave_lines(&mut self, store: &impl CasStore, config: &Config, now_ms: u64) {
        for (_, i, ticket) in std::mem::take(&mut self.lined) {
            self.leave(store, config, i, ticket, now_ms);
        }
    }

    /// Gives up the place `ticket` names in the line of model `i`'s bucket (settling a call
    /// that was never admitted frees its place).
    fn leave(&mut self, store: &impl CasStore, config: &Config, i: usize, ticket: Ticket, now_ms: u64) {
        self.settle_at(store, config, i, ticket, (None, ProviderHints::default(), 0), now_ms);
    }

    /// Settles what `ticket` holds in model `i`'s bucket, where it was taken: the call used
    /// `actual` tokens (`None`: unknown, or it was never admitted and only leaves the line),
    /// the provider said `hints`, and `retries` more requests went to a model owner.
    fn settle_at(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        i: usize,
        ticket: Ticket,
        (actual, hints, retries): (Option<u64>, ProviderHints, u64),
        now_ms: u64,
    ) {
        let Some(name) = self.models.get(i).cloned() else { return };
        let estimate = self.estimate;
        if let Ticket::Owner(id) = ticket {
            // The owner knows the model by its name, whatever this node's configuration
            // says of it now.
            self.outbox.push(Op::Settle { model: name, id, estimate, actual, hints, retries });
            return;
        }
        let Some((bucket, m)) = config.model(&name) else { return };
        let l = Limits::of(m, &config.rate_limit);
        match ticket {
            Ticket::Local(id) => limits::settle(store, bucket, &l, id, estimate, actual, &hints, now_ms),
            Ticket::Share(id) => {
                let share = l.share(config.fleet.nodes);
                limits::settle(store, &limits::share_bucket(bucket), &share, id, estimate, actual, &hints, now_ms);
            }
            Ticket::Owner(_) => {}
        }
    }

    /// The 429 for `model`, refused for `d`.
    fn rate_limited(&self, config: &Config, model: &str, d: Denial) -> Response {
        let l = config.model(model).map(|(_, m)| Limits::of(m, &config.rate_limit));
        let what = match (d.kind, l) {
            (Kind::Requests, Some(l)) => {
                format!("requests per min (RPM): Limit {}", limits::whole(l.rpm.unwrap_or(0.0)))
            }
            (Kind::Tokens, Some(l)) => format!("tokens per min (TPM): Limit {}", limits::whole(l.tpm.unwrap_or(0.0))),
            (Kind::Concurrency, Some(l)) => format!("requests in flight: Limit {}", l.max_in_flight.unwrap_or(0)),
            (Kind::Shed, _) => format!("{} requests: the rest is kept for higher priorities", self.class.as_str()),
            (Kind::QueueFull, _) => format!("{} requests: the waiting line is full", self.class.as_str()),
            _ => "requests".to_owned(),
        };
        let wait = d.wait_ms.unwrap_or(1_000).max(1);
        let shed = match d.kind {
            Kind::Shed => Some("priority"),
            Kind::QueueFull => Some("queue-full"),
            _ => None,
        };
        let e = ApiError {
            status: 429,
            message: format!("Rate limit reached for {model} on {what}. Please try again in {}.", duration(wait)),
            kind: d.kind.as_str(),
            param: None,
            code: "rate_limit_exceeded",
        };
        let limited = Response::json(429, e.body())
            .with_header(headers::RETRY_AFTER, wait.div_ceil(1000).to_string())
            .with_header("retry-after-ms", wait.to_string())
            .with_header(headers::MODEL, model.to_owned());
        // Marked with its class: a waiter of a higher class does not take it as its answer.
        match shed {
            Some(why) => limited.shed(why, self.class),
            None => limited.with_header(headers::PRIORITY, self.class.as_str().to_owned()),
        }
    }
}

/// A refusal for priority, or for a call larger than the bucket: final, never waited out.
fn is_final(kind: Kind) -> bool {
    matches!(kind, Kind::Shed | Kind::QueueFull | Kind::TooLarge)
}

/// What is left of `tenant`'s budget now, as its gauges show it (`None`: no such tenant).
pub fn budget_left(store: &impl CasStore, config: &Config, tenant: &str, now_ms: u64) -> Option<Left> {
    crate::core::limits::budget::standing(store, tenant, now_ms).left(config, tenant)
}

/// What a flight's `Event::BudgetStanding` leaves of its tenant's budget.
pub fn budget_left_after(config: &Config, tenant: &str, spent: (u64, u64), keepers: u32) -> Option<Left> {
    crate::core::limits::budget::Standing { spent, keepers }.left(config, tenant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::limits::budget;
    use crate::core::store::MemStore;

    /// gpt-4.1 at $10/$30 per Mtok with a bucket of 10 requests, and tenant `t` with
    /// `usd_per_day`; `fleet`: its limits kept by owner nodes.
    fn config(usd_per_day: f64, fleet: bool) -> Config {
        let fleet = if fleet { r#""fleet":{"cluster":"owners","nodes":4},"# } else { "" };
        let raw = format!(
            r#"{{{fleet}"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30,"requests_per_minute":10}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":{usd_per_day}}}}}}}"#,
            "a".repeat(64)
        );
        Config::parse(raw.as_bytes()).unwrap()
    }

    /// A call of 100 estimated tokens that can be billed as many (a worst case of 3000
    /// micro-dollars at the output price).
    fn standing(c: &Config, tenant: Option<&str>) -> Standing {
        let claim =
            Claim { model: "gpt-4.1", tenant, class: Class::Standard, estimate: 100, worst_tokens: 100, started_ms: 0 };
        Standing::new(c, &claim)
    }

    fn requests_left(s: &MemStore, c: &Config) -> f64 {
        let l = Limits::of(c.models.get("gpt-4.1").unwrap(), &c.rate_limit);
        limits::peek(s, "gpt-4.1", &l, 0).requests
    }

    #[test]
    fn a_tenant_past_its_budget_is_refused_before_any_models_bucket_is_touched() {
        let (s, c) = (MemStore::new(), config(0.004, false));
        let mut first = standing(&c, Some("t"));
        assert_eq!(first.admit(&s, &c, 0, 0, 1), Admission::Admitted { index: 0 });
        assert_eq!(budget::spent(&s, "t", 0).0, 3000, "its worst case, held before the call");
        assert_eq!(requests_left(&s, &c), 9.0);
        // 3000 held + 3000 more is past the day's 4000: refused at the door, the model's
        // bucket untouched, and nothing to settle.
        let Admission::Denied(r) = standing(&c, Some("t")).admit(&s, &c, 0, 0, 2) else { panic!("refused") };
        assert_eq!(r.status, 429);
        assert_eq!(requests_left(&s, &c), 9.0);
        // A caller without a tenant passes on the model's bucket alone.
        assert_eq!(standing(&c, None).admit(&s, &c, 0, 0, 3), Admission::Admitted { index: 0 });
        assert_eq!(requests_left(&s, &c), 8.0);
        // The first call settles at what it was billed.
        first.bill(&c, 0, Billed::Known(crate::core::api::usage::Usage::new(7, 5)));
        first.settle(&s, &c, 0, (Some(12), 0), &ProviderHints::default(), 1);
        first.close(&s, &c, 1);
        assert_eq!(budget::spent(&s, "t", 1).0, 220);
        // The record as the settlement left it, for the tenant's gauges (no second read).
        let standing = Event::BudgetStanding { tenant: "t".into(), spent: (220, 220), keepers: 1 };
        assert_eq!(first.events.last(), Some(&standing));
    }

    /// A model listed for its prices alone limits nothing: a call on it is admitted, billed
    /// and settled without one read or write of the store, alone and in a fleet (no owner
    /// asked). Given a limit, the same call takes and settles its bucket.
    #[test]
    fn a_model_without_limits_costs_the_store_nothing() {
        use crate::core::store::Counting;
        for (fleet, limit, calls) in [("", "", (0, 0)), (r#""fleet":{"cluster":"owners","nodes":4},"#, "", (0, 0))]
            .into_iter()
            .chain([("", r#","max_in_flight":5"#, (2, 2))])
        {
            let raw = format!(
                r#"{{{fleet}"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30{limit}}}}}}}"#
            );
            let c = Config::parse(raw.as_bytes()).unwrap();
            let s = Counting::new();
            let mut call = standing(&c, None);
            assert_eq!(call.admit(&s, &c, 0, 0, 1), Admission::Admitted { index: 0 }, "{fleet}{limit}");
            call.bill(&c, 0, Billed::Known(crate::core::api::usage::Usage::new(7, 5)));
            call.settle(&s, &c, 0, (Some(12), 0), &ProviderHints::default(), 1);
            call.close(&s, &c, 1);
            assert_eq!(s.calls(), calls, "{fleet}{limit}");
        }
    }

    #[test]
    fn a_tenant_owners_verdict_the_flight_never_read_is_given_back_when_it_closes() {
        let c = config(0.01, true);
        let (here, owner) = (MemStore::new(), MemStore::new());
        let mut door = standing(&c, Some("t"));
        let Admission::AskOwner { bucket, op, .. } = door.admit(&here, &c, 0, 0, 1) else { panic!("asks") };
        assert_eq!(bucket, "tenant.t");
        assert!(door.asking_tenant());
        let verdict = fleet::serve_op(&owner, &c, op, 0);
        assert!(verdict.admitted);
        assert_eq!(budget::spent(&owner, "t", 0).0, 3000, "reserved on the owner");
        // The verdict came, but the flight reached its deadline before reading it.
        door.on_verdict(Some(verdict));
        door.close(&here, &c, 5);
        let [release @ Op::TenantSettle(Settlement { release: true, .. })] = door.outbox.as_slice() else {
            panic!("a release for the owner: {:?}", door.outbox)
        };
        fleet::serve(&owner, &c, &release.to_json(), 6).unwrap();
        assert_eq!(budget::spent(&owner, "t", 6).0, 0, "what the owner reserved is given back");
    }

    /// In a fleet the tenant's owner node keeps its gauges: a call this node admitted from
    /// its own share of the budget (the owner out of reach) reports no standing for them.
    #[test]
    fn a_share_taken_while_the_owner_is_out_of_reach_sets_no_gauge() {
        let (c, here) = (config(1.0, true), MemStore::new());
        let mut door = standing(&c, Some("t"));
        assert!(matches!(door.admit(&here, &c, 0, 0, 1), Admission::AskOwner { .. }), "the tenant's owner");
        door.on_verdict(None);
        assert!(matches!(door.admit(&here, &c, 0, 0, 1), Admission::AskOwner { .. }), "the model's owner");
        door.on_verdict(None);
        assert_eq!(door.admit(&here, &c, 0, 0, 1), Admission::Admitted { index: 0 });
        door.bill(&c, 0, Billed::Known(crate::core::api::usage::Usage::new(7, 5)));
        door.settle(&here, &c, 0, (Some(12), 0), &ProviderHints::default(), 1);
        door.close(&here, &c, 1);
        assert!(!door.events.iter().any(|e| matches!(e, Event::BudgetStanding { .. })), "{:?}", door.events);
    }

    #[test]
    fn an_ask_that_timed_out_at_the_deadline_is_given_back_and_an_unread_admission_freed() {
        let c = config(0.01, true);
        let (here, owner) = (MemStore::new(), MemStore::new());
        // The tenant's owner reserved, but its answer never came in time.
        let mut door = standing(&c, Some("t"));
        let Admission::AskOwner { op, .. } = door.admit(&here, &c, 0, 0, 1) else { panic!("asks") };
        fleet::serve_op(&owner, &c, op, 0);
        door.on_verdict(None);
        door.close(&here, &c, 5);
        let [release @ Op::TenantSettle(Settlement { release: true, .. })] = door.outbox.as_slice() else {
            panic!("a release for the owner: {:?}", door.outbox)
        };
        fleet::serve(&owner, &c, &release.to_json(), 6).unwrap();
        assert_eq!(budget::spent(&owner, "t", 6).0, 0);
        // The model's owner admitted to its one slot, and the flight ended before it read
        // so: the slot is freed for the next call.
        let one = r#"{"fleet":{"cluster":"owners","nodes":4},"models":{"gpt-4.1":{"max_in_flight":1}}}"#;
        let c = Config::parse(one.as_bytes()).unwrap();
        let owner = MemStore::new();
        let mut door = standing(&c, None);
        let Admission::AskOwner { op, .. } = door.admit(&here, &c, 0, 0, 2) else { panic!("asks the model") };
        let admitted = fleet::serve_op(&owner, &c, op.clone(), 0);
        assert!(admitted.admitted);
        let mut next = standing(&c, None);
        let Admission::AskOwner { op: other, .. } = next.admit(&here, &c, 0, 1, 3) else { panic!("asks") };
        assert!(!fleet::serve_op(&owner, &c, other.clone(), 1).admitted, "the slot is taken");
        door.on_verdict(Some(admitted));
        door.close(&here, &c, 5);
        let [settle @ Op::Settle { actual: Some(0), .. }] = door.outbox.as_slice() else {
            panic!("a settlement for the model owner: {:?}", door.outbox)
        };
        fleet::serve(&owner, &c, &settle.to_json(), 6).unwrap();
        assert!(fleet::serve_op(&owner, &c, other, 7).admitted, "the slot is free again");
    }

    /// A reload between the ask and the verdict takes the model's limit away on this node:
    /// the call goes unlimited here, and the slot the owner gave it is settled there once,
    /// when the call ends, not held until the hold runs out (nor freed while it runs, had
    /// the call waited in the owner's line first).
    #[test]
    fn an_owners_admission_heard_after_a_reload_dropped_the_limit_is_settled_there() {
        let one = r#"{"fleet":{"cluster":"owners","nodes":4},"models":{"gpt-4.1":{"max_in_flight":1}}}"#;
        let free = r#"{"fleet":{"cluster":"owners","nodes":4},"models":{"gpt-4.1":{"usd_per_mtok_input":1}}}"#;
        let (c, here) = (Config::parse(one.as_bytes()).unwrap(), MemStore::new());
        for waited in [false, true] {
            let reloaded = free;
            let owner = MemStore::new();
            let mut door = standing(&c, None);
            if waited {
                // The slot is taken: the call waits in the owner's line, then asks again.
                let mut first = standing(&c, None);
                let Admission::AskOwner { op, .. } = first.admit(&here, &c, 0, 0, 9) else { panic!("asks") };
                assert!(fleet::serve_op(&owner, &c, op, 0).admitted);
                door.hold_until_ms = 60_000;
                let Admission::AskOwner { op, .. } = door.admit(&here, &c, 0, 0, 2) else { panic!("asks") };
                let refused = fleet::serve_op(&owner, &c, op, 0);
                assert!(!refused.admitted);
                door.on_verdict(Some(refused));
                assert!(matches!(door.admit(&here, &c, 0, 0, 2), Admission::Wait { .. }), "in the owner's line");
                let settle = Op::Settle {
                    model: "gpt-4.1".into(),
                    id: 9,
                    estimate: 100,
                    actual: Some(1),
                    hints: ProviderHints::default(),
                    retries: 0,
                };
                fleet::serve(&owner, &c, &settle.to_json(), 1).unwrap();
            }
            let Admission::AskOwner { op, .. } = door.admit(&here, &c, 0, 1, 2) else { panic!("asks the model") };
            let admitted = fleet::serve_op(&owner, &c, op, 1);
            assert!(admitted.admitted, "waited: {waited}");
            let reloaded = Config::parse(reloaded.as_bytes()).unwrap();
            door.on_verdict(Some(admitted));
            assert_eq!(door.admit(&here, &reloaded, 0, 1, 2), Admission::Admitted { index: 0 });
            assert!(door.outbox.is_empty(), "nothing settled while the call runs: {:?}", door.outbox);
            door.settle(&here, &reloaded, 0, (Some(12), 0), &ProviderHints::default(), 2);
            door.close(&here, &reloaded, 3);
            let [settle @ Op::Settle { actual: Some(12), .. }] = door.outbox.as_slice() else {
                panic!("a settlement for the model owner: {:?}", door.outbox)
            };
            let mut next = standing(&c, None);
            let Admission::AskOwner { op: other, .. } = next.admit(&here, &c, 0, 1, 3) else { panic!("asks") };
            assert!(!fleet::serve_op(&owner, &c, other.clone(), 1).admitted, "the slot is taken until settled");
            fleet::serve(&owner, &c, &settle.to_json(), 4).unwrap();
            assert!(fleet::serve_op(&owner, &c, other, 5).admitted, "the slot is free again");
        }
    }
}
