//! `NativePool`: instances of one definition booted ahead of need, each handed out once.

use std::sync::{Arc, Mutex};

use napi_derive::napi;

use crate::errors::OrNapi;
use crate::instance::NativeInstance;

/// A warm pool (the crate's `krunbox::Pool`).
#[napi]
pub struct NativePool {
    /// `None` once shut down.
    inner: Mutex<Option<Arc<krunbox::Pool>>>,
}

impl NativePool {
    pub(crate) fn new(pool: krunbox::Pool) -> Self {
        NativePool {
            inner: Mutex::new(Some(Arc::new(pool))),
        }
    }

    fn pool(&self) -> napi::Result<Arc<krunbox::Pool>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                crate::errors::to_napi(krunbox::Error::InvalidConfig(
                    "this pool was shut down".into(),
                ))
            })
    }
}

#[napi]
impl NativePool {
    /// A running instance that never ran anything.
    #[napi]
    pub async fn take(&self) -> napi::Result<NativeInstance> {
        let pool = self.pool()?;
        Ok(NativeInstance::new(pool.take().await.or_napi()?))
    }

    /// How many instances are ready now.
    #[napi]
    pub fn ready(&self) -> napi::Result<u32> {
        Ok(self.pool()?.ready() as u32)
    }

    /// Why the last boot in the background failed, if it did.
    #[napi]
    pub fn last_failure(&self) -> napi::Result<Option<String>> {
        Ok(self.pool()?.last_failure())
    }

    /// Stops the pool and shuts down the instances still in it. Idempotent.
    #[napi]
    pub async fn shutdown(&self) -> napi::Result<()> {
        let pool = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Closed also while a take under way holds it too.
        if let Some(pool) = pool {
            pool.close().await;
        }
        Ok(())
    }
}
