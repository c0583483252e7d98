//! Real builds (no mocks). They need the tools from
//! `apt-get install erofs-utils mmdebstrap busybox-static` and apt package
//! lists (`apt-get update`); without them they fail, saying what to install.

use krunbox_rootfs::{
    build, default_cache_dir, image_path, load, manifest_path, rebuild, verify, BuildError,
    BuiltinImage, ImageManifest, PackageInput, VerifyError,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Builds `image` into `cache`, panicking with the builder's own message (which
/// names the packages to install) if it fails.
fn must_build(cache: &Path, image: BuiltinImage) -> ImageManifest {
    build(cache, image, &mut |line| eprintln!("{line}"))
        .unwrap_or_else(|e| panic!("building the {image} image failed: {e}"))
}

/// One busybox build shared by the tests that only read or copy it.
fn shared_busybox() -> &'static (PathBuf, ImageManifest) {
    static SHARED: OnceLock<(PathBuf, ImageManifest)> = OnceLock::new();
    SHARED.get_or_init(|| {
        // Under target/tmp, replaced on each run, so runs do not pile up copies.
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shared-busybox-cache");
        if dir.exists() {
            fs::remove_dir_all(&dir).unwrap();
        }
        let manifest = must_build(&dir, BuiltinImage::Busybox);
        (dir, manifest)
    })
}

/// A private copy of the shared cache, for tests that damage it.
fn copy_of_shared() -> tempfile::TempDir {
    let (src, _) = shared_busybox();
    let dst = tempfile::tempdir().unwrap();
    fs::create_dir(dst.path().join("images")).unwrap();
    for file in [
        image_path(src, BuiltinImage::Busybox),
        manifest_path(src, BuiltinImage::Busybox),
    ] {
        fs::copy(
            &file,
            dst.path().join("images").join(file.file_name().unwrap()),
        )
        .unwrap();
    }
    dst
}

#[test]
fn busybox_builds_are_byte_identical() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let start = std::time::Instant::now();
    let first = must_build(a.path(), BuiltinImage::Busybox);
    eprintln!("busybox image built in {:?}", start.elapsed());
    let second = must_build(b.path(), BuiltinImage::Busybox);
    assert_eq!(first, second, "two builds gave different manifests");
    assert_eq!(
        fs::read(image_path(a.path(), BuiltinImage::Busybox)).unwrap(),
        fs::read(image_path(b.path(), BuiltinImage::Busybox)).unwrap(),
        "two builds gave different images"
    );

    assert_eq!(first.name, "busybox");
    assert_eq!(first.format, "erofs");
    assert_eq!(first.sha256.len(), 64);
    assert!(first
        .sha256
        .bytes()
        .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
    assert!(
        first.size < 8 << 20,
        "busybox image is {} bytes",
        first.size
    );
    assert!(
        first
            .inputs
            .iter()
            .any(|p| p.name == "busybox-static" && !p.version.is_empty()),
        "{:?}",
        first.inputs
    );
    let on_disk = fs::metadata(image_path(a.path(), BuiltinImage::Busybox)).unwrap();
    assert_eq!(on_disk.len(), first.size);
    // No build leftovers next to the image.
    let mut names: Vec<_> = fs::read_dir(a.path().join("images"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    names.sort();
    assert_eq!(names, ["busybox.erofs", "busybox.json"]);
}

#[test]
fn build_is_idempotent_and_rebuild_replaces() {
    let cache = copy_of_shared();
    let (_, expected) = shared_busybox();
    let mut lines = Vec::new();
    let again = build(cache.path(), BuiltinImage::Busybox, &mut |l| {
        lines.push(l.to_string())
    })
    .unwrap();
    assert_eq!(&again, expected);
    assert_eq!(
        lines.len(),
        1,
        "an up-to-date image is not rebuilt: {lines:?}"
    );
    assert!(lines[0].contains("already built"), "{lines:?}");

    let rebuilt = rebuild(cache.path(), BuiltinImage::Busybox, &mut |_| {}).unwrap();
    assert_eq!(&rebuilt, expected);
}

#[test]
fn truncated_image_is_not_loaded_and_fails_verify() {
    let cache = copy_of_shared();
    let (_, expected) = shared_busybox();
    assert_eq!(
        verify(cache.path(), BuiltinImage::Busybox).unwrap(),
        *expected
    );
    assert_eq!(
        load(cache.path(), BuiltinImage::Busybox).unwrap().as_ref(),
        Some(expected)
    );

    let image = image_path(cache.path(), BuiltinImage::Busybox);
    let file = fs::OpenOptions::new().write(true).open(&image).unwrap();
    file.set_len(expected.size / 2).unwrap();
    match verify(cache.path(), BuiltinImage::Busybox) {
        Err(VerifyError::SizeMismatch {
            expected: e,
            actual,
            ..
        }) => assert_eq!((e, actual), (expected.size, expected.size / 2)),
        other => panic!("expected SizeMismatch, got {other:?}"),
    }
    assert_eq!(load(cache.path(), BuiltinImage::Busybox).unwrap(), None);

    // build() notices and makes a good image again.
    let fixed = must_build(cache.path(), BuiltinImage::Busybox);
    assert_eq!(&fixed, expected);
    verify(cache.path(), BuiltinImage::Busybox).unwrap();
}

#[test]
fn modified_image_fails_verify_with_digest_mismatch() {
    let cache = copy_of_shared();
    let (_, expected) = shared_busybox();
    let image = image_path(cache.path(), BuiltinImage::Busybox);
    let mut bytes = fs::read(&image).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff; // same size, different content
    fs::write(&image, &bytes).unwrap();
    match verify(cache.path(), BuiltinImage::Busybox) {
        Err(VerifyError::DigestMismatch {
            expected: e,
            actual,
            ..
        }) => {
            assert_eq!(e, expected.sha256);
            assert_ne!(actual, expected.sha256);
            assert_eq!(actual, krunbox_rootfs::sha256_file(&image).unwrap());
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    // Same size, so load() (which does not hash) still returns the manifest.
    assert!(load(cache.path(), BuiltinImage::Busybox).unwrap().is_some());
}

#[test]
fn manifest_round_trips_through_disk() {
    let (dir, expected) = shared_busybox();
    let text = fs::read_to_string(manifest_path(dir, BuiltinImage::Busybox)).unwrap();
    let parsed: ImageManifest = serde_json::from_str(&text).unwrap();
    assert_eq!(&parsed, expected);
    assert_eq!(serde_json::to_string_pretty(&parsed).unwrap() + "\n", text);

    let manifest = ImageManifest {
        name: "agent".into(),
        format: "erofs".into(),
        sha256: "ab".repeat(32),
        size: 123,
        inputs: vec![PackageInput {
            name: "python3".into(),
            version: "3.11.2-1+b1".into(),
        }],
        builder: krunbox_rootfs::BUILDER_VERSION.into(),
        tools: vec![],
    };
    let json = serde_json::to_string(&manifest).unwrap();
    assert_eq!(
        serde_json::from_str::<ImageManifest>(&json).unwrap(),
        manifest
    );
}

#[test]
fn missing_image_loads_as_none() {
    let empty = tempfile::tempdir().unwrap();
    for image in BuiltinImage::ALL {
        assert_eq!(load(empty.path(), image).unwrap(), None);
        assert!(matches!(
            verify(empty.path(), image),
            Err(VerifyError::NotBuilt { .. })
        ));
    }
    // A manifest without its image is not built either.
    let cache = copy_of_shared();
    fs::remove_file(image_path(cache.path(), BuiltinImage::Busybox)).unwrap();
    assert_eq!(load(cache.path(), BuiltinImage::Busybox).unwrap(), None);
}

#[test]
fn corrupt_manifest_is_an_error_and_is_rebuilt() {
    let cache = copy_of_shared();
    fs::write(
        manifest_path(cache.path(), BuiltinImage::Busybox),
        "{not json",
    )
    .unwrap();
    // What a build that crashed midway leaves behind.
    let images = cache.path().join("images");
    fs::create_dir_all(images.join(".tmp-busybox-crashed/root/bin")).unwrap();
    fs::write(images.join(".tmp-busybox-crashedAB.json"), "{").unwrap();
    assert!(matches!(
        load(cache.path(), BuiltinImage::Busybox),
        Err(BuildError::Manifest { .. })
    ));
    let (_, expected) = shared_busybox();
    assert_eq!(&must_build(cache.path(), BuiltinImage::Busybox), expected);
    assert!(!images.join(".tmp-busybox-crashed").exists());
    assert!(!images.join(".tmp-busybox-crashedAB.json").exists());
}

/// The full agent image, in the real cache: the set-up step builds it (a minute or two, as
/// root), so here `build` finds it and this checks what it recorded; on a machine without it,
/// this test builds it.
#[test]
fn agent_image_builds() {
    let cache = default_cache_dir();
    let manifest = must_build(&cache, BuiltinImage::Agent);
    for package in ["python3", "curl", "git", "ca-certificates", "procps"] {
        assert!(
            manifest.inputs.iter().any(|p| p.name == package),
            "{package} missing from {:?}",
            manifest.inputs
        );
    }
    assert_eq!(verify(&cache, BuiltinImage::Agent).unwrap(), manifest);
}

/// Two agent builds from the same package versions, tools and builder give the same bytes.
/// The real cache's image (built by the set-up step) is compared with a fresh build; should
/// the Debian archive have moved on in between (other package versions), a second fresh build
/// is the comparison instead, so the claim is always checked against like inputs.
#[test]
fn agent_builds_are_byte_identical() {
    let real = must_build(&default_cache_dir(), BuiltinImage::Agent);
    let fresh_cache = tempfile::tempdir().unwrap();
    let fresh = must_build(fresh_cache.path(), BuiltinImage::Agent);
    let (a, b) = if (&fresh.inputs, &fresh.tools, &fresh.builder)
        == (&real.inputs, &real.tools, &real.builder)
    {
        (real, fresh)
    } else {
        let again_cache = tempfile::tempdir().unwrap();
        (fresh, must_build(again_cache.path(), BuiltinImage::Agent))
    };
    assert_eq!(a.inputs, b.inputs, "the archive changed during the test");
    assert_eq!(
        (a.sha256, a.size),
        (b.sha256, b.size),
        "the same inputs built different agent images"
    );
}
