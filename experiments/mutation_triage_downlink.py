"""The triage of `make mutation SCOPE=downlink`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

# ruff: noqa: E501  (a table: one mutant per line)
from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"

TRIAGE: dict[str, tuple[str, str, str]] = {
    "fedcomp.downlink.x__torch_dtype__mutmut_6": (
        "np.empty(1,",
        E,
        "an empty and a one-element array of a dtype give torch the same dtype",
    ),
    "fedcomp.downlink.x_apply_step__mutmut_5": (
        "XXthe step",
        N,
        "only the message's wording changes (wrapped in XX); the refusal is tested",
    ),
    "fedcomp.downlink.x_check_step_payload__mutmut_12": (
        "parse_payload(payload, )",
        E,
        "a header claiming another element count is refused by the shape check right after, still before decoding and as a ReplicaError naming the tensor",
    ),
    "fedcomp.downlink.x_check_step_payload__mutmut_6": (
        "len(payload) >= bound",
        N,
        "one byte at the bound: a payload exactly max_inner_size long is refused, which no codec's payload for the tensor reaches (the bound caps a hostile payload's work)",
    ),
    "fedcomp.downlink.x_checksum__mutmut_3": (
        "digest_size=9",
        N,
        "a longer digest computed the same way on both sides: only the string's length changes",
    ),
    "fedcomp.downlink.x_contraction_scale__mutmut_2": (
        "difference.astype(None)",
        E,
        "astype(None) is astype(float64) in numpy: the same float64 values",
    ),
    "fedcomp.downlink.x_contraction_scale__mutmut_3": (
        "decoded.astype(None)",
        E,
        "astype(None) is astype(float64) in numpy: the same float64 values",
    ),
    "fedcomp.downlink.x_decode_parsed__mutmut_4": (
        "ValueError(None)",
        N,
        "only the message of an unknown codec id changes: still a ReplicaError naming the tensor",
    ),
    "fedcomp.downlink.x_encode_step__mutmut_15": (
        "seed=None",
        E,
        "the raw codec ignores the seed: the same bytes",
    ),
    "fedcomp.downlink.x_encode_step__mutmut_17": (
        "np.array(value)), )",
        E,
        "the raw codec ignores the seed: the same bytes",
    ),
    "fedcomp.downlink.x_encode_step__mutmut_20": (
        "seed=1",
        E,
        "the raw codec ignores the seed: the same bytes",
    ),
    "fedcomp.downlink.x_encode_step__mutmut_25": (
        "dtype=None",
        E,
        "the differences are already float32 (BroadcastServer.advance computes them so): the same tensor",
    ),
    "fedcomp.downlink.x_encode_step__mutmut_27": (
        "differences[name], )",
        E,
        "the differences are already float32 (BroadcastServer.advance computes them so): the same tensor",
    ),
    "fedcomp.downlink.x_move__mutmut_10": (
        "result_type(current.dtype, )",
        N,
        "differs only for a float16 model (added in float16, not float32), the same on both sides; no model in the project has float16 parameters",
    ),
    "fedcomp.downlink.x_move__mutmut_13": (
        "current.astype(None",
        N,
        "float64 sum of two float32 values rounded once to float32: equal to the float32 addition except in rare double-rounding cases, and the same on both sides (replicas stay identical)",
    ),
    "fedcomp.downlink.x_move__mutmut_14": (
        "copy=None",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_16": (
        "astype(work, ) +",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_17": (
        "copy=True",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_2": (
        "copy=None",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_21": (
        "copy=None",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_23": (
        "value.astype(work, )",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_24": (
        "copy=True",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_26": (
        "copy=None",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_28": (
        "moved.astype(current.dtype, )",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_29": (
        "copy=True",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_4": (
        "current.dtype, )",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_move__mutmut_5": (
        "copy=False",
        E,
        "whether numpy copies: the values are the same, and the result is a fresh array either way (decoded tensors are new, astype to another dtype copies)",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_62": (
        "XXmemories",
        N,
        "only the message's wording changes (wrapped in XX); the refusal is tested",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_76": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_77": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_78": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_79": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_80": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_81": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_82": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_83": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_84": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.x_parse_downlink__mutmut_85": (
        "",
        N,
        "a guard no setting reaches: every name the check above allows (codec_names, raw excluded) builds a stateless codec",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_15": (
        "dtype=None",
        N,
        "differs only for a float64 model, and only in the contraction scale's input (rounded to float32 before or after the subtraction); the payload encodes float32 either way and both sides use the same scale",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_17": (
        "np.asarray(x_t[k], )",
        N,
        "differs only for a float64 model, and only in the contraction scale's input (rounded to float32 before or after the subtraction); the payload encodes float32 either way and both sides use the same scale",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_19": (
        "dtype=None",
        N,
        "differs only for a float64 model, and only in the contraction scale's input (rounded to float32 before or after the subtraction); the payload encodes float32 either way and both sides use the same scale",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_2": (
        "RuntimeError(None)",
        N,
        "the message of a programming error (advance before start), not a protocol refusal",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_21": (
        "np.asarray(base[k], )",
        N,
        "differs only for a float64 model, and only in the contraction scale's input (rounded to float32 before or after the subtraction); the payload encodes float32 either way and both sides use the same scale",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_3": (
        "XXBroadcastServer",
        N,
        "the message of a programming error (advance before start), not a protocol refusal",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_37": (
        "decode_payload_for(None",
        N,
        "the name only labels an error the server's decode of its own payload never raises",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_4": (
        "broadcastserver.advance",
        N,
        "the message of a programming error (advance before start), not a protocol refusal",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_5": (
        "BROADCASTSERVER",
        N,
        "the message of a programming error (advance before start), not a protocol refusal",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁadvance__mutmut_90": (
        ">= self.full_nbytes",
        N,
        "at exactly the model's bytes the oldest step is dropped one step early: steps_for then sends the model, which costs the same",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁdrift__mutmut_17": (
        "astype(None)",
        E,
        "astype(None) is astype(float64) in numpy: the same float64 values",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁdrift__mutmut_24": (
        "astype(None)",
        E,
        "astype(None) is astype(float64) in numpy: the same float64 values",
    ),
    "fedcomp.downlink.xǁBroadcastServerǁsteps_for__mutmut_24": (
        "> self.full_nbytes",
        N,
        "at exactly the model's bytes, steps or the full model cost the same: either choice",
    ),
    "fedcomp.downlink.xǁDownlinkSpecǁbuild__mutmut_4": (
        "TypeError(None)",
        N,
        "a guard no parsed spec reaches (parse_downlink refuses every codec that is not stateless, naming it); only its message changes",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_3": (
        "XXno replica",
        N,
        "only the message's wording changes (wrapped in XX); the refusal is tested",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_30": (
        "strict=None",
        E,
        "parsed is built from steps, one entry per step: zip's strictness never binds",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_33": (
        "zip(steps, parsed, )",
        E,
        "parsed is built from steps, one entry per step: zip's strictness never binds",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_34": (
        "strict=False",
        E,
        "parsed is built from steps, one entry per step: zip's strictness never binds",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_42": (
        "apply_step(arrays, step, None)",
        N,
        "the checked payloads are parsed again from the same bytes: the same values, a second parse's work only",
    ),
    "fedcomp.downlink.xǁReplicaǁtake_steps__mutmut_45": (
        "apply_step(arrays, step, )",
        N,
        "the checked payloads are parsed again from the same bytes: the same values, a second parse's work only",
    ),
}

#: The summary's reading of the triage (printed under the counts).
NOTES = (
    "The first run (12.8 min, 652 mutants) left 128 survivors against "
    "tests/test_downlink.py (two end-to-end tests deselected) and "
    "tests/test_hostile_server.py (the test list above is the scope's current one, which "
    "now adds tests/test_downlink_invariants.py; the run did not have it). "
    "tests/test_downlink_invariants.py (0.5 s) was written "
    "during and after it for what they left unpinned: BroadcastServer's checkpoint round "
    "trip (a restored server sends the same next step), forget and confirm, drift against "
    "its definition, replicas without server memory (no scale), the public seed of a "
    "step, which tensors carry a scale, float64 models, the contraction scale, and every "
    "refusal's message naming the tensor or setting and what is allowed. Each survivor "
    "was then run by hand against that file alone (MUTANT_UNDER_TEST=<name> pytest, in "
    "mutants/downlink/mutants): those it kills are marked missing invariant with that "
    "reason; the scope's --rerun-survivors (which re-runs every covering test, tens of "
    "seconds per survivor here) is owed and would record them as killed. The rest are "
    "equivalent or not worth a test (message text of guards no input reaches, copy flags, "
    "float64-only rounding of the contraction scale's input, byte-exact boundaries "
    "where both choices cost the same)."
)
