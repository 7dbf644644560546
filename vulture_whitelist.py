"""Names vulture (`make lint`, `make test`) reports as unused that are used, each with why.

Vulture reads names, never runs code: each line below marks one name as used. Code that
only tests call is dead, not whitelisted, unless it is a harness the tests drive.
"""

# ruff: noqa: B018, F821  (bare names are how vulture reads a whitelist; none is defined)

# Called by a library through its own interface, never by name in this repository.
configure_train  # flwr.serverapp.strategy.Strategy: the ServerApp calls it each round
configure_evaluate  # likewise, for the evaluation rounds
evaluate_local  # clients/client_app.py: registered with Flower by @app.evaluate()
find_class  # pickle.Unpickler's hook (fedcomp/data/sources.py's safe CIFAR-10 loader)

# Numba kernels looked up by their name in the compiled-kernel table (fedcomp.compiled).
_block_amax
_dither_pack
_rotate_run
_unrotate_run
_eden_encode_run
_eden_decode_run
_decode_chunk
_sketch_rows
_unsketch_run

# Attributes written on other libraries' objects, read by those libraries.
THREADING_LAYER  # numba.config: the threading layer Numba starts its threads with
writeable  # numpy's array flags: the cached one-bit table is read-only
conv1  # torchvision's ResNet-18 stem, replaced for 32x32 inputs
maxpool  # likewise
task_id  # Flower's TaskIdentity, set for in-process runs (experiments/inprocess.py)

# Dataclass fields read through dataclasses.asdict.
drop_reply  # fedcomp.settings.FaultSettings: its rates, read through dataclasses.asdict
crash_client
corrupt_payload
nan_update

# Public API that only tests call in this repository.
num_parameters  # fedcomp.models: the size of a built model, for users sizing runs
tree_mean  # fedcomp.trees.aggregate: the list evaluation streaming_tree_mean must equal bit for bit

# Test harnesses in experiments/ that tests drive.
read_log  # experiments/deployment/tap.py: reads a transport log (tests/test_deployment.py)
summarise  # likewise
restart_node  # experiments/inprocess.py: a node restarting as a new device (residual tests)
RESIDUAL  # experiments/hostile.py: the attacks' codec (tests/test_hostile_clients.py)
residual_liars  # experiments/hostile.py's attacks, used by tests/test_hostile_clients.py
extra_metric
nan_metric
two_metric_records
M  # experiments/mutation_triage.py: the triage's third verdict; no entry holds it today
