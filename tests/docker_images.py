"""Docker images the tests build locally: nothing can be pulled here, so a root filesystem is made
with debootstrap from Debian's mirror and imported with `docker import`.

`debian_image(tag, suite=..., packages=...)` returns the tag of an image holding a minimal Debian
(`--variant=minbase`) plus `packages`, building it on first use and reusing it afterwards (the
image stays on the daemon between test sessions; building one takes about a minute). Several
test sessions may ask for the same tag at once: a lock file under /tmp serialises the build.

Containers that need the package registries (a fresh-machine set-up test) run with
`--network host` and `registry_access_args()`, which passes the host's CA bundle and pip
configuration through (this machine reaches PyPI through a proxy with its own CA).

`docker_sdk()` is the Docker SDK, or a skip that says how to install it.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["debian_image", "docker_sdk", "image_exists", "registry_access_args"]

_MIRROR = "http://deb.debian.org/debian"
_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def docker_sdk() -> Any:
    """The Docker SDK module; skips the test (or module) where it is not installed. Without it, a
    folder named `docker/` on sys.path imports as an empty package: that counts as not installed."""
    install = "pip install 'agentrl[docker]' (or bash scripts/install.sh docker)"
    docker = pytest.importorskip("docker", reason=f"needs the Docker SDK: {install}")
    if not hasattr(docker, "from_env"):
        pytest.skip(f"needs the Docker SDK ('import docker' found a folder without from_env): {install}",
                    allow_module_level=True)
    return docker


def image_exists(tag: str) -> bool:
    """Whether the local daemon has an image called `tag`."""
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def debian_image(tag: str, *, suite: str = "bookworm", packages: Sequence[str] = (), variant: str = "minbase") -> str:
    """Build (once) and return a local image `tag`: Debian `suite` with `packages` installed."""
    if image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed; `bash scripts/install.sh dev docker` installs it")
    lock_path = Path(tempfile.gettempdir()) / f"agentrl-image-{tag.replace('/', '_').replace(':', '_')}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if image_exists(tag):  # another session built it while this one waited
            return tag
        with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
            root = Path(tmp) / "rootfs"
            cmd = ["debootstrap", f"--variant={variant}"]
            if packages:
                cmd.append("--include=" + ",".join(packages))
            cmd += [suite, str(root), _MIRROR]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"debootstrap failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, capture_output=True, text=True)
            tar.wait()
            if imported.returncode != 0:
                raise RuntimeError(f"docker import failed: {imported.stderr}")
    return tag


def registry_access_args() -> list[str]:
    """`docker run` arguments that let a container reach the package registries as this host does."""
    args = ["--network", "host"]
    if _CA_BUNDLE.is_file():
        args += ["-v", f"{_CA_BUNDLE}:/etc/agentrl-host-ca.crt:ro",
                 "-e", "PIP_CERT=/etc/agentrl-host-ca.crt",
                 "-e", "SSL_CERT_FILE=/etc/agentrl-host-ca.crt",
                 "-e", "REQUESTS_CA_BUNDLE=/etc/agentrl-host-ca.crt"]
    return args
