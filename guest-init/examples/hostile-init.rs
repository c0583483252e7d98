//! A deliberately hostile guest init, for krunbox's tests: it connects to the control port like
//! guest-init and then sends bytes that are not a valid hello, to prove the host turns hostile
//! input into a typed error rather than a hang or a panic.
//!
//! The mode comes from the kernel command line / environment `KRUNBOX_HOSTILE` (default
//! `garbage`): `garbage` sends random-looking bytes; `oversized` sends a header announcing a
//! 4 GiB frame.

use std::io::Write;
use std::time::Duration;

fn main() {
    let mode = std::env::var("KRUNBOX_HOSTILE").unwrap_or_else(|_| "garbage".into());
    if let Ok(mut conn) =
        guest_init::vsock::connect_host(krunbox_protocol::CONTROL_PORT, Duration::from_secs(10))
    {
        let bytes: Vec<u8> = match mode.as_str() {
            "oversized" => vec![0xff, 0xff, 0xff, 0xff, 101, 0],
            _ => (0..4096u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                .collect(),
        };
        let _ = conn.write_all(&bytes);
        std::thread::sleep(Duration::from_secs(30));
    }
    guest_init::sys::power_off();
}
