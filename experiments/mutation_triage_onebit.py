"""The triage of `make mutation SCOPE=onebit`'s survivors (experiments/mutation.py).

Entries as in experiments/mutation_triage.py: mutmut's mutant name -> (a snippet of the
mutated line, so that an entry goes stale when the code moves; the verdict; a one-line
reason).
"""

# ruff: noqa: E501  (a table: one mutant per line)
from __future__ import annotations

E, M, N = "equivalent", "missing invariant", "not worth it"
C = "fedcomp.onebit.code."
D = "fedcomp.onebit.decode."
XX = "only the message's wording changes (wrapped in XX or upper-cased); its kind, trigger and the fields it names are tested"
NEG = "NumPy takes any negative size in reshape as the one to infer: -2 is -1 here"
WEIGHTED = "equal weights take the weighted path: the same sums up to float64 rounding (bit for bit for the tests' dyadic weights); only slower"
CHUNK = "the chunk size (still a multiple of 8 coordinates) changes only memory and speed: the estimate does not depend on the chunking (tested over chunks of 8 and 16)"
FLOAT64 = "the array is float64 already (NumPy's default float, or built as float64 by the caller)"
NEVER_EMPTY = "no block is empty (there are ceil(numel / block) of them), so this branch never runs"

TRIAGE: dict[str, tuple[str, str, str]] = {
    C + "x__as_float64__mutmut_3": ("hape(-1).to(None).numpy()", N, "a float32 tensor stays float32: its spreads' medians round in float32 (a scale code is a quarter octave); the division by tau is float64 all the same"),
    C + "x__as_float64__mutmut_9": ("ay(x, dtype=None).reshape(-1", N, "a float32 array stays float32: its spreads' medians round in float32 (a scale code is a quarter octave); the division by tau is float64 all the same"),
    C + "x__as_float64__mutmut_11": (".asarray(x, ).reshape(-1", N, "a float32 array stays float32: its spreads' medians round in float32 (a scale code is a quarter octave); the division by tau is float64 all the same"),
    C + "x__as_float64__mutmut_13": ("4).reshape(-2)", E, NEG),
    C + "x__checked_weights__mutmut_7": ("ay(weights, None)", E, "float weights are float64 already; integer weights give the same sums"),
    C + "x__checked_weights__mutmut_9": ("ay(weights, )", E, "float weights are float64 already; integer weights give the same sums"),
    C + "x_block_spreads__mutmut_24": ("- ref)) if (part.size) or True else 0.0", E, NEVER_EMPTY),
    C + "x_block_spreads__mutmut_29": ("t.size else 1.0", E, NEVER_EMPTY),
    C + "x_scale_code__mutmut_1": ("tate(divide=None):", N, "only a RuntimeWarning for log2(0) (a zero spread, coded 0 all the same)"),
    C + "x_scale_code__mutmut_19": ("0.0, neginf=None), 1, 255)", E, "a zero spread (log2 gives -inf) is coded 0 by the final where whatever this step gives it, and no spread is NaN (a median of absolute differences of finite values)"),
    C + "x_scale_code__mutmut_21": ("_num(code, neginf=1.0),", E, "a zero spread (log2 gives -inf) is coded 0 by the final where whatever this step gives it, and no spread is NaN (a median of absolute differences of finite values)"),
    C + "x_scale_code__mutmut_22": ("e, nan=0.0, ), 1, 255)", E, "a zero spread (log2 gives -inf) is coded 0 by the final where whatever this step gives it, and no spread is NaN (a median of absolute differences of finite values)"),
    C + "x_scale_code__mutmut_23": ("m(code, nan=1.0, neginf=1", E, "a zero spread (log2 gives -inf) is coded 0 by the final where whatever this step gives it, and no spread is NaN (a median of absolute differences of finite values)"),
    C + "x_scale_code__mutmut_24": ("0.0, neginf=2.0), 1, 255)", E, "a zero spread (log2 gives -inf) is coded 0 by the final where whatever this step gives it, and no spread is NaN (a median of absolute differences of finite values)"),
    C + "x_scale_value__mutmut_5": ("code.astype(None) - 128) / _", E, FLOAT64),
    C + "xǁOneBitCodeǁ__post_init____mutmut_20": ("ad(\"bits\", \"XXuse an integer in 1..64XX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_65": ("e bad(key, \"XXuse a finite number >= 0XX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_83": ("e bad(key, \"XXuse a positive numberXX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_96": ("esultant\", \"XXuse a number in [0, 2]XX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_109": ("se_share\", \"XXuse a number in (0, 0.5)XX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_115": ("_prior <= 1e+30:", E, "1e+30 is 1e30"),
    C + "xǁOneBitCodeǁ__post_init____mutmut_122": ("au_prior\", \"XXuse a number in [1e-30, 1e30] (it travels as float32)XX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_132": ("d(\"decay\", \"XXuse a finite numberXX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_145": ("d(\"block\", \"XXuse a positive integerXX\")", N, XX),
    C + "xǁOneBitCodeǁ__post_init____mutmut_158": ("(\"groups\", \"XXuse a positive integerXX\")", N, XX),
    C + "xǁOneBitCodeǁ_decode_received__mutmut_15": ("groups == 1 and len(receive", N, "several replies of one group go to the per-answer decoder: the same estimate as the run-sum or compiled one (tested to the bit), only slower"),
    C + "xǁOneBitCodeǁ_decode_received__mutmut_19": ("indices) == 2:", E, "a lone reply makes one group (groups = min(groups, R)): the per-answer decoder's estimate is the one-group decoder's (tested)"),
    C + "xǁOneBitCodeǁblock_taus__mutmut_5": ("tau, dtype=None)", E, "a float or list of floats is float64 already; an integer tau divides and digests (astype('<f8')) the same"),
    C + "xǁOneBitCodeǁblock_taus__mutmut_7": (") else tau, )", E, "a float or list of floats is float64 already; an integer tau divides and digests (astype('<f8')) the same"),
    C + "xǁOneBitCodeǁblock_taus__mutmut_8": (".numpy() if (isinstance(tau, torch.Tensor)) and False else tau, d", E, "np.asarray reads a CPU tensor through its __array__: the same values"),
    C + "xǁOneBitCodeǁcheck__mutmut_45": ("_from(body, ), client_in", E, "unpack_from's offset defaults to 0"),
    C + "xǁOneBitCodeǁdecode__mutmut_20": ("digest = None", N, "check computes the same digest itself, once per reply: only slower"),
    C + "xǁOneBitCodeǁdecode__mutmut_32": ("digest=None,", N, "check computes the same digest itself, once per reply: only slower"),
    C + "xǁOneBitCodeǁdecode__mutmut_39": (")[0]", N, "check computes the same digest itself, once per reply: only slower"),
    C + "xǁOneBitCodeǁdecode__mutmut_43": ("ces, strict=None)", E, "_check_indices has already required one index per payload"),
    C + "xǁOneBitCodeǁdecode__mutmut_46": ("nt_indices, )", E, "_check_indices has already required one index per payload"),
    C + "xǁOneBitCodeǁdecode__mutmut_47": ("ces, strict=False)", E, "_check_indices has already required one index per payload"),
    C + "xǁOneBitCodeǁdecode__mutmut_72": ("(packed) if (numel) or True else np.zer", E, "np.stack of R empty rows is the same (R, 0) uint8 array"),
    C + "xǁOneBitCodeǁdecode__mutmut_75": ("acked), 0), None),", E, "an empty tensor has no chunk: the packed bits are never read"),
    C + "xǁOneBitCodeǁdecode__mutmut_77": ("acked), 0), ),", E, "an empty tensor has no chunk: the packed bits are never read"),
    C + "xǁOneBitCodeǁdecode__mutmut_78": ("en(packed), 1), np.uint8)", E, "an empty tensor has no chunk: the packed bits are never read"),
    C + "xǁOneBitCodeǁdecode__mutmut_80": ("ices, dtype=None),", E, "client indices are Python ints: NumPy's default integer is int64"),
    C + "xǁOneBitCodeǁdecode__mutmut_82": ("nt_indices, ),", E, "client indices are Python ints: NumPy's default integer is int64"),
    C + "xǁOneBitCodeǁdigest__mutmut_9": ("taus.astype(None).tobytes(),", E, "taus are float64 already: astype(None) is the same little-endian float64 here"),
    C + "xǁOneBitCodeǁencode__mutmut_83": ("its.reshape(None), bitorder=", E, "reshape(None) keeps the (numel, b) bits, and packbits without an axis flattens them in the same order"),
    C + "xǁOneBitCodeǁencode__mutmut_85": ("ts.reshape(-2), bitorder=", E, NEG),
    C + "xǁOneBitCodeǁquery_set__mutmut_6": ("s.size else 1.0", E, "an empty tensor has no coordinate: only the range of its plan, the same on both sides, changes"),
    D + "x__center__mutmut_5": ("y(c0, dtype=None), 0", E, FLOAT64),
    D + "x__center__mutmut_7": ("asarray(c0, ), 0", E, FLOAT64),
    D + "x__center__mutmut_14": ("= (chunk.q <= num_loc).re", E, "the answers of query num_loc land in row num_loc, which the slice [:, :num_loc] drops"),
    D + "x__center__mutmut_16": ("c).reshape(-2)", E, NEG),
    D + "x__center__mutmut_29": ("ts.reshape(-2)[loc], minl", E, NEG),
    D + "x__chunk_estimate__mutmut_12": ("nit_weights=None,", N, WEIGHTED),
    D + "x__chunk_estimate__mutmut_45": ("nit_weights=None,", N, WEIGHTED),
    D + "x__drawn_sums__mutmut_3": ("u_range[0]) | (q < u_rang", E, "the extra (deterministic) queries' sums are never read: _refine takes drawn_sums only at the rows with a public U"),
    D + "x__drawn_sums__mutmut_6": ("e[0]) & (q <= u_range[1])", E, "the extra (deterministic) queries' sums are never read: _refine takes drawn_sums only at the rows with a public U"),
    D + "x__drawn_sums__mutmut_41": ("- bc.astype(None)", E, FLOAT64),
    D + "x__drawn_sums__mutmut_56": ("ts.reshape(-2, 1, 1), q.s", E, NEG),
    D + "x__drawn_sums__mutmut_74": ("aw.reshape(-2)], weights=", E, NEG),
    D + "x__median_of_means__mutmut_6": ("group[0] if (per_group.shape[0] == 1) and False else np.med", E, "the median of one group's row is that row"),
    D + "x__refine__mutmut_12": ("pe(groups, -2)", E, NEG),
    D + "x__refine__mutmut_19": ("pe(groups, -2)", E, NEG),
    D + "x__shared__mutmut_36": ("nit_weights=None,", N, WEIGHTED),
    D + "x__shared__mutmut_58": ("eights=bool(None),", N, WEIGHTED),
    D + "x__shared__mutmut_59": ("bool(np.all(None)),", N, WEIGHTED),
    D + "x__shared__mutmut_60": ("all(weights != weights[0]", N, "w != w[0] is never true for every reply (w[0] equals itself): always the weighted path, the same sums up to float64 rounding"),
    D + "x__snap__mutmut_14": ("2 * np.pi), 2.0)", N, "y moves by one period before the snap to its copy nearest the center: the same center up to one rounding of y + P (and the choice at an exact tie)"),
    D + "x__sum_answers__mutmut_30": ("es.reshape(-2, 1), shifts", E, NEG),
    D + "x__sum_answers__mutmut_67": ("if groups >= 1:", E, "with one group every reply's group is 0: the offset added is 0"),
    D + "x__sum_answers__mutmut_79": ("q).reshape(-2, 1, 1)", E, NEG),
    D + "x__sum_answers__mutmut_90": ("ey.reshape(-2)", E, NEG),
    D + "x__sum_answers__mutmut_91": ("shape3 = None", E, "reshape(None) keeps the flat sums, and every reader reshapes them to (groups, -1) itself"),
    D + "x__sum_answers__mutmut_102": ("ts.reshape(-2), minlength", E, NEG),
    D + "x__sum_answers__mutmut_132": ("ts.reshape(-2, 1, 1), q.s", E, NEG),
    D + "x__sum_answers__mutmut_136": ("e).reshape(-2)", E, NEG),
    D + "x__sum_answers__mutmut_147": ("ts.reshape(-2) * w_full,", E, NEG),
    D + "x__sum_answers__mutmut_162": ("pe(shape3), None, answers)", E, "without the unweighted ones, _center counts the LOC ones again from the answers: the same integers"),
    D + "x__sum_answers__mutmut_172": ("s1.reshape(None), s0.reshap", E, "reshape(None) keeps the flat sums, and every reader reshapes them to (groups, -1) itself"),
    D + "x__sum_answers__mutmut_173": ("s0.reshape(None), ones, ans", E, "reshape(None) keeps the flat sums, and every reader reshapes them to (groups, -1) itself"),
    D + "x_decode_joint__mutmut_16": ("ed.weights, )", E, "group_of = arange(R) % groups names every group (groups <= R): bincount is that long already"),
    D + "x_decode_joint__mutmut_30": ("RIES // max(2, num_rx * q", E, CHUNK),
    D + "x_decode_joint__mutmut_32": ("s.bits)) // 9 * 8)", E, CHUNK),
    D + "x_localize__mutmut_2": ("tart.astype(None, copy=True)", E, FLOAT64),
    D + "x_localize__mutmut_5": ("np.float64, )", E, "astype copies by default"),
    D + "x_localize__mutmut_21": ("re\", divide=None):", E, "sums <= counts, so a zero count has a zero sum: 0 / 0 is 'invalid', never 'divide'"),
    D + "x_localize__mutmut_23": ("d=\"ignore\", ):", E, "sums <= counts, so a zero count has a zero sum: 0 / 0 is 'invalid', never 'divide'"),
    D + "x_localize__mutmut_57": ("ive &= (n0 >= 0) & (n1 >", E, "with no answer p = 0 / 0 = NaN, whose resultant NaN fails resultant >= min_resultant: the count test is redundant"),
    D + "x_localize__mutmut_59": ("> 0) & (n1 >= 0) & (resul", E, "with no answer p = 0 / 0 = NaN, whose resultant NaN fails resultant >= min_resultant: the count test is redundant"),
    D + "x_used_queries__mutmut_5": ("um_scales + 2):", E, "scale J + 1 has no refinement query: no row"),
    D + "x_used_queries__mutmut_15": ("q].reshape(-2)[p] != 0] f", E, NEG),
    D + "x_used_queries__mutmut_23": ("(qs.kind[q] != KIND_BASE)", N, "the BASE rows and the refinement rows swap places: the same terms, summed in another order (float64 rounding)"),
    D + "x_used_queries__mutmut_24": ("KIND_BASE) != kind_is_ba", N, "the BASE rows and the refinement rows swap places: the same terms, summed in another order (float64 rounding)"),
    D + "x_used_queries__mutmut_42": ("]].reshape(-2)[p]", E, NEG),
}

#: The summary's reading of the triage (printed under the counts).
NOTES = (
    "No missing invariant is left. A first run against tests/test_onebit.py alone was "
    "stopped at 334 of the 1697 mutants (86 survivors among them, mostly of the "
    "per-answer decoder, which only its median-of-means tests reach, and the coarse "
    "center's snap): projected past an hour with one worker on the loaded machine. "
    "tests/test_onebit_invariants.py began from those; the complete run, with that file "
    "and four more slow tests left out, had 346 survivors (79.5%): the settings' bounds "
    "and messages, each check's field names, next tau, the scale codes, the weighted and "
    "chunked decoder, median of means, used queries and the query set. The file now "
    "tests each from its definition (the decoder against the run-sum decoder and each "
    "group decoded alone; localization against the vote angle computed in float64; the "
    "bounds at the boundary value and one past it); three re-runs of the survivors took "
    "them to 346 -> 102 -> 95 -> 93. What is left: messages reworded (XX or upper case), NumPy's "
    "negative reshape sizes and float64 defaults, the weighted path taken with equal "
    "weights (the same sums, slower), the chunk size, redundant guards (a zero count "
    "whose NaN vote already stops, lengths checked before zip, branches an empty tensor "
    "or a non-empty block never takes), float32 rounding of a spread statistic, and a "
    "RuntimeWarning."
)
