"""A real S3-compatible server for tests: versitygw (Versity S3 Gateway, Apache-2.0) with its
posix backend on a temp dir and a free loopback port.

Why versitygw: a real S3 server (SigV4, path-style requests, multipart, conditional writes with
``If-None-Match`` as ``deltalake`` commits use them), one static Go binary built from the Go
module proxy with the Go toolchain every machine of this kind has, starting in well under a
second. MinIO's module graph and build are larger; s3proxy (Java) needs its Maven dependency
tree and a JVM start per test run, and maps S3 onto jclouds rather than serving it. Built once into ``~/.cache/tidemark/bin`` (about 2.5 CPU-minutes and ~340 MB
of modules on a fresh machine), then reused: ``python -m tests.s3`` builds it ahead of the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VERSION = "v1.8.0"
MODULE = "github.com/versity/versitygw/cmd/versitygw"
ACCESS_KEY = "tidemark-test"
SECRET_KEY = "tidemark-test-secret"
REGION = "us-east-1"


class S3Unavailable(RuntimeError):
    """versitygw could not be built or did not start."""


def binary_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidemark" / "bin"
    return base / f"versitygw-{VERSION}"


def ensure_binary() -> Path:
    """The versitygw binary, built with ``go install`` into the cache when missing (idempotent:
    a finished build is renamed into place, so an interrupted one is never mistaken for it)."""
    target = binary_path()
    if target.is_file():
        return target
    go = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go", "/usr/lib/go/bin/go") if Path(p).is_file()), None)
    if go is None:
        raise S3Unavailable(f"the Go toolchain is needed to build the test S3 server ({MODULE}@{VERSION}); "
                            "install Go (>= 1.24), or put a versitygw binary at " + str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers may both get here: one builds, the other waits for it and reuses it
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        _build(go, target)
    return target


def _build(go: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        env = {**os.environ, "GOBIN": tmp, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath"}
        print(f"building the test S3 server: go install {MODULE}@{VERSION} (first time only)", file=sys.stderr, flush=True)
        done = subprocess.run([go, "install", "-ldflags=-s -w", f"{MODULE}@{VERSION}"], env=env, capture_output=True,
                              text=True, timeout=1800)
        built = Path(tmp) / "versitygw"
        if done.returncode != 0 or not built.is_file():
            raise S3Unavailable(f"go install {MODULE}@{VERSION} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        built.replace(target)


@dataclass(frozen=True)
class S3Server:
    """A running server: its endpoint and the root account's keys."""

    endpoint: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    def env(self) -> dict[str, str]:
        """The Tidemark settings that point at this server."""
        return {"TIDEMARK_S3_ENDPOINT": self.endpoint, "TIDEMARK_S3_ACCESS_KEY": self.access_key,
                "TIDEMARK_S3_SECRET_KEY": self.secret_key, "TIDEMARK_S3_REGION": self.region}

    def create_bucket(self, name: str) -> None:
        import pyarrow.fs as pafs

        host = self.endpoint.removeprefix("http://")
        fs = pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region=self.region,
                               endpoint_override=host, scheme="http", allow_bucket_creation=True)
        fs.create_dir(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_s3(root: Path) -> Iterator[S3Server]:
    """versitygw on ``127.0.0.1:<free port>`` serving the buckets under ``root``; stopped (and
    waited for) on exit, also when the body fails."""
    binary = ensure_binary()
    data, meta = root / "data", root / "meta"
    data.mkdir(parents=True, exist_ok=True)
    meta.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = root / "versitygw.log"
    # --sidecar: object metadata in files, so the temp dir needs no user xattrs (overlayfs, tmpfs).
    cmd = [str(binary), "--access", ACCESS_KEY, "--secret", SECRET_KEY, "--region", REGION,
           "--port", f"127.0.0.1:{port}", "posix", "--sidecar", str(meta), str(data)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise S3Unavailable(f"versitygw exited with {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise S3Unavailable(f"versitygw did not listen on port {port} within 30s; log {log}")
            time.sleep(0.1)
        yield S3Server(endpoint=f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    print(ensure_binary())
