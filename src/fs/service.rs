//! The transport: each mount's vsock connection, served.
