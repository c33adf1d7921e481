"""``VllmEngine``: the rollout-engine handler for a vLLM (>= 0.32) OpenAI-compatible server (endpoints:
docs/engines.md; the server side: ``engine/vllm_ext.py``). Start one with ``scripts/launch_vllm.sh MODEL_DIR PORT``,
or let the trainer launch it (``engine/vllm_launch.py``).

Generation: vLLM gives sample ``j`` the seed ``seed + j``; greedy requests, where vLLM refuses n > 1, repeat each
prompt instead. Log-probs are ``log_softmax(logits / T)`` (``--logprobs-mode processed_logprobs``); with
``top_k > 0`` vLLM reports them under the top-k-truncated distribution, not the full tempered one the embedded
engine reports.

In-flight updates (``in_flight``, ``rollout.in_flight_weight_updates``): a push pauses with ``mode=keep`` and
``clear_cache=false`` (vLLM 0.32: the scheduler stops stepping, running requests stay scheduled with their KV
cache, new ones queue; ``clear_cache`` would preempt the running requests and drop their KV), updates, and
``/resume`` lets them continue on the new weights (their earlier tokens' KV stays the old weights').

Prefix cache: every request salts it with its version stamp (``cache_salt``, in-flight updates or not), so a request
never reuses blocks computed on other weights. The ``/reset_prefix_cache`` after a push only frees the old blocks
early: vLLM answers ``{"success": false}`` while any block is held (requests frozen by an in-flight push; async KV
offload after a drain), and its result is not needed (fifth review, finding 19: the salt was chosen over
retrying the reset, which could wait without bound on blocks someone else holds, and costs nothing: after a push
no block of the old weights may be reused anyway).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torchtitan_flux.errors import EngineStartError
from torchtitan_flux.engine.base import GenerationRequest, WeightGroupInfo
from torchtitan_flux.engine.http import HttpEngine, HttpOptions
from torchtitan_flux.engine.http_client import HttpError
from torchtitan_flux.engine.vllm_launch import EXTENSION

logger = logging.getLogger("torchtitan_flux")

CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "tie_word_embeddings")


@dataclass
class VllmOptions(HttpOptions):
    """``HttpOptions`` plus the sampled checksums: the server hashes every ``verify_every``-th push (0: none) and
    the final one, ``final_version`` (hashing copies the whole model to the host, so it is sampled); and
    ``in_flight``: pushes land while generations run (``rollout.in_flight_weight_updates``; the module docstring)."""

    verify_every: int = 1
    final_version: int = -1
    in_flight: bool = False


class VllmEngine(HttpEngine):
    kind = "vLLM"
    launch_hint = "Start one with scripts/launch_vllm.sh MODEL_DIR PORT."
    expected_backends = ("gloo",)  # the server's transfer engine: our gloo one (GPU: engine/vllm_nccl.py)

    Options = VllmOptions

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.served_model: str | None = None
        self.in_flight = self.options.in_flight

    def _check_server(self) -> None:
        self.checks.reachable()
        models = self.client.get("/v1/models")["data"]
        if not models:
            raise EngineStartError(f"{self.name}: the vLLM server at {self.url} serves no model")
        self.served_model = models[0]["id"]
        try:
            self.client.get("/weight_info")
        except HttpError as e:
            if e.status == 404:
                raise EngineStartError(f"{self.name}: the vLLM server at {self.url} has no RL weight-update "
                                       "endpoints (GET /weight_info -> 404). Start it with VLLM_SERVER_DEV_MODE=1, "
                                       f"--worker-extension-cls {EXTENSION} and --weight-transfer-config "
                                       "(scripts/launch_vllm.sh does).") from e
            raise
        try:
            info = self.client.post("/collective_rpc", {"method": "flux_model_info"}, idempotent=True)["results"][0]
        except HttpError as e:
            raise EngineStartError(f"{self.name}: the vLLM server at {self.url} does not have our worker extension "
                                   f"({e.detail[:200]}). Start it with --worker-extension-cls {EXTENSION} "
                                   "(scripts/launch_vllm.sh does).") from e
        self._check_transfer(info)
        if info.get("world_size") != 1:
            raise EngineStartError(f"{self.name}: the vLLM server at {self.url} runs {info.get('world_size')} "
                                   "workers; weight sync supports tensor/pipeline/data parallel size 1 per server "
                                   "(run more servers instead)")
        self.checks.config(info["hf_config"], CONFIG_KEYS, f"serving {info.get('model')}")
        self.checks.tokenizer(lambda text: self.client.post(
            "/tokenize", {"model": self.served_model, "prompt": text, "add_special_tokens": False}, idempotent=True,
        )["tokens"])

    def _check_transfer(self, info: dict) -> None:
        """The server's weight-transfer engine (``flux_model_info``) is one this handler drives."""
        if info.get("transfer_backend") not in self.expected_backends:
            raise EngineStartError(f"{self.name}: the vLLM server at {self.url} has weight-transfer engine "
                                   f"{info.get('transfer_engine')!r}, not one of ours. Start it with "
                                   "--weight-transfer-config '{\"backend\":\"gloo\"}' (CPU) or "
                                   "'{\"backend\":\"nccl\"}' (GPU, vLLM's own engine).")

    def _generate(self, req: GenerationRequest, version: int) -> list[tuple[list[int], list[float]]]:
        greedy = req.temperature == 0  # vLLM refuses n > 1 with greedy sampling: repeat the prompts instead
        prompts = [p for p in req.prompt_ids for _ in range(req.group_size)] if greedy else req.prompt_ids
        body: dict[str, Any] = {
            "model": self.served_model, "prompt": prompts, "n": 1 if greedy else req.group_size,
            "max_tokens": req.max_new_tokens, "temperature": req.temperature, "top_p": 1.0, "seed": req.seed,
            "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True, "skip_special_tokens": False,
        }
        if req.top_k > 0:
            body["top_k"] = req.top_k
        body["cache_salt"] = f"flux-v{version}"  # blocks of other weights are never reused (the module docstring)
        out = self.client.post("/v1/completions", body, idempotent=True)  # generation has no side effects
        choices = sorted(out["choices"], key=lambda c: c["index"])
        completions = []
        for c in choices:
            lp = c["logprobs"]
            ids = c.get("token_ids")
            if ids is None:
                ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            completions.append((list(ids), [float(x) for x in lp["token_logprobs"]]))
        return completions

    def _score(self, tokens: list[int]) -> list[float]:
        """Prompt logprobs (each prompt token's own; temperature 1, so processed == raw)."""
        body = {"model": self.served_model, "prompt": [tokens], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "cache_salt": f"flux-v{self._gate.version}"}
        rows = self.client.post("/v1/completions", body, idempotent=True)["choices"][0]["prompt_logprobs"]
        return [float(row[str(t)]["logprob"]) for row, t in zip(rows[1:], tokens[1:])]

    def hashes(self, version: int) -> bool:
        """Whether the server hashes the push of ``version`` (``weight_sync.verify_every``; always the final one)."""
        every, final = self.options.verify_every, self.options.final_version
        return every > 0 and (version % every == 0 or 0 <= final <= version)

    def _init_group(self, info: WeightGroupInfo) -> None:
        init = {
            "master_address": info.host, "master_port": info.port, "rank_offset": 1, "world_size": 2,
            "store_prefix": info.prefix, "backend": info.backend, "timeout_s": info.timeout_s,
            "checksum": self.options.verify_every > 0, "patches": info.patches,
        }
        self.client.post("/init_weight_transfer_engine", {"init_info": init}, timeout_s=self._weight_timeout_s)

    def _pause(self) -> None:
        params = {"mode": "keep", "clear_cache": "false"} if self.in_flight else {"mode": "wait"}
        self.client.post("/pause", params=params, timeout_s=self._weight_timeout_s)

    def _open(self, version: int) -> None:
        self.client.post("/start_weight_update")

    def _send_bucket(self, i, n, names, dtypes, shapes, version) -> None:
        update = {
            "names": names, "dtype_names": dtypes, "shapes": shapes, "bucket": i, "num_buckets": n,
            "version": version, "header_len": self._plan.header_len if i == 0 else 0,
            "checksum": self.hashes(version),
        }
        self.client.post("/update_weights", {"update_info": update}, timeout_s=self._weight_timeout_s)

    def _close(self, version: int) -> None:
        self.client.post("/finish_weight_update", {"weight_version": str(version)})
        self.client.post("/reset_prefix_cache")

    def _resume(self) -> None:
        self.client.post("/resume")

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        """(version of the last hashed push, sha256 of its buckets as received); (-1, None) before any push."""
        try:
            res = self.client.post("/collective_rpc", {"method": "flux_weights_checksum"}, timeout_s=timeout,
                                   idempotent=True)["results"][0]
        except HttpError as e:  # a dead server has no checksum; the summary must still be written
            logger.warning(f"{self.name}: no weights checksum: {e}")
            return self._gate.version, None
        return int(res["version"]), res["sha256"]

    def weight_version(self) -> str:
        """The version the server reports (``GET /weight_info``); ``str(version)`` after our pushes."""
        return self.client.get("/weight_info")["weight_version"]
