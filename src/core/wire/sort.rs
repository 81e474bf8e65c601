//! A stable insertion sort for the short lists the edge orders (a tenant's key digests,
//! a registry of worker queues, a stream's tool calls, a partition's close questions): the
//! standard library's sorts are fast on long slices, and each element type compiles a copy
//! of several kilobytes into the plugin.

/// Sorts `items` so that no item is `before` one ahead of it, keeping equal items in their
/// order. Quadratic: for lists of at most a few hundred items.
pub(crate) fn sort_by<T>(items: &mut [T], before: impl Fn(&T, &T) -> bool) {
    for i in 1..items.len() {
        let mut j = i;
        while j > 0 && before(&items[j], &items[j - 1]) {
            items.swap(j, j - 1);
            j -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_and_keeps_equal_items_in_order() {
        let mut v = [(3, 'a'), (1, 'b'), (2, 'c'), (1, 'd'), (3, 'e'), (0, 'f')];
        sort_by(&mut v, |a, b| a.0 < b.0);
        assert_eq!(v, [(0, 'f'), (1, 'b'), (1, 'd'), (2, 'c'), (3, 'a'), (3, 'e')]);
        let mut empty: [u8; 0] = [];
        sort_by(&mut empty, |a, b| a < b);
        let mut one = [7];
        sort_by(&mut one, |a, b| a > b);
        assert_eq!(one, [7]);
    }
}
