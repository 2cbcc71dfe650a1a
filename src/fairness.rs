//! Fairness between principals: a bound on how many of the store's pooled
//! connections one principal's guarded requests may hold at once (the
//! claim, and the handler's transaction after it), so that one tenant's
//! storm (many keys at once, or a flood of retries) leaves the rest of the
//! pool to the others. Duplicates that wait for a request running in this
//! process hold no connection and no slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The slots of every principal with a request on the store now.
#[derive(Debug)]
pub(crate) struct PrincipalSlots {
    per_principal: usize,
    /// Only principals that hold or wait for a slot have an entry.
    active: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// One principal's slot, held while its request uses a connection.
#[derive(Debug)]
pub(crate) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    semaphore: Arc<Semaphore>,
    principal: String,
    slots: Arc<PrincipalSlots>,
}

impl PrincipalSlots {
    pub(crate) fn new(per_principal: usize) -> Self {
        Self {
            per_principal,
            active: Mutex::new(HashMap::new()),
        }
    }

    /// How many slots each principal has.
    pub(crate) fn per_principal(&self) -> usize {
        self.per_principal
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Semaphore>>> {
        // The map holds no invariant a panic could break.
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot of `principal`, waiting at most `wait` for one of its own
    /// requests to give one back; `None` when none came.
    pub(crate) async fn take(self: &Arc<Self>, principal: &str, wait: Duration) -> Option<Slot> {
        let semaphore = Arc::clone(
            self.lock()
                .entry(principal.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_principal))),
        );
        let mut slot = Slot {
            permit: None,
            semaphore: Arc::clone(&semaphore),
            principal: principal.to_owned(),
            slots: Arc::clone(self),
        };
        let permit = tokio::time::timeout(wait, semaphore.acquire_owned()).await;
        match permit {
            Ok(Ok(permit)) => {
                slot.permit = Some(permit);
                Some(slot)
            }
            // Timed out (the slot's drop tidies the map), or closed (never).
            _ => None,
        }
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.lock().len()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        drop(self.permit.take());
        let mut active = self.slots.lock();
        // The map's reference and this slot's: nobody else holds or waits.
        if Arc::strong_count(&self.semaphore) == 2 {
            active.remove(&self.principal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_principal_holds_at_most_its_share_and_the_map_empties() {
        let slots = Arc::new(PrincipalSlots::new(2));
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
        assert_eq!(slots.tracked(), 2);
        drop(a1);
        let a3 = slots
            .take("a", wait)
            .await
            .expect("a slot given back is taken");
        drop((a2, a3, b1));
        assert_eq!(
            slots.tracked(),
            0,
            "no principal is remembered after its requests"
        );
    }
}
