"""Codec families, each with its client half and its server half side by side.

=============  =====================================  ==================================
family         codecs                                 module
=============  =====================================  ==================================
stateless      fp32, bf16, uniform, qsgd, topk, ...   :mod:`.stateless`
feedback       ef (error feedback around any codec)   :mod:`.feedback`
tensor_state   dgc, powersgd                          :mod:`.feedback`
residual       residual (control variates)            :mod:`.residual`
ef21           ef21 (EF21, EF21-SGDM)                 :mod:`.residual`
joint          onebit                                 :mod:`.joint`
adaptive       adaptive (EDEN widths under a budget)  :mod:`.stateless`
sketch         sketch (FetchSGD: count sketches)      :mod:`.sketch`
=============  =====================================  ==================================

A codec names its family (its ``family`` attribute); :func:`family_of` is the one
place that turns a codec into the object the mod and the wrapper call
(:class:`~.base.Family`, :class:`~.base.ServerHalf`).
"""

from __future__ import annotations

from typing import Any

from fedcomp.flower.families.base import DecodedUpdate, Encoded, Family, Instruction, ServerHalf
from fedcomp.flower.families.feedback import FeedbackFamily, TensorStateFamily
from fedcomp.flower.families.joint import JointFamily
from fedcomp.flower.families.residual import EF21Family, ResidualFamily
from fedcomp.flower.families.sketch import SketchFamily
from fedcomp.flower.families.stateless import AdaptiveFamily, StatelessFamily

FAMILIES: dict[str, type[Family]] = {
    "stateless": StatelessFamily,
    "feedback": FeedbackFamily,
    "tensor_state": TensorStateFamily,
    "residual": ResidualFamily,
    "ef21": EF21Family,
    "joint": JointFamily,
    "adaptive": AdaptiveFamily,
    "sketch": SketchFamily,
}


def family_of(codec: Any) -> Family:
    """The family object for ``codec`` (a codec from fedcomp.codecs.make_codec_from_spec)."""
    kind = getattr(codec, "family", None)
    if kind not in FAMILIES:
        raise ValueError(f"codec {getattr(codec, 'name', codec)!r} names no known family: {kind!r}")
    return FAMILIES[kind](codec)


__all__ = [
    "FAMILIES",
    "DecodedUpdate",
    "Encoded",
    "Family",
    "Instruction",
    "ServerHalf",
    "family_of",
]
