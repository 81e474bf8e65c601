//! A tenant's dollar budgets, per UTC day and per UTC month, in one shared-data record per
//! tenant (`holysheep/budget/<tenant>`: a bounded set of keys, kept across reloads). A call
//! reserves its worst case before it leaves and settles with what it cost, so concurrent
//! calls can never spend more than the budget. The record lists the reservations in flight
//! by call, each until its deadline: a settlement takes out only a reservation it finds (a
//! late one, a repeated one or one sent to another node takes nothing out), and one never
//! settled stays charged, its entry dropped at its deadline. Amounts are micro-dollars.

mod held;
mod record;

#[cfg(test)]
use self::held::SUMS_FROM;
use self::held::{Entry, Held, SUMS_MARK};
use self::record::{numbers, read_numbers, Record};
use crate::core::config::tenants::Caps;
use crate::core::config::Config;
use crate::core::store::{cas_after, CasStore, StoreError, MAX_RACES};
use crate::core::wire::codec;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write::Object;

const DAY_MS: u64 = 86_400_000;
/// The most reservations a record lists; beyond it the oldest is dropped (it stays charged).
pub(crate) const MAX_IN_FLIGHT: usize = 256;

/// What a call reserved, and in which periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub micro: u64,
    day: u64,
    month: u64,
}

impl Hold {
    /// A reservation of `micro` made at `now_ms`.
    pub fn at(micro: u64, now_ms: u64) -> Hold {
        let (day, month) = periods(now_ms);
        Hold { micro, day, month }
    }

    /// As the fleet's messages write it.
    pub(crate) fn to_json(self) -> String {
        Object::new().u64("micro", self.micro).u64("day", self.day).u64("month", self.month).finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<Hold> {
        let [micro, day, month] = json.fields(["micro", "day", "month"])?;
        Some(Hold { micro: micro?.as_u64()?, day: day?.as_u64()?, month: month?.as_u64()? })
    }
}

/// Why a reservation was refused: the budget it would exceed and when that period ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    pub period: &'static str,
    pub cap_micro: u64,
    pub retry_after_ms: u64,
}

impl Exhausted {
    /// `period`'s cap (`"day"` or `"month"`) left no room at `now_ms`: until the period ends.
    fn of(period: &'static str, cap_micro: u64, now_ms: u64) -> Exhausted {
        let ends_ms = if period == "day" { next_day_ms(now_ms) } else { next_month_ms(now_ms) };
        Exhausted { period, cap_micro, retry_after_ms: ends_ms - now_ms }
    }
}

/// Why a reservation was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// What was settled leaves no room for the call's worst case: not before the period ends.
    Exhausted(Exhausted),
    /// There is room once other calls in flight settle: their reservations hold it now.
    Held,
    /// Every compare-and-swap lost a race: look again shortly.
    Contended,
    /// With a spend store, the tenant's record has not been read from it since this node
    /// began to keep it: no call is admitted until it is (`budget_store::wanted`).
    Unread,
    /// The store has never answered for the record, and what this node admits meanwhile
    /// (`budget_store.outage_usd`) leaves no room for the call: look again once it is read.
    Outage,
}

/// How the budgets are backed: by the spend store (`budget_store`), and the fleet's size,
/// whose share of each budget a node admits from while the store cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backing {
    pub store: bool,
    pub nodes: u32,
    /// What a node admits per period while the store has never answered
    /// (`budget_store.outage_usd`; `None`: one call's worst case alone).
    pub outage_micro: Option<u64>,
    /// Independent admitters that share the store (`budget_store.replicas`): each holds in
    /// flight and unwritten at most its share of what the store left when last read.
    pub replicas: u32,
}

impl Backing {
    /// Process memory only (no store).
    #[cfg(test)]
    pub(crate) const MEMORY: Backing = Backing { store: false, nodes: 1, outage_micro: None, replicas: 1 };

    /// As `config` backs a tenant's budget (`store`: by the spend store).
    pub fn of(config: &Config, store: bool) -> Backing {
        Backing {
            store,
            nodes: config.fleet.nodes,
            outage_micro: config.budget_store.outage_micro(),
            replicas: config.budget_store.replicas,
        }
    }
}

/// What marks a writer's last write among a record's entries (`Spend::decode`).
const WRITES_MARK: &str = "~w";

/// How many writers' last writes a stored record names (`Stored::writes`): a write whose
/// answer was lost is known to have landed unless this many other writers wrote since.
pub(crate) const MAX_WRITERS: usize = 64;

/// Settled spend of one day and one month, as the spend store keeps it for a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stored {
    pub day: u64,
    pub day_micro: u64,
    pub month: u64,
    pub month_micro: u64,
    /// The tag of the write that put it there (a random number per write).
    pub write: Option<u64>,
    /// Each recent writer's last write, `[writer, tag]`, the latest last (at most
    /// `MAX_WRITERS`; a writer is a process): a write whose answer was lost is known by its
    /// tag even after other writers wrote over it.
    pub writes: Vec<(u64, u64)>,
}

impl Stored {
    /// As the spend store keeps it: `write` and `writes` are left out when there are none.
    pub fn to_json(&self) -> String {
        let o = Object::new()
            .u64("day", self.day)
            .u64("day_micro", self.day_micro)
            .u64("month", self.month)
            .u64("month_micro", self.month_micro);
        let o = match self.write {
            Some(w) => o.u64("write", w),
            None => o,
        };
        if self.writes.is_empty() {
            return o.finish();
        }
        let pairs: Vec<String> = self.writes.iter().map(|(w, t)| format!("[{w},{t}]")).collect();
        o.raw("writes", &format!("[{}]", pairs.join(","))).finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<Stored> {
        let names = ["day", "day_micro", "month", "month_micro", "write", "writes"];
        let [day, day_micro, month, month_micro, write, writes] = json.fields(names)?;
        let pair = |p: Json<'_>| {
            let mut items = p.is_array().then(|| p.items())?;
            match (items.next(), items.next(), items.next()) {
                (Some(w), Some(t), None) => Some((w.as_u64()?, t.as_u64()?)),
                _ => None,
            }
        };
        let writes = scan::opt(writes, |w| w.is_array().then(|| w.items().map(pair).collect::<Option<Vec<_>>>())?)?;
        Some(Stored {
            day: day?.as_u64()?,
            day_micro: day_micro?.as_u64()?,
            month: month?.as_u64()?,
            month_micro: month_micro?.as_u64()?,
            write: scan::opt(write, Json::as_u64)?,
            writes: writes.unwrap_or_default(),
        })
    }

    /// What it holds for the day `day` and the month `month` (nothing for other periods).
    fn within(&self, day: u64, month: u64) -> (u64, u64) {
        (if self.day == day { self.day_micro } else { 0 }, if self.month == month { self.month_micro } else { 0 })
    }

    /// With `(day_micro, month_micro)` more spent in `day` and `month`, written by `writer`
    /// as `write` (its entry in `writes` moves to the end; the oldest writers' beyond
    /// `MAX_WRITERS` are dropped). The periods never go back: spend a node whose clock lags
    /// settled in a day (or month) the store has already left counts in the store's, never
    /// resets it.
    pub fn plus(&self, day: u64, month: u64, (d, m): (u64, u64), (writer, write): (u64, u64)) -> Stored {
        let (day, month) = (day.max(self.day), month.max(self.month));
        let (old_d, old_m) = self.within(day, month);
        let mut writes: Vec<(u64, u64)> = self.writes.iter().filter(|(w, _)| *w != writer).copied().collect();
        writes.push((writer, write));
        writes.drain(..writes.len().saturating_sub(MAX_WRITERS));
        Stored {
            day,
            day_micro: old_d.saturating_add(d),
            month,
            month_micro: old_m.saturating_add(m),
            write: Some(write),
            writes,
        }
    }

    /// Whether the write tagged `tag` is in it (the last write, or a writer's last).
    pub fn holds(&self, tag: u64) -> bool {
        self.write == Some(tag) || self.writes.iter().any(|(_, t)| *t == tag)
    }
}

/// How a record stands with the spend store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Mark {
    /// Not read from the store since this node began to keep it.
    #[default]
    Unread,
    /// Read (or last written) at the store's `revision`.
    Read { revision: u64 },
    /// The store could not be read: calls are admitted from this node's share, and a round
    /// of writes from this time on reads it again.
    Unreachable { until_ms: u64 },
}

/// Spend in the current day and month (reserved and settled), and the reservations listed;
/// with a spend store, also what the store held when last read and what was settled here
/// since and not yet written to it (`unsent`): the charge is always their sum with the
/// reservations listed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Spend {
    pub(super) day: u64,
    day_micro: u64,
    pub(super) month: u64,
    month_micro: u64,
    held: Held,
    /// Reservations no longer listed (past their deadline, or pushed off the list) and
    /// charged at their worst case: a call that settles after all (a stream that outlived
    /// its deadline) replaces that worst case by its cost. At most `MAX_LAPSED`.
    lapsed: Vec<Entry>,
    /// Lapsed reservations whose worst case was written to the store: a late settlement
    /// is charged only what its cost passes that worst case. At most `MAX_LAPSED`.
    paid: Vec<Entry>,
    pub(super) mark: Mark,
    pub(super) stored: Stored,
    pub(super) unsent: (u64, u64),
    /// When the store's value was last learned (read, or written).
    pub(super) learned_ms: u64,
    /// A write sent and not yet known to have landed or not: no other is sent meanwhile
    /// (a second would add the same spend again), until its deadline.
    pub(super) pending: Option<Pending>,
    /// Writes given up that may still land (their answer lost, the key as they found it):
    /// what they sent is counted as unsent until a later revision of the key says whether
    /// it holds them. At most `MAX_UNSURE`.
    pub(super) unsure: Vec<Unsure>,
    /// Other processes seen writing the tenant's spend while this one keeps it.
    pub(super) keepers: Keepers,
}

/// The processes that keep a tenant's spend beside this one, as the store's writers show
/// them: one owner of a tenant is the rule, but while a fleet's ring changes (or when
/// stores are shared without `budget_store.replicas`) two can admit at once. While others
/// are seen, each admits only its share of what the store left, and writes at least every
/// `budget_store::REFRESH_MS` while it admits, so that the others keep seeing it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Keepers {
    /// Each other writer seen, until when it counts, and whether it was seen writing (not
    /// only named by the record this process read first; at most `MAX_KEEPERS`).
    pub(super) seen: Vec<Seen>,
    /// When this process last admitted a call of the tenant.
    pub(super) admitted_ms: u64,
    /// When a write of this process last landed.
    pub(super) wrote_ms: u64,
}

/// Another writer of a tenant's spend, as a keeper saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    pub(super) writer: u64,
    pub(super) until_ms: u64,
    /// Seen writing, not only named by the record read first.
    pub(super) writing: bool,
}

impl Keepers {
    /// How many keep the spend at `now_ms`, this one counted.
    pub(super) fn at(&self, now_ms: u64) -> u32 {
        1 + self.seen.iter().filter(|s| now_ms < s.until_ms).count() as u32
    }

    /// How many were seen writing, at `now_ms`, this one counted.
    pub(super) fn writing_at(&self, now_ms: u64) -> u32 {
        1 + self.seen.iter().filter(|s| s.writing && now_ms < s.until_ms).count() as u32
    }

    /// `seen` counts until its time (or longer, if its writer already did); those past
    /// their time are forgotten.
    pub(super) fn saw(&mut self, seen: Seen, now_ms: u64) {
        let kept = self.seen.iter().position(|s| s.writer == seen.writer);
        match kept.map(|at| &mut self.seen[at]) {
            Some(s) => {
                s.until_ms = s.until_ms.max(seen.until_ms);
                s.writing |= seen.writing;
            }
            None => push_bounded(&mut self.seen, seen, MAX_KEEPERS),
        }
        self.seen.retain(|s| now_ms < s.until_ms);
    }

    /// Whether this process still keeps the tenant as one of several: others are seen, and
    /// it admitted a call lately or holds one in flight.
    pub(super) fn shared_and_busy(&self, now_ms: u64, in_flight: bool) -> bool {
        self.at(now_ms) > 1 && (in_flight || now_ms.saturating_sub(self.admitted_ms) < KEEPERS_MS)
    }
}

/// How long another process's write counts after it was seen: three of the writes a keeper
/// makes while it admits, at least every `budget_store::REFRESH_MS` or `flush_ms` (at most
/// 10 s), whichever is longer.
pub(crate) const KEEPERS_MS: u64 = 30_000;
/// The most other keepers a record names.
const MAX_KEEPERS: usize = 8;
/// What marks the keepers among a record's entries: `~k<writer>:<until>` for each other
/// writer seen writing, `~q<writer>:<until>` for one only named by the record read first,
/// `~a<when>` for this process's last admission, `~t<when>` for its last write that landed.
const KEEPERS_MARK: &str = "~k";
const NAMED_MARK: &str = "~q";
const ADMITTED_MARK: &str = "~a";
const WROTE_MARK: &str = "~t";

/// A write given up while the key still stood at the revision it was sent against
/// (`base`): it may land yet, and the key's next revision says whether it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Unsure {
    pub(super) write: Pending,
    pub(super) base: u64,
}

/// The most writes a record keeps as unsure; beyond it the oldest is taken as not landed
/// (its spend is written again: counted twice, never lost).
pub(crate) const MAX_UNSURE: usize = 4;
/// What marks an unsure write among a record's entries.
const UNSURE_MARK: &str = "~u";

/// A write out to the store: its tag, what it adds, in which periods, and until when it
/// may still be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) tag: u64,
    pub(super) sent: (u64, u64),
    pub(super) day: u64,
    pub(super) month: u64,
    pub(super) until_ms: u64,
}

impl Spend {
    /// `day day_micro month month_micro`, then after `|` entries `id:micro:day:month:until`
    /// separated by `,` (the reservations listed, after their sums `~s`; lapsed ones
    /// marked `~`, paid ones `^`, and the store's writers' last writes `~w<writer>:<tag>`),
    /// then after `|` (a record kept with a spend store) the mark, its number, the store's
    /// four numbers, the two unsent amounts, when it was learned and the write out. A
    /// release reads the records of the one before it, and the one before reads this
    /// one's (a rollback keeps the spend).
    pub(super) fn decode(raw: &[u8]) -> Option<Spend> {
        let (totals, rest) = split_once(raw, b'|');
        let [day, day_micro, month, month_micro] = numbers(totals, b' ')?;
        let mut spend = Spend { day, day_micro, month, month_micro, held: Held::new(day, month), ..Spend::default() };
        // The reservations listed by their sums, their entries not read; a record without
        // sums (or whose sums do not fit) has each entry read below.
        let mut rest = rest.unwrap_or_default();
        if let Some(sums) = rest.strip_prefix(SUMS_MARK.as_bytes()) {
            let (sums, entries) = split_once(sums, b',');
            if let Some((held, after)) = entries.and_then(|entries| Held::read(sums, entries, (day, month))) {
                (spend.held, rest) = (held, after);
            }
        }
        let (held, backed) = split_once(rest, b'|');
        let (mut writes, mut unsure, mut lapsed, mut paid) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut admitted_ms, mut wrote_ms) = (None, None);
        // One pass over the entries. A marked one (`~`, `^`) that cannot be read is dropped,
        // never the record: a release reads past the marks of the next one, and a lapsed
        // entry only lowers a late settlement.
        for e in held.split(|&b| b == b',').filter(|e| !e.is_empty()) {
            let marked = |mark: &str| e.strip_prefix(mark.as_bytes());
            if let Some(rest) = marked(WRITES_MARK) {
                // The store's writers, `~w<writer>:<tag>`.
                writes.extend(numbers(rest, b':').map(|[w, t]| (w, t)));
            } else if let Some(rest) = marked(UNSURE_MARK) {
                // Unsure writes, `~u<tag>:<day sent>:<month sent>:<day>:<month>:<base>`.
                if let Some([tag, d, m, day, month, base]) = numbers(rest, b':') {
                    let write = Pending { tag, sent: (d, m), day, month, until_ms: 0 };
                    unsure.push(Unsure { write, base });
                }
            } else if let Some((rest, writing)) =
                marked(KEEPERS_MARK).map(|r| (r, true)).or_else(|| marked(NAMED_MARK).map(|r| (r, false)))
            {
                // The keepers, `~k<writer>:<until>` and `~q<writer>:<until>`.
                if let Some([writer, until_ms]) = numbers(rest, b':') {
                    spend.keepers.seen.push(Seen { writer, until_ms, writing });
                }
            } else if let Some(rest) = marked(ADMITTED_MARK) {
                admitted_ms = admitted_ms.or_else(|| codec::number(rest));
            } else if let Some(rest) = marked(WROTE_MARK) {
                wrote_ms = wrote_ms.or_else(|| codec::number(rest));
            } else if let Some(rest) = marked("~") {
                lapsed.extend(Entry::decode(rest));
            } else if let Some(rest) = marked("^") {
                paid.extend(Entry::decode(rest));
            } else {
                spend.held.push_read(Entry::decode(e)?, e);
            }
        }
        spend.keepers.admitted_ms = admitted_ms.unwrap_or(0);
        spend.keepers.wrote_ms = wrote_ms.unwrap_or(0);
        (spend.lapsed, spend.paid) = (lapsed, paid);
        let Some(backed) = backed else {
            // A record of a release without the store: what it charged beyond its
            // reservations was settled, and is the store's to be told.
            let (held_d, held_m) = spend.held.sums();
            spend.unsent = (day_micro.saturating_sub(held_d), month_micro.saturating_sub(held_m));
            spend.keepers = Keepers::default();
            return Some(spend);
        };
        spend.unsure = unsure;
        let mut f = [0; 15];
        let pending = match read_numbers(backed, b' ', &mut f)? {
            15 => {
                let [.., tag, pd, pm, day, month, until_ms] = f;
                Some(Pending { tag, sent: (pd, pm), day, month, until_ms })
            }
            9 => None,
            _ => return None,
        };
        let [mark, number, sd, sdm, sm, smm, ud, um, learned_ms, ..] = f;
        spend.pending = pending;
        spend.learned_ms = learned_ms;
        spend.mark = match mark {
            0 => Mark::Unread,
            1 => Mark::Read { revision: number },
            2 => Mark::Unreachable { until_ms: number },
            _ => return None,
        };
        spend.stored = Stored { day: sd, day_micro: sdm, month: sm, month_micro: smm, write: None, writes };
        spend.unsent = (ud, um);
        Some(spend)
    }

    /// The record as `decode` reads it, written number by number (no formatting machinery:
    /// a budgeted call writes it twice).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Record::with_capacity(128 + self.held.text_len());
        out.numbers(b' ', &[self.day, self.day_micro, self.month, self.month_micro]);
        out.0.push(b'|');
        let mut entries = out.list();
        self.held.write(&mut entries);
        for (mark, list) in [("~", &self.lapsed), ("^", &self.paid)] {
            for e in list {
                entries.entry(mark, &[e.id, e.micro, e.day, e.month, e.until_ms]);
            }
        }
        for (w, t) in &self.stored.writes {
            entries.entry(WRITES_MARK, &[*w, *t]);
        }
        for u in &self.unsure {
            let w = u.write;
            entries.entry(UNSURE_MARK, &[w.tag, w.sent.0, w.sent.1, w.day, w.month, u.base]);
        }
        for seen in &self.keepers.seen {
            entries.entry(if seen.writing { KEEPERS_MARK } else { NAMED_MARK }, &[seen.writer, seen.until_ms]);
        }
        for (mark, ms) in [(ADMITTED_MARK, self.keepers.admitted_ms), (WROTE_MARK, self.keepers.wrote_ms)] {
            if ms > 0 {
                entries.entry(mark, &[ms]);
            }
        }
        let (mark, number) = match self.mark {
            Mark::Unread => (0, 0),
            Mark::Read { revision } => (1, revision),
            Mark::Unreachable { until_ms } => (2, until_ms),
        };
        let s = &self.stored;
        out.0.push(b'|');
        out.numbers(
            b' ',
            &[mark, number, s.day, s.day_micro, s.month, s.month_micro, self.unsent.0, self.unsent.1, self.learned_ms],
        );
        if let Some(p) = self.pending {
            out.0.push(b' ');
            out.numbers(b' ', &[p.tag, p.sent.0, p.sent.1, p.day, p.month, p.until_ms]);
        }
        out.0
    }

    /// How the record stands (as read `at` `now_ms`), as its gauges show it.
    fn standing(&self, now_ms: u64) -> Standing {
        Standing { spent: (self.day_micro, self.month_micro), keepers: self.keepers.at(now_ms) }
    }

    /// The spend as of `now_ms`: a new day or month starts from nothing, and reservations
    /// past their deadline are no longer listed: they stay charged, as settled at their
    /// worst case.
    pub(super) fn at(mut self, now_ms: u64) -> Spend {
        let (day, month) = periods(now_ms);
        if self.day != day {
            (self.day, self.day_micro, self.unsent.0) = (day, 0, 0);
        }
        if self.month != month {
            (self.month, self.month_micro, self.unsent.1) = (month, 0, 0);
        }
        let (today, this_month) = (self.day, self.month);
        let unread = self.held.rebase(today, this_month);
        self.unlisted(unread);
        let (lapsed, unread) = self.held.lapse(now_ms);
        self.unlisted(unread);
        for e in lapsed {
            self.lapse(e);
        }
        self
    }

    /// Reservations that made `(day_micro, month_micro)` in the current periods are no
    /// longer listed and stay charged, as settled at their worst case (with a store: for
    /// it to be told).
    fn unlisted(&mut self, (d, m): (u64, u64)) {
        self.unsent = (self.unsent.0.saturating_add(d), self.unsent.1.saturating_add(m));
    }

    /// Whether calls of the tenant are in flight here (their reservations listed).
    pub(super) fn in_flight(&self) -> bool {
        !self.held.is_empty()
    }

    /// What `write` sent is in the store: no longer unsent (in the periods it was sent for).
    pub(super) fn landed(&mut self, write: &Pending) {
        self.unsent.0 = if self.day == write.day { self.unsent.0.saturating_sub(write.sent.0) } else { self.unsent.0 };
        self.unsent.1 =
            if self.month == write.month { self.unsent.1.saturating_sub(write.sent.1) } else { self.unsent.1 };
    }

    /// `write` is given up while the key stood at `base`: it may land yet (one that sent
    /// nothing is forgotten).
    pub(super) fn unsure_of(&mut self, write: Pending, base: u64) {
        // A heartbeat sent nothing: whether it landed changes nothing.
        if write.sent == (0, 0) {
            return;
        }
        push_bounded(&mut self.unsure, Unsure { write, base }, MAX_UNSURE);
    }

    /// The key at `revision` holds (or not) each unsure write sent against an earlier one:
    /// those it holds landed, the others never will.
    pub(super) fn settle_unsure(&mut self, found: Option<&Stored>, revision: u64) {
        let (decided, open): (Vec<Unsure>, Vec<Unsure>) =
            std::mem::take(&mut self.unsure).into_iter().partition(|u| revision > u.base);
        self.unsure = open;
        for u in decided.iter().filter(|u| found.is_some_and(|v| v.holds(u.write.tag))) {
            self.landed(&u.write);
        }
    }

    /// The lapsed reservations' worst cases were written to the store: they stay.
    pub(super) fn forget_lapsed(&mut self) {
        for e in std::mem::take(&mut self.lapsed) {
            push_bounded(&mut self.paid, e, MAX_LAPSED);
        }
    }

    /// `e` is no longer listed, and stays charged at its worst case until its call settles.
    fn lapse(&mut self, e: Entry) {
        self.unlisted((if e.day == self.day { e.micro } else { 0 }, if e.month == self.month { e.micro } else { 0 }));
        push_bounded(&mut self.lapsed, e, MAX_LAPSED);
    }

    /// What a record backed by the store charges: what the store held when read, what was
    /// settled here since, and the reservations listed.
    pub(super) fn recharge(&mut self) {
        let (d, m) = self.stored.within(self.day, self.month);
        let (held_d, held_m) = self.held.sums();
        self.day_micro = d.saturating_add(self.unsent.0).saturating_add(held_d);
        self.month_micro = m.saturating_add(self.unsent.1).saturating_add(held_m);
    }

    /// The caps a call is held to as the record stands with the store (`Refused::Unread`:
    /// none yet).
    fn caps_now(&self, caps: Caps, backing: Backing) -> Result<Caps, Refused> {
        match self.mark {
            _ if !backing.store => Ok(caps),
            Mark::Read { .. } => Ok(caps),
            // Until a round's read again reaches the store (`budget_store::due`), a node
            // that never read the record knows nothing of what was spent: it admits its
            // outage allowance (within its share), by default one call alone.
            Mark::Unreachable { .. } => {
                let share = caps.share(backing.nodes);
                match backing.outage_micro {
                    Some(allowed) => Ok(Caps {
                        per_day: share.per_day.map(|c| c.min(allowed)),
                        per_month: share.per_month.map(|c| c.min(allowed)),
                    }),
                    None if self.day_micro == 0 && self.month_micro == 0 => Ok(share),
                    None => Err(Refused::Outage),
                }
            }
            Mark::Unread => Err(Refused::Unread),
        }
    }

    /// Whether a call of `micro` is admitted as the record stands with the store: an
    /// outage allowance spent is the store's silence, not the tenant's budget.
    fn admits(&self, caps: Caps, backing: Backing, micro: u64, now_ms: u64) -> Result<(), Refused> {
        let outage = backing.store && matches!(self.mark, Mark::Unreachable { .. });
        let mut found = self.room(self.caps_now(caps, backing)?, micro, now_ms);
        let sharers = backing.replicas.max(self.keepers.at(now_ms));
        if backing.store && sharers > 1 && !matches!(found, Err(Refused::Exhausted(_))) {
            // A share past for good outweighs a wait; a wait outweighs room.
            match self.within_share(caps, (backing.replicas, sharers), micro, now_ms) {
                Err(exhausted @ Refused::Exhausted(_)) => found = Err(exhausted),
                Err(held) if found.is_ok() => found = Err(held),
                _ => {}
            }
        }
        match found {
            Err(Refused::Exhausted(_) | Refused::Held) if outage => Err(Refused::Outage),
            other => other,
        }
    }

    /// With `replicas` independent admitters on one store, what this one holds in flight
    /// and has not written (its part of the record beside the store's) stays within its
    /// share of what the store left when it was last read: refused for the period when
    /// the call alone is past that share (the share only shrinks within a period), held
    /// while its own calls are in the way. `sharers` (at least `replicas`) counts the
    /// other keepers seen lately too: a call past the share only they make smaller waits
    /// for them to go.
    fn within_share(
        &self,
        caps: Caps,
        (replicas, sharers): (u32, u32),
        micro: u64,
        now_ms: u64,
    ) -> Result<(), Refused> {
        let (stored_day, stored_month) = self.stored.within(self.day, self.month);
        let periods = [
            (caps.per_day, stored_day, self.day_micro, "day"),
            (caps.per_month, stored_month, self.month_micro, "month"),
        ];
        let mut held = false;
        for (cap, stored, charged, period) in periods {
            let Some(cap) = cap else { continue };
            let left = cap.saturating_sub(stored);
            if micro > left / u64::from(replicas.max(1)) {
                return Err(Refused::Exhausted(Exhausted::of(period, cap, now_ms)));
            }
            held |= charged.saturating_sub(stored).saturating_add(micro) > left / u64::from(sharers.max(1));
        }
        if held {
            Err(Refused::Held)
        } else {
            Ok(())
        }
    }

    /// What a call of `micro` finds: room, room only once the reservations listed are
    /// settled, or no room until `caps`' period ends. A reservation past its deadline is no
    /// longer listed, so it counts as settled (at its worst case).
    fn room(&self, caps: Caps, micro: u64, now_ms: u64) -> Result<(), Refused> {
        let (held_d, held_m) = self.held.sums();
        let periods =
            [(caps.per_day, self.day_micro, held_d, "day"), (caps.per_month, self.month_micro, held_m, "month")];
        let mut busy = false;
        for (cap, charged, held, period) in periods {
            let Some(cap) = cap else { continue };
            if charged.saturating_sub(held).saturating_add(micro) > cap {
                return Err(Refused::Exhausted(Exhausted::of(period, cap, now_ms)));
            }
            busy |= charged.saturating_add(micro) > cap;
        }
        if busy {
            Err(Refused::Held)
        } else {
            Ok(())
        }
    }

    /// Takes out the reservation of call `id`, if it is listed, from the periods it is
    /// still in.
    fn release(&mut self, id: u64) {
        let taken = self.held.take(id);
        self.unlisted(taken.unread);
        let Some(e) = taken.entry else { return };
        if e.day == self.day {
            self.day_micro = self.day_micro.saturating_sub(e.micro);
        }
        if e.month == self.month {
            self.month_micro = self.month_micro.saturating_sub(e.micro);
        }
    }
}

/// `item` at the end of `list`, the oldest dropped to keep at most `max`.
fn push_bounded<T>(list: &mut Vec<T>, item: T, max: usize) {
    if list.len() >= max {
        list.remove(0);
    }
    list.push(item);
}

/// `text` before the first `sep`, and what follows it (`None`: no `sep`).
#[inline(never)]
fn split_once(text: &[u8], sep: u8) -> (&[u8], Option<&[u8]>) {
    match text.iter().position(|&b| b == sep) {
        Some(at) => (&text[..at], text.get(at + 1..)),
        None => (text, None),
    }
}

pub(crate) fn key(tenant: &str) -> String {
    ["holysheep/budget/", tenant].concat()
}

/// Lapsed reservations a record remembers (beyond them, a late settlement is charged on
/// top of the worst case already charged).
const MAX_LAPSED: usize = 64;

/// Reserves `micro` for the call `id` of `tenant` at `now_ms`, listed until `until_ms`, if
/// both periods have room (as the record stands with the spend store, `backing`).
pub fn reserve(
    store: &impl CasStore,
    tenant: &str,
    (caps, backing): (Caps, Backing),
    (id, micro, until_ms): (u64, u64, u64),
    now_ms: u64,
) -> Result<Hold, Refused> {
    let hold = Hold::at(micro, now_ms);
    if caps.is_none() {
        return Ok(hold);
    }
    let key = key(tenant);
    for _ in 0..MAX_RACES {
        // A broken store admits: the edge must not go down with it.
        let Ok(read) = store.get(&key) else { return Ok(hold) };
        let mut spend = read.value.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
        // A re-ask of the same call (a fleet retry) replaces its reservation, not adds one.
        spend.release(id);
        spend.admits(caps, backing, micro, now_ms)?;
        spend.day_micro = spend.day_micro.saturating_add(micro);
        spend.month_micro = spend.month_micro.saturating_add(micro);
        if spend.held.len() >= MAX_IN_FLIGHT {
            // No longer listed, still charged: as settled at its worst case.
            let oldest = spend.held.take_oldest();
            spend.unlisted(oldest.unread);
            if let Some(e) = oldest.entry {
                spend.lapse(e);
            }
        }
        spend.held.push(Entry { id, micro, day: hold.day, month: hold.month, until_ms });
        spend.keepers.admitted_ms = now_ms;
        match store.set(&key, &spend.encode(), cas_after(&read)) {
            Ok(()) => return Ok(hold),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(_)) => return Ok(hold),
        }
    }
    Err(Refused::Contended)
}

/// The call `id` ended having cost `actual` micro-dollars: its reservation, if the record
/// still lists it, is taken out of the periods it was made in (a period that ended since
/// is not touched), and the current ones are charged what the call cost (settled here,
/// for the spend store to be told).
pub fn settle(store: &impl CasStore, tenant: &str, caps: Caps, id: u64, actual: u64, now_ms: u64) -> Option<Standing> {
    if caps.is_none() {
        return None;
    }
    let settled = update(store, tenant, now_ms, |s| {
        s.release(id);
        // A call whose reservation lapsed was charged its worst case meanwhile: its cost
        // takes that charge's place (never going below what was charged, should part of
        // it have been written to the store already).
        let lapsed = s.lapsed.iter().position(|e| e.id == id).map(|at| s.lapsed.remove(at));
        // One whose worst case was written already: only what its cost passes it.
        let paid = s.paid.iter().position(|e| e.id == id).map(|at| s.paid.remove(at));
        let actual = paid.map_or(actual, |e| actual.saturating_sub(e.micro));
        let (day, month) = (s.day, s.month);
        let back = |period_matches: bool| lapsed.filter(|_| period_matches).map_or(0, |e| e.micro);
        let (back_d, back_m) =
            (back(lapsed.is_some_and(|e| e.day == day)), back(lapsed.is_some_and(|e| e.month == month)));
        s.unsent = (
            s.unsent.0.saturating_add(actual).saturating_sub(back_d),
            s.unsent.1.saturating_add(actual).saturating_sub(back_m),
        );
        s.recharge();
        true
    });
    settled.map(|s| s.standing(now_ms))
}

/// Reads `tenant`'s record as of `now_ms`, lets `f` change it (`f` says whether to write),
/// and writes it back by compare-and-swap; the record as written (or read), `None` when the
/// store failed or every race was lost.
pub(super) fn update(
    store: &impl CasStore,
    tenant: &str,
    now_ms: u64,
    mut f: impl FnMut(&mut Spend) -> bool,
) -> Option<Spend> {
    let key = key(tenant);
    for _ in 0..MAX_RACES {
        let read = store.get(&key).ok()?;
        let mut s = read.value.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
        if !f(&mut s) {
            return Some(s);
        }
        match store.set(&key, &s.encode(), cas_after(&read)) {
            Ok(()) => return Some(s),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(_)) => return None,
        }
    }
    None
}

/// Whether a call of `micro` would be admitted now, as `reserve` decides, without
/// reserving (a broken store admits).
pub(crate) fn check(
    store: &impl CasStore,
    tenant: &str,
    (caps, backing): (Caps, Backing),
    micro: u64,
    now_ms: u64,
) -> Result<(), Refused> {
    if caps.is_none() {
        return Ok(());
    }
    let Ok(read) = store.get(&key(tenant)) else { return Ok(()) };
    let spend = read.value.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
    spend.admits(caps, backing, micro, now_ms)
}

/// How `tenant`'s record stands at `now_ms`, as its gauges show it, from one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Micro-dollars spent (and reserved) today and this month.
    pub spent: (u64, u64),
    /// How many processes keep the spend, this one counted (1: this one alone).
    pub keepers: u32,
}

impl Standing {
    /// What this leaves of `tenant`'s budget, as its gauges show it (`None`: no such
    /// tenant).
    pub fn left(&self, config: &Config, tenant: &str) -> Option<Left> {
        let caps = config.tenants.get(tenant)?.caps();
        let left = |cap: Option<u64>, spent: u64| cap.map(|c| c.saturating_sub(spent));
        let (day, month) = self.spent;
        Some(Left { day: left(caps.per_day, day), month: left(caps.per_month, month), keepers: self.keepers })
    }
}

/// What is left of a tenant's budget: micro-dollars today and this month (`None`: no cap),
/// and how many processes keep its spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    pub day: Option<u64>,
    pub month: Option<u64>,
    pub keepers: u32,
}

/// `tenant`'s standing, read and decoded once.
pub fn standing(store: &impl CasStore, tenant: &str, now_ms: u64) -> Standing {
    let raw = store.get(&key(tenant)).ok().and_then(|r| r.value);
    raw.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms).standing(now_ms)
}

/// Micro-dollars spent (and reserved) today and this month.
pub fn spent(store: &impl CasStore, tenant: &str, now_ms: u64) -> (u64, u64) {
    standing(store, tenant, now_ms).spent
}

/// How many processes keep `tenant`'s spend now, this one counted (1: this one alone).
#[cfg(test)]
pub(crate) fn keepers(store: &impl CasStore, tenant: &str, now_ms: u64) -> u32 {
    standing(store, tenant, now_ms).keepers
}

/// What `tenant`'s record charges today beyond what the spend store holds of it: beyond
/// what the store held when this node last read it, less the writes out (or unsure) that
/// `landed` says the store already holds (by their tag). What a crash of the node loses:
/// its reservations and its spend not yet written.
#[cfg(test)]
pub(crate) fn unwritten(store: &impl CasStore, tenant: &str, now_ms: u64, landed: impl Fn(u64) -> bool) -> u64 {
    let raw = store.get(&key(tenant)).ok().and_then(|r| r.value);
    let s = raw.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
    let writes = s.pending.iter().chain(s.unsure.iter().map(|u| &u.write));
    let in_store: u64 = writes.filter(|w| w.day == s.day && landed(w.tag)).map(|w| w.sent.0).sum();
    s.day_micro.saturating_sub(s.stored.within(s.day, s.month).0).saturating_sub(in_store)
}

/// The UTC day (days since 1970-01-01) and month (months since January 1970) of `now_ms`.
fn periods(now_ms: u64) -> (u64, u64) {
    let day = now_ms / DAY_MS;
    let (year, month) = civil(day);
    (day, year * 12 + month - 1)
}

fn next_day_ms(now_ms: u64) -> u64 {
    (now_ms / DAY_MS + 1) * DAY_MS
}

/// The first millisecond of the next UTC month.
fn next_month_ms(now_ms: u64) -> u64 {
    let mut day = now_ms / DAY_MS;
    let (_, month) = periods(now_ms);
    while periods(day * DAY_MS).1 == month {
        day += 1;
    }
    day * DAY_MS
}

/// The (year, month 1-12) of a day since 1970-01-01 (the civil calendar's proleptic
/// Gregorian rules, as in Howard Hinnant's `civil_from_days`).
fn civil(days: u64) -> (u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::MemStore;

    #[test]
    fn a_stored_record_is_written_as_the_spend_store_already_holds_it() {
        // As the previous release's serde-derived writer put records in etcd.
        let full =
            Stored { day: 1, day_micro: 2, month: 3, month_micro: 4, write: Some(5), writes: vec![(6, 7), (8, 9)] };
        let records = [
            (full, r#"{"day":1,"day_micro":2,"month":3,"month_micro":4,"write":5,"writes":[[6,7],[8,9]]}"#),
            (Stored::default(), r#"{"day":0,"day_micro":0,"month":0,"month_micro":0}"#),
        ];
        for (stored, text) in records {
            assert_eq!(stored.to_json(), text);
            assert_eq!(Stored::read(scan::read(text.as_bytes()).unwrap()), Some(stored));
        }
        for bad in [
            r#"{"day":1,"day_micro":2,"month":3}"#,
            r#"{"day":1,"day_micro":2,"month":3,"month_micro":4,"writes":[[6,7,8]]}"#,
            r#"{"day":1,"day_micro":2,"month":3,"month_micro":-4}"#,
        ] {
            assert_eq!(Stored::read(scan::read(bad.as_bytes()).unwrap()), None, "{bad}");
        }
    }

    /// 2026-12-01T00:00:00Z.
    const DEC_1: u64 = 1_796_083_200_000;

    #[test]
    fn the_calendar_is_utcs() {
        assert_eq!(civil(0), (1970, 1));
        assert_eq!(civil(DEC_1 / DAY_MS), (2026, 12));
        assert_eq!(civil(DEC_1 / DAY_MS - 1), (2026, 11));
        assert_eq!(civil(11_016), (2000, 2), "2000-02-29 is a day of February");
        assert_eq!(civil(11_017), (2000, 3));
        assert_eq!(next_month_ms(DEC_1 + 5), DEC_1 + 31 * DAY_MS, "to 2027-01-01");
        assert_eq!(next_day_ms(DEC_1 + 5), DEC_1 + DAY_MS);
    }

    #[test]
    fn reservations_never_pass_the_cap_and_settle_to_what_was_spent() {
        let s = MemStore::new();
        let caps = Caps { per_day: Some(100), per_month: Some(100) };
        let far = DEC_1 + 10 * DAY_MS;
        reserve(&s, "t", (caps, Backing::MEMORY), (1, 60, far), DEC_1).unwrap();
        assert_eq!(
            reserve(&s, "t", (caps, Backing::MEMORY), (2, 60, far), DEC_1),
            Err(Refused::Held),
            "room once the first settles"
        );
        assert_eq!(
            check(&s, "t", (caps, Backing::MEMORY), 60, DEC_1),
            Err(Refused::Held),
            "as the check without reserving sees it"
        );
        assert_eq!(check(&s, "t", (caps, Backing::MEMORY), 40, DEC_1), Ok(()));
        settle(&s, "t", caps, 1, 10, DEC_1 + 1);
        assert_eq!(spent(&s, "t", DEC_1 + 1), (10, 10), "the reservation is replaced by the cost");
        settle(&s, "t", caps, 1, 0, DEC_1 + 1);
        assert_eq!(spent(&s, "t", DEC_1 + 1), (10, 10), "a settlement repeated takes nothing out");
        settle(&s, "t", caps, 2, 0, DEC_1 + 1);
        assert_eq!(spent(&s, "t", DEC_1 + 1), (10, 10), "nor one for a reservation that was refused");
        reserve(&s, "t", (caps, Backing::MEMORY), (3, 60, far), DEC_1 + 2).unwrap();
        assert_eq!(spent(&s, "t", DEC_1 + 2), (70, 70));
        // With 10 settled and 60 held, a call of 91 could never fit: exhausted, not held.
        let Err(Refused::Exhausted(refused)) = reserve(&s, "t", (caps, Backing::MEMORY), (9, 91, far), DEC_1 + 2)
        else {
            panic!("refused")
        };
        assert_eq!((refused.period, refused.cap_micro, refused.retry_after_ms), ("day", 100, DAY_MS - 2));
        assert_eq!(
            reserve(&s, "t", (caps, Backing::MEMORY), (9, 90, far), DEC_1 + 2),
            Err(Refused::Held),
            "90 fits what is settled"
        );
        // The next day: a fresh day, the same month; the call reserved yesterday settles.
        let tomorrow = DEC_1 + DAY_MS;
        settle(&s, "t", caps, 3, 60, tomorrow);
        assert_eq!(spent(&s, "t", tomorrow), (60, 70), "charged to today, in the month once");
        let Err(Refused::Exhausted(month)) = reserve(&s, "t", (caps, Backing::MEMORY), (4, 35, far), tomorrow) else {
            panic!("refused")
        };
        assert_eq!((month.period, month.retry_after_ms), ("month", 30 * DAY_MS));
        assert!(
            reserve(&s, "t", (Caps::default(), Backing::MEMORY), (5, u64::MAX, far), DEC_1).is_ok(),
            "no caps, no record"
        );
    }

    #[test]
    fn a_call_asked_again_under_its_id_is_reserved_once() {
        let s = MemStore::new();
        let caps = Caps { per_day: Some(1_000), per_month: None };
        reserve(&s, "t", (caps, Backing::MEMORY), (1, 100, DEC_1 + 9_000), DEC_1).unwrap();
        reserve(&s, "t", (caps, Backing::MEMORY), (1, 100, DEC_1 + 9_000), DEC_1 + 1).unwrap();
        assert_eq!(spent(&s, "t", DEC_1 + 1), (100, 100), "one reservation, not two");
        settle(&s, "t", caps, 1, 40, DEC_1 + 2);
        assert_eq!(spent(&s, "t", DEC_1 + 2), (40, 40));
    }

    #[test]
    fn a_reservation_never_settled_stays_charged_and_leaves_the_list_at_its_deadline() {
        let s = MemStore::new();
        let caps = Caps { per_day: Some(1_000), per_month: None };
        reserve(&s, "t", (caps, Backing::MEMORY), (1, 100, DEC_1 + 50), DEC_1).unwrap();
        reserve(&s, "t", (caps, Backing::MEMORY), (2, 100, DEC_1 + 500), DEC_1 + 60).unwrap();
        let listed = |s: &MemStore| Spend::decode(&s.get(&key("t")).unwrap().value.unwrap()).unwrap().held.len();
        assert_eq!(listed(&s), 1, "the first is past its deadline: no longer listed, still charged");
        assert_eq!(spent(&s, "t", DEC_1 + 60), (200, 200));
        settle(&s, "t", caps, 1, 30, DEC_1 + 70);
        assert_eq!(spent(&s, "t", DEC_1 + 70), (130, 130), "settled late: its cost takes its worst case's place");
        settle(&s, "t", caps, 1, 30, DEC_1 + 71);
        assert_eq!(spent(&s, "t", DEC_1 + 71), (160, 160), "a second settlement of it is charged, never refunded");
        let open = Caps { per_day: Some(u64::MAX), per_month: None };
        for id in 10..10 + MAX_IN_FLIGHT as u64 + 5 {
            reserve(&s, "t", (open, Backing::MEMORY), (id, 1, DEC_1 + DAY_MS), DEC_1 + 80).unwrap();
        }
        assert_eq!(listed(&s), MAX_IN_FLIGHT, "bounded");
    }

    /// What the previous release's reader requires of a record to read it at all: four
    /// totals, every unmarked entry five numbers, and the store's section nine numbers, or
    /// fifteen with a write out.
    fn previous_release_reads(raw: &[u8]) -> bool {
        let numbers = |s: &str, sep: char| s.split(sep).map(str::parse::<u64>).collect::<Result<Vec<_>, _>>();
        let text = std::str::from_utf8(raw).unwrap();
        let mut sections = text.splitn(3, '|');
        let (totals, held, backed) = (sections.next().unwrap(), sections.next().unwrap(), sections.next());
        let unmarked = held.split(',').filter(|e| !e.is_empty() && !e.starts_with(['~', '^']));
        numbers(totals, ' ').is_ok_and(|t| t.len() == 4)
            && unmarked.into_iter().all(|e| numbers(e, ':').is_ok_and(|n| n.len() == 5))
            && backed.is_none_or(|b| numbers(b, ' ').is_ok_and(|n| n.len() == 9 || n.len() == 15))
    }

    /// The record written with `format!`, entry by entry: what the writer is held to.
    fn formatted(spend: &Spend) -> Vec<u8> {
        let this = spend;
        let entry = |e: &Entry| format!("{}:{}:{}:{}:{}", e.id, e.micro, e.day, e.month, e.until_ms);
        let listed: Vec<String> = this.held.entries().iter().map(entry).collect();
        let mut held = Vec::new();
        if listed.len() >= SUMS_FROM {
            // The sums first: how many, their bytes, the periods' sums, the earliest deadline.
            let (d, m) = this.held.sums();
            let earliest = this.held.entries().iter().map(|e| e.until_ms).min().unwrap_or(u64::MAX);
            let bytes = listed.join(",").len();
            held.push(format!("~s{}:{bytes}:{}:{d}:{}:{m}:{earliest}", listed.len(), this.day, this.month));
        }
        held.extend(listed);
        held.extend(this.lapsed.iter().map(|e| format!("~{}", entry(e))));
        held.extend(this.paid.iter().map(|e| format!("^{}", entry(e))));
        let (mark, number) = match this.mark {
            Mark::Unread => (0, 0),
            Mark::Read { revision } => (1, revision),
            Mark::Unreachable { until_ms } => (2, until_ms),
        };
        let s = &this.stored;
        let pending = this.pending.map_or(String::new(), |p| {
            format!(" {} {} {} {} {} {}", p.tag, p.sent.0, p.sent.1, p.day, p.month, p.until_ms)
        });
        held.extend(s.writes.iter().map(|(w, t)| format!("{WRITES_MARK}{w}:{t}")));
        held.extend(this.unsure.iter().map(|u| {
            let w = u.write;
            format!("{UNSURE_MARK}{}:{}:{}:{}:{}:{}", w.tag, w.sent.0, w.sent.1, w.day, w.month, u.base)
        }));
        held.extend(this.keepers.seen.iter().map(|s| {
            let mark = if s.writing { KEEPERS_MARK } else { NAMED_MARK };
            format!("{mark}{}:{}", s.writer, s.until_ms)
        }));
        for (mark, ms) in [(ADMITTED_MARK, this.keepers.admitted_ms), (WROTE_MARK, this.keepers.wrote_ms)] {
            if ms > 0 {
                held.push(format!("{mark}{ms}"));
            }
        }
        format!(
            "{} {} {} {}|{}|{mark} {number} {} {} {} {} {} {} {}{pending}",
            this.day,
            this.day_micro,
            this.month,
            this.month_micro,
            held.join(","),
            s.day,
            s.day_micro,
            s.month,
            s.month_micro,
            this.unsent.0,
            this.unsent.1,
            this.learned_ms
        )
        .into_bytes()
    }

    /// A record with every kind of entry and a write out.
    fn rich_spend() -> Spend {
        let (day, month) = periods(DEC_1);
        let entry = |id| Entry { id, micro: 10, day, month, until_ms: DEC_1 + 1 };
        Spend {
            day,
            day_micro: 90,
            month,
            month_micro: 100,
            held: Held::of(&[entry(1), entry(4), entry(5)], day, month),
            lapsed: vec![entry(2)],
            paid: vec![entry(3)],
            mark: Mark::Read { revision: 7 },
            stored: Stored {
                day,
                day_micro: 40,
                month,
                month_micro: 50,
                write: None,
                writes: vec![(11, 12), (13, 14)],
            },
            unsent: (20, 20),
            learned_ms: DEC_1,
            pending: Some(Pending { tag: 12, sent: (5, 5), day, month, until_ms: DEC_1 + 9 }),
            unsure: vec![Unsure { write: Pending { tag: 10, sent: (3, 3), day, month, until_ms: 0 }, base: 6 }],
            keepers: Keepers {
                seen: vec![
                    Seen { writer: 11, until_ms: DEC_1 + KEEPERS_MS, writing: true },
                    Seen { writer: 13, until_ms: DEC_1 + 9, writing: false },
                ],
                admitted_ms: DEC_1,
                wrote_ms: DEC_1 + 1,
            },
        }
    }

    #[test]
    fn the_previous_release_reads_this_ones_records_so_a_rollback_keeps_the_spend() {
        let spend = rich_spend();
        let raw = spend.encode();
        assert_eq!(raw, formatted(&spend), "as the previous release formats it");
        assert!(previous_release_reads(&raw), "{}", String::from_utf8_lossy(&raw));
        assert_eq!(Spend::decode(&raw), Some(spend.clone()), "and this release reads it whole");
        let idle = Spend { pending: None, ..spend };
        assert!(previous_release_reads(&idle.encode()));
        assert_eq!(idle.encode(), formatted(&idle));
        assert_eq!(Spend::default().encode(), formatted(&Spend::default()));
    }

    /// The reader before this one (`str::parse`, a Vec per kind of entry), which every
    /// record below must read the same.
    fn decoded_before(raw: &[u8]) -> Option<Spend> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut sections = text.splitn(3, '|');
        let (totals, held, backed) = (sections.next()?, sections.next().unwrap_or(""), sections.next());
        let mut n = totals.split(' ').map(|f| f.parse::<u64>().ok());
        let (day, day_micro, month, month_micro) = (n.next()??, n.next()??, n.next()??, n.next()??);
        if n.next().is_some() {
            return None;
        }
        let entries = held.split(',').filter(|e| !e.is_empty());
        let (marked, held): (Vec<&str>, Vec<&str>) = entries.partition(|e| e.starts_with(['~', '^']));
        // The store's writers, `~w<writer>:<tag>`: marked, so a release that does not know
        // them reads past them (an entry it cannot read is dropped, never the record).
        let writes: Vec<(u64, u64)> = marked
            .iter()
            .filter_map(|e| {
                let (writer, tag) = e.strip_prefix(WRITES_MARK)?.split_once(':')?;
                Some((writer.parse().ok()?, tag.parse().ok()?))
            })
            .collect();
        // Unsure writes, `~u<tag>:<day sent>:<month sent>:<day>:<month>:<base>`, the same way.
        let unsure: Vec<Unsure> = marked
            .iter()
            .filter_map(|e| {
                let mut f = e.strip_prefix(UNSURE_MARK)?.split(':').map(|n| n.parse::<u64>().ok());
                let (tag, d, m, day, month, base) =
                    (f.next()??, f.next()??, f.next()??, f.next()??, f.next()??, f.next()??);
                let write = Pending { tag, sent: (d, m), day, month, until_ms: 0 };
                f.next().is_none().then_some(Unsure { write, base })
            })
            .collect();
        // The keepers, `~k<writer>:<until>`, `~q<writer>:<until>` and `~a<when>`, the same way.
        let seen = marked
            .iter()
            .filter_map(|e| {
                let (writing, rest) = match e.strip_prefix(KEEPERS_MARK) {
                    Some(rest) => (true, rest),
                    None => (false, e.strip_prefix(NAMED_MARK)?),
                };
                let (writer, until_ms) = rest.split_once(':')?;
                Some(Seen { writer: writer.parse().ok()?, until_ms: until_ms.parse().ok()?, writing })
            })
            .collect();
        let time = |mark: &str| marked.iter().find_map(|e| e.strip_prefix(mark)?.parse().ok()).unwrap_or(0);
        let keepers = Keepers { seen, admitted_ms: time(ADMITTED_MARK), wrote_ms: time(WROTE_MARK) };
        let held = held.into_iter().map(entry_before).collect::<Option<Vec<_>>>()?;
        // A lapsed entry only lowers a late settlement: one that cannot be read is dropped
        // (its worst case stays charged), never the record.
        let lapsed_of = |mark: char| marked.iter().filter_map(move |e| entry_before(e.strip_prefix(mark)?));
        let (lapsed, paid): (Vec<Entry>, Vec<Entry>) = (lapsed_of('~').collect(), lapsed_of('^').collect());
        let held = Held::of(&held, day, month);
        let mut spend = Spend { day, day_micro, month, month_micro, held, ..Spend::default() };
        let Some(backed) = backed else {
            // A record of a release without the store: what it charged beyond its
            // reservations was settled, and is the store's to be told.
            let (held_d, held_m) = spend.held.sums();
            spend.unsent = (day_micro.saturating_sub(held_d), month_micro.saturating_sub(held_m));
            (spend.lapsed, spend.paid) = (lapsed, paid);
            return Some(spend);
        };
        (spend.lapsed, spend.paid, spend.unsure, spend.keepers) = (lapsed, paid, unsure, keepers);
        {
            let f: Vec<u64> = backed.split(' ').map(str::parse).collect::<Result<_, _>>().ok()?;
            let (f, pending) = match f[..] {
                [.., tag, pd, pm, day, month, until_ms] if f.len() == 15 => {
                    (&f[..9], Some(Pending { tag, sent: (pd, pm), day, month, until_ms }))
                }
                _ => (&f[..], None),
            };
            spend.pending = pending;
            let [mark, number, sd, sdm, sm, smm, ud, um, learned_ms] = f[..] else { return None };
            spend.learned_ms = learned_ms;
            spend.mark = match mark {
                0 => Mark::Unread,
                1 => Mark::Read { revision: number },
                2 => Mark::Unreachable { until_ms: number },
                _ => return None,
            };
            spend.stored = Stored { day: sd, day_micro: sdm, month: sm, month_micro: smm, write: None, writes };
            spend.unsent = (ud, um);
        }
        Some(spend)
    }
    fn entry_before(e: &str) -> Option<Entry> {
        let mut f = e.split(':').map(|f| f.parse::<u64>().ok());
        let entry =
            Entry { id: f.next()??, micro: f.next()??, day: f.next()??, month: f.next()??, until_ms: f.next()?? };
        f.next().is_none().then_some(entry)
    }

    #[test]
    fn the_record_reads_as_the_reader_before_read_it() {
        let (day, month) = periods(DEC_1);
        let spend = rich_spend();
        let mut records: Vec<Vec<u8>> = vec![
            spend.encode(),
            Spend { pending: None, ..spend.clone() }.encode(),
            Spend { mark: Mark::Unreachable { until_ms: DEC_1 }, ..spend.clone() }.encode(),
            Spend::default().encode(),
            format!("{day} 2 {month} 4").into_bytes(),
            format!("{day} 2 {month} 4|1:1:{day}:{month}:9,~2:1:{day}:{month}:9,^3:1:{day}:{month}:9").into_bytes(),
        ];
        // Garbled records as the writer before the sums wrote them, each entry read.
        let with_sums = String::from_utf8(spend.encode()).unwrap();
        let sums = with_sums.split(['|', ',']).nth(1).unwrap();
        assert!(sums.starts_with(SUMS_MARK));
        let text = with_sums.replacen(&format!("{sums},"), "", 1);
        records.push(text.clone().into_bytes());
        for (from, to) in [
            ("~w11:12", "~w11:x"),
            ("~w11:12", "~z11:12"),
            ("~k11:", "~k:"),
            ("~u10:3", "~u10"),
            ("~a", "~a~"),
            ("~t", "~aa"),
            ("^3:", "^x:"),
            ("~2:", "~2:2:"),
            ("|1 7 ", "|3 7 "),
            ("|1 7 ", "|1 7 1 "),
            ("1:10:", "1:1x:"),
            (" 12 5 5 ", " 12 5 "),
        ] {
            assert!(text.contains(from), "{from}");
            records.push(text.replacen(from, to, 1).into_bytes());
        }
        records.extend([&b""[..], b"|", b"1 2 3", b"1 2 3 4 5", b"1 2 3 4|,,|", b"not a spend"].map(<[u8]>::to_vec));
        for raw in records {
            assert_eq!(Spend::decode(&raw), decoded_before(&raw), "{}", String::from_utf8_lossy(&raw));
        }
    }

    #[test]
    fn listed_entries_are_read_only_once_one_may_have_lapsed() {
        let s = MemStore::new();
        let caps = Caps { per_day: Some(1_000), per_month: None };
        for id in 1..=3 {
            reserve(&s, "t", (caps, Backing::MEMORY), (id, 100, DEC_1 + 100 * id), DEC_1).unwrap();
        }
        // A listed entry garbled behind the sums is not read while no deadline has passed:
        // the sums admit, and the record is kept.
        let raw = String::from_utf8(s.get(&key("t")).unwrap().value.unwrap()).unwrap();
        let garbled = raw.replacen(",2:100:", ",2:1x0:", 1);
        assert_ne!(garbled, raw);
        s.set(&key("t"), garbled.as_bytes(), None).unwrap();
        assert_eq!(spent(&s, "t", DEC_1 + 1), (300, 300));
        assert_eq!(reserve(&s, "t", (caps, Backing::MEMORY), (4, 800, DEC_1 + 900), DEC_1 + 1), Err(Refused::Held));
        // Once one may have lapsed the entries are read: the garbled one is no longer
        // listed and stays charged, as a reservation past its deadline does.
        settle(&s, "t", caps, 1, 50, DEC_1 + 150);
        assert_eq!(spent(&s, "t", DEC_1 + 150), (250, 250));
        settle(&s, "t", caps, 2, 10, DEC_1 + 151);
        assert_eq!(
            spent(&s, "t", DEC_1 + 151),
            (260, 260),
            "its settlement finds no reservation of it: its cost is charged beside its worst case"
        );
        let listed = Spend::decode(&s.get(&key("t")).unwrap().value.unwrap()).unwrap().held;
        assert_eq!(listed.entries().iter().map(|e| e.id).collect::<Vec<_>>(), [3]);
        assert_eq!(reserve(&s, "t", (caps, Backing::MEMORY), (4, 800, DEC_1 + 900), DEC_1 + 152), Err(Refused::Held));
        settle(&s, "t", caps, 3, 0, DEC_1 + 153);
        reserve(&s, "t", (caps, Backing::MEMORY), (4, 800, DEC_1 + 900), DEC_1 + 154).unwrap();
        assert_eq!(spent(&s, "t", DEC_1 + 154), (960, 960));
    }

    /// Process memory alone, and a spend store read at revision 7 holding nothing yet.
    fn backings() -> [(Backing, MemStore); 2] {
        let stored = MemStore::new();
        let (day, month) = periods(DEC_1);
        let record = format!("{day} 0 {month} 0||1 7 {day} 0 {month} 0 0 0 {DEC_1}");
        stored.set(&key("t"), record.as_bytes(), None).unwrap();
        let store = Backing { store: true, ..Backing::MEMORY };
        [(Backing::MEMORY, MemStore::new()), (store, stored)]
    }

    /// The record of "t" with `from` in its text written as `to`.
    fn garble(s: &MemStore, from: &str, to: &str) {
        let raw = String::from_utf8(s.get(&key("t")).unwrap().value.unwrap()).unwrap();
        assert!(raw.contains(SUMS_MARK) && raw.contains(from), "{raw}");
        s.set(&key("t"), raw.replacen(from, to, 1).as_bytes(), None).unwrap();
    }

    #[test]
    fn a_garbled_entry_stays_charged_when_settlements_leave_too_few_for_sums() {
        let caps = Caps { per_day: Some(10_000), per_month: None };
        for (backing, s) in backings() {
            for id in 1..=3 {
                reserve(&s, "t", (caps, backing), (id, 100 * id, DEC_1 + DAY_MS / 2), DEC_1).unwrap();
            }
            garble(&s, ",2:200:", ",2:2x0:");
            // No deadline passes: the entries are read only once too few are left for sums.
            settle(&s, "t", caps, 1, 50, DEC_1 + 1);
            assert_eq!(spent(&s, "t", DEC_1 + 1), (550, 550), "{backing:?}");
            settle(&s, "t", caps, 3, 0, DEC_1 + 2);
            assert_eq!(spent(&s, "t", DEC_1 + 2), (250, 250), "its worst case stays charged: {backing:?}");
            // Its settlement finds no entry it can read: its cost is charged beside the worst
            // case (a lapsed reservation's cost would replace it; this one's is not known).
            settle(&s, "t", caps, 2, 20, DEC_1 + 3);
            assert_eq!(spent(&s, "t", DEC_1 + 3), (270, 270), "{backing:?}");
            let spend = Spend::decode(&s.get(&key("t")).unwrap().value.unwrap()).unwrap();
            assert!(spend.held.is_empty());
            if backing.store {
                assert_eq!(spend.unsent, (270, 270), "for the store to be told");
            }
        }
    }

    #[test]
    fn a_new_day_keeps_a_garbled_entrys_worst_case_in_the_month() {
        let caps = Caps { per_day: Some(10_000), per_month: None };
        for (backing, s) in backings() {
            for id in 1..=3 {
                reserve(&s, "t", (caps, backing), (id, 100, DEC_1 + 2 * DAY_MS), DEC_1).unwrap();
            }
            garble(&s, ",2:100:", ",2:1x0:");
            let tomorrow = DEC_1 + DAY_MS;
            assert_eq!(spent(&s, "t", tomorrow), (0, 300), "{backing:?}");
            settle(&s, "t", caps, 1, 0, tomorrow);
            settle(&s, "t", caps, 3, 0, tomorrow + 1);
            assert_eq!(spent(&s, "t", tomorrow + 1), (0, 100), "{backing:?}");
        }
    }

    #[test]
    fn the_oldest_reservation_pushed_off_the_list_stays_charged_until_it_settles() {
        let caps = Caps { per_day: Some(u64::MAX), per_month: None };
        for (backing, s) in backings() {
            let calls = MAX_IN_FLIGHT as u64 + 1;
            for id in 1..=calls {
                reserve(&s, "t", (caps, backing), (id, 10, DEC_1 + DAY_MS / 2), DEC_1 + id).unwrap();
            }
            let spend = Spend::decode(&s.get(&key("t")).unwrap().value.unwrap()).unwrap();
            assert_eq!((spend.held.len(), spend.held.sums(), spend.lapsed.len()), (MAX_IN_FLIGHT, (2_560, 2_560), 1));
            assert_eq!(spent(&s, "t", DEC_1 + calls), (2_570, 2_570), "{backing:?}");
            for id in 1..=calls {
                settle(&s, "t", caps, id, 1, DEC_1 + calls + id);
            }
            assert_eq!(spent(&s, "t", DEC_1 + 2 * calls), (257, 257), "{backing:?}");
        }
    }

    #[test]
    fn a_garbled_record_reads_as_nothing_spent() {
        let s = MemStore::new();
        s.set(&key("t"), b"not a spend", None).unwrap();
        assert_eq!(spent(&s, "t", DEC_1), (0, 0));
        assert!(reserve(
            &s,
            "t",
            (Caps { per_day: Some(5), per_month: None }, Backing::MEMORY),
            (1, 5, DEC_1 + 1),
            DEC_1
        )
        .is_ok());
        let (day, month) = periods(DEC_1);
        s.set(&key("t"), format!("{day} 2 {month} 4").as_bytes(), None).unwrap();
        assert_eq!(spent(&s, "t", DEC_1), (2, 4), "a record of the previous release reads as it was");
    }
}
