"""Post-sync logprob probe: does every engine serve the policy the trainer just pushed?

A checksum covers the bytes an engine received, not what it does with them (a wrong name, dropped tensor, untied
head, q/k layout or dtype all pass it). So every ``weight_sync.probe_every`` steps, once the engines hold the
step's version, each engine scores a fixed probe sequence (teacher-forced logprobs) and the trainer compares them
with its own model's; a difference above ``weight_sync.probe_tolerance`` raises ``ProbeMismatch``.

Concurrency: ``PostSyncProbe.run`` is called on every trainer rank (the forward is collective under FSDP) between
a step's push and the next step, so no push is in flight while an engine scores; only rank 0 talks to engines.
Simplification: logprobs are raw (temperature 1) on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from torchtitan_flux import compat
from torchtitan_flux.errors import ProbeMismatch

# digits, letters, punctuation and spaces
PROBE_TEXT = "Q: 12 + 35 = ? A: 47. The quick brown fox jumps over the lazy dog; 0123456789 xyz!"


@dataclass
class ProbeReport:
    engine: str
    version: int
    max_abs_diff: float
    worst_index: int  # position in the probe sequence of the worst token (>= 1)
    worst_token: int
    trainer_logprob: float
    engine_logprob: float


def probe_tokens(tokenizer, vocab_size: int, max_len: int, text: str = PROBE_TEXT) -> list[int]:
    """The fixed probe sequence: ``text`` through the run's tokenizer (with BOS when it adds one), ids < vocab,
    at most ``max_len`` tokens (the trainer's ``training.seq_len``: its RoPE table ends there)."""
    ids = tokenizer.encode(text)
    ids = [int(t) for t in ids if 0 <= int(t) < vocab_size][:max_len]
    if len(ids) < 2:
        raise ValueError(f"the probe text encodes to {len(ids)} token(s) below vocab_size {vocab_size}; need >= 2")
    return ids


def model_logprobs(model: torch.nn.Module, tokens: list[int], device: torch.device | str) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under ``model`` (float32, on the CPU). An FSDP2 model is
    resharded afterwards: a forward without backward leaves its root unsharded, which breaks the next checkpoint."""
    seq = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(seq)[0, :-1].float()
    fsdp_module = compat.FSDPModule
    if fsdp_module is not None:
        for m in model.modules():
            if isinstance(m, fsdp_module):
                m.reshard()
    return torch.log_softmax(logits, dim=-1).gather(-1, seq[0, 1:, None]).squeeze(-1).cpu()


def compare(engine: str, version: int, tokens: list[int], expected: torch.Tensor, got: list[float],
            tolerance: float) -> ProbeReport:
    """A ``ProbeReport``; ``ProbeMismatch`` when ``got`` differs from ``expected`` by more than ``tolerance``."""
    if len(got) != expected.numel():
        raise ProbeMismatch(f"probe: engine {engine} at version {version} returned {len(got)} logprobs for "
                            f"{expected.numel()} probe tokens")
    diff = torch.nan_to_num((torch.tensor(got, dtype=torch.float32) - expected).abs(), nan=float("inf"))
    i = int(diff.argmax())
    report = ProbeReport(engine, version, float(diff[i]), i + 1, tokens[i + 1], float(expected[i]), float(got[i]))
    if report.max_abs_diff > tolerance:
        raise ProbeMismatch(
            f"probe: engine {engine} at version {version} does not serve the trainer's policy: max |logprob "
            f"difference| {report.max_abs_diff:.4g} > weight_sync.probe_tolerance {tolerance:g}, worst at probe "
            f"token {report.worst_index} (id {report.worst_token}): trainer {report.trainer_logprob:.4f}, engine "
            f"{report.engine_logprob:.4f}. Wrong weight names/layout, a dropped tensor, an untied head or a "
            "different dtype on the engine side; an engine that computes in a lower precision than the trainer "
            "(weight_sync.wire_dtype = \"bfloat16\") differs by up to ~0.3 on a 30-layer model: raise "
            "weight_sync.probe_tolerance for it."
        )
    return report


class PostSyncProbe:
    """Runs the probe at a step: trainer logprobs, then each engine's, compared (see the module docstring)."""

    def __init__(self, tokens: list[int], tolerance: float, every: int, timeout_s: float):
        self.tokens = list(tokens)
        self.tolerance = float(tolerance)
        self.every = int(every)
        self.timeout_s = float(timeout_s)
        self.confirmed_version = -1  # newest version every live engine was probed at and matched (the summary's)

    def due(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def engine_logprobs(self, engine, version: int) -> tuple[int, list[float]]:
        """The engine's (version, logprobs) once it holds ``version``; past ``timeout_s``, (its version, [])."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            held, lps = engine.score(self.tokens, timeout=self.timeout_s)
            if held >= version or time.monotonic() > deadline:
                return held, lps
            time.sleep(0.02)

    def run(self, model: torch.nn.Module, engines: list, version: int, device) -> dict[str, float]:
        """Probe ``engines`` (rank 0's; empty elsewhere) at ``version``: this step's metrics, or ``ProbeMismatch``."""
        t0 = time.perf_counter()
        expected = model_logprobs(model, self.tokens, device)
        worst, checked = 0.0, 0
        for engine in engines:
            held, lps = self.engine_logprobs(engine, version)
            if held != version:  # lagging (or a newer push, which the caller rules out): nothing to compare
                continue
            report = compare(engine.name, version, self.tokens, expected, lps, self.tolerance)
            worst, checked = max(worst, report.max_abs_diff), checked + 1
        if not engines:
            return {}
        if checked == len(engines):
            self.confirmed_version = version
        return {"probe_max_abs_diff": worst, "probe_engines_checked": checked, "probe_s": time.perf_counter() - t0}
