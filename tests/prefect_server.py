"""A real Prefect server for tests: `prefect server start` on a free 127.0.0.1 port.

It runs with a temporary PREFECT_HOME (its own SQLite database), analytics off,
and is stopped (SIGTERM, then SIGKILL) by whoever started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port

STARTUP_TIMEOUT = float(os.environ.get("CKPTFLOW_TEST_PREFECT_STARTUP", "180"))


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        PREFECT_LOGGING_LEVEL="INFO",
        PREFECT_UI_ENABLED="true",
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


@dataclass
class PrefectServer:
    home: Path
    port: int
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def env(self) -> dict[str, str]:
        return prefect_env(self.home, self.api_url)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start_prefect_server(home: Path) -> PrefectServer:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = home / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--analytics-off",
    ]
    env = prefect_env(home)
    # The UI asks the server where its API is; without this it would say 127.0.0.1:4200.
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = PrefectServer(home, port, proc, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{server.api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"prefect server did not answer within {STARTUP_TIMEOUT}s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def talking_to(server: PrefectServer) -> Iterator[None]:
    """This process's Prefect client talks to ``server``, in every thread.

    Prefect read its settings when it was imported: a thread without the test's context (a
    reader thread that logs, say) would use those and start a temporary server of its own,
    which also stalls Prefect's shared event loop while it starts. Refreshing the global
    settings makes every thread see the environment set here, as in a process started with it.
    """
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    names = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        PREFECT_API_URL=server.api_url,
        PREFECT_HOME=str(server.home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    prefect.context.refresh_global_settings_context()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_HOME: server.home}):
            yield
    finally:
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # ship buffered run logs while the server is still up
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        prefect.context.refresh_global_settings_context()
