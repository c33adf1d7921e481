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

from torchtitan_flux import loss as grpo
from torchtitan_flux.config import ConfigError, validate_config
from torchtitan_flux.controller import AdaptiveAsyncController, StalenessSample
from torchtitan_flux.engine.auth import read_token
from torchtitan_flux.engine.embedded import EmbeddedEngine, die_with_parent
from torchtitan_flux.metrics import MetricsWriter
from torchtitan_flux.model import export_hf_weights, load_hf_weights
from torchtitan_flux.rollout import NoEngineLeft, RolloutBatch, RolloutScheduler
from torchtitan_flux.tasks import build_task, check_reward
from torchtitan_flux.weight_sync import WeightSyncer

logger = logging.getLogger("torchtitan_flux")


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm of a step is NaN/inf. Raised before ``optimizer.step()``, so the weights are
    those of the last completed step, which is checkpointed (when checkpoints are on) before the run stops."""


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT during training. An ``Exception`` (not ``SystemExit``) so that torchtitan's ``main``
    calls ``trainer.close()``, which stops the engines, before the process exits non-zero."""

    def __init__(self, message: str, at_step_boundary: bool):
        super().__init__(message)
        self.at_step_boundary = at_step_boundary


class FluxTrainer(Trainer):
    def __init__(self, job_config):
        self._die_with_launcher()
        self._stop_signal: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        validate_config(job_config)
        self.task = build_task(job_config.rollout)
        probe = self.task.prompts(job_config.rollout.seed, 1, 1)[0]
        check_reward(self.task, self.task.reward(probe, ""))  # bad reward functions fail before any spawn
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
        load_hf_weights(self.model, job_config.model.hf_assets_path, self.model_args)
        self.ref_model = self._build_reference_model() if job_config.grpo.kl_coef > 0 else None
        self.step_callbacks: list = []
        self.engines: list[EmbeddedEngine] = []
        self.scheduler: RolloutScheduler | None = None
        self.metrics_writer: MetricsWriter | None = None
        self._events: queue.Queue = queue.Queue()
        self._engine_restarts = 0
        self.discarded_rollouts = 0
        self._step_ends: list[float] = []
        aa = job_config.adaptive_async
        self.controller = AdaptiveAsyncController(aa, job_config.training.steps) if aa.enabled else None
        self.async_ratio = (
            self.controller.async_ratio if self.controller else float(job_config.weight_sync.async_weight_update)
        )
        self.force_sync = False
        self.admit_carry = 0.0  # error-diffusion residual of the fractional lookahead, in [-0.5, 0.5)
        if self.rank == 0:
            self._start_engines()
        self.memory = {"rss_before_sync_mb": _rss_mb()}
        self.syncer = WeightSyncer(
            job_config.weight_sync, self.model, self.engines, device=self.device, is_sender=self.rank == 0,
            backend="nccl" if self.device.type == "cuda" else "gloo",
        )
        self.memory["rss_after_staging_mb"] = _rss_mb()
        if self.rank == 0:
            self.syncer.pump = self._pump
            self.scheduler = self._build_scheduler()
            self.metrics_writer = MetricsWriter(
                job_config.job.dump_folder, job_config.training.steps,
                tensorboard=job_config.metrics.enable_tensorboard, tensorboard_every=job_config.metrics.log_freq,
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
            if r.engine == "vllm":
                from torchtitan_flux.engine.vllm import VllmEngine as cls
            else:
                from torchtitan_flux.engine.sglang import SglangEngine as cls
            e = cls(f"{r.engine}{index}", self._urls[index], self._events, model_dir=self.job_config.model.hf_assets_path,
                    auth_token=token)
            e.start()
            return e
        e = EmbeddedEngine(
            f"engine{index}", self.job_config.model.hf_assets_path, r.engine_threads, self._events, self._engine_device(),
            weight_buffers=self.job_config.adaptive_async.max_version_gap + 1, auth_token=token,
        )
        e.start()
        return e

    def _engine_device(self) -> str:
        d = self.job_config.rollout.engine_device
        if d != "auto":
            return d
        if self.device.type != "cuda":
            return "cpu"
        return f"cuda:{int(os.environ.get('LOCAL_WORLD_SIZE', '1'))}"

    def _start_engines(self) -> None:
        r = self.job_config.rollout
        self._urls = list(r.urls)
        if r.launch:  # rollout.launch: start our own vLLM servers (stopped in close())
            from torchtitan_flux.config import resolve_launch_python
            from torchtitan_flux.engine.vllm import launch_servers

            self.servers = launch_servers(
                r.num_engines, self.job_config.model.hf_assets_path, python=resolve_launch_python(r.launch_python),
                log_dir=self.job_config.job.dump_folder, timeout_s=r.launch_timeout_s,
                threads=None if torch.cuda.is_available() else r.engine_threads,
                auth_token=read_token(self.job_config.weight_sync.auth_token_env),
            )
            self._urls = [s.url for s in self.servers]
        n = len(self._urls) if r.engine in ("vllm", "sglang") else r.num_engines
        self.engines = [self._new_engine(i) for i in range(n)]

    def _restart_engine(self, dead: EmbeddedEngine):
        """A dead embedded engine is replaced by a fresh process that rejoins and gets the newest weights."""
        dead.close()
        self._engine_restarts += 1
        idx = self.engines.index(dead)
        if hasattr(dead, "reconnect"):  # an HTTP server is not ours to restart: reconnect if it is back
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
            seed=jc.rollout.seed, pad_id=_pad_id(self.tokenizer), max_version_gap=jc.adaptive_async.max_version_gap,
            on_weight_event=self.syncer.on_event, on_engine_dead=self._restart_engine,
            dead_zone=jc.rollout.dispatch_dead_zone, max_share=jc.rollout.dispatch_max_share,
        )

    def _pump(self, timeout: float) -> None:
        self.scheduler.pump(timeout)

    def add_step_callback(self, fn) -> Any:
        """Register ``fn(step, metrics)``, called on rank 0 after every step; returns ``fn`` (decorator use)."""
        self.step_callbacks.append(fn)
        return fn

    # ------------------------------------------------------------------------------------------- loop

    @property
    def lookahead(self) -> float:
        """How many steps ahead of training generation may run (see the module docstring)."""
        if self.force_sync:
            return 0.0
        return self.async_ratio * self.job_config.adaptive_async.max_version_gap

    def train(self):
        jc = self.job_config
        self.checkpointer.load(step=jc.checkpoint.load_step)
        logger.info(f"Training starts at step {self.step + 1}")
        if self.rank == 0:
            self.syncer.connect()
        self.syncer.flush(self.step)  # engines start from the trainer's (possibly resumed) weights
        try:
            while self.should_continue_training():
                self.gc_handler.run(self.step + 1)
                t0 = time.perf_counter()
                batch, rollout_wait = self._next_batch(self.step + 1)
                self.step += 1
                t1 = time.perf_counter()
                metrics = self.train_on(batch)
                metrics.update(self._control(batch, metrics))
                t2 = time.perf_counter()
                self.syncer.after_optimizer_step(self.step)
                t3 = time.perf_counter()
                self.checkpointer.save(self.step, last_step=(self.step == jc.training.steps))
                if self.rank == 0:
                    self._log(batch, metrics, t0, t1, t2, t3, rollout_wait)
                    self._step_ends.append(time.perf_counter())
                if self.step == 1:
                    dist_utils.set_pg_timeouts(
                        timeout=_td(jc.comm.train_timeout_seconds), parallel_dims=self.parallel_dims
                    )
                if self._stop_signal is not None:
                    raise TrainingInterrupted(f"received {self._stop_signal}", at_step_boundary=True)
        except (TrainingInterrupted, NoEngineLeft) as e:
            self._save_on_stop(getattr(e, "at_step_boundary", True), reason=str(e))
            raise
        except NonFiniteLoss as e:
            self.step -= 1  # the failed step took no optimizer step: the state is that of the step before
            self._save_on_stop(True, reason=str(e))
            raise
        finally:
            if self.rank == 0 and self.scheduler is not None:
                self.scheduler.drain(timeout=1.0)
        self._finish()

    def _save_on_stop(self, at_step_boundary: bool, reason: str) -> None:
        """Graceful stop (a signal, or no rollout engine left): let an in-flight push finish or time out (nothing
        is left half-sent by us), then write a checkpoint of the last completed step when checkpoints are on.
        Single-process only: with several ranks a second signal can land at different points on each, and a
        collective save could hang, so those runs resume from their last periodic checkpoint. After a second
        signal the step in progress may be incomplete: then no checkpoint is written."""
        logger.warning(f"interrupted after step {self.step} ({reason}); stopping")
        if not self.syncer.wait_idle(self.job_config.weight_sync.timeout_seconds):
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

    def _next_batch(self, step: int) -> tuple[RolloutBatch | None, float]:
        """Rank 0 admits and collects; every rank gets the batch. Returns (batch, seconds waited)."""
        t0 = time.perf_counter()
        lookahead = self.lookahead
        if lookahead == 0 and self.job_config.weight_sync.async_weight_update:
            self.syncer.flush(self.step)  # on-policy step: engines must hold the newest weights first
        ahead = self._admit(lookahead)  # on every rank, so every rank checkpoints the same admit_carry
        batch = None
        if self.rank == 0:
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
        if self.world > 1:
            obj = [batch]
            dist.broadcast_object_list(obj, src=0)
            batch = obj[0]
        return batch, wait

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
        finite = (torch.isfinite(loss_total) & torch.isfinite(grad_norm)).to(torch.int32)
        if self.world > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise NonFiniteLoss(f"loss is not finite at step {self.step} (loss = {loss_total.item()}, grad_norm = "
                                f"{grad_norm.item()}); stopped before the optimizer step. Check the rewards "
                                "(very large values) and optimizer.lr")
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
        self.metrics_writer.log(self.step, m)
        for fn in self.step_callbacks:
            fn(self.step, m)

    def _write_summary(self, memory: list[dict]) -> None:
        """``summary.json``: final versions and checksums of trainer vs every engine, throughput, and per-rank
        memory (RSS before and after the weight-sync staging buffer was allocated, and the run's peak)."""
        import json

        trainer_sum = self.syncer.staging.checksum()
        engines = {}
        for e in self.engines:
            version, checksum = e.checksum()
            engines[e.name] = {"version": version, "checksum": checksum}
        ends = self._step_ends
        warm = min(2, len(ends) - 1)
        summary = {
            "final_version": self.step,
            "trainer_checksum": trainer_sum,
            "engines": engines,
            "final_engine_version": min((v["version"] for v in engines.values()), default=-1),
            "checksums_match": all(
                v["checksum"] == trainer_sum for v in engines.values() if v["checksum"] is not None
            ),
            "steps_per_s": (len(ends) - 1 - warm) / (ends[-1] - ends[warm]) if len(ends) > warm + 1 else 0.0,
            "weight_bytes": self.syncer.plan.nbytes,
            "weight_buckets": len(self.syncer.plan.buckets),
            "bucket_bytes": self.syncer.bucket_bytes,
            "memory_per_rank": memory,
            "weight_sync": self.syncer.metrics(),
        }
        with open(os.path.join(self.job_config.job.dump_folder, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if not summary["checksums_match"]:
            logger.error(f"engine weights differ from the trainer's after the final sync: {engines}")

    def _export_final(self) -> None:
        out = os.path.join(self.job_config.job.dump_folder, "hf_final")
        export_hf_weights(self.model, out, self.model_args, self.job_config.model.hf_assets_path)
        if self.rank == 0:
            logger.info(f"final policy exported to {out}")

    # ----------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        rollouts = [b""]
        if self.scheduler is not None:  # rank 0 (called on save and load; on load nothing is in flight)
            rollouts[0] = pickle.dumps(self.scheduler.state_dict(self.job_config.weight_sync.timeout_seconds))
        if self.world > 1:  # every rank saves the same value, whichever one the checkpoint writer keeps
            dist.broadcast_object_list(rollouts, src=0)
        return {
            **super().state_dict(),
            "rng": torch.get_rng_state(),
            "discarded_rollouts": self.discarded_rollouts,
            "async_ratio": self.async_ratio,
            "force_sync": self.force_sync,
            "admit_carry": self.admit_carry,
            "controller": self.controller.state_dict() if self.controller else {},
            "rollouts": rollouts[0],  # finished rollouts of later steps (async); pickled: their sizes vary
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


def _pad_id(tokenizer) -> int:
    pad = tokenizer.tokenizer.token_to_id("<|pad|>") if hasattr(tokenizer, "tokenizer") else None
    return 0 if pad is None else pad


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
