//! Filesystems mounted into the guest: the library's `MemoryFs` and `HostDir`, and
//! filesystems written in Python (`krunbox.VirtualFs`).

mod python_fs;

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::callback::EventLoop;
use crate::errors::InvalidConfig;

/// The bytes a callback returned: `bytes` or `bytearray` (a `memoryview` is refused: the stable
/// ABI before 3.11 has no buffer protocol).
pub(crate) fn bytes_of(value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    if let Ok(array) = value.cast::<pyo3::types::PyByteArray>() {
        return Ok(array.to_vec());
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "expected bytes or bytearray, got {}",
        value.get_type().name()?
    )))
}

/// An `FsError` as Python's `OSError` of that errno.
fn os_error(error: krunbox::fs::FsError, path: &str) -> PyErr {
    let errno = error.errno();
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    PyOSError::new_err((errno, text, path.to_owned()))
}

/// What a `VirtualFs` written in Python says of a path (its `stat` returns one).
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Stat {
    /// "file", "dir" or "symlink".
    #[pyo3(name = "type")]
    kind: &'static str,
    size: u64,
    mode: u32,
    mtime: f64,
    uid: u32,
    gid: u32,
}

#[pymethods]
impl Stat {
    #[new]
    #[pyo3(signature = (r#type = "file", *, size = 0, mode = None, mtime = 0.0, uid = 0, gid = 0))]
    fn new(
        r#type: &str,
        size: u64,
        mode: Option<u32>,
        mtime: f64,
        uid: u32,
        gid: u32,
    ) -> PyResult<Self> {
        let (kind, default_mode) = match r#type {
            "file" => ("file", 0o644),
            "dir" => ("dir", 0o755),
            "symlink" => ("symlink", 0o777),
            other => {
                return Err(InvalidConfig::new_err(format!(
                    "{other:?} is no file type: say \"file\", \"dir\" or \"symlink\""
                )))
            }
        };
        Ok(Stat {
            kind,
            size,
            mode: mode.unwrap_or(default_mode),
            mtime,
            uid,
            gid,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Stat({:?}, size={}, mode=0o{:o})",
            self.kind, self.size, self.mode
        )
    }
}

/// A filesystem held in this process's memory, shared with the guests it is mounted in:
/// what the host writes they see, and the other way round.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct MemoryFs(krunbox::fs::MemoryFs);

#[pymethods]
impl MemoryFs {
    #[new]
    fn new() -> Self {
        MemoryFs(krunbox::fs::MemoryFs::new())
    }

    /// Writes the file at `path` (its directories made as needed).
    fn write_file(&self, path: &str, data: &[u8]) -> PyResult<()> {
        if let Some((dir, _)) = path.rsplit_once('/') {
            if !dir.is_empty() {
                self.0.create_dir_all(dir).map_err(|e| os_error(e, dir))?;
            }
        }
        self.0.write_file(path, data).map_err(|e| os_error(e, path))
    }

    /// The file at `path`, whole.
    fn read_file<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.0.read_file(path).map_err(|e| os_error(e, path))?;
        Ok(PyBytes::new(py, &data))
    }

    /// The names in the directory at `path`.
    fn list_dir(&self, path: &str) -> PyResult<Vec<String>> {
        self.0.read_dir(path).map_err(|e| os_error(e, path))
    }
}

/// A directory of the host's, mounted so the guest can never reach outside it.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct HostDir(krunbox::fs::HostDir);

#[pymethods]
impl HostDir {
    /// `path` on the host; `read_only` refuses the guest's writes; `hide` are paths inside it
    /// the guest does not see (`.env`, `.git`), and what the guest makes there goes to
    /// `hidden_store` (a host directory), or nowhere without one.
    #[new]
    #[pyo3(signature = (path, *, read_only = false, hide = Vec::new(), hidden_store = None))]
    fn new(
        path: PathBuf,
        read_only: bool,
        hide: Vec<PathBuf>,
        hidden_store: Option<PathBuf>,
    ) -> PyResult<Self> {
        let shown = path.display().to_string();
        let dir = if read_only {
            krunbox::fs::HostDir::read_only(&path)
        } else {
            krunbox::fs::HostDir::new(&path)
        }
        .map_err(|e| os_error(e, &shown))?;
        if hide.is_empty() {
            if hidden_store.is_some() {
                return Err(InvalidConfig::new_err(
                    "hidden_store= keeps what the guest makes at hidden paths: name them in hide=",
                ));
            }
            return Ok(HostDir(dir));
        }
        let mut mask = krunbox::fs::Mask::hide(hide);
        if let Some(store) = hidden_store {
            mask = mask.stored_in(store);
        }
        dir.with_mask(mask)
            .map(HostDir)
            .map_err(crate::errors::to_py)
    }
}

/// One mount's filesystem, of whichever kind it was given as.
pub(crate) enum MountFs {
    Memory(krunbox::fs::MemoryFs),
    Host(krunbox::fs::HostDir),
    Python(Box<krunbox::fs::ByPath<python_fs::PythonFs>>),
}

/// A mount: the guest path, its filesystem, its options.
pub(crate) struct Mount(String, MountFs, krunbox::fs::MountOptions);

/// What takes mounts: a sandbox's builder, a boot's options.
pub(crate) trait Mounts: Sized {
    fn mount_with(
        self,
        path: String,
        fs: impl krunbox::fs::VirtualFs,
        options: krunbox::fs::MountOptions,
    ) -> Self;

    /// `mounts` added, in order.
    fn with_mounts(self, mounts: Vec<Mount>) -> Self {
        mounts
            .into_iter()
            .fold(self, |to, Mount(path, fs, options)| match fs {
                MountFs::Memory(fs) => to.mount_with(path, fs, options),
                MountFs::Host(fs) => to.mount_with(path, fs, options),
                MountFs::Python(fs) => to.mount_with(path, *fs, options),
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

/// The mounts of a sandbox or a boot: each guest path and its filesystem (a `MemoryFs`, a
/// `HostDir`, or a Python object with the `VirtualFs` methods, read-only when its
/// `read_only` is true).
pub(crate) fn mounts(
    given: Vec<(String, Bound<'_, PyAny>)>,
    event_loop: &Arc<EventLoop>,
) -> PyResult<Vec<Mount>> {
    given
        .into_iter()
        .map(|(guest_path, fs)| {
            let options = krunbox::fs::MountOptions::new();
            if let Ok(memory) = fs.cast::<MemoryFs>() {
                return Ok(Mount(
                    guest_path,
                    MountFs::Memory(memory.get().0.clone()),
                    options,
                ));
            }
            if let Ok(host) = fs.cast::<HostDir>() {
                return Ok(Mount(
                    guest_path,
                    MountFs::Host(host.get().0.clone()),
                    options,
                ));
            }
            if !fs.hasattr("stat")? {
                return Err(InvalidConfig::new_err(format!(
                    "the mount at {guest_path:?} is not a filesystem: give a MemoryFs, a HostDir \
                     or a krunbox.VirtualFs"
                )));
            }
            let read_only = match fs.getattr("read_only") {
                Ok(flag) => flag.is_truthy()?,
                Err(_) => false,
            };
            let options = if read_only {
                options.read_only()
            } else {
                options
            };
            let fs = MountFs::Python(Box::new(krunbox::fs::ByPath::new(
                python_fs::PythonFs::new(&fs, event_loop),
            )));
            Ok(Mount(guest_path, fs, options))
        })
        .collect()
}

/// Registers the filesystem classes in the module.
pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Stat>()?;
    module.add_class::<MemoryFs>()?;
    module.add_class::<HostDir>()?;
    Ok(())
}
