"""Executing a reduction tree over a stack of client tensors, and the roundoff constant.

Low precision is done the honest way: every internal node is ONE eager tensor addition
in the working dtype (bfloat16, float16 or float32), so a bf16 tree equals, bit for bit,
pairwise bf16 additions in the tree's order. (torch.compile fuses a bf16 tree keeping
float32 intermediates, which is a different, more accurate computation: docs/architecture.md
"Performance facts"; it is not used here.)
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.trees.structure import Tree, validate_tree

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def reduce_tree(
    tree: Tree,
    leaves: torch.Tensor,
    dtype: str | torch.dtype = "fp32",
    root_dtype: str | torch.dtype | None = None,
) -> torch.Tensor:
    """Sum ``leaves`` (a (k, ...) stack) along ``tree`` in ``dtype``.

    Leaves are cast to ``dtype`` first. With ``root_dtype`` (e.g. "fp32") the root's two
    operands are cast up and the last addition happens there. The result has the root's
    dtype. Raises ``ValueError`` for k = 0 or a tree that does not match the stack.
    """
    if leaves.dim() < 1 or leaves.shape[0] == 0:
        raise ValueError("reduce_tree needs at least one leaf (k >= 1)")
    validate_tree(tree, leaves.shape[0])
    work = _dtype(dtype)
    cast = leaves.to(work)

    def evaluate(node: Tree) -> tuple[torch.Tensor, bool]:
        """(value, whether we own the tensor). A partial sum we own is accumulated in
        place: the same rounded addition (IEEE addition commutes exactly), without
        allocating a tensor per node."""
        if not isinstance(node, tuple):
            return cast[node], False
        (left, left_owned), (right, right_owned) = evaluate(node[0]), evaluate(node[1])
        if left_owned:
            return left.add_(right), True
        if right_owned:
            return right.add_(left), True
        return torch.add(left, right), True

    if root_dtype is not None and isinstance(tree, tuple):
        root = _dtype(root_dtype)
        return evaluate(tree[0])[0].to(root) + evaluate(tree[1])[0].to(root)
    result, owned = evaluate(tree)
    if root_dtype is not None:
        return result.to(_dtype(root_dtype))
    return result if owned else result.clone()


def unit_roundoff(dtype: str | torch.dtype) -> float:
    """u = 2^-(mantissa bits + 1) of the format (bf16: 2^-8, fp16: 2^-11, fp32: 2^-24)."""
    return float(torch.finfo(_dtype(dtype)).eps) / 2


def estimate_nu(dtype: str | torch.dtype, samples: int = 200_000, seed: int = 0) -> float:
    """The roundoff constant nu of one addition: E[(fl(a+b) - (a+b))^2] / (u^2 E[(a+b)^2]),
    measured against float64 on normal operands already representable in ``dtype``."""
    work = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(samples, generator=gen).to(work)
    b = torch.randn(samples, generator=gen).to(work)
    exact = a.double() + b.double()
    err = (a + b).double() - exact
    u = unit_roundoff(work)
    return float((err**2).mean() / (u**2 * (exact**2).mean()))


def float64_reference(leaves: torch.Tensor, dtype: str | torch.dtype) -> np.ndarray:
    """The float64 sum of the SAME leaves the tree receives (already cast to ``dtype``),
    so a comparison isolates the tree's rounding from the cast."""
    return leaves.to(_dtype(dtype)).double().sum(0).numpy()
