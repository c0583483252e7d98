//! Filesystems mounted into the guest: the library's `MemoryFs` and `HostDir`, one written in
//! JavaScript (path-based, served by the library's `ByPath`), and the list of mounts a
//! definition or a boot takes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use krunbox::fs::{FileKind, FsError, FsResult, PathFs, PathStat, MAX_LISTED};
use napi::bindgen_prelude::{Buffer, Function, Promise};
use napi_derive::napi;

use crate::callback::{calls_bound, Callback};
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
    /// Each mount made of it (a boot's, or a definition's, which its boots share) gets an
    /// inode table of its own, all sharing its callback and the bound of calls into it.
    JavaScript(JsFs),
}

/// A host-side filesystem's error (a `MemoryFs` read here, a `HostDir` opened): the host's I/O,
/// not the guest's.
fn fs_error(error: krunbox::fs::FsError, path: &str) -> napi::Error {
    let errno = error.errno();
    napi::Error::new(
        napi::Status::GenericFailure,
        format!(
            "[krunbox:Io] {path}: {}",
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

    /// A filesystem written in JavaScript: `call` does each operation on a path.
    #[napi(factory)]
    pub fn javascript(call: Function<'_, FsCall, Promise<FsReply>>) -> napi::Result<Self> {
        let fs = JsFs {
            call: Arc::new(Callback::new(&call, calls_bound())?),
        };
        Ok(NativeFs {
            kind: Kind::JavaScript(fs),
        })
    }

    fn memory_fs(&self) -> napi::Result<&krunbox::fs::MemoryFs> {
        match &self.kind {
            Kind::Memory(fs) => Ok(fs),
            _ => Err(invalid(
                "only a memory filesystem is read and written through it",
            )),
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
                Kind::JavaScript(fs) => to.mount_with(path, krunbox::fs::ByPath::new(fs), options),
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

/// One call into a JavaScript filesystem.
#[napi(object)]
pub struct FsCall {
    /// "stat", "listDir", "read", "write", "create", "makeDir", "remove", "removeDir",
    /// "rename", "truncate" or "readLink".
    pub op: String,
    pub path: String,
    /// "rename": where to.
    pub to: Option<String>,
    /// "read", "write": where in the file.
    pub offset: Option<f64>,
    /// "read": how many bytes at most; "truncate": the new size.
    pub size: Option<f64>,
    /// "write": the bytes.
    pub data: Option<Buffer>,
    /// "create", "makeDir": permission bits.
    pub mode: Option<u32>,
}

/// What a path is, as a JavaScript filesystem says.
#[napi(object)]
pub struct FsStat {
    /// "file", "dir" or "symlink".
    pub kind: String,
    pub size: Option<f64>,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Last modification, in milliseconds since the epoch.
    pub mtime_ms: Option<f64>,
}

/// A JavaScript filesystem's answer: an errno, or what the operation gives.
#[napi(object)]
pub struct FsReply {
    /// The error the guest gets (ENOENT, EACCES, ...), as its number.
    pub errno: Option<i32>,
    pub stat: Option<FsStat>,
    pub names: Option<Vec<String>>,
    pub data: Option<Buffer>,
    /// "write": how many bytes it wrote (all of them when not given).
    pub written: Option<f64>,
    /// "readLink": the target.
    pub target: Option<String>,
}

/// A filesystem written in JavaScript as the library's `PathFs`. An errno in its answer goes
/// to the guest as it is; a throw or rejection (reported in TypeScript) is `EIO`.
#[derive(Clone)]
struct JsFs {
    call: Arc<Callback<FsCall, FsReply>>,
}

fn op(op: &str, path: &str) -> FsCall {
    FsCall {
        op: op.into(),
        path: path.into(),
        to: None,
        offset: None,
        size: None,
        data: None,
        mode: None,
    }
}

impl JsFs {
    async fn ask(&self, call: FsCall) -> FsResult<FsReply> {
        let reply = self.call.call(call).await.map_err(|_| FsError::IO)?;
        match reply.errno {
            Some(errno) if (1..4096).contains(&errno) => Err(FsError::from_errno(errno)),
            Some(_) => Err(FsError::IO),
            None => Ok(reply),
        }
    }
}

fn path_stat(stat: FsStat) -> FsResult<PathStat> {
    let kind = match stat.kind.as_str() {
        "dir" => FileKind::Directory,
        "symlink" => FileKind::Symlink,
        "file" => FileKind::File,
        _ => return Err(FsError::IO),
    };
    let mut made = PathStat::new(kind, 0);
    if let Some(size) = stat.size {
        made.size = count(size)?;
    }
    if let Some(mode) = stat.mode {
        made.mode = mode & 0o7777;
    }
    made.uid = stat.uid.unwrap_or(0);
    made.gid = stat.gid.unwrap_or(0);
    if let Some(ms) = stat.mtime_ms.filter(|ms| ms.is_finite() && *ms >= 0.0) {
        made.mtime = UNIX_EPOCH + Duration::from_secs_f64(ms.min(1e14) / 1000.0);
    } else {
        made.mtime = SystemTime::UNIX_EPOCH;
    }
    Ok(made)
}

/// The largest offset or size a JavaScript number holds exactly (2^53).
const EXACT: u64 = 1 << 53;

/// A byte count or offset from JavaScript: a whole number from 0 to 2^53.
fn count(value: f64) -> FsResult<u64> {
    if value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value <= EXACT as f64 {
        Ok(value as u64)
    } else {
        Err(FsError::IO)
    }
}

/// An offset or size from the guest as a JavaScript number: `EFBIG` past 2^53, which a number
/// cannot hold exactly.
fn number(value: u64) -> FsResult<f64> {
    if value <= EXACT {
        Ok(value as f64)
    } else {
        Err(FsError::TOO_BIG)
    }
}

#[krunbox::fs::async_trait]
impl PathFs for JsFs {
    async fn stat(&self, path: &str) -> FsResult<PathStat> {
        path_stat(self.ask(op("stat", path)).await?.stat.ok_or(FsError::IO)?)
    }

    async fn list_dir(&self, path: &str) -> FsResult<Vec<String>> {
        let names = self
            .ask(op("listDir", path))
            .await?
            .names
            .unwrap_or_default();
        if names.len() > MAX_LISTED {
            return Err(FsError::IO);
        }
        Ok(names)
    }

    async fn read(&self, path: &str, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let call = FsCall {
            offset: Some(number(offset)?),
            size: Some(f64::from(size)),
            ..op("read", path)
        };
        let mut data = self
            .ask(call)
            .await?
            .data
            .map(|d| d.to_vec())
            .unwrap_or_default();
        data.truncate(size as usize);
        Ok(data)
    }

    async fn write(&self, path: &str, offset: u64, data: &[u8]) -> FsResult<u32> {
        let call = FsCall {
            offset: Some(number(offset)?),
            data: Some(data.to_vec().into()),
            ..op("write", path)
        };
        let all = data.len() as u32;
        match self.ask(call).await?.written {
            None => Ok(all),
            Some(n) => Ok(count(n)?.min(u64::from(all)) as u32),
        }
    }

    async fn create(&self, path: &str, mode: u32) -> FsResult<()> {
        self.ask(FsCall {
            mode: Some(mode),
            ..op("create", path)
        })
        .await
        .map(drop)
    }

    async fn make_dir(&self, path: &str, mode: u32) -> FsResult<()> {
        self.ask(FsCall {
            mode: Some(mode),
            ..op("makeDir", path)
        })
        .await
        .map(drop)
    }

    async fn remove(&self, path: &str) -> FsResult<()> {
        self.ask(op("remove", path)).await.map(drop)
    }

    async fn remove_dir(&self, path: &str) -> FsResult<()> {
        self.ask(op("removeDir", path)).await.map(drop)
    }

    async fn rename(&self, from: &str, to: &str) -> FsResult<()> {
        self.ask(FsCall {
            to: Some(to.into()),
            ..op("rename", from)
        })
        .await
        .map(drop)
    }

    async fn truncate(&self, path: &str, size: u64) -> FsResult<()> {
        self.ask(FsCall {
            size: Some(number(size)?),
            ..op("truncate", path)
        })
        .await
        .map(drop)
    }

    async fn read_link(&self, path: &str) -> FsResult<String> {
        self.ask(op("readLink", path))
            .await?
            .target
            .ok_or(FsError::IO)
    }
}
