"""experiments/behaviour.py, the refactoring check: it must see a one-ulp change in what
was learned, list byte changes apart, and see a run that failed differently."""

from __future__ import annotations

import copy
import math

from experiments.behaviour import compare


def _record() -> dict:
    row = {
        "accuracy": 0.9, "loss": 0.3, "client_accuracy": 0.88, "client_loss": 0.31,
        "selected": 4, "replied": 4, "failures": 0,
        "traffic": {"train_reply": [4, 1000], "train_instruction": [4, 5000]},
    }  # fmt: skip
    second = copy.deepcopy(dict(row, loss=0.2))  # its own traffic, not the first round's
    return {"a": {"overrides": [], "rounds": [row, second]}}


def test_an_identical_record_has_no_difference() -> None:
    assert compare(_record(), _record()) == ([], [])


def test_one_ulp_of_a_loss_is_a_difference_in_what_was_learned() -> None:
    after = copy.deepcopy(_record())
    after["a"]["rounds"][1]["loss"] = math.nextafter(0.2, 1.0)
    learned, bytes_ = compare(_record(), after)
    assert learned == [f"a round 2: loss 0.2 -> {math.nextafter(0.2, 1.0)!r}"]
    assert bytes_ == []


def test_byte_changes_are_listed_apart_and_do_not_count_as_learning() -> None:
    after = copy.deepcopy(_record())
    after["a"]["rounds"][0]["traffic"]["train_reply"] = [4, 999]
    learned, bytes_ = compare(_record(), after)
    assert learned == []
    assert bytes_ == ["a round 1: train_reply [messages, bytes] [4, 1000] -> [4, 999]"]


def test_a_missing_run_and_a_different_failure_are_differences() -> None:
    assert compare(_record(), {}) == (["a: not in the new record"], [])
    failed = copy.deepcopy(_record())
    failed["a"]["failed"] = "the model did not learn"
    learned, _ = compare(_record(), failed)
    assert learned == ["a: failed None -> 'the model did not learn'"]
