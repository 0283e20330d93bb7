"""The API's JSON body parser: what the database cannot store is refused at the door.

DRF's own parser takes any JSON the standard library reads, and some of that breaks later, as
a 500 that the caller (a node agent) retries for ever:

- ``\\u0000`` in a string: PostgreSQL's text and jsonb cannot hold a NUL;
- a lone surrogate (``"\\ud800"``): not encodable as UTF-8, so PostgreSQL refuses it and on
  SQLite it is stored and then breaks every reader of the row;
- ``1e999`` (read as infinity) and the ``NaN``/``Infinity`` literals: not JSON numbers, and
  neither database takes them as such;
- an integer outside 64 bits: no integer column holds it;
- deep nesting: the standard library's reader recurses, and so do the serializers after it.

Each is a 400 whose ``detail`` names the field (``signals[3].extra.msg``), also given alone in
``field``, so a client can say which record of a batch is bad. A body that is not UTF-8 is a
400 too (``codecs`` raises ``UnicodeDecodeError``, a ``ValueError``, as DRF's parser does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# Deeper than any body the API documents (a push is four levels before its extra fields).
MAX_DEPTH = 32
_INT64 = 2**63


class _NonFinite(float):
    """A NaN/Infinity literal, kept until the walk can name where it was."""


def _constant(literal: str) -> _NonFinite:
    return _NonFinite(literal.replace("-Infinity", "-inf").replace("Infinity", "inf"))


class BodyRefused(ParseError):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__({"detail": f"{where or 'the body'}: {problem}", "field": where})


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "NUL characters (\\u0000) are not accepted"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (\\ud800-\\udfff) is not text; send valid UTF-16 pairs"
    return None


def json_check(value: Any, path: str = "", depth: int = 0) -> None:
    """Raise ``BodyRefused`` at the first value the database could not store."""
    if depth > MAX_DEPTH:
        raise BodyRefused(path, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        problem = _text_problem(value)
        if problem:
            raise BodyRefused(path, problem)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, float):
        if isinstance(value, _NonFinite) or not math.isfinite(value):
            raise BodyRefused(path, "not a finite number (NaN, Infinity and 1e999 are refused)")
    elif isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise BodyRefused(path, "integer out of range (64-bit signed)")
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = _text_problem(key)
            if problem:
                raise BodyRefused(path, f"a key: {problem}")
            json_check(item, _child(path, key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            json_check(item, _child(path, index), depth + 1)


class SafeJSONParser(JSONParser):
    """``application/json`` as DRF reads it, then checked by ``json_check``."""

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"JSON parse error - the body is not UTF-8 ({exc.reason} at byte "
                             f"{exc.start})") from None
        try:
            data = json.loads(text, parse_constant=_constant)
        except RecursionError:
            # The standard library's reader recurses once a level: far past MAX_DEPTH.
            raise BodyRefused("", f"nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        json_check(data)
        return data
