//! Loop devices: a file as a block device, for a writable layer the host serves as a file.
//!
//! The libc crate does not define the loop ioctls, so their numbers and the `loop_config`
//! structure are written here from the kernel's UAPI header (`linux/loop.h`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// The loop device reads and writes its file with direct I/O: no second copy of each block in
/// the guest's page cache (the filesystem on the device has its own).
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Attaches `path` (opened read-write) to a free loop device with 4 KiB logical blocks and
/// returns the device's path. The device keeps the file open; nothing here detaches it (it
/// lives as long as the guest).
pub fn attach(path: &str) -> io::Result<String> {
    let context = |what: &str| {
        let what = what.to_string();
        move |e: io::Error| io::Error::new(e.kind(), format!("{what}: {e}"))
    };
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(context(&format!("opening {path}")))?;
    let control = File::open("/dev/loop-control").map_err(context("opening /dev/loop-control"))?;
    // SAFETY: an ioctl without arguments on a descriptor we own.
    let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
    if number < 0 {
        return Err(context("finding a free loop device")(
            io::Error::last_os_error(),
        ));
    }
    let device_path = format!("/dev/loop{number}");
    let device = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&device_path)
        .map_err(context(&format!("opening {device_path}")))?;
    let configure = |flags: u32| {
        // SAFETY: all-zero bytes are a valid value of these plain C structures.
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = backing.as_raw_fd() as u32;
        config.block_size = 4096;
        config.info.lo_flags = flags;
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which `config` is, laid out as C.
        let result = unsafe {
            libc::ioctl(
                device.as_raw_fd(),
                LOOP_CONFIGURE as _,
                &config as *const LoopConfig,
            )
        };
        if result < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // A kernel that cannot do direct I/O on the file refuses the flag: buffered I/O works too.
    configure(LO_FLAGS_DIRECT_IO)
        .or_else(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => configure(0),
            _ => Err(e),
        })
        .map_err(context(&format!("attaching {path} to {device_path}")))?;
    Ok(device_path)
}
