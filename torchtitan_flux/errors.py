"""Every failure the run reports as one line (``train.py``'s report): bad input, user code, engines, weight sync,
the run's own files, signals. A leaf: it imports nothing, so every layer may raise these."""


class ConfigError(ValueError):
    """A bad config value. The message names the field (``section.field``) and the allowed values."""


class TorchtitanVersionError(RuntimeError):
    """The installed torchtitan is not the one torchtitan_flux is written for; the message names both and the fix."""


class NoEngineLeft(RuntimeError):
    """Every rollout engine is gone. Raised between steps, so the trainer's state can be checkpointed."""


class RolloutWaitInterrupted(Exception):
    """``interrupt()`` was called while ``collect`` waited: the step is not trained on (the trainer's state is
    that of its last completed step; the rollouts in flight stay dispatched)."""


class EngineStartError(RuntimeError):
    """The server cannot serve as a rollout engine; the message names the server and what is wrong."""


class RewardError(ValueError):
    """A reward function failed or returned a bad value; the message names it (and the sample when known)."""


class NcclVersionMismatch(RuntimeError):
    """Rule 7: the two sides of a weight-sync group run different NCCL versions (no retry: it cannot succeed)."""


class ProbeMismatch(RuntimeError):
    """An engine's logprobs differ from the trainer's beyond tolerance: it does not serve the pushed policy."""


class MetricsWriteError(RuntimeError):
    """``metrics.jsonl`` or ``completions.jsonl`` cannot be written (a full disk, a folder gone): the run stops,
    checkpointing the step it just trained, instead of training on without a record."""


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT during training. An ``Exception`` (not ``SystemExit``) so that torchtitan's ``main``
    calls ``trainer.close()``, which stops the engines, before the process exits non-zero."""

    def __init__(self, message: str, at_step_boundary: bool):
        super().__init__(message)
        self.at_step_boundary = at_step_boundary


class LossNotFinite(RuntimeError):
    """The loss (or the gradient norm) of a step is NaN or infinite: the run stops before the optimizer applies it,
    so the last completed step's weights (and its checkpoint) are intact."""


class UserCodeError(RuntimeError):
    """User code failed mid-run: a step callback raised or called ``sys.exit()``, a task made a prompt it may
    not (a budget above ``rollout.max_new_tokens``), or an environment raised, hung or returned the wrong type; the
    message names it and what it did."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only folder, a folder gone): the run stops with one
    line naming it and the fix for its cause; the previous complete checkpoint is what a resume loads (the torn
    one has no ``.metadata``)."""
