//! A store handle taken for one use: a boot's layer, or an image written or read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tracing::Instrument;

use super::{BlockStore, StoreContext, StoreError};

/// A store handle taken (its "attached" flag set) and, once [`Claim::attach`] succeeds, the
/// store attached. Dropped armed (the use failed, or the future awaiting it was dropped), it
/// detaches the store (in a task: `Drop` cannot wait) and frees the handle; a use that hands
/// the store on [`disarm`](Claim::disarm)s it, one that is done [`release`](Claim::release)s it.
pub(crate) struct Claim {
    attached: Arc<AtomicBool>,
    /// The store, once its `attach` succeeded (then it needs a `detach`).
    store: Option<Arc<dyn BlockStore>>,
    armed: bool,
}

impl Claim {
    /// Takes the handle whose flag is `attached`: [`StoreError::InUse`] while another use of
    /// this process holds it.
    pub(crate) fn take(attached: Arc<AtomicBool>) -> Result<Claim, StoreError> {
        attached
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .map_err(|_| StoreError::InUse)?;
        Ok(Claim {
            attached,
            store: None,
            armed: true,
        })
    }

    /// Attaches `store` with `context`; from now on dropping the claim detaches it.
    pub(crate) async fn attach(
        &mut self,
        store: &Arc<dyn BlockStore>,
        context: &StoreContext,
    ) -> Result<(), StoreError> {
        store.attach(context).await?;
        self.store = Some(store.clone());
        Ok(())
    }

    /// The use is handed on (a boot's layer owns the handle now and frees it itself).
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// The use is over: detaches the store (if attached) and frees the handle.
    pub(crate) async fn release(mut self) -> Result<(), StoreError> {
        self.armed = false;
        let detached = match self.store.take() {
            Some(store) => store.detach().await,
            None => Ok(()),
        };
        self.attached.store(false, Ordering::SeqCst);
        detached
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let attached = self.attached.clone();
        match (self.store.take(), tokio::runtime::Handle::try_current()) {
            (Some(store), Ok(runtime)) => {
                runtime.spawn(
                    async move {
                        let _ = store.detach().await;
                        attached.store(false, Ordering::SeqCst);
                    }
                    .in_current_span(),
                );
            }
            _ => attached.store(false, Ordering::SeqCst),
        }
    }
}
