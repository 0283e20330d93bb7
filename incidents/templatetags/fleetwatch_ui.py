"""Display helpers for the pages: times in UTC with a relative reading, durations, URLs.

Only formatting lives here; what to show comes from the selectors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from collectors.roles import actor_shown

register = template.Library()


def relative(value: datetime, now: datetime | None = None) -> str:
    """'12 s ago', '3 min ago', '2 h ago', '4 d ago'; 'in 3 min' for the future."""
    now = now or timezone.now()
    seconds = (now - value).total_seconds()
    future, seconds = seconds < 0, abs(seconds)
    if seconds < 5:
        return "just now"
    text = duration_text(seconds, parts=1)
    return f"in {text}" if future else f"{text} ago"


def duration_text(seconds: float | None, parts: int = 2) -> str:
    """Seconds as a person reads them: '850 ms', '42 s', '3 min 5 s', '2 h 10 min', '3 d 4 h'."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    for i, (name, size) in enumerate(units):
        if seconds >= size:
            text = f"{int(seconds // size)} {name}"
            if parts > 1 and i + 1 < len(units):
                # One finer unit, when it is not zero: "3 min 5 s", "2 h", "1 d 4 h".
                finer_name, finer_size = units[i + 1]
                finer = int(seconds % size) // finer_size
                if finer:
                    text += f" {finer} {finer_name}"
            return text
    return f"{seconds:.0f} s"


@register.filter
def when(value: datetime | None) -> SafeString | str:
    """``<time>`` with the ISO instant (machine-readable), the UTC time and how long ago."""
    if value is None:
        return "-"
    utc = value.astimezone(UTC)
    # data-show: static/fleetwatch/times.js rewrites it in the zone the person chose.
    return format_html('<time datetime="{}" title="{}" data-show="full">{} UTC · {}</time>',
                       utc.isoformat(timespec="seconds").replace("+00:00", "Z"),
                       utc.strftime("%Y-%m-%d %H:%M:%S UTC"),
                       utc.strftime("%Y-%m-%d %H:%M:%S"), relative(value))


@register.filter
def ago(value: datetime | None) -> SafeString | str:
    """Only the relative reading, the UTC time in the tooltip and the datetime attribute."""
    if value is None:
        return "never"
    utc = value.astimezone(UTC)
    return format_html('<time datetime="{}" title="{}" data-show="ago">{}</time>',
                       utc.isoformat(timespec="seconds").replace("+00:00", "Z"),
                       utc.strftime("%Y-%m-%d %H:%M:%S UTC"), relative(value))


@register.filter
def duration(value: float | timedelta | None) -> str:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    return duration_text(value)


@register.filter
def ms_duration(value: float | None) -> str:
    return "-" if value is None else duration_text(value / 1000)


@register.filter
def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


@register.simple_tag(takes_context=True)
def query_with(context: dict[str, Any], **changes: Any) -> str:
    """The current query string with some parameters changed (pagination, group links):
    filters survive paging. A value of None or "" drops the parameter."""
    request = context["request"]
    params = request.GET.copy()
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = value
    encoded = params.urlencode()
    return f"?{encoded}" if encoded else "?"


@register.filter
def startswith(value: str, prefix: str) -> bool:
    return str(value).startswith(prefix)


@register.filter
def get_item(mapping: dict[str, Any], key: str) -> Any:
    return mapping.get(key)


@register.filter
def lowerfirst(value: str) -> str:
    """A step title inside a sentence: "Drain the Slurm node" -> "drain the Slurm node"
    (``lower`` would also turn Slurm and Kubernetes into common nouns)."""
    text = str(value)
    return text[:1].lower() + text[1:]


@register.filter
def actor(value: str) -> str:
    """An audit actor (user:NAME, token:NAME, system) as a person reads it."""
    return actor_shown(value)


@register.filter
def reading(value: float | None, unit: str = "") -> SafeString | str:
    """A telemetry reading with its unit ("612 W", "1,980 MHz", "0.5"); where the source
    reported nothing, a dash that says so (never a 0)."""
    if value is None:
        return format_html('<span class="muted" title="not reported">-</span>')
    number = float(value)
    text = f"{number:,.0f}" if number.is_integer() or abs(number) >= 100 else f"{number:.1f}"
    return f"{text} {unit}" if unit else text
