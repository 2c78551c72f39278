"""Credentials for the pipeline's storage: never parameters, always Prefect blocks or the environment.

Prefect stores a run's parameters in clear and shows them in the UI, so the
config refuses credential-looking keys in any ``*_options`` (see
:func:`credential_keys`). Credentials reach fsspec the usual AWS ways (the
environment, an AWS profile, an instance role) or through a Prefect block
named by ``storage_secret`` / ``archive.upload_secret``:

- ``NAME`` or ``secret/NAME``: a Secret block whose value is a JSON object of
  fsspec options, merged into the options (``client_kwargs`` merged key by key);
- ``aws-credentials/NAME``: a prefect-aws ``AwsCredentials`` block (install
  ``prefect-aws``), with its region and endpoint. A block that names only a
  profile passes the profile on: s3fs and boto3 resolve it themselves and
  refresh the temporary credentials it yields (an assumed role, SSO, a
  ``credential_process``) before they expire. A block with ``assume_role_arn``
  passes the role on (``assume_role`` in the options) with the block's own
  keys or profile: the role is assumed where the store is used, and again
  before its credentials expire. Static keys are passed as they are; only a
  role that needs an MFA ``TokenCode`` is assumed once, when the options are
  built, and its keys frozen.

The block is loaded inside the run, on the machine that runs it; what it holds
is never logged, put in an artifact or written to a manifest.
"""

from __future__ import annotations

import json
from typing import Any

SECRET_PREFIX = "secret/"
AWS_PREFIX = "aws-credentials/"

CREDENTIAL_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "session_token",
        "security_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "credentials",
    }
)


def credential_keys(options: Any, prefix: str = "") -> list[str]:
    """Paths of keys that look like credentials, anywhere in nested options."""
    found: list[str] = []
    if isinstance(options, dict):
        for name, value in options.items():
            path = f"{prefix}{name}"
            if str(name).lower() in CREDENTIAL_KEYS:
                found.append(path)
            found.extend(credential_keys(value, f"{path}."))
    return found


def check_block_ref(ref: str | None, field: str) -> str | None:
    """Refuse a block reference of an unknown kind (before the run starts)."""
    if ref is None:
        return None
    kind, _, name = ref.rpartition("/")
    if not name.strip() or kind not in ("", "secret", "aws-credentials"):
        raise ValueError(
            f"{field} {ref!r} must name a Prefect block: 'NAME' or 'secret/NAME' (a Secret block holding "
            "fsspec options as JSON) or 'aws-credentials/NAME' (a prefect-aws AwsCredentials block)"
        )
    return ref


def with_secret(options: dict[str, Any], block_ref: str | None) -> dict[str, Any]:
    """fsspec ``options`` with the options of the block ``block_ref`` merged in (call inside a run)."""
    if not block_ref:
        return dict(options)
    if block_ref.startswith(AWS_PREFIX):
        secret = aws_block_options(block_ref.removeprefix(AWS_PREFIX))
    else:
        secret = secret_block_options(block_ref.removeprefix(SECRET_PREFIX))
    merged = {**options, **secret}
    for nested in ("client_kwargs", "config_kwargs"):
        if isinstance(options.get(nested), dict) and isinstance(secret.get(nested), dict):
            merged[nested] = {**options[nested], **secret[nested]}
    return merged


def secret_block_options(name: str) -> dict[str, Any]:
    """The JSON object of fsspec options held by the Secret block ``name``."""
    from prefect.blocks.system import Secret

    block: Any = Secret.load(name)  # sync in a sync context
    value = block.get()
    secret = json.loads(value) if isinstance(value, str) else value
    if not isinstance(secret, dict):
        raise ValueError(f"the Secret block {name!r} must hold a JSON object of fsspec options")
    return secret


def aws_block_options(name: str) -> dict[str, Any]:
    """s3fs options from the prefect-aws ``AwsCredentials`` block ``name``."""
    try:
        from prefect_aws import AwsCredentials
    except ImportError:
        raise ValueError(
            f"'{AWS_PREFIX}{name}' names an AwsCredentials block, which needs prefect-aws: "
            "pip install prefect-aws (on the machine that runs the flow)"
        ) from None
    block: Any = AwsCredentials.load(name)  # sync in a sync context
    return aws_credentials_options(block, name)


def aws_credentials_options(block: Any, name: str) -> dict[str, Any]:
    """s3fs options (key, secret, token, region, endpoint) of an ``AwsCredentials`` block."""
    session = block.get_boto3_session()
    credentials = session.get_credentials()
    if credentials is None:
        raise ValueError(
            f"the AwsCredentials block {name!r} resolves to no credentials: set its keys, a profile "
            "that exists on this machine, or a role to assume"
        )
    options: dict[str, Any]
    role = block.assume_role_kwargs.get_params_override() if block.assume_role_arn else {}
    if block.assume_role_arn and not {"SerialNumber", "TokenCode"} & set(role):  # MFA: frozen below
        # The role is assumed where the options are used, from the block's own credentials, and
        # again before its credentials expire (the session above only proved it can be assumed).
        options = _source_options(block)
        options["assume_role"] = {"RoleArn": block.assume_role_arn, **role}
    elif block.profile_name and not block.aws_access_key_id:
        options = {"profile": block.profile_name}  # resolved, and refreshed, where it is used
    else:
        frozen = credentials.get_frozen_credentials()
        options = {"key": frozen.access_key, "secret": frozen.secret_key}
        if frozen.token:
            options["token"] = frozen.token
    client_kwargs: dict[str, Any] = {}
    if session.region_name:
        client_kwargs["region_name"] = session.region_name
    params = block.aws_client_parameters
    if params.endpoint_url:
        options["endpoint_url"] = params.endpoint_url
    if not params.use_ssl:
        options["use_ssl"] = False
    if params.verify_cert_path:
        client_kwargs["verify"] = str(params.verify_cert_path)
    elif params.verify is False:
        client_kwargs["verify"] = False
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return options


def _source_options(block: Any) -> dict[str, Any]:
    """The block's own credentials, from which its role is assumed: its keys, else its profile
    (else none: the chain of the machine that uses them)."""
    if block.aws_access_key_id:
        options = {"key": block.aws_access_key_id}
        if block.aws_secret_access_key:
            options["secret"] = block.aws_secret_access_key.get_secret_value()
        if block.aws_session_token:
            options["token"] = block.aws_session_token
        return options
    return {"profile": block.profile_name} if block.profile_name else {}
