"""``FluxTrainer``: torchtitan's ``Trainer`` turned into a GRPO trainer fed by rollout engines.

What is torchtitan's and what is ours: model construction, FSDP2 parallelisation, optimizers, LR schedulers,
gradient clipping, ``CheckpointManager`` and the entry point are torchtitan's, used as they are. We replace the
data path (rollouts instead of a text dataloader), the loss (GRPO, ``loss.py``) and the step loop (``train``),
and add engines, weight sync and metrics.

One training step (policy version = number of optimizer steps done = ``self.step`` after the step):
  1. admission: generation may run ``lookahead = async_ratio * adaptive_async.max_version_gap`` steps ahead of
     training, on average: steps are admitted whole, ``floor(lookahead)`` ahead, and one step further on the
     fraction ``lookahead - floor(lookahead)`` of steps (error diffusion, see ``_admit``). ``async_ratio`` is 0 with
     ``weight_sync.async_weight_update = false``, 1 with it true, and the controller's output when
     ``adaptive_async.enabled``. At lookahead 0 the engines first get the newest weights (a synchronous,
     on-policy step). Rank 0 dispatches, then waits for step ``k``'s rollouts; a batch with samples older than
     ``max_version_gap`` is discarded and regenerated (counted);
  2. the batch is broadcast to every rank; each rank trains on its contiguous slice, in micro-batches of
     ``training.local_batch_size`` sequences; the loss is normalised by the global token (or sequence) count;
  3. gradient clipping, ``optimizer.step()``, LR step; then ``WeightSyncer.after_optimizer_step``: blocking
     push (sync mode) or snapshot + background push (async mode);
  4. checkpoint (torchtitan's manager; our ``state_dict`` adds the RNG state), metrics.

Simplifications: one optimizer step per batch (so the "proximal" policy of decoupled PPO is the current one,
detached); no pipeline parallelism (``pipelining_fn`` is None).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import resource
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer

from torchtitan_flux import hf
from torchtitan_flux import loss as grpo
from torchtitan_flux.config import ConfigError, import_spec, step_callback, validate_config
from torchtitan_flux.controller import AdaptiveAsyncController, StalenessSample
from torchtitan_flux.engine.auth import read_token
from torchtitan_flux.engine.embedded import EmbeddedEngine, die_with_parent
from torchtitan_flux.evaluation import Evaluator
from torchtitan_flux.metrics import MetricsWriter
from torchtitan_flux.model import export_hf_weights, load_hf_weights, select_model
from torchtitan_flux.probe import PostSyncProbe, probe_tokens
from torchtitan_flux.placement import engine_devices, visible_devices_env
from torchtitan_flux.rollout import NoEngineLeft, RolloutBatch, RolloutScheduler
from torchtitan_flux.sync_cadence import SyncCadence
from torchtitan_flux.tasks import build_eval_task, build_task, check_rewards, prompt_tokenizer
from torchtitan_flux.weight_sync import WeightSyncer, control_group

logger = logging.getLogger("torchtitan_flux")

RESTART_WINDOW_S = 600.0  # rollout.max_engine_restarts counts restarts of one engine within this window
STALE_BAND = 0.05  # staleness this far above its target counts as out of band (as in benchmarks/controller.py)


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT during training. An ``Exception`` (not ``SystemExit``) so that torchtitan's ``main``
    calls ``trainer.close()``, which stops the engines, before the process exits non-zero."""

    def __init__(self, message: str, at_step_boundary: bool):
        super().__init__(message)
        self.at_step_boundary = at_step_boundary


class LossNotFinite(RuntimeError):
    """The loss (or the gradient norm) of a step is NaN or infinite: the run stops before the optimizer applies it,
    so the last completed step's weights (and its checkpoint) are intact."""


class FluxTrainer(Trainer):
    def __init__(self, job_config):
        self._die_with_launcher()
        self._stop_signal: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        validate_config(job_config)
        try:  # the family in model.hf_assets_path/config.json picks the TrainSpec, or is refused here
            select_model(job_config)
        except ValueError as e:
            raise ConfigError(f"model.hf_assets_path = {job_config.model.hf_assets_path!r}: {e}") from None
        tokenizer = prompt_tokenizer(job_config)
        self.task = build_task(job_config, tokenizer)  # datasets load and prompts are length-checked here
        self.eval_task = build_eval_task(job_config, tokenizer, self.task)
        check_rewards(self.task, job_config.rollout.seed)  # bad reward functions fail before any spawn
        _set_cpu_threads(job_config)
        super().__init__(job_config)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        batch = job_config.rollout.prompts_per_step * job_config.grpo.group_size
        if batch % self.world:
            raise ConfigError(
                f"rollout.prompts_per_step * grpo.group_size = {batch} must be divisible by the number of "
                f"trainer ranks ({self.world})"
            )
        self.model = self.model_parts[0]
        try:  # a missing, truncated or mismatched weights file: one line naming it
            load_hf_weights(self.model, job_config.model.hf_assets_path, self.model_args)
        except (ValueError, OSError) as e:
            raise ConfigError(f"model.hf_assets_path = {job_config.model.hf_assets_path!r}: {e}") from None
        self.ref_model = self._build_reference_model() if job_config.grpo.kl_coef > 0 else None
        self.step_callbacks: list = []
        for spec in job_config.metrics.step_callbacks:  # checked by validate_config
            self.add_step_callback(import_spec("metrics.step_callbacks", spec))
        self.engines: list[EmbeddedEngine] = []
        self.scheduler: RolloutScheduler | None = None
        self.evaluator: Evaluator | None = None
        self.metrics_writer: MetricsWriter | None = None
        self._events: queue.Queue = queue.Queue()
        self._engine_restarts = 0
        self._restart_times: dict[int, list[float]] = {}  # engine index -> monotonic times of its recent restarts
        self.discarded_rollouts = 0
        self._step_ends: list[float] = []
        aa = job_config.adaptive_async
        self.controller = AdaptiveAsyncController(aa, job_config.training.steps) if aa.enabled else None
        self.async_ratio = (
            self.controller.async_ratio if self.controller else float(job_config.weight_sync.async_weight_update)
        )
        self.force_sync = False
        ws = job_config.weight_sync
        self.probe = PostSyncProbe(
            probe_tokens(self.tokenizer, self.model_args.vocab_size, job_config.training.seq_len), ws.probe_tolerance, ws.probe_every,
            ws.timeout_seconds,
        ) if ws.probe_every > 0 else None
        self.admit_carry = 0.0  # error-diffusion residual of the fractional lookahead, in [-0.5, 0.5)
        # weight_sync.interval = "auto": rank 0's cadence decides which steps push (broadcast with the batch)
        max_interval = min(ws.max_interval, aa.max_version_gap + 1)
        self.cadence = SyncCadence(1, ws.overhead_target, max_interval) if ws.interval == "auto" else None
        self._push_s_seen = 0.0  # the push thread's total push time at the last cadence update
        self._probed_version = -1  # newest version the logprob probe confirmed on every live engine
        if self.rank == 0:
            self._start_engines()
        self.memory = {"rss_before_sync_mb": _rss_mb()}
        if self.rank == 0:  # before the syncer, which takes its pump (events flow scheduler -> syncer)
            self.scheduler = self._build_scheduler()
        self.syncer = WeightSyncer(
            job_config.weight_sync, self.model, self.engines, device=self.device, is_sender=self.rank == 0,
            backend="nccl" if self.device.type == "cuda" else "gloo",
            pump=self.scheduler.pump if self.scheduler is not None else time.sleep,
        )
        self.memory["rss_after_staging_mb"] = _rss_mb()
        if self.rank == 0:
            self.metrics_writer = MetricsWriter(
                job_config.job.dump_folder, job_config.training.steps,
                loggers=self.metrics_processor.logger, log_every=job_config.metrics.log_freq,
            )
            if self.eval_task is not None:
                self.evaluator = Evaluator(
                    job_config.eval, self.eval_task, self.scheduler, self.tokenizer, job_config.rollout.seed,
                    job_config.job.dump_folder, wait=not job_config.weight_sync.async_weight_update,
                )

    # ------------------------------------------------------------------------------------------- setup

    def _on_signal(self, signum, frame) -> None:
        """First SIGTERM/SIGINT: stop at the next step boundary (the step in progress completes, so no trained
        step is half-applied). A second one, 2 s or more later: stop now."""
        name = signal.Signals(signum).name
        if self._stop_signal is not None:
            if time.monotonic() - self._stop_at < 2.0:  # one signal delivered twice (to torchrun's group and by it)
                return
            raise TrainingInterrupted(f"received {name} twice", at_step_boundary=False)
        self._stop_signal, self._stop_at = name, time.monotonic()
        logger.warning(f"received {name}: stopping after the current step (send it again to stop at once)")

    @staticmethod
    def _die_with_launcher() -> None:
        """torchrun starts each worker in a session of its own, so a SIGKILL to torchrun's process group does not
        reach the trainer, which would train on (engines included) as an orphan. Under torchrun, ask the kernel
        to SIGKILL this process when the agent dies (``PR_SET_PDEATHSIG``); the engines then die with it the
        same way, and the newest checkpoint with ``.metadata`` stays the one a resume loads."""
        if "TORCHELASTIC_RUN_ID" not in os.environ or not die_with_parent():
            return
        if os.getppid() == 1:  # the agent died before the prctl
            os.kill(os.getpid(), signal.SIGKILL)

    def _build_reference_model(self) -> torch.nn.Module:
        """A frozen copy of the initial policy, built and sharded the same way (for the KL penalty)."""
        with torch.device("meta"):
            ref = self.train_spec.model_cls(self.model_args)
        ref = self.train_spec.parallelize_fn(ref, self.parallel_dims, self.job_config)
        ref.to_empty(device=self.device)
        with torch.no_grad():
            ref.init_weights(buffer_device=None)
        load_hf_weights(ref, self.job_config.model.hf_assets_path, self.model_args)
        ref.eval().requires_grad_(False)
        return ref

    def _new_engine(self, index: int):
        r = self.job_config.rollout
        token = read_token(self.job_config.weight_sync.auth_token_env)  # never stored: not in checkpoints
        if r.engine in ("vllm", "sglang"):  # a server we did not start: connect and check it (start() raises)
            if r.engine == "vllm" and self.device.type == "cuda":  # vLLM's own NCCL engines (engine/vllm_nccl.py)
                from torchtitan_flux.engine.vllm_nccl import VllmNcclEngine as cls
            elif r.engine == "vllm":
                from torchtitan_flux.engine.vllm import VllmEngine as cls
            else:
                from torchtitan_flux.engine.sglang import SglangEngine as cls
            kw = {}
            if r.engine == "vllm":  # sampled checksums of what the server received (weight_sync.verify_every)
                kw = dict(verify_every=self.job_config.weight_sync.verify_every,
                          final_version=self.job_config.training.steps)
            e = cls(f"{r.engine}{index}", self._urls[index], self._events, model_dir=self.job_config.model.hf_assets_path,
                    auth_token=token, **kw)
            e.start()
            return e
        e = EmbeddedEngine(
            f"engine{index}", self.job_config.model.hf_assets_path, r.engine_threads, self._events, self._devices[index],
            weight_buffers=self.job_config.adaptive_async.max_version_gap + 1, auth_token=token,
        )
        e.start()
        return e

    def _start_engines(self) -> None:
        r = self.job_config.rollout
        self._urls = list(r.urls)
        self._devices = engine_devices(  # before any engine starts; servers at rollout.urls are placed by their owner
            list(r.engine_devices), r.engine_device, r.num_engines, trainer_on_gpu=self.device.type == "cuda",
            visible=torch.cuda.device_count(), local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        ) if r.engine == "embedded" or r.launch else []
        if r.launch:  # rollout.launch: start our own vLLM servers (stopped in close())
            from torchtitan_flux.config import resolve_launch_python
            from torchtitan_flux.engine.vllm import launch_servers

            self.servers = launch_servers(
                r.num_engines, self.job_config.model.hf_assets_path, python=resolve_launch_python(r.launch_python),
                log_dir=self.job_config.job.dump_folder, timeout_s=r.launch_timeout_s,
                threads=None if torch.cuda.is_available() else r.engine_threads,
                auth_token=read_token(self.job_config.weight_sync.auth_token_env),
                envs=[visible_devices_env(d, os.environ.get("CUDA_VISIBLE_DEVICES")) for d in self._devices],
            )
            self._urls = [s.url for s in self.servers]
        n = len(self._urls) if r.engine in ("vllm", "sglang") else r.num_engines
        self.engines = [self._new_engine(i) for i in range(n)]

    def _restart_engine(self, dead: EmbeddedEngine):
        """A dead embedded engine is replaced by a fresh process that rejoins and gets the newest weights, at most
        ``rollout.max_engine_restarts`` times within ``RESTART_WINDOW_S`` (a crash loop is given up: None)."""
        dead.close()
        idx = self.engines.index(dead)
        now = time.monotonic()
        recent = [t for t in self._restart_times.get(idx, []) if now - t < RESTART_WINDOW_S]
        if not dead.reconnects and len(recent) >= self.job_config.rollout.max_engine_restarts:
            logger.error(f"{dead.name}: died {len(recent) + 1} times within {RESTART_WINDOW_S:.0f} s "
                         f"(rollout.max_engine_restarts = {self.job_config.rollout.max_engine_restarts}); not "
                         "restarted again: its error is the 'died' line above")
            self.engines.remove(dead)
            return None
        self._restart_times[idx] = recent + [now]
        self._engine_restarts += 1
        if dead.reconnects:  # an HTTP server is not ours to restart: reconnect if it is back
            try:
                new = dead.reconnect()
            except Exception as e:  # noqa: BLE001
                logger.error(f"{dead.name}: server gone ({e}); going on without it")
                self.engines.remove(dead)
                return None
        else:
            new = self._new_engine(idx)
        self.engines[idx] = new
        self.syncer.replace_engine(dead, new)
        return new

    def _build_scheduler(self) -> RolloutScheduler:
        jc = self.job_config
        return RolloutScheduler(
            self.engines, self._events, self.task, self.tokenizer,
            group_size=jc.grpo.group_size, prompts_per_step=jc.rollout.prompts_per_step,
            max_new_tokens=jc.rollout.max_new_tokens, temperature=jc.grpo.temperature, top_k=jc.rollout.top_k,
            seed=jc.rollout.seed, pad_id=_pad_id(self.tokenizer, jc.model.hf_assets_path),
            max_version_gap=jc.adaptive_async.max_version_gap,
            on_weight_event=lambda ev: self.syncer.on_event(ev), on_engine_dead=self._restart_engine,
            dead_zone=jc.rollout.dispatch_dead_zone, max_share=jc.rollout.dispatch_max_share,
            reward_workers=jc.rollout.reward_workers,
        )

    def add_step_callback(self, fn) -> Any:
        """Register ``fn(step, metrics)`` or ``fn(result)`` (``result.step``, ``result.metrics``), called on rank 0
        after every step; returns ``fn`` (decorator use)."""
        self.step_callbacks.append(step_callback(fn))
        return fn

    # ------------------------------------------------------------------------------------------- loop

    @property
    def sync_interval(self) -> int:
        """Every how many steps weights are pushed now (``weight_sync.interval``, or the cadence's choice)."""
        return self.cadence.interval if self.cadence is not None else self.job_config.weight_sync.interval

    @property
    def lookahead(self) -> float:
        """How many steps ahead of training generation may run (see the module docstring): ``async_ratio *
        max_version_gap``, but at most ``max_version_gap - (interval - 1)``, since engines may hold weights up to
        ``interval - 1`` steps old (with interval 1 the cap never binds)."""
        if self.force_sync:
            return 0.0
        gap = self.job_config.adaptive_async.max_version_gap
        return min(self.async_ratio * gap, gap - (self.sync_interval - 1))

    def train(self):
        jc = self.job_config
        self.checkpointer.load(step=jc.checkpoint.load_step)
        logger.info(f"Training starts at step {self.step + 1}")
        if self.rank == 0:
            self.syncer.connect()
        self.syncer.flush(self.step)  # engines start from the trainer's (possibly resumed) weights
        if self.evaluator is not None and jc.eval.at_start:
            self.evaluator.start(self.step)
            self.metrics_writer.log(self.step, self.evaluator.collect(wait=True), progress=False)
        try:
            while self.should_continue_training():
                self.gc_handler.run(self.step + 1)
                t0 = time.perf_counter()
                batch, rollout_wait, push_due = self._next_batch(self.step + 1)
                self.step += 1
                t1 = time.perf_counter()
                metrics = self.train_on(batch)
                metrics.update(self._control(batch, metrics))
                t2 = time.perf_counter()
                self.syncer.after_optimizer_step(self.step, due=push_due)
                t3 = time.perf_counter()
                if self.cadence is not None and self.rank == 0:
                    metrics.update(self._tune_cadence(push_due, t2 - t1, t3 - t2, rollout_wait, metrics))
                if self.probe is not None and self.probe.due(self.step, jc.training.steps):
                    self.syncer.flush(self.step)  # the engines must hold this step's weights
                    engines = [e for e in self.engines if e.alive()] if self.rank == 0 else []
                    probed = self.probe.run(self.model, engines, self.step, self.device)
                    if probed.get("probe_engines_checked", 0) == len(engines) > 0:
                        self._probed_version = self.step  # every live engine served this version (summary)
                    metrics.update(probed)
                self.checkpointer.save(self.step, last_step=(self.step == jc.training.steps))
                if self.evaluator is not None:
                    metrics.update(self._evaluate())
                if self.rank == 0:
                    self._log(batch, metrics, t0, t1, t2, t3, rollout_wait)
                    self._step_ends.append(time.perf_counter())
                if self.step == 1:
                    dist_utils.set_pg_timeouts(
                        timeout=_td(jc.comm.train_timeout_seconds), parallel_dims=self.parallel_dims
                    )
                if self._stop_signal is not None:
                    raise TrainingInterrupted(f"received {self._stop_signal}", at_step_boundary=True)
        except (TrainingInterrupted, NoEngineLeft, LossNotFinite) as e:
            self._save_on_stop(getattr(e, "at_step_boundary", True), reason=str(e))
            raise
        finally:
            if self.rank == 0 and self.scheduler is not None:
                self.scheduler.drain(timeout=1.0)
        self._finish()

    def _evaluate(self) -> dict[str, float]:
        """Rank 0: start the evaluation of the newest policy the engines get (this step's, unless an async push
        was coalesced or ``weight_sync.interval`` skipped it: ``eval/version`` says which) when due, and return
        the metrics of the newest evaluation finished (see ``evaluation.py`` for when it waits)."""
        ev, last = self.evaluator, self.step == self.job_config.training.steps
        earlier = None
        if ev.due(self.step):
            if ev.pending():
                earlier = ev.collect(wait=True)  # one evaluation in flight at a time
            ev.start(self.syncer.version)
        return ev.collect(wait=ev.wait or last) or earlier or {}

    def _save_on_stop(self, at_step_boundary: bool, reason: str) -> None:
        """Graceful stop (a signal, or no rollout engine left): let an in-flight push finish or time out (nothing
        is left half-sent by us), then write a checkpoint of the last completed step when checkpoints are on.
        Single-process only: with several ranks a second signal can land at different points on each, and a
        collective save could hang, so those runs resume from their last periodic checkpoint. After a second
        signal the step in progress may be incomplete: then no checkpoint is written."""
        logger.warning(f"interrupted after step {self.step} ({reason}); stopping")
        try:
            settled = self.syncer.wait_idle(self.job_config.weight_sync.timeout_seconds)
        except NoEngineLeft:  # the last engine's death noticed while waiting (events are pumped): save anyway
            settled = False
        if not settled:
            logger.warning("weight push did not settle within weight_sync.timeout_seconds: abandoned (a resume "
                           "pushes the checkpoint's weights to every engine first)")
        if at_step_boundary and self.world == 1 and self.job_config.checkpoint.enable and self.step > 0:
            self.checkpointer.save(self.step, last_step=True)
            logger.warning(f"checkpoint of step {self.step} written")

    def _finish(self) -> None:
        """After the last step: final push, summary (rank 0), HF export."""
        self.syncer.flush(self.step)
        memory = [{**self.memory, "peak_rss_mb": _peak_rss_mb()}]  # before the export gathers the model
        if self.world > 1:
            memory = [None] * self.world
            dist.all_gather_object(memory, {**self.memory, "peak_rss_mb": _peak_rss_mb()})
        self._export_final()
        if self.rank == 0:
            self._write_summary(memory)

    def _next_batch(self, step: int) -> tuple[RolloutBatch | None, float, bool]:
        """Rank 0 admits and collects; every rank gets the batch and whether this step pushes its weights.
        Returns (batch, seconds waited, push due)."""
        t0 = time.perf_counter()
        self._flush_s = 0.0
        if (self.force_sync or self.async_ratio == 0) and self.job_config.weight_sync.async_weight_update:
            self.syncer.flush(self.step)  # on-policy step: engines must hold the newest weights first
            self._flush_s = time.perf_counter() - t0
        batch = None
        if self.rank == 0:
            ahead = self._admit(self.lookahead)
            sched, last = self.scheduler, self.job_config.training.steps
            pin = self.syncer.version  # newest staged: every engine gets it, so requests can run on exactly it
            for k in range(step, min(step + ahead, last) + 1):
                sched.dispatch(k, self.step, pin_version=pin)
            while True:
                batch = sched.collect(step, self.step, pin_version=pin)
                gap = self.step - int(batch.versions.min())
                if gap <= self.job_config.adaptive_async.max_version_gap:
                    break
                self.discarded_rollouts += batch.tokens.shape[0]
                logger.warning(f"step {step}: rollouts {gap} versions old exceed max_version_gap; regenerating")
            self.syncer.check_timeouts()
        wait = time.perf_counter() - t0
        due = self.cadence.due() if self.cadence is not None else step % self.job_config.weight_sync.interval == 0
        if self.world > 1:
            obj = [batch, due, self.sync_interval]
            dist.broadcast_object_list(obj, src=0, group=control_group())  # CPU gloo: no NCCL timeout
            batch, due, interval = obj
            if self.rank != 0:  # the same inputs as rank 0's admission, so every rank checkpoints the same carry
                if self.cadence is not None:
                    self.cadence.interval = interval
                self._admit(self.lookahead)
        return batch, wait, due

    def _tune_cadence(self, pushed: bool, compute_s: float, sync_s: float, rollout_wait: float,
                      m: dict[str, float]) -> dict[str, Any]:
        """Rank 0, ``weight_sync.interval = "auto"``: account this step's time lost to weight sync and, when it
        pushed, let the cadence pick the next interval (``sync_cadence.py``). Lost time: blocking mode, the main
        thread's time in the push; async mode, that (the snapshot) plus an on-policy flush, plus the part of the
        rollout wait the push thread's work can explain (at most the push time spent since the last step).
        Staleness wins: with the controller on, staleness above its target by more than ``STALE_BAND`` halves
        the interval and blocks raises."""
        lost = sync_s + self._flush_s
        if self.job_config.weight_sync.async_weight_update:
            total = self.syncer.stats.push_s_total
            lost += min(max(rollout_wait - self._flush_s, 0.0), total - self._push_s_seen)
            self._push_s_seen = total
        stale = "staleness" in m and m["staleness"] > m["target_staleness"] + STALE_BAND
        before = self.cadence.interval
        d = self.cadence.observe_step(compute_s, lost, pushed, stale=stale)
        out: dict[str, Any] = {"sync_interval": self.cadence.interval, "sync_lost_s": lost,
                               "sync_overhead_target": self.cadence.target}
        if d is not None:
            out.update(sync_overhead=d.overhead, sync_interval_reason=d.reason)
            if d.interval != before:
                logger.info(f"weight_sync.interval {before} -> {d.interval} ({d.reason}: overhead "
                            f"{d.overhead:.3f}, target {self.cadence.target})")
        return out

    def _admit(self, lookahead: float) -> int:
        """How many steps ahead of ``step`` to admit now: ``floor(lookahead)``, plus one on the fraction
        ``lookahead - floor(lookahead)`` of calls (error diffusion: the residual carries over, so the admitted
        lookahead averages ``lookahead`` and its running error stays within half a step).

        Why whole steps: an earlier design sent that fraction of the next step's prompts early and the rest
        later, which made every step two engine requests and two decode passes over smaller batches; on the CPU
        debug config that costs ~10% of throughput at the same mean lookahead (measured: 24.4 vs 27.3 steps/s at
        lookahead 2.4 vs 2.0). Deterministic (a function of the controller's outputs and ``admit_carry``, which
        is checkpointed), and ``lookahead = 0`` never admits ahead (the residual stays below one half)."""
        whole = int(lookahead)
        self.admit_carry += lookahead - whole
        if self.admit_carry >= 0.5:
            self.admit_carry -= 1.0
            return whole + 1
        return whole

    def _control(self, batch: RolloutBatch, m: dict[str, float]) -> dict[str, float]:
        """Staleness of the batch just trained -> the controller -> async_ratio of the next admission.
        Runs on every rank with identical (all-reduced / broadcast) inputs, so every rank agrees."""
        gap = (self.step - 1 - batch.versions).float()
        out = {"async_ratio": self.async_ratio}
        if self.controller is None:
            return out
        sample = StalenessSample(
            kl=m["behaviour_kl"], iw_var=m["iw_var"], version_gap_mean=gap.mean().item(),
            version_gap_max=gap.max().item(), ess_fraction=m["ess_fraction"],
        )
        out = self.controller.step(self.step, sample)
        self.async_ratio = out["async_ratio"]
        self.force_sync = bool(out["force_sync"])
        return out

    def train_on(self, batch: RolloutBatch) -> dict[str, float]:
        """One GRPO optimizer step on ``batch`` (all ranks)."""
        jc, g = self.job_config, self.job_config.grpo
        self.optimizers.zero_grad()
        adv, zero_groups = grpo.group_advantages(batch.rewards, g.group_size, std_normalize=g.advantage_std_normalize)
        gap = (self.step - 1 - batch.versions).clamp(min=0).float()
        weights = (1.0 + gap) ** -g.staleness_discount if g.staleness_discount > 0 else None
        num_tokens = batch.loss_mask.sum()
        rows = batch.tokens.shape[0] // self.world
        lo = self.rank * rows
        mbs = jc.training.local_batch_size
        sums: dict[str, torch.Tensor] = {}
        loss_total = torch.zeros((), device=self.device)
        for s in range(lo, lo + rows, mbs):
            sl = slice(s, min(s + mbs, lo + rows))
            tokens = batch.tokens[sl].to(self.device)
            mask = batch.loss_mask[sl].to(self.device)
            with self.train_context(), self.maybe_enable_amp:
                logits = self.model(tokens)
                logprobs = grpo.token_logprobs(logits[:, :-1].float(), tokens[:, 1:], g.temperature)
                del logits
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = grpo.token_logprobs(self.ref_model(tokens)[:, :-1].float(), tokens[:, 1:], g.temperature)
                loss, m = grpo.grpo_loss(
                    logprobs, batch.behaviour_logprobs[sl].to(self.device), adv[sl].to(self.device), mask,
                    proximal_logprobs=logprobs.detach() if g.tis_cap > 0 else None,
                    ref_logprobs=ref, sample_weights=None if weights is None else weights[sl].to(self.device),
                    clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef, kl_estimator=g.kl_estimator,
                    normalization=g.loss_normalization, tis_cap=g.tis_cap,
                    num_tokens=num_tokens, num_sequences=batch.tokens.shape[0],
                )
            loss.backward()
            loss_total += loss.detach()
            ntok = mask.sum()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v.detach() * ntok
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], jc.training.max_norm, foreach=True,
            pp_mesh=None, ep_enabled=False,
        )
        if not torch.isfinite(grad_norm).item():  # the same on every rank (a global norm): all stop here
            self.optimizers.zero_grad()
            self.step -= 1  # nothing of this step was applied: the weights are still those of the step before
            raise LossNotFinite(
                f"loss is not finite at step {self.step + 1} (loss {loss_total.item():.4g}, gradient norm "
                f"{grad_norm.item():.4g}; rewards of this batch: min {batch.rewards.min().item():.4g}, max "
                f"{batch.rewards.max().item():.4g}); the weights of step {self.step} are kept"
            )
        self.checkpointer.maybe_wait_for_staging()
        self.syncer.before_optimizer_step()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.ntokens_seen += int(num_tokens)

        stats = torch.stack([loss_total] + [sums[k] for k in sorted(sums)])
        if self.world > 1:
            dist.all_reduce(stats)
        out = {"loss": stats[0].item()}
        out.update({k: (stats[i + 1] / num_tokens.clamp(min=1)).item() for i, k in enumerate(sorted(sums))})
        out["grad_norm"] = grad_norm.item()
        out["zero_variance_groups"] = zero_groups
        out["lr"] = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        return out

    def _log(self, batch: RolloutBatch, m: dict, t0, t1, t2, t3, rollout_wait: float) -> None:
        gap = (self.step - 1 - batch.versions).float()
        ntok = batch.num_completion_tokens
        step_time = t3 - t0
        m.update(
            reward_mean=batch.rewards.mean().item(),
            reward_std=batch.rewards.std(unbiased=False).item(),
            policy_version=self.step,
            step_time_s=step_time,
            rollout_time_s=rollout_wait,
            gen_time_s=batch.gen_time_s,
            train_time_s=t2 - t1,
            tokens_per_s=ntok / max(step_time, 1e-9),
            samples_per_s=batch.tokens.shape[0] / max(step_time, 1e-9),
            completion_len_mean=ntok / batch.tokens.shape[0],
            version_gap_mean=gap.mean().item(),
            version_gap_max=gap.max().item(),
            rollout_version_min=int(batch.versions.min()),
            discarded_rollouts=self.discarded_rollouts,
            engine_restarts=self._engine_restarts,
            redispatched_requests=self.scheduler.redispatched,
            **self.syncer.metrics(),
        )
        m["weight_sync_s"] = t3 - t2
        m.update(batch.reward_metrics)
        self.metrics_writer.log(self.step, m)
        every = self.job_config.metrics.log_completions_every
        if every and self.step % every == 0:
            G = self.job_config.grpo.group_size
            self.metrics_writer.log_completions(
                self.step, [p for p in batch.prompts for _ in range(G)], batch.completions, batch.versions.tolist(),
                batch.rewards.tolist(), batch.reward_values,
            )
        for fn in self.step_callbacks:
            fn(self.step, m)

    def _write_summary(self, memory: list[dict]) -> None:
        """``summary.json``: final versions and checksums of trainer vs every engine, throughput, and per-rank
        memory (RSS before and after the weight-sync staging buffer was allocated, and the run's peak)."""
        import json

        trainer_sum, final = self.syncer.staging.checksum(), self.syncer.version
        engines = {}
        for e in self.engines:
            version, checksum = e.checksum()
            if checksum is not None and version == final:
                check = "checksum match" if checksum == trainer_sum else "checksum differs"
            elif self._probed_version == final and e.alive():
                check = "probe"  # no byte checksum of the final version; the logprob probe passed on it
            else:
                check = "not verified"
            engines[e.name] = {"version": version, "checksum": checksum, "check": check}
        ends = self._step_ends
        warm = min(2, len(ends) - 1)
        checks = [v["check"] for v in engines.values()]
        summary = {
            "final_version": self.step,
            "trainer_checksum": trainer_sum,
            "engines": engines,
            "final_engine_version": min((v["version"] for v in engines.values()), default=-1),
            # every engine's bytes compared and equal (a missing checksum is not a match)
            "checksums_match": bool(checks) and all(c == "checksum match" for c in checks),
            "checksums_compared": [n for n, v in engines.items() if v["check"].startswith("checksum")],
            # every engine shown to serve the final weights, by checksum or by the logprob probe
            "all_engines_verified": bool(checks) and all(c in ("checksum match", "probe") for c in checks),
            "steps_per_s": (len(ends) - 1 - warm) / (ends[-1] - ends[warm]) if len(ends) > warm + 1 else 0.0,
            "weight_bytes": self.syncer.plan.nbytes,
            "weight_buckets": len(self.syncer.plan.buckets),
            "bucket_bytes": self.syncer.bucket_bytes,
            "memory_per_rank": memory,
            "weight_sync": self.syncer.metrics(),
        }
        with open(os.path.join(self.job_config.job.dump_folder, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if "checksum differs" in checks:
            logger.error(f"engine weights differ from the trainer's after the final sync: {engines}")
        elif not summary["all_engines_verified"]:
            logger.warning(f"not every engine's final weights could be verified (no checksum, no probe): {engines}")

    def _export_final(self) -> None:
        out = os.path.join(self.job_config.job.dump_folder, "hf_final")
        export_hf_weights(self.model, out, self.model_args, self.job_config.model.hf_assets_path)
        if self.rank == 0:
            logger.info(f"final policy exported to {out}")

    # ----------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        rollouts = [b"", b""]  # rank 0's finished rollouts and sync cadence
        if self.scheduler is not None:  # rank 0 (called on save and load; on load nothing is in flight)
            rollouts[0] = pickle.dumps(self.scheduler.state_dict(self.job_config.weight_sync.timeout_seconds))
            rollouts[1] = pickle.dumps(self.cadence.state_dict() if self.cadence is not None else None)
        if self.world > 1:  # every rank saves the same value, whichever one the checkpoint writer keeps
            dist.broadcast_object_list(rollouts, src=0, group=control_group())
        return {
            **super().state_dict(),
            "rng": torch.get_rng_state(),
            "discarded_rollouts": self.discarded_rollouts,
            "async_ratio": self.async_ratio,
            "force_sync": self.force_sync,
            "admit_carry": self.admit_carry,
            "controller": self.controller.state_dict() if self.controller else {},
            "rollouts": rollouts[0],  # finished rollouts of later steps (async); pickled: their sizes vary
            "sync_cadence": rollouts[1],
            "data": pickle.dumps(self._data_state()),  # dataset position (a function of the step) and identity
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        torch.set_rng_state(state_dict["rng"])
        self.discarded_rollouts = int(state_dict["discarded_rollouts"])
        self.async_ratio, self.force_sync = float(state_dict["async_ratio"]), bool(state_dict["force_sync"])
        self.admit_carry = float(state_dict.get("admit_carry", 0.0))  # absent in checkpoints before it existed
        if self.controller is not None and state_dict["controller"]:
            self.controller.load_state_dict(state_dict["controller"])
        if self.scheduler is not None and state_dict.get("rollouts"):
            self.scheduler.load_state_dict(pickle.loads(state_dict["rollouts"]))
        cadence = pickle.loads(state_dict["sync_cadence"]) if state_dict.get("sync_cadence") else None
        if self.cadence is not None and cadence is not None:  # absent in older checkpoints, or interval was fixed
            self.cadence.load_state_dict(cadence)
        saved = pickle.loads(state_dict["data"]) if state_dict.get("data") else {}  # absent before it existed
        if saved and hasattr(self.task, "check_resume") and self.rank == 0:
            problem = self.task.check_resume(saved, self.step, self.job_config.rollout.prompts_per_step)
            if problem:
                logger.warning(problem)

    def _data_state(self) -> dict:
        if not hasattr(self.task, "data_state"):  # generated tasks: prompts are a function of (seed, step)
            return {}
        return self.task.data_state(self.step, self.job_config.rollout.prompts_per_step)

    def close(self) -> None:
        if getattr(self, "syncer", None) is not None:
            self.syncer.close()
        for e in getattr(self, "engines", []):
            e.close()
        for s in getattr(self, "servers", []):  # launched vLLM servers: SIGTERM, SIGKILL after a grace period
            s.stop()
        if getattr(self, "metrics_writer", None) is not None:
            self.metrics_writer.close()
        super().close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:  # Linux; resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pad_id(tokenizer, hf_dir: str) -> int:
    pad = tokenizer.tokenizer.token_to_id("<|pad|>") if hasattr(tokenizer, "tokenizer") else None
    return hf.tokenizer_settings(hf_dir)["pad_token_id"] if pad is None else pad


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _set_cpu_threads(job_config) -> None:
    """On CPU, leave the engines on this machine their cores (embedded engines, or servers we launch):
    trainer threads = (cores - engine threads) / local ranks. Remote servers leave the trainer every core."""
    if torch.cuda.is_available() or not (job_config.rollout.engine == "embedded" or job_config.rollout.launch):
        return
    r = job_config.rollout
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    engine_cores = r.engine_threads * r.num_engines
    torch.set_num_threads(max(1, ((os.cpu_count() or 1) - engine_cores) // local))
