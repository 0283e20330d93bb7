"""Typed readers for configuration from the environment.

Each helper fails loudly (``ImproperlyConfigured``) on a value it cannot parse, naming the
variable and what it expected, so a typo in a deployment stops start-up instead of silently
running with a default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import overload

from django.core.exceptions import ImproperlyConfigured

from collectors.knowledge.kubernetes import TAINT_EFFECTS

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# Each reader takes the environment to read (``env``, default os.environ): a cluster's own
# settings (collectors/sources.py) are read by the same rules from its entry over it.
Env = Mapping[str, str]


def _raw(name: str, env: Env | None = None) -> str | None:
    value = (os.environ if env is None else env).get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


# With a str default the answer is always a str: settings read this way need no None checks.
@overload
def env_str(name: str, default: str, env: Env | None = None) -> str: ...
@overload
def env_str(name: str, default: None = None, env: Env | None = None) -> str | None: ...
def env_str(name: str, default: str | None = None, env: Env | None = None) -> str | None:
    value = _raw(name, env)
    return default if value is None else value


def env_bool(name: str, default: bool, env: Env | None = None) -> bool:
    value = _raw(name, env)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None,
            env: Env | None = None) -> int:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from exc
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfigured(f"{name}={parsed} must be at least {minimum}")
    return parsed


def env_float(name: str, default: float, *, minimum: float | None = None,
              env: Env | None = None) -> float:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from exc
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfigured(f"{name}={parsed} must be at least {minimum}")
    return parsed


def env_list(name: str, default: Iterable[str], env: Env | None = None) -> list[str]:
    value = _raw(name, env)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: Iterable[str], env: Env | None = None) -> str:
    allowed = list(choices)
    value = _raw(name, env)
    if value is None:
        return default
    if value not in allowed:
        raise ImproperlyConfigured(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def env_subset(name: str, default: Iterable[str], choices: Iterable[str], env: Env | None = None) -> list[str]:
    allowed = list(choices)
    values = env_list(name, default, env)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ImproperlyConfigured(
            f"{name} names unknown entries {', '.join(unknown)}; known: {', '.join(allowed)}"
        )
    return values


def env_map(name: str, keys: Iterable[str], values: Iterable[str]) -> dict[str, str]:
    """``key=value,key=value`` with both sides checked, e.g. per-playbook modes."""
    known_keys, known_values = list(keys), list(values)
    out: dict[str, str] = {}
    for item in env_list(name, []):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in known_keys or value not in known_values:
            raise ImproperlyConfigured(
                f"{name}: {item!r} is not KEY=VALUE with KEY one of {', '.join(known_keys)} "
                f"and VALUE one of {', '.join(known_values)}")
        out[key] = value
    return out


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_CRON_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
                 "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *"}


def env_schedule(name: str, env: Env | None = None) -> float | str | None:
    """When something recurs: ``None`` (unset or empty: never), an interval in seconds
    ("90s", "30m", "6h", "1d", or a plain number of seconds), or a five-field cron expression
    ("0 3 * * *", minute hour day-of-month month day-of-week, UTC; @hourly, @daily, @weekly
    and @monthly stand for theirs), returned as its five fields. A cron expression is checked
    with Celery's own parser, so one the beat could not read stops start-up here."""
    value = _raw(name, env)
    if value is None:
        return None
    value = _CRON_ALIASES.get(value.lower(), value)
    fields = value.split()
    if len(fields) == 5:
        from celery.schedules import crontab_parser

        limits = ((60, 0), (24, 0), (31, 1), (12, 1), (7, 0))
        for field_text, (size, first) in zip(fields, limits, strict=True):
            try:
                crontab_parser(size, first).parse(field_text)
            except ValueError as exc:
                raise ImproperlyConfigured(
                    f"{name}={value!r}: {field_text!r} is not a cron field ({exc})") from None
        return " ".join(fields)
    unit = value[-1].lower() if value[-1].isalpha() else "s"
    number = value[:-1] if value[-1].isalpha() else value
    try:
        seconds = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ImproperlyConfigured(
            f"{name}={value!r} is neither an interval (90s, 30m, 6h, 1d) nor a cron expression "
            "of five fields (0 3 * * *)") from None
    if seconds < 1:
        raise ImproperlyConfigured(f"{name}={value!r}: an interval of at least one second")
    return seconds
# The key of a per-pool map's value for every pool not named (FLEETWATCH_LEND_FLOOR="25%,gpu=4").
EVERY_POOL = "*"


def env_per_pool(name: str, default: str, check: Callable[[str], str | None],
                 env: Env | None = None) -> dict[str, str]:
    """``VALUE`` for every pool and ``POOL=VALUE`` for one, comma-separated: "25%,gpu=4"
    (``*=25%`` says the same as ``25%``). ``check(value)`` answers what is wrong with a value,
    or None. The answer always holds ``EVERY_POOL``."""
    out = {EVERY_POOL: default}
    for item in env_list(name, [], env):
        pool, sep, value = item.partition("=")
        pool, value = (pool.strip(), value.strip()) if sep else (EVERY_POOL, item.strip())
        problem = "no pool name before '='" if not pool else check(value)
        if problem:
            raise ImproperlyConfigured(f"{name}: {item!r}: {problem} (expected VALUE or "
                                       "POOL=VALUE, comma-separated)")
        out[pool] = value
    return out


def env_labels(name: str, default: Mapping[str, str], env: Env | None = None) -> dict[str, str]:
    """Kubernetes labels as ``key=value,key2=value2`` (a value may be empty: ``key=``)."""
    raw = _raw(name, env)
    if raw is None:
        return dict(default)
    out: dict[str, str] = {}
    for item in env_list(name, [], env):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or any(c.isspace() for c in key.strip() + value.strip()):
            raise ImproperlyConfigured(f"{name}: {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def env_taints(name: str, env: Env | None = None) -> list[tuple[str, str, str]]:
    """Kubernetes taints as ``key=value:Effect`` or ``key:Effect``, comma-separated."""
    out = []
    for item in env_list(name, [], env):
        spec, _, effect = item.rpartition(":")
        key, _, value = spec.partition("=")
        if not key.strip() or effect not in TAINT_EFFECTS:
            raise ImproperlyConfigured(f"{name}: {item!r} is not key[=value]:Effect with Effect "
                                       f"one of {', '.join(TAINT_EFFECTS)}")
        out.append((key.strip(), value.strip(), effect))
    return out


def env_taint_keys(name: str, env: Env | None = None) -> list[str]:
    """Taints to remove, as ``kubectl taint NODE KEY[:Effect]-`` names them: ``key`` (every
    effect) or ``key:Effect``, comma-separated."""
    out = []
    for item in env_list(name, [], env):
        key, sep, effect = item.partition(":")
        if not key.strip() or (sep and effect not in TAINT_EFFECTS):
            raise ImproperlyConfigured(f"{name}: {item!r} is not key or key:Effect with Effect "
                                       f"one of {', '.join(TAINT_EFFECTS)}")
        out.append(item.strip())
    return out
