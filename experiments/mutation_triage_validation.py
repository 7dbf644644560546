"""The triage of `make mutation SCOPE=validation`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

# ruff: noqa: E501  (a table: one mutant per line)
from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"
V = "fedcomp.flower.validation."
COUNTS = "the ranking (and a tie) is the same when every count is shifted by one or doubled: only the order of the counts matters"

TRIAGE: dict[str, tuple[str, str, str]] = {
    V + "x__torch_dtype__mutmut_6": (
        "np.empty(1,",
        E,
        "an array of one element has the same dtype as one of zero",
    ),
    V + "x_decode_payloads__mutmut_5": (
        "XXpayload tensor names",
        N,
        "only the message's wording changes (wrapped in XX); its kind and trigger are tested",
    ),
    V + "x_majority_keys__mutmut_9": ("get(keys, 1)", E, COUNTS),
    V + "x_majority_keys__mutmut_10": ("get(keys, 0) + 2", E, COUNTS),
}

#: The summary's reading of the triage (printed under the counts).
NOTES = (
    "No missing invariant is left: tests/test_validation_invariants.py checks every "
    "check of the module at its boundary, with the failure kind, the fields a "
    "SpecMismatch carries and the value each message names. The end-to-end suites "
    "that also reach this module (left out above for time) were not measured against "
    "these mutants."
)
