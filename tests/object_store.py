"""An S3-compatible server on the loopback address (moto), for the object-store checkpoint tests.

The credentials and endpoint go into this process's environment, which the ranks and the
launcher inherit, as a cloud job's would come from its node; the secret is distinctive so a test
can show it appears in no log and no file the job writes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

SECRET = "meshtrain-test-secret-5f3a9c"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """``s3://<bucket>`` on a moto server of this module's own."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "meshtrain-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the moto server did not start"
                time.sleep(0.2)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("checkpoints")
        try:
            yield "s3://checkpoints"
        finally:
            server.terminate()
            server.wait(timeout=30)
