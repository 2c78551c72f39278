"""`ckptflow run` without a configured API starts its own temporary server, and never outlives it.

The server (flows/api_server.py) is found by what it carries: its command line
runs `prefect server start` and its environment holds the test's own PREFECT_HOME.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ckptflow.flows.api_server import NO_EPHEMERAL, configured_api_url
from tests.pipeline.helpers import REPO
from tests.pipeline.specs import MARKED_SPEC, MARKERS_ENV, SLOW_FROM_ENV, SLOW_SECONDS_ENV, SPEC_CONFIG
from tests.prefect_server import prefect_env

pytestmark = pytest.mark.prefect
CKPTFLOW = str(Path(sys.executable).parent / "ckptflow")


def servers_of(home: Path) -> list[int]:
    """Pids of `server start` processes (ckptflow's shielded `prefect server start`) whose environment
    has PREFECT_HOME=home."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"\0server\0start\0--host\0" in cmdline and f"PREFECT_HOME={home}".encode() in environ:
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run_args(storage: Path, epochs: int) -> list[str]:
    spec = ["--spec", MARKED_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    return [CKPTFLOW, "run", "--storage", str(storage), "--epochs", str(epochs), *spec]


def spec_env(home: Path) -> dict[str, str]:
    """The environment of a run with no API configured, where the test specs import."""
    return {**prefect_env(home), "PYTHONPATH": str(REPO)}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_run_starts_a_temporary_server_and_stops_it(tmp_path):
    home = tmp_path / "prefect-home"
    proc = run(run_args(tmp_path / "store", 2), spec_env(home))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "store").glob("v*")) == ["v000001", "v000002"]
    assert (home / "prefect.db").exists()  # the server's database is Prefect's own, under PREFECT_HOME
    assert servers_of(home) == []


def test_the_server_dies_with_a_killed_run(tmp_path):
    """SIGKILL runs no exit handler: the kernel stops the server (PR_SET_PDEATHSIG)."""
    home = tmp_path / "prefect-home"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**spec_env(home), MARKERS_ENV: str(markers), SLOW_FROM_ENV: "1", SLOW_SECONDS_ENV: "0.5"}
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            run_args(tmp_path / "store", 50), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        started = wait_until(lambda: any(markers.iterdir()), 240)
        assert started, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        [server] = servers_of(home)
        assert_runs_the_api_alone(server)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert wait_until(lambda: servers_of(home) == [], 15), servers_of(home)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_to_the_whole_process_group_stops_the_run_not_its_server(tmp_path, sig):
    """SLURM's ``scancel --signal=TERM`` reaches every process of the job step, a Ctrl-C the
    terminal's whole process group, ``kill -- -PGID`` the same. Before, the temporary server died
    with the run it serves: the run saved where it stood and then waited (hours) on an API that
    was gone. Now the server ignores them: the run saves, reports, ends with 128+N at once, and
    then stops its server."""
    home = tmp_path / "prefect-home"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**spec_env(home), MARKERS_ENV: str(markers), SLOW_FROM_ENV: "1", SLOW_SECONDS_ENV: "0.5"}
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            run_args(tmp_path / "store", 50),
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a shell gives a command
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's Ctrl-C
        )
    try:
        started = wait_until(lambda: len(list(markers.iterdir())) >= 2, 240)
        assert started, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        assert len(servers_of(home)) == 1
        os.killpg(proc.pid, sig)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    out = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 128 + sig, out[-3000:]
    assert "Error logging to API" not in out and "All connection attempts failed" not in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "store").glob("v*")), out[-3000:]
    assert wait_until(lambda: servers_of(home) == [], 15), servers_of(home)


def test_an_api_set_in_a_profile_is_used_not_replaced(prefect_server, tmp_path):
    """Prefect's settings come from more than the environment: a profile names the server here."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text(
        f'active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "{prefect_server.api_url}"\n'
    )
    env = spec_env(home)
    assert configured_api_url_in(env) == prefect_server.api_url
    storage = tmp_path / "store"
    proc = run(run_args(storage, 1), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (home / "prefect.db").exists()  # no temporary server ran

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    assert [r for r in runs if r.parameters.get("config", {}).get("storage") == str(storage)]


def test_no_api_configured_reads_as_none(tmp_path):
    assert configured_api_url_in(prefect_env(tmp_path / "empty-home")) is None


def test_temporary_servers_turned_off_start_none(tmp_path):
    """PREFECT_SERVER_ALLOW_EPHEMERAL_MODE=false: no server is started; one line says what to do."""
    home = tmp_path / "prefect-home"
    env = {**spec_env(home), "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false"}
    assert configured_api_url_in(env) == NO_EPHEMERAL
    proc = run(run_args(tmp_path / "store", 1), env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: no Prefect API is configured and temporary servers are turned off "
        "(PREFECT_SERVER_ALLOW_EPHEMERAL_MODE): set PREFECT_API_URL to a running server "
        "(prefect server start)"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("v*"))
    assert not (home / "prefect.db").exists()


def configured_api_url_in(env: dict[str, str]) -> str | None:
    """configured_api_url() as a process with ``env`` sees it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return configured_api_url()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def assert_runs_the_api_alone(pid: int) -> None:
    """The server answers on 127.0.0.1 with Prefect's own settings: no UI, scheduler or late runs
    (a run of one local flow needs none), and the services that record events and task runs on."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    port = int(args[args.index(b"--port") + 1])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/admin/settings", timeout=10) as response:
        server = json.load(response)["server"]
    assert server["ui"]["enabled"] is False
    assert server["services"]["scheduler"]["enabled"] is False
    assert server["services"]["late_runs"]["enabled"] is False
    assert server["services"]["event_persister"]["enabled"] is True
    assert server["services"]["task_run_recorder"]["enabled"] is True


def test_a_port_another_server_takes_is_given_up_for_a_free_one(tmp_path, monkeypatch):
    """The port is picked, released, then bound by Prefect: a process that takes it in between
    (here one answering /api/health, as another run's temporary server would) is not mistaken for
    ours; the start goes on on another port, and PREFECT_API_URL would name our own server."""
    import http.server
    import threading

    from ckptflow.flows import api_server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    taken = int(foreign.server_address[1])
    first = iter([taken])
    free_port = api_server._free_port
    monkeypatch.setattr(api_server, "_free_port", lambda: next(first, 0) or free_port())
    for name, value in prefect_env(tmp_path / "prefect-home").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    server = api_server.TemporaryApiServer()
    try:
        server.start(180)
        assert server.port != taken
        assert server.process is not None and server.process.poll() is None
        assert api_server._listens(server.process.pid, server.port)
        assert not api_server._listens(server.process.pid, taken)
        with urllib.request.urlopen(f"{server.api_url}/admin/settings", timeout=10) as response:
            assert json.load(response)["server"]["ui"]["enabled"] is False  # Prefect's, not the stub
    finally:
        server.stop()
        foreign.shutdown()
        foreign.server_close()
