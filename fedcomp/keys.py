"""Record and config keys shared by the client mod and the server strategy wrapper.

The client mod (``fedcomp.flower.mod``) and the server wrapper
(``fedcomp.flower.strategy``) never import each other; they agree on these names
instead, as Flower's DP mods and wrappers do.
"""

#: Version of the fedcomp message protocol (header fields and record layout).
#: 5: fedcomp's header fields and metrics packed in one entry (fedcomp.flower.packed);
#: 4: compact payload entries (fedcomp.compact): a payload's header, which its reader
#: knows, is one byte in both directions;
#: 3: fewer fixed bytes (the downlink codec travels with the run settings, the step
#: list has no per-step checksum and float32 scales, no codec-bytes metric, positional
#: payload bundles, the settings' digest and handles only in replies to settings sent
#: in full);
#: 2: compact messages, every payload of a message in one bundle (fedcomp.bundle)
#: inside its header or config record; 1: one Array per payload.
PROTOCOL_VERSION = 5

# --- Instruction (server -> client) config keys -----------------------------------
#: JSON-encoded codec spec, e.g. ``{"name": "fp32"}``. Its presence tells the mod
#: that a fedcomp strategy wrapper is on the server.
KEY_CODEC = "fedcomp.codec"
#: Round number the instruction belongs to.
KEY_ROUND = "fedcomp.round"
#: Run seed from which all public randomness is derived.
KEY_RUN_SEED = "fedcomp.run-seed"
#: JSON-encoded settings the ClientApp needs (dataset, partition, model, training).
KEY_TASK = "fedcomp.task"
#: Protocol version the server speaks.
KEY_PROTOCOL = "fedcomp.protocol"
#: The stable id the server believes this node has (checked by the client).
KEY_EXPECTED_ID = "fedcomp.expected-id"
#: Last round whose reply from THIS client the server accepted (-1: none). The client
#: commits the state that reply produced only when it sees this acknowledgement.
KEY_ACK_ROUND = "fedcomp.ack-round"
#: 1 when the server asks this client for a full-precision resync of its control variate.
KEY_RESYNC = "fedcomp.resync"
#: JSON-encoded tensor policy, e.g. ``{"min_numel": 256}``.
KEY_POLICY = "fedcomp.policy"
#: Joint (one-bit) codes: this client's position among the round's selected clients,
#: how many were selected, and the public tau per block of every jointly coded tensor
#: (float32 bytes, model order).
KEY_JOINT_INDEX = "fedcomp.joint-index"
KEY_JOINT_CLIENTS = "fedcomp.joint-clients"
KEY_JOINT_TAU = "fedcomp.joint-tau"
#: The adaptive codec's budget for this client and round (bits a coordinate), when the
#: server adapts it (fedcomp.budgets); without it the codec's own.
KEY_BIT_BUDGET = "fedcomp.bit-budget"
#: Downlink replica (fedcomp.downlink): how this instruction carries the model
#: ("full": x_hat under the strategy's arrays key; "steps": the payloads of the steps
#: the client lacks, in KEY_DOWNLINK_PAYLOADS, and no model), the version and checksum of
#: x_hat it brings the client to, and the arrays key the mod rebuilds the model under.
KEY_DOWNLINK = "fedcomp.downlink"
DOWNLINK_FULL = "full"
DOWNLINK_STEPS = "steps"
KEY_DOWNLINK_VERSION = "fedcomp.downlink-version"
KEY_DOWNLINK_CHECKSUM = "fedcomp.downlink-checksum"
KEY_DOWNLINK_ARRAYS = "fedcomp.downlink-arrays"
#: The downlink codec spec (JSON) in "steps" instructions: the client refuses any step
#: payload this codec (or the raw value, for tensors the policy sends raw) does not build.
KEY_DOWNLINK_CODEC = "fedcomp.downlink-codec"
#: The downlink steps' payloads, one bundle (fedcomp.bundle) of "<target>/<tensor>"
#: entries; the steps themselves as JSON [[source, target, scales], ...] in
#: KEY_DOWNLINK_STEPS.
KEY_DOWNLINK_PAYLOADS = "fedcomp.downlink-payloads"
KEY_DOWNLINK_STEPS = "fedcomp.downlink-steps"
#: Digest of the run settings (codec, policy, task) the instruction means; the values
#: themselves travel only until the client's reply header confirms the digest
#: (fedcomp.flower.shared_settings).
KEY_SETTINGS = "fedcomp.settings"
#: Query kind for first-contact identity queries.
KEY_QUERY = "fedcomp.query"
QUERY_IDENTITY = "identity"

# --- Reply (client -> server) record names and header keys ------------------------
#: ConfigRecord holding the reply header and, in train replies, KEY_PAYLOADS.
RECORD_HEADER = "fedcomp.header"
#: The train reply's payloads: one bundle (fedcomp.bundle), one entry per tensor in
#: model order. A compressed reply is three Flower objects besides its Message: the
#: RecordDict, this header and the metrics.
KEY_PAYLOADS = "fedcomp.payloads"
#: ConfigRecord in identity replies.
RECORD_IDENTITY = "fedcomp.identity"
#: Stable client id (the partition id unless configured otherwise).
KEY_STABLE_ID = "fedcomp.stable-id"
#: The message kinds this client's mod handles, comma-separated (e.g. "train,evaluate"):
#: the server sends model-free evaluate instructions only to mods that rebuild them.
KEY_HANDLES = "fedcomp.handles"
#: Downlink replica: the version and checksum of the x_hat this client now holds (the
#: replica it trained or evaluated on).
KEY_REPLICA_VERSION = "fedcomp.replica-version"
KEY_REPLICA_CHECKSUM = "fedcomp.replica-checksum"
#: Residual memory: the committed control-variate version the payload was encoded
#: against (0 for a resync), and the checksum of that control variate.
KEY_CV_VERSION = "fedcomp.cv-version"
KEY_CV_CHECKSUM = "fedcomp.cv-checksum"

# --- Reply metrics --------------------------------------------------------------------
#: The MetricRecord of train and evaluate replies (Flower's quickstart convention).
RECORD_METRICS = "metrics"
KEY_NUM_EXAMPLES = "num-examples"
METRIC_ENCODE_S = "fedcomp.encode-s"
#: Residual memory statistics measured by the client (sums over tensors):
#: ||delta - h||^2, ||delta||^2, the compression noise ||r_hat - r||^2, omega ||r||^2,
#: and the bytes its control-variate state takes.
METRIC_CV_RESIDUAL = "fedcomp.cv-residual-norm2"
METRIC_CV_DELTA = "fedcomp.cv-delta-norm2"
METRIC_CV_NOISE = "fedcomp.cv-noise-norm2"
METRIC_CV_BOUND = "fedcomp.cv-noise-bound"
#: An unbiased estimate of ||E decode(encode(r)) - r||^2 on the client's real residuals,
#: from the residual codec's ``bias_draws`` extra draws (a diagnostic; may be negative).
METRIC_CV_BIAS = "fedcomp.cv-bias-norm2"
METRIC_STATE_BYTES = "fedcomp.state-bytes"
#: The codec's relative error on this client's update, measured by the client.
METRIC_REL_ERROR = "fedcomp.codec-rel-error"
#: Joint codes: fraction of this client's coordinates farther than L_J / 4 from 0, in
#: units of the public tau (they wrap unless the center is near them).
METRIC_OUT_OF_RANGE = "fedcomp.out-of-range"

#: Reply header entries holding the reply's metrics: ``METRIC_PREFIX + name`` (the app's
#: own metrics and fedcomp's measurements; the wrapper rebuilds the MetricRecord).
METRIC_PREFIX = "metric:"

# --- Packed fields (protocol 5, fedcomp.flower.packed) ------------------------------------------
#: The one bytes entry of a header or instruction config holding fedcomp's fields.
KEY_PACKED = "fedcomp"
#: The fields that travel packed, each as a one-byte tag: its position here plus one.
#: Append only: a tag's meaning is part of the protocol. The payload bundles stay
#: entries of their own (their readers take views into them, nothing copied).
PACKED_FIELDS: tuple[str, ...] = (
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_EXPECTED_ID,
    KEY_ACK_ROUND,
    KEY_RESYNC,
    KEY_SETTINGS,
    KEY_CODEC,
    KEY_TASK,
    KEY_POLICY,
    KEY_JOINT_INDEX,
    KEY_JOINT_CLIENTS,
    KEY_JOINT_TAU,
    KEY_DOWNLINK,
    KEY_DOWNLINK_VERSION,
    KEY_DOWNLINK_CHECKSUM,
    KEY_DOWNLINK_ARRAYS,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_STEPS,
    KEY_STABLE_ID,
    KEY_HANDLES,
    KEY_REPLICA_VERSION,
    KEY_REPLICA_CHECKSUM,
    KEY_CV_VERSION,
    KEY_CV_CHECKSUM,
    METRIC_PREFIX + KEY_NUM_EXAMPLES,
    METRIC_PREFIX + METRIC_ENCODE_S,
    METRIC_PREFIX + METRIC_CV_RESIDUAL,
    METRIC_PREFIX + METRIC_CV_DELTA,
    METRIC_PREFIX + METRIC_CV_NOISE,
    METRIC_PREFIX + METRIC_CV_BOUND,
    METRIC_PREFIX + METRIC_STATE_BYTES,
    METRIC_PREFIX + METRIC_REL_ERROR,
    METRIC_PREFIX + METRIC_OUT_OF_RANGE,
    KEY_BIT_BUDGET,
    METRIC_PREFIX + METRIC_CV_BIAS,
)

#: Error reasons of injected faults (clients.faults) contain this, then the fault kind.
FAULT_REASON_PREFIX = "fault injection: "

#: Node-config keys a SuperNode may carry to name its stable id.
NODE_CONFIG_STABLE_ID = "stable-id"
NODE_CONFIG_PARTITION_ID = "partition-id"

#: Evaluation inside the train round (settings.evaluate_in_train): each train reply
#: also reports the model the client RECEIVED, evaluated before local training on its
#: local evaluation split (the data an evaluate instruction would use): accuracy, mean
#: loss and the number of examples, which weigh the server's mean of the other two.
METRIC_PRE_TRAIN_ACCURACY = "pre-train-accuracy"
METRIC_PRE_TRAIN_LOSS = "pre-train-loss"
METRIC_PRE_TRAIN_EXAMPLES = "pre-train-examples"
