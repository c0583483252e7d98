//! The guest's view of an inode's owner and mode where it differs from the host's.
//!
//! The host never chowns and never sets setuid/setgid bits, so `chown`, a setuid `chmod`, or a
//! file created by a guest user other than the host's is recorded here instead, in the
//! extended attribute [`XATTR`] (regular files and directories: where Linux allows `user.`
//! attributes), or only in memory for symlinks, fifos and sockets. Each record also keeps the
//! host's owner and mode it was made against: if the host changes those behind the guest's
//! back, the host's values win again.

use std::ffi::CStr;

/// Where a record is kept on the host.
pub(super) const XATTR: &CStr = c"user.krunbox.stat";

/// The prefix of every attribute HostDir keeps for itself (hidden from the guest, which can
/// neither read, set nor remove them).
pub(super) const PRIVATE_PREFIX: &[u8] = b"user.krunbox.";

/// One inode's guest-visible owner and permission bits, and the host's when recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Overlay {
    pub uid: u32,
    pub gid: u32,
    /// `0o7777`.
    pub perm: u32,
    pub host_uid: u32,
    pub host_gid: u32,
    /// `0o7777`.
    pub host_perm: u32,
}

impl Overlay {
    /// The owner, group and permission bits the guest sees for an inode whose host metadata
    /// is `st`.
    pub(super) fn apply(this: Option<&Overlay>, st: &libc::stat) -> (u32, u32, u32) {
        let host_perm = st.st_mode & 0o7777;
        match this {
            None => (st.st_uid, st.st_gid, host_perm),
            Some(overlay) => {
                let (uid, gid) = if (overlay.host_uid, overlay.host_gid) == (st.st_uid, st.st_gid) {
                    (overlay.uid, overlay.gid)
                } else {
                    (st.st_uid, st.st_gid)
                };
                let perm = if overlay.host_perm == host_perm {
                    overlay.perm
                } else {
                    host_perm
                };
                (uid, gid, perm)
            }
        }
    }

    /// The record that shows `(uid, gid, perm)` over the host's `st`, or `None` when the host
    /// already shows exactly that.
    pub(super) fn between(uid: u32, gid: u32, perm: u32, st: &libc::stat) -> Option<Overlay> {
        let host_perm = st.st_mode & 0o7777;
        ((uid, gid, perm) != (st.st_uid, st.st_gid, host_perm)).then_some(Overlay {
            uid,
            gid,
            perm: perm & 0o7777,
            host_uid: st.st_uid,
            host_gid: st.st_gid,
            host_perm,
        })
    }

    /// The attribute's value: `1 uid gid perm host_uid host_gid host_perm`, modes in octal,
    /// readable with `getfattr`.
    pub(super) fn encode(&self) -> Vec<u8> {
        format!(
            "1 {} {} {:o} {} {} {:o}",
            self.uid, self.gid, self.perm, self.host_uid, self.host_gid, self.host_perm
        )
        .into_bytes()
    }

    /// Parses [`encode`](Self::encode)'s form; anything else is no record.
    pub(super) fn decode(bytes: &[u8]) -> Option<Overlay> {
        let text = std::str::from_utf8(bytes).ok()?;
        let fields: Vec<&str> = text.split(' ').collect();
        let [version, uid, gid, perm, host_uid, host_gid, host_perm] = fields[..] else {
            return None;
        };
        if version != "1" {
            return None;
        }
        let mode = |field: &str| {
            u32::from_str_radix(field, 8)
                .ok()
                .filter(|m| m & !0o7777 == 0)
        };
        Some(Overlay {
            uid: uid.parse().ok()?,
            gid: gid.parse().ok()?,
            perm: mode(perm)?,
            host_uid: host_uid.parse().ok()?,
            host_gid: host_gid.parse().ok()?,
            host_perm: mode(host_perm)?,
        })
    }
}

/// The permission bits the host gets for guest-visible bits `perm` on a `kind` inode
/// (`S_IFMT` bits): never setuid or setgid (a guest must not plant a setuid binary for the
/// host's users), and the owner (HostDir's own process, for everything it creates) keeps read
/// and write (and search, for a directory) so that the host process can still serve a file
/// that the guest's root, whom no mode stops, goes on using.
pub(super) fn host_perm(kind: u32, perm: u32) -> u32 {
    let perm = perm & 0o1777;
    match kind {
        libc::S_IFREG => perm | 0o600,
        libc::S_IFDIR => perm | 0o700,
        _ => perm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(uid: u32, gid: u32, mode: u32) -> libc::stat {
        // SAFETY: plain integers.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_uid = uid;
        st.st_gid = gid;
        st.st_mode = libc::S_IFREG | mode;
        st
    }

    #[test]
    fn records_round_trip_and_garbage_is_no_record() {
        let overlay = Overlay {
            uid: 0,
            gid: 10,
            perm: 0o4755,
            host_uid: 1000,
            host_gid: 1000,
            host_perm: 0o755,
        };
        assert_eq!(overlay.encode(), b"1 0 10 4755 1000 1000 755");
        assert_eq!(Overlay::decode(&overlay.encode()), Some(overlay));
        for garbage in [
            &b""[..],
            b"1 0 0 755 0 0",
            b"2 0 0 755 0 0 755",
            b"1 0 0 17777 0 0 755",
            b"1 -1 0 755 0 0 755",
            b"1 0 0 755 0 0 755 9",
            b"\xff",
        ] {
            assert_eq!(Overlay::decode(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn the_host_wins_what_it_changed_behind_the_record() {
        let st = stat(1000, 1000, 0o755);
        let overlay = Overlay::between(0, 0, 0o4755, &st).unwrap();
        assert_eq!(Overlay::apply(Some(&overlay), &st), (0, 0, 0o4755));
        // The host chmods: its mode shows, the owner stays the guest's.
        assert_eq!(
            Overlay::apply(Some(&overlay), &stat(1000, 1000, 0o700)),
            (0, 0, 0o700)
        );
        // The host chowns: its owner shows.
        assert_eq!(
            Overlay::apply(Some(&overlay), &stat(1001, 1000, 0o755)),
            (1001, 1000, 0o4755)
        );
        assert_eq!(Overlay::between(1000, 1000, 0o755, &st), None);
    }

    #[test]
    fn host_modes_never_carry_setuid_or_setgid() {
        assert_eq!(host_perm(libc::S_IFREG, 0o6755), 0o755);
        assert_eq!(host_perm(libc::S_IFREG, 0o000), 0o600);
        assert_eq!(host_perm(libc::S_IFDIR, 0o3555), 0o1755);
        assert_eq!(host_perm(libc::S_IFIFO, 0o6640), 0o640);
    }
}
