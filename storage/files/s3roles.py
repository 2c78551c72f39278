"""An assumed IAM role whose credentials refresh themselves: ``assume_role`` in S3 storage options.

``{"assume_role": {"RoleArn": "arn:aws:iam::123456789012:role/train"}}`` beside the
credentials allowed to assume it (``key``/``secret``/``token``, a ``profile``, or the usual
chain: environment, instance or pod role). Both S3 clients of a store, s3fs's for its own
reads and writes and boto3's for the transfers, call STS AssumeRole when first used and again
before the role's credentials expire (botocore's refreshing credentials), so a job that runs
for days keeps saving. The other keys are AssumeRole's own: ``RoleSessionName`` (a
``ckptflow-…`` name by default), ``DurationSeconds``, ``ExternalId``, ``Policy`` ... STS is
reached as botocore configures it: ``AWS_ENDPOINT_URL_STS`` or the profile's
``endpoint_url`` for a server other than AWS.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from ..errors import StorageUnavailableError

ROLE_KEY = "assume_role"
SOURCE_KEYS = ("key", "secret", "token", "profile")
METHOD = "ckptflow-assume-role"


def role_arguments(options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(RoleArn, the other AssumeRole arguments)`` of ``options``, None without a role."""
    role = options.get(ROLE_KEY)
    if role is None:
        return None
    arn = role.get("RoleArn") if isinstance(role, dict) else None
    if not isinstance(arn, str) or not arn:
        raise StorageUnavailableError(
            f"the storage option {ROLE_KEY} must be an object with a RoleArn, e.g. "
            '{"assume_role": {"RoleArn": "arn:aws:iam::123456789012:role/NAME"}} '
            "(other keys: AssumeRole's RoleSessionName, DurationSeconds, ExternalId, ...)"
        )
    extra = {k: v for k, v in role.items() if k != "RoleArn"}
    if "SerialNumber" in extra or "TokenCode" in extra:
        raise StorageUnavailableError(
            f"the storage option {ROLE_KEY} names an MFA device (SerialNumber/TokenCode): a role that "
            "needs a one-time code cannot be assumed again unattended when its credentials expire; "
            "use a role without MFA, or assume it yourself and pass its key, secret and token"
        )
    extra.setdefault("RoleSessionName", f"ckptflow-{uuid.uuid4().hex[:12]}")
    return arn, extra


def boto3_session(options: dict[str, Any]) -> Any:
    """A boto3 session with the credentials ``options`` give: keys, a profile, the default chain,
    or, with ``assume_role``, the role's (assumed from those, and again before they expire)."""
    import boto3
    import botocore.session
    from botocore.credentials import (
        AssumeRoleCredentialFetcher,
        CredentialProvider,
        CredentialResolver,
        DeferredRefreshableCredentials,
    )

    region = (options.get("client_kwargs") or {}).get("region_name")
    source = boto3.session.Session(
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        aws_session_token=options.get("token"),
        profile_name=options.get("profile"),
        region_name=region,
    )
    role = role_arguments(options)
    if role is None:
        return source
    fetcher = AssumeRoleCredentialFetcher(
        source.client, _SourceCredentials(source), role[0], extra_args=role[1]
    )
    credentials = DeferredRefreshableCredentials(fetcher.fetch_credentials, METHOD)

    class RoleProvider(CredentialProvider):
        METHOD = CANONICAL_NAME = METHOD

        def load(self) -> Any:
            return credentials

    core = botocore.session.Session()
    core.register_component("credential_provider", CredentialResolver([RoleProvider()]))
    return boto3.session.Session(botocore_session=core, region_name=region)


def s3fs_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options for ``options``: unchanged without ``assume_role``; with it, an aiobotocore
    session whose credentials are the role's (refreshing) in place of the source credentials.
    One session per distinct role and source in a process, so that fsspec's cache of
    filesystems (keyed by their options) holds one filesystem per store, not one per open."""
    if role_arguments(options) is None:
        return options
    source = {k: options.get(k) for k in (*SOURCE_KEYS, ROLE_KEY)}
    source["region"] = (options.get("client_kwargs") or {}).get("region_name")
    kept = {k: v for k, v in options.items() if k not in (*SOURCE_KEYS, ROLE_KEY)}
    return {**kept, "session": _role_session(json.dumps(source, sort_keys=True))}


@functools.lru_cache(maxsize=16)
def _role_session(frozen: str) -> Any:
    options = json.loads(frozen)
    role = role_arguments(options)
    assert role is not None
    from aiobotocore.credentials import (
        AioAssumeRoleCredentialFetcher,
        AioCredentialResolver,
        AioDeferredRefreshableCredentials,
    )
    from aiobotocore.session import AioSession
    from botocore.credentials import CredentialProvider

    source = AioSession(profile=options.get("profile"))
    if options.get("key"):
        source.set_credentials(options["key"], options.get("secret"), options.get("token"))
    region = options["region"]

    def sts_client(service: str, **kwargs: Any) -> Any:
        return source.create_client(service, region_name=region, **kwargs)

    fetcher = AioAssumeRoleCredentialFetcher(
        sts_client, _AioSourceCredentials(source), role[0], extra_args=role[1]
    )
    credentials = AioDeferredRefreshableCredentials(fetcher.fetch_credentials, METHOD)

    class RoleProvider(CredentialProvider):
        METHOD = CANONICAL_NAME = METHOD

        async def load(self) -> Any:
            return credentials

    session = AioSession()
    session.register_component("credential_provider", AioCredentialResolver([RoleProvider()]))
    return session


class _SourceCredentials:
    """The credentials a role is assumed with, taken from their session when needed (a profile's
    or an instance role's refresh themselves)."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def get_frozen_credentials(self) -> Any:
        import botocore.exceptions

        credentials = self._session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        return credentials.get_frozen_credentials()


class _AioSourceCredentials(_SourceCredentials):
    async def get_frozen_credentials(self) -> Any:
        import botocore.exceptions

        credentials = await self._session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        return await credentials.get_frozen_credentials()
