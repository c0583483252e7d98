//! A hostile guest against the host's real handling of its messages: the control channel's
//! reader and dispatch, flow control, liveness check and handshake, with processes, stdin and
//! file requests outstanding on the host side. The input is a script of guest writes and host
//! actions (`krunbox::fuzzing`, which documents the checked properties). Run with
//! `cargo +nightly fuzz run host_dispatch`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(krunbox::fuzzing::host_dispatch(data));
});
