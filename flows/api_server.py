"""A temporary Prefect API server for `ckptflow run` when no API is configured.

Prefect starts one itself on the first API call (its ``SubprocessASGIServer``),
but first imports the whole server application into the calling process:
2.4-2.6 s here, holding the GIL while this process imports torch and builds
the model. This module starts the server with Prefect's own command instead,
``prefect server start``, in a child process (so the same database under
PREFECT_HOME), and points PREFECT_API_URL at it before this process imports
Prefect. The command's flags leave out what a run of one local flow has no use
for: the UI, the scheduler and the late-runs service.

What must hold:

- A configured API is never overridden: whether one is set (environment,
  profile, ``prefect.toml``, ``.env``) is asked of Prefect's own settings, in
  a child process, so this process has not loaded them yet. If that check
  fails, nothing is started and Prefect's own mechanism takes over; if
  temporary servers are turned off (PREFECT_SERVER_ALLOW_EPHEMERAL_MODE) and
  no API is set, the run stops with a message saying so.
- The server does not outlive this process: it is stopped at exit, and on
  Linux the kernel stops it if this process dies (SIGKILL included). That
  signal comes when the *thread* that started the server ends, so start it
  from a thread that lives as long as the process.
- The server outlives a stop of this process: a Ctrl-C reaches the terminal's
  whole process group, and SLURM's ``scancel --signal=TERM`` every process of
  the job step. The run saves where it stands and reports it through the
  server, so the server runs in a session of its own and ignores SIGINT and
  SIGTERM (:data:`STOP_SIGNAL`, SIGUSR1, stops it). Before, it died with the
  run, and the run then waited for hours on an API that was gone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from ckptflow.tasks.training.lifetime import command

log = logging.getLogger(__name__)

_CHECK = (
    "from prefect.settings import get_current_settings as g; s = g(); "
    "print(s.api.url or ('' if s.server.ephemeral.enabled else 'no-ephemeral'))"
)
NO_EPHEMERAL = "no-ephemeral"  # no API configured, and the user turned temporary servers off
# `prefect server start`'s own flags (Prefect 3.8 and 3.9 name them alike): the API with the
# services that record events and task runs, and no UI, scheduler or late-runs service. Prefect's
# other housekeeping services (foreman, repossessor, cancellation cleanup, pause expirations) run
# as on any server, on the database under PREFECT_HOME.
SERVER_FLAGS = ("--no-ui", "--no-scheduler", "--no-late-runs", "--log-level", "ERROR")
STOP_SIGNAL = signal.SIGUSR1  # what stops the server (uvicorn's graceful exit); it ignores the rest


class ApiServerError(RuntimeError):
    """The temporary API server did not come up."""


def configured_api_url() -> str | None:
    """The API URL Prefect's settings give (None: none configured), asked of a child process.

    ``NO_EPHEMERAL``: none, and PREFECT_SERVER_ALLOW_EPHEMERAL_MODE is off (Prefect then says so).

    Raises ``OSError``/``subprocess.SubprocessError`` when it cannot tell.
    """
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise subprocess.SubprocessError(proc.stderr.strip()[-500:])
    return proc.stdout.strip() or None


class TemporaryApiServer:
    """``prefect server start`` on a free port of 127.0.0.1, for as long as this process lives.

    The port is picked here and handed to Prefect, which binds it again: another process could
    take it in between. Then either Prefect exits unable to bind it, or another server answers
    there (seen by the listening socket not being our process's), and the start is tried again
    on another port, as Prefect's own temporary server does.
    """

    ATTEMPTS = 3

    def __init__(self) -> None:
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (the server's output, kept for errors)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout: float) -> None:
        """Start it and wait until ``/api/health`` answers; stop it and raise ApiServerError if not."""
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        tries = 0
        while tries < self.ATTEMPTS:
            tries += 1
            self._spawn()
            outcome = self._wait(deadline)
            if outcome == "ours":
                return
            self.stop()
            if outcome != "taken":
                break
        assert self.process is not None
        why = (
            f"did not answer within {timeout:g}s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
            if outcome == "slow"
            else f"exited with code {self.process.returncode}"
            if outcome == "exited"
            else f"found its port taken by another process {tries} times"
        )
        raise ApiServerError(f"the temporary Prefect API server {why}; its output:\n{self._tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(STOP_SIGNAL)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def _spawn(self) -> None:
        self.port = _free_port()
        self._output.seek(0)
        self._output.truncate()
        self.process = subprocess.Popen(
            command(  # the kernel sends STOP_SIGNAL when this process dies (PR_SET_PDEATHSIG)
                STOP_SIGNAL,
                __name__,  # main() below: `prefect server start`, shielded from stop signals
                *("server", "start", "--host", "127.0.0.1", "--port", str(self.port)),
                *SERVER_FLAGS,
            ),
            env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C to the terminal's process group does not reach it
        )

    def _wait(self, deadline: float) -> str:
        """ "ours": our server answers; "taken": another process holds the port (it answered, or
        ours exited unable to bind it); "exited": ours failed otherwise; "slow": the deadline."""
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return "taken" if _in_use(self.port) else "exited"
            if self._answers():
                return "ours" if _listens(self.process.pid, self.port) else "taken"
            time.sleep(0.1)
        return "slow"

    def _answers(self) -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response,
        ):
            return bool(response.status == 200)
        return False

    def _tail(self) -> str:
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-2000:]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on ``port`` (read from /proc; where
    there is none, the server that answered is taken to be ours)."""
    try:
        tables = [Path(t).read_text() for t in ("/proc/net/tcp", "/proc/net/tcp6") if Path(t).exists()]
        fds = Path(f"/proc/{pid}/fd")
        if not tables or not fds.exists():
            return True
    except OSError:
        return True
    inodes = {
        f"socket:[{fields[9]}]"
        for table in tables
        for fields in (line.split() for line in table.splitlines()[1:])
        if len(fields) > 9 and fields[1].endswith(f":{port:04X}") and fields[3] == "0A"  # LISTEN
    }
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def start_for_cli() -> TemporaryApiServer | None:
    """Start a temporary server and set PREFECT_API_URL, unless an API is configured (call before
    importing prefect). None: an API is configured, or the check failed and Prefect decides."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    try:
        configured = configured_api_url()
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("could not read Prefect's settings in a child process: %s", exc)
        return None
    if configured == NO_EPHEMERAL:
        raise ApiServerError(
            "no Prefect API is configured and temporary servers are turned off "
            "(PREFECT_SERVER_ALLOW_EPHEMERAL_MODE): set PREFECT_API_URL to a running server "
            "(prefect server start)"
        )
    if configured:
        return None
    server = TemporaryApiServer()
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 60)
    server.start(max(timeout, 20.0))
    os.environ["PREFECT_API_URL"] = server.api_url
    return server


def main(args: list[str]) -> None:
    """``prefect server start ARGS`` ignoring SIGINT and SIGTERM, which are meant for the run that
    started it (a Ctrl-C, SLURM's signal to every process of a job step); :data:`STOP_SIGNAL` is
    the one uvicorn handles, as it would handle those."""
    import runpy

    import uvicorn.server

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    uvicorn.server.HANDLED_SIGNALS = (STOP_SIGNAL,)  # type: ignore[assignment]
    sys.argv = ["prefect", *args]
    runpy.run_module("prefect", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
