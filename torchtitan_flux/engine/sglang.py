"""``SglangEngine``: the rollout-engine handler for an SGLang (0.5.23) server (endpoints: docs/engines.md; source:
``sglang/srt/entrypoints/http_server.py`` and ``managers/io_struct.py``). Start one with
``scripts/launch_sglang.sh MODEL_DIR PORT`` (GPU only: SGLang has no CPU build on PyPI).

* generation: one ``input_ids`` list per completion (each prompt repeated ``group_size`` times), seeds
  ``seed + sample``. Log-probs are ``log_softmax(logits / T)`` unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set.
* weights: SGLang joins the group with its own ``init_custom_process_group`` (``group_store`` matches its store
  prefixes); each bucket travels as ONE uint8 tensor (``flattened_bucket``, no header). No checksum of the
  received bytes: ``checksum`` is ``HttpEngine``'s (version, None).
* the shared token: SGLang's own ``--api-key`` guards every endpoint but ``/health*`` and ``/metrics*``; with no
  rendezvous handshake (SGLang's own code joins), the API key is what keeps others from joining.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import torch

from torchtitan_flux.errors import EngineStartError
from torchtitan_flux.engine.base import GenerationRequest, WeightGroupInfo
from torchtitan_flux.engine.http import HttpEngine
from torchtitan_flux.engine.http_client import HttpError


class SglangEngine(HttpEngine):
    kind = "SGLang"
    launch_hint = "Start one with scripts/launch_sglang.sh MODEL_DIR PORT (needs a CUDA GPU)."
    rendezvous_handshake = False  # SGLang joins with its own code (see the module docstring)
    # SGLang 0.5.23 joins lazily: weight_updater.init_weights_update_group calls init_custom_process_group without
    # device_id, so its NCCL communicator is created in its first broadcast; an eager rank 0 would wait for it
    eager_connect = False
    accepts_patches = False  # SGLang loads whole tensors (update_weights_from_distributed): sparse pushes go dense

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._group: str | None = None  # the group the server holds for us
        self._group_names: dict[str, str] = {}  # our store prefix -> SGLang group name

    def _check_server(self) -> None:
        self.checks.reachable()
        info = self.client.get("/model_info")
        if not info.get("is_generation", True):
            raise EngineStartError(f"{self.name}: the SGLang server at {self.url} serves a non-generation model")
        self.checks.config(info, ("architectures", "model_type"), f"serving {info.get('model_path')}")
        server = self.client.get("/server_info")
        for key in ("tp_size", "dp_size", "pp_size"):
            if int(server.get(key) or 1) != 1:
                raise EngineStartError(f"{self.name}: the SGLang server at {self.url} has {key} = "
                                       f"{server.get(key)}; weight sync supports 1 (run more servers instead)")
        try:
            row = self.client.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 100000},
                                   idempotent=True)
        except HttpError as e:
            if e.status == 404:
                raise EngineStartError(f"{self.name}: the SGLang server at {self.url} has no weight-update endpoints "
                                       "(POST /get_weights_by_name -> 404); use SGLang >= 0.5.23") from e
            raise
        if isinstance(row, dict):
            row = row.get("parameter", row)
        self.checks.config({"hidden_size": len(row)}, ("hidden_size",), "model.norm.weight")
        self.checks.tokenizer(lambda text: self.client.post(
            "/tokenize", {"prompt": text, "add_special_tokens": False}, idempotent=True)["tokens"])

    def _generate(self, req: GenerationRequest, version: int) -> list[tuple[list[int], list[float]]]:
        G = req.group_size
        input_ids = [p for p in req.prompt_ids for _ in range(G)]
        top_k = {"top_k": req.top_k} if req.top_k > 0 else {}
        params = [{"max_new_tokens": req.max_new_tokens, "temperature": req.temperature,
                   "sampling_seed": req.seed + i % G, **top_k} for i in range(len(input_ids))]
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "stream": False}
        out = self.client.post("/generate", body, idempotent=True)  # generation has no side effects
        if isinstance(out, dict):
            out = [out]
        completions = []
        for o in out:
            triples = o["meta_info"]["output_token_logprobs"]
            ids = [int(t[1]) for t in triples]
            if "output_ids" in o and list(o["output_ids"]) != ids:
                raise RuntimeError("output_ids and output_token_logprobs disagree")
            completions.append((ids, [float(t[0]) for t in triples]))
        return completions

    def _score(self, tokens: list[int]) -> list[float]:
        """Input-token logprobs (``logprob_start_len: 0``; the first token has none)."""
        body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, "stream": False}
        out = self.client.post("/generate", body, idempotent=True)
        if isinstance(out, list):
            out = out[0]
        return [float(t[0]) for t in out["meta_info"]["input_token_logprobs"][1:]]

    def join_weight_group(self, info: WeightGroupInfo) -> None:
        # a fresh group name per join: SGLang refuses one it holds, and it outlives runs (whose prefixes repeat)
        self._group_names[info.prefix] = f"{info.prefix}#{uuid.uuid4().hex[:12]}"
        super().join_weight_group(info)

    def group_store(self, store: Any, info: WeightGroupInfo) -> Any:
        """The store prefixes of SGLang's side of the group: ``PrefixStore(group_name)``, then torch's
        ``_new_process_group_helper`` adds ``"{group_name}/"`` and ``"{device}/"``."""
        from torch.distributed.distributed_c10d import Backend, BackendConfig

        device_map = BackendConfig(Backend(info.backend)).get_device_backend_map()
        if len(set(device_map.values())) != 1:
            raise ValueError(f"{self.name}: mixed-backend weight-sync groups are not supported ({device_map})")
        device = next(iter(device_map))
        name = self._group_names[info.prefix]
        base = torch.distributed.PrefixStore(f"{name}/", torch.distributed.PrefixStore(name, store))
        return torch.distributed.PrefixStore(f"{device}/", base)

    def wire_tensors(self, header: torch.Tensor, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [f.view(torch.uint8) for f in flats]  # flattened_bucket receives raw bytes; no push header

    def _init_group(self, info: WeightGroupInfo) -> None:
        old, self._group = self._group, self._group_names[info.prefix]
        if old is not None:
            with contextlib.suppress(HttpError):  # a broken group may already be gone
                self.client.post("/destroy_weights_update_group", {"group_name": old})
        init = {"master_address": info.host, "master_port": info.port, "rank_offset": 1, "world_size": 2,
                "group_name": self._group, "backend": info.backend}
        self.client.post("/init_weights_update_group", init, timeout_s=self._weight_timeout_s)

    def _pause(self) -> None:
        self.client.post("/pause_generation", {"mode": "retract"})

    def _open(self, version: int) -> None:
        self.client.post("/begin_weight_update", {"selector": "all"})

    def _send_bucket(self, i, n, names, dtypes, shapes, version) -> None:
        last = i == n - 1
        update = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self._group, "flush_cache": last,
                  "abort_all_requests": False, "weight_version": str(version) if last else None,
                  "load_format": "flattened_bucket"}
        self.client.post("/update_weights_from_distributed", update, timeout_s=self._weight_timeout_s)

    def _close(self, version: int) -> None:
        self.client.post("/end_weight_update", {})

    def _resume(self) -> None:
        self.client.post("/continue_generation", {})

    def weight_version(self) -> str | None:
        return self.client.get("/model_info").get("weight_version")
