//! Fairness between principals: turns at the store's connections for the
//! layer's guarded requests (the claim, and the handler's transaction after
//! it), so that one tenant's storm, or several tenants' storms together,
//! leave others a turn.
//!
//! The rule, for a capacity of `N` connections (the pool's size; `1` on
//! SQLite, whose claims all need its one writer) and a share of `S` (at
//! most `N`):
//!
//! - a principal holds at most `S` of them;
//! - a principal that holds none may take any free one; a principal that
//!   already holds one takes another only while fewer than `S` are held in
//!   all, so the last `N - S` (the reserve) only ever go to principals'
//!   first connections: storms together never hold more than `S`;
//! - a connection given back goes to the waiting request whose principal
//!   holds the fewest, then whose principal's last turn is the oldest,
//!   then the one that came first (a fair queue: at SQLite's one writer,
//!   principals take turns);
//! - every wait is bounded by the request's own wait, and at most
//!   [`queue_bound`] requests of one principal wait at once (more are
//!   refused at once).
//!
//! Duplicates that wait for a request running in this process hold no
//! connection and take no turn.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

/// The turns of every principal with a request on the store now.
#[derive(Debug)]
pub(crate) struct PrincipalSlots {
    /// How many connections the layer's requests may hold at once.
    capacity: usize,
    /// How many one principal may hold, and all principals that hold more
    /// than one together.
    per_principal: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Connections held now, by every principal.
    held: usize,
    /// Only principals that hold or wait have an entry.
    principals: HashMap<Arc<str>, Entry>,
    /// Waiting requests, in the order they came.
    queue: Vec<Waiter>,
    /// Numbers waiters, in the order they came.
    next_seq: u64,
    /// Numbers turns, in the order they were given.
    turns: u64,
}

#[derive(Debug, Default)]
struct Entry {
    held: usize,
    queued: usize,
    /// The number of this principal's last turn (0: none yet).
    last_turn: u64,
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    principal: String,
    wake: oneshot::Sender<()>,
}

/// One principal's turn, held while its request uses a connection.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<PrincipalSlots>,
    /// The principal's key in the map while it holds a turn (shared, not
    /// copied).
    principal: Arc<str>,
}

/// How many requests of one principal may wait for a turn at once, for a
/// capacity of `capacity`: four times the capacity, at least 64.
pub(crate) fn queue_bound(capacity: usize) -> usize {
    capacity.saturating_mul(4).max(64)
}

impl PrincipalSlots {
    /// Turns at `capacity` connections, at most `per_principal` for one
    /// principal (both at least 1; the share at most the capacity).
    pub(crate) fn new(capacity: usize, per_principal: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            per_principal: per_principal.clamp(1, capacity),
            state: Mutex::new(State::default()),
        }
    }

    /// How many connections one principal may hold.
    pub(crate) fn per_principal(&self) -> usize {
        self.per_principal
    }

    /// How many connections the layer's requests may hold at once.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many requests wait for a turn now (for tests).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn waiting(&self) -> usize {
        self.lock().queue.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change to the state is made whole under the lock, with no
        // call that could panic halfway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `principal` may take a connection now.
    fn admissible(&self, st: &State, principal: &str) -> bool {
        let held = st.principals.get(principal).map_or(0, |e| e.held);
        if held >= self.per_principal {
            return false;
        }
        if held == 0 {
            st.held < self.capacity
        } else {
            st.held < self.per_principal
        }
    }

    fn grant(st: &mut State, principal: &str) -> Arc<str> {
        st.turns += 1;
        st.held += 1;
        let turn = st.turns;
        let key = Self::key(st, principal);
        let entry = st.principals.entry(Arc::clone(&key)).or_default();
        entry.held += 1;
        entry.last_turn = turn;
        key
    }

    /// `principal`'s key in the map: the one there, or a new one.
    fn key(st: &State, principal: &str) -> Arc<str> {
        st.principals
            .get_key_value(principal)
            .map_or_else(|| Arc::from(principal), |(key, _)| Arc::clone(key))
    }

    /// Forgets a principal that neither holds nor waits.
    fn tidy(st: &mut State, principal: &str) {
        if st
            .principals
            .get(principal)
            .is_some_and(|e| e.held == 0 && e.queued == 0)
        {
            st.principals.remove(principal);
        }
    }

    /// Gives free connections to the waiters they are due to.
    fn dispatch(&self, st: &mut State) {
        loop {
            let mut best: Option<(usize, (usize, u64, u64))> = None;
            for (i, w) in st.queue.iter().enumerate() {
                if !self.admissible(st, &w.principal) {
                    continue;
                }
                let (held, last_turn) = st
                    .principals
                    .get(w.principal.as_str())
                    .map_or((0, 0), |e| (e.held, e.last_turn));
                let rank = (held, last_turn, w.seq);
                if best.is_none_or(|(_, b)| rank < b) {
                    best = Some((i, rank));
                }
            }
            let Some((i, _)) = best else { return };
            let waiter = st.queue.remove(i);
            if let Some(e) = st.principals.get_mut(waiter.principal.as_str()) {
                e.queued = e.queued.saturating_sub(1);
            }
            Self::grant(st, &waiter.principal);
            // A waiter that is gone (its wait ended, or it was dropped)
            // gives the turn back from its guard, once this lock is free.
            let _ = waiter.wake.send(());
        }
    }

    fn release(&self, principal: &str) {
        let mut st = self.lock();
        st.held = st.held.saturating_sub(1);
        if let Some(e) = st.principals.get_mut(principal) {
            e.held = e.held.saturating_sub(1);
        }
        Self::tidy(&mut st, principal);
        self.dispatch(&mut st);
    }

    /// A turn of `principal`, waiting at most `wait`; `None` when none
    /// came, or when too many of its requests wait already.
    pub(crate) async fn take(self: &Arc<Self>, principal: &str, wait: Duration) -> Option<Slot> {
        let (seq, woken) = {
            let mut st = self.lock();
            // No waiter may take a connection now (each change that frees
            // one gives it away), so one free for this request is its own.
            if self.admissible(&st, principal) {
                let key = Self::grant(&mut st, principal);
                return Some(self.slot(key));
            }
            let bound = queue_bound(self.capacity);
            let key = Self::key(&st, principal);
            let entry = st.principals.entry(key).or_default();
            if entry.queued >= bound {
                Self::tidy(&mut st, principal);
                return None;
            }
            entry.queued += 1;
            let (wake, woken) = oneshot::channel();
            st.next_seq += 1;
            let seq = st.next_seq;
            st.queue.push(Waiter {
                seq,
                principal: principal.to_owned(),
                wake,
            });
            (seq, woken)
        };
        let mut queued = Queued {
            slots: self,
            seq,
            principal,
            turned: false,
        };
        match tokio::time::timeout(wait, woken).await {
            Ok(Ok(())) => {
                queued.turned = true;
                Some(self.slot(Arc::from(principal)))
            }
            // Out of time (a turn given meanwhile goes back from the
            // guard), or the sender dropped (never: a waiter leaves the
            // queue only through a turn or its own guard).
            _ => None,
        }
    }

    fn slot(self: &Arc<Self>, principal: Arc<str>) -> Slot {
        Slot {
            slots: Arc::clone(self),
            principal,
        }
    }
}

/// A request waiting for its turn: when its wait ends without one (out of
/// time, or the request was dropped), it leaves the queue, or gives back
/// the turn that came too late.
struct Queued<'a> {
    slots: &'a PrincipalSlots,
    seq: u64,
    principal: &'a str,
    turned: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.turned {
            return;
        }
        let mut st = self.slots.lock();
        if let Some(i) = st.queue.iter().position(|w| w.seq == self.seq) {
            st.queue.remove(i);
            if let Some(e) = st.principals.get_mut(self.principal) {
                e.queued = e.queued.saturating_sub(1);
            }
            PrincipalSlots::tidy(&mut st, self.principal);
        } else {
            drop(st);
            self.slots.release(self.principal);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(&self.principal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracked(slots: &PrincipalSlots) -> usize {
        slots.lock().principals.len()
    }

    #[tokio::test]
    async fn a_principal_holds_at_most_its_share_and_the_map_empties() {
        let slots = Arc::new(PrincipalSlots::new(4, 2));
        let wait = Duration::from_millis(20);
        let a1 = slots.take("a", wait).await.expect("a's first");
        let a2 = slots.take("a", wait).await.expect("a's second");
        assert!(
            slots.take("a", wait).await.is_none(),
            "a's third waits, then none"
        );
        let b1 = slots
            .take("b", wait)
            .await
            .expect("b is not held back by a");
        assert_eq!(tracked(&slots), 2);
        drop(a1);
        assert!(
            slots.take("a", wait).await.is_none(),
            "a's second with b's first would pass the share"
        );
        drop(b1);
        let a3 = slots
            .take("a", wait)
            .await
            .expect("a slot given back is taken");
        drop((a2, a3));
        assert_eq!(slots.waiting(), 0);
        assert_eq!(
            tracked(&slots),
            0,
            "no principal is remembered after its requests"
        );
    }

    #[tokio::test]
    async fn storms_together_leave_the_reserve_to_principals_that_hold_none() {
        // Capacity 4, share 3: one connection is kept for first turns.
        let slots = Arc::new(PrincipalSlots::new(4, 3));
        let wait = Duration::from_millis(20);
        let a1 = slots.take("a", wait).await.expect("a");
        let b1 = slots.take("b", wait).await.expect("b");
        let a2 = slots.take("a", wait).await.expect("a's second");
        assert!(slots.take("a", wait).await.is_none(), "the reserve");
        assert!(slots.take("b", wait).await.is_none(), "the reserve");
        let c1 = slots.take("c", wait).await.expect("c finds the reserve");
        assert!(slots.take("d", wait).await.is_none(), "all four held");
        // Given back, a connection goes to the principal that holds none.
        let a_waits = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.take("a", Duration::from_secs(30)).await }
        });
        let d_waits = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.take("d", Duration::from_secs(30)).await }
        });
        while slots.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        drop(c1);
        let d1 = d_waits.await.expect("no panic").expect("d's turn");
        assert_eq!(slots.waiting(), 1, "a still waits");
        drop((d1, b1));
        // Now three are held with one free... a holds two, so a's third
        // waits for the total to fall below the share.
        let a3 = a_waits.await.expect("no panic").expect("a's turn");
        drop((a1, a2, a3));
        assert_eq!(tracked(&slots), 0);
    }

    #[tokio::test]
    async fn one_writer_is_taken_in_turns() {
        let slots = Arc::new(PrincipalSlots::new(1, 1));
        let first = slots.take("storm", Duration::from_millis(20)).await;
        let mut waiting = Vec::new();
        for who in ["storm", "storm", "calm"] {
            let shared = Arc::clone(&slots);
            waiting.push(tokio::spawn(async move {
                let slot = shared.take(who, Duration::from_secs(30)).await;
                (who, slot)
            }));
            while slots.waiting() < waiting.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(first);
        // The calm principal, which had no turn yet, goes before the
        // storm's second.
        let (who, slot) = waiting.pop().expect("calm").await.expect("no panic");
        assert_eq!(who, "calm");
        assert!(slot.is_some());
        assert_eq!(slots.waiting(), 2);
        drop(slot);
        for w in waiting {
            let (_, slot) = w.await.expect("no panic");
            drop(slot.expect("the storm's turn"));
        }
        assert_eq!(tracked(&slots), 0);
    }

    #[tokio::test]
    async fn a_dropped_or_late_waiter_gives_its_turn_back() {
        let slots = Arc::new(PrincipalSlots::new(1, 1));
        let held = slots.take("a", Duration::from_millis(20)).await;
        let dropped = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.take("b", Duration::from_secs(30)).await }
        });
        while slots.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        dropped.abort();
        let _ = dropped.await;
        assert_eq!(slots.waiting(), 0, "a dropped waiter leaves the queue");
        drop(held);
        assert!(slots.take("c", Duration::from_millis(20)).await.is_some());
        assert_eq!(tracked(&slots), 0);
    }
}
