"""One-bit non-adaptive refinement coding for heavy-tailed updates (docs/onebit.md).

Every client answers b public random queries per coordinate with one bit each; the
server decodes the mean jointly. See :class:`OneBitCode` for the surface.
"""

from fedcomp.onebit.code import ONEBIT_CODEC_ID, OneBitCode, scale_code, scale_value
from fedcomp.onebit.decode import JointDecode

__all__ = ["ONEBIT_CODEC_ID", "JointDecode", "OneBitCode", "scale_code", "scale_value"]
