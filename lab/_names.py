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

#: The characters no tag holds: whitespace (what ``str.isspace`` calls so), control and
#: format characters (Unicode Cc and Cf: invisible, or moving text about on a terminal) and
#: private-use ones. Written out, not read from `unicodedata`, so that the rule is the same
#: on every Python and fits a regular expression (the server's OpenAPI document states it).
NOT_IN_TAG = (
    "\x00- \x7f-\xa0\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u1680\u180e"
    "\u2000-\u200f\u2028-\u202f\u205f-\u2064\u2066-\u206f\u3000\ue000-\uf8ff\ufeff"
    "\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f\U000f0000-\U000ffffd"
    "\U00100000-\U0010fffd"
)
#: A tag: 1 to `TAG_LIMIT` characters, none of `NOT_IN_TAG`, not starting with ``+`` or
#: ``-`` (``lab tag`` reads those as add and remove).
TAG = re.compile(f"^[^+\\-{NOT_IN_TAG}][^{NOT_IN_TAG}]{{0,{TAG_LIMIT - 1}}}$")


def check_tags(tags: Sequence[str] | str) -> list[str]:
    """Tags as a list, each checked (`TAG`): a non-empty string of at most `TAG_LIMIT`
    characters, with no whitespace, control or format character, and not starting with
    ``+`` or ``-`` (``lab tag`` reads those as add and remove). A `ConfigError` names the bad
    one."""
    if isinstance(tags, str):
        raise ConfigError(f"tags={tags!r}: give a list of tags, e.g. [{tags!r}]")
    out = []
    for tag in tags:
        if not isinstance(tag, str) or TAG.fullmatch(tag) is None or not _utf8(tag):
            raise ConfigError(
                f"tag {tag!r}: use 1 to {TAG_LIMIT} printable characters, no spaces, not "
                "starting with + or -"
            )
        out.append(tag)
    return out


def _utf8(text: str) -> bool:
    """Whether `text` is valid unicode (no lone surrogate), as the store must encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
