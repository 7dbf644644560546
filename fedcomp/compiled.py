"""Numba, optional (the ``fast`` extra): imported on first use, compiled kernels cached.

Two parts of fedcomp have compiled kernels: the one-bit joint decoder
(:mod:`fedcomp.onebit.decode_compiled`) and the rotation codecs' encoders and decoders
(:mod:`fedcomp.codecs.rotation_compiled`). Each falls back to NumPy/torch code when
:func:`installed` is False or :func:`can_compile` refuses. This module holds what they
share:

- the import, tried once (it costs 0.2 s, which a process that never compiles should
  not pay);
- the guard against compiling under a small address-space limit (Numba's compiler then
  never finishes: measured);
- compilation with Numba's on-disk cache where it finds a writable place for it;
- Numba's own workqueue thread pool, used under one lock and with as many threads as
  torch uses: Numba's OpenMP layer shares libgomp with torch and reset torch's thread
  count when it started (set to 1, read back 2: measured).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: The import attempt ("numba": the module or None) and the warnings already given.
_STATE: dict[str, Any] = {}
#: First compilations: two at once would compile the same helpers twice.
COMPILE_LOCK = threading.Lock()
#: The workqueue threading layer runs one parallel region at a time per process.
_RUN_LOCK = threading.Lock()

#: Address space the first compilation needs: measured, the one-bit kernel compiles in
#: 9 s with 1 GB of headroom under an address-space limit, and Numba's compiler does not
#: finish at all with 256 MB.
COMPILE_ADDRESS_SPACE = 1 << 30


#: Environment variable that switches every compiled path off (``0``) or leaves them
#: on where Numba is installed (``1``, the default).
SWITCH = "FEDCOMP_COMPILED"


def installed() -> bool:
    """Whether Numba can be imported (tried once, on first use) and the compiled paths
    are not switched off with ``FEDCOMP_COMPILED=0``.

    A process pays about 0.4 s to import Numba and load a module's kernels (measured).
    That is nothing to a server or a simulation's long-lived actors, but it is paid for
    every message where each one starts a fresh ClientApp process (Flower's process
    isolation), and it outweighs what the faster encoders save below about 10^8
    coordinates. Such deployments can switch the compiled paths off.

    Raises
    ------
    ValueError
        When ``FEDCOMP_COMPILED`` is set to anything but ``0`` or ``1``.
    """
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{SWITCH}={switch!r}: allowed are 0 (compiled paths off) and 1 (on)")
    return switch == "1" and _import() is not None


def _import() -> Any:
    """The numba module, or None without it (the import is tried once)."""
    if "numba" not in _STATE:
        try:
            import numba as module
        except ImportError:
            module = None
        else:
            # Before anything can start Numba's threads (a kernel's first launch, or
            # numba.set_num_threads): the layer is fixed from then on (module docstring).
            module.config.THREADING_LAYER = "workqueue"
        _STATE["numba"] = module
    return _STATE["numba"]


def numba_module() -> Any:
    """The numba module; RuntimeError without it."""
    module = _import()
    if module is None:
        raise RuntimeError("numba is not installed: pip install fedcomp[fast]")
    return module


def can_compile(what: str, fallback: str) -> bool:
    """False, with one warning per ``what``, when an address-space limit (``ulimit -v``)
    leaves less than :data:`COMPILE_ADDRESS_SPACE` to this process: compiling would
    hang. ``fallback`` says what runs instead, for the warning."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * resource.getpagesize()
    except (ImportError, OSError, ValueError):  # not Linux: no such limit to honour
        return True
    if soft == resource.RLIM_INFINITY or soft - used >= COMPILE_ADDRESS_SPACE:
        return True
    warned = _STATE.setdefault("warned", set())
    if what not in warned:
        warned.add(what)
        logger.warning(
            "%s: the address-space limit leaves %d MB, compiling needs %d MB: %s",
            what,
            max(0, soft - used) >> 20,
            COMPILE_ADDRESS_SPACE >> 20,
            fallback,
        )
    return False


def compile_functions(
    namespace: dict[str, Any],
    *,
    inlined: tuple[str, ...] = (),
    plain: tuple[str, ...] = (),
    parallel: tuple[str, ...] = (),
    what: str,
    fastmath: frozenset[str] = frozenset(),
) -> dict[str, Callable]:
    """Compile the named functions of a module's ``namespace`` (its ``globals()``) and
    return the ``parallel`` ones, compiled.

    The ``inlined`` helpers (``inline="always"``) and ``plain`` functions replace their
    Python definitions in ``namespace``, which is what the kernels then call; the
    kernels get ``parallel=True``. ``fastmath`` names LLVM's fast-math flags for all of
    them (e.g. ``{"reassoc"}`` lets a float sum be vectorized). Numba's on-disk cache
    is used where it finds a writable place, else everything is compiled in this
    process, with a warning. Call under :data:`COMPILE_LOCK`.
    """
    numba = numba_module()
    python = {name: namespace[name] for name in (*inlined, *plain, *parallel)}
    for cache in (True, False):
        # error_model="numpy": a division by zero gives inf/nan as in NumPy, with no
        # ZeroDivisionError check in every loop.
        jit = {"cache": cache, "error_model": "numpy", "fastmath": set(fastmath) or False}
        try:
            compiled = {name: numba.njit(inline="always", **jit)(python[name]) for name in inlined}
            compiled.update({name: numba.njit(**jit)(python[name]) for name in plain})
            kernels = {name: numba.njit(parallel=True, **jit)(python[name]) for name in parallel}
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            if not cache:
                raise
            logger.warning("%s: no cache for compiled code (%s): compiling it", what, exc)
            continue
        namespace.update(compiled)
        return kernels
    raise AssertionError("unreachable")


@contextlib.contextmanager
def parallel_region() -> Iterator[None]:
    """Run compiled parallel kernels: one region at a time in this process (the
    workqueue layer allows no more), with as many threads as torch uses."""
    numba = numba_module()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    with _RUN_LOCK:
        numba.set_num_threads(threads)
        yield


class Kernels:
    """One module's compiled kernels: compiled (or loaded from Numba's cache) on first
    use, under :data:`COMPILE_LOCK`, then run once by ``warm_up``.

    Numba compiles a kernel at its first call with given argument types; ``warm_up``
    makes those calls, with the types the module's entry points pass, so that no
    compilation happens later (inside a parallel region, or under an address-space
    limit that :meth:`available` did not check).

    Parameters
    ----------
    namespace : dict
        The module's ``globals()``: the functions to compile are looked up there, their
        compiled helpers replace them there, and ``numba`` is bound there for the
        kernel bodies (``numba.prange``).
    what, fallback : str
        For warnings: who compiles, and what runs instead when it cannot.
    inlined, plain, parallel, fastmath
        As :func:`compile_functions`.
    warm_up : callable, optional
        Called with the compiled parallel kernels (by name).
    """

    def __init__(
        self,
        namespace: dict[str, Any],
        *,
        what: str,
        fallback: str,
        parallel: tuple[str, ...],
        inlined: tuple[str, ...] = (),
        plain: tuple[str, ...] = (),
        fastmath: frozenset[str] = frozenset(),
        warm_up: Callable[[dict[str, Callable]], None] | None = None,
    ) -> None:
        self.namespace, self.what, self.fallback = namespace, what, fallback
        self.functions = {"inlined": inlined, "plain": plain, "parallel": parallel}
        self.fastmath, self.warm_up = fastmath, warm_up
        #: The compiled parallel kernels by name, once made.
        self.compiled: dict[str, Callable] | None = None

    def available(self) -> bool:
        """Numba is installed, and the kernels are compiled or can be (:func:`can_compile`)."""
        if not installed():
            return False
        return self.compiled is not None or can_compile(self.what, self.fallback)

    def get(self) -> dict[str, Callable]:
        """The compiled parallel kernels (compiled and warmed up on the first call)."""
        with COMPILE_LOCK:
            if self.compiled is None:
                self.namespace["numba"] = numba_module()
                kernels = compile_functions(
                    self.namespace, what=self.what, fastmath=self.fastmath, **self.functions
                )
                if self.warm_up is not None:
                    self.warm_up(kernels)
                self.compiled = kernels
        return self.compiled
