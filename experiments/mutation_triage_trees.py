"""The triage of `make mutation SCOPE=trees`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

# ruff: noqa: E501  (a table: one mutant per line)
from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"

TRIAGE: dict[str, tuple[str, str, str]] = {
    "fedcomp.trees.aggregate.x__fixed_tree__mutmut_3": (
        "XXsequentialXX",
        E,
        "the one call with the name 'sequential' passes zero statistics, and greedy_tree on zeros is the left chain (checked for k = 1..59): the same tree",
    ),
    "fedcomp.trees.aggregate.x__fixed_tree__mutmut_4": (
        '"SEQUENTIAL"',
        E,
        "the one call with the name 'sequential' passes zero statistics, and greedy_tree on zeros is the left chain (checked for k = 1..59): the same tree",
    ),
    "fedcomp.trees.aggregate.x__tree_for__mutmut_2": (
        "XXsumXX",
        N,
        "moments are then tracked for the plain sum too: work only, the sum's tree ignores them",
    ),
    "fedcomp.trees.aggregate.x__tree_for__mutmut_3": (
        '"SUM"',
        N,
        "moments are then tracked for the plain sum too: work only, the sum's tree ignores them",
    ),
    "fedcomp.trees.aggregate.x_choose_tree__mutmut_9": (
        "np.zeros(k), None)",
        E,
        "the order-only trees (sequential, balanced, blocked) never read the means",
    ),
    "fedcomp.trees.aggregate.x_leaf_factors__mutmut_7": (
        "XXtree_mean needs",
        N,
        "only the message's wording changes (wrapped in XX); the refusal is tested",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_124": (
        "reduce_tree(tree, leaves, )",
        E,
        "reduce_tree's default dtype is fp32: the same float32 redo",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_33": (
        "astype(None)",
        E,
        "astype(None) is astype(float64) in numpy: the same float64 mean",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_36": (
        "strict=None",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_39": (
        "updates, )",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_40": (
        "strict=False",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_51": (
        "dtype=None",
        N,
        "updates are float32 (decoded payloads of a float32 model); only a float64 update would be scaled by its factor before the cast to the working dtype rather than after",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_53": (
        "np.asarray(u[name], )",
        N,
        "updates are float32 (decoded payloads of a float32 model); only a float64 update would be scaled by its factor before the cast to the working dtype rather than after",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_58": (
        "strict=None",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_61": (
        "factors, )",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_62": (
        "strict=False",
        E,
        "leaf_factors has already checked one factor per update: zip's strictness never binds",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_65": (
        "dtype=None",
        E,
        "torch's default dtype is float32 (nothing in the project changes it): the same tensor",
    ),
    "fedcomp.trees.aggregate.x_tree_mean__mutmut_67": (
        "terms.shape[1], )",
        E,
        "torch's default dtype is float32 (nothing in the project changes it): the same tensor",
    ),
    "fedcomp.trees.aggregate.xǁTreeStatsǁupdate__mutmut_3": (
        "decay >= 0",
        E,
        "with decay 0 the moving average is 0 * old + 1 * new = new exactly (moments of finite float32 leaves are finite)",
    ),
    "fedcomp.trees.reduce.x__dtype__mutmut_4": (
        "'XX, XX'.join",
        N,
        "only the message's separator changes; the refusal and the names it lists are the same",
    ),
    "fedcomp.trees.reduce.x_estimate_nu__mutmut_1": (
        "200001",
        N,
        "a default of a diagnostic estimate (sample count, seed): the estimate's meaning is unchanged",
    ),
    "fedcomp.trees.reduce.x_estimate_nu__mutmut_2": (
        "seed: int = 1",
        N,
        "a default of a diagnostic estimate (sample count, seed): the estimate's meaning is unchanged",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_1": (
        "XXfp32XX",
        N,
        "a default dtype no caller in fedcomp relies on (every call names its dtype)",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_10": (
        "XXreduce_tree needs",
        N,
        "only the message's wording changes (wrapped in XX)",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_2": (
        '"FP32"',
        N,
        "a default dtype no caller in fedcomp relies on (every call names its dtype)",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_29": (
        "left.add_(right), False",
        E,
        "an owned partial sum marked not owned is copied instead of updated in place: the same rounded additions",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_31": (
        "right.add_(left), False",
        E,
        "an owned partial sum marked not owned is copied instead of updated in place: the same rounded additions",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_36": (
        "torch.add(left, right), False",
        E,
        "an owned partial sum marked not owned is copied instead of updated in place: the same rounded additions",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_42": (
        "evaluate(tree[0])[0].to(None)",
        E,
        "one root operand left in the working dtype is promoted to the root's float32 by the addition: the same exact cast, the same float32 sum",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_46": (
        "evaluate(tree[1])[0].to(None)",
        E,
        "one root operand left in the working dtype is promoted to the root's float32 by the addition: the same exact cast, the same float32 sum",
    ),
    "fedcomp.trees.reduce.x_reduce_tree__mutmut_55": (
        "and False",
        E,
        "always a copy: the same values",
    ),
    "fedcomp.trees.structure.x__normal_cdf__mutmut_4": (
        "dtype=None",
        E,
        "z is computed from float64 arrays: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x__normal_cdf__mutmut_6": (
        "np.asarray(z, )",
        E,
        "z is computed from float64 arrays: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_common_ancestor_kernel__mutmut_5": (
        "dtype=None",
        E,
        "float64 holds these small integer counts exactly, and every use sums them or multiplies them by floats",
    ),
    "fedcomp.trees.structure.x_common_ancestor_kernel__mutmut_7": (
        "np.zeros((k, k), )",
        E,
        "float64 holds these small integer counts exactly, and every use sums them or multiplies them by floats",
    ),
    "fedcomp.trees.structure.x_expected_rounding_variance__mutmut_36": (
        "top = int(np.floor(np.log2(abs(mean) + 10 * sd)))",
        N,
        "one binade more at either end of the sum, whose probability (beyond 9 standard deviations, or 2^-60 below the top) is negligible",
    ),
    "fedcomp.trees.structure.x_expected_rounding_variance__mutmut_43": (
        "exps = np.arange(top - 61, top + 1)",
        N,
        "one binade more at either end of the sum, whose probability (beyond 9 standard deviations, or 2^-60 below the top) is negligible",
    ),
    "fedcomp.trees.structure.x_expected_rounding_variance__mutmut_45": (
        "exps = np.arange(top - 60, top + 2)",
        N,
        "one binade more at either end of the sum, whose probability (beyond 9 standard deviations, or 2^-60 below the top) is negligible",
    ),
    "fedcomp.trees.structure.x_gram_cost__mutmut_5": ("kernel.shape[1]", E, "the kernel is square"),
    "fedcomp.trees.structure.x_leaf_depths__mutmut_5": (
        "dtype=None",
        E,
        "float64 holds these small integer counts exactly, and every use sums them or multiplies them by floats",
    ),
    "fedcomp.trees.structure.x_leaf_depths__mutmut_7": (
        "np.zeros(k, )",
        E,
        "float64 holds these small integer counts exactly, and every use sums them or multiplies them by floats",
    ),
    "fedcomp.trees.structure.x_rounding_cost__mutmut_11": (
        "mean = np.asarray(means, )",
        E,
        "variances and means arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_rounding_cost__mutmut_4": (
        "var = np.asarray(variances, dtype=None)",
        E,
        "variances and means arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_rounding_cost__mutmut_6": (
        "var = np.asarray(variances, )",
        E,
        "variances and means arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_rounding_cost__mutmut_9": (
        "mean = np.asarray(means, dtype=None)",
        E,
        "variances and means arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_tree_cost__mutmut_18": (
        "XXvariances",
        N,
        "only the message's wording changes (wrapped in XX)",
    ),
    "fedcomp.trees.structure.x_tree_cost__mutmut_2": (
        "lam: float = 2.0",
        N,
        "a default the one caller (build.select_tree) does not use: it passes lam",
    ),
    "fedcomp.trees.structure.x_tree_cost__mutmut_5": (
        "dtype=None",
        E,
        "variances arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
    "fedcomp.trees.structure.x_tree_cost__mutmut_7": (
        "np.asarray(sigma2, )",
        E,
        "variances arrive as float arrays or lists of floats: asarray gives float64 either way",
    ),
}

#: The summary's reading of the triage (printed under the counts).
NOTES = (
    "The first complete run (9.6 min, tests/test_trees.py and tests/test_tree_aggregation.py) "
    "left 215 survivors: the 165 of the stopped run, triaged then, and 50 among its last 178 "
    "mutants: 46 missing invariants (the refresh schedule, needs_moments_first, the adaptive "
    "choice's arguments, the plain sum, TreeConfig's refusals, validate_tree) and "
    "4 equivalent or message text. tests/test_tree_invariants.py then pins, from their "
    "definitions: integer buffers (before a float tensor), a single update, root_fp32, the "
    "report (mse_vs_fp64 per coordinate over chunks and tensors, chosen counts), the tree "
    "chosen again every round with stats='current' and on refresh rounds with 'ema', "
    "needs_moments_first, the shape each tree name sums along (bit for bit in bf16), the "
    "adaptive choice scored in the working dtype with the float32 root, the plain sum as "
    "the float32 chain, TreeConfig's and validate_tree's refusals with their messages, "
    "reduce_tree with one leaf (root dtype, not a view) and 1-D leaves, float64_reference "
    "at bf16, tree_cost's and gram_cost's refusals, expected_rounding_variance (constant "
    "branch, and the binade sum against a quadrature of the definition), rounding_cost "
    "per addition and without the float32 root, the tracked moments, a reloaded tree "
    "cache, estimate_nu's seed. Re-running the survivors three times as these tests were "
    "added killed 166 of them; the 49 left are equivalent or not worth a test, none a "
    "missing invariant."
)
