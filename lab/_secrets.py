"""Credentials never reach a message or a log line: `mask(text)` and the filter that applies it.

A store URL holds a password, a libpq connection string holds ``password=...``, an HTTP
header a bearer token, and a webhook URL is itself the token (its path). Drivers quote them
back in their errors: DuckDB's postgres scanner repeats the whole connection string when
ATTACH fails, and httpx logs every request's URL at INFO. So every error `lab` raises from
a URL goes through `mask`, and `MaskSecrets` is installed on lab's loggers and on httpx's
and httpcore's, so a record is masked before any handler (a file, pytest's capture, a
notebook) sees it, at every level.

>>> mask("postgresql://lab:hunter2@db:5432/lab")
'postgresql://lab:***@db:5432/lab'
>>> mask("host=db user=lab password='p w' dbname=lab")
'host=db user=lab password=*** dbname=lab'
>>> mask("Authorization: Bearer abc.def-123")
'Authorization: Bearer ***'
"""

from __future__ import annotations

import logging
import re
import threading

HIDDEN = "***"
_NOT_PLACEHOLDER = r"(?!(?:password|<password>|PASSWORD)@)"
#: Words where a value would be, left alone: a usage hint's placeholder (``Bearer <token>``),
#: and after ``name: `` (a colon and one space) a word of a sentence: a short lowercase word
#: followed by one space and another word that is no pair itself, as in "needs a token: set
#: LAB_TOKEN" or "LAB_TOKEN: it is wrong". Values are masked: "passwd: zz pwd=p1" and
#: "token: hunter2" hold values. Five letters at most, as `register` ignores strings under six.
_PROSE = r"<[\w-]+>(?![^\s'\";&])|(?<=: )(?-i:[a-z]{1,5}) (?!\S*[=:])(?=\S)"
#: a name that says its value is a secret (password, token, api_key, ...), anywhere in a
#: longer name: WANDB_API_KEY, --wandb-token, db.password
SECRET_NAME = (
    r"(?:password|passwd|pwd|passphrase|token|secret|api[_-]?key|apikey|access[_-]?key"
    r"|auth(?:orization)?|credentials?|private[_-]?key)"
)

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:PASSWORD@host (a password with "@" or "/" must be %-escaped in a URL); the
    # placeholder of a usage hint ("postgresql://user:password@host/dbname") is left alone
    (
        re.compile(
            rf"([A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:'\"]*:){_NOT_PLACEHOLDER}[^\s/@'\"]+(?=@)"
        ),
        r"\1***",
    ),
    # user:PASSWORD@host with no scheme in front (a URL missing its "postgresql://")
    (
        re.compile(rf"(?<![\w/:.%+-])([\w.%+-]+:){_NOT_PLACEHOLDER}[^\s/@:'\"]+(?=@[\w.\[\]-]+)"),
        r"\1***",
    ),
    # name=value and name: value pairs whose name says secret: libpq's password='x y', a
    # command line's --api-key=abc, WANDB_API_KEY=k, token=xyz, passwd: zz; an HTTP scheme
    # word after the separator (token: Bearer x) is kept, and so is a word of a sentence
    # (_PROSE). The name's tail is bounded, so a long run of word characters costs linear time.
    (
        re.compile(
            rf"(?i)({SECRET_NAME}(?:[_.-][\w.-]{{0,63}})?\s*[=:]\s*(?:(?:bearer|basic|token)\s+)?+)"
            rf"(?!{_PROSE})('(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^\s'\";&]+)"
        ),
        r"\1***",
    ),
    # a password or token in a dict or JSON: 'password': 'x', "token": "x"
    (
        re.compile(
            r"(?i)(['\"](?:password|passwd|token|access_token|api_key|apikey|secret)['\"]\s*:\s*)"
            r"(['\"])(?:(?!\2).)*\2"
        ),
        r"\1\2***\2",
    ),
    # HTTP credentials: a bearer token anywhere, any scheme's credentials in Authorization
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*"), r"\1***"),
    (
        re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(?!bearer\b)((?:\w+\s+)?)[^\s'\"]+"),
        r"\1\2***",
    ),
    # tokens in a query string
    (
        re.compile(
            r"(?i)([?&](?:access_token|token|api_key|apikey|key|secret|password|sig|signature|"
            r"auth)=)[^&\s'\"#]+"
        ),
        r"\1***",
    ),
    # a `lab serve` token (lab.server.auth): "lab_" and 43 URL-safe characters
    (re.compile(r"(?<![A-Za-z0-9])lab_[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"), HIDDEN),
    # well-known token formats: GitHub, Hugging Face, Slack, OpenAI, GitLab, AWS access keys
    (
        re.compile(
            r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{40,}|hf_[A-Za-z0-9]{16,}"
            r"|xox[abprs]-[A-Za-z0-9-]{10,}|sk-[A-Za-z0-9_-]{20,}|glpat-[A-Za-z0-9_-]{20,}"
            r"|AKIA[0-9A-Z]{16})\b"
        ),
        HIDDEN,
    ),
    # webhook URLs whose path is the token: Slack, Discord, Teams, Mattermost and the like
    (
        re.compile(
            r"(?i)(https?://(?:hooks\.slack\.com/(?:services|workflows|triggers)|"
            r"(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks|"
            r"[\w.-]+\.webhook\.office\.com/webhookb2|[\w.:-]+/hooks)/)[^\s'\"<>]+"
        ),
        r"\1***",
    ),
)

# Whether a text may hold a credential at all: one scan, so that the common message, which
# holds none, skips the patterns above. Each alternative is a substring that some pattern
# cannot match without; it is searched in the lowered text, which is several times faster
# than a case-insensitive search.
_MAYBE = re.compile(
    r"://|pass|pwd|bearer|auth|[?&][a-z_]+=|:[^\s@]+@|token|secret|api[_-]?key"
    r"|access[_-]?key|credential|private[_-]?key|gh[pousr]_|github_pat_|hf_|xox|sk-|glpat-|akia"
    r"|lab_"
)

# literal secrets registered at run time (a Notifier's URL path), longest first; replaced
# whole under the lock, so `mask` reads a consistent tuple without taking it
_known: tuple[str, ...] = ()
_known_lock = threading.Lock()


def register(secret: str) -> None:
    """Mask `secret` wherever it appears from now on (in this process).

    For secrets no pattern recognizes, such as the path of a webhook URL on a host of your
    own. Strings shorter than 6 characters are ignored: masking them would garble messages.
    """
    global _known
    if isinstance(secret, str) and len(secret) >= 6:
        with _known_lock:
            if secret not in _known:
                _known = tuple(sorted({*_known, secret}, key=len, reverse=True))


def register_url(url: str) -> None:
    """Register the secret part of a URL whose path (or query) is a token: all after the host."""
    match = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#]+([/?#].*)?$", url or "")
    tail = match.group(1) if match else None
    if tail and tail not in ("/", "?", "#"):
        register(tail)


def mask(text: str) -> str:
    """`text` with every credential it holds replaced by ``***``: URL passwords, the value of
    each ``name=value`` or ``name: value`` whose name says secret (libpq's ``password=...``,
    ``--api-key=...``, ``WANDB_API_KEY=...``), bearer and basic tokens, token query
    parameters, well-known token formats (GitHub, Hugging Face, Slack, OpenAI, GitLab, AWS),
    webhook paths, and the secrets passed to `register`. The one masker of lab: errors, log
    records, notifications and the recorded command line all go through it.

    >>> mask("train.py --api-key=abc token=xyz passwd: zz")
    'train.py --api-key=*** token=*** passwd: ***'
    """
    if not text:
        return text
    for secret in _known:
        if secret in text:
            text = text.replace(secret, "/" + HIDDEN if secret.startswith("/") else HIDDEN)
    if not _MAYBE.search(text.lower()):
        return text
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class MaskSecrets(logging.Filter):
    """Masks a log record's message, arguments and traceback before any handler sees it."""

    @staticmethod
    def _mask_args(record: logging.LogRecord) -> bool:
        """Mask a record's arguments one by one, keeping them a tuple (uvicorn's access
        formatter unpacks them), if that alone leaves no credential in the message."""
        if not isinstance(record.args, tuple) or not record.args:
            return False
        msg, args = record.msg, record.args
        record.msg = mask(msg) if isinstance(msg, str) else msg
        record.args = tuple(mask(a) if isinstance(a, str) else a for a in args)
        try:
            message = record.getMessage()
        except Exception:
            message = None
        if message is not None and mask(message) == message:
            return True
        record.msg, record.args = msg, args
        return False

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; never drop it."""
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error report
            return True
        masked = mask(message)
        if masked != message and not self._mask_args(record):
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask(record.exc_text)
        if record.stack_info:
            record.stack_info = mask(record.stack_info)
        return True


_FILTER = MaskSecrets()

#: Third-party loggers that print URLs: httpx logs each request line at INFO, httpcore
#: its connections at DEBUG. A filter on a logger applies only to records made on it,
#: not to those of its children, so each one is named.
THIRD_PARTY = (
    "httpx",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)


def logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` with `MaskSecrets` installed: how every lab module logs."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


for _name in ("lab", *THIRD_PARTY):
    logger(_name)
