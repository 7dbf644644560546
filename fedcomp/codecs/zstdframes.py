"""Zstandard frames for the codecs: compression, and decompression that cannot be bombed.

Used by the lossless stage (fedcomp.codecs.entropy) and sparseq's index section. A
frame is inflated only when it declares its content size, that size is within the
caller's bound (and equals what the payload claims, when it claims one), and the body
is exactly one frame: a decompression bomb, a lying size, trailing bytes or a corrupt
frame are a PayloadError before anything beyond the bound is allocated.
"""

from __future__ import annotations

from types import ModuleType

from fedcomp.codecs.wire import PayloadError


def zstd(required_by: str) -> ModuleType:
    """The ``zstandard`` module, or a ValueError naming the extra to install."""
    try:
        import zstandard
    except ImportError:  # pragma: no cover - depends on the installation
        raise ValueError(
            f"{required_by} needs the zstandard package: pip install 'fedcomp[entropy]'"
        ) from None
    return zstandard


def available() -> bool:
    try:
        zstd("")
    except ValueError:  # pragma: no cover - depends on the installation
        return False
    return True


def compress(data: bytes, level: int = 3) -> bytes:
    """One zstd frame that declares its content size."""
    return zstd("zstd").ZstdCompressor(level=level, write_content_size=True).compress(data)


def inflate(frame: bytes, *, limit: int, what: str, expected: int | None = None) -> bytes:
    """The content of exactly one frame of at most ``limit`` bytes (``expected``: the
    size the payload claims, which the frame must declare too)."""
    try:
        zstandard = zstd(what)
    except ValueError as exc:
        raise PayloadError(str(exc)) from None
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"{what}: not a zstd frame ({exc})") from None
    if expected is not None and size != expected:
        raise PayloadError(
            f"{what}: the frame declares {size} bytes, the header {expected}",
            field="decompressed size",
            value=size,
            expected=expected,
        )
    if not 0 <= size <= limit:
        raise PayloadError(f"{what}: the frame declares {size} bytes (at most {limit})")
    # A streaming object, to see the frame end exactly where the body ends (one-shot
    # decompression ignores trailing bytes); libzstd stops at the declared size.
    stream = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = stream.decompress(frame)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"{what}: corrupt zstd frame ({exc})") from None
    if not stream.eof or stream.unused_data or len(out) != size:
        raise PayloadError(
            f"{what}: the body is not exactly one zstd frame of {size} bytes "
            f"({len(out)} decompressed, {len(stream.unused_data)} bytes after it)"
        )
    return out
