"""Children that end with the process that started them (:mod:`ckptflow.tasks.training.lifetime`).

The flow's process starts its training process and its temporary API server so;
those cases, end to end, are in test_trainer_process.py and test_api_server.py.
Here the launcher itself, ``python -m ckptflow.tasks.training.lifetime SIGNAL PARENT MODULE ARGS...``:

- with PARENT its parent, it runs ``python -m MODULE ARGS...``;
- with PARENT ended before the child asked for its signal (the kernel would
  then never send it), the child sends the signal to itself and runs nothing;
- its parent SIGKILLed, the child gets the signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ckptflow.tasks.training.lifetime import command
from tests.pipeline.helpers import gone, wait_until


def test_it_runs_the_module_with_its_arguments(tmp_path):
    doc = tmp_path / "doc.json"
    doc.write_text('{"b": 1, "a": [2]}')
    cmd = command(signal.SIGTERM, "json.tool", "--sort-keys", str(doc))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"a": [2], "b": 1}
    assert done.stdout.startswith('{\n    "a"')  # sorted and indented: the arguments reached json.tool


def test_a_parent_gone_before_the_child_asked_ends_the_child_at_once(tmp_path):
    """The parent named is not the child's parent any more: as if it died before prctl took effect."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    doc = tmp_path / "doc.json"
    doc.write_text("{}")
    cmd = command(signal.SIGTERM, "json.tool", str(doc))
    cmd[cmd.index("SIGTERM") + 1] = str(dead.pid)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == ""  # json.tool never ran


def test_a_killed_parent_takes_the_child_along():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, subprocess, sys, time\n"
            "from ckptflow.tasks.training.lifetime import command\n"
            "child = subprocess.Popen(command(signal.SIGTERM, 'timeit', '-n1', '-r1', '-s', 'import time',"
            " 'time.sleep(600)'))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(2)  # most likely past its prctl by now; before it, the child's own check ends it
        assert not gone(child)
    finally:
        parent.kill()
        parent.wait(30)
    try:
        wait_until(lambda: gone(child), 15, "end of the child of a killed parent")
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)
