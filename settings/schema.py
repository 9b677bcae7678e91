"""specpool's YAML config schema: one dataclass per section, validated at load. The router and both
worker pools read it (workers get their section as a dict of these fields).

    specpool serve --config deploy/local.yaml

An unknown key or a bad value raises ConfigError naming it (e.g. "draft.replicas: must be >= 1").
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from settings.cpu_list import parse_cpus
from settings.errors import ConfigError
from settings.yaml_doc import parse_yaml

DRAFT_SAMPLING_MODES = ("greedy", "sampled")
DRAFT_METHODS = ("model", "ngram", "model+ngram")
POLICIES = ("fixed", "threshold", "goodput")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# http.tool_call_parser's names (openai_api/tools.py PARSERS)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "seed_oss", "deepseek_v31",
                     "deepseek_v3", "deepseek_v32", "deepseek_v4", "gemma4", "glm45", "minimax_m2", "kimi_k2", "openai")
# http.reasoning_parser's names (openai_api/reasoning.py NAMES)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gemma4", "seed_oss", "openai_gptoss")
BUILTIN_PREFIX = "builtin:"        # engine.model_pair's offline pairs (builtin:random-pair/draft)
# Upper bounds of the counts that size a round's work. Speculating past a few dozen tokens never pays (E[K] grows
# at most by the product of the acceptance rates, which falls geometrically, while the draft's time grows with K),
# and the controller's cost model is quadratic in k_max (goodput_curve and its overlap chances, every round and
# in `specpool status`): k_max 100000 pinned the router's event loop for minutes.
K_LIMIT = 64               # speculation.k_max, draft.ngram_max_tokens (the n-gram controller's k_max)
NGRAM_LIMIT = 32           # draft.ngram_max: each lookup tries every size, and each size has its own controller
TRIAL_LIMIT = 1024         # draft.prediction_trial_rounds (its window is twice as long, at least 16 rounds)
BRANCH_LIMIT = 2 * K_LIMIT  # speculation.overlap_branches: a pre-draft beside K drafts has at most 2 K branches
DECODE_STEPS_LIMIT = 1024  # speculation.decode_steps: a run that long keeps the policy from re-planning (or
                           # probing) for up to 4x that many tokens under load
WINDOW_LIMIT = 65536       # speculation.window, min_samples: rounds kept per controller (a request's too); a
                           # reload recounts them all
CHANGE_RECENT_LIMIT = 1024  # speculation.change_recent: the change test reads this many rounds every round
HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")  # huggingface_hub's rule


@dataclass
class PoolConfig:
    model: str = ""                 # HF model folder, hub ID, or builtin:random-pair/{draft,target}
    replicas: int = 1
    dtype: str = "float32"
    device: str = "cpu"             # "cpu" or "cuda"
    num_gpus: float = 0.0           # GPUs per actor (per rank for the target)
    num_cpus: float = 1.0           # logical CPUs Ray reserves per actor
    resources: dict = field(default_factory=dict)   # Ray custom resources that pick this pool's nodes
    num_threads: int = 0            # torch intra-op threads per actor (0: one per pinned CPU, or torch's default)
    cpus: list | str = ""           # CPUs of its node each actor is confined to, as taskset: [0, 1] or "0-3,8"
                                    # (a target's ranks split them, one equal slice each); "auto": on a local
                                    # instance, each actor CPUs of its own (num_threads, at least 1), targets
                                    # first, if there are enough; "": not pinned
    max_sessions: int = 256         # KV caches held per worker (LRU beyond that)
    max_batch_size: int = 16        # calls run as one batched forward (1: no batching)
    batch_wait_ms: float = 0.0      # after a call arrives at an idle worker, wait this long for more to batch
                                    # with it (calls arriving while a batch runs always join the next one)
    inline_ms: float = 5.0          # a call (no session start) finding the engine idle runs on the worker's
                                    # event-loop thread, with no thread hop, while such calls take at most this
                                    # long (the loop waits for it; 0: always on the engine thread)
    prefix_cache_tokens: int = 8192  # KV of contexts' first blocks (16 tokens each) kept per worker (per rank of a
                                    # target), so a session starting with a cached prefix computes only the rest
                                    # (LRU; 0: off). Memory: 2 x layers x kv_heads x head_dim x dtype bytes a token
    prefill_chunk_tokens: int = 512  # a prompt longer than this is computed in forwards of at most this many tokens,
                                    # each its own batch, so other requests' rounds run between them (0: in one)

    def validate(self, section: str) -> None:
        cpu_error = _cpu_list_error(self.cpus)
        checks = [
            (bool(self.model), "model", "must name a model folder or hub ID"),
            (self.replicas >= 1, "replicas", "must be >= 1"),
            (self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}"),
            (self.device == "cpu" or self.device.startswith("cuda"), "device", "must be 'cpu' or 'cuda'"),
            (self.num_gpus >= 0, "num_gpus", "must be >= 0"),
            (self.num_cpus >= 0, "num_cpus", "must be >= 0"),
            (self.num_threads >= 0, "num_threads", "must be >= 0"),
            (self.max_sessions >= 1, "max_sessions", "must be >= 1"),
            (self.max_batch_size >= 1, "max_batch_size", "must be >= 1"),
            (0 <= self.batch_wait_ms <= 1000, "batch_wait_ms", "must be in [0, 1000]"),
            (0 <= self.inline_ms <= 1000, "inline_ms", "must be in [0, 1000]"),
            (self.prefix_cache_tokens >= 0, "prefix_cache_tokens", "must be >= 0 (0: off)"),
            (self.prefill_chunk_tokens >= 0, "prefill_chunk_tokens", "must be >= 0 (0: a prompt in one forward)"),
            (cpu_error is None, "cpus", cpu_error),
            (all(isinstance(v, (int, float)) for v in self.resources.values()), "resources",
             "must map resource names to numbers"),
        ]
        for ok, key, message in checks:
            if not ok:
                raise ConfigError(f"{section}.{key}: {message} (got {getattr(self, key)!r})")


@dataclass
class TargetConfig(PoolConfig):
    model: str = "builtin:random-pair/target"
    tensor_parallel_size: int = 1   # ranks per target replica, packed on one node
    engine_process: bool = False    # the engine in a process of its own on the actor's `cpus`, its gRPC server on
                                    # the node's other CPUs (tensor_parallel_size 1 only; target_worker/engine_process.py)

    def validate(self, section: str = "target") -> None:
        super().validate(section)
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"{section}.tensor_parallel_size: must be >= 1 (got {self.tensor_parallel_size!r})")
        if self.engine_process and self.tensor_parallel_size > 1:
            raise ConfigError(f"{section}.engine_process: a tensor-parallel group's ranks keep their engines on a "
                              f"thread; needs tensor_parallel_size 1 (got {self.tensor_parallel_size!r})")
        cpus = len(parse_cpus(self.cpus))
        if 0 < cpus < self.tensor_parallel_size:
            raise ConfigError(f"{section}.cpus: {cpus} CPU(s) for {self.tensor_parallel_size} ranks; give each rank "
                              f"at least one (got {self.cpus!r})")


@dataclass
class TlsConfig:
    """The `tls:` section: TLS on the public port and (mutual) TLS on router <-> worker channels.
    Paths must exist on every node that reads them (router and workers)."""
    cert: str = ""                  # PEM certificate chain of this deployment ("": TLS off)
    key: str = ""                   # its PEM private key
    ca: str = ""                    # PEM CA bundle that signed the peers' certificates
    client_auth: bool = False       # public port: require client certificates (mutual TLS)
    internal: bool = True           # router <-> workers over mutual TLS (both present `cert`)
    server_name: str = ""           # name to check in worker certificates ("": their address)

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def validate(self, section: str = "tls") -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError(f"{section}.key: cert and key go together (cert={self.cert!r}, key={self.key!r})")
        if self.enabled and not self.ca and (self.internal or self.client_auth):
            raise ConfigError(f"{section}.ca: needed to verify peers when internal or client_auth is on")
        for key in ("cert", "key", "ca"):
            path = getattr(self, key)
            if path and not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"{section}.{key}: no such file {path!r}")


@dataclass
class DraftConfig(PoolConfig):
    model: str = "builtin:random-pair/draft"
    method: str = "model"           # model (the draft pool) | ngram (prompt lookup, no draft pool started) |
                                    # model+ngram (per round, whichever source the K controller models faster)
    ngram_min: int = 2              # smallest n-gram (suffix of the context) that prompt lookup matches
    ngram_max: int = 4              # largest; the longest match wins
    ngram_max_tokens: int = 8       # longest continuation an n-gram round proposes (its K range's top)
    prediction_max_tokens: int = 32  # ... for a request with a prediction (OpenAI's Predicted Outputs), whose drafts
                                    # copied from it are accepted far more often (router/prediction.py)
    prediction_trial_rounds: int = 8  # ... whose prediction is dropped once about this many of its rounds that
                                    # drafted from it, and as many others, show it delivering less (0: never)

    def validate(self, section: str = "draft") -> None:
        super().validate(section)
        checks = (("method", self.method in DRAFT_METHODS, f"must be one of {DRAFT_METHODS}"),
                  ("ngram_min", self.ngram_min >= 1, "must be >= 1"),
                  ("ngram_max", self.ngram_min <= self.ngram_max <= NGRAM_LIMIT,
                   f"must be in [ngram_min, {NGRAM_LIMIT}] = [{self.ngram_min}, {NGRAM_LIMIT}]"),
                  ("ngram_max_tokens", 1 <= self.ngram_max_tokens <= K_LIMIT, f"must be in [1, {K_LIMIT}]"),
                  ("prediction_max_tokens", 1 <= self.prediction_max_tokens <= K_LIMIT, f"must be in [1, {K_LIMIT}]"),
                  ("prediction_trial_rounds", 0 <= self.prediction_trial_rounds <= TRIAL_LIMIT,
                   f"must be in [0, {TRIAL_LIMIT}]"))
        for key, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{section}.{key}: {rule} (got {getattr(self, key)!r})")

    @property
    def uses_model(self) -> bool:
        """Whether a draft pool is started (methods model and model+ngram)."""
        return self.method != "ngram"


@dataclass
class ControllerConfig:
    policy: str = "goodput"          # fixed | threshold | goodput
    k: int = 4                       # the fixed K, and the starting K of the adaptive policies
    k_min: int = 0                   # smallest K an adaptive policy chooses (0: plain target decoding)
    k_max: int = 8                   # largest K an adaptive policy chooses; positions tracked: 0..k_max-1
    window: int = 128                # rounds in the rolling acceptance statistics
    min_samples: int = 32            # ... but keep at least this many rounds with K > 0 (sparse data, e.g. at K = 0)
    prior_acceptance: float = 0.5    # acceptance assumed before any data (prior of the pooled rate)
    prior_weight: float = 8.0        # pseudo-outcomes shrinking each a_j towards the pooled rate (and it to the prior)
    change_recent: int = 16          # rounds (with K > 0) in the change test's recent part
    change_z: float = 4.5            # forget older rounds when a_0 over the recent part differs by this many
                                     # standard errors from the rest of the window (0: no change test)
    cost_window: int = 256           # effective length in rounds of the exponentially weighted timing estimates
    load_window: int = 8             # ... and of the load estimate (rows per target forward), which moves faster
    # overlap (draft-ahead)
    overlap: bool = True             # while the target verifies, the draft pre-drafts the next round for the
                                     # verdict "all K accepted + its own guess of the next token"...
    overlap_tokens: int = 0          # most tokens one pre-draft may draft (guess + next K; 0: k_max + 1)
    overlap_branches: int = 16       # ... and beside that, at most this many rejection branches, the likeliest:
                                     # drafts after "j drafts accepted, then the draft's runner-up at j" (0: only
                                     # all accepted)
    overlap_branch_guesses: int = 2  # guesses of the correction per rejected position: 1 the runner-up, 2 also the
                                     # draft's third choice
    stage_predrafts: bool = True     # a pre-draft back before the verdict is staged on the target, which starts the
                                     # next round itself when the verdict is one it guessed (no router round trip)
    hand_off: bool = False           # a round's model drafts go from the draft worker straight to the target, whose
                                     # verify call waits there for them (no router round trip between the calls);
                                     # only rounds that pre-draft nothing beside their verify, or chain it:
    chain_predrafts: bool = True     # a round that drafts now tells the draft worker its pre-draft too, which starts
                                     # right after the drafts, with no router round trip between
    prefill_first: bool = True       # a request's first round is the target's prefill alone (K = 0), the draft
                                     # prefilling and pre-drafting the next round beside it: the first token waits
                                     # for the target's prefill only, not for the draft's prefill and drafts too
                                     # (with overlap, in greedy-draft mode)
    decode_steps: int = 32           # a round at K = 0 (chosen, or speculation.k: 0) is a decode run: the target
                                     # decodes up to this many tokens in one call, streaming each back, with no
                                     # round trip between them (1: one call per token)
    answer_delay_ms: float = 10.0    # ... and may hold a step's answer this long to send it with later steps'
                                     # in one message (steps shorter than a message's cost; 0: each at once)
    unstreamed_answer_delay_ms: float = 200.0   # ... this long instead for a request whose client takes its
                                     # output whole (Generate, HTTP without stream) and has no stop strings
    answer_delay_max_ms: float = 40.0   # under load answer_delay_ms grows with the target's rows per forward,
                                     # up to this (each message costs the target's event loop CPU that its
                                     # batched forward then waits for; <= answer_delay_ms: no growth)
    # threshold policy
    raise_above: float = 0.8         # K += 1 when the acceptance rate since the last step is above this
    lower_below: float = 0.4         # K -= 1 when it is below this
    adjust_every: int = 16           # rounds between two threshold steps
    # goodput policy
    warmup_rounds: int = 16          # rounds observed at K = k before the model decides (and before probing)
    hysteresis: float = 0.01         # switch only if the best K's modeled goodput beats the current K's by this
    # probing (threshold and goodput)
    probe_every: int = 8             # mean rounds between probes; 0 disables probing
    random_probe: float = 0.05       # chance that a probe tries a uniformly random other K instead of K+1

    def validate(self, section: str = "speculation") -> None:
        """Raise ConfigError naming the first bad key, e.g. 'speculation.k_max: must be >= k_min=2 (got 1)'."""
        if self.policy not in POLICIES:
            raise ConfigError(f"{section}.policy: must be one of {POLICIES} (got {self.policy!r})")
        checks = (
            ("k_min", self.k_min >= 0, "must be >= 0"),
            ("k_max", self.k_min <= self.k_max <= K_LIMIT,
             f"must be in [k_min, {K_LIMIT}] = [{self.k_min}, {K_LIMIT}]"),
            ("k", self.k_min <= self.k <= self.k_max, f"must be in [k_min, k_max] = [{self.k_min}, {self.k_max}]"),
            ("window", 1 <= self.window <= WINDOW_LIMIT, f"must be in [1, {WINDOW_LIMIT}]"),
            ("min_samples", 0 <= self.min_samples <= WINDOW_LIMIT, f"must be in [0, {WINDOW_LIMIT}]"),
            ("prior_acceptance", 0.0 <= self.prior_acceptance <= 1.0, "must be in [0, 1]"),
            ("prior_weight", self.prior_weight >= 0, "must be >= 0"),
            ("change_recent", 1 <= self.change_recent <= CHANGE_RECENT_LIMIT,
             f"must be in [1, {CHANGE_RECENT_LIMIT}]"),
            ("change_z", self.change_z >= 0, "must be >= 0"),
            ("cost_window", self.cost_window >= 1, "must be >= 1"),
            ("load_window", self.load_window >= 1, "must be >= 1"),
            ("overlap_tokens", self.overlap_tokens == 0 or 2 <= self.overlap_tokens <= K_LIMIT + 1,
             f"must be 0 or in [2, {K_LIMIT + 1}]"),
            ("overlap_branches", 0 <= self.overlap_branches <= BRANCH_LIMIT, f"must be in [0, {BRANCH_LIMIT}]"),
            ("overlap_branch_guesses", self.overlap_branch_guesses in (1, 2), "must be 1 or 2"),
            ("decode_steps", 1 <= self.decode_steps <= DECODE_STEPS_LIMIT, f"must be in [1, {DECODE_STEPS_LIMIT}]"),
            ("answer_delay_ms", 0 <= self.answer_delay_ms <= 1000, "must be in [0, 1000]"),
            ("unstreamed_answer_delay_ms", 0 <= self.unstreamed_answer_delay_ms <= 10000, "must be in [0, 10000]"),
            ("answer_delay_max_ms", 0 <= self.answer_delay_max_ms <= 1000, "must be in [0, 1000]"),
            ("raise_above", 0.0 <= self.raise_above <= 1.0, "must be in [0, 1]"),
            ("lower_below", 0.0 <= self.lower_below <= self.raise_above,
             f"must be in [0, raise_above={self.raise_above}]"),
            ("adjust_every", self.adjust_every >= 1, "must be >= 1"),
            ("warmup_rounds", self.warmup_rounds >= 0, "must be >= 0"),
            ("hysteresis", self.hysteresis >= 0, "must be >= 0"),
            ("probe_every", self.probe_every >= 0, "must be >= 0"),
            ("random_probe", 0.0 <= self.random_probe <= 1.0, "must be in [0, 1]"),
        )
        for key, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{section}.{key}: {rule} (got {getattr(self, key)!r})")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"          # interface the public gRPC server binds
    port: int = 50051
    worker_timeout_s: float = 30.0   # per router -> worker call
    ready_timeout_s: float = 600.0   # how long serve waits for every pool to load
    metrics_port: int = -1           # Prometheus /metrics on router.host (-1: off, 0: any free port)
    admin_host: str = "127.0.0.1"    # interface the Admin service (specpool reload / status) binds
    admin_port: int = 50052          # its port (0: any free port; -1: on the public port, beside Generation)
    max_active_requests: int = 64    # requests generating at once; more wait in the admission queue
    max_queued_requests: int = 256   # beyond this, RESOURCE_EXHAUSTED at once
    max_prompt_tokens: int = 0       # size cap on prompts (0: the model's context)
    max_new_tokens: int = 4096       # size cap on outputs (0: the model's context)
    shutdown_grace_s: float = 30.0   # on SIGTERM: how long in-flight requests may take to finish
    target_recovery_s: float = 60.0  # how long a request waits for a failed target to come back
    prefix_affinity_slack: int = 4   # a request whose prompt begins as an earlier one's goes to the replica that
                                     # served it (its prefix cache holds those blocks) while that one holds at most
                                     # this many sessions more than the least loaded (-1: always the least loaded)
    log_requests: bool = False       # a line per client request on serve's log once it is over (hot-reloadable)
    admin_keys: list = field(default_factory=list, metadata={"secret": True})   # bearer keys Admin calls must carry
                                     # ([]: none needed; hot-reloadable); never shown

    def validate(self, section: str = "router") -> None:
        for key in ("port", "metrics_port", "admin_port"):
            if not -1 <= getattr(self, key) <= 65535 or (key == "port" and self.port < 0):
                raise ConfigError(f"{section}.{key}: must be a port number (got {getattr(self, key)!r})")
        for key in ("worker_timeout_s", "ready_timeout_s", "max_active_requests", "shutdown_grace_s",
                    "target_recovery_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{section}.{key}: must be > 0 (got {getattr(self, key)!r})")
        for key in ("max_queued_requests", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{section}.{key}: must be >= 0 (got {getattr(self, key)!r})")
        check_keys(self.admin_keys, f"{section}.admin_keys")
        if self.prefix_affinity_slack < -1:
            raise ConfigError(f"{section}.prefix_affinity_slack: must be >= -1 (-1: off) "
                              f"(got {self.prefix_affinity_slack!r})")


@dataclass
class SpeculationConfig(ControllerConfig):
    """The K controller's knobs (router/controller.py) plus how drafts are sampled."""
    draft_sampling: str = "greedy"   # greedy: q one-hot, IDs only; sampled: draft samples, sends hidden states

    def validate(self, section: str = "speculation") -> None:
        super().validate(section)
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise ConfigError(f"{section}.draft_sampling: must be one of {DRAFT_SAMPLING_MODES} "
                              f"(got {self.draft_sampling!r})")


@dataclass
class RayConfig:
    address: str = ""                # "" starts a local Ray instance; "auto" or host:port joins a cluster
    namespace: str = "specpool"
    node_ip: str = ""                # address workers bind and advertise ("": their Ray node's IP);
                                     # 127.0.0.1 keeps a single-machine deployment on loopback
    num_cpus: int = 0                # local instance only: logical CPUs (0: this machine's cores, or more if the
                                     # pools ask for more: router.launch.local_num_cpus)
    resources: dict = field(default_factory=dict)   # local instance only: custom resources to declare
    worker_niceness: int = 0         # CPU priority (nice) of the draft and target worker processes; Ray's own
                                     # default for its workers, 15, lets any other process pre-empt a forward

    def validate(self, section: str = "ray") -> None:
        if self.num_cpus < 0:
            raise ConfigError(f"{section}.num_cpus: must be >= 0 (got {self.num_cpus!r})")
        if not (isinstance(self.worker_niceness, int) and 0 <= self.worker_niceness <= 19):
            raise ConfigError(f"{section}.worker_niceness: must be an integer from 0 to 19 (got "
                              f"{self.worker_niceness!r}; below 0 needs privileges a worker does not have)")


REDACTED = "<redacted>"      # a secret's value (a field whose metadata says "secret") in a message or the log


def check_keys(keys: list, key: str) -> None:
    """Bearer keys (http.api_keys, router.admin_keys) are non-empty strings; a refusal never shows them."""
    if not all(isinstance(value, str) and value for value in keys):
        raise ConfigError(f"{key}: must be a list of non-empty strings (got {REDACTED})")


def shown(section, key: str, form=repr) -> str:
    """The value of `key` of a config section (a dataclass) for a message or the log: form(value), or REDACTED for
    a secret that is set (http.api_keys: bearer keys must reach neither serve's log nor an admin client; that none
    is set is no secret)."""
    secret = any(f.name == key and f.metadata.get("secret") for f in dataclasses.fields(section))
    return REDACTED if secret and getattr(section, key) else form(getattr(section, key))


@dataclass
class HttpConfig:
    """The `http:` section: the OpenAI-compatible HTTP API, served on router.host next to gRPC."""
    port: int = -1                   # -1: off; 0: any free port
    api_keys: list = field(default_factory=list, metadata={"secret": True})   # bearer keys accepted on /v1/*
                                                                             # ([]: no auth); never shown
    chat_template: str = ""          # a Jinja chat template file, for a model whose tokenizer has none
    model_name: str = ""             # the model's id in /v1/models ("": the target model folder's name)
    tool_call_parser: str = ""       # how tool_choice "auto" reads calls in the output: hermes | llama3_json |
                                     # mistral | pythonic | qwen3_coder | seed_oss | deepseek_v31 | deepseek_v3 |
                                     # deepseek_v32 | deepseek_v4 | gemma4 | glm45 | minimax_m2 | kimi_k2 |
                                     # openai (gpt-oss; with reasoning_parser openai_gptoss)
                                     # ("": "auto" is refused; "required" and named functions need none)
    reasoning_parser: str = ""       # how chat answers split a thinking model's reasoning from its content:
                                     # deepseek_r1 | qwen3 | gemma4 | seed_oss | openai_gptoss ("": no split,
                                     # the reasoning is content)
    store_responses: int = 1000      # the Responses API's stored responses kept, the last used
                                     # (previous_response_id, GET /v1/responses/{id}); 0: none stored
    store_responses_mb: int = 256    # ... and at most this much of their text, the last used kept
    store_path: str = ""             # where they are kept: "" in this router's memory; a file: an SQLite database
                                     # there (created if missing), kept over restarts and shared by the routers on
                                     # this machine that name it

    def validate(self, section: str = "http") -> None:
        if not -1 <= self.port <= 65535:
            raise ConfigError(f"{section}.port: must be a port number or -1 (got {self.port!r})")
        check_keys(self.api_keys, f"{section}.api_keys")
        if not 0 <= self.store_responses <= 1_000_000:
            raise ConfigError(f"{section}.store_responses: must be in [0, 1000000] (got {self.store_responses!r})")
        if not 1 <= self.store_responses_mb <= 1_000_000:
            raise ConfigError(f"{section}.store_responses_mb: must be in [1, 1000000] "
                              f"(got {self.store_responses_mb!r})")
        if self.store_path and not Path(self.store_path).resolve().parent.is_dir():
            raise ConfigError(f"{section}.store_path: no such directory for the file (got {self.store_path!r})")
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ConfigError(f"{section}.chat_template: no such file (got {self.chat_template!r})")
        for key, names in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, key) not in ("", *names):
                raise ConfigError(f"{section}.{key}: one of {', '.join(names)} or \"\" (got {getattr(self, key)!r})")
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ConfigError(f"{section}.tool_call_parser: openai reads gpt-oss's harmony messages, which need "
                              f"{section}.reasoning_parser: openai_gptoss as well (got {self.reasoning_parser!r})")


@dataclass
class SpecpoolConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)


def _cpu_list_error(spec) -> str | None:
    """Why `spec` is not a CPU list (settings.cpu_list.parse_cpus), or None."""
    try:
        parse_cpus(spec)
    except ValueError as exc:
        return str(exc)
    return None


def _coerce(value, kind, key: str, show=repr):
    """Check one scalar against its dataclass field type; ints are accepted where floats are. A refusal shows the
    value as show(value) (a secret's: REDACTED)."""
    origin = typing.get_origin(kind) or kind
    if origin is types.UnionType:
        if not any(isinstance(value, option) for option in typing.get_args(kind)):
            raise ConfigError(f"{key}: must be {' or '.join(t.__name__ for t in typing.get_args(kind))} "
                              f"(got {show(value)})")
        return value
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a mapping (got {show(value)})")
        return dict(value)
    if not isinstance(value, origin) or (origin is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: must be {origin.__name__} (got {show(value)})")
    return value


def _build(cls, data: dict, prefix: str):
    """`cls` from the mapping `data` of the section at `prefix` ("" or e.g. "speculation."), every key checked.
    A section given with no value (`speculation:` alone) is refused, not read as all its defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: must be a mapping (got {data!r})")
    hints = typing.get_type_hints(cls)
    names = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(data) - set(names), key=str)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key{_did_you_mean(unknown[0], names)} "
                          f"(known: {', '.join(names)})")
    kwargs, secrets = {}, {f.name for f in dataclasses.fields(cls) if f.metadata.get("secret")}
    for name, value in data.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if value is None:
                raise ConfigError(f"{prefix}{name}: empty; leave the section out for its defaults")
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, kind, prefix + name, (lambda _: REDACTED) if name in secrets else repr)
    return cls(**kwargs)


def _did_you_mean(key, names: list[str]) -> str:
    """", did you mean 'overlap_tokens'?" for a key close to a known one (a typo), else ""."""
    close = difflib.get_close_matches(str(key), names, n=1)
    return f", did you mean {close[0]!r}?" if close else ""


def config_from_dict(data: dict, base_dir: str | os.PathLike | None = None) -> SpecpoolConfig:
    """Build and validate a config from its parsed YAML. Model paths are resolved (`resolve_model`) against
    `base_dir` (the YAML file's folder), then the working directory, so a missing folder is refused here,
    before anything starts."""
    config = _build(SpecpoolConfig, data or {}, "")
    for section in dataclasses.fields(SpecpoolConfig):
        getattr(config, section.name).validate(section.name)
    check_answer_delays(config)
    check_ports(config)
    for section in ("draft", "target"):
        pool = getattr(config, section)
        pool.model = resolve_model(pool.model, f"{section}.model", base_dir)
    return config


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")     # a listener on one of these takes the port on every interface
PORT_HINTS = {"router.admin_port": " (serve --admin-port picks another; -1 serves Admin on the public port)",
              "http.port": " (serve --http-port picks another; -1 turns HTTP off)",
              "router.metrics_port": " (-1 turns the metrics endpoint off)"}


def check_ports(config: SpecpoolConfig) -> None:
    """No two of the router's listeners on one port of one host (0, any free port, and -1, off, excepted): the
    second would fail to bind only once the first had, on serve's own port, and be reported as a busy port."""
    router, seen = config.router, {}
    for key, host, port in (("router.port", router.host, router.port),
                            ("router.admin_port", router.admin_host, router.admin_port),
                            ("router.metrics_port", router.host, router.metrics_port),
                            ("http.port", router.host, config.http.port)):
        for other, other_host in seen.get(port, []) if port > 0 else []:
            if host == other_host or host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS:
                raise ConfigError(f"{key}: {port} is {other} too{PORT_HINTS.get(key, '')}")
        seen.setdefault(port, []).append((key, host))


def check_answer_delays(config: SpecpoolConfig) -> None:
    """A decode run's held answers must reach the router within its wait for each answer (router.worker_timeout_s),
    or every held run would time out."""
    wait = config.router.worker_timeout_s
    for key in ("answer_delay_ms", "unstreamed_answer_delay_ms", "answer_delay_max_ms"):
        held = getattr(config.speculation, key)
        if held / 1000 >= wait:
            raise ConfigError(f"speculation.{key}: must be shorter than router.worker_timeout_s={wait:g} s "
                              f"(got {held:g} ms)")


def parse_config(data, base_dir: str | os.PathLike | None) -> SpecpoolConfig:
    """The one way a YAML document becomes a config: `load_config`, `specpool reload` and SIGHUP all come
    here, so a relative model path means the same folder (next to the YAML file, `base_dir`) everywhere."""
    return config_from_dict(data, base_dir)


def load_config(path: str | os.PathLike) -> SpecpoolConfig:
    return parse_config(read_yaml(path), Path(path).parent)


def read_yaml(path: str | os.PathLike):
    """The parsed YAML document at `path` (parse_yaml: a key given twice is refused); an unreadable file, bad
    YAML or a duplicate key is a one-line ConfigError naming the file (and the line)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return parse_yaml(text, str(path))


def resolve_model(model: str, key: str, base_dir: str | os.PathLike | None = None) -> str:
    """A model folder as an absolute path: a relative one is looked for in `base_dir`, then the working
    directory. A name that is no existing folder is taken as a Hugging Face hub ID only if it has that form
    (`name` or `namespace/name`); otherwise ConfigError names the key and the paths tried."""
    if model.startswith(BUILTIN_PREFIX):
        return model
    path = Path(model).expanduser()
    folders = [] if path.is_absolute() else [Path(base_dir)] if base_dir is not None else []
    tried = [path] if path.is_absolute() else [(folder / path).absolute() for folder in folders + [Path.cwd()]]
    for candidate in tried:
        if candidate.is_dir():
            return str(candidate.resolve())
    if not path.is_absolute() and HUB_ID.fullmatch(model):
        return model
    raise ConfigError(f"{key}: no model folder {model!r} (tried {', '.join(map(str, dict.fromkeys(tried)))}), "
                      "and it is not a hub ID (name or namespace/name)")


def with_model_paths_from(data, folder: Path):
    """The YAML document with its model paths resolved as load_config resolves them (`resolve_model`)."""
    for section in ("draft", "target"):
        pool = data.get(section) if isinstance(data, dict) else None
        model = pool.get("model") if isinstance(pool, dict) else None
        if isinstance(model, str) and model:
            pool["model"] = resolve_model(model, f"{section}.model", folder)
    return data


def config_to_yaml(config) -> str:
    """A config (or one section) as YAML for an admin client, secrets (http.api_keys, router.admin_keys) shown as
    REDACTED."""
    return yaml.safe_dump(_shown_fields(config), sort_keys=False)


def _shown_fields(value):
    """dataclasses.asdict of `value`, at every depth, with each secret field that is set replaced by REDACTED."""
    if not dataclasses.is_dataclass(value):
        return copy.deepcopy(value)
    shown = {}
    for f in dataclasses.fields(value):
        field_value = getattr(value, f.name)
        shown[f.name] = REDACTED if f.metadata.get("secret") and field_value else _shown_fields(field_value)
    return shown
