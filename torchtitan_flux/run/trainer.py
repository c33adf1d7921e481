"""``GRPOTrainer``: torchtitan's ``Trainer`` turned into a GRPO trainer fed by rollout engines.

Model construction, FSDP2, optimizers, LR schedulers, gradient clipping, ``CheckpointManager`` and the entry point
are torchtitan's, used as they are; we replace the data path (rollouts, ``BatchFeed``), the loss (``rl/loss.py``)
and the step loop (``train_step_grpo``; policy version = optimizer steps done = ``self.step``), and add engines,
weight sync and metrics.

Simplifications: one optimizer step per batch (so the "proximal" policy of decoupled PPO is the current one,
detached); no pipeline parallelism. ``backward_on_batch`` runs its own micro-batch loop instead of torchtitan's
``forward_backward_step`` (whose loss takes one label tensor), keeping its ``train_context`` and the ``profiler``.
Mixed precision is FSDP2's policy (``training.mixed_precision_param``), which torchtitan applies on one rank too.

torchtitan's ``Trainer`` always builds a dataloader and a loss: ours are placeholders (``RolloutFed``,
``GRPOLossSlot``) that the step loop never calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import BaseLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from torchtitan_flux import config as flux_config

from torchtitan_flux.run import report, resume
from torchtitan_flux.run.config_file import LEGACY
from torchtitan_flux.rl.off_policy import OffPolicyControl
from torchtitan_flux.errors import ConfigError
from torchtitan_flux.engine.kinds import engine_kind
from torchtitan_flux.rollout.evaluation import Evaluator
from torchtitan_flux.rl.feed import BatchFeed
from torchtitan_flux.rollout.rollouts import Rollouts
from torchtitan_flux.run.threads import TrainerThreads, every_block
from torchtitan_flux.models.hf_weights import build_reference_model, export_hf_weights, load_hf_weights
from torchtitan_flux.errors import CheckpointWriteError, MetricsWriteError
from torchtitan_flux.run.metrics import MetricsWriter
from torchtitan_flux.run.preflight import preflight
from torchtitan_flux.sync.probe import PostSyncProbe, probe_tokens
from torchtitan_flux.errors import RewardError
from torchtitan_flux.errors import NoEngineLeft, RolloutWaitInterrupted
from torchtitan_flux.rollout.batch import RolloutBatch
from torchtitan_flux.run.checkpoint_state import CheckpointState
from torchtitan_flux.run.episode_checks import EpisodeWarnings, episode_metrics
from torchtitan_flux.models.hf import tokenizer_settings
from torchtitan_flux.errors import LossNotFinite, TrainingInterrupted
from torchtitan_flux.run.stops import StopRequests, die_with_launcher, settle_and_checkpoint
from torchtitan_flux.rl.controller import StalenessSample
from torchtitan_flux.rl.gradient import backward_on_batch
from torchtitan_flux.errors import UserCodeError
from torchtitan_flux.user_code import import_spec, step_callback
from torchtitan_flux.sync.syncer import WeightSyncer, control_group

logger = logging.getLogger("torchtitan_flux")


def _with_fields_of(base: type, additions: type) -> type:
    """``base`` (a torchtitan component's ``Config``) with the fields of ``additions`` (ours, in ``config.py``, where
    their docstrings are) added: the component builds as before and ignores them."""
    hints = typing.get_type_hints(additions)
    fields = [(f.name, hints[f.name], field(default=f.default) if f.default_factory is dataclasses.MISSING
               else field(default_factory=f.default_factory)) for f in dataclasses.fields(additions)]
    return dataclasses.make_dataclass(base.__qualname__, fields, bases=(base,), kw_only=True, slots=True,
                                      namespace={"__module__": __name__})


MetricsConfig = _with_fields_of(MetricsProcessor.Config, flux_config.MetricsAdditions)
CheckpointConfig = _with_fields_of(CheckpointManager.Config, flux_config.CheckpointAdditions)


class AdamOptimizers(OptimizersContainer):
    """torchtitan's optimizers with one parameter group, set by the ``[optimizer]`` fields of a TOML (0.3.0's own
    ``param_groups``, when given, are used as they are)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: typing.Literal["Adam", "AdamW"] = "AdamW"
        """Optimizer of every parameter."""

        lr: float = 8e-4
        """Learning rate (the peak of ``[lr_scheduler]``'s schedule)."""

        beta1: float = 0.9
        """Adam's first-moment decay."""

        beta2: float = 0.95
        """Adam's second-moment decay."""

        eps: float = 1e-8
        """Adam's epsilon."""

        weight_decay: float = 0.1
        """Weight decay (decoupled for AdamW)."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if not config.param_groups:
            config = dataclasses.replace(config, param_groups=[ParamGroupConfig(
                pattern=r".*", optimizer_name=config.name,
                optimizer_kwargs={"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
                                  "weight_decay": config.weight_decay})])
        super().__init__(config, model_parts=model_parts)


class RolloutFed(BaseDataLoader):
    """The dataloader torchtitan's ``Trainer`` builds: batches come from rollouts (``BatchFeed``), never from here."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, **_runtime: Any) -> None:
        self.config = config

    def __iter__(self):
        raise RuntimeError("GRPOTrainer's batches come from rollouts (BatchFeed), not from a dataloader")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class GRPOLossSlot(BaseLoss):
    """The loss torchtitan's ``Trainer`` builds: the GRPO loss is ``rl/loss.py``'s, called by ``backward_on_batch``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config: Config, *, compile_config=None) -> None:
        self.config = config

    def __call__(self, *args, **kwargs):
        raise RuntimeError("GRPOTrainer's loss is rl/loss.py's (backward_on_batch), not the Trainer's")


class GRPOTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config`` with our sections; ``run/config_file.py`` builds it from a TOML file."""

        hf_assets_path: str = ""
        """The HF model folder (``config.json``, safetensors, tokenizer): the policy's family, shapes and initial
        weights. TOML key ``model.hf_assets_path``."""

        parallelism: ParallelismConfig = field(
            default_factory=lambda: ParallelismConfig(spmd_backend="partial_dtensor"))
        """torchtitan's ``[parallelism]`` with ``spmd_backend = "partial_dtensor"`` by default (torchtitan 0.3.0's
        default ``"spmd_types"`` trains a model with tied embeddings wrong over two or more ranks: measured, see
        ``validation._check_parallelism``, which refuses that combination)."""

        grpo: flux_config.Grpo = field(default_factory=flux_config.Grpo)
        rollout: flux_config.Rollout = field(default_factory=flux_config.Rollout)
        weight_sync: flux_config.WeightSync = field(default_factory=flux_config.WeightSync)
        off_policy: flux_config.OffPolicy = field(default_factory=flux_config.OffPolicy)
        adaptive_async: flux_config.AdaptiveAsync = field(default_factory=flux_config.AdaptiveAsync)
        eval: flux_config.Eval = field(default_factory=flux_config.Eval)
        metrics: MetricsConfig = field(default_factory=MetricsConfig)
        checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
        optimizer: AdamOptimizers.Config = field(default_factory=AdamOptimizers.Config)
        dataloader: RolloutFed.Config = field(default_factory=RolloutFed.Config)
        loss: GRPOLossSlot.Config = field(default_factory=GRPOLossSlot.Config)

        def __getattr__(self, name: str) -> Any:
            """Called only for a missing attribute: 0.2.2's ``job`` and ``model`` sections (read by a user's task
            factory or callback) name where their fields went, in one line."""
            moved = [(key, field) for key, field in LEGACY.items() if key.split(".")[0] == name]
            if moved:
                raise AttributeError(f"config.{name} is gone with torchtitan 0.3.0: " + "; ".join(
                    f"read config.{field} (was config.{key})" for key, field in moved))
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __init__(self, config: Config):
        die_with_launcher()
        self.stops = StopRequests()
        pre = preflight(config)  # before torchtitan builds anything and before any spawn
        self.task, self.checkpoint_folder = pre.task, pre.checkpoint_folder
        self.threads = TrainerThreads(config)
        super().__init__(config)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.saver = resume.CheckpointSaver(self.checkpointer, pre.checkpoint_folder, pre.fingerprint, self.rank == 0)
        self.model = self.model_parts[0]
        try:  # a missing, truncated or mismatched weights file: one line naming it
            load_hf_weights(self.model, config.hf_assets_path, self.model_config)
        except (ValueError, OSError) as e:
            raise ConfigError(f"model.hf_assets_path = {config.hf_assets_path!r}: {e}") from None
        self.ref_model = None
        if config.grpo.kl_coef > 0:  # a frozen copy of the initial policy, built and sharded like it
            self.ref_model = build_reference_model(config.model_spec, self.parallel_dims, config, self.device)
        self.step_callbacks: list = []
        for spec in config.metrics.step_callbacks:  # checked by validate_config
            self.add_step_callback(import_spec("metrics.step_callbacks", spec), name=f"step callback {spec!r}")
        self.rollouts: Rollouts | None = None  # rank 0's rollout side; None on ranks > 0
        self.evaluator: Evaluator | None = None
        self.metrics_writer: MetricsWriter | None = None
        self._step_ends: list[float] = []
        self._stop_after_step: Exception | None = None  # rank 0, world > 1: see _agree_on_stop
        self.final_step = config.training.steps  # earlier once the task has finished (StepInput.last)
        self.off_policy = OffPolicyControl(config.off_policy, config.adaptive_async, config.weight_sync,
                                           config.training.steps,
                                           serial_engines=engine_kind(config.rollout.engine).serves_serially(
                                               config.rollout.continuous_batching))
        ws = config.weight_sync
        self.probe = PostSyncProbe(
            probe_tokens(self.tokenizer, self.model_config.vocab_size, config.training.seq_len), ws.probe_tolerance,
            ws.probe_every, ws.timeout_seconds,
        ) if ws.probe_every > 0 else None
        self.memory = {"rss_before_sync_mb": report.rss_mb()}
        if self.rank == 0:  # starts the engines and builds the syncer it delivers their events to
            self.rollouts = Rollouts.start(config, self.task, self.tokenizer, self.model, device=self.device,
                                      stops=self.stops)
            self.syncer = self.rollouts.syncer
            if self.threads.borrowing:
                every_block(self.model, self._before_compute)
            if self.world == 1:
                self.stops.interrupt_rollout_waits_of(self.rollouts)
        else:  # a bystander: takes part in every snapshot, sends nothing
            self.syncer = WeightSyncer(config.weight_sync, self.model, [], device=self.device, is_sender=False,
                                       backend="nccl" if self.device.type == "cuda" else "gloo")
        self.memory["rss_after_staging_mb"] = report.rss_mb()
        self.feed = BatchFeed(self.off_policy, self.rollouts, self.syncer, async_push=ws.async_weight_update,
                              last_step=config.training.steps, rank=self.rank, world=self.world)
        self.checkpoint_state = CheckpointState(self.off_policy, self.rollouts, self.task,
                                                config.rollout.prompts_per_step, pre.config_changes, self.stops,
                                                ws.timeout_seconds, self.world)
        if self.rank == 0:
            self.metrics_writer = MetricsWriter(
                config.dump_folder, config.training.steps,
                loggers=self.metrics_processor.logger, log_every=config.metrics.log_freq,
            )
            self.episode_warnings = EpisodeWarnings(
                config.rollout.max_new_tokens, config.training.seq_len,
                tokenizer_settings(config.hf_assets_path)["eos_token_ids"])
            if pre.eval_task is not None:
                self.evaluator = Evaluator(
                    config.eval, pre.eval_task, self.rollouts, self.tokenizer, config.rollout.seed,
                    config.dump_folder, wait=not config.weight_sync.async_weight_update,
                )

    def add_step_callback(self, fn, name: str | None = None) -> Any:
        """Register ``fn(step, metrics)`` or ``fn(result)``, called on rank 0 after every step; returns ``fn``. If it
        raises (or calls ``sys.exit()``) the run stops with one line naming it (``name``, else the function's own)."""
        self.step_callbacks.append(step_callback(fn, name or f"step callback {getattr(fn, '__qualname__', fn)!r}",
                                                 self.config.metrics.step_callback_timeout_seconds))
        return fn

    def train(self):
        jc = self.config
        resume.load(self.checkpointer, jc.checkpoint, self.checkpoint_folder, self.rank == 0)
        logger.info(f"Training starts at step {self.step + 1}")
        if self.rank == 0:
            self.syncer.connect()
        # torchtitan shortens the timeouts after step 1; its barrier + device synchronize would then wait for the
        # push in flight (GPU), so here they run before the first push, with no weight-sync work on the device
        dist_utils.set_pg_timeouts(timeout=timedelta(seconds=jc.comm.train_timeout_seconds),
                                   parallel_dims=self.parallel_dims)
        self.syncer.flush(self.step)  # engines start from the trainer's (possibly resumed) weights
        if self.evaluator is not None and jc.eval.at_start:
            self.evaluator.start(self.step)
            # a row of its own, before any training step: marked, so readers can tell it from the step rows
            self.metrics_writer.log(self.step, {"eval_only": True, **self.evaluator.collect(wait=True)}, progress=False)
        self.stops.training = True
        try:
            with jc.profiler.build(global_step=self.step, base_folder=jc.dump_folder) as profiler:
                while self.should_continue_training():
                    self.gc_handler.run(self.step + 1)
                    self.train_step_grpo()
                    profiler.step()
                    self.stops.raise_if_requested()
        except RolloutWaitInterrupted as e:  # the signal came while the next step waited for its rollouts
            self._save_on_stop(True, reason=str(e))
            raise TrainingInterrupted(f"received {self.stops.signal}", at_step_boundary=True) from None
        except (TrainingInterrupted, NoEngineLeft, LossNotFinite, RewardError, UserCodeError, MetricsWriteError) as e:
            # a reward function's failure or deadline, a step callback's or the metrics file's: like a lost engine
            signalled = isinstance(e, TrainingInterrupted) or self.stops.signal is not None
            try:
                self._save_on_stop(getattr(e, "at_step_boundary", True),
                                   reason=f"received {self.stops.signal}" if signalled else str(e))
            except CheckpointWriteError as save_error:  # the same full disk, say: one line with both causes
                raise CheckpointWriteError(f"{e}; then {save_error}") from None
            if isinstance(e, NoEngineLeft) and signalled:  # the signal killed the engines too: say the cause
                raise TrainingInterrupted(f"received {self.stops.signal}", at_step_boundary=True) from None
            raise
        finally:
            if self.rank == 0 and self.rollouts is not None:
                self.rollouts.drain(timeout=1.0)
        self._finish()

    def _before_compute(self) -> None:
        """Rank 0, before each transformer block's forward and backward (``every_block``, borrowing only: CPU, the
        main thread) and the optimizer step: the threads of the computation about to run (``TrainerThreads``). No
        rollout work runs here: episodes send their own turns (``rollout/pump.py``)."""
        self.threads.before_compute(self.rollouts)

    def train_step_grpo(self) -> None:
        """One step, all ranks: batch, GRPO update, controller, push, probe, checkpoint, evaluation, metrics."""
        jc = self.config
        t0 = time.perf_counter()
        fed = self.feed.next(self.step + 1, self.step)
        last = fed.last
        self._before_compute()  # the next steps' requests just went out: their cores come back
        self.step += 1
        t1 = time.perf_counter()
        metrics, staleness = self.train_on(fed.batch)
        metrics.update(self.off_policy.control(self.step, staleness))
        t2 = time.perf_counter()
        self.syncer.after_optimizer_step(self.step, due=fed.push_due)
        t3 = time.perf_counter()
        if self.rank == 0:
            metrics.update(self.off_policy.after_push(fed, t2 - t1, t3 - t2, self.syncer.stats.push_s_total))
        if self.probe is not None and (self.probe.due(self.step, jc.training.steps) or last):
            self.syncer.flush(self.step)  # the engines must hold this step's weights
            engines = [e for e in self.rollouts.engines if e.alive()] if self.rank == 0 else []
            metrics.update(self.probe.run(self.model, engines, self.step, self.device))
        if self.saver.save(self.step, last) and self.checkpointer.async_mode == AsyncMode.DISABLED:
            logger.info(f"checkpoint of step {self.step} saved")  # an async one: when written (saver.poll)
        if self.evaluator is not None:
            metrics.update(self.evaluator.after_step(self.step, self.syncer.version, last))
        if self.rank == 0:
            try:
                self.saver.poll()
                self._log(fed.batch, metrics, report.StepTimes(t0, t1, t2, t3, fed.wait_s))
            except (CheckpointWriteError, UserCodeError, MetricsWriteError) as e:
                if self.world == 1:
                    raise
                self._stop_after_step = e
            self._step_ends.append(time.perf_counter())
        self._agree_on_stop()
        if last and self.step < jc.training.steps:
            logger.info(f"the task finished at step {self.step} (Task.finished): training ends here")
            self.final_step = self.step

    def should_continue_training(self) -> bool:
        return self.step < self.final_step

    def _agree_on_stop(self) -> None:
        """With several ranks: rank 0's reason to stop after this step (a step callback's error, a metrics file
        that cannot be written) reaches every rank, which all raise it, instead of the others going on into a
        collective rank 0 never joins. One small broadcast per step on the CPU control group."""
        if self.world == 1:
            return
        obj = [self._stop_after_step]
        dist.broadcast_object_list(obj, src=0, group=control_group())
        if obj[0] is not None:
            raise obj[0]

    def _save_on_stop(self, at_step_boundary: bool, reason: str) -> None:
        """Graceful stop (a signal, or no rollout engine left): ``stops.settle_and_checkpoint``."""
        logger.warning(f"interrupted after step {self.step} ({reason}); stopping")
        wait = self.stops.wait_s(self.config.weight_sync.timeout_seconds)
        can_save = at_step_boundary and self.world == 1 and self.config.checkpoint.enable and self.step > 0
        save = partial(self.saver.save_on_stop, self.step)
        settle_and_checkpoint(self.syncer, wait, save if can_save else None, self.step)

    def _finish(self) -> None:
        """After the last step: final push, summary (rank 0), HF export."""
        self.syncer.flush(self.step)
        memory = report.memory_per_rank(self.memory, self.world)  # before the export gathers the model
        out = os.path.join(self.config.dump_folder, "hf_final")
        export_hf_weights(self.model, out, self.model_config, self.config.hf_assets_path)
        if self.rank == 0:
            logger.info(f"final policy exported to {out}")
            probed = self.probe.confirmed_version if self.probe is not None else -1
            content = report.summary(self.step, self.syncer, self.rollouts.engines, probed, self._step_ends, memory)
            report.write_summary(self.config.dump_folder, content)

    def train_on(self, batch: RolloutBatch) -> tuple[dict[str, float], StalenessSample]:
        """One GRPO optimizer step on ``batch`` (all ranks): gradients, clipping, step; its metrics and staleness."""
        jc = self.config
        self.optimizers.zero_grad()
        grad = backward_on_batch(
            self.model, self.ref_model, batch, jc.grpo, trained_steps=self.step - 1, rank=self.rank,
            world=self.world, micro_batch=jc.training.local_batch_size, device=self.device,
            train_context=self.train_context,
        )
        loss_total, num_tokens = grad.loss, grad.num_tokens
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
        self._before_compute()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.ntokens_seen += int(num_tokens)

        reduced = grad.reduce(self.world)
        return {"loss": reduced.loss, **reduced.means, "grad_norm": grad_norm.item(), **self.threads.step_metrics(),
                "zero_variance_groups": grad.zero_variance_groups,
                "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0]}, reduced.staleness

    def _log(self, batch: RolloutBatch, m: dict, times: report.StepTimes) -> None:
        counters = dict(discarded_rollouts=self.off_policy.discarded_rollouts, **self.rollouts.metrics(),
                        **self.syncer.metrics())
        if batch.episodes:
            episodes = episode_metrics(batch.episodes)
            self.episode_warnings.check(self.step, batch.episodes, episodes)
            m = {**m, **episodes}
        m = report.step_row(self.step, batch, times, counters, m)
        self.metrics_writer.log(self.step, m)
        every = self.config.metrics.log_completions_every
        if every and self.step % every == 0:
            self.metrics_writer.log_completions(self.step, batch, self.config.grpo.group_size)
        for fn in self.step_callbacks:
            fn(self.step, m)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.checkpoint_state.state_dict(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.checkpoint_state.load_state_dict(state_dict, self.step)

    def close(self) -> None:
        if getattr(self, "rollouts", None) is not None:  # rank 0: its syncer, engines and servers
            self.rollouts.close()
        elif getattr(self, "syncer", None) is not None:
            self.syncer.close()
        if getattr(self, "metrics_writer", None) is not None:
            self.metrics_writer.close()
        super().close()
