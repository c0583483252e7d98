//! Filesystems mounted into the guest: the library's `MemoryFs` and `HostDir`, and the list
//! of mounts a definition or a boot takes.

use std::sync::Mutex;

use napi::bindgen_prelude::Buffer;
use napi_derive::napi;

use crate::errors::invalid;

/// A host-implemented filesystem to mount.
#[napi]
pub struct NativeFs {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Memory(krunbox::fs::MemoryFs),
    Host(krunbox::fs::HostDir),
}

fn fs_error(error: krunbox::fs::FsError, path: &str) -> napi::Error {
    let errno = error.errno();
    napi::Error::new(
        napi::Status::GenericFailure,
        format!(
            "[krunbox:Fs] {path}: {}",
            std::io::Error::from_raw_os_error(errno)
        ),
    )
}

#[napi]
impl NativeFs {
    /// An empty filesystem in this process's memory.
    #[napi(factory)]
    pub fn memory() -> Self {
        NativeFs {
            kind: Kind::Memory(krunbox::fs::MemoryFs::new()),
        }
    }

    /// The host directory `path`, which the guest can never reach outside of; read-only if
    /// asked.
    #[napi(factory)]
    pub fn host_dir(path: String, read_only: bool) -> napi::Result<Self> {
        let dir = if read_only {
            krunbox::fs::HostDir::read_only(&path)
        } else {
            krunbox::fs::HostDir::new(&path)
        }
        .map_err(|e| fs_error(e, &path))?;
        Ok(NativeFs {
            kind: Kind::Host(dir),
        })
    }

    fn memory_fs(&self) -> napi::Result<&krunbox::fs::MemoryFs> {
        match &self.kind {
            Kind::Memory(fs) => Ok(fs),
            Kind::Host(_) => Err(invalid("a host directory is read and written on the host")),
        }
    }

    /// Writes the file at `path` of a memory filesystem (its directories made as needed).
    #[napi]
    pub fn write_file(&self, path: String, data: Buffer) -> napi::Result<()> {
        let fs = self.memory_fs()?;
        if let Some((dir, _)) = path.rsplit_once('/') {
            if !dir.is_empty() {
                fs.create_dir_all(dir).map_err(|e| fs_error(e, dir))?;
            }
        }
        fs.write_file(&path, &data).map_err(|e| fs_error(e, &path))
    }

    /// The file at `path` of a memory filesystem, whole.
    #[napi]
    pub fn read_file(&self, path: String) -> napi::Result<Buffer> {
        let data = self
            .memory_fs()?
            .read_file(&path)
            .map_err(|e| fs_error(e, &path))?;
        Ok(data.into())
    }

    /// The names in the directory at `path` of a memory filesystem.
    #[napi]
    pub fn list_dir(&self, path: String) -> napi::Result<Vec<String>> {
        self.memory_fs()?
            .read_dir(&path)
            .map_err(|e| fs_error(e, &path))
    }
}

/// Mounts, in order: a definition's or a boot's.
#[napi]
#[derive(Default)]
pub struct NativeMounts {
    mounts: Mutex<Vec<(String, Kind, bool)>>,
}

#[napi]
impl NativeMounts {
    #[napi(constructor)]
    pub fn new() -> Self {
        NativeMounts::default()
    }

    /// Mounts `fs` at `guest_path`, read-only if asked.
    #[napi]
    pub fn add(&self, guest_path: String, fs: &NativeFs, read_only: bool) {
        self.mounts.lock().unwrap_or_else(|e| e.into_inner()).push((
            guest_path,
            fs.kind.clone(),
            read_only,
        ));
    }
}

/// What takes mounts: a sandbox's builder, a boot's options.
pub(crate) trait Mounts: Sized {
    fn mount_with(
        self,
        path: String,
        fs: impl krunbox::fs::VirtualFs,
        options: krunbox::fs::MountOptions,
    ) -> Self;

    /// `mounts` added, in order.
    fn with_mounts(self, mounts: Option<&NativeMounts>) -> Self {
        let Some(mounts) = mounts else {
            return self;
        };
        let mounts = mounts
            .mounts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        mounts.into_iter().fold(self, |to, (path, fs, read_only)| {
            let options = krunbox::fs::MountOptions::new();
            let options = if read_only {
                options.read_only()
            } else {
                options
            };
            match fs {
                Kind::Memory(fs) => to.mount_with(path, fs, options),
                Kind::Host(fs) => to.mount_with(path, fs, options),
            }
        })
    }
}

impl Mounts for krunbox::SandboxBuilder {
    fn mount_with(
        self,
        path: String,
        fs: impl krunbox::fs::VirtualFs,
        options: krunbox::fs::MountOptions,
    ) -> Self {
        krunbox::SandboxBuilder::mount_with(self, path, fs, options)
    }
}

impl Mounts for krunbox::BootOptions {
    fn mount_with(
        self,
        path: String,
        fs: impl krunbox::fs::VirtualFs,
        options: krunbox::fs::MountOptions,
    ) -> Self {
        krunbox::BootOptions::mount_with(self, path, fs, options)
    }
}
