"""The triage of `make mutation SCOPE=downlink`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"

TRIAGE: dict[str, tuple[str, str, str]] = {}

#: The summary's reading of the triage (printed under the counts).
NOTES = (
    "No run has been triaged yet: the scope (files, measured tests, deselections) is "
    "defined in experiments/mutation_scopes.py; its first run and triage are owed."
)
