//! Listing guest directories ([`Instance::read_dir`]).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

use serde_bytes::ByteBuf;

use super::request::Target;
use super::DirEntry;
use crate::error::Result;
use crate::instance::Instance;
use crate::protocol::fs::{FsErrorKind, FsOk, FsOp};

impl Instance {
    /// Lists a guest directory, sorted by name (byte order), without `.` and `..`. Large
    /// directories arrive in pages, all collected here.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// for entry in vm.read_dir("/etc").await? {
    ///     println!("{:?} {:?}", entry.file_type, entry.name);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn read_dir(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        let target = Target::new(self, "read_dir", path.as_ref())?;
        let mut all: Vec<DirEntry> = Vec::new();
        let mut after: Option<ByteBuf> = None;
        loop {
            let (entries, complete) = match target
                .call(FsOp::ReadDir {
                    path: target.wire_path(),
                    after: after.clone(),
                })
                .await?
            {
                FsOk::Entries { entries, complete } => (entries, complete),
                other => return Err(target.unexpected("Entries", &other)),
            };
            // Every page must continue strictly after the last name, in order: otherwise
            // paging would not terminate.
            let mut last = after.take();
            for entry in entries {
                if last.as_ref().is_some_and(|l| entry.name <= *l) {
                    return Err(target.error(
                        FsErrorKind::Other,
                        "guest-init listed the directory out of order".into(),
                    ));
                }
                all.push(DirEntry {
                    name: OsString::from_vec(entry.name.to_vec()),
                    file_type: entry.file_type,
                });
                last = Some(entry.name);
            }
            if complete {
                return Ok(all);
            }
            if last.is_none() {
                return Err(target.error(
                    FsErrorKind::Other,
                    "guest-init sent an empty page of an incomplete listing".into(),
                ));
            }
            after = last;
        }
    }
}
