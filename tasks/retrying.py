"""How ckptflow's I/O tasks retry: exponential backoff with jitter, no result caching.

Caching stays off: task inputs are live training objects (a store, a model),
which Prefect must neither hash nor persist.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff


def io_task(name: str, *, retries: int = 3, backoff: float = 1.0, **options: Any) -> Any:
    """``@task`` for an idempotent I/O step: ``retries`` with backoff ``backoff * 2**n`` s and 50% jitter."""
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=retries,
        retry_delay_seconds=exponential_backoff(backoff),
        retry_jitter_factor=0.5,
        **options,
    )
