"""The triage of `make mutation SCOPE=codecs`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

# ruff: noqa: E501  (a table: one mutant per line)
from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"
SP = "fedcomp.codecs.sparse."
Q = "fedcomp.codecs.quantizers."
B = "fedcomp.codecs.base."
W = "fedcomp.codecs.wire."
ZEROS = "torch's default dtype is float32 (nothing in the project changes it): the same tensor"
XX = "only the message's wording changes (wrapped in XX or upper-cased); its kind, trigger and the fields it names are tested"

TRIAGE: dict[str, tuple[str, str, str]] = {
    SP + "x__read_values__mutmut_8": (
        "5 * count",
        E,
        "the values are the body's last 4 count bytes and its length was checked exactly before: the longer slice is cut at the same end",
    ),
    SP + "x__read_values__mutmut_14": ("XXnon-finite", N, XX),
    SP + "xǁ_Sparsifierǁ_read_k__mutmut_11": (
        "unpack_from(body, )",
        E,
        "unpack_from's offset defaults to 0",
    ),
    SP + "xǁTopKCodecǁdecode_payload__mutmut_32": (
        "astype(None)",
        E,
        "numpy's dtype None is float64: the same cast",
    ),
    SP + "xǁTopKCodecǁdecode_payload__mutmut_52": ("dtype=None", E, ZEROS),
    SP + "xǁTopKCodecǁdecode_payload__mutmut_54": ("zeros(n, )", E, ZEROS),
    SP + "xǁRandKCodecǁdecode_payload__mutmut_27": ("dtype=None", E, ZEROS),
    SP + "xǁRandKCodecǁdecode_payload__mutmut_29": ("zeros(n, )", E, ZEROS),
}

#: The summary's reading of the triage (printed under the counts).
NOTES = ""
