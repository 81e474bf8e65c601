//! The reservations a spend record lists in flight, kept as the record's text: a
//! reservation adds its entry and a settlement takes its own out, and neither reads nor
//! writes the others (under load a tenant has many calls in flight, and every one of them
//! reads and writes the record twice). Beside the entries the record keeps what admission
//! needs of them: how many, their sums in the current day and month, and a time no
//! deadline comes before.

use super::record::{numbers, Entries, Record};
use super::MAX_IN_FLIGHT;
use crate::core::wire::{bytes, codec};

/// A reservation in flight: the call's id, its amount and periods, and its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) micro: u64,
    pub(super) day: u64,
    pub(super) month: u64,
    pub(super) until_ms: u64,
}

impl Entry {
    /// `id:micro:day:month:until`.
    pub(super) fn decode(e: &[u8]) -> Option<Entry> {
        let [id, micro, day, month, until_ms] = numbers(e, b':')?;
        Some(Entry { id, micro, day, month, until_ms })
    }

    fn numbers(&self) -> [u64; 5] {
        [self.id, self.micro, self.day, self.month, self.until_ms]
    }
}

/// What marks the sums among a record's entries:
/// `~s<count>:<bytes>:<day>:<day's sum>:<month>:<month's sum>:<no deadline before>`, the
/// entries' `bytes` following it. A release that does not know it reads past it (a marked
/// entry it cannot read is dropped) and reads the entries one by one.
pub(super) const SUMS_MARK: &str = "~s";

/// From how many entries a record carries their sums.
pub(super) const SUMS_FROM: usize = 3;

/// What taking an entry out gave: the entry (`None`: not listed, or listed and unreadable),
/// and what entries that could not be read made in the day and the month, known once the
/// list was read (their amounts left the sums: the spend charges them as settled at their
/// worst case, for good: unlike a lapsed reservation's, no settlement replaces it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Taken {
    pub(super) entry: Option<Entry>,
    pub(super) unread: (u64, u64),
}

/// The reservations listed, oldest first, as the record's text holds them.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// The entries, `id:micro:day:month:until` each, `,` between them.
    text: Vec<u8>,
    count: usize,
    /// The day and month the sums are of (the record's), and the sums: what the entries
    /// made in that day, and in that month.
    day: u64,
    day_micro: u64,
    month: u64,
    month_micro: u64,
    /// No entry's deadline comes before it (the earliest's, or earlier once that one was
    /// taken out): until then none has lapsed, and the entries need not be read.
    earliest_ms: u64,
    /// The sums were read from the record, the entries not: an entry may not be readable.
    unchecked: bool,
}

/// The same entries and sums, however they were learned.
impl PartialEq for Held {
    fn eq(&self, other: &Held) -> bool {
        let sums = |h: &Held| (h.count, h.day, h.day_micro, h.month, h.month_micro, h.earliest_ms);
        self.text == other.text && sums(self) == sums(other)
    }
}

impl Eq for Held {}

impl Default for Held {
    fn default() -> Held {
        Held::new(0, 0)
    }
}

impl Held {
    /// None, for the record of `day` and `month`.
    pub(super) fn new(day: u64, month: u64) -> Held {
        Held {
            text: Vec::new(),
            count: 0,
            day,
            day_micro: 0,
            month,
            month_micro: 0,
            earliest_ms: u64::MAX,
            unchecked: false,
        }
    }

    /// `entries`, for the record of `day` and `month`.
    #[inline(never)]
    pub(super) fn of(entries: &[Entry], day: u64, month: u64) -> Held {
        let mut held = Held::new(day, month);
        for e in entries {
            held.push(*e);
        }
        held
    }

    /// As a record's sums entry says (`sums`: after its mark), its entries' text at the
    /// front of `rest` (the record after the sums entry). The held list and what follows
    /// its entries (from the next entry, or the `|` that ends them); `None` when the sums
    /// do not fit the text or the record's periods (the entries are then read one by one).
    pub(super) fn read<'a>(sums: &[u8], rest: &'a [u8], (day, month): (u64, u64)) -> Option<(Held, &'a [u8])> {
        let [count, bytes, d, day_micro, m, month_micro, earliest_ms] = numbers(sums, b':')?;
        let (count, bytes) = (usize::try_from(count).ok()?, usize::try_from(bytes).ok()?);
        // No more than a record lists: a count past it is not one this edge wrote.
        if count > MAX_IN_FLIGHT {
            return None;
        }
        let text = rest.get(..bytes)?;
        let after = match rest.get(bytes..)? {
            [b',', after @ ..] => after,
            // The end of the entries (`|`: the store's section follows).
            after @ ([] | [b'|', ..]) => after,
            _ => return None,
        };
        if count < SUMS_FROM || (d, m) != (day, month) {
            return None;
        }
        let held =
            Held { text: text.to_vec(), count, day, day_micro, month, month_micro, earliest_ms, unchecked: true };
        Some((held, after))
    }

    /// Writes the sums entry and the entries; the entries alone while they are fewer than
    /// `SUMS_FROM` (reading a few costs less than the sums).
    pub(super) fn write(&self, list: &mut Entries<'_>) {
        if self.count < SUMS_FROM {
            list.text(&self.text);
            return;
        }
        let sums = [
            self.count as u64,
            self.text.len() as u64,
            self.day,
            self.day_micro,
            self.month,
            self.month_micro,
            self.earliest_ms,
        ];
        list.entry(SUMS_MARK, &sums);
        list.text(&self.text);
    }

    pub(super) fn len(&self) -> usize {
        self.count
    }

    pub(super) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// What the entries made in the record's day and month.
    pub(super) fn sums(&self) -> (u64, u64) {
        (self.day_micro, self.month_micro)
    }

    /// Every entry that can be read.
    pub(super) fn entries(&self) -> Vec<Entry> {
        let (mut entries, mut start) = (Vec::with_capacity(self.count.min(MAX_IN_FLIGHT)), 0);
        while start < self.text.len() {
            let end = self.end_of(start);
            entries.extend(self.text.get(start..end).and_then(Entry::decode));
            start = end + 1;
        }
        entries
    }

    /// `e` listed last.
    pub(super) fn push(&mut self, e: Entry) {
        let mut text = Record::with_capacity(64);
        text.numbers(b':', &e.numbers());
        self.push_read(e, &text.0);
    }

    /// `e`, read from `text`, listed last as it was read.
    pub(super) fn push_read(&mut self, e: Entry, text: &[u8]) {
        if !self.text.is_empty() {
            self.text.push(b',');
        }
        self.text.extend_from_slice(text);
        self.count += 1;
        self.add(e, true);
        self.earliest_ms = self.earliest_ms.min(e.until_ms);
    }

    /// Takes out call `id`'s entry, if it is listed.
    pub(super) fn take(&mut self, id: u64) -> Taken {
        let id = codec::decimal(id);
        let id = id.as_bytes();
        let (mut start, text) = (0, &self.text[..]);
        while start < text.len() {
            let end = self.end_of(start);
            let listed = text.get(start..start + id.len()).is_some_and(|head| bytes::same(head, id));
            if listed && text.get(start + id.len()) == Some(&b':') {
                return self.cut(start, end);
            }
            start = end + 1;
        }
        Taken::default()
    }

    /// Where the entry that starts at `start` ends.
    fn end_of(&self, start: usize) -> usize {
        let rest = self.text.get(start..).unwrap_or_default();
        bytes::find(rest, b',').map_or(self.text.len(), |at| start + at)
    }

    /// Takes out the oldest entry (`None`: there is none, or it could not be read).
    pub(super) fn take_oldest(&mut self) -> Taken {
        if self.count == 0 {
            return Taken::default();
        }
        self.cut(0, self.end_of(0))
    }

    /// The entries' text length in bytes.
    pub(super) fn text_len(&self) -> usize {
        self.text.len()
    }

    /// Takes out the entries past their deadline at `now_ms` (read only once one may be),
    /// and those that cannot be read: the entries, and what the unreadable ones made in the
    /// day and the month (what the sums held beyond the entries read), to stay charged as
    /// the lapsed ones do.
    pub(super) fn lapse(&mut self, now_ms: u64) -> (Vec<Entry>, (u64, u64)) {
        if self.count == 0 || self.earliest_ms > now_ms {
            return (Vec::new(), (0, 0));
        }
        let (held, unread) = self.reread();
        let (lapsed, held): (Vec<Entry>, Vec<Entry>) = held.into_iter().partition(|e| e.until_ms <= now_ms);
        *self = Held::of(&held, self.day, self.month);
        (lapsed, unread)
    }

    /// The same entries, their sums taken in `day` and `month` (a new period); what the
    /// entries that could not be read made in the periods that did not change.
    pub(super) fn rebase(&mut self, day: u64, month: u64) -> (u64, u64) {
        if (day, month) == (self.day, self.month) {
            return (0, 0);
        }
        let (held, (d, m)) = self.reread();
        let unread = (if day == self.day { d } else { 0 }, if month == self.month { m } else { 0 });
        *self = Held::of(&held, day, month);
        unread
    }

    /// The entries read, those that cannot be read no longer listed; and what those made
    /// in the day and the month (what the sums held beyond the entries read).
    fn reread(&mut self) -> (Vec<Entry>, (u64, u64)) {
        let (before, held) = (self.sums(), self.entries());
        *self = Held::of(&held, self.day, self.month);
        let read = self.sums();
        (held, (before.0.saturating_sub(read.0), before.1.saturating_sub(read.1)))
    }

    /// Takes out the entry at `start..end` of the text. One that cannot be read goes all
    /// the same, so that the list stays bounded: the sums keep what it made until the
    /// entries are read (`lapse`). Fewer than `SUMS_FROM` left are written without their
    /// sums, so entries not read yet are read now.
    fn cut(&mut self, start: usize, end: usize) -> Taken {
        let entry = self.text.get(start..end).and_then(Entry::decode);
        // The entry and one comma beside it.
        let (from, to) = if end < self.text.len() { (start, end + 1) } else { (start.saturating_sub(1), end) };
        self.text.drain(from..to);
        self.count = self.count.saturating_sub(1);
        if let Some(e) = entry {
            self.add(e, false);
        }
        let mut unread = (0, 0);
        if self.unchecked && (self.count < SUMS_FROM || self.text.is_empty()) {
            unread = self.reread().1;
        } else if self.text.is_empty() {
            *self = Held::new(self.day, self.month);
        }
        Taken { entry, unread }
    }

    /// `e`'s amount added to (or taken from) the sums of the periods it was made in.
    fn add(&mut self, e: Entry, more: bool) {
        let change = |sum: u64| if more { sum.saturating_add(e.micro) } else { sum.saturating_sub(e.micro) };
        if e.day == self.day {
            self.day_micro = change(self.day_micro);
        }
        if e.month == self.month {
            self.month_micro = change(self.month_micro);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 20_788;
    const MONTH: u64 = 24_323;

    fn entry(id: u64, micro: u64, until_ms: u64) -> Entry {
        Entry { id, micro, day: DAY, month: MONTH, until_ms }
    }

    /// The held list as a record writes it and reads it back.
    fn round_trip(held: &Held) -> Held {
        let mut r = Record::with_capacity(64);
        held.write(&mut r.list());
        if held.len() < SUMS_FROM {
            let entries: Vec<Entry> = r.0.split(|&b| b == b',').filter_map(Entry::decode).collect();
            assert_eq!(entries.len(), held.len(), "the entries alone");
            return Held::of(&entries, DAY, MONTH);
        }
        let rest = r.0.strip_prefix(SUMS_MARK.as_bytes()).unwrap();
        let comma = rest.iter().position(|&b| b == b',').unwrap();
        let (read, after) = Held::read(&rest[..comma], &rest[comma + 1..], (DAY, MONTH)).unwrap();
        assert!(after.is_empty());
        read
    }

    #[test]
    fn the_sums_follow_every_entry_added_and_taken_out() {
        let mut held = Held::new(DAY, MONTH);
        for id in 1..=5 {
            held.push(entry(id * 1_000_000_007, id * 10, 900 + id));
        }
        // Another day's reservation (the record's day turned while it was out) counts in
        // the month alone.
        held.push(Entry { id: 6, micro: 1_000, day: DAY - 1, month: MONTH, until_ms: 2_000 });
        assert_eq!((held.len(), held.sums()), (6, (150, 1_150)));
        assert_eq!(held.take(3_000_000_021).entry, Some(entry(3_000_000_021, 30, 903)));
        assert_eq!(held.take(3_000_000_021).entry, None, "taken once");
        assert_eq!(held.take(300_000_002).entry, None, "an id that only begins another's is not it");
        assert_eq!(
            held.take(6).entry,
            Some(Entry { id: 6, micro: 1_000, day: DAY - 1, month: MONTH, until_ms: 2_000 })
        );
        assert_eq!(held.take_oldest().entry, Some(entry(1_000_000_007, 10, 901)));
        assert_eq!((held.len(), held.sums()), (3, (110, 110)));
        let ids: Vec<u64> = held.entries().iter().map(|e| e.id).collect();
        assert_eq!(ids, [2_000_000_014, 4_000_000_028, 5_000_000_035]);
        assert_eq!(round_trip(&held), held);
        let anew = Held::of(&held.entries(), DAY, MONTH);
        assert_eq!((&anew.text, anew.sums()), (&held.text, held.sums()), "as if pushed anew");
        for id in [5_000_000_035, 2_000_000_014, 4_000_000_028] {
            held.take(id).entry.unwrap();
        }
        assert_eq!(held, Held::new(DAY, MONTH));
        assert_eq!(round_trip(&held), held);
    }

    #[test]
    fn entries_are_read_only_once_a_deadline_may_have_passed() {
        let mut held = Held::of(&[entry(1, 10, 500), entry(2, 20, 300), entry(3, 30, 700)], DAY, MONTH);
        assert_eq!(held.lapse(299), (vec![], (0, 0)));
        // The earliest deadline kept after its entry left: a time before which none lapses.
        held.take(2).entry.unwrap();
        assert_eq!(held.lapse(300), (vec![], (0, 0)), "read: none had lapsed");
        assert_eq!(held.earliest_ms, 500, "and the earliest deadline is known again");
        assert_eq!(held.lapse(600), (vec![entry(1, 10, 500)], (0, 0)));
        assert_eq!((held.len(), held.sums(), held.earliest_ms), (1, (30, 30), 700));
    }

    #[test]
    fn a_new_period_takes_the_sums_anew() {
        let mut held = Held::of(&[entry(1, 10, 500)], DAY, MONTH);
        assert_eq!(held.rebase(DAY + 1, MONTH), (0, 0));
        assert_eq!(held.sums(), (0, 10));
        held.push(Entry { id: 2, micro: 5, day: DAY + 1, month: MONTH, until_ms: 600 });
        assert_eq!(held.sums(), (5, 15));
    }

    #[test]
    fn sums_that_do_not_fit_the_text_are_not_read() {
        let held = Held::of(&[entry(1, 10, 500), entry(2, 20, 300), entry(3, 5, 900)], DAY, MONTH);
        let mut r = Record::with_capacity(64);
        held.write(&mut r.list());
        let text = String::from_utf8(r.0).unwrap();
        let (sums, rest) = text.strip_prefix("~s").unwrap().split_once(',').unwrap();
        assert!(Held::read(sums.as_bytes(), rest.as_bytes(), (DAY, MONTH)).is_some());
        let rest_more = format!("{rest},~a5");
        let (_, after) = Held::read(sums.as_bytes(), rest_more.as_bytes(), (DAY, MONTH)).unwrap();
        assert_eq!(after, b"~a5");
        for (sums, rest) in [
            (sums.replacen(":", "x", 1), rest.to_owned()),
            (sums.to_owned(), format!("{rest}9")),
            (sums.to_owned(), rest[1..].to_owned()),
            (sums.replacen(&DAY.to_string(), &(DAY + 1).to_string(), 1), rest.to_owned()),
            ("0:0:1:0:1:0:0".to_owned(), rest.to_owned()),
            (sums.replacen("3:", "2:", 1), rest.to_owned()),
        ] {
            assert!(Held::read(sums.as_bytes(), rest.as_bytes(), (DAY, MONTH)).is_none(), "{sums} {rest}");
        }
    }

    #[test]
    fn an_unreadable_entry_is_no_longer_listed_and_what_it_made_stays_charged() {
        let mut held = Held::of(&[entry(1, 10, 500), entry(2, 20, 300), entry(3, 30, 700)], DAY, MONTH);
        held = garbled(&held, "2:20:", "2:2x:");
        assert_eq!(held.lapse(299), (vec![], (0, 0)), "not read yet");
        assert_eq!(held.lapse(500), (vec![entry(1, 10, 500)], (20, 20)));
        assert_eq!((held.len(), held.sums()), (1, (30, 30)));
        // Taken out unread, its amount stays in the sums while they are written; once the
        // entries left are too few to carry sums, they are read and it is given back.
        let four = [entry(1, 10, 500), entry(2, 20, 800), entry(3, 40, 900), entry(4, 80, 900)];
        let mut held = garbled(&Held::of(&four, DAY, MONTH), "1:10:", "1:1x:");
        assert_eq!(held.take_oldest(), Taken::default());
        assert_eq!((held.len(), held.sums()), (3, (150, 150)), "its amount kept until the entries are read");
        assert_eq!(held.take(3), Taken { entry: Some(entry(3, 40, 900)), unread: (10, 10) });
        assert_eq!((held.len(), held.sums()), (2, (100, 100)));
        // One still listed is read then too.
        let mut held = garbled(&Held::of(&four, DAY, MONTH), "2:20:", "2:2x:");
        assert_eq!(held.take(4), Taken { entry: Some(entry(4, 80, 900)), unread: (0, 0) });
        assert_eq!(held.take(3), Taken { entry: Some(entry(3, 40, 900)), unread: (20, 20) });
        assert_eq!((held.entries(), held.len(), held.sums()), (vec![entry(1, 10, 500)], 1, (10, 10)));
        let mut held = garbled(&Held::of(&four[..3], DAY, MONTH), "3:40:", "3:4x:");
        assert_eq!(held.take(1).unread, (40, 40));
        assert_eq!(held.take(2), Taken { entry: Some(entry(2, 20, 800)), unread: (0, 0) });
        assert_eq!(held, Held::new(DAY, MONTH));
    }

    #[test]
    fn a_new_period_gives_back_what_unreadable_entries_made_in_the_period_that_stays() {
        let three = [entry(1, 10, 500), entry(2, 20, 800), entry(3, 40, 900)];
        let mut held = garbled(&Held::of(&three, DAY, MONTH), "2:20:", "2:2x:");
        assert_eq!(held.rebase(DAY + 1, MONTH), (0, 20), "the month goes on; the day does not");
        assert_eq!((held.len(), held.sums()), (2, (0, 50)));
        let mut held = garbled(&Held::of(&three, DAY, MONTH), "2:20:", "2:2x:");
        assert_eq!(held.rebase(DAY + 1, MONTH + 1), (0, 0));
        assert_eq!((held.len(), held.sums()), (2, (0, 0)));
    }

    #[test]
    fn sums_that_count_more_than_a_record_lists_are_not_read() {
        let held = Held::of(&[entry(1, 10, 500), entry(2, 20, 300), entry(3, 5, 900)], DAY, MONTH);
        let rest = held.text.clone();
        let sums = |count: u64| format!("{count}:{}:{DAY}:35:{MONTH}:35:300", rest.len());
        assert!(Held::read(sums(3).as_bytes(), &rest, (DAY, MONTH)).is_some());
        for count in [MAX_IN_FLIGHT as u64 + 1, u64::from(u32::MAX), u64::MAX] {
            assert_eq!(Held::read(sums(count).as_bytes(), &rest, (DAY, MONTH)), None, "{count}");
        }
        // A count within the bound but not the entries' own is read past safely.
        let (mut wrong, _) = Held::read(sums(MAX_IN_FLIGHT as u64).as_bytes(), &rest, (DAY, MONTH)).unwrap();
        assert_eq!(wrong.entries().len(), 3);
        assert_eq!(wrong.take(2).entry, Some(entry(2, 20, 300)));
    }

    /// `held` as a record with its sums lists it, then read back with `from` in its text
    /// written as `to` (the entries not read).
    fn garbled(held: &Held, from: &str, to: &str) -> Held {
        let mut r = Record::with_capacity(64);
        held.write(&mut r.list());
        let text = String::from_utf8(r.0).unwrap();
        assert!(text.contains(from), "{from}");
        let text = text.replacen(from, to, 1);
        let (sums, rest) = text.strip_prefix(SUMS_MARK).unwrap().split_once(',').unwrap();
        let (read, _) = Held::read(sums.as_bytes(), rest.as_bytes(), (DAY, MONTH)).unwrap();
        read
    }
}
