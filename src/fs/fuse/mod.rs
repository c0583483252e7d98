//! FUSE: the wire format between the guest kernel and this module.
