"""Engine placement (finding 9): every engine and launched server gets its own GPU, validated before any work."""

from __future__ import annotations

import pytest

from torchtitan_flux.errors import ConfigError
from torchtitan_flux.rollout.placement import engine_devices, visible_devices_env


def place(requested=(), n=2, gpu=True, visible=4, local_world=1):
    return engine_devices(list(requested), n, trainer_on_gpu=gpu, visible=visible, local_world=local_world)


def test_cpu_trainer_keeps_engines_on_cpu():
    assert place(gpu=False, visible=0) == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match=r"rollout.engine_devices: the trainer runs on CPU"):
        place(["cuda:1", "cuda:2"], gpu=False, visible=0)


def test_auto_gives_each_engine_its_own_gpu_after_the_trainers():
    assert place(n=3, visible=4) == ["cuda:1", "cuda:2", "cuda:3"]  # not every engine on cuda:{LOCAL_WORLD_SIZE}
    assert place(n=2, visible=4, local_world=2) == ["cuda:2", "cuda:3"]


def test_full_node_is_refused_before_any_work_with_the_field_named():
    with pytest.raises(ConfigError, match=r"^rollout.engine_devices: 1 engine\(s\) need cuda:8..cuda:8 .* only 8"):
        place(n=1, visible=8, local_world=8)


@pytest.mark.parametrize("devices, why", [
    (["cuda:1"], "1 entries for 2 engines"),
    (["cuda:1", "gpu1"], "'gpu1' is not a device"),
    (["cuda:1", "cuda:9"], "cuda:9 is not visible"),
    (["cuda:0", "cuda:1"], "cuda:0 is trainer rank 0's GPU"),
    (["cuda:1", "cuda:1"], "two engines on one GPU"),
])
def test_explicit_devices_are_validated(devices, why):
    with pytest.raises(ConfigError, match=f"^rollout.engine_devices: .*{why}|^rollout.engine_devices has {why}"):
        place(devices)


def test_explicit_devices():
    assert place(["cuda:3", "cpu"]) == ["cuda:3", "cpu"]


def test_launched_server_sees_only_its_gpu():
    assert visible_devices_env("cuda:2", None) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert visible_devices_env("cuda:1", "4,5,6") == {"CUDA_VISIBLE_DEVICES": "5"}  # through the parent's mask
    assert visible_devices_env("cpu", "0") == {}
