//! The admission line of one bucket: the calls waiting for it, in the order they are
//! admitted. By class first; within a class, tenants take turns (each place carries a turn,
//! one past the tenant's last place in line or the class's last admitted turn, whichever
//! is later: start-time fair queueing with equal weights); then by arrival. The line is
//! bounded: a full line refuses the lowest class first. A place lapses unless its caller
//! comes back within `LINE_HOLD_MS`, so a caller whose worker died holds no one up.

use crate::core::api::priority::{Class, CLASSES};

/// A place in line lapses unless renewed this often.
pub(crate) const LINE_HOLD_MS: u64 = 3_000;
/// A place is written again (renewed) once less than this is left of its hold; a caller
/// looks again at least every `POLL_CAP_MS`, so it may come back up to a second late.
const RENEW_BELOW_MS: u64 = 1_500;
/// The longest a caller in line waits before looking again.
pub(crate) const POLL_CAP_MS: u64 = 500;

/// Who asks a bucket for admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Who {
    pub id: u64,
    pub estimate: u64,
    pub class: Class,
    /// `priority::tenant_tag` of the verified tenant (0: none).
    pub tenant: u64,
}

impl Who {
    pub(crate) fn standard(id: u64, estimate: u64) -> Who {
        Who { id, estimate, class: Class::Standard, tenant: 0 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    pub id: u64,
    pub until_ms: u64,
    pub class: Class,
    pub tenant: u64,
    pub turn: u64,
    pub since_ms: u64,
    pub estimate: u64,
}

impl Place {
    fn order(&self) -> (usize, u64, u64, u64) {
        (self.class.rank(), self.turn, self.since_ms, self.id)
    }
}

/// What stands ahead of a place: how many calls, and the tokens they asked for.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Ahead {
    pub calls: usize,
    pub tokens: f64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Line {
    places: Vec<Place>,
    /// Per class, the turn of the last place admitted from the line.
    turns: [u64; 3],
}

/// The line is full and the caller orders after every place in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl Line {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.places.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    pub(crate) fn lapse(&mut self, now_ms: u64) {
        self.places.retain(|p| p.until_ms > now_ms);
    }

    /// The caller's place: the one it holds, or the one it would take now (a caller whose
    /// class was raised since it took its place takes one in its new class).
    pub(crate) fn place_of(&self, who: &Who, now_ms: u64) -> Place {
        if let Some(p) = self.places.iter().find(|p| p.id == who.id && p.class == who.class) {
            return *p;
        }
        let last = self.places.iter().filter(|p| p.class == who.class && p.tenant == who.tenant).map(|p| p.turn);
        let turn = last.max().unwrap_or(0).max(self.turns[who.class.rank()]) + 1;
        Place {
            id: who.id,
            until_ms: now_ms.saturating_add(LINE_HOLD_MS),
            class: who.class,
            tenant: who.tenant,
            turn,
            since_ms: now_ms,
            estimate: who.estimate,
        }
    }

    /// The calls in line before `place` (`cap`: the most tokens one call is charged).
    pub(crate) fn ahead(&self, place: &Place, cap: f64) -> Ahead {
        let key = place.order();
        self.places.iter().filter(|p| p.id != place.id && p.order() < key).fold(Ahead::default(), |a, p| Ahead {
            calls: a.calls + 1,
            tokens: a.tokens + (p.estimate as f64).min(cap),
        })
    }

    /// Takes (or keeps) `place` in a line of at most `max`; whether the line changed. A full
    /// line gives its last place (of the lowest class, the latest turn) to a caller that
    /// orders before it: a higher class, or an earlier turn of the same class (another
    /// tenant's, whose fair share the full line would otherwise shut out).
    pub(crate) fn stand(&mut self, place: Place, max: usize, now_ms: u64) -> Result<bool, Full> {
        if let Some(p) = self.places.iter_mut().find(|p| p.id == place.id && p.class == place.class) {
            let renew = p.until_ms.saturating_sub(now_ms) < RENEW_BELOW_MS;
            if renew {
                p.until_ms = now_ms.saturating_add(LINE_HOLD_MS);
            }
            return Ok(renew);
        }
        // Its place in another class is given up for this one.
        self.places.retain(|p| p.id != place.id);
        if self.places.len() >= max.max(1) {
            let last = self.places.iter().enumerate().max_by_key(|(_, p)| p.order()).map(|(i, p)| (i, p.order()));
            match last {
                Some((i, order)) if order > place.order() => {
                    self.places.swap_remove(i);
                }
                _ => return Err(Full),
            }
        }
        self.places.push(place);
        Ok(true)
    }

    /// The call `id` leaves the line; `admitted` in a class: that class's turn moves on to
    /// the call's (a call raised to another class since it took its place moves no turn of
    /// the class it left).
    pub(crate) fn leave(&mut self, id: u64, admitted: Option<Class>) -> bool {
        let Some(i) = self.places.iter().position(|p| p.id == id) else { return false };
        let p = self.places.swap_remove(i);
        if admitted == Some(p.class) {
            let t = &mut self.turns[p.class.rank()];
            *t = (*t).max(p.turn);
        }
        true
    }

    /// The line in a bucket record: the turns, then each place, in fixed-width binary
    /// (every waiter reads the whole line each time it looks: text cost a long line's
    /// every read).
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.reserve(TURNS_BYTES + self.places.len() * PLACE_BYTES);
        for t in self.turns {
            out.extend_from_slice(&t.to_le_bytes());
        }
        for p in &self.places {
            for n in [p.id, p.until_ms] {
                out.extend_from_slice(&n.to_le_bytes());
            }
            out.push(p.class.rank() as u8);
            for n in [p.tenant, p.turn, p.since_ms, p.estimate] {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }

    /// The line `encode` wrote (`None`: not one).
    pub(crate) fn decode(raw: &[u8]) -> Option<Line> {
        let (turns, places) = raw.split_at_checked(TURNS_BYTES)?;
        if !places.len().is_multiple_of(PLACE_BYTES) {
            return None;
        }
        let word = |b: &[u8], at: usize| b.get(at..at + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes);
        let mut line = Line { places: Vec::with_capacity(places.len() / PLACE_BYTES), turns: [0; 3] };
        for (i, t) in line.turns.iter_mut().enumerate() {
            *t = word(turns, 8 * i)?;
        }
        for p in places.chunks_exact(PLACE_BYTES) {
            line.places.push(Place {
                id: word(p, 0)?,
                until_ms: word(p, 8)?,
                class: CLASSES.get(usize::from(*p.get(16)?)).copied()?,
                tenant: word(p, 17)?,
                turn: word(p, 25)?,
                since_ms: word(p, 33)?,
                estimate: word(p, 41)?,
            });
        }
        Some(line)
    }
}

const TURNS_BYTES: usize = 3 * 8;
/// A place: six numbers of 8 bytes and its class's byte.
const PLACE_BYTES: usize = 6 * 8 + 1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::MAX_LINE;

    fn who(id: u64, class: Class, tenant: u64) -> Who {
        Who { id, estimate: 10, class, tenant }
    }

    /// A line of at most `max` with `n` callers of `class` from `tenant`, ids 0.., one per ms.
    fn line_of(n: u64, class: Class, tenant: u64, max: usize) -> Line {
        let mut line = Line::default();
        for i in 0..n {
            let p = line.place_of(&who(i, class, tenant), i);
            line.stand(p, max, i).unwrap();
        }
        line
    }

    /// Stands each caller in line, then admits the head until the line is empty.
    fn admitted_order(arrivals: &[Who]) -> Vec<u64> {
        let mut line = Line::default();
        for (t, w) in arrivals.iter().enumerate() {
            let p = line.place_of(w, t as u64);
            line.stand(p, MAX_LINE, t as u64).unwrap();
        }
        let mut order = Vec::new();
        while let Some(head) = line.places.iter().min_by_key(|p| p.order()).copied() {
            assert_eq!(line.ahead(&head, f64::INFINITY).calls, 0);
            line.leave(head.id, Some(head.class));
            order.push(head.id);
        }
        order
    }

    #[test]
    fn classes_first_then_tenants_take_turns_then_arrival() {
        let mut arrivals: Vec<Who> = (0..10).map(|i| who(i, Class::Sheddable, 1)).collect();
        arrivals.extend((10..20).map(|i| who(i, Class::Standard, 2)));
        arrivals.extend([who(20, Class::Standard, 3), who(21, Class::Standard, 3), who(22, Class::Critical, 4)]);
        let order = admitted_order(&arrivals);
        assert_eq!(order[0], 22, "critical first, though it came last");
        assert_eq!(&order[1..5], &[10, 20, 11, 21], "tenant 3's two take turns with tenant 2's ten");
        assert_eq!(&order[13..], &(0..10).collect::<Vec<_>>()[..], "sheddable last, by arrival");
    }

    #[test]
    fn a_tenant_arriving_late_is_not_behind_anothers_backlog() {
        let mut line = line_of(100, Class::Standard, 1, MAX_LINE);
        // Fifty of tenant 1's calls are admitted before tenant 2 arrives.
        for i in 0..50 {
            line.leave(i, Some(Class::Standard));
        }
        let late = line.place_of(&who(500, Class::Standard, 2), 200);
        assert_eq!(line.ahead(&late, f64::INFINITY).calls, 1, "behind tenant 1's next call only");
    }

    #[test]
    fn a_full_line_refuses_its_lowest_class_first() {
        let mut line = line_of(3, Class::Sheddable, 1, 3);
        let p = line.place_of(&who(7, Class::Sheddable, 1), 5);
        assert_eq!(line.stand(p, 3, 5), Err(Full), "no place for another sheddable call of the same tenant");
        let p = line.place_of(&who(8, Class::Critical, 2), 5);
        assert_eq!(line.stand(p, 3, 5), Ok(true), "a critical call takes the last sheddable place");
        assert_eq!(line.len(), 3);
        assert!(line.places.iter().all(|p| p.id != 2), "the latest sheddable place went");
        // The caller that lost its place finds the line full when it comes back.
        let back = line.place_of(&who(2, Class::Sheddable, 1), 6);
        assert_eq!(line.stand(back, 3, 6), Err(Full));
    }

    #[test]
    fn a_full_line_gives_its_last_turn_to_another_tenant_whose_turn_comes_first() {
        let mut line = line_of(4, Class::Standard, 1, 4);
        let other = line.place_of(&who(9, Class::Standard, 2), 10);
        assert_eq!(other.turn, 1, "its first turn, beside tenant 1's first");
        assert_eq!(line.stand(other, 4, 10), Ok(true), "a place, not a refusal");
        assert_eq!(line.len(), 4);
        assert!(line.places.iter().all(|p| p.id != 3), "tenant 1's fourth turn gave way");
        assert_eq!(line.ahead(&other, f64::INFINITY).calls, 1, "behind tenant 1's first turn only");
        let again = line.place_of(&who(10, Class::Standard, 2), 11);
        assert_eq!(line.stand(again, 4, 11), Ok(true), "its second turn orders before tenant 1's third");
        let third = line.place_of(&who(11, Class::Standard, 2), 12);
        assert_eq!(line.stand(third, 4, 12), Err(Full), "its third comes after tenant 1's second: full");
    }

    #[test]
    fn a_place_is_renewed_only_when_its_hold_runs_low_and_lapses_otherwise() {
        let mut line = Line::default();
        let me = who(1, Class::Standard, 0);
        assert_eq!(line.stand(line.place_of(&me, 0), 8, 0), Ok(true));
        let early = LINE_HOLD_MS - RENEW_BELOW_MS;
        assert_eq!(line.stand(line.place_of(&me, early), 8, early), Ok(false), "nothing to write");
        let late = early + 1;
        assert_eq!(line.stand(line.place_of(&me, late), 8, late), Ok(true), "renewed");
        line.lapse(late + LINE_HOLD_MS - 1);
        assert_eq!(line.len(), 1);
        line.lapse(late + LINE_HOLD_MS);
        assert!(line.is_empty(), "not renewed: lapsed");
    }

    #[test]
    fn a_caller_raised_to_a_higher_class_moves_ahead_of_the_class_it_left() {
        let mut line = line_of(5, Class::Sheddable, 1, 8);
        let raised = who(4, Class::Critical, 1);
        let p = line.place_of(&raised, 10);
        assert_eq!((p.class, line.ahead(&p, f64::INFINITY).calls), (Class::Critical, 0));
        assert_eq!(line.stand(p, 8, 10), Ok(true));
        assert_eq!(line.len(), 5, "one place, in its new class");
        let last = line.place_of(&who(0, Class::Sheddable, 1), 11);
        assert_eq!(line.ahead(&last, f64::INFINITY).calls, 1, "the raised caller is ahead of every sheddable one");
        // Raised and admitted at once (its new place never written), it leaves its old one
        // and moves no turn of the class it left.
        let mut line = line_of(5, Class::Sheddable, 1, 8);
        assert!(line.leave(4, Some(Class::Critical)));
        let other = line.place_of(&who(9, Class::Sheddable, 2), 12);
        assert_eq!(other.turn, 1, "another tenant's first sheddable call is not sent behind the first's");
    }

    #[test]
    fn the_line_round_trips_through_its_record_bytes() {
        let mut line = Line::default();
        for i in 0..3 {
            let p = line.place_of(&Who { id: u64::MAX - i, ..who(i, CLASSES[i as usize], i * 7) }, i);
            line.stand(p, 8, i).unwrap();
        }
        line.leave(u64::MAX, Some(Class::Critical));
        let mut raw = Vec::new();
        line.encode(&mut raw);
        assert_eq!(Line::decode(&raw), Some(line));
        assert_eq!(Line::decode(&raw[..raw.len() - 1]), None, "a torn record is no line");
    }
}
