# fedcomp: two commands on a fresh machine, `make run` and `make test`.
# Each target creates (or reuses) .venv and installs the project with its extras,
# using this machine's exact versions from constraints.txt.

SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedcomp-installed
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_HOME := $(CURDIR)/.flwr

.PHONY: run test test-slow deploy-test lint data bench bench-scale bench-dme leaderboard leaderboard-fmnist fuzz mutants mutation wheel clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[sim,dev]" 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import fedcomp, clients, strategies, experiments, flwr, torch, hydra" \
	    || { echo "installation failed: see pip's output above" >&2; exit 1; }
	touch $(STAMP)

## run: set up, then the main job (a simulation on the embedded digits dataset)
# The main job: the recipe the leaderboards recommend (1-bit EDEN both ways: the
# best over every seed) on the embedded digits, its ratio against fp32 measured on its
# own messages; `make run RUN_ARGS='recipe=fedavg num_rounds=10'` runs the fp32 FedAvg
# baseline of the same job.
RUN_ARGS ?= recipe=eden1
run: $(STAMP)
	$(PY) -m experiments.run $(RUN_ARGS)

## test: set up, then lint (ruff, vulture) and the fast test suite in a shuffled order
## (pytest-randomly; the seed is printed at the end, replay an order with
## `make test TEST_SEED=N`)
# One call, Ray modules included: each module that starts Ray stops it, checks that the
# processes it started are gone and ignores ones it did not start (tests/ray_processes.py).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m vulture
	$(PY) -m pytest -m "not slow" -q -p randomly $(if $(TEST_SEED),--randomly-seed=$(TEST_SEED))

## test-slow: the slow tests
test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

## deploy-test: every test that starts real SuperLink/SuperNode processes on loopback,
## TLS + SuperNode authentication included (the non-slow ones also run in `make test`)
deploy-test: $(STAMP)
	$(PY) -m pytest -m deployment -q

## data: Fashion-MNIST (dataset=fashion_mnist) from the Debian package dataset-fashion-mnist
## (/usr/share/datasets/fashion-mnist): installed when run as root, else the command is printed
data:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
	    echo "Fashion-MNIST is installed in /usr/share/datasets/fashion-mnist"; \
	elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update && apt-get install -y dataset-fashion-mnist; \
	else \
	    echo "run as root: apt-get update && apt-get install -y dataset-fashion-mnist"; \
	    echo "(or point dataset.path at a directory holding the four IDX files)"; \
	fi

## bench: codec, rotation/EDEN, lossless-stage, server and reduction-tree benchmarks;
## summaries in experiments/results/
bench: $(STAMP)
	$(PY) -m experiments.bench_codecs --out experiments/results/bench_codecs.md
	$(PY) -m experiments.bench_rotation --out experiments/results/bench_rotation.md
	$(PY) -m experiments.bench_entropy --out experiments/results/bench_entropy.md
	$(PY) -m experiments.bench_aggregation --out experiments/results/bench_aggregation.md

## leaderboard: every recipe on digits (3 seeds, about 25 minutes on 2 cores, in-process),
## ranked by total bytes to FedAvg's accuracy; summary and plot in experiments/results/
leaderboard: $(STAMP)
	$(PY) -m experiments.presets leaderboard_digits
	$(PY) -m experiments.report --leaderboard multirun/leaderboard_digits \
	    --plot experiments/results/leaderboard_digits.png --out experiments/results/leaderboard_digits.md

## leaderboard-fmnist: the Fashion-MNIST leaderboard on a converged horizon (FedAvg to
## its plateau, 300 rounds; 4 recipes x 3 seeds under each of NIID-Bench's label skews,
## Dirichlet 0.5 and two labels per client): about 25 minutes a run on one core, 10 hours
## in all on 2 cores (needs `make data`; resumes where it stopped: --skip-done); tables
## and plots in multirun/leaderboard_fmnist{,_labels}_converged/
leaderboard-fmnist: $(STAMP)
	status=0; for p in leaderboard_fmnist_converged leaderboard_fmnist_labels_converged; do \
	    $(PY) -m experiments.presets $$p --skip-done || status=1; \
	    $(PY) -m experiments.report --leaderboard multirun/$$p --window 50 \
	        --plot multirun/$$p/leaderboard.png --out multirun/$$p/leaderboard.md || exit 1; \
	done; exit $$status

## bench-scale: the server with 100 and 1,000 replies of a ResNet-18-sized model (real
## mod and wrapper, no Ray): aggregation time and peak memory against the replies' size
bench-scale: $(STAMP)
	$(PY) -m experiments.bench_scale --out experiments/results/bench_scale.md

## bench-dme: the one-bit code vs the baselines at equal bits (distributed mean estimation)
bench-dme: $(STAMP)
	$(PY) -m experiments.bench_dme --out experiments/results/bench_dme.md

## fuzz: 10^4 cases per decoder and for a reply's metric fields (fedcomp's own, the pre-train
## evaluation) under a memory cap (a derandomized sample runs in
## `make test`); prints its seed (replay with FUZZ_SEED=N), cases per decoder, wall time
fuzz: $(STAMP)
	@seed=$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz seed $$seed (replay: make fuzz FUZZ_SEED=$$seed)"; start=$$(date +%s); \
	FEDCOMP_FUZZ_EXAMPLES=10000 FEDCOMP_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q \
	    tests/test_fuzz_decoders.py --hypothesis-seed=$$seed --hypothesis-show-statistics \
	    | grep -E "^tests/|phase|passing examples|failing examples|Stopped because|passed|failed"; \
	status=$${PIPESTATUS[0]}; \
	echo "fuzz: seed $$seed, wall time $$(( $$(date +%s) - start )) s"; exit $$status

## mutants: deliberate bugs the test suite must catch (summary in experiments/results/)
mutants: $(STAMP)
	$(PY) -m experiments.mutants --out experiments/results/mutants.md

## mutation: mutmut over the protocol cores with their fast tests, survivors triaged;
## SCOPE=all (default: each in turn) or one of core, codecs, validation, downlink, trees,
## onebit (experiments/mutation_scopes.py; core is pyproject.toml's [tool.mutmut]); each
## scope works in mutants/<scope>/ (git-ignored) and writes experiments/results/mutation*.md
SCOPE ?= all
mutation: $(STAMP)
	$(PY) -m experiments.mutation --scope $(SCOPE) --max-children 2

## wheel: the installable package (fedcomp only; this repository's apps are not shipped)
wheel: $(STAMP)
	$(PY) -m pip wheel --no-deps --no-build-isolation -q -w dist .
	@ls dist/fedcomp-*.whl

## lint: ruff, then vulture for dead code (paths and whitelist: pyproject's [tool.vulture])
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m vulture

clean:
	rm -rf $(VENV) .flwr .ray outputs multirun .pytest_cache mutants
