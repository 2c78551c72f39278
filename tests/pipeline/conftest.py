from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.prefect_server import PrefectServer, start_prefect_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real `prefect server start` on 127.0.0.1; this process's Prefect client talks to it."""
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    os.environ.update(
        PREFECT_API_URL=server.api_url,
        PREFECT_HOME=str(server.home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_HOME: server.home}):
            yield server
    finally:
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # ship buffered run logs while the server is still up
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
