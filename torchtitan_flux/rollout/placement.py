"""Engine placement: which device each rollout engine (embedded, or a server started by ``rollout.launch``) gets.

Decided once on rank 0 before any engine starts: ``rollout.engine_devices`` as given (validated against the visible
GPUs and the trainer's local ones), else engine i on ``cuda:{LOCAL_WORLD_SIZE + i}``, or on "cpu" when the trainer
is. A launched server sees only its own GPU (``visible_devices_env``), as ``cuda:0``.
"""

from __future__ import annotations

import re

from torchtitan_flux.errors import ConfigError

_DEVICE = re.compile(r"cpu|cuda:(\d+)")


def engine_devices(requested: list[str], n_engines: int, *, trainer_on_gpu: bool, visible: int,
                   local_world: int) -> list[str]:
    """The device of each of ``n_engines`` engines, or a ``ConfigError`` naming ``rollout.engine_devices``."""
    for d in requested:
        if not _DEVICE.fullmatch(d):
            raise ConfigError(f"rollout.engine_devices: {d!r} is not a device; allowed: 'cpu' | 'cuda:N'")
    if requested and len(requested) != n_engines:
        raise ConfigError(f"rollout.engine_devices has {len(requested)} entries for {n_engines} engines; give one "
                          "device per engine")
    if not trainer_on_gpu:
        if any(d != "cpu" for d in requested):
            raise ConfigError("rollout.engine_devices: the trainer runs on CPU (no GPU visible); engines must be 'cpu'")
        return ["cpu"] * n_engines
    if requested:
        devices = list(requested)
    else:
        devices = [f"cuda:{local_world + i}" for i in range(n_engines)]
        if local_world + n_engines > visible:
            raise ConfigError(
                f"rollout.engine_devices: {n_engines} engine(s) need cuda:{local_world}..cuda:{local_world + n_engines - 1}"
                f" after the {local_world} trainer GPU(s), but only {visible} GPU(s) are visible; list the devices "
                "in rollout.engine_devices (e.g. [\"cpu\"]) or lower rollout.num_engines")
    gpus = [int(m.group(1)) for d in devices if (m := _DEVICE.fullmatch(d)) and m.group(1) is not None]
    for g in gpus:
        if g >= visible:
            raise ConfigError(f"rollout.engine_devices: cuda:{g} is not visible ({visible} GPU(s): cuda:0..cuda:"
                              f"{visible - 1})")
        if g < local_world:
            raise ConfigError(f"rollout.engine_devices: cuda:{g} is trainer rank {g}'s GPU; give engines their own")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"rollout.engine_devices: {devices} puts two engines on one GPU; give each its own")
    return devices


def visible_devices_env(device: str, parent: str | None) -> dict[str, str]:
    """Environment for a launched server that must use only ``device`` ("cuda:N"; {} for "cpu")."""
    m = _DEVICE.fullmatch(device)
    if m is None or m.group(1) is None:
        return {}
    index = int(m.group(1))
    if parent:
        ids = [x.strip() for x in parent.split(",") if x.strip()]
        return {"CUDA_VISIBLE_DEVICES": ids[index]}
    return {"CUDA_VISIBLE_DEVICES": str(index)}
