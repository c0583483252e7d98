//! Pulling images from a real registry: Debian's `docker-registry` on loopback, with token
//! authentication (tests/common/registry.rs), holding images this test built from files it
//! makes (tests/common/oci.rs) and pushed with `skopeo`. A pulled image boots and runs its
//! entrypoint; a private one needs credentials; layers two images share download once; a blob
//! changed in the registry's storage, or in the layer cache, is refused.

mod common;
#[path = "common/oci.rs"]
mod oci;
#[path = "common/registry.rs"]
mod registry;

use krunbox::image::oci::{fetch, pull, Credentials, LayerCache, PullFailure, PullOptions};
use krunbox::Error;
use oci::{boot_and_run_entrypoint, multi_platform_layout_dir, oci_layout_dir, tag_latest, Image};
use registry::{Registry, READER_PASSWORD};
use sha2::Digest;

/// Pushes `image` to the registry as `repository:1`; its config's and layers' digests.
async fn push(registry: &Registry, image: Image, repository: &str) -> (String, Vec<String>) {
    let layout = tempfile::tempdir().unwrap();
    let digests = oci_layout_dir(layout.path(), image);
    registry.push(layout.path(), repository, "1").await;
    digests
}

fn options(cache: &LayerCache) -> PullOptions {
    PullOptions::new().plain_http(true).cache(cache.clone())
}

/// An image in `public/` pulls without credentials (an anonymous token from the token
/// service), boots, and runs its entrypoint as its config says.
#[test]
fn a_pushed_image_pulls_anonymously_boots_and_runs_its_entrypoint() {
    common::run(async {
        let registry = Registry::start().await;
        let (config_digest, layers) = push(&registry, Image::App, "public/app").await;
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::at(dir.path().join("blobs"));
        let reference = format!("{}/public/app:1", registry.host);
        let pulled = pull(&reference, dir.path().join("app.qcow2"), &options(&cache))
            .await
            .expect("pull");
        assert_eq!(pulled.image.config_digest, config_digest);
        assert_eq!(pulled.fetched.layers, layers);
        assert_eq!(pulled.fetched.layers_fetched, 2);
        assert_eq!(pulled.fetched.layers_cached, 0);
        assert!(layers.iter().all(|l| cache.contains(l)));
        assert_eq!(pulled.image.config.user, Some((1000, 1001)));
        boot_and_run_entrypoint(&pulled.image).await;
    });
}

/// A private image: refused without credentials and with a wrong password, each a typed
/// `Unauthorized` before anything is downloaded; pulled with a reader's credentials, reusing
/// the base layer another image brought into the cache, and then it boots.
#[test]
fn a_private_image_needs_credentials_and_reuses_cached_layers() {
    common::run(async {
        let registry = Registry::start().await;
        let (_, base_layers) = push(&registry, Image::Base, "public/base").await;
        let (_, app_layers) = push(&registry, Image::App, "private/app").await;
        assert_eq!(
            base_layers[0], app_layers[0],
            "the app is built on the base"
        );
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::at(dir.path().join("blobs"));
        let private = format!("{}/private/app:1", registry.host);
        let output = dir.path().join("app.qcow2");

        for credentials in [
            Credentials::Anonymous,
            Credentials::Basic {
                username: "reader".into(),
                password: "wrong".into(),
            },
        ] {
            let refused = pull(&private, &output, &options(&cache).credentials(credentials)).await;
            match refused {
                Err(Error::Registry {
                    kind: PullFailure::Unauthorized,
                    ..
                }) => {}
                other => panic!("expected Unauthorized, got {other:?}"),
            }
            assert!(!output.exists());
            assert!(!app_layers.iter().any(|l| cache.contains(l)));
        }

        let base = fetch(
            &format!("{}/public/base:1", registry.host),
            &options(&cache),
        )
        .await
        .expect("fetch the base");
        assert_eq!((base.layers_fetched, base.layers_cached), (1, 0));

        let reader = Credentials::Basic {
            username: "reader".into(),
            password: READER_PASSWORD.into(),
        };
        let pulled = pull(&private, &output, &options(&cache).credentials(reader))
            .await
            .expect("pull with credentials");
        assert_eq!(pulled.fetched.layers, app_layers);
        assert_eq!(
            (pulled.fetched.layers_fetched, pulled.fetched.layers_cached),
            (1, 1),
            "only the app's own layer is downloaded"
        );
        boot_and_run_entrypoint(&pulled.image).await;
    });
}

/// A layer whose bytes the registry's storage changed after the push is refused as it arrives
/// (and never enters the cache); a cached layer changed on disk is refused before an image is
/// built from it. No VM boots for either.
#[test]
fn a_layer_changed_in_the_registry_or_the_cache_is_refused() {
    common::run(async {
        let registry = Registry::start().await;
        let (_, layers) = push(&registry, Image::App, "public/app").await;
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::at(dir.path().join("blobs"));
        let reference = format!("{}/public/app:1", registry.host);
        let output = dir.path().join("app.qcow2");

        let stored = registry.blob_file(&layers[1]);
        let mut bytes = std::fs::read(&stored).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&stored, &bytes).unwrap();
        match pull(&reference, &output, &options(&cache)).await {
            Err(Error::Registry {
                kind: PullFailure::Unverified,
                reason,
                ..
            }) => assert!(reason.contains("igest"), "{reason}"),
            other => panic!("expected the changed layer refused, got {other:?}"),
        }
        assert!(!cache.contains(&layers[1]));
        assert!(!output.exists());

        // Put it back; pull the layers into the cache; change one there.
        bytes[middle] ^= 0xff;
        std::fs::write(&stored, &bytes).unwrap();
        fetch(&reference, &options(&cache)).await.expect("fetch");
        let cached = dir
            .path()
            .join("blobs/sha256")
            .join(layers[0].strip_prefix("sha256:").unwrap());
        let mut bytes = std::fs::read(&cached).unwrap();
        bytes[10] ^= 0xff;
        std::fs::write(&cached, &bytes).unwrap();
        match pull(&reference, &output, &options(&cache)).await {
            Err(Error::Registry {
                kind: PullFailure::Unverified,
                reason,
                ..
            }) => assert!(reason.contains("changed on disk"), "{reason}"),
            other => panic!("expected the changed cache blob refused, got {other:?}"),
        }
        assert!(!output.exists());
    });
}

/// A reference naming an index of several platforms (as most images in registries are) resolves
/// to the linux/amd64 image, though another platform is listed first; no VM is needed to tell.
#[test]
fn an_index_of_platforms_resolves_to_linux_amd64() {
    common::run(async {
        let registry = Registry::start().await;
        let layout = tempfile::tempdir().unwrap();
        let multi = multi_platform_layout_dir(layout.path());
        tag_latest(layout.path(), &multi.arm64_manifest);
        registry.push(layout.path(), "public/multi", "arm64").await;
        tag_latest(layout.path(), &multi.amd64_manifest);
        registry.push(layout.path(), "public/multi", "amd64").await;
        registry.put_index("public/multi", "1", &multi.index).await;
        // The tag names the index itself.
        let tag = registry
            .storage
            .join("docker/registry/v2/repositories/public/multi/_manifests/tags/1/current/link");
        let index_digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&multi.index)));
        assert_eq!(std::fs::read_to_string(tag).unwrap(), index_digest);

        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::at(dir.path().join("blobs"));
        let reference = format!("{}/public/multi:1", registry.host);
        let fetched = fetch(&reference, &options(&cache)).await.expect("fetch");
        assert_eq!(fetched.manifest_digest, multi.amd64_manifest);
        assert_eq!(fetched.config_digest, multi.amd64_config);
        assert!(cache.contains(&multi.amd64_config));
    });
}
