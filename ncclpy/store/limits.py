"""The store server's limits: one frozen record, from arguments, the environment, or defaults.

Precedence, per field: an explicit argument, else its environment variable, else the default.
Every variable is ``NCCLPY_STORE_`` + the field name in capitals:

* ``NCCLPY_STORE_MAX_KEY_SIZE`` (default 4096 bytes): longest key.
* ``NCCLPY_STORE_MAX_VALUE_SIZE`` (64 MiB): largest value; also bounds a key list in bytes.
* ``NCCLPY_STORE_MAX_CLIENTS`` (4096; a job's store: at least ``4 * world + 64``, see
  :meth:`StoreLimits.for_world`): concurrent connections; more are told why and closed.
* ``NCCLPY_STORE_MAX_KEYS_PER_REQUEST`` (4096): keys one ``wait``/``check`` may list; more are
  refused with an error naming the limit.
* ``NCCLPY_STORE_MAX_BUFFERED_BYTES`` (1 GiB): request bytes buffered over all connections
  (partial frames, pipelined requests, unsent copied replies); past it the connections holding
  the most are closed. Never below one largest request.
* ``NCCLPY_STORE_FRAME_TIMEOUT`` (30 s): a connection whose half-received request gets no new
  byte for this long is closed (an idle connection between requests is never closed).
* ``NCCLPY_STORE_AUTH_TIMEOUT`` (60 s): time a client has to authenticate (servers with a token).

Sizes accept a binary suffix (``64M``, ``1GiB``, ``512k``); times are seconds (float).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

from ..errors import ArgumentError

__all__ = ["StoreLimits", "ENV_PREFIX", "ENV_VARS", "parse_size"]

ENV_PREFIX = "NCCLPY_STORE_"
_MAX_SIZE = 1 << 30           # largest key / value a server may be configured for
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"4096"``, ``"64M"``, ``"64MiB"``, ``"1g"`` -> bytes (binary multiples)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512K, 64M, 1G)")
    return int(m.group(1)) * _SUFFIX[m.group(2).lower()]


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    """Bounds that keep one server safe from bad or greedy clients (see the module docstring)."""

    max_key_size: int = 4096
    max_value_size: int = 64 << 20
    max_clients: int = 4096
    max_keys_per_request: int = 4096
    max_buffered_bytes: int = 1 << 30
    frame_timeout: float = 30.0
    auth_timeout: float = 60.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ArgumentError(f"{f.name}: expected an int >= 1, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ArgumentError(f"{f.name}: expected seconds > 0, got {v!r}")
        if self.max_key_size > _MAX_SIZE or self.max_value_size > _MAX_SIZE:
            raise ArgumentError(f"max_key_size/max_value_size: at most 1 GiB each (got "
                                f"{self.max_key_size}, {self.max_value_size})")

    @classmethod
    def resolve(cls, limits: Optional["StoreLimits"] = None,
                env: Optional[Mapping[str, str]] = None, **overrides) -> "StoreLimits":
        """``overrides`` (None entries ignored) over ``limits`` over ``$NCCLPY_STORE_*`` over
        the defaults. ``env`` defaults to ``os.environ``; ``limits`` given means its fields win
        over the environment."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ArgumentError(f"unknown store limit(s): {', '.join(unknown)} (known: "
                                f"{', '.join(names)})")
        if limits is not None and not isinstance(limits, cls):
            if isinstance(limits, Mapping):
                limits = cls.resolve(None, env, **dict(limits))
            else:
                raise ArgumentError(f"limits: expected StoreLimits or a dict, got "
                                    f"{type(limits).__name__}")
        values = {}
        if limits is None:
            environ = os.environ if env is None else env
            for name, f in names.items():
                var = ENV_PREFIX + name.upper()
                raw = environ.get(var)
                if raw is None or not raw.strip():
                    continue
                try:
                    values[name] = (parse_size(raw) if f.type in ("int", int)
                                    else float(raw))
                except ValueError as e:
                    raise ArgumentError(f"${var}={raw!r}: {e}") from None
        else:
            values = dataclasses.asdict(limits)
        from_env = set(values) if limits is None else set()
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ArgumentError as e:
            bad = [n for n in from_env if overrides.get(n) is None and str(e).startswith(n)]
            if bad:
                raise ArgumentError(f"{e} (from ${ENV_PREFIX}{bad[0].upper()})") from None
            raise


def _for_world(cls, world: int, env: Optional[Mapping[str, str]] = None) -> "StoreLimits":
    """The limits of a job's store for ``world`` ranks: ``max_clients`` at least
    ``4 * world + 64`` (a connection per rank, a spare while another thread's call is parked,
    a probe, launchers and tools), unless ``$NCCLPY_STORE_MAX_CLIENTS`` says otherwise."""
    environ = os.environ if env is None else env
    base = cls.resolve(None, env)
    if (environ.get(ENV_PREFIX + "MAX_CLIENTS") or "").strip():
        return base
    return dataclasses.replace(base, max_clients=max(base.max_clients, 4 * int(world) + 64))


StoreLimits.for_world = classmethod(_for_world)  # type: ignore[attr-defined]

ENV_VARS = tuple(ENV_PREFIX + f.name.upper() for f in dataclasses.fields(StoreLimits))
