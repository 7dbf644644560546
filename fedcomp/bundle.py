"""Several named payloads in one bytes value: how a compressed message carries every
tensor's payload as ONE Flower object.

On a Deployment Engine each Flower object of a message (each record, each Array and
each of its chunks) is its own HTTP call with about 1 KB of headers, so a reply with
one Array per tensor costs two calls per tensor whatever its payload weighs. A bundle
is a single ``bytes`` value of the message's header ConfigRecord instead.

Layout (little-endian), version 1 (named)::

    magic b"FB" | u8 version | u32 count
    count x ( u16 name length | name, UTF-8 | u32 payload length )
    the payloads, in entry order, back to back

Version 2 (positional) leaves the names to the reader, who knows them (the model's
tensors, in model order: the compressed messages of protocol 3 use it, saving about
10 B per tensor)::

    magic b"FB" | u8 version | u32 count
    count x u32 payload length
    the payloads, in entry order, back to back

Version 3 (compact) is version 2 whose payloads are compact entries
(fedcomp.compact): each payload's header, which the reader knows, is one byte; the
reader passes the rule that rebuilds the headers and gets full payloads back (the
messages of protocol 4 use it, saving 19-31 B per tensor).

A positional bundle read without names comes back under its positions ("0", "1", ...);
read with names, its count must be theirs.

Every length is checked against what is left of the value before anything is sliced,
and the payload lengths must add up to exactly the bytes after the table: a bundle
costs its reader nothing beyond its own size.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

from fedcomp.compact import HeaderRule, compact_entry, expand_entry

BUNDLE_MAGIC = b"FB"
BUNDLE_VERSION = 1
#: The version whose names are the reader's (positional).
POSITIONAL_VERSION = 2
#: Positional, and every payload a compact entry (fedcomp.compact).
COMPACT_VERSION = 3
#: The longest tensor name a bundle carries (in UTF-8 bytes).
MAX_NAME_BYTES = 1024

_HEAD = struct.Struct("<2sBI")
_NAME = struct.Struct("<H")
_SIZE = struct.Struct("<I")


class BundleError(ValueError):
    """A bundle that cannot be read: truncated, inconsistent, or not the one expected."""


def pack_bundle(
    items: Mapping[str, bytes | bytearray | memoryview],
    *,
    named: bool = True,
    compact: bool = False,
    stored: bool = False,
) -> bytes:
    """One bytes value holding every named payload, in the mapping's order; with
    ``named=False`` a positional bundle (version 2): the names are not written, the
    reader passes them; with ``compact=True`` too, each payload is written as a
    compact entry (version 3; the payloads must be fedcomp payloads), or, with
    ``stored=True``, the items already are compact entries and are written as they are.

    Raises
    ------
    BundleError
        A name longer than :data:`MAX_NAME_BYTES`, a payload of 4 GiB or more, a
        compact bundle with names, or a payload a compact entry cannot hold.
    """
    if compact and named:
        raise BundleError("a compact bundle is positional (named=False)")
    if compact and not stored:
        try:
            items = {name: compact_entry(payload) for name, payload in items.items()}
        except ValueError as exc:
            raise BundleError(f"a payload a compact bundle cannot hold: {exc}") from exc
    table, bodies = [], []
    for name, payload in items.items():
        encoded = name.encode("utf-8")
        if len(encoded) > MAX_NAME_BYTES:
            raise BundleError(f"tensor name of {len(encoded)} bytes (max {MAX_NAME_BYTES})")
        if len(payload) >= 2**32:
            raise BundleError(f"{name}: a payload of {len(payload)} bytes (max 2**32 - 1)")
        if named:
            table += [_NAME.pack(len(encoded)), encoded]
        table.append(_SIZE.pack(len(payload)))
        bodies.append(bytes(payload))
    version = BUNDLE_VERSION if named else COMPACT_VERSION if compact else POSITIONAL_VERSION
    return b"".join([_HEAD.pack(BUNDLE_MAGIC, version, len(bodies)), *table, *bodies])


def is_positional(blob: object) -> bool:
    """Whether ``blob`` is a positional bundle, compact or not (what a tool that
    changes a message's payloads writes back, so the message keeps its format)."""
    return isinstance(blob, bytes) and blob[2:3] in (
        bytes([POSITIONAL_VERSION]),
        bytes([COMPACT_VERSION]),
    )


def is_compact(blob: object) -> bool:
    """Whether ``blob`` is a compact bundle (version 3)."""
    return isinstance(blob, bytes) and blob[2:3] == bytes([COMPACT_VERSION])


def repack_like(
    blob: object, items: Mapping[str, bytes | bytearray | memoryview], *, stored: bool = False
) -> bytes:
    """``items`` packed in the format of ``blob``: what a tool or a test that changes a
    message's payloads writes back, so the message keeps its format. ``items`` are full
    payloads, or with ``stored=True`` entries as the bundle stores them (a compact
    bundle's compact entries: ``unpack_bundle(..., expand=False)``)."""
    return pack_bundle(
        items, named=not is_positional(blob), compact=is_compact(blob), stored=stored
    )


def unpack_bundle(
    blob: object,
    *,
    max_entries: int,
    names: Sequence[str] | None = None,
    headers: HeaderRule | None = None,
    expand: bool = True,
) -> dict[str, memoryview]:
    """The named payloads of a bundle, as views into ``blob`` (nothing is copied but a
    compact bundle's entries, each expanded to its full payload).

    Parameters
    ----------
    blob : object
        What the message holds where the bundle should be (anything but ``bytes`` is
        refused).
    max_entries : int
        The most entries the reader accepts (checked before the table is read).
    names : sequence of str, optional
        The exact names expected, in order (the model's tensors); a positional bundle's
        entries take them (without them: "0", "1", ...).

    Raises
    ------
    BundleError
        Naming the first problem: not bytes, truncated, wrong magic or version, too
        many entries, a name that is not UTF-8 or repeats, lengths that do not add up
        to the value's size, names other than ``names``, a compact bundle without
        ``headers``, or an entry they refuse.
    """
    view, version, count = _read_head(blob)
    expected = max_entries if names is None else len(names)
    if count > max_entries or (names is not None and count != expected):
        bound = f"at most {max_entries}" if names is None else f"exactly {expected}"
        raise BundleError(f"the bundle claims {count} payloads, {bound} allowed")
    if version in (POSITIONAL_VERSION, COMPACT_VERSION):
        keys = list(names) if names is not None else [str(i) for i in range(count)]
        entries, offset = _read_sizes(view, keys)
    else:
        entries, offset = _read_table(view, count)
    sizes = sum(size for _, size in entries)
    if sizes != len(view) - offset:
        raise BundleError(
            f"the bundle's payload lengths add up to {sizes} bytes, {len(view) - offset} follow"
        )
    if names is not None and [n for n, _ in entries] != list(names):
        raise BundleError("the bundle's tensor names differ from the model's (or their order)")
    out: dict[str, memoryview] = {}
    for name, size in entries:
        out[name] = view[offset : offset + size]
        offset += size
    if version == COMPACT_VERSION and expand:
        return expand_entries(out, headers)
    return out


def expand_entries(
    entries: Mapping[str, memoryview], headers: HeaderRule | None
) -> dict[str, memoryview]:
    """A compact bundle's entries (``unpack_bundle(..., expand=False)``) as full
    payloads, each header rebuilt by ``headers`` (fedcomp.compact).

    Raises
    ------
    BundleError
        Entries without ``headers``, or an entry they refuse.
    """
    if not entries:
        return {}
    if headers is None:
        raise BundleError("a compact bundle, read without the rule for its payload headers")
    try:
        return {n: memoryview(expand_entry(e, n, headers)) for n, e in entries.items()}
    except ValueError as exc:
        raise BundleError(str(exc)) from exc


def _read_head(blob: object) -> tuple[memoryview, int, int]:
    """The bundle as a view, its version and its claimed count (magic and version
    checked)."""
    if not isinstance(blob, bytes):
        raise BundleError(f"the payload bundle is a {type(blob).__name__}, not bytes")
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise BundleError(f"truncated bundle: {len(view)} bytes, its header needs {_HEAD.size}")
    magic, version, count = _HEAD.unpack_from(view, 0)
    if magic != BUNDLE_MAGIC:
        raise BundleError(f"not a payload bundle (magic {bytes(magic)!r})")
    if version not in (BUNDLE_VERSION, POSITIONAL_VERSION, COMPACT_VERSION):
        raise BundleError(
            f"bundle format version {version}, this reads {BUNDLE_VERSION}, "
            f"{POSITIONAL_VERSION} and {COMPACT_VERSION}"
        )
    return view, version, count


def _read_sizes(view: memoryview, keys: list[str]) -> tuple[list[tuple[str, int]], int]:
    """A positional bundle's (name, size) entries, the names the reader's; the table's
    length is checked against the value first."""
    end = _HEAD.size + _SIZE.size * len(keys)
    if end > len(view):
        raise BundleError(f"truncated bundle: a table of {len(keys)} lengths does not fit")
    sizes = struct.unpack_from(f"<{len(keys)}I", view, _HEAD.size)
    return list(zip(keys, sizes, strict=True)), end


def _read_table(view: memoryview, count: int) -> tuple[list[tuple[str, int]], int]:
    """The (name, size) entries and where the payloads start; every read is bounded
    by the value's length first."""
    entries: list[tuple[str, int]] = []
    seen: set[str] = set()
    offset = _HEAD.size
    for i in range(count):
        if offset + _NAME.size > len(view):
            raise BundleError(f"truncated bundle: entry {i} of {count} is cut off")
        (length,) = _NAME.unpack_from(view, offset)
        end = offset + _NAME.size + length
        if length > MAX_NAME_BYTES or end + _SIZE.size > len(view):
            raise BundleError(f"entry {i}: a {length}-byte name does not fit the bundle")
        try:
            name = bytes(view[offset + _NAME.size : end]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"entry {i}: the name is not UTF-8 ({exc.reason})") from exc
        if name in seen:
            raise BundleError(f"entry {i}: tensor {name!r:.80} appears twice")
        seen.add(name)
        (size,) = _SIZE.unpack_from(view, end)
        entries.append((name, size))
        offset = end + _SIZE.size
    return entries, offset
