//! guest-init's entry point: see the library docs for the boot sequence.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::mpsc::sync_channel;
use std::time::Duration;

use guest_init::outbox::Outbox;
use guest_init::supervisor::{self, Reaper, Table};
use guest_init::{files, host_fs, identity, mounts, net, sys, trust, vsock};
use krunbox_protocol::{
    Failure, FrameDecoder, GuestMessage, Hello, HostMessage, CONTROL_PORT, PROTOCOL_VERSION,
};

/// Frames queued for the host before output readers block (backpressure).
const OUTBOX_DEPTH: usize = 64;

/// Bytes read from the control connection at once.
const READ_BUFFER: usize = 256 * 1024;

fn main() {
    // Everything below reports to the console (the host keeps it as the VM's log) and powers
    // off on failure: PID 1 exiting would panic the kernel, which says nothing useful.
    if let Err(err) = run() {
        eprintln!("guest-init: {err}");
        // The console is drained asynchronously by the VMM: give it a moment, or the one line
        // that explains the failure is lost with the VM.
        std::thread::sleep(Duration::from_millis(300));
    }
    sys::power_off();
}

fn run() -> Result<(), String> {
    // Two breadcrumbs on the console (kept in the host's instance log): they tell a boot that
    // never reached guest-init from one that never reached the host.
    eprintln!("guest-init: started");
    let reaper = Reaper::start().map_err(|e| format!("reaper: {e}"))?;
    mounts::mount_early().map_err(|e| format!("early mounts: {e}"))?;

    // Patient: under nested emulation with several VMs booting, the host can take long to
    // answer. The host owns the boot deadline and kills the VM when it passes.
    let conn = vsock::connect_host(CONTROL_PORT, Duration::from_secs(600))
        .map_err(|e| format!("connecting to the host on vsock port {CONTROL_PORT}: {e}"))?;
    eprintln!("guest-init: connected to the host");
    let mut reader = conn.try_clone().map_err(|e| format!("dup: {e}"))?;
    let outbox = start_writer(conn)?;

    outbox.send(&GuestMessage::Hello(Hello {
        version: PROTOCOL_VERSION,
        guest_init: env!("CARGO_PKG_VERSION").into(),
        kernel_release: sys::kernel_release(),
    }));

    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_BUFFER];
    let setup = match next_message(&mut reader, &mut decoder, &mut buf)? {
        HostMessage::Setup(setup) => setup,
        other => return Err(format!("expected Setup from the host, got {other:?}")),
    };
    let mount_points: Vec<&str> = setup.mounts.iter().map(|m| m.path.as_str()).collect();
    let ca = setup
        .network
        .as_ref()
        .and_then(|n| n.ca_certificate.as_deref());
    let bound_files: Vec<&str> = identity::BOUND_FILES
        .iter()
        .chain(trust::bound_files(ca.is_some()))
        .copied()
        .collect();
    let writable_root = setup.root.writable_layer.is_some();
    let setup_result = mounts::switch_root(&setup.root, &mount_points, &bound_files)
        .map_err(|e| format!("switching to root {}: {e}", setup.root.device))
        .and_then(|()| identity::set_up(&setup.hostname).map_err(|e| e.to_string()))
        .and_then(|()| match &setup.network {
            Some(network) => net::configure(network)
                .map(|name| eprintln!("guest-init: network on {name}"))
                .map_err(|e| format!("configuring the network: {e}")),
            None => Ok(()),
        })
        .map(|()| {
            // Best effort, as the rest of a normal system: a guest whose image keeps no CA
            // bundle where it can go boots, and its TLS clients then say so.
            if let Err(e) = trust::install(ca, writable_root) {
                eprintln!("guest-init: installing the sandbox CA: {e}");
            }
        })
        .and_then(|()| host_fs::mount_all(&setup.mounts));
    if let Err(message) = setup_result {
        outbox.send(&GuestMessage::SetupFailed(Failure {
            message: message.clone(),
        }));
        // Give the writer a moment to flush the report before power-off.
        std::thread::sleep(Duration::from_millis(100));
        return Err(message);
    }
    outbox.send(&GuestMessage::Ready);

    let table = Table::default();
    loop {
        match next_message(&mut reader, &mut decoder, &mut buf)? {
            HostMessage::Exec(exec) => supervisor::start(exec, &reaper, &table, &outbox),
            HostMessage::Signal(sig) => table.signal(sig.id, sig.signal),
            HostMessage::Stdin(data) => table.stdin(data.id, data.data.into_vec()),
            HostMessage::CloseStdin(p) => table.close_stdin(p.id),
            HostMessage::Credit(credit) => table.credit(credit.id, credit.stream, credit.bytes),
            HostMessage::Resize(resize) => table.resize(resize.id, resize.size),
            HostMessage::Fs(request) => files::handle(request, &outbox),
            HostMessage::Ping(ping) => {
                outbox.pong(ping.seq);
            }
            HostMessage::Shutdown => return Ok(()),
            HostMessage::Setup(_) => return Err("Setup sent twice".into()),
        }
    }
}

/// One writer thread owns the socket's write half; everyone else queues frames to it. A pong
/// (the answer to the host's liveness ping) jumps the queue: it is written before the next
/// queued frame, so it never waits behind more than the frame being written.
fn start_writer(mut conn: File) -> Result<Outbox, String> {
    let (tx, rx) = sync_channel::<Vec<u8>>(OUTBOX_DEPTH);
    let (outbox, pong_slot) = Outbox::new(tx);
    std::thread::Builder::new()
        .name("writer".into())
        .spawn(move || {
            for frame in rx {
                // An empty frame only wakes the writer for a pong.
                let pong = pong_slot.take();
                for bytes in pong.iter().chain(Some(&frame).filter(|f| !f.is_empty())) {
                    if let Err(err) = conn.write_all(bytes) {
                        eprintln!("guest-init: host connection lost while writing: {err}");
                        std::thread::sleep(Duration::from_millis(300));
                        sys::power_off();
                    }
                }
            }
        })
        .map_err(|e| format!("writer thread: {e}"))?;
    Ok(outbox)
}

/// Reads until one whole, valid host message is decoded. Any protocol error or EOF ends the
/// session: a host that sends garbage is not trusted to send anything else.
fn next_message(
    reader: &mut File,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<HostMessage, String> {
    loop {
        if let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
            return HostMessage::decode(&frame).map_err(|e| e.to_string());
        }
        let want = buf.len();
        let n = reader
            .read(&mut buf[..want])
            .map_err(|e| format!("reading from host: {e}"))?;
        if n == 0 {
            decoder.finish().map_err(|e| e.to_string())?;
            return Err("the host closed the control connection".into());
        }
        decoder.push(&buf[..n]).map_err(|e| e.to_string())?;
    }
}
