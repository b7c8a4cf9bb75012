//! The admission queue of an InferencePool: requests that found every pod saturated wait
//! here and leave highest priority first and, within a priority, one request per tenant in
//! turn, so a tenant that sends many requests waits behind its own, not in front of others'.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

pub(super) struct Queue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    /// Where each waiting request is: its priority and tenant.
    index: HashMap<u64, (i32, Arc<str>)>,
    next_id: u64,
}

struct Band<T> {
    /// Tenants with waiting requests, in the order they are served next.
    turn: VecDeque<Arc<str>>,
    flows: HashMap<Arc<str>, VecDeque<(u64, T)>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            bands: BTreeMap::new(),
            index: HashMap::new(),
            next_id: 0,
        }
    }
}

impl<T> Queue<T> {
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Adds `item` at the back of its tenant's flow; the id [`Queue::remove`] takes.
    pub(super) fn push(&mut self, priority: i32, tenant: Arc<str>, item: T) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let band = self.bands.entry(Reverse(priority)).or_insert_with(|| Band {
            turn: VecDeque::new(),
            flows: HashMap::new(),
        });
        let flow = band.flows.entry(tenant.clone()).or_default();
        if flow.is_empty() {
            band.turn.push_back(tenant.clone());
        }
        flow.push_back((id, item));
        self.index.insert(id, (priority, tenant));
        id
    }

    /// The next request: the highest priority's next tenant's oldest.
    pub(super) fn pop(&mut self) -> Option<T> {
        let mut entry = self.bands.first_entry()?;
        let band = entry.get_mut();
        let tenant = band.turn.pop_front()?;
        let flow = band.flows.get_mut(&tenant)?;
        let (id, item) = flow.pop_front()?;
        if flow.is_empty() {
            band.flows.remove(&tenant);
        } else {
            band.turn.push_back(tenant);
        }
        if band.turn.is_empty() {
            entry.remove();
        }
        self.index.remove(&id);
        Some(item)
    }

    /// Takes out the request `id` if it is still waiting.
    pub(super) fn remove(&mut self, id: u64) -> Option<T> {
        let (priority, tenant) = self.index.remove(&id)?;
        self.take(priority, &tenant, |flow| {
            flow.iter().position(|(held, _)| *held == id)
        })
    }

    /// Makes room for a request of `priority`: takes out the newest request of the lowest
    /// priority below it, from that priority's longest flow; `None` if every waiting request
    /// is of `priority` or above.
    pub(super) fn displace_below(&mut self, priority: i32) -> Option<T> {
        let (&Reverse(lowest), band) = self.bands.last_key_value()?;
        if lowest >= priority {
            return None;
        }
        let tenant = band
            .flows
            .iter()
            .max_by_key(|(_, flow)| flow.len())
            .map(|(tenant, _)| tenant.clone())?;
        let mut taken = None;
        let item = self.take(lowest, &tenant, |flow| {
            taken = flow.back().map(|(id, _)| *id);
            flow.len().checked_sub(1)
        });
        if let Some(id) = taken {
            self.index.remove(&id);
        }
        item
    }

    /// Takes the item at `position(flow)` out of `tenant`'s flow at `priority`, keeping the
    /// band's turn order and dropping what became empty.
    fn take(
        &mut self,
        priority: i32,
        tenant: &Arc<str>,
        position: impl FnOnce(&VecDeque<(u64, T)>) -> Option<usize>,
    ) -> Option<T> {
        let band = self.bands.get_mut(&Reverse(priority))?;
        let flow = band.flows.get_mut(tenant)?;
        let (_, item) = flow.remove(position(flow)?)?;
        if flow.is_empty() {
            band.flows.remove(tenant);
            band.turn.retain(|held| held != tenant);
            if band.turn.is_empty() {
                self.bands.remove(&Reverse(priority));
            }
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(queue: &mut Queue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| queue.pop()).collect()
    }

    #[test]
    fn higher_priorities_leave_first_and_tenants_take_turns_within_one() {
        let mut queue = Queue::default();
        let (a, b) = (Arc::<str>::from("a"), Arc::<str>::from("b"));
        for item in ["a1", "a2", "a3", "a4"] {
            queue.push(0, a.clone(), item);
        }
        queue.push(0, b.clone(), "b1");
        queue.push(-1, b.clone(), "batch");
        queue.push(0, b.clone(), "b2");
        queue.push(10, a.clone(), "urgent");
        assert_eq!(queue.len(), 8);
        assert_eq!(
            drain(&mut queue),
            ["urgent", "a1", "b1", "a2", "b2", "a3", "a4", "batch"]
        );
        assert!(queue.is_empty());
        assert!(queue.bands.is_empty(), "empty bands are dropped");
    }

    #[test]
    fn a_removed_request_leaves_no_trace_and_turns_stay_fair() {
        let mut queue = Queue::default();
        let (a, b) = (Arc::<str>::from("a"), Arc::<str>::from("b"));
        let a1 = queue.push(0, a.clone(), "a1");
        queue.push(0, b.clone(), "b1");
        queue.push(0, a.clone(), "a2");
        assert_eq!(queue.remove(a1), Some("a1"));
        assert_eq!(queue.remove(a1), None, "already gone");
        assert_eq!(drain(&mut queue), ["a2", "b1"]);
        let only = queue.push(3, b, "only");
        assert_eq!(queue.remove(only), Some("only"));
        assert!(queue.is_empty() && queue.bands.is_empty());
    }

    #[test]
    fn room_is_made_only_by_displacing_a_lower_priority_from_its_longest_flow() {
        let mut queue = Queue::default();
        let (a, b) = (Arc::<str>::from("a"), Arc::<str>::from("b"));
        queue.push(0, a.clone(), "a1");
        queue.push(-5, b.clone(), "b1");
        queue.push(-5, a.clone(), "low-a1");
        queue.push(-5, a.clone(), "low-a2");
        assert_eq!(queue.displace_below(-5), None, "nothing below -5");
        assert_eq!(
            queue.displace_below(0),
            Some("low-a2"),
            "newest of the longest flow"
        );
        let mut rest: Vec<_> = std::iter::from_fn(|| queue.displace_below(0)).collect();
        rest.sort_unstable();
        assert_eq!(rest, ["b1", "low-a1"]);
        assert_eq!(queue.len(), 1);
        assert_eq!(drain(&mut queue), ["a1"]);
    }
}
