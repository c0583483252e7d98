//! Where guest memory lies in the file the library made for it (the library's
//! `guest_memory.rs`): what the helper reports when it hands a device's queues over, and what
//! the library checks before it maps anything.

/// The most regions a handed-over layout may name (libkrun's x86-64 guests have three or
/// four: below the kernel, the kernel, after it, and past the 32-bit gap).
pub const MAX_REGIONS: usize = 8;

/// One region of guest memory: `len` bytes at guest address `guest_address`, kept at
/// `file_offset` in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Where the region starts in the guest's physical address space.
    pub guest_address: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where it starts in the file.
    pub file_offset: u64,
}
