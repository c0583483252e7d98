//! guest-init's entry point: see the library docs for the boot sequence.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::time::Duration;

use guest_init::outbox::{Outbox, Outgoing};
use guest_init::supervisor::{self, Reaper, Table};
use guest_init::{files, host_fs, identity, mounts, net, sys, trust, vsock};
use krunbox_protocol::{
    Failure, FrameDecoder, GuestMessage, Hello, HostMessage, Rejoin, CONTROL_PORT, PROTOCOL_VERSION,
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
    // The writer's next connection after a quiesce: `None` goes on with the same one.
    let (resume_writer, writer_resumes) = sync_channel::<Option<File>>(1);
    let outbox = start_writer(conn, writer_resumes)?;

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
    // The token of the host's last quiesce, until it resumes the channel.
    let mut quiesced: Option<u64> = None;
    loop {
        let message = match read_message(&mut reader, &mut decoder, &mut buf)? {
            Some(message) => message,
            None => match quiesced.take() {
                // The connection broke while still: this is a copy restored from a
                // snapshot, whose new VMM reset every vsock connection. Join the new host.
                Some(token) => {
                    eprintln!("guest-init: the host connection broke while quiesced; rejoining");
                    reader = rejoin(token, &resume_writer, &mut decoder, &mut buf)?;
                    continue;
                }
                None => return Err("the host closed the control connection".into()),
            },
        };
        match message {
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
            HostMessage::Quiesce(quiesce) => {
                outbox.quiesce(&GuestMessage::Quiesced(quiesce));
                quiesced = Some(quiesce.token);
            }
            HostMessage::Resume(resume) if quiesced.take().is_some() => {
                set_wall_clock(resume.unix_time_ns);
                // The writer goes on with the same connection.
                let _ = resume_writer.send(None);
            }
            HostMessage::Resume(_) => return Err("Resume without a quiesce".into()),
            HostMessage::Shutdown => return Ok(()),
            HostMessage::Setup(_) => return Err("Setup sent twice".into()),
        }
    }
}

/// Connects to the host again after a quiesced connection broke: `Rejoin` with the quiesce's
/// token first, then the host's `Resume`; the writer then goes on with the new connection,
/// with what was queued meanwhile. Returns the new connection's read half.
fn rejoin(
    token: u64,
    resume_writer: &SyncSender<Option<File>>,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<File, String> {
    let mut conn = vsock::connect_host(CONTROL_PORT, Duration::from_secs(600))
        .map_err(|e| format!("connecting to the host again on vsock port {CONTROL_PORT}: {e}"))?;
    let rejoin = GuestMessage::Rejoin(Rejoin {
        version: PROTOCOL_VERSION,
        token,
    });
    let bytes = rejoin.encode().map_err(|e| e.to_string())?;
    conn.write_all(&bytes)
        .map_err(|e| format!("rejoining the host: {e}"))?;
    let mut reader = conn.try_clone().map_err(|e| format!("dup: {e}"))?;
    *decoder = FrameDecoder::new();
    match read_message(&mut reader, decoder, buf)? {
        Some(HostMessage::Resume(resume)) => set_wall_clock(resume.unix_time_ns),
        Some(other) => return Err(format!("expected Resume after Rejoin, got {other:?}")),
        None => return Err("the host closed the connection it was rejoined on".into()),
    }
    resume_writer
        .send(Some(conn))
        .map_err(|_| "the writer thread is gone".to_string())?;
    eprintln!("guest-init: rejoined the host");
    Ok(reader)
}

/// Sets the wall clock to the host's (a snapshotted guest's clocks stood still while its state
/// was saved). Best effort: a guest with a stale clock still works.
fn set_wall_clock(unix_time_ns: u64) {
    let time = libc::timespec {
        tv_sec: (unix_time_ns / 1_000_000_000) as _,
        tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime reads a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        eprintln!(
            "guest-init: setting the clock: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// One writer thread owns the socket's write half; everyone else queues frames to it. A pong
/// (the answer to the host's liveness ping) jumps the queue: it is written before the next
/// queued frame, so it never waits behind more than the frame being written.
fn start_writer(mut conn: File, resumes: Receiver<Option<File>>) -> Result<Outbox, String> {
    let (tx, rx) = sync_channel::<Outgoing>(OUTBOX_DEPTH);
    let (outbox, pong_slot) = Outbox::new(tx);
    std::thread::Builder::new()
        .name("writer".into())
        .spawn(move || {
            for item in rx {
                let (frame, last) = match item {
                    Outgoing::Frame(frame) => (frame, false),
                    Outgoing::Last(frame) => (frame, true),
                };
                // An empty frame only wakes the writer for a pong.
                let pong = pong_slot.take();
                for bytes in pong.iter().chain(Some(&frame).filter(|f| !f.is_empty())) {
                    if let Err(err) = conn.write_all(bytes) {
                        eprintln!("guest-init: host connection lost while writing: {err}");
                        std::thread::sleep(Duration::from_millis(300));
                        sys::power_off();
                    }
                }
                if last {
                    // Quiesced: nothing more until the host resumes, on this connection or
                    // (a restored copy) a new one. A ping from before is answered by now.
                    match resumes.recv() {
                        Ok(None) => {}
                        Ok(Some(new)) => conn = new,
                        Err(_) => return,
                    }
                    pong_slot.take();
                }
            }
        })
        .map_err(|e| format!("writer thread: {e}"))?;
    Ok(outbox)
}

/// Reads until one whole, valid host message is decoded. Any protocol error ends the session
/// (a host that sends garbage is not trusted to send anything else); `None` when the
/// connection ended or broke.
fn read_message(
    reader: &mut File,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<Option<HostMessage>, String> {
    loop {
        if let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
            return HostMessage::decode(&frame)
                .map(Some)
                .map_err(|e| e.to_string());
        }
        let want = buf.len();
        match reader.read(&mut buf[..want]) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => decoder.push(&buf[..n]).map_err(|e| e.to_string())?,
        }
    }
}

/// [`read_message`] where the connection must go on: its end is an error.
fn next_message(
    reader: &mut File,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<HostMessage, String> {
    read_message(reader, decoder, buf)?
        .ok_or_else(|| "the host closed the control connection".to_string())
}
