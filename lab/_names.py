"""What a name may be, and how free text is stored: the same on SQLite and on PostgreSQL.

SQLite stores a string of any length with any character in it; PostgreSQL refuses a value
longer than its ``varchar(n)`` column and any text that holds NUL, with a raw `DataError`
halfway through a run. So `lab` checks every name against the width of its column before
anything is written (`check_name`), and stores free text (errors, tracebacks, prediction
fields) with NUL replaced by U+FFFD (`storable_text`), on both backends alike.

>>> check_name("arm", "small", MAX_NAME)
'small'
>>> storable_text("bad\\x00byte")
'bad\\ufffdbyte'
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from lab.errors import ConfigError

#: Characters an experiment, arm or group name may hold: the width of their `name` columns.
MAX_NAME = 512
#: Characters a run key, an eval name or a metric key may hold: the width of their columns.
MAX_KEY = 255

NUL_REPLACEMENT = "\ufffd"


def check_name(kind: str, name: Any, limit: int) -> str:
    """`name` if the store can hold it as the name of a `kind`; else one `ConfigError` line
    that says what is wrong (empty, too long, a NUL, a lone surrogate) and the limit."""
    what = kind if kind.endswith("key") else f"{kind} name"  # "run key", "arm name"
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{what} {name!r} is not a non-empty string; give it a name")
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}..."
    if len(name) > limit:
        raise ConfigError(
            f"{what} {shown} is {len(name)} characters long; {what}s hold at most {limit}: "
            "shorten it"
        )
    if "\x00" in name:
        raise ConfigError(
            f"{what} {shown} holds a NUL character (\\x00), which the store cannot hold: remove it"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{what} {shown} is not valid unicode (a lone surrogate): fix its encoding"
        ) from None
    return name


def storable_text(text: str | None) -> str | None:
    """Free text as the store keeps it: NUL becomes U+FFFD (PostgreSQL cannot store NUL), and
    a lone surrogate U+FFFD too (UTF-8 cannot encode it); the rest is kept as it is."""
    if text is None:
        return None
    if "\x00" in text:
        text = text.replace("\x00", NUL_REPLACEMENT)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join(NUL_REPLACEMENT if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text


TAG_LIMIT = 64  # characters in one tag, as W&B


def check_tags(tags: Sequence[str] | str) -> list[str]:
    """Tags as a list, each checked: a non-empty string of at most `TAG_LIMIT` characters,
    with no whitespace, and not starting with ``+`` or ``-`` (``lab tag`` reads those as
    add and remove). A `ConfigError` names the bad one."""
    if isinstance(tags, str):
        raise ConfigError(f"tags={tags!r}: give a list of tags, e.g. [{tags!r}]")
    out = []
    for tag in tags:
        if (
            not isinstance(tag, str)
            or not tag
            or len(tag) > TAG_LIMIT
            or tag[0] in "+-"
            or any(c.isspace() or not c.isprintable() for c in tag)
        ):
            raise ConfigError(
                f"tag {tag!r}: use 1 to {TAG_LIMIT} printable characters, no spaces, not "
                "starting with + or -"
            )
        out.append(tag)
    return out


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(name: str, *, limit: int = 64) -> str:
    """A folder name for `name`: safe on every filesystem, and distinct for distinct names.

    >>> safe_name("small")
    'small'
    >>> safe_name("../../x")
    'x-9bdbf20b'
    """
    slug = _SAFE.sub("-", name).strip("-.")[:limit] or "x"
    if slug == name:
        return slug
    return f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
