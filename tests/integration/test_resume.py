"""Resume checks (``torchtitan_flux/run/resume.py``): the config fingerprint stored with each checkpoint and its
comparison, the refusal of ``training.steps`` below the checkpoint's step, and the fallback past an unreadable
newest checkpoint. The end-to-end test runs them through the real command."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, read_metrics, run_train, torchrun_cmd

from torchtitan_flux.run import resume
from torchtitan_flux.errors import ConfigError


def _config(model_dir, **over) -> SimpleNamespace:
    ck = dict(enable=True, load_step=-1, on_config_mismatch="error")
    ck.update({k: over.pop(k) for k in list(over) if k in ck})
    r = dict(prompts_per_step=4, task="digits", seed=0, environment="", task_args=[])
    r.update({k: over.pop(k) for k in list(over) if k in r})
    return SimpleNamespace(
        hf_assets_path=str(over.pop("model_dir", model_dir)),
        optimizer=SimpleNamespace(name=over.pop("optimizer", "AdamW")),
        grpo=SimpleNamespace(group_size=over.pop("group_size", 8)),
        training=SimpleNamespace(steps=over.pop("steps", 10)),
        rollout=SimpleNamespace(**r), checkpoint=SimpleNamespace(**ck),
    )


class _DataTask:
    def __init__(self, texts):
        self.texts = texts

    def data_state(self, step, prompts_per_step):
        return {"records": len(self.texts), "sha1": str(hash(tuple(self.texts)) & 0xFFFFFFFFFFFF).zfill(12)}


def _checkpoint(folder: Path, step: int, fp: dict | None, complete: bool = True) -> Path:
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 64)
    if complete:
        (d / ".metadata").write_bytes(b"m")
    if fp is not None:
        resume.write_fingerprint(str(d), fp)
    return d


def _check(cfg, task, folder):
    return resume.check_resume(cfg, resume.fingerprint(cfg, task), str(folder))


def test_fingerprint_holds_the_fields_that_shape_a_resume(tiny_model_dir):
    fp = resume.fingerprint(_config(tiny_model_dir), None)
    assert set(fp) == {"model.hf_assets_path config.json", "model.hf_assets_path tokenizer.json", "optimizer.name",
                       "rollout.prompts_per_step", "grpo.group_size", "rollout.task", "rollout.seed",
                       "rollout.environment", "rollout.task_args"}
    assert fp["rollout.prompts_per_step"] == 4 and fp["grpo.group_size"] == 8
    with_data = resume.fingerprint(_config(tiny_model_dir, task="dataset"), _DataTask(["a", "b"]))
    assert with_data["rollout.task"] == "dataset"
    assert with_data["rollout.dataset_path"].startswith("2 records, sha1 ")


@pytest.mark.parametrize("change,field", [
    (dict(prompts_per_step=2), "rollout.prompts_per_step = 2 differs from the checkpoint's 4"),
    (dict(group_size=4), "grpo.group_size = 4 differs from the checkpoint's 8"),
    (dict(optimizer="Adam"), "optimizer.name = 'Adam' differs from the checkpoint's 'AdamW'"),
    (dict(seed=7), "rollout.seed = 7 differs from the checkpoint's 0"),
    (dict(task="arithmetic"), "rollout.task = 'arithmetic' differs from the checkpoint's 'digits'"),
    (dict(environment="m:Env"), "rollout.environment = 'm:Env' differs from the checkpoint's ''"),
])
def test_a_changed_field_is_refused_in_one_line_naming_it_both_values_and_the_fix(tiny_model_dir, tmp_path, change,
                                                                                   field):
    cfg = _config(tiny_model_dir)
    _checkpoint(tmp_path, 4, resume.fingerprint(cfg, None))
    _check(cfg, None, tmp_path)  # the same config resumes
    with pytest.raises(ConfigError) as e:
        _check(_config(tiny_model_dir, **change), None, tmp_path)
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg, msg
    assert str(tmp_path / "step-4" / "fingerprint.json") in msg
    assert "--job.dump_folder" in msg and 'checkpoint.on_config_mismatch = "warn"' in msg


def test_model_and_dataset_are_compared_by_content(tiny_model_dir, tmp_path):
    cfg = _config(tiny_model_dir, task="dataset")
    _checkpoint(tmp_path / "ck", 4, resume.fingerprint(cfg, _DataTask(["a", "b"])))
    moved = shutil.copytree(tiny_model_dir, tmp_path / "moved")
    _check(_config(moved, task="dataset"), _DataTask(["a", "b"]), tmp_path / "ck")  # a moved copy matches
    with pytest.raises(ConfigError, match=r"^rollout.dataset_path = '1 records, sha1 \w+' differs"):
        _check(cfg, _DataTask(["a"]), tmp_path / "ck")
    conf = json.loads((moved / "config.json").read_text())
    conf["num_hidden_layers"] += 1
    (moved / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"^model.hf_assets_path config.json = 'sha256 \w+' differs"):
        _check(_config(moved, task="dataset"), _DataTask(["a", "b"]), tmp_path / "ck")


def test_warn_mode_logs_the_same_line_and_resumes(tiny_model_dir, tmp_path, caplog):
    _checkpoint(tmp_path, 4, resume.fingerprint(_config(tiny_model_dir), None))
    with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
        changed = _check(_config(tiny_model_dir, prompts_per_step=2, seed=3, on_config_mismatch="warn"), None,
                         tmp_path)
    assert changed == ["rollout.prompts_per_step", "rollout.seed"]  # the trainer then drops the saved rollouts
    assert "rollout.prompts_per_step = 2 differs from the checkpoint's 4 (and rollout.seed)" in caplog.text


def test_the_checkpoint_compared_is_the_one_resumed(tiny_model_dir, tmp_path):
    """The newest complete one (a torn newer folder is ignored, as torchtitan's loader does), or load_step's."""
    cfg = _config(tiny_model_dir)
    _checkpoint(tmp_path, 2, {**resume.fingerprint(cfg, None), "rollout.prompts_per_step": 3})
    _checkpoint(tmp_path, 4, resume.fingerprint(cfg, None))
    _checkpoint(tmp_path, 6, {**resume.fingerprint(cfg, None), "rollout.prompts_per_step": 3}, complete=False)
    _check(cfg, None, tmp_path)
    with pytest.raises(ConfigError, match="checkpoint's 3"):
        _check(_config(tiny_model_dir, load_step=2), None, tmp_path)
    _check(_config(tiny_model_dir, enable=False, load_step=2), None, tmp_path)  # checkpoints off: nothing loaded


def test_training_steps_below_the_checkpoint_step_is_refused(tiny_model_dir, tmp_path, caplog):
    _checkpoint(tmp_path, 6, None)
    with pytest.raises(ConfigError) as e:
        _check(_config(tiny_model_dir, steps=5), None, tmp_path)
    assert str(e.value).startswith("training.steps = 5 is below the step of the checkpoint to resume (")
    assert "nothing to do" in str(e.value) and "training.steps > 6" in str(e.value)
    caplog.set_level(logging.WARNING, logger="torchtitan_flux")
    _check(_config(tiny_model_dir, steps=6), None, tmp_path)  # no fingerprint (an older checkpoint): not compared
    assert "has no readable fingerprint.json (FileNotFoundError" in caplog.text
    (tmp_path / "step-6" / "fingerprint.json").write_text('{"rollout.seed": ')  # damaged: not compared either
    _check(_config(tiny_model_dir, steps=6), None, tmp_path)
    assert "has no readable fingerprint.json (JSONDecodeError" in caplog.text


def test_a_load_step_without_a_checkpoint_is_refused_naming_the_ones_there(tiny_model_dir, tmp_path):
    """Before 2026-11-25 (issue 27): torchtitan's ``FileNotFoundError`` traceback."""
    for step in (2, 4):
        _checkpoint(tmp_path, step, None)
    for step in (3, 0, -5):  # 0 (a seed checkpoint) and -5 too: before 2026-11-26 (issue 27's second sweep)
        with pytest.raises(ConfigError, match=rf"^checkpoint.load_step = {step} has no complete checkpoint in "
                                              rf"{tmp_path}; allowed: 2, 4, or -1 for the newest$"):
            _check(_config(tiny_model_dir, load_step=step), None, tmp_path)


def test_a_model_only_checkpoint_is_refused_naming_the_newest_full_one(tiny_model_dir, tmp_path):
    """torchtitan's ``last_save_model_only`` (its default) writes the final checkpoint without optimizer state.
    Before 2026-11-25 (issue 27) a resume reported it unreadable, set it aside and fell back to an older one."""
    import torch
    import torch.distributed.checkpoint as dcp

    w = {"tok_embeddings.weight": torch.zeros(2, 2)}
    dcp.save({**w, "optimizer.state.tok_embeddings.weight.step": torch.zeros(())}, checkpoint_id=str(tmp_path / "step-2"))
    dcp.save(w, checkpoint_id=str(tmp_path / "step-4"))
    assert not resume.model_only(str(tmp_path / "step-2")) and resume.model_only(str(tmp_path / "step-4"))
    with pytest.raises(ConfigError, match=rf"^checkpoint {tmp_path}/step-4 holds the model only \(written with "
                                          r"checkpoint.last_save_model_only = true\): it cannot resume training .*"
                                          r"allowed: --checkpoint.load_step 2 \(the newest full checkpoint\)"):
        _check(_config(tiny_model_dir), None, tmp_path)
    assert (tmp_path / "step-4" / ".metadata").exists()  # nothing set aside


def test_a_torchtitan_0_2_2_checkpoint_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """The fixture is a full one-step checkpoint of the debug config written by torchtitan 0.2.2 (its README): its
    parameter names do not load on 0.3.0, so the resume is refused before anything starts, naming the version and
    the two ways on. A 0.3.0 checkpoint of the same shape is not refused (the model-only test's, then this one)."""
    fixture = ROOT / "tests" / "fixtures" / "checkpoint_torchtitan_0_2_2" / "checkpoint"
    shutil.copytree(fixture, tmp_path / "checkpoint")
    folder = tmp_path / "checkpoint"
    assert resume.written_by_torchtitan_022(str(folder / "step-1"))
    with pytest.raises(ConfigError, match=rf"^checkpoint {folder}/step-1 was written by torchtitan 0.2.2, whose "
                                          r"parameter names torchtitan 0.3.0 does not load; allowed: another "
                                          r"--job.dump_folder .* hf_final .* commit 420b2f0 \(torchtitan 0.2.2\) "
                                          r"to resume it$") as e:
        _check(_config(tiny_model_dir), None, folder)
    assert "\n" not in str(e.value)
    import torch
    import torch.distributed.checkpoint as dcp

    renamed = {"lm_head.weight": torch.zeros(2, 2), "layers.0.attention.qkv_linear.wq.weight": torch.zeros(2, 2),
               "optimizer.state.lm_head.weight.step": torch.zeros(())}
    dcp.save(renamed, checkpoint_id=str(tmp_path / "new" / "step-2"))
    assert not resume.written_by_torchtitan_022(str(tmp_path / "new" / "step-2"))
    assert _check(_config(tiny_model_dir), None, tmp_path / "new") == []


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_and_is_set_aside(tmp_path, caplog):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step, None)
    tried = []

    def load(step):
        tried.append(step)
        if step == 6:
            raise EOFError("Ran out of input")

    with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
        assert resume.load_newest_readable(str(tmp_path), load, is_writer=True) == 4
    assert tried == [6, 4]
    line = [r.getMessage() for r in caplog.records][-1]
    assert line.startswith(f"checkpoint {tmp_path / 'step-6'} cannot be loaded (EOFError: Ran out of input); "
                           f"resumed from {tmp_path / 'step-4'} instead"), line
    assert not (tmp_path / "step-6" / ".metadata").exists() and (tmp_path / "step-6" / resume.SET_ASIDE).exists()
    assert resume.complete_steps(str(tmp_path)) == [4, 2]  # what torchtitan's loader and the next resume see


def test_when_no_checkpoint_loads_the_resume_is_refused_and_nothing_is_renamed(tmp_path):
    for step in (2, 4):
        _checkpoint(tmp_path, step, None)

    def load(step):
        raise RuntimeError(f"size mismatch in step {step}\nsecond line")

    with pytest.raises(ConfigError) as e:
        resume.load_newest_readable(str(tmp_path), load, is_writer=True)
    assert str(e.value).startswith(f"checkpoint {tmp_path / 'step-4'} cannot be loaded (RuntimeError: size mismatch "
                                   "in step 4), nor can any earlier one")
    assert "\n" not in str(e.value) and f"delete {tmp_path}" in str(e.value)
    assert resume.complete_steps(str(tmp_path)) == [4, 2]


def _output(proc) -> str:
    return proc.stdout + proc.stderr


def _refused(dump, *overrides) -> str:
    """Run the real command, which must refuse to start: returns its one ``error:`` line."""
    p = subprocess.run(torchrun_cmd(dump, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=180)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "exitcode  : 2" in p.stderr, p.stderr[-3000:]
    assert "Training starts" not in p.stdout + p.stderr
    return errors[0]


@pytest.mark.slow
@pytest.mark.faults
def test_resume_refusals_and_the_fallback_past_a_truncated_checkpoint(tiny_model_dir, tmp_path):
    """Async run to step 6, checkpoints at 4 and 6 (step 4's holds the finished rollouts of step 5). Resuming
    with another rollout.prompts_per_step (which crashed on a tensor shape) or with training.steps below 6 is
    refused in one line; with checkpoint.on_config_mismatch = "warn" the first resumes, generating step 5 afresh;
    with step 6's shard truncated (which gave a bare EOFError) the resume warns, goes on from step 4, and steps 5
    and 6 equal the first run's."""
    args = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--weight_sync.async_weight_update", "true",
            "--off_policy.async_ratio", "1"]
    dump, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    run_train(dump, *args, "--training.steps", "6")
    first = read_metrics(dump)
    assert resume.complete_steps(str(ckpt))[:2] == [6, 4]
    assert json.loads((ckpt / "step-4" / "fingerprint.json").read_text())["rollout.prompts_per_step"] == 4

    line = _refused(dump, *args, "--checkpoint.load_step", "4", "--rollout.prompts_per_step", "2",
                    "--training.steps", "8")
    assert line.startswith("error: rollout.prompts_per_step = 2 differs from the checkpoint's 4 ("), line
    line = _refused(dump, *args, "--training.steps", "5")
    assert line.startswith(f"error: training.steps = 5 is below the step of the checkpoint to resume ({ckpt}"), line
    warned = shutil.copytree(dump, tmp_path / "warned")  # "warn" resumes anyway: step 5 is generated afresh
    out = _output(run_train(warned, *args, "--checkpoint.load_step", "4", "--rollout.prompts_per_step", "2",
                            "--training.steps", "6", "--checkpoint.on_config_mismatch", "warn"))
    assert "the checkpoint's finished rollouts are not used (rollout.prompts_per_step changed)" in out, out[-3000:]
    assert "Training starts at step 5" in out and read_metrics(warned)[-1]["step"] == 6

    shard = ckpt / "step-6" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    out = _output(run_train(dump, *args, "--training.steps", "8"))
    assert re.search(rf"checkpoint {re.escape(str(ckpt / 'step-6'))} cannot be loaded \(.+\); resumed from "
                     rf"{re.escape(str(ckpt / 'step-4'))} instead", out), out[-3000:]
    assert "Training starts at step 5" in out
    resumed = read_metrics(dump)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed[4:6]] == [r["loss"] for r in first[4:6]]
    assert resume.complete_steps(str(ckpt))[:2] == [8, 6]  # step 6 written again over the set-aside folder


def test_a_disk_without_room_for_a_checkpoint_is_refused_at_start(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 27: a full disk was found at a save (a traceback, the run's work since the last checkpoint lost). Now
    the start checks the checkpoint folder's free space against one checkpoint of the model."""
    import shutil
    from collections import namedtuple

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
                          dump_folder=str(tmp_path),
                          hf_assets_path=str(tiny_model_dir))
    (tmp_path / "checkpoint").mkdir()
    resume.check_room_for_a_checkpoint(cfg)  # this disk has room
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(ConfigError, match=r"^checkpoint.folder = 'checkpoint' \(that is '.*/checkpoint'\) has 1.0 MiB "
                                          r"free; a checkpoint of this model takes about 3.2 MiB \(279,488 parameters "
                                          r"x 12 bytes"):
        resume.check_room_for_a_checkpoint(cfg)
    cfg.checkpoint.enable = False
    resume.check_room_for_a_checkpoint(cfg)  # checkpoints off: nothing to check


def test_a_seed_checkpoint_is_not_a_run_to_resume(tmp_path):
    """A dump folder holding only a seed checkpoint (step 0: torchtitan's ``checkpoint.create_seed_checkpoint``,
    initial weights, no trained step) and an earlier run's outputs. Before 2026-11-26 (issue 27) it counted as a
    resume: the earlier outputs stayed and the new run appended steps 1..N to its metrics.jsonl. Now they are set
    aside like any new run's; a checkpoint of a trained step still makes it a resume. An empty file (a seed
    run's metrics.jsonl) is no run's output."""
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
                          dump_folder=str(tmp_path))
    _checkpoint(tmp_path / "checkpoint", 0, None)
    (tmp_path / "metrics.jsonl").write_text("")
    assert resume.set_aside_previous_outputs(cfg) is None and (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    dest = resume.set_aside_previous_outputs(cfg)
    assert dest is not None and (Path(dest) / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    _checkpoint(tmp_path / "checkpoint", 1, None)
    assert resume.set_aside_previous_outputs(cfg) is None and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("name, make", [("hf_final", "file"), ("summary.json", "folder"), ("metrics.jsonl", "folder"),
                                        ("tb", "file")])
def test_an_output_path_of_the_wrong_kind_is_refused_at_start(tmp_path, name, make):
    """Before 2026-11-26 (issue 27's second sweep): a resume into a dump folder where hf_final is a file (or
    summary.json / metrics.jsonl a folder) trained every step, then ended with an IsADirectoryError /
    FileExistsError traceback: no export, no summary. A new run moves the earlier outputs aside first."""
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
                          dump_folder=str(tmp_path),
                          metrics=SimpleNamespace(save_tb_folder="tb", enable_tensorboard=True))
    _checkpoint(tmp_path / "checkpoint", 2, None)  # a resume: nothing is set aside
    (tmp_path / name).mkdir() if make == "folder" else (tmp_path / name).write_text("x")
    assert resume.set_aside_previous_outputs(cfg) is None
    kind = "file" if make == "folder" else "folder"
    with pytest.raises(ConfigError, match=rf"^job.dump_folder = '{re.escape(str(tmp_path))}' holds "
                                          rf"{re.escape(str(tmp_path / name))}, a {make} where the run writes its "
                                          rf"{re.escape(name)} {kind}; allowed: remove or rename it"):
        resume.check_outputs(cfg)
    cfg.metrics.enable_tensorboard = False
    if name == "tb":
        resume.check_outputs(cfg)
