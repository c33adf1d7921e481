"""Config sections torchtitan_flux adds to torchtitan's ``Trainer.Config`` (``run/trainer.GRPOTrainer.Config``
holds them; ``run/config_file.py`` reads them from the TOML). Torch-free, so the entry point can read them before
torch is imported. Every field has a docstring (docs/configuration.md is generated from them); a numeric field's
range is declared on its type (``Range``, ``ranges.py``), and ``run/validation.py`` checks it and every other rule,
raising ``ConfigError``.
"""

from dataclasses import dataclass, field
from typing import Annotated, Literal

from torchtitan_flux.auth import TOKEN_ENV
from torchtitan_flux.ranges import Range

MODEL_NAME = "hf_auto"  # ``model.name`` of every config: the family is read from model.hf_assets_path/config.json


@dataclass
class Grpo:
    """``[grpo]``: the GRPO objective."""

    group_size: Annotated[int, Range(ge=2, le=4096)] = 8
    """Completions sampled per prompt (G). Advantages are normalised within each group."""

    clip_low: Annotated[float, Range(gt=0, lt=1)] = 0.2
    """Lower clip bound epsilon_low: the policy ratio is clipped at 1 - clip_low."""

    clip_high: Annotated[float, Range(gt=0)] = 0.28
    """Upper clip bound epsilon_high: the policy ratio is clipped at 1 + clip_high (DAPO's clip-higher)."""

    kl_coef: Annotated[float, Range(ge=0)] = 0.0
    """KL penalty coefficient against a frozen copy of the initial policy; 0 disables it (no reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator on sampled tokens: k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, k3 = ref/pi - log(ref/pi) - 1."""

    loss_normalization: Literal["token", "sequence"] = "token"
    """"token": sum of per-token losses over all completion tokens of the batch divided by their count (DAPO);
    "sequence": mean over completions of each completion's mean token loss (original GRPO)."""

    temperature: Annotated[float, Range(gt=0)] = 1.0
    """Sampling temperature of the rollout engines; the trainer divides its logits by it too."""

    tis_cap: Annotated[float, Range(ge=0, note="0 disables")] = 2.0
    """Truncated importance sampling: each token's loss is weighted by min(pi_trainer / pi_behaviour, tis_cap)
    (detached), the clipped ratio taken against the trainer's policy (decoupled PPO). 0: against the behaviour's."""

    advantage_std_normalize: bool = True
    """Divide group-centred rewards by the group's standard deviation (+1e-4). Groups with equal rewards get
    advantage 0 either way (no policy gradient; counted in ``zero_variance_groups``)."""

    staleness_discount: Annotated[float, Range(ge=0)] = 0.0
    """A sample's weight is (1 + version_gap) ** -staleness_discount (a staleness-adaptive step size); 0 disables."""


@dataclass
class Rollout:
    """``[rollout]``: where completions come from and what they are scored on."""

    # Fields are grouped by job, each group headed by a "# -- Title: one-line description" comment, which
    # scripts/gen_config_docs.py turns into a sub-heading of docs/configuration.md. The TOML section stays flat.

    # -- Engines: which engines generate the completions, where they run and on how many threads.
    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    """Rollout engine: "embedded" (a child process holding a copy of the policy), "vllm" or "sglang" (servers)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of vLLM / SGLang servers, e.g. ["http://127.0.0.1:8000"]. Required for those engines."""

    num_engines: Annotated[int, Range(ge=1, le=1024)] = 1
    """Embedded engine processes, or vLLM servers started with ``launch = true`` (else ``urls`` counts them)."""

    launch: bool = False
    """Engine "vllm" only: the trainer starts ``num_engines`` local vLLM servers (model ``model.hf_assets_path``,
    interpreter ``launch_python``), uses them as ``urls`` (which must be empty) and stops them when it closes."""

    launch_python: str = ".venv-vllm/bin/python"
    """Python with vLLM, for ``launch`` (``scripts/setup_vllm.sh``); relative: to the cwd, else the repo root."""

    launch_timeout_s: Annotated[float, Range(gt=0)] = 600.0
    """Seconds to wait for a launched vLLM server to answer ``/health`` before giving up."""

    engine_devices: list[str] = field(default_factory=list)
    """Device of each engine ("cpu" or "cuda:N"; a launched server sees only that GPU). Empty: CPU when the
    trainer is on CPU, else engine i on ``cuda:{LOCAL_WORLD_SIZE + i}``. Never a trainer GPU, never one GPU twice."""

    colocated: bool = False
    """Embedded engines share the trainer's device (rank 0's GPU, or the CPU) and copy the weights from rank 0's
    staging by reference (CUDA IPC on GPU, shared memory on CPU) instead of a broadcast: the mode for one GPU, or
    one host (docs/gpu.md). Needs ``engine = "embedded"`` and an empty ``engine_devices``."""

    engine_threads: Annotated[int, Range(ge=1, le=4096)] = 1
    """CPU threads of each engine (torch threads, or a launched server's OpenMP threads); the trainer gets the rest."""

    borrow_idle_engine_cores: bool = True
    """CPU, one trainer rank, embedded engines, no compiled model: the trainer also computes on the threads of every
    engine that holds no request (re-checked before every transformer block's forward and backward;
    ``run.threads.TrainerThreads``). With async rollouts the engine is idle once the next batch is generated, so its
    core trains the rest of the step. The thread count then depends on timing, and with it the last bits of reductions:
    runs are not bit-reproducible. Refused with ``environment`` (episodes send their turns while the trainer computes).
    False: the fixed split (``engine_threads`` per engine, the rest for the trainer), reproducible."""

    # -- Sampling: how each completion is sampled (its temperature is ``grpo.temperature``).
    max_new_tokens: Annotated[int, Range(ge=1)] = 16
    """Maximum completion length in tokens; with ``environment``, per assistant turn (the whole episode, its opening
    included, within ``training.seq_len``)."""

    top_k: Annotated[int, Range(ge=0)] = 0
    """Sample only from the top-k tokens (slightly off-policy: logprobs stay the full distribution's); 0 disables."""

    seed: Annotated[int, Range(ge=0, le=2**31 - 1)] = 0
    """Base seed of the engines' samplers (each request derives its own generator from it) and of the task's prompt
    order (a dataset's epoch permutations, a generated task's prompts; docs/data.md)."""

    # -- Tasks and prompts: what the prompts are, how many a step takes, and how a dataset is read and filtered.
    task: str = "digits"
    """Task: "digits" (fraction of digit characters), "arithmetic" (exact-match sums), "dataset" (``dataset_path``
    scored by ``reward_funcs``), "gsm8k" (scored by the final answer), "reasoning_gym:<name>" (a reasoning-gym
    dataset scored by its own ``score_answer``; ``pip install '.[tasks]'``) or "package.module:name" (docs/data.md)."""

    task_args: list[str] = field(default_factory=list)
    """With ``task = "reasoning_gym:<name>"``: the dataset's config fields as "name=value" (the value read as JSON
    when it parses, e.g. ``["max_terms=2", "max_digits=1"]``, else as the plain string), each checked against the
    field's type (``seed`` comes from ``seed``), and ``system_prompt``: which of reasoning-gym's system prompts
    (``reasoning_gym.utils.SYSTEM_PROMPTS``; default "default") precedes each question. Other tasks take none."""

    prompts_per_step: Annotated[int, Range(ge=1, le=65536)] = 4
    """Prompts per training step; the batch holds prompts_per_step * grpo.group_size completions."""

    dataset_path: str = ""
    """Dataset of tasks "dataset" / "gsm8k": a local .jsonl / .json / .parquet / .csv file, a folder of such files
    (splits named by file name: train.jsonl, test.jsonl), or a ``save_to_disk`` folder (docs/data.md)."""

    dataset_split: str = "train"
    """Split of ``dataset_path`` to train on, when it is a folder or a saved ``DatasetDict``."""

    prompt_column: str = "prompt"
    """Dataset column holding the prompt text (task "gsm8k" also accepts "question")."""

    messages_column: str = "messages"
    """Dataset column holding a chat prompt ({"role", "content"} messages), used when there is no ``prompt_column``."""

    answer_column: str = "answer"
    """Dataset column passed to the rewards as ``answer`` (every other column is passed under its own name)."""

    apply_chat_template: bool = False
    """Render text prompts as a one-message user chat with the model's chat template (chat datasets always are)."""

    max_prompt_tokens: Annotated[int, Range(ge=0, note="0 = seq_len - max_new_tokens")] = 0
    """Longest prompt in tokens; with ``max_new_tokens`` it must fit in ``training.seq_len``."""

    long_prompts: Literal["drop", "error"] = "drop"
    """Dataset prompts longer than ``max_prompt_tokens``: "drop" them (the count is logged) or "error"."""

    task_timeout_seconds: Annotated[float, Range(gt=0)] = 300.0
    """The longest a task's own code may take on one call (``prompts``, ``eval_prompts``, ``finished``). Past it the
    run checkpoints its last completed step and stops with one line naming the task and the call."""

    # -- Rewards: how completions are scored.
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions ``f(prompts, completions, completion_ids, **columns) -> list[float | None]`` (TRL's; sync or
    async): "package.module:function" or "answer_match", "math_verify", "digits". Empty: the task's own reward."""

    reward_weights: list[float] = field(default_factory=list)
    """Weight of each of ``reward_funcs`` in the total reward; empty means 1.0 each."""

    reward_workers: Annotated[int, Range(ge=1, le=1024)] = 1
    """Threads scoring rewards off the trainer's main loop."""

    reward_timeout_seconds: Annotated[float, Range(gt=0)] = 300.0
    """The longest one reward function may take on one batch. Past it the run checkpoints its last completed step
    and stops with one line naming the function (exit code 2): a thread cannot be killed."""

    # -- Dispatch and engine faults: how prompts are split among the engines, and what happens to a stalled or dead one.
    dispatch_dead_zone: Annotated[float, Range(ge=0, lt=1)] = 0.1
    """Dead zone of the dispatch split (prompts go to engines in proportion to their measured completions/s): the
    split is kept while every engine's share would change by less than this fraction of itself. 0 re-splits always."""

    dispatch_max_share: Annotated[float, Range(gt=0, le=1)] = 0.75
    """Imbalance cap: while several engines are alive, none gets more than this fraction of a step's prompts
    (below 1 / (engines alive) the split is even)."""

    engine_stall_seconds: Annotated[float, Range(gt=0)] = 1800.0
    """An embedded engine holding requests with no result for this long (stopped, hung) is restarted, its requests
    re-dispatched. Must exceed ``weight_sync.timeout_seconds`` plus the longest generation of one engine's share."""

    max_engine_restarts: Annotated[int, Range(ge=0)] = 3
    """Restarts of a dead embedded engine (or reconnects to a dead server) within any 10 minutes before it is given
    up (the run goes on with the others or, with none left, stops at the step boundary, checkpointed). 0: never."""

    # -- Batching: how an embedded engine batches requests, and when new weights go live in it.
    continuous_batching: bool = False
    """Embedded engines only (vLLM and SGLang batch continuously already): sequences join the running batch at any
    decode step and leave it when they end, and several steps' requests are in flight at once, each result sent as
    soon as its sequences end (``engine/batcher.py``). Each request runs on exactly its pinned version (unless
    ``in_flight_weight_updates``): it joins a running batch only on the live version, else waits for the batch to
    drain (so requests pinned to different versions do not overlap). Each sequence samples from its own draws
    (a hash of its key and the token's position), so its tokens do not depend on its batch; they differ from those
    of false (one generator per request). A multi-turn turn prefills only its new tokens: the engine keeps the K/V
    of its episode's previous turn (``engine/kept.py``). Runs are bit-reproducible only as
    far as requests interleave alike: which sequences share a decode step depends on when requests arrive, and
    with it the last bits of the forward (steps pinned alike, such as the first two of an async run, do share
    steps). Lifts the serial engine's auto ``off_policy.max_pipeline_depth`` of 1. False: one request at a time."""

    decode_graphs: bool = False
    """With ``continuous_batching``, colocated embedded engines (``colocated``) on GPUs: each decode step (decode, logits and sampling) is
    replayed from a CUDA graph, captured at a bucket's first step (rows and width: powers of two), instead of
    launching its ~1,000 kernels one by one; a swap copies the new version into one static copy of the weights
    (``engine/decoding.py``). Costs one more model copy, per-row buffers and the graphs' memory pool per engine,
    counted with the KV pool in the memory checks. Each row samples from its own draws as without it, so tokens and
    logprobs are the same up to the last bits of the forward (a padded batch). Unmeasured on a GPU so far
    (docs/gpu.md, "Run this first"), so false by default; refused on CPU engines, without ``continuous_batching``
    and on engines on GPUs of their own (a capture waits for every pending NCCL receive: docs/gpu.md, rule 16)."""

    max_batch_sequences: Annotated[int, Range(ge=1, le=65536)] = 256
    """With ``continuous_batching``: the most sequences one embedded engine decodes at once (the rows of its KV
    pool, each of ``training.seq_len`` slots, allocated at its first request and fixed from then on; refused at
    start where the pools cannot fit: in half the memory available on a CPU, in the colocated formula on a GPU);
    further sequences wait for a row. 256: eight steps of the CPU configs
    (32 sequences each), one of the 8-GPU examples (256)."""

    in_flight_weight_updates: bool = False
    """Apply a landed push between two decode steps, without waiting for the running sequences to end: each token
    carries the version that generated it (``GenerationResult.token_versions``), a completion's samples count as
    its oldest token's version for the staleness bound, and the KV cache of earlier tokens is kept (as PipelineRL
    does; docs/architecture.md says why). Embedded engines need ``continuous_batching``; vLLM pauses with
    ``mode=keep`` instead of draining. Requests then run on the newest version an engine holds (their pin only
    sets the oldest), so runs are not bit-reproducible. False: versions change only between requests."""

    # -- Streaming: which finished groups a step trains on, and what becomes of the ones still generating.
    streaming_admission: bool = False
    """A step trains on the first ``prompts_per_step`` groups to finish among all those in flight (its own and the
    steps admitted ahead), each fresh enough for ``off_policy.max_version_gap`` by its oldest token, instead of
    waiting for its own prompts' slowest completion. Requests are sent one group each. Embedded engines need
    ``continuous_batching``. Biases a step toward short completions; ``streaming_carry_over`` keeps the slow ones
    for later steps (docs/benchmarks.md, "Streaming rollouts", measures both)."""

    streaming_carry_over: bool = True
    """With ``streaming_admission``: groups still generating when a step takes its batch stay in flight and serve
    later steps (Kimi k1.5's partial rollouts), regenerated only when too stale by their oldest token. False: a
    step's own groups still generating when it has its batch restart from scratch (``restarted_groups``), so a
    completion longer than a step's window is never trained on: training leans toward short completions."""

    # -- Environments: multi-turn episodes; every field but ``environment`` is read only when it is set.
    environment: str = ""
    """Multi-turn episodes: the environment class, "package.module:Class" in torchtitan 0.3.0's ``MessageEnv``
    shape (docs/environments.md). Each prompt of the task becomes a group of ``grpo.group_size`` episodes, each with
    its own instance built from the prompt's record (its columns, plus ``prompt``); every turn is generated by the
    engines (up to ``max_new_tokens`` tokens), the environment's replies are in the sequence but not in the loss.
    Empty: one completion per sample, as without environments. Every engine kind (embedded, vLLM, SGLang)."""

    environment_args: list[str] = field(default_factory=list)
    """The environment's own ``Config`` fields, as "name=value", the value read as JSON when it parses, else as the
    plain string; each is checked against the field's type. In TOML ``["max_value=100", 'mode="hard"']``, on the
    command line ``--rollout.environment_args 'max_value=100,mode="hard"'``."""

    max_turns: Annotated[int, Range(ge=1, le=1024)] = 4
    """Multi-turn: assistant turns per episode at most; the environment is stepped on the last one and the episode
    ends there (truncated, ``max_turns``) unless that step ends it."""

    max_episodes_in_flight: Annotated[int, Range(ge=0, note="0 = no cap")] = 0
    """Multi-turn: episodes running at once (their environments built, turns being generated or stepped); later
    ones wait. Bounds the environments' threads and memory; 0: every episode of every group in flight."""

    environment_timeout_seconds: Annotated[float, Range(gt=0)] = 300.0
    """Multi-turn: the longest one call into the environment may take (its constructor, ``init``, ``step``,
    ``close``). Past it the run checkpoints its last completed step and stops with one line naming the environment
    and the call (its thread cannot be stopped)."""

    environment_reward_weight: float = 1.0
    """Multi-turn: the weight of the environment's rewards in the total (the sum of every ``env_rewards`` value of
    the episode's steps, metric ``rewards/environment``), beside ``reward_funcs`` (which then get whole
    conversations). 0: only ``reward_funcs`` score."""


@dataclass
class WeightSync:
    """``[weight_sync]``: how trained weights reach the engines."""

    async_weight_update: bool = False
    """false: after each optimizer step the trainer blocks until every engine holds the new weights. true: they
    are snapshotted into a staging buffer and pushed by a background thread; the trainer never waits on an engine."""

    timeout_seconds: Annotated[float, Range(ge=1)] = 60.0
    """An engine that has not applied a push this many seconds after it was sent is marked lagging (it keeps its
    old version) and gets a full resync when it answers again."""

    bucket_size_mb: Annotated[float, Range(gt=0, le=65536)] = 64.0
    """Weights are flattened into buckets of about this size for transfer."""

    interval: int | Literal["auto"] = 1
    """Push every N optimizer steps, N in [1, ``off_policy.max_version_gap + 1``], or "auto": tuned to keep the time
    lost to weight sync under ``overhead_target``. Generation runs at most ``max_version_gap - (N - 1)`` steps ahead."""

    master_addr: str = "127.0.0.1"
    """Address of the weight-sync rendezvous (a TCPStore); other than loopback needs ``auth_token_env``'s token."""

    master_port: Annotated[int, Range(ge=0, le=65535)] = 0
    """Port of the weight-sync rendezvous; 0 picks a free port."""

    auth_token_env: str = TOKEN_ENV
    """Environment variable holding the shared token (never in a config, log or checkpoint): it authenticates HTTP
    requests to rollout servers (Bearer), weight-sync groups (mutual HMAC) and launched servers. Required when
    ``master_addr`` or a ``rollout.urls`` host is not loopback. Servers read ``TORCHTITAN_FLUX_TOKEN``; see README."""

    wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the weights on the wire and in the staging buffer, and the one an embedded engine computes in;
    "auto": the parameters' own dtype. A bfloat16 engine needs a larger ``probe_tolerance`` (docs/running.md, "An
    engine in bfloat16")."""

    probe_every: Annotated[int, Range(ge=0, note="0 disables")] = 10
    """Post-sync logprob probe every N steps (and after the last): each engine scores a fixed sequence; a difference
    above ``probe_tolerance`` stops the run naming the engine, version and token. A probe step waits for its push."""

    probe_tolerance: Annotated[float, Range(gt=0)] = 0.1
    """Largest allowed |engine - trainer| logprob at any probe token (fp32: ~1e-5 apart; bf16 wire: a few 1e-2 on the
    debug model, up to 0.3 on the 30-layer SmolLM2-135M with embedded engines, which compute in the wire dtype)."""

    overhead_target: Annotated[float, Range(gt=0, lt=1)] = 0.10
    """With ``interval = "auto"``: the largest share of a step's compute time weight sync may cost the trainer."""

    max_interval: Annotated[int, Range(ge=1)] = 16
    """With ``interval = "auto"``: the interval never goes above this, nor above ``off_policy.max_version_gap + 1``."""

    verify_every: Annotated[int, Range(ge=0, note="0 disables")] = 10
    """Engines that checksum what they receive (vLLM's gloo path, CPU) hash every N-th push and the final one, which
    ``summary.json`` compares with the trainer's; vLLM's NCCL path and SGLang keep none (the probe verifies them)."""

    method: Literal["dense", "sparse"] = "dense"
    """"dense": every push sends whole buckets. "sparse": an engine known to hold the last pushed version gets, per
    bucket, only the elements whose wire-dtype bits changed (flat indices + values; bit-exact), or the whole bucket
    where that is not smaller (``sparse_max_bytes_ratio``); a new, restarted or lagging engine gets a dense push.
    Pays with a bfloat16/float16 ``wire_dtype`` at RL learning rates (with float32 nearly every element changes and
    it falls back to dense, saying so); costs one more host copy of the weights. Embedded engines and vLLM on CPU
    (our gloo engine); SGLang and vLLM's NCCL engine get dense pushes. docs/benchmarks.md, "Sparse pushes"."""

    sparse_max_bytes_ratio: Annotated[float, Range(gt=0, le=1)] = 0.5
    """With ``method = "sparse"``: a bucket travels as a patch when the patch (4-byte index + value per changed
    element) is at most this share of its dense bytes, else whole (the measured crossover: docs/benchmarks.md)."""


@dataclass
class OffPolicy:
    """``[off_policy]``: how far generation may run ahead of training (``async_ratio * max_version_gap`` steps;
    decided by ``rl/off_policy.py``)."""

    max_version_gap: Annotated[int, Range(ge=1)] = 1
    """No sample older than this many policy versions is trained on, nor does generation run further ahead. With
    ``adaptive_async.enabled`` give the law room: 4-8 for "throughput" (at 1 it has nothing to choose), 3 or more for
    "pid" with its default ``target_staleness`` (validation warns about both)."""

    async_ratio: Annotated[float | None, Range(ge=0, le=1, note="unset: follows weight_sync.async_weight_update")] = None
    """The fixed async ratio without the controller: 0 is synchronous and on-policy, 1 lets generation run
    ``max_version_gap`` steps ahead (fractions: whole steps on that share of steps). Unset (the default): 1 with
    ``weight_sync.async_weight_update = true``, else 0. Leave it unset (or 0) with ``adaptive_async``."""

    feedforward: bool = False
    """Cap the lookahead at the pipeline depth that hides generation, ``ceil(generation / training time)`` (EMAs),
    at most ``max_pipeline_depth``. Runs are then no longer bit-reproducible (like ``weight_sync.interval =
    "auto"``); see docs/controller.md."""

    max_pipeline_depth: Annotated[int, Range(ge=0, note="0 = auto")] = 0
    """The feedforward's depth at most this; 0: 1 with the embedded engine (it serves one request at a time, so a
    second step in flight adds staleness, not throughput: one queued step already keeps it busy), no cap with vLLM
    and SGLang (continuous batching: steps in flight share the engine, as Little's law assumes)."""


@dataclass
class PhaseSpec:
    """One phase of ``adaptive_async.phase_schedule``."""

    steps: Annotated[int, Range(ge=0)] = 0
    """Length of the phase in steps (ignored for "main", which lasts between warmup and cooldown)."""

    target_staleness: Annotated[float, Range(le=1, note="negative = use adaptive_async.target_staleness")] = -1.0
    """Target staleness during the phase; negative means ``adaptive_async.target_staleness``."""


@dataclass
class PhaseSchedule:
    """``[adaptive_async.phase_schedule]``: warmup, main and cooldown phases."""

    warmup: PhaseSpec = field(default_factory=PhaseSpec)
    """Warmup phase: the first ``warmup.steps`` steps."""

    main: PhaseSpec = field(default_factory=PhaseSpec)
    """Main phase: between warmup and cooldown."""

    cooldown: PhaseSpec = field(default_factory=PhaseSpec)
    """Cooldown phase: the last ``cooldown.steps`` steps of ``training.steps``."""


@dataclass
class AdaptiveAsync:
    """``[adaptive_async]``: the controller that sets how asynchronous the run is."""

    enabled: bool = False
    """Turn the controller on: it sets how far generation runs ahead every step (``controller``). When off,
    ``off_policy.async_ratio`` does."""

    target_staleness: Annotated[float, Range(ge=0, le=1)] = 0.15
    """Staleness the "pid" law steers to (this field and the next ones up to ``version_gap_norm`` set the "pid" law
    and its staleness signal; the "throughput" law reads only ``ema_alpha``, ``starve_fraction`` and ``ess_floor``)."""

    min_async_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Lower bound of async_ratio; at most ``max_async_ratio``."""

    max_async_ratio: Annotated[float, Range(ge=0, le=1)] = 1.0
    """Upper bound of async_ratio; at least ``min_async_ratio``."""

    initial_async_ratio: Annotated[float, Range(ge=0, le=1)] = 0.5
    """async_ratio at step 1; within [``min_async_ratio``, ``max_async_ratio``]."""

    kp: Annotated[float, Range(ge=0)] = 3.0
    """Proportional gain, in async-ratio per unit of staleness error (tuning: docs/controller.md)."""

    ki: Annotated[float, Range(ge=0)] = 0.3
    """Integral gain (per step)."""

    kd: Annotated[float, Range(ge=0)] = 1.5
    """Derivative gain, on the measurement (not the error), so target changes cause no kick."""

    integral_band: Annotated[float, Range(gt=0, le=1)] = 0.1
    """Integral separation: the integral accumulates only while |target - smoothed staleness| <= this (1.0: a plain
    PID). Keep it wider than the P-only offset, or the integral never engages (docs/benchmarks.md)."""

    ema_alpha: Annotated[float, Range(gt=0, le=1)] = 0.2
    """EMA weight of the newest staleness sample ("pid"), of the newest ESS fraction ("throughput")."""

    sync_threshold: Annotated[float, Range(gt=0, le=1)] = 0.5
    """When smoothed staleness exceeds this, the next step is forced synchronous."""

    kl_weight: Annotated[float, Range(ge=0)] = 0.4
    """Weight of min(1, KL / kl_norm) in staleness. The three weights must sum to a positive number."""

    iw_var_weight: Annotated[float, Range(ge=0)] = 0.3
    """Weight of min(1, importance-weight variance / iw_var_norm) in staleness."""

    version_gap_weight: Annotated[float, Range(ge=0)] = 0.3
    """Weight of min(1, mean version gap / version_gap_norm) in staleness."""

    kl_norm: Annotated[float, Range(gt=0)] = 0.1
    """KL at which the KL term saturates."""

    iw_var_norm: Annotated[float, Range(gt=0)] = 2.0
    """Importance-weight variance at which that term saturates."""

    version_gap_norm: Annotated[float, Range(gt=0)] = 5.0
    """Version gap at which that term saturates."""

    controller: str = "throughput"
    """"throughput" (runs as far ahead as keeps the trainer fed, bounded by ``ess_floor``: ``rl/throughput.py``; the
    default: ahead of "pid" on the worst workload in two 10-seed runs side by side, docs/controller.md; its
    decisions follow measured times, so its runs are not bit-reproducible), "pid" (steers the staleness to ``target_staleness``), or
    "package.module:Class": a ``rl.controller.ControlLaw`` built as ``Class(adaptive_async)``. A checkpoint resumes
    under the law that saved it only."""

    starve_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.1
    """"throughput": the smoothed rollout wait, as a fraction of the step, above which the lookahead rises a step
    (below half of it, and with Little's law asking for fewer, it falls one)."""

    ess_floor: Annotated[float, Range(ge=0, le=1)] = 0.5
    """"throughput": the learning-quality guard: while the smoothed effective sample size fraction of the importance
    weights is below this, the lookahead falls a step at a time and may not rise (0: no guard)."""

    phase_schedule: PhaseSchedule = field(default_factory=PhaseSchedule)
    """Per-phase targets: ``[adaptive_async.phase_schedule.warmup]`` etc."""


@dataclass
class Eval:
    """``[eval]``: held-out evaluation through the rollout engines (docs/data.md)."""

    every_steps: Annotated[int, Range(ge=0, note="0 disables")] = 0
    """Evaluate the policy after every N-th training step."""

    at_start: bool = False
    """Also evaluate the initial policy (version 0) before the first step."""

    dataset_path: str = ""
    """Held-out dataset (formats of ``rollout.dataset_path``); empty: the ``eval.split`` split of
    ``rollout.dataset_path``. Generated tasks draw their own held-out prompts."""

    split: str = "test"
    """Split of the held-out dataset (a folder or a saved ``DatasetDict``)."""

    num_prompts: Annotated[int, Range(ge=0, le=65536, note="0 = all")] = 0
    """Prompts evaluated: the first N records of the held-out set; 0 means all of a dataset (64 of a generated task)."""

    n: Annotated[int, Range(ge=1, le=4096)] = 1
    """Completions per prompt. With n > 1, pass@n is logged too."""

    temperature: Annotated[float, Range(ge=0, note="0 = greedy")] = 0.0
    """Sampling temperature of evaluation."""

    pass_threshold: float = 1.0
    """A completion passes when its total reward is >= this (for pass@k)."""


@dataclass
class MetricsAdditions:
    """``[metrics]`` fields added to torchtitan's own section."""

    log_completions_every: Annotated[int, Range(ge=0, note="0 disables")] = 0
    """Every N steps, write the step's completions to ``<dump_folder>/completions.jsonl`` and W&B."""

    step_callbacks: list[str] = field(default_factory=list)
    """Functions called on rank 0 after every step, as ``"package.module:function"`` (``trainer.add_step_callback``
    in code): ``fn(result)`` (``result.step``, ``result.metrics``) or ``fn(step, metrics)``, a ``metrics.jsonl`` row."""

    step_callback_timeout_seconds: Annotated[float, Range(gt=0)] = 300.0
    """The longest one step callback may take on one call. Past it the run checkpoints the step and stops with one
    line naming the callback."""


@dataclass
class CheckpointAdditions:
    """``[checkpoint]`` fields added to torchtitan's own section."""

    on_config_mismatch: Literal["error", "warn"] = "error"
    """When a resume's run-shaping settings (model config and tokenizer, optimizer.name, prompts_per_step, group_size,
    task, dataset records, rollout.seed) differ from the checkpoint's: "error" refuses, "warn" logs and resumes."""


SECTIONS = {"grpo": Grpo, "rollout": Rollout, "weight_sync": WeightSync, "off_policy": OffPolicy,
            "adaptive_async": AdaptiveAsync, "eval": Eval}
# fields added to torchtitan's own sections (run/trainer.py: MetricsConfig, CheckpointConfig)
ADDED_TO_TORCHTITAN = {"metrics": MetricsAdditions, "checkpoint": CheckpointAdditions}
