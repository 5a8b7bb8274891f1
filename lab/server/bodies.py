"""A batch's body, read within bounds: what a client sends costs the server no more memory
than its size says.

`--max-body` bounds the bytes a request sends; these bound what they decode to:

- **Arrow** (``/batches/metrics``): the stream's schema is checked before any buffer is
  read (the metric columns must have plain number and text types; other columns are never
  decoded), and each message's header is read before its body: a compressed stream is
  refused (its buffers could decode to a thousand times their size), and so is a stream of
  more than `MAX_BATCH_ROWS` rows. What is read is then the body's own bytes, without a copy.
- **JSON** (``/batches/ops``): a body of more than `MAX_JSON_VALUES` values (counted from its
  bytes before it is parsed: each value costs at most about 100 bytes once decoded) or more
  than `MAX_BATCH_OPS` operations is refused, and so is one nested too deep to parse.

Each refusal is a 413 (a 400 for a body that is not what it says) with one line that names
the limit. `lab`'s own client sends batches well inside them (`lab.store.http.sender`).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from lab._metrics import check_key
from lab.errors import LabError
from lab.server.rejected import Rejected

#: The most metric rows one Arrow batch may hold: twice what `lab`'s client sends in one.
MAX_BATCH_ROWS = 500_000
#: The most operations one JSON batch may hold: ten times what `lab`'s client sends in one.
MAX_BATCH_OPS = 10_000
#: The most values (objects, arrays, numbers, strings...) one JSON body may hold: about
#: 200 MB decoded at the very most, and room for an eval of 200,000 predictions.
MAX_JSON_VALUES = 2_000_000

#: The metric columns, their type on arrival (checked before any buffer is read) and as
#: stored; ``wall_time`` may be left out (the server's clock then).
METRIC_COLUMNS = {
    "run_id": "int64",
    "step": "int64",
    "key": "string",
    "value": "double",
    "wall_time": "double",
}

# Arrow's IPC message headers (format/Message.fbs): the union's types, and the fields of
# the tables read here, by their slot in the flatbuffer.
_SCHEMA, _DICTIONARY, _RECORD_BATCH = 1, 2, 3


def _bad_arrow(why: str) -> Rejected:
    return Rejected(400, f"the body is not an Arrow IPC stream ({why})", "body")


# -- Arrow --------------------------------------------------------------------------------------
def metric_columns(body: bytes) -> dict[str, list[Any]]:
    """The metric columns of an Arrow IPC stream as lists, checked and bounded (see the
    module's text); a `Rejected` naming what is wrong otherwise."""
    import pyarrow as pa

    schema = _check_stream(body)
    for name, kind in METRIC_COLUMNS.items():
        if name not in schema.names and name != "wall_time":
            raise Rejected(400, f"the Arrow body has no column {name!r} ({kind})", f"body.{name}")
    wanted = [i for i, name in enumerate(schema.names) if name in METRIC_COLUMNS]
    try:
        options = pa.ipc.IpcReadOptions(included_fields=wanted, use_threads=False)
        table = pa.ipc.open_stream(body, options=options).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise _bad_arrow(_first_line(exc)) from None
    columns: dict[str, list[Any]] = {}
    for name, kind in METRIC_COLUMNS.items():
        if name not in table.column_names:  # wall_time: the server's clock
            from datetime import UTC, datetime

            columns[name] = [datetime.now(UTC).timestamp()] * table.num_rows
            continue
        column = table.column(name)
        if column.null_count:
            raise Rejected(400, f"the Arrow column {name!r} holds nulls", f"body.{name}")
        columns[name] = _keys(column) if name == "key" else _values(column, name, kind)
    return columns


def _check_stream(body: bytes) -> Any:
    """The stream's schema, once every message's header has been read and none is
    compressed and the rows add up to no more than `MAX_BATCH_ROWS`; no buffer is decoded."""
    import pyarrow as pa

    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        first = reader.read_next_message()
        schema = pa.ipc.read_schema(first)
    except StopIteration:
        raise _bad_arrow("it is empty") from None
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise _bad_arrow(_first_line(exc)) from None
    _check_schema(schema)
    rows = 0
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            return schema
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise _bad_arrow(_first_line(exc)) from None
        kind, length, compressed = _batch_header(bytes(message.metadata))
        if compressed:
            raise Rejected(
                413,
                "the Arrow body is compressed, which the server does not accept (its buffers "
                "could decode to far more than --max-body); send the stream uncompressed",
                "body",
            )
        if kind == _RECORD_BATCH:
            rows += length
        if rows > MAX_BATCH_ROWS or length > MAX_BATCH_ROWS:
            raise Rejected(
                413,
                f"the Arrow body holds more than {MAX_BATCH_ROWS} rows, the most one batch may "
                "hold; send smaller batches",
                "body",
            )


def _check_schema(schema: Any) -> None:
    """Refuse a metric column of a type the server does not read, before any buffer is."""
    import pyarrow as pa

    def plain(kind: Any) -> bool:
        return (
            pa.types.is_integer(kind)
            or pa.types.is_floating(kind)
            or pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
        )

    for field in schema:
        if field.name not in METRIC_COLUMNS:
            continue  # never decoded
        kind = field.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not plain(kind):
            raise Rejected(
                400,
                f"the Arrow column {field.name!r} is {field.type}; send "
                f"{METRIC_COLUMNS[field.name]}",
                f"body.{field.name}",
            )


def _batch_header(meta: bytes) -> tuple[int, int, bool]:
    """(message type, rows, compressed) from an IPC message's flatbuffer header, read
    without decoding the message's body: rows and compression of a record batch, or of a
    dictionary batch's data; (type, 0, False) for any other message."""
    try:
        message = _table(meta, _offset(meta, 0))
        kind = meta[message(1)] if message(1) else 0
        if kind not in (_DICTIONARY, _RECORD_BATCH) or not message(2):
            return kind, 0, False
        header = _table(meta, _offset(meta, message(2)))
        if kind == _DICTIONARY:  # its `data` (slot 1) is a record batch
            if not header(1):
                return kind, 0, False
            header = _table(meta, _offset(meta, header(1)))
        length = struct.unpack_from("<q", meta, header(0))[0] if header(0) else 0
        return kind, max(length, 0), bool(header(3))  # slot 3: BodyCompression
    except (struct.error, IndexError, ValueError):
        raise _bad_arrow("a message header cannot be read") from None


def _offset(buf: bytes, at: int) -> int:
    """Where the uoffset stored at `at` points."""
    target = at + struct.unpack_from("<I", buf, at)[0]
    if not 0 <= target < len(buf):
        raise ValueError("an offset out of the header")
    return target


def _table(buf: bytes, at: int) -> Any:
    """The flatbuffer table at `at`: a function from a field's slot to its absolute position
    in `buf` (0 when the field is absent)."""
    vtable = at - struct.unpack_from("<i", buf, at)[0]
    if not 0 <= vtable < len(buf):
        raise ValueError("a vtable out of the header")
    size = struct.unpack_from("<H", buf, vtable)[0]

    def field(slot: int) -> int:
        where = 4 + 2 * slot
        if where + 2 > size:
            return 0
        relative = struct.unpack_from("<H", buf, vtable + where)[0]
        return at + relative if relative else 0

    return field


def _values(column: Any, name: str, kind: str) -> list[Any]:
    import pyarrow as pa

    try:
        return column.cast(kind).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise Rejected(
            400, f"the Arrow column {name!r} is {column.type}; send {kind}", f"body.{name}"
        ) from None


def _keys(column: Any) -> list[str]:
    """The key column as a list, each key checked once; a dictionary-encoded column (what
    `lab`'s client sends) is read through its dictionary, so its rows share their strings."""
    import pyarrow as pa

    keys: list[str] = []
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            words = _values(chunk.dictionary, "key", "string")
            for word in set(words):
                _check_key(word)
            keys += [words[i] for i in chunk.indices.to_pylist()]
        else:
            values = _values(chunk, "key", "string")
            for word in set(values):
                _check_key(word)
            keys += values
    return keys


def _check_key(key: str) -> None:
    try:
        check_key(key, 0)
    except LabError as exc:
        raise Rejected(400, str(exc), "body.key") from None


# -- JSON ---------------------------------------------------------------------------------------
def ops_body(raw: bytes) -> Any:
    """The parsed JSON of an ops batch, bounded (see the module's text): a `Rejected` for a
    body over `MAX_JSON_VALUES` values or `MAX_BATCH_OPS` operations (413), or one that is
    not JSON, is nested too deep, or is not ``{"client_id", "seq", "ops": [...]}`` (400)."""
    values = raw.count(b",") + raw.count(b"{") + raw.count(b"[") + 1  # a bound: strings count
    if values > MAX_JSON_VALUES:
        raise Rejected(
            413,
            f"the JSON body holds more than {MAX_JSON_VALUES} values, the most one batch may "
            "hold; send smaller batches",
            "body",
        )
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Rejected(400, "the body is nested too deep to be read as JSON", "body") from None
    except ValueError as exc:
        raise Rejected(400, f"the body is not JSON ({_first_line(exc)})", "body") from None
    if not isinstance(body, dict) or not isinstance(body.get("ops"), list):
        raise Rejected(400, 'the body must be {"client_id", "seq", "ops": [...]}', "body")
    if len(body["ops"]) > MAX_BATCH_OPS:
        raise Rejected(
            413,
            f"the batch holds {len(body['ops'])} ops; the server takes at most "
            f"{MAX_BATCH_OPS} in one batch; send smaller batches",
            "body.ops",
        )
    return body


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
