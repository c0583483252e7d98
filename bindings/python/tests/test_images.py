"""OCI images from Python, in a real microVM: a ``docker save`` archive made here (the host's
static busybox and a script, in two layers) imported into a store and booted, its
configuration as the image gave it.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import krunbox
import krunbox.sync


def _tar(members: List[Tuple[str, int, bytes]]) -> bytes:
    """A tar of files (name, mode, data), directories made for them."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        made = set()
        for name, mode, data in members:
            parts = name.split("/")[:-1]
            for i in range(len(parts)):
                directory = "/".join(parts[: i + 1])
                if directory not in made:
                    made.add(directory)
                    info = tarfile.TarInfo(directory)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _docker_save(layers: List[bytes], config: Dict[str, object]) -> bytes:
    """``docker save``'s layout: manifest.json, the config named by its digest, layer tars."""
    blob = json.dumps(
        {
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()],
            "os": "linux",
            "config": config,
            "rootfs": {
                "type": "layers",
                "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers],
            },
        }
    ).encode()
    config_name = hashlib.sha256(blob).hexdigest() + ".json"
    names = [f"layer{i}/layer.tar" for i in range(len(layers))]
    manifest = json.dumps([{"Config": config_name, "RepoTags": ["t:1"], "Layers": names}])
    members = [("manifest.json", 0o644, manifest.encode()), (config_name, 0o644, blob)]
    members += [(name, 0o644, layer) for name, layer in zip(names, layers)]
    return _tar(members)


async def test_an_imported_image_boots_with_its_configuration(tmp_path: Path) -> None:
    busybox = Path("/bin/busybox").read_bytes()
    script = b"#!/bin/busybox sh\necho \"$GREETING from $(/bin/busybox pwd)\"\n"
    archive = tmp_path / "image.tar"
    archive.write_bytes(
        _docker_save(
            [_tar([("bin/busybox", 0o755, busybox)]), _tar([("app/run.sh", 0o755, script)])],
            {"Env": ["GREETING=hello", "PATH=/bin"], "WorkingDir": "/app",
             "Entrypoint": ["/bin/busybox", "sh", "/app/run.sh"]},
        )
    )
    images = krunbox.Images(tmp_path / "store")
    image = await images.import_archive("hello", archive)
    assert image.config["entrypoint"] == ["/bin/busybox", "sh", "/app/run.sh"]
    assert image.config["env"] == {"GREETING": "hello", "PATH": "/bin"}
    assert images.names() == ["hello"] and images.get("hello") is not None

    sandbox = krunbox.Sandbox(krunbox.Rootfs.ephemeral(image.rootfs), memory_mib=256)
    async with sandbox.boot(cwd=image.config["working_dir"]) as vm:
        done = await vm.run(image.config["entrypoint"], env=image.config["env"])
        assert done.stdout == b"hello from /app\n", done

    assert krunbox.sync.Images(tmp_path / "store").remove("hello")
    assert images.names() == []
    with pytest.raises(krunbox.KrunboxError):
        await images.import_archive("broken", tmp_path / "missing.tar")
