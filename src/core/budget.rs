//! A tenant's dollar budgets, per UTC day and per UTC month, in one shared-data record per
//! tenant (`holysheep/budget/<tenant>`: a bounded set of keys, kept across reloads). A call
//! reserves its worst case before it leaves and settles with what it cost, so concurrent
//! calls can never spend more than the budget. Amounts are micro-dollars.

use super::store::{cas_after, CasStore, StoreError};

const DAY_MS: u64 = 86_400_000;
/// Attempts at a compare-and-swap before a reservation is refused as contended.
const MAX_RACES: usize = 16;

/// A tenant's caps, in micro-dollars (`None`: no cap for that period).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caps {
    pub per_day: Option<u64>,
    pub per_month: Option<u64>,
}

impl Caps {
    pub fn is_none(&self) -> bool {
        self.per_day.is_none() && self.per_month.is_none()
    }
}

/// What a call reserved, and in which periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hold {
    pub micro: u64,
    day: u64,
    month: u64,
    /// Whether the reservation is in the record (not when the store failed, or there are
    /// no caps): only then does settling take it out again.
    written: bool,
}

/// Why a reservation was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Exhausted(Exhausted),
    /// Every compare-and-swap lost a race: look again shortly.
    Contended,
}

/// Why a reservation was refused: the budget it would exceed and when that period ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    pub period: &'static str,
    pub cap_micro: u64,
    pub retry_after_ms: u64,
}

/// Spend in the current day and month: reserved (in flight) plus settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Spend {
    day: u64,
    day_micro: u64,
    month: u64,
    month_micro: u64,
}

impl Spend {
    fn decode(raw: &[u8]) -> Option<Spend> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut n = text.split(' ').map(|f| f.parse::<u64>().ok());
        let spend = Spend { day: n.next()??, day_micro: n.next()??, month: n.next()??, month_micro: n.next()?? };
        n.next().is_none().then_some(spend)
    }

    fn encode(&self) -> Vec<u8> {
        format!("{} {} {} {}", self.day, self.day_micro, self.month, self.month_micro).into_bytes()
    }

    /// The spend as of `now_ms`: a new day or month starts from nothing.
    fn at(mut self, now_ms: u64) -> Spend {
        let (day, month) = periods(now_ms);
        if self.day != day {
            (self.day, self.day_micro) = (day, 0);
        }
        if self.month != month {
            (self.month, self.month_micro) = (month, 0);
        }
        self
    }
}

pub fn key(tenant: &str) -> String {
    format!("holysheep/budget/{tenant}")
}

/// Reserves `micro` for a call of `tenant` at `now_ms`, if both periods have room.
pub fn reserve(store: &impl CasStore, tenant: &str, caps: Caps, micro: u64, now_ms: u64) -> Result<Hold, Refused> {
    let (day, month) = periods(now_ms);
    let hold = Hold { micro, day, month, written: false };
    if caps.is_none() {
        return Ok(hold);
    }
    let key = key(tenant);
    for _ in 0..MAX_RACES {
        let Ok(read) = store.get(&key) else { return Ok(hold) };
        let spend = read.value.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
        if let Some(cap) = caps.per_day.filter(|c| spend.day_micro.saturating_add(micro) > *c) {
            let retry_after_ms = next_day_ms(now_ms) - now_ms;
            return Err(Refused::Exhausted(Exhausted { period: "day", cap_micro: cap, retry_after_ms }));
        }
        if let Some(cap) = caps.per_month.filter(|c| spend.month_micro.saturating_add(micro) > *c) {
            let retry_after_ms = next_month_ms(now_ms) - now_ms;
            return Err(Refused::Exhausted(Exhausted { period: "month", cap_micro: cap, retry_after_ms }));
        }
        let (day_micro, month_micro) = (spend.day_micro.saturating_add(micro), spend.month_micro.saturating_add(micro));
        let taken = Spend { day_micro, month_micro, ..spend }.encode();
        match store.set(&key, &taken, cas_after(&read)) {
            Ok(()) => return Ok(Hold { written: true, ..hold }),
            Err(StoreError::CasMismatch) => continue,
            // A broken store admits: the edge must not go down with it.
            Err(StoreError::Host(_)) => return Ok(hold),
        }
    }
    Err(Refused::Contended)
}

/// The call ended having cost `actual` micro-dollars: its reservation is replaced by that,
/// in the periods it was taken in (a period that ended since is not touched; a new one
/// is charged what the call cost).
pub fn settle(store: &impl CasStore, tenant: &str, caps: Caps, hold: &Hold, actual: u64, now_ms: u64) {
    if caps.is_none() {
        return;
    }
    let key = key(tenant);
    for _ in 0..MAX_RACES {
        let Ok(read) = store.get(&key) else { return };
        let mut s = read.value.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
        let held = |period: u64, current: u64| if hold.written && period == current { hold.micro } else { 0 };
        s.day_micro = s.day_micro.saturating_sub(held(hold.day, s.day)).saturating_add(actual);
        s.month_micro = s.month_micro.saturating_sub(held(hold.month, s.month)).saturating_add(actual);
        match store.set(&key, &s.encode(), cas_after(&read)) {
            Err(StoreError::CasMismatch) => continue,
            _ => return,
        }
    }
}

/// Micro-dollars spent (and reserved) today and this month.
pub fn spent(store: &impl CasStore, tenant: &str, now_ms: u64) -> (u64, u64) {
    let raw = store.get(&key(tenant)).ok().and_then(|r| r.value);
    let s = raw.as_deref().and_then(Spend::decode).unwrap_or_default().at(now_ms);
    (s.day_micro, s.month_micro)
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
        let a = reserve(&s, "t", caps, 60, DEC_1).unwrap();
        let Err(Refused::Exhausted(refused)) = reserve(&s, "t", caps, 60, DEC_1) else { panic!("refused") };
        assert_eq!((refused.period, refused.cap_micro, refused.retry_after_ms), ("day", 100, DAY_MS));
        settle(&s, "t", caps, &a, 10, DEC_1 + 1);
        assert_eq!(spent(&s, "t", DEC_1 + 1), (10, 10), "the reservation is replaced by the cost");
        let b = reserve(&s, "t", caps, 60, DEC_1 + 2).unwrap();
        assert_eq!(spent(&s, "t", DEC_1 + 2), (70, 70));
        // The next day: a fresh day, the same month; the call reserved yesterday settles.
        let tomorrow = DEC_1 + DAY_MS;
        settle(&s, "t", caps, &b, 60, tomorrow);
        assert_eq!(spent(&s, "t", tomorrow), (60, 70), "charged to today, in the month once");
        let Err(Refused::Exhausted(month)) = reserve(&s, "t", caps, 35, tomorrow) else { panic!("refused") };
        assert_eq!((month.period, month.retry_after_ms), ("month", 30 * DAY_MS));
        assert!(reserve(&s, "t", Caps::default(), u64::MAX, DEC_1).is_ok(), "no caps, no record");
    }

    #[test]
    fn a_garbled_record_reads_as_nothing_spent() {
        let s = MemStore::new();
        s.set(&key("t"), b"not a spend", None).unwrap();
        assert_eq!(spent(&s, "t", DEC_1), (0, 0));
        assert!(reserve(&s, "t", Caps { per_day: Some(5), per_month: None }, 5, DEC_1).is_ok());
    }
}
