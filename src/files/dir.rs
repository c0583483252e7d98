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
    /// directories arrive in pages, all collected here, up to
    /// [`Limits::read_dir_max_entries`](crate::Limits::read_dir_max_entries) (65,536 by
    /// default; names are at most 255 bytes, so about 20 MiB at most): a larger directory fails
    /// with [`FsErrorKind::TooLarge`](crate::FsErrorKind::TooLarge).
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
        list(Target::new(self, "read_dir", path.as_ref())?).await
    }
}

/// Collects every page of a listing, at most
/// [`Limits::read_dir_max_entries`](crate::Limits::read_dir_max_entries) entries.
pub(super) async fn list(target: Target) -> Result<Vec<DirEntry>> {
    let max = target.control.limits.read_dir_max_entries;
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
        if all.len() + entries.len() > max {
            return Err(target.error(
                FsErrorKind::TooLarge,
                format!(
                    "the directory has more than {max} entries, the most read_dir collects \
                         (Limits::read_dir_max_entries): raise the limit, or list it with a \
                         command (`ls`, `find`) and stream its output"
                ),
            ));
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::limits::Limits;
    use crate::protocol::fs::{DirEntry as WireEntry, FileType, FsReply, MAX_DIR_ENTRIES};
    use crate::protocol::{GuestMessage, HostMessage};
    use crate::scripted_guest;
    use crate::Error;

    /// A guest that lists a directory without end (every page full and "incomplete", in
    /// order): the host stops at the entry limit with a typed error.
    #[tokio::test(start_paused = true)]
    async fn read_dir_collects_at_most_the_limit() {
        let pages = Arc::new(AtomicU32::new(0));
        let counted = pages.clone();
        let (control, _) =
            scripted_guest::start(Limits::new().read_dir_max_entries(3000), move |message| {
                let HostMessage::Fs(request) = message else {
                    return vec![];
                };
                let page = counted.fetch_add(1, Ordering::SeqCst);
                let entries = (0..MAX_DIR_ENTRIES)
                    .map(|i| WireEntry {
                        name: ByteBuf::from(format!("{page:08}-{i:08}").into_bytes()),
                        file_type: FileType::File,
                    })
                    .collect();
                vec![GuestMessage::FsReply(FsReply {
                    id: request.id,
                    result: Ok(FsOk::Entries {
                        entries,
                        complete: false,
                    }),
                })]
            });
        let target = Target::with_control(control, "read_dir", Path::new("/d")).unwrap();
        let result = tokio::time::timeout(std::time::Duration::from_secs(600), list(target))
            .await
            .expect("the listing must end");
        match result {
            Err(err @ Error::Fs { .. }) => {
                assert_eq!(err.fs_kind(), Some(FsErrorKind::TooLarge), "{err}");
                assert!(err.to_string().contains("more than 3000 entries"), "{err}");
            }
            other => panic!("expected TooLarge, got {:?}", other.map(|e| e.len())),
        }
        assert_eq!(pages.load(Ordering::SeqCst), 3);
    }
}
