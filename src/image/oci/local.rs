//! [`LocalImages`]: imported and pulled images kept under names in the cache directory.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{build, import, pull, ImageConfig, LayerCache, OciImage, PullOptions, Pulled};
use crate::error::{Error, Result};
use crate::image::FlatImage;

/// The longest image name.
const MAX_NAME: usize = 128;

/// Imported and pulled images kept by name: `DIR/NAME.qcow2` and `DIR/NAME.json` (its digest,
/// configuration and the cached blobs it was pulled from), pulled blobs in `DIR/blobs`
/// ([`LocalImages::layer_cache`]), `DIR` being `$KRUNBOX_IMAGE_DIR`, or `oci/` in krunbox's
/// cache directory.
/// Names are letters, digits and `.`, `_`, `-`, `:` (like `myapp:1.2`).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::LocalImages;
/// use krunbox::Sandbox;
///
/// let images = LocalImages::default_location();
/// images.import("myapp:latest", "myapp.tar").await?; // docker save myapp > myapp.tar
/// let image = images.get("myapp:latest")?.expect("just imported");
/// let vm = Sandbox::builder()
///     .rootfs(image.rootfs())
///     .image_config(image.config.clone())
///     .build()?
///     .boot()
///     .await?;
/// # let _ = vm; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalImages {
    dir: PathBuf,
}

/// What `NAME.json` holds.
#[derive(Serialize, Deserialize)]
struct Record {
    sha256: String,
    config_digest: String,
    config: ImageConfig,
    /// The blobs of `DIR/blobs` a pulled image was built from (its config and layers): kept
    /// while an image names them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    blobs: Vec<String>,
    /// The reference a pulled image was pulled from, as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reference: Option<String>,
}

impl LocalImages {
    /// The images in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        LocalImages { dir: dir.into() }
    }

    /// The images in `$KRUNBOX_IMAGE_DIR` if it is set, else in `oci/` of krunbox's cache
    /// directory ([`crate::cache_dir`]).
    pub fn default_location() -> Self {
        match std::env::var_os("KRUNBOX_IMAGE_DIR") {
            Some(dir) if !dir.is_empty() => Self::at(dir),
            _ => Self::at(crate::cache_dir().join("oci")),
        }
    }

    /// Where the images are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Imports the archive at `archive` (see [`import`]) as `name`, replacing an image of that
    /// name.
    pub async fn import(&self, name: &str, archive: impl AsRef<Path>) -> Result<OciImage> {
        let output = self.prepare(name)?;
        let image = import(archive, output).await?;
        self.record(name, &image, Vec::new(), None)?;
        Ok(image)
    }

    /// Pulls `reference` (see [`pull`]) as `name`, replacing an image of that name. Its blobs
    /// go to this directory's layer cache, [`LocalImages::layer_cache`], whatever cache
    /// `options` name, and stay there while an image here needs them.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::image::oci::{LocalImages, PullOptions};
    ///
    /// let images = LocalImages::default_location();
    /// let pulled = images
    ///     .pull("tools", "registry.example.com/team/tools:3", &PullOptions::new())
    ///     .await?;
    /// println!("{} of {} layers downloaded", pulled.fetched.layers_fetched, pulled.fetched.layers.len());
    /// # Ok(()) }
    /// ```
    pub async fn pull(&self, name: &str, reference: &str, options: &PullOptions) -> Result<Pulled> {
        let output = self.prepare(name)?;
        let cache = self.layer_cache();
        // Until the record names the blobs, a removal elsewhere must not prune them.
        let _hold = cache.hold().map_err(|reason| Error::Registry {
            reference: reference.to_string(),
            kind: super::PullFailure::Cache,
            reason,
        })?;
        let options = options.clone().cache(cache);
        let pulled = pull(reference, output, &options).await?;
        let mut blobs = pulled.fetched.layers.clone();
        blobs.push(pulled.fetched.config_digest.clone());
        self.record(name, &pulled.image, blobs, Some(reference))?;
        Ok(pulled)
    }

    /// Builds `name` (replacing an image of that name) from `sandbox`'s image by running
    /// `steps` in it: see [`build`].
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::image::oci::LocalImages;
    /// use krunbox::{BuiltinImage, Rootfs, Sandbox};
    ///
    /// let base = Sandbox::builder().rootfs(Rootfs::builtin(BuiltinImage::Agent)).build()?;
    /// LocalImages::default_location()
    ///     .build("with-venv", &base, &["python3 -m venv /opt/venv"])
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn build(
        &self,
        name: &str,
        sandbox: &crate::Sandbox,
        steps: &[impl AsRef<str>],
    ) -> Result<OciImage> {
        let output = self.prepare(name)?;
        let image = build(sandbox, steps, output).await?;
        self.record(name, &image, Vec::new(), None)?;
        Ok(image)
    }

    /// The layer cache of the images here: `DIR/blobs`.
    ///
    /// ```
    /// use krunbox::image::oci::LocalImages;
    ///
    /// let images = LocalImages::at("/var/lib/agents/images");
    /// assert_eq!(images.layer_cache().dir(), images.dir().join("blobs"));
    /// ```
    pub fn layer_cache(&self) -> LayerCache {
        LayerCache::at(self.dir.join("blobs"))
    }

    /// Removes the cached blobs no image here names. Best effort: when a record cannot be
    /// read (so what it needs is unknown), or a pull holds the cache, nothing is removed now;
    /// the next removal tries again.
    fn prune(&self) {
        let mut needed = Vec::new();
        let Ok(images) = self.list() else { return };
        for (name, _) in images {
            match self.read_record(&name) {
                Ok(Some(record)) => needed.extend(record.blobs),
                Ok(None) => {}
                Err(_) => return,
            }
        }
        if let Err(e) = self.layer_cache().retain(&needed) {
            tracing::warn!(target: "krunbox::rootfs", %e, "pruning the layer cache failed");
        }
    }

    /// Checks `name` and makes the directory; where the image file goes.
    fn prepare(&self, name: &str) -> Result<PathBuf> {
        check_name(name)?;
        std::fs::create_dir_all(&self.dir).map_err(Error::io(format!(
            "making the image directory {}",
            self.dir.display()
        )))?;
        Ok(self.dir.join(format!("{name}.qcow2")))
    }

    /// Writes `NAME.json` for `image` (atomically: a reader sees the old record or the new).
    fn record(
        &self,
        name: &str,
        image: &OciImage,
        blobs: Vec<String>,
        reference: Option<&str>,
    ) -> Result<()> {
        let record = Record {
            sha256: image.image.sha256.clone(),
            config_digest: image.config_digest.clone(),
            config: image.config.clone(),
            blobs,
            reference: reference.map(str::to_string),
        };
        // A temporary file of its own (two writers of one name never share one), renamed over
        // the record: a reader sees the old record or the new.
        let write = || -> std::io::Result<()> {
            let mut temp = tempfile::Builder::new()
                .prefix(&format!(".{name}.json."))
                .tempfile_in(&self.dir)?;
            std::io::Write::write_all(
                &mut temp,
                &serde_json::to_vec_pretty(&record).expect("a record serialises"),
            )?;
            temp.persist(self.dir.join(format!("{name}.json")))
                .map(drop)
                .map_err(|e| e.error)
        };
        write().map_err(Error::io(format!("recording the image {name}")))
    }

    /// The image called `name`, if there is one.
    pub fn get(&self, name: &str) -> Result<Option<OciImage>> {
        Ok(self.read_record(name)?.map(|record| OciImage {
            image: FlatImage {
                path: self.dir.join(format!("{name}.qcow2")),
                sha256: record.sha256,
            },
            config: record.config,
            config_digest: record.config_digest,
        }))
    }

    fn read_record(&self, name: &str) -> Result<Option<Record>> {
        check_name(name)?;
        let record_path = self.dir.join(format!("{name}.json"));
        let bytes = match std::fs::read(&record_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("reading {}", record_path.display()))(e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::ImageArchive {
                path: record_path.clone(),
                reason: format!("not an image record: {e}"),
            })
    }

    /// The image pulled from `reference` (exactly as it was given to [`LocalImages::pull`]),
    /// and its name, if there is one: to run a reference without pulling it again.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::image::oci::{LocalImages, PullOptions};
    ///
    /// let images = LocalImages::default_location();
    /// let reference = "registry.example.com/team/tools:3";
    /// let image = match images.pulled_from(reference)? {
    ///     Some((_, image)) => image,
    ///     None => images.pull("tools:3", reference, &PullOptions::new()).await?.image,
    /// };
    /// # let _ = image; Ok(()) }
    /// ```
    pub fn pulled_from(&self, reference: &str) -> Result<Option<(String, OciImage)>> {
        for (name, image) in self.list()? {
            if self.pulled_reference(&name)?.as_deref() == Some(reference) {
                return Ok(Some((name, image)));
            }
        }
        Ok(None)
    }

    /// The reference the image `name` was pulled from; `None` for an image imported or built
    /// here, or no image of that name.
    ///
    /// ```no_run
    /// # fn demo() -> krunbox::Result<()> {
    /// use krunbox::image::oci::LocalImages;
    ///
    /// if let Some(reference) = LocalImages::default_location().pulled_reference("tools:3")? {
    ///     println!("tools:3 came from {reference}");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn pulled_reference(&self, name: &str) -> Result<Option<String>> {
        Ok(self.read_record(name)?.and_then(|record| record.reference))
    }

    /// Every image, by name.
    pub fn list(&self) -> Result<Vec<(String, OciImage)>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(format!("listing {}", self.dir.display()))(e)),
        };
        let mut images = Vec::new();
        for entry in entries {
            let entry = entry.map_err(Error::io(format!("listing {}", self.dir.display())))?;
            let file = entry.file_name();
            let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".json")) else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            if let Some(image) = self.get(name)? {
                images.push((name.to_string(), image));
            }
        }
        images.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(images)
    }

    /// Removes the image called `name`, and the cached blobs no other image here needs;
    /// `false` if there was no such image.
    pub fn remove(&self, name: &str) -> Result<bool> {
        check_name(name)?;
        let mut removed = false;
        for file in [format!("{name}.json"), format!("{name}.qcow2")] {
            match std::fs::remove_file(self.dir.join(&file)) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(format!("removing {file}"))(e)),
            }
        }
        if removed {
            self.prune();
        }
        Ok(removed)
    }
}

fn check_name(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(Error::InvalidConfig(format!(
            "an image name is 1-{MAX_NAME} letters, digits, '.', '_', '-' and ':', not starting \
             with '.'; got {name:?}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_records_read_back() {
        for bad in ["", ".hidden", "a/b", "../x", &"n".repeat(129), "sp ace"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("myapp:1.2-rc_1").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let images = LocalImages::at(dir.path());
        assert!(images.get("none").unwrap().is_none());
        assert!(images.list().unwrap().is_empty());
        let record = Record {
            sha256: "a".repeat(64),
            config_digest: format!("sha256:{}", "b".repeat(64)),
            config: ImageConfig {
                cmd: vec!["sh".into()],
                ..Default::default()
            },
            blobs: Vec::new(),
            reference: None,
        };
        std::fs::write(
            dir.path().join("app:1.json"),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.path().join("app:1.qcow2"), b"").unwrap();
        let listed = images.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].0, "app:1");
        assert_eq!(listed[0].1.config.cmd, ["sh"]);
        assert_eq!(listed[0].1.image.path, dir.path().join("app:1.qcow2"));
        assert!(images.remove("app:1").unwrap());
        assert!(!images.remove("app:1").unwrap());
        assert!(images.list().unwrap().is_empty());

        // Removing a pulled image removes the blobs no other image names.
        let shared = format!("sha256:{}", "1".repeat(64));
        let own = format!("sha256:{}", "2".repeat(64));
        for (name, blobs) in [
            ("a", vec![shared.clone(), own.clone()]),
            ("b", vec![shared.clone()]),
        ] {
            let record = Record {
                blobs,
                ..serde_json::from_slice(&serde_json::to_vec(&record).unwrap()).unwrap()
            };
            std::fs::write(
                dir.path().join(format!("{name}.json")),
                serde_json::to_vec(&record).unwrap(),
            )
            .unwrap();
        }
        let cache = images.layer_cache();
        for digest in [&shared, &own] {
            let path = cache.path(digest).unwrap();
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"blob").unwrap();
        }
        assert!(images.remove("a").unwrap());
        assert!(cache.contains(&shared) && !cache.contains(&own));
        assert!(images.remove("b").unwrap());
        assert!(!cache.contains(&shared));

        std::fs::write(dir.path().join("bad.json"), b"{").unwrap();
        assert!(matches!(images.get("bad"), Err(Error::ImageArchive { .. })));
    }
}
