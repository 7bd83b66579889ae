"""Requests as the server reads them: a bounded body, JSON or a form, each field checked, every
refusal a `Refused` with its HTTP status and a message that names the field.

Why by hand rather than pydantic models: LibreTranslate's fields are loosely typed (`q` a string or
a list; `alternatives` a number or a numeric string from a form), its errors are
``{"error": "..."}`` with its own status codes, and a refusal must name the field the client got
wrong; a schema library's 422 with a list of locations is what no LibreTranslate client expects.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from nmt_cli.errors import shown
from nmt_cli.inference.translate import clean_line


class Refused(Exception):
    """A request the server will not serve: its HTTP status, the message, and headers to send."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass(frozen=True)
class Limits:
    max_chars: int  # per text
    max_texts: int  # per request
    max_body_bytes: int
    max_beam: int


def body_fields(raw: bytes, content_type: str) -> dict[str, Any]:
    """The request's fields: a JSON object, or a form (LibreTranslate accepts both)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused(400, f"the request body is not valid UTF-8 (byte {e.start + 1})") from None
    form_type = content_type.split(";")[0].strip().lower() == "application/x-www-form-urlencoded"
    if form_type and not text.lstrip().startswith("{"):  # `curl -d '{...}'` labels JSON a form
        form = urllib.parse.parse_qs(text, keep_blank_values=True)
        return {k: (v[0] if len(v) == 1 else v) for k, v in form.items()}
    if not text.strip():
        raise Refused(400, "the request body is empty: send a JSON object, e.g. "
                           '{"q": "Hello", "source": "en", "target": "de"}')
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError) as e:
        raise Refused(400, f"the request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise Refused(400, f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def texts_of(data: dict[str, Any], name: str, limits: Limits) -> tuple[list[str], bool]:
    """(the texts of field `name`, whether it was one string): each cleaned as `nmt translate` cleans
    a line (control and line-separating characters become spaces), so one text gives one output."""
    if name not in data:
        raise Refused(400, f"missing field '{name}': the text to translate (a string or a list of strings)")
    value = data[name]
    single = isinstance(value, str)
    texts = [value] if single else value
    if not isinstance(texts, list):
        raise Refused(400, f"'{name}' must be a string or a list of strings, got {shown(value)}")
    if not texts:
        raise Refused(400, f"'{name}' is an empty list: give at least one text")
    if len(texts) > limits.max_texts:
        raise Refused(413, f"'{name}' has {len(texts)} texts; at most {limits.max_texts} a request")
    out = []
    for i, text in enumerate(texts):
        where = name if single else f"{name}[{i}]"
        if not isinstance(text, str):
            raise Refused(400, f"'{where}' must be a string, got {shown(text)}")
        if len(text) > limits.max_chars:
            raise Refused(413, f"'{where}' has {len(text)} characters; at most {limits.max_chars} a text")
        # lone surrogates (JSON's "\ud800") become U+FFFD, as invalid UTF-8 does in `nmt translate`
        out.append(clean_line(text.encode("utf-8", "surrogatepass"), i + 1, _quiet))
    return out, single


def _quiet(message: str) -> None:
    pass


def text_field(data: dict[str, Any], name: str, default: str | None = None) -> str:
    value = data.get(name, default)
    if value is None:
        raise Refused(400, f"missing field '{name}'")
    if not isinstance(value, str):
        raise Refused(400, f"'{name}' must be a string, got {shown(value)}")
    return value


def count_field(data: dict[str, Any], name: str, default: int, lowest: int, highest: int) -> int:
    """A whole number between `lowest` and `highest` (a numeric string, as a form sends, too)."""
    value = data.get(name, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(400, f"'{name}' must be a whole number, got {shown(value)}")
    if not lowest <= value <= highest:
        raise Refused(400, f"'{name}' must be between {lowest} and {highest} (the server's limit), "
                           f"got {value}")
    return value
