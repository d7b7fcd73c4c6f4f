"""The serving config: one YAML file (or the `args` of a Serve config) -> `ServeConfig`.

Unknown keys are errors that name them: a misspelt key must not silently fall back to a default.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.tls import TlsSetting
from specdec_core.cuda_graphs import GraphConfig, check_widths
from specdec_core.drafters import registry as drafters
from specdec_core.drafters.base import DraftMethod, DraftSpec
from specdec_core.errors import InvalidArgument

# Serve's logger: what a worker logs at its start goes there (module loggers stay under WARNING in Ray's workers).
serve_log = logging.getLogger("ray.serve")

Dtype = Literal["bfloat16", "float16", "float32"]
Device = Literal["cpu", "cuda"]
# Ray's placement-group strategies: PACK as few nodes as possible (spread if they must), STRICT_PACK one node or
# wait, SPREAD as many nodes as possible, STRICT_SPREAD one node per bundle or wait.
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
# Serve's proxy locations: a proxy on EveryNode that holds a replica, HeadOnly, or Disabled (handles only).
ProxyLocation = Literal["EveryNode", "HeadOnly", "Disabled"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SERVE_METRICS_INTERVAL_S = 10.0  # Serve's default autoscaling_config.metrics_interval_s


class WorkerAutoscaling(_Strict):
    """Serve autoscaling of a worker deployment by its sessions (`deployments.autoscaling`): the replicas each
    report the sessions they hold, the routers the sessions that wait for a slot, and Serve's controller keeps
    (held + waiting) / target_sessions_per_replica replicas, between min_replicas and max_replicas. A replica that
    is scaled down takes no new session and finishes those it holds first (`Placement.drain_timeout_s`)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=1)  # at deployment; None: min_replicas
    # The sessions a replica should hold. None: three quarters of its KV slots (as the replicas report them,
    # after any kv_cache_max_bytes cut), which leaves room for a burst while a new replica starts.
    target_sessions_per_replica: float | None = Field(None, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)  # the load must call for more replicas this long before they start
    downscale_delay_s: float = Field(120.0, ge=0)  # ... and for fewer this long before replicas drain
    look_back_period_s: float = Field(20.0, gt=0)  # the load is averaged over this window
    # How often each replica sends its load to Serve's controller (Serve's metrics_interval_s; None: Serve's
    # default, 10 s; Serve warns that it will move to an environment variable).
    metrics_interval_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _order(self) -> WorkerAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.look_back_period_s <= (self.metrics_interval_s or SERVE_METRICS_INTERVAL_S):
            raise ValueError(
                f"look_back_period_s must exceed metrics_interval_s ({SERVE_METRICS_INTERVAL_S:g} s "
                "unless set): the window must hold more than one report"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must be within [min_replicas, max_replicas]")
        return self


class CudaGraphs(_Strict):
    """A worker's forwards captured as CUDA graphs (`specdec_core.cuda_graphs`): every batch size 1, 2, 4, ... up to
    max_batch (included) with every width in `widths` (new tokens per row: 1 for decode, k + 1 for a verify of k
    drafts). Other forwards (prefill) run eagerly. A CUDA feature: on a CPU device it is ignored."""

    max_batch: int = Field(ge=1)
    widths: tuple[int, ...]

    @field_validator("widths")
    @classmethod
    def _widths(cls, widths: tuple[int, ...]) -> tuple[int, ...]:
        check_widths(widths)
        return widths


def _graphs_or_off(graphs: Any) -> Any:
    # `off` (bare in YAML 1.1: false) is None inside, so that a dump leaves it out; a mapping is a CudaGraphs.
    if graphs is False or graphs == "off":
        return None
    if graphs is None or isinstance(graphs, dict | CudaGraphs):
        return graphs
    raise ValueError(f"off, or a mapping of max_batch and widths; got {graphs!r}")


GraphsSetting = Annotated[CudaGraphs | None, BeforeValidator(_graphs_or_off)]


class Placement(_Strict):
    """Where and how many: per worker deployment."""

    num_replicas: int = Field(1, ge=1)  # ignored when autoscaling is set
    autoscaling: WorkerAutoscaling | None = None
    # A replica being stopped (scaled down, redeployed, deleted) refuses new sessions and waits this long at most
    # for those it holds to end before it stops: longer than the longest request, or that request fails.
    drain_timeout_s: float = Field(300.0, gt=0)
    # Ray's reservation for each replica (each rank with tensor parallelism): what the scheduler counts, not what
    # the worker computes with. Ray pins no cores, so it limits nothing; `threads` sets the torch threads.
    num_cpus: float = Field(1.0, ge=0)
    # The worker's torch threads. auto: the cores its process may use (its CPU affinity, cut to its cgroup's CPU
    # quota: `specdec_core.hardware`), shared evenly by the ranks of a tensor-parallel replica. Right for one
    # worker per machine, and for a target and a draft on one machine (they take turns within a round); set a
    # number when several replicas that run at once share a machine's cores.
    threads: int | Literal["auto"] = "auto"
    # CPU ids the worker's process and all its threads run on (its CPU affinity, as `taskset -c` sets it): keeps a
    # draft and a target on one machine off each other's cores, so that they compute at once (`draft.overlap`), or
    # a worker on one NUMA node's cores. `threads: auto` then counts these cores. None: the cores Ray gives it.
    cpu_affinity: list[int] | None = None
    num_gpus: float = Field(0.0, ge=0)
    max_sequences: int = Field(8, ge=1)  # KV cache slots per replica: sessions it can hold at once
    # The replica's KV cache budget in bytes (per rank with tensor parallelism): fewer slots than max_sequences
    # when they would not fit. The cache is allocated whole at start; requests wait for a slot, never for memory.
    kv_cache_max_bytes: int | None = Field(None, ge=1)
    # Custom Ray resources of each replica (each rank with tensor parallelism), e.g. {"target_node": 1} to land on
    # nodes started with that resource (`ray start --resources`, a KubeRay worker group's rayStartParams).
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, threads: Any) -> Any:
        if threads == "auto" or (type(threads) is int and threads >= 1):
            return threads
        raise ValueError(f"a number of threads (1 or more) or auto, got {threads!r}")

    @field_validator("cpu_affinity")
    @classmethod
    def _cores(cls, cores: list[int] | None) -> list[int] | None:
        if cores is not None and (not cores or min(cores) < 0 or len(set(cores)) != len(cores)):
            raise ValueError(f"a list of distinct CPU ids (0 or more), got {cores!r}")
        return cores

    @property
    def initial_replicas(self) -> int:
        """Replicas at deployment: what the router waits for at its start."""
        scaling = self.autoscaling
        if scaling is None:
            return self.num_replicas
        return scaling.initial_replicas or scaling.min_replicas

    @property
    def most_replicas(self) -> int:
        """The most replicas the deployment may run (what the cluster must have room for)."""
        return self.num_replicas if self.autoscaling is None else self.autoscaling.max_replicas


class TargetConfig(Placement):
    model: str  # a path, a .gguf file or a `specdec models` name
    dtype: Dtype = "bfloat16"
    device: Device = "cpu"
    # Ranks per replica (1 = unsplit). num_cpus, num_gpus and resources are per rank (the replica itself is rank 0):
    # one placement-group bundle each, reserved together.
    tensor_parallel_size: int = Field(1, ge=1)
    # How Ray places those bundles (PlacementStrategy). None: PACK, or STRICT_PACK when the ranks use GPUs (NCCL
    # within one node's GPUs; across nodes only when asked). STRICT_SPREAD puts each rank on a node of its own.
    placement_strategy: PlacementStrategy | None = None
    # The network interface(s) the ranks' collectives use, on nodes with several (e.g. "eth1", or "eth1,eth2"):
    # GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in every rank's environment. None: gloo uses the address its
    # node's hostname resolves to, NCCL picks one itself.
    socket_ifname: str | None = Field(None, pattern=r"^[^\s,]+(,[^\s,]+)*$")
    # off, or {max_batch, widths}: the target's forwards captured as CUDA graphs (CudaGraphs).
    cuda_graphs: GraphsSetting = None

    @model_validator(mode="after")
    def _ranks_only(self) -> TargetConfig:
        for key in ("placement_strategy", "socket_ifname"):
            if getattr(self, key) is not None and self.tensor_parallel_size == 1:
                raise ValueError(f"{key} places the ranks of a split target: it needs tensor_parallel_size > 1")
        if self.cuda_graphs is not None and self.device == "cuda" and self.tensor_parallel_size > 1:
            raise ValueError("cuda_graphs captures one process's forwards: it needs tensor_parallel_size 1")
        if self.cpu_affinity is not None and self.tensor_parallel_size > 1:
            raise ValueError("cpu_affinity pins one process: it needs tensor_parallel_size 1")
        return self

    @property
    def rank_strategy(self) -> PlacementStrategy:
        """The placement-group strategy of a tensor-parallel replica's ranks."""
        if self.placement_strategy is not None:
            return self.placement_strategy
        return "STRICT_PACK" if self.num_gpus else "PACK"

    @property
    def rank_environment(self) -> dict[str, str]:
        """Environment variables of every rank (the replica's process included)."""
        if self.socket_ifname is None:
            return {}
        return {"GLOO_SOCKET_IFNAME": self.socket_ifname, "NCCL_SOCKET_IFNAME": self.socket_ifname}


class DraftConfig(Placement):
    # A registered drafting method (`specdec_core.drafters.registry`: draft_model, ngram, suffix), or none.
    method: str = "draft_model"
    model: str | None = None  # required by a method that runs a draft model (draft_model)
    dtype: Dtype = "bfloat16"
    device: Device = "cpu"
    # int8: int8 weights and activations (CPU drafts in bf16 on AVX-512 VNNI or AVX2; cheaper drafts, the same output).
    # int4: 4-bit weights in groups of 32 and int8 activations (CPU drafts in bf16; fewer bytes a draft step).
    # auto, for a bf16 CPU draft: int4 where the int8 kernel runs (AVX2, AVX-512 VNNI); else none (CUDA: none).
    quantization: Literal["none", "int8", "int4", "auto"] = "auto"
    # draft_model, hybrid: the draft's LM head scores only the first N token ids (a BPE vocabulary numbers its
    # tokens roughly most frequent first), the special tokens and the ids of each request's context; 0: all.
    # Cheaper draft steps (a 0.5B draft's head is a quarter of its weights); the output is the same.
    vocabulary: int = Field(0, ge=0)
    num_speculative_tokens: int | Literal["auto"] = "auto"
    max_speculative_tokens: int = Field(8, ge=1, le=16)
    ngram_max: int = Field(4, ge=1)
    ngram_min: int = Field(1, ge=1)
    # suffix (SuffixDecoding): defaults and meanings in `specdec_core.drafters.base.DraftSpec`.
    suffix_max_depth: int = Field(32, ge=2, le=256)
    suffix_min_match: int = Field(2, ge=1)
    suffix_max_requests: int = Field(256, ge=0)
    suffix_max_bytes: int = Field(256 * 1024 * 1024, ge=0)
    suffix_min_prob: float = Field(0.1, ge=0.0, le=1.0)
    suffix_index_prompts: bool = True
    # draft_model, hybrid: stop a row's drafts after one the draft gives less than this probability (0: off).
    confidence_threshold: float = Field(0.0, ge=0.0, lt=1.0)
    # draft_model, hybrid: pre-draft the next round while the target verifies this one (`specdec_core.overlap`).
    # It pays where the draft computes on hardware of its own (a GPU, a node, `cpu_affinity` apart from the
    # target's); auto measures both ways as it serves and takes the faster.
    overlap: Literal["auto", "on", "off"] = "auto"
    # off, or {max_batch, widths}: the draft model's forwards captured as CUDA graphs (CudaGraphs).
    cuda_graphs: GraphsSetting = None

    @field_validator("overlap", mode="before")
    @classmethod
    def _on_off(cls, overlap: Any) -> Any:
        # YAML 1.1 reads a bare on / off as true / false.
        return {True: "on", False: "off"}.get(overlap, overlap) if isinstance(overlap, bool) else overlap

    @field_validator("method")
    @classmethod
    def _registered(cls, method: str) -> str:
        try:
            drafters.resolve(method)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None  # it names every registered method
        return method

    @model_validator(mode="after")
    def _consistent(self) -> DraftConfig:
        if self.runs_draft_model and not self.model:
            raise ValueError(f"method {self.method} needs draft.model")
        if (
            isinstance(self.num_speculative_tokens, int)
            and not 0 <= self.num_speculative_tokens <= self.max_speculative_tokens
        ):
            raise ValueError(f"num_speculative_tokens must be in [0, {self.max_speculative_tokens}] or auto")
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.suffix_min_match > self.suffix_max_depth // 2:
            raise ValueError("suffix_min_match must be <= suffix_max_depth // 2 (matches use half the depth)")
        if self.cuda_graphs is not None and self.device == "cuda" and self.vocabulary > 0:
            raise ValueError("cuda_graphs needs the whole LM head (vocabulary 0): a cut head's ids change every call")
        return self

    @property
    def drafting(self) -> DraftMethod | None:
        """The registered method; None for "none" (plain decoding)."""
        return drafters.resolve(self.method)

    @property
    def runs_draft_model(self) -> bool:
        """The method runs a draft model: the application deploys draft workers and the router drafts through them."""
        drafting = self.drafting
        return drafting is not None and drafting.runs_draft_model

    @property
    def spec(self) -> DraftSpec:
        """The method and its options, as the engine's builders take them."""
        return DraftSpec(
            self.method,
            ngram_max=self.ngram_max,
            ngram_min=self.ngram_min,
            suffix_max_depth=self.suffix_max_depth,
            suffix_min_match=self.suffix_min_match,
            suffix_max_requests=self.suffix_max_requests,
            suffix_max_bytes=self.suffix_max_bytes,
            suffix_min_prob=self.suffix_min_prob,
            suffix_index_prompts=self.suffix_index_prompts,
            confidence_threshold=self.confidence_threshold,
        )

    @property
    def label(self) -> str:
        """What metrics, traces and proposal records call the drafter: the draft model, else the method ("none")."""
        return self.model if self.runs_draft_model and self.model else self.method


VARIANT_METHODS = ("draft_model", "ngram", "suffix")  # what an A/B variant may run (one drafter each)
DEFAULT_VARIANT = "default"  # the variant of a single `draft:` config


class DraftVariant(DraftConfig):
    """One draft of an A/B test (`drafts:`): a draft config with a name, and a weight for assigning requests."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")  # in responses, metrics labels and deployment names
    # Requests go to variants in proportion to their weights (0: only requests that pin it by name).
    weight: float = Field(1.0, ge=0)

    @field_validator("method")
    @classmethod
    def _one_drafter(cls, method: str) -> str:
        if method not in VARIANT_METHODS:
            raise ValueError(f"a draft variant runs one of {', '.join(VARIANT_METHODS)}, got {method!r}")
        return method

    def as_draft(self) -> DraftConfig:
        return DraftConfig(**self.model_dump(exclude={"name", "weight"}))


class Demotion(_Strict):
    """Automatic demotion of a variant (its weight set to 0, logged and counted in
    `specdec_draft_variant_demotions`) that does worse than the control. Promotion back is by config only."""

    # What is compared: acceptance rate, committed tokens per second of speculative rounds, or either one.
    metric: Literal["acceptance", "tokens_per_second", "either"] = "either"
    margin: float = Field(0.1, gt=0, lt=1)  # demoted below (1 - margin) times the control's figure
    window_rounds: int = Field(1024, ge=16)  # the rounds of each variant the comparison looks at (the latest)
    min_rounds: int = Field(200, ge=1)  # neither variant is judged with fewer rounds than this in its window
    check_interval_s: float = Field(30.0, gt=0)  # how often each router compares
    # The comparison must fail this many checks in a row: a window's noise seldom lasts several checks.
    consecutive_checks: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _window(self) -> Demotion:
        if self.min_rounds > self.window_rounds:
            raise ValueError("min_rounds must be <= window_rounds")
        return self


class ABConfig(_Strict):
    """How the variants of `drafts:` are compared."""

    control: str | None = None  # the variant others are judged against; None: the first
    demotion: Demotion | None = None  # None: variants are never demoted automatically


class Autoscaling(_Strict):
    """Serve autoscaling of the router by its ongoing requests (new replicas may need new nodes: in-tree Ray
    autoscaling adds them on KubeRay)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(32, gt=0)

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class RouterConfig(_Strict):
    num_replicas: int = Field(1, ge=1)  # ignored when autoscaling is set
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(0.5, ge=0)
    # Custom Ray resources of each router replica, e.g. {"router_node": 1} to keep it on nodes started with that.
    resources: dict[str, float] = Field(default_factory=dict)
    max_seq_len: int = Field(2048, ge=16)  # prompt plus output tokens per request
    default_max_tokens: int = Field(256, ge=1)  # when a request does not say
    max_ongoing_requests: int = Field(256, ge=1)  # per router replica, waiting ones included
    # Admission: requests that find no free KV slot wait in a queue of at most this many, for at most
    # queue_timeout_s; beyond either they get RESOURCE_EXHAUSTED.
    max_queued_requests: int = Field(64, ge=0)
    queue_timeout_s: float = Field(60.0, gt=0)
    # A prompt's text (gRPC `prompt`; chat messages and tools: every string the chat template renders) longer than
    # this in UTF-8 is INVALID_ARGUMENT before it is tokenized: tokenizing costs the router CPU in proportion to the
    # text's size.
    # A 32k-token context is ~130 KiB of English or code (~4 bytes a token) and less of CJK (~2): 1 MiB holds it 8
    # times over (32 bytes a token: whitespace-heavy text packs many bytes into one), a 128k-token one 2 times.
    max_prompt_bytes: int = Field(1024 * 1024, ge=1)
    # A request's constraint in UTF-8 (gRPC `structured`, HTTP `response_format`, the grammar of a forced tool call)
    # longer than this is INVALID_ARGUMENT before it is compiled. A limit of its own rather than a share of
    # max_prompt_bytes: a constraint costs what a prompt does not (its compile, the compiled grammar the router and
    # the draft workers keep, a mask from it at every position), and a long prompt must not decide how large a
    # schema may be. 256 KiB holds the schemas of many tools.
    max_schema_bytes: int = Field(256 * 1024, ge=1)
    # Longer prompts (in tokens) are INVALID_ARGUMENT. None: the context, max_seq_len less one output token.
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)  # a larger sampling.max_tokens is INVALID_ARGUMENT
    request_timeout_s: float | None = Field(None, gt=0)  # a request running longer ends with DEADLINE_EXCEEDED
    rpc_timeout_s: float = Field(120.0, gt=0)  # one call to a target worker
    # One Propose to a draft worker: a draft that answers slower is treated as stalled, and its sessions go on
    # target-only (exact, just slower) until a draft replica takes them again.
    draft_timeout_s: float = Field(10.0, gt=0)
    worker_refresh_s: float = Field(10.0, gt=0)  # how often the router re-reads the worker replicas
    worker_start_timeout_s: float = Field(900.0, gt=0)  # how long a router waits for workers to come up
    # Measure what rounds cost at each batch size before serving (specdec_core.calibration), so that `auto` needs
    # no exploring on live requests. Each router replica runs it once at startup, on synthetic sequences.
    calibrate: bool = True

    @model_validator(mode="after")
    def _limits(self) -> RouterConfig:
        if self.max_output_tokens is not None and self.default_max_tokens > self.max_output_tokens:
            raise ValueError("default_max_tokens must be <= max_output_tokens")
        return self


class ProposalLogConfig(_Strict):
    """Opt-in: one JSON line per round of a sample of requests (token ids only, never prompt text)."""

    directory: str
    sample_rate: float = Field(0.1, gt=0, le=1)  # fraction of requests logged
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024)  # per file before rotating
    backup_count: int = Field(5, ge=0)
    # Records also carry q and p of each proposed token (the draft's and the target's probabilities). Only sampled
    # requests pay for it: their workers compute a softmax per proposed token.
    include_probs: bool = False
    # Records also carry "context": the last N token ids committed before the round (prompt and output), so that
    # `specdec distill --proposal-log` can teach the draft the target's choice exactly where it was rejected. Token
    # ids decode to the text they stand for: this writes (a window of) prompts and outputs to disk, hence 0 (off).
    include_context_tokens: int = Field(0, ge=0, le=4096)


class ServeConfig(_Strict):
    app_name: str = "specdec"
    grpc_port: int = Field(9000, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)  # Ray Serve's HTTP proxy: the OpenAI-compatible API, health
    # Where Serve runs its proxies (ProxyLocation), when `specdec serve` starts Serve. None: Serve's default
    # (EveryNode). Cluster-wide and fixed once Serve runs: under `serve run` / `serve deploy`, the Serve config's
    # own top-level proxy_location says it.
    proxy_location: ProxyLocation | None = None
    # The model id of the OpenAI-compatible API (`model` in requests, /v1/models): by default target.model.
    served_model_name: str | None = Field(None, min_length=1)
    worker_grpc_port: int = Field(0, ge=0, le=65535)  # workers' internal gRPC servers; 0: any free port
    session_idle_timeout_s: float = Field(300.0, gt=0)  # a worker frees a session unused this long
    # The public API's auth (`deployments.auth.public_auth`). bearer: every call carries `authorization: Bearer
    # <token>`, and a router with no token (SPECDEC_AUTH_TOKEN in its environment, else auth_token_file) refuses to
    # start, so that a forgotten Secret stops the deployment instead of opening it. none: an open API, for a
    # machine of one's own; the router logs a WARNING saying so at start.
    auth: Literal["bearer", "none"] = "bearer"
    # A file holding the bearer token (SPECDEC_AUTH_TOKEN in the router's environment takes precedence).
    auth_token_file: str | None = None
    # Tokens per tenant: a YAML file mapping each tenant's name to its token, accepted beside the one above. A
    # tenant's requests share cached prefixes only among themselves (`deployments.auth.cache_namespace`), so no
    # tenant can learn another's prompts from `cached_tokens` or from what its own requests find cached.
    auth_tokens_file: str | None = None
    # Mutual TLS between the router and the workers (`deployments.tls`): certificates from a CA the registry actor
    # makes for the application. false: internal traffic in plaintext (the secret check stays), with a warning.
    internal_tls: bool = True
    # A mounted directory holding ca.crt, tls.crt and tls.key (a Kubernetes TLS Secret, e.g. cert-manager's) to
    # use instead of the made certificates; read on every node that runs a worker, a router or a tool.
    internal_tls_dir: str | None = Field(None, min_length=1)
    # Prefix caching in the target and draft workers (every rank): the KV of ended sessions stays, within the KV
    # budget, as cache entries (least recently used evicted first), and a new session computes only what the
    # longest cached prefix of its tokens lacks; requests share prefixes only within one `cache_salt`. The tokens
    # are those a full computation gives. false: every session computes its whole prompt, slots freed at release.
    prefix_caching: bool = True
    target: TargetConfig
    draft: DraftConfig = DraftConfig(method="none")
    # A/B of drafts: several variants served at once, requests assigned by weight (sticky for their life) or
    # pinned by name. The control variant is also `draft` (what `draft` alone would configure): give one or the
    # other.
    drafts: tuple[DraftVariant, ...] | None = None
    ab: ABConfig = ABConfig()
    router: RouterConfig = RouterConfig()
    proposal_log: ProposalLogConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _control_as_draft(cls, data: Any) -> Any:
        """With `drafts:`, `draft` is the control variant: filled in from it when absent (a dumped config has both)."""
        if isinstance(data, dict) and data.get("drafts") and "draft" not in data:
            variants = data["drafts"]
            control = (data.get("ab") or {}).get("control")
            chosen = next((v for v in variants if _name_of(v) == control), variants[0])
            if isinstance(chosen, DraftVariant):
                data = {**data, "draft": chosen.as_draft()}
            elif isinstance(chosen, dict):
                data = {**data, "draft": {k: v for k, v in chosen.items() if k not in ("name", "weight")}}
        return data

    @model_validator(mode="after")
    def _variants(self) -> ServeConfig:
        if self.drafts is None:
            if self.ab != ABConfig():
                raise ValueError("ab configures the variants of drafts: there are none")
            return self
        if not self.drafts:
            raise ValueError("drafts: give at least one variant")
        names = [v.name for v in self.drafts]
        if len(set(names)) != len(names):
            raise ValueError("drafts: variant names must be unique")
        if self.ab.control is not None and self.ab.control not in names:
            raise ValueError(f"ab.control: no variant named {self.ab.control!r}")
        if not any(v.weight > 0 for v in self.drafts):
            raise ValueError("drafts: at least one variant needs a weight > 0")
        control = self.control_variant
        for key in ("num_speculative_tokens", "max_speculative_tokens"):  # one engine verifies every variant
            if any(getattr(v, key) != getattr(control, key) for v in self.drafts):
                raise ValueError(f"drafts: every variant needs the same {key}")
        if self.draft != control.as_draft():
            raise ValueError("draft and drafts: with drafts, draft is the control variant; give only drafts")
        return self

    @property
    def control_variant(self) -> DraftVariant:
        """The variant others are compared with (the only one of a single `draft:` config)."""
        variants = self.variants
        return next((v for v in variants if v.name == self.ab.control), variants[0])

    def variant(self, name: str) -> DraftVariant:
        """The variant called `name` (DEFAULT_VARIANT: the single `draft`)."""
        found = next((v for v in self.variants if v.name == name), None)
        if found is None:
            raise InvalidArgument("draft_variant", f"no draft variant {name!r}")
        return found

    @property
    def variants(self) -> tuple[DraftVariant, ...]:
        """Every draft variant served: `drafts`, or the single `draft` as the variant "default"."""
        if self.drafts is not None:
            return self.drafts
        # Not validated again: a single draft may run any method (hybrid, none), which a variant of drafts may not.
        return (DraftVariant.model_construct(name=DEFAULT_VARIANT, weight=1.0, **dict(self.draft)),)

    @model_validator(mode="after")
    def _auth(self) -> ServeConfig:
        if self.auth == "none" and (self.auth_token_file is not None or self.auth_tokens_file is not None):
            raise ValueError("auth_token_file and auth_tokens_file need auth: bearer (auth: none serves without one)")
        return self

    @model_validator(mode="after")
    def _tls(self) -> ServeConfig:
        if self.internal_tls_dir is not None and not self.internal_tls:
            raise ValueError("internal_tls_dir needs internal_tls: true")
        return self

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.target.model

    @property
    def tls_setting(self) -> TlsSetting:
        return TlsSetting(self.internal_tls, self.internal_tls_dir)

    @property
    def overlap(self) -> str:
        """The router engine's pre-drafting (`draft.overlap`): off for a method without a draft model (the router
        drafts it itself), and `auto` is off where the config puts the draft on the target's cores."""
        if not self.draft.runs_draft_model:
            return "off"
        if self.draft.overlap == "auto" and shares_cores(self.target, self.draft):
            return "off"
        return self.draft.overlap


def runner_graphs(worker: TargetConfig | DraftConfig) -> GraphConfig | None:
    """The `RunnerConfig.cuda_graphs` of a worker's runner: None when off, and on a CPU device, where the setting is
    accepted and ignored with one log line (graphs are a CUDA feature)."""
    graphs = worker.cuda_graphs
    if graphs is None:
        return None
    if worker.device != "cuda":
        serve_log.info("cuda_graphs ignored: the worker's device is %s, and CUDA graphs need CUDA", worker.device)
        return None
    return GraphConfig(graphs.max_batch, graphs.widths)


def shares_cores(target: Placement, draft: Placement) -> bool:
    """The config puts both workers on the CPUs of one kind of node with cores in common: both on the CPU, neither
    sent to nodes of its own (custom `resources`) nor kept apart by `cpu_affinity`. Pre-drafting cannot pay there:
    the draft's forwards would run on the cores the target's verify uses."""
    if getattr(target, "device", "cpu") != "cpu" or getattr(draft, "device", "cpu") != "cpu":
        return False
    if target.resources != draft.resources:
        return False
    if target.cpu_affinity is not None and draft.cpu_affinity is not None:
        return bool(set(target.cpu_affinity) & set(draft.cpu_affinity))
    return True


def _name_of(variant: Any) -> Any:
    return variant.get("name") if isinstance(variant, dict) else getattr(variant, "name", None)


def parse_config(data: Any) -> ServeConfig:
    """Validate a mapping; `InvalidArgument` names every bad or unknown key."""
    if not isinstance(data, dict):
        raise InvalidArgument("config", f"expected a mapping of keys, got {type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "config"
            if error["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown key")
            else:
                problems.append(f"{where}: {error['msg']}")
        fields = ", ".join(dict.fromkeys(p.split(":")[0] for p in problems))
        raise InvalidArgument(fields, "; ".join(problems)) from None


def read_config_file(path: str | Path) -> Any:
    """The YAML of `path`, not yet validated (`specdec serve` lays its flags over it first)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument("config", f"no config file at {str(path)!r}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InvalidArgument("config", f"{path} is not valid YAML: {exc}") from None


def load_config(path: str | Path) -> ServeConfig:
    return parse_config(read_config_file(path))


def dump_config(config: ServeConfig) -> str:
    """`config` as YAML that `load_config` reads back to an equal config: the keys whose values differ from the
    defaults, in the models' order; and the draft's method, which says what its other keys mean."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    if "draft" in data:
        data["draft"] = {"method": config.draft.method, **data["draft"]}
    return yaml.safe_dump(data, sort_keys=False)
