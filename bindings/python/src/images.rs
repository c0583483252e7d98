//! OCI images from Python: imported from an archive (`docker save`, an OCI layout as a tar) or
//! pulled from a registry into a local store, and booted as a `Rootfs`.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::rootfs::Rootfs;
use crate::runtime::{awaitable, block_on};

/// A local store of OCI images, by name.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Images(krunbox::image::oci::LocalImages);

/// An image in the store: its root filesystem and its configuration.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Image(krunbox::image::oci::OciImage);

#[pymethods]
impl Image {
    /// The image as a read-only root (`Rootfs`; make it writable with `Rootfs.ephemeral` and
    /// the others).
    #[getter]
    fn rootfs(&self) -> Rootfs {
        Rootfs::ready(self.0.rootfs())
    }

    /// The image's configuration: `entrypoint`, `cmd`, `env` (a dict), `working_dir`,
    /// `user` (`(uid, gid)`), as its config blob gives them.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let config = &self.0.config;
        let dict = pyo3::types::PyDict::new(py);
        dict.set_item("entrypoint", &config.entrypoint)?;
        dict.set_item("cmd", &config.cmd)?;
        let env = pyo3::types::PyDict::new(py);
        for (key, value) in &config.env {
            env.set_item(key, value)?;
        }
        dict.set_item("env", env)?;
        dict.set_item("working_dir", &config.working_dir)?;
        dict.set_item("user", config.user)?;
        Ok(dict)
    }

    /// The digest of the image's config blob (`sha256:...`).
    #[getter]
    fn digest(&self) -> String {
        self.0.config_digest.clone()
    }

    fn __repr__(&self) -> String {
        format!("Image({})", self.0.config_digest)
    }
}

/// How a pull talks to its registry.
fn pull_options(
    username: Option<String>,
    password: Option<String>,
    plain_http: bool,
    ca_pem: Option<Vec<u8>>,
) -> krunbox::image::oci::PullOptions {
    let mut options = krunbox::image::oci::PullOptions::new().plain_http(plain_http);
    if let Some(username) = username {
        options = options.credentials(krunbox::image::oci::Credentials::Basic {
            username,
            password: password.unwrap_or_default(),
        });
    }
    if let Some(pem) = ca_pem {
        options = options.root_certificate_pem(pem);
    }
    options
}

#[pymethods]
impl Images {
    /// The store at `path` (default: the user's, beside the library's cache).
    #[new]
    #[pyo3(signature = (path = None))]
    fn new(path: Option<PathBuf>) -> Self {
        Images(match path {
            Some(path) => krunbox::image::oci::LocalImages::at(path),
            None => krunbox::image::oci::LocalImages::default_location(),
        })
    }

    /// Imports the archive at `archive` as `name` (awaitable): its layers flattened into an
    /// image, its digests checked.
    fn import_archive<'py>(
        &self,
        py: Python<'py>,
        name: String,
        archive: PathBuf,
    ) -> PyResult<Bound<'py, PyAny>> {
        let images = self.0.clone();
        awaitable(
            py,
            async move { images.import(&name, archive).await.map(Image) },
        )
    }

    /// `import_archive`, waiting here with the GIL released.
    fn import_archive_blocking(
        &self,
        py: Python<'_>,
        name: String,
        archive: PathBuf,
    ) -> PyResult<Image> {
        let images = self.0.clone();
        block_on(
            py,
            async move { images.import(&name, archive).await.map(Image) },
        )
    }

    /// Pulls `reference` (`registry/repository:tag` or `@sha256:...`) as `name` (awaitable).
    #[pyo3(signature = (
        name, reference, *, username = None, password = None, plain_http = false, ca_pem = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        name: String,
        reference: String,
        username: Option<String>,
        password: Option<String>,
        plain_http: bool,
        ca_pem: Option<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let images = self.0.clone();
        let options = pull_options(username, password, plain_http, ca_pem);
        awaitable(py, async move {
            let pulled = images.pull(&name, &reference, &options).await?;
            Ok(Image(pulled.image))
        })
    }

    /// `pull`, waiting here with the GIL released.
    #[pyo3(signature = (
        name, reference, *, username = None, password = None, plain_http = false, ca_pem = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn pull_blocking(
        &self,
        py: Python<'_>,
        name: String,
        reference: String,
        username: Option<String>,
        password: Option<String>,
        plain_http: bool,
        ca_pem: Option<Vec<u8>>,
    ) -> PyResult<Image> {
        let images = self.0.clone();
        let options = pull_options(username, password, plain_http, ca_pem);
        block_on(py, async move {
            let pulled = images.pull(&name, &reference, &options).await?;
            Ok(Image(pulled.image))
        })
    }

    /// The image stored as `name`, if there is one.
    fn get(&self, name: &str) -> PyResult<Option<Image>> {
        let image = self.0.get(name).map_err(crate::errors::to_py)?;
        Ok(image.map(Image))
    }

    /// The names of the stored images.
    fn names(&self) -> PyResult<Vec<String>> {
        let all = self.0.list().map_err(crate::errors::to_py)?;
        Ok(all.into_iter().map(|(name, _)| name).collect())
    }

    /// Removes the image stored as `name`; whether there was one.
    fn remove(&self, name: &str) -> PyResult<bool> {
        self.0.remove(name).map_err(crate::errors::to_py)
    }
}
