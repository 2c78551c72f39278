from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.prefect_server import PrefectServer, start_prefect_server, talking_to


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real `prefect server start` on 127.0.0.1; this process's Prefect client talks to it."""
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    try:
        with talking_to(server):
            yield server
    finally:
        server.stop()
