//! A hostile guest's HTTP: the bytes it sends on an intercepted connection, as plain HTTP and
//! as what is inside its TLS, served as the network service serves them
//! (`src/net/intercept/`: hyper-util's server, HTTP/1.1 or HTTP/2 with prior knowledge, each
//! request's authority checked, hop-by-hop headers stripped, middleware run (one answers some
//! requests itself), secrets' placeholders swapped over TLS, in bodies too for a secret that
//! opted in), over in-memory pipes to a fake origin: no network. Checks that nothing panics,
//! that the connection ends once the guest finishes sending, and that every request the origin
//! gets has the trusted Host, no hop-by-hop header, was not one middleware answered, and has a
//! secret's value only where the guest put its placeholder (a header, an opted-in query string
//! or body), over TLS (`krunbox::fuzzing::http_request`). Run with `cargo +nightly fuzz run http_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::http_request(data));
