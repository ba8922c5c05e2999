"""Reaching a Ray cluster's Jobs API: its address, the Ray auth token (looked up, never
printed: `mask_secrets`), the `JobSubmissionClient`, and `SubmitError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: where the Ray Jobs API listens when nothing else is said
DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
_ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


_MASK = "***"


class SubmitError(RuntimeError):
    """A submission that cannot be made as asked; one-paragraph message, no secret in it."""


class RayToken:
    """A Ray authentication token and where it was read from; `repr`/`str` hide the value."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        self._value = value
        self.source = source

    @property
    def value(self) -> str:
        return self._value

    def header(self) -> dict[str, str]:
        """The HTTP header the dashboard's token middleware checks."""
        return {"Authorization": f"Bearer {self._value}"}

    def __repr__(self) -> str:
        return f"RayToken(source={self.source!r})"

    __str__ = __repr__


def _read_token_file(path: Path, what: str) -> str:
    try:
        value = path.expanduser().read_text().strip()
    except OSError as error:
        raise SubmitError(f"cannot read the Ray token file {path} ({what}): {error.strerror or error}") from None
    if not value:
        raise SubmitError(f"the Ray token file {path} ({what}) is empty")
    return value


def resolve_ray_token(token_file: str | os.PathLike | None = None) -> RayToken | None:
    """The Ray token from `token_file`, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token (first found); None when there is none (a cluster without auth)."""
    if token_file is not None:
        path = Path(token_file)
        return RayToken(_read_token_file(path, "--token-file"), f"file {path}")
    value = os.environ.get(TOKEN_ENV, "").strip()
    if value:
        return RayToken(value, f"environment variable {TOKEN_ENV}")
    named = os.environ.get(TOKEN_PATH_ENV, "").strip()
    if named:
        path = Path(named)
        return RayToken(_read_token_file(path, TOKEN_PATH_ENV), f"file {path} ({TOKEN_PATH_ENV})")
    default = DEFAULT_TOKEN_FILE.expanduser()
    if default.is_file():
        return RayToken(_read_token_file(default, "default token file"), f"file {default}")
    return None


def mask_secrets(text: str, secret_values: Iterable[str | None]) -> str:
    """`text` with every occurrence of each (non-trivial) secret replaced by ***."""
    for value in secret_values:
        if value and len(value) >= 4:
            text = text.replace(value, _MASK)
    return text


def local_secrets(token: RayToken | None) -> list[str]:
    values = [
        token.value if token else None,
        os.environ.get("MLFLOW_TRACKING_PASSWORD"),
        os.environ.get("MLFLOW_TRACKING_TOKEN"),
    ]
    return [v for v in values if v]


def normalize_address(address: str | None) -> str:
    """The dashboard URL of `address` (http://HOST:PORT; HOST:PORT gets http://).

    None: RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else http://127.0.0.1:8265.
    """
    if address is None:
        for name in _ADDRESS_ENVS:
            if os.environ.get(name):
                address = os.environ[name]
                break
        else:
            address = DEFAULT_DASHBOARD_ADDRESS
    address = address.strip()
    if not address:
        raise SubmitError("--address is empty; expected the Ray dashboard URL, e.g. http://HEAD:8265")
    if address == "auto":
        raise SubmitError(
            "--address auto names a cluster from inside it; from outside give "
            "the dashboard URL of the head node, e.g. http://HEAD:8265"
        )
    if "://" not in address:
        address = f"http://{address}"
    scheme = address.split("://", 1)[0]
    if scheme not in ("http", "https", "ray"):
        raise SubmitError(
            f"--address {address!r}: expected http(s)://HEAD:8265 (the Ray "
            f"dashboard, which serves the Jobs API) or ray://HEAD:10001"
        )
    return address.rstrip("/")


@contextmanager
def _explicit_address() -> Iterator[None]:
    """Ray's client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address it is
    given; an address named on the command line must win, so hide them meanwhile."""
    saved = {name: os.environ.pop(name) for name in _ADDRESS_ENVS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def job_client(address: str | None, token_file: str | os.PathLike | None = None):
    """(JobSubmissionClient, RayToken | None) for the dashboard at `address`."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    url = normalize_address(address)
    token = resolve_ray_token(token_file)
    headers = token.header() if token else None
    try:
        with _explicit_address():
            client = JobSubmissionClient(url, headers=headers)
    except AuthenticationError as error:
        status = (
            "rejected the token from " + token.source
            if token
            else (
                "requires a token and none was found (looked at --token-file, "
                f"{TOKEN_ENV}, {TOKEN_PATH_ENV}, {DEFAULT_TOKEN_FILE})"
            )
        )
        detail = mask_secrets(str(error).split("\n")[0], local_secrets(token))
        raise SubmitError(f"the Ray cluster at {url} {status}: {detail}") from None
    except ConnectionError as error:
        detail = mask_secrets(str(error).split("\n")[0], local_secrets(token))
        raise SubmitError(
            f"cannot reach the Ray Jobs API at {url} ({detail}); is the head "
            f"node's dashboard running and reachable from here?"
        ) from None
    return client, token
