//! The helper's jail as the library sees it: the contract both sides share (what the library
//! asks of the jail, the report it gets back) is `krunbox_protocol::vmm::jail`, re-exported
//! here; the library's own side (the probe, reading the report) is `host.rs`; the jail itself
//! runs in the helper (`vmm/src/jail/`, the `krunbox-vmm` crate).

pub(crate) mod host;

pub use krunbox_protocol::vmm::jail::{
    refusal, Canary, CanaryReport, CgroupPlacement, HelperReport, Isolation, JailConfig, Layer,
    LayerReport, REPORT_MAX_BYTES,
};
