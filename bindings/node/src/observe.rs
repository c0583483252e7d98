//! What an instance tells about itself: its confinement, its resource use, its published
//! ports. Reports cross as JSON values (the library serializes them); the TypeScript API types
//! them and names their fields in camelCase.

use napi_derive::napi;

use crate::errors::{invalid, OrNapi};
use crate::instance::NativeInstance;

fn json(value: &impl serde::Serialize) -> napi::Result<serde_json::Value> {
    serde_json::to_value(value).map_err(|e| invalid(format!("cannot serialize a report: {e}")))
}

#[napi]
impl NativeInstance {
    /// How the VMM helper is confined: each layer in force or not, each canary blocked or not.
    #[napi]
    pub fn isolation(&self) -> napi::Result<serde_json::Value> {
        json(self.inner.isolation())
    }

    /// What the instance uses now: CPU time, memory, disk and network bytes, descriptors.
    #[napi]
    pub fn metrics(&self) -> napi::Result<serde_json::Value> {
        json(&self.inner.metrics().or_napi()?)
    }

    /// The host's "address:port" a published guest port is reachable at, if it is published.
    #[napi]
    pub fn published_address(&self, guest_port: u16) -> Option<String> {
        self.inner
            .published_address(guest_port)
            .map(|address| address.to_string())
    }
}
