//! libkrunfw's guest kernel, read the way libkrun reads it, for tests that must tell which
//! kernel a VM booted.

// Each test binary that includes this module uses a different part of it.
#![allow(dead_code)]

/// libkrunfw's kernel as the memory image libkrun loads: (load address, entry point, bytes),
/// through libkrunfw's own accessor.
pub fn libkrunfw_kernel() -> (u64, u64, Vec<u8>) {
    use std::os::unix::ffi::OsStrExt;
    let dir = krunbox::Artifacts::locate().unwrap().libkrunfw_dir;
    let path = std::ffi::CString::new(dir.join("libkrunfw.so.5").as_os_str().as_bytes()).unwrap();
    type GetKernel = unsafe extern "C" fn(*mut u64, *mut u64, *mut usize) -> *const u8;
    // SAFETY: libkrunfw's C API: `krunfw_get_kernel(&load, &entry, &size)` returns a pointer to
    // `size` bytes that live as long as the library stays loaded; they are copied out before
    // dlclose.
    unsafe {
        let lib = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!lib.is_null(), "dlopen {path:?} failed");
        let sym = libc::dlsym(lib, c"krunfw_get_kernel".as_ptr());
        assert!(!sym.is_null(), "libkrunfw has no krunfw_get_kernel");
        let get_kernel: GetKernel = std::mem::transmute(sym);
        let (mut load, mut entry, mut size) = (0u64, 0u64, 0usize);
        let bytes = get_kernel(&mut load, &mut entry, &mut size);
        assert!(!bytes.is_null() && size > 0);
        let image = std::slice::from_raw_parts(bytes, size).to_vec();
        libc::dlclose(lib);
        (load, entry, image)
    }
}

/// Length of each field of the kernel's `struct new_utsname` (sysname, nodename, release, ...).
const UTS_FIELD: usize = 65;

/// Where the kernel image holds its initial `struct new_utsname` ("Linux", "(none)", release):
/// the offsets of every copy's release field.
pub fn utsname_release_offsets(image: &[u8]) -> Vec<usize> {
    let mut found = Vec::new();
    let mut at = 0;
    // Scanning for the first byte first keeps this fast in an unoptimised test build.
    while let Some(step) = image[at..].iter().position(|&b| b == b'L') {
        at += step;
        let Some(uts) = image.get(at..at + 3 * UTS_FIELD) else {
            break;
        };
        if uts.starts_with(b"Linux\0")
            && uts[6..UTS_FIELD].iter().all(|&b| b == 0)
            && uts[UTS_FIELD..].starts_with(b"(none)\0")
        {
            found.push(at + 2 * UTS_FIELD);
        }
        at += 1;
    }
    found
}

/// The release string at a release field's offset.
pub fn release_at(image: &[u8], offset: usize) -> String {
    let field = &image[offset..offset + UTS_FIELD];
    let len = field.iter().position(|&b| b == 0).unwrap_or(UTS_FIELD);
    String::from_utf8(field[..len].to_vec()).expect("a kernel release is text")
}

/// libkrunfw's kernel release, read from its image.
pub fn libkrunfw_release() -> String {
    let (_, _, image) = libkrunfw_kernel();
    let offsets = utsname_release_offsets(&image);
    assert!(!offsets.is_empty(), "no utsname in libkrunfw's kernel");
    release_at(&image, offsets[0])
}

/// An ELF executable with one loadable segment holding `image` at physical address `load`,
/// entered at `entry`: how libkrun's ELF loader wants an x86-64 kernel.
pub fn elf_kernel(load: u64, entry: u64, image: &[u8]) -> Vec<u8> {
    const DATA_OFFSET: u64 = 4096;
    let mut elf = Vec::with_capacity(DATA_OFFSET as usize + image.len());
    elf.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0"); // 64-bit, little-endian
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    elf.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    elf.extend_from_slice(&entry.to_le_bytes());
    elf.extend_from_slice(&64u64.to_le_bytes()); // program headers right after this header
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes()); // flags
    for half in [64u16, 56, 1, 64, 0, 0] {
        // header size, program header size and count, section header size, count, names
        elf.extend_from_slice(&half.to_le_bytes());
    }
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&7u32.to_le_bytes()); // rwx
    let len = image.len() as u64;
    for word in [DATA_OFFSET, load, load, len, len, 4096] {
        // offset, virtual and physical address, size in the file and in memory, alignment
        elf.extend_from_slice(&word.to_le_bytes());
    }
    elf.resize(DATA_OFFSET as usize, 0);
    elf.extend_from_slice(image);
    elf
}
