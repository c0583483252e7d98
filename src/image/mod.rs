//! Making images: above [`Sandbox`](crate::Sandbox), since each of these boots one to do its
//! work inside a guest (an image's own files are never unpacked or run on the host).
//!
//! - [`flatten`]: a writable root's image and layer merged into one standalone qcow2 at a path,
//!   written to any writer ([`flatten_into`]) or into a block store ([`flatten_into_store`],
//!   read back with [`stored_bytes`]); [`bytes`] streams the image file a root boots from. The
//!   root to flatten is described without booting: [`Rootfs::cow`](crate::Rootfs::cow) is a
//!   base plus the store of its changes (the design's `compose`).
//! - [`oci`]: OCI and Docker images imported from an archive or pulled from a registry, kept by
//!   name ([`oci::LocalImages`]), and built by running steps on one ([`oci::build`]).
//!
//! What a sandbox boots from them is a [`Rootfs`](crate::Rootfs) (`FlatImage::rootfs`,
//! `OciImage::rootfs`) and, for an OCI image, its [`ImageConfig`](crate::rootfs::ImageConfig).

mod flatten;
pub mod oci;
mod stored;

pub use flatten::{bytes, flatten, flatten_into, FlatImage, WrittenImage};
pub use stored::{flatten_into_store, stored_bytes};
