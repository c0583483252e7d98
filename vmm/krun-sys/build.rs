//! Refuses to build against a stale patched krun-vmm: `.patched/krun-vmm` (which the
//! workspace's `[patch.crates-io]` names) must be the one `scripts/libkrun-hook.sh` makes from
//! the patch in `hook/` as it is now. Cargo cannot tell on its own: it sees only the patched
//! tree, not the patch it was made from.

use sha2::{Digest, Sha256};

fn main() {
    let here = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let patch = here.join("hook/embedder-devices.patch");
    let stamp = here.join("../.patched/krun-vmm/.krunbox-hook");
    println!("cargo:rerun-if-changed={}", patch.display());
    println!("cargo:rerun-if-changed={}", stamp.display());
    let digest = hex::encode(Sha256::digest(
        std::fs::read(&patch).expect("hook/embedder-devices.patch"),
    ));
    let made_from = std::fs::read_to_string(&stamp).unwrap_or_default();
    if made_from.split_whitespace().next() != Some(digest.as_str()) {
        panic!(
            "{} was not made from the current {}: run scripts/libkrun-hook.sh",
            stamp.parent().unwrap().display(),
            patch.display()
        );
    }
}
