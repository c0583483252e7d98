//! Refuses to build against stale patched libkrun crates: `.patched/krun-vmm` and
//! `.patched/krun-devices` (which the workspace's `[patch.crates-io]` names) must be the ones
//! `scripts/libkrun-hook.sh` makes from the patches in `hook/` as they are now. Cargo cannot
//! tell on its own: it sees only the patched trees, not the patches they were made from.

use sha2::{Digest, Sha256};

/// The patched crates, in the order the hook's stamp lists their patches' digests.
const CRATES: [&str; 2] = ["krun-vmm", "krun-devices"];

fn main() {
    let here = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let stamp = here.join("../.patched/.krunbox-hook");
    println!("cargo:rerun-if-changed={}", stamp.display());
    let mut digests = Vec::new();
    for krate in CRATES {
        let patch = here.join(format!("hook/{krate}.patch"));
        println!("cargo:rerun-if-changed={}", patch.display());
        let bytes =
            std::fs::read(&patch).unwrap_or_else(|e| panic!("reading {}: {e}", patch.display()));
        digests.push(hex::encode(Sha256::digest(bytes)));
    }
    let made_from = std::fs::read_to_string(&stamp).unwrap_or_default();
    let stamped: Vec<&str> = made_from.split_whitespace().take(CRATES.len()).collect();
    if stamped != digests {
        panic!(
            "{} were not made from the current patches in {}: run scripts/libkrun-hook.sh",
            stamp.parent().unwrap().display(),
            here.join("hook").display()
        );
    }
}
