"""Fault injection from outside the code under test, for ``tests/integration/test_faults_trainer.py``.

A test puts this folder first on ``PYTHONPATH``; every Python process of the run (torchrun, the trainer, its
engine processes) then imports this module at start-up. With none of the variables below set it does nothing.

  FLUX_FAULT_CKPT_STALL="STEP:SECONDS:MARKER"   the checkpoint of step STEP stalls SECONDS after its shards are
      written and before its ``.metadata`` (what makes it complete) is: a checkpoint write in progress. MARKER
      is created when the stall starts.
  FLUX_FAULT_PUSH_STALL="VERSION:SECONDS:MARKER"  an embedded engine that has received weight version VERSION
      stalls SECONDS before publishing (acking) it: a weight push in flight. MARKER is created when it starts.
  FLUX_FAULT_GENERATE_STALL="STEP:SECONDS:MARKER"  an embedded engine stalls SECONDS before generating any
      request for training step STEP: a long rollout wait (a slow engine, long generations).
  FLUX_FAULT_PUSH_DELAY="SECONDS"   an embedded engine takes SECONDS longer to receive every push (it publishes,
      i.e. acks, each version that much later): a slow link or a large model, for the self-tuning sync cadence
      (tests/integration/test_sync_cadence.py, ``benchmarks/weight_sync.py --slow-sync``).
  FLUX_FAULT_ENGINE_FAIL="MESSAGE"   every embedded engine dies with RuntimeError(MESSAGE) at its first
      generation request: an engine that fails the same way every time (a bad device, a bad setting), for the
      bounded-restart test.
  FLUX_FAULT_CKPT_OSERROR="STEP:ERRNO"   writing the checkpoint of step STEP fails with OSError(errno.ERRNO), e.g.
      ENOSPC (a full disk), EACCES, EROFS, EIO, when its shards are written (in the background with an async
      ``checkpoint.async_mode``).
  FLUX_FAULT_METRICS_ENOSPC="STEP"   appending step STEP's row to metrics.jsonl fails with "No space left on
      device": a full disk under the metrics.
  FLUX_FAULT_PUSH_HOLD="VERSION:SECONDS"   the trainer's first regular push of a weight version >= VERSION stays
      in flight after its bytes went out until two more due steps found the pusher busy and were coalesced (at
      most SECONDS), as a push to an engine slow to acknowledge it (a slow link, a big model, a loaded machine)
      does, whatever the engine kind (tests/integration/test_livelock.py).
"""

import os
import time


def _parse(var):
    spec = os.environ.get(var)
    if not spec:
        return None
    key, seconds, marker = spec.split(":", 2)
    return int(key), float(seconds), marker


def _stall(seconds, marker):
    open(marker, "w").close()
    time.sleep(seconds)


_ckpt = _parse("FLUX_FAULT_CKPT_STALL")
if _ckpt is not None:
    from torch.distributed.checkpoint import filesystem as _fs

    _finish = _fs._FileSystemWriter.finish

    def finish(self, metadata, results):
        if str(self.path).rstrip("/").endswith(f"step-{_ckpt[0]}"):
            _stall(*_ckpt[1:])
        return _finish(self, metadata, results)

    _fs._FileSystemWriter.finish = finish

_push = _parse("FLUX_FAULT_PUSH_STALL")
_delay = float(os.environ.get("FLUX_FAULT_PUSH_DELAY", "0") or 0)
if _push is not None or _delay > 0:
    from torchtitan_flux.wire import transport as _transport

    _publish = _transport.WeightReceiver._publish

    def _publish_stalled(self, version, buf, stop):
        if _push is not None and version == _push[0]:
            _stall(*_push[1:])
        if _delay > 0 and version > 0:  # not the start-up push
            time.sleep(_delay)
        return _publish(self, version, buf, stop)

    _transport.WeightReceiver._publish = _publish_stalled

_gen = _parse("FLUX_FAULT_GENERATE_STALL")
if _gen is not None:
    from torchtitan_flux.engine import embedded as _embedded

    _generate = _embedded._EngineProcess.generate

    def _generate_stalled(self, req):
        if req.step == _gen[0]:
            _stall(*_gen[1:])
        return _generate(self, req)

    _embedded._EngineProcess.generate = _generate_stalled

_hold = os.environ.get("FLUX_FAULT_PUSH_HOLD")
if _hold:
    from push_hold import held_push as _held_push

    from torchtitan_flux.sync import pusher as _pusher

    _pusher.Pusher.push = _held_push(_pusher.Pusher.push, int(_hold.split(":")[0]), float(_hold.split(":")[1]), [])

_engine_fail = os.environ.get("FLUX_FAULT_ENGINE_FAIL")
if _engine_fail:
    from torchtitan_flux.engine import embedded as _embedded_fail

    def _failing_generate(self, req):
        raise RuntimeError(_engine_fail)

    _embedded_fail._EngineProcess.generate = _failing_generate

_ckpt_error = os.environ.get("FLUX_FAULT_CKPT_OSERROR")
if _ckpt_error:
    import errno

    from torch.distributed.checkpoint import filesystem as _fs_err

    _write_data = _fs_err._FileSystemWriter.write_data
    _err_step, _err_name = _ckpt_error.split(":")

    def _failing_write(self, plan, planner):
        if str(self.path).rstrip("/").endswith(f"step-{_err_step}"):
            code = getattr(errno, _err_name)
            raise OSError(code, os.strerror(code), os.path.join(self.path, "__0_0.distcp"))
        return _write_data(self, plan, planner)

    _fs_err._FileSystemWriter.write_data = _failing_write

_metrics_full = os.environ.get("FLUX_FAULT_METRICS_ENOSPC")
if _metrics_full:
    import errno

    from torchtitan_flux.run import metrics as _metrics

    _metrics_write = _metrics._write

    class _FullDiskFile:
        def __init__(self, name):
            self.name = name

        def write(self, line):
            raise OSError(errno.ENOSPC, "No space left on device")

    def _full_metrics_disk(f, line, step):
        full = step == int(_metrics_full) and f.name.endswith("metrics.jsonl")
        return _metrics_write(_FullDiskFile(f.name) if full else f, line, step)

    _metrics._write = _full_metrics_disk

# FLUX_FAULT_ENGINE_WEIGHTS="VERSION:MODE[:NAME]" (tests/integration/test_probe_e2e.py): from weight version
# VERSION on, an embedded engine computes (generates and scores the post-sync probe) with other weights than the
# ones it received; the received bytes, so its checksum, stay right: what the probe exists to catch.
#   MODE "drop": the tensor NAME is zero, as a tensor the engine never loaded (dropped from the push or loaded
#   under a wrong name); MODE "bf16": every floating tensor rounded through bfloat16, as an engine that holds the
#   push in bf16 while the trainer computes in fp32 (a dtype mix-up).
_wrong_weights = os.environ.get("FLUX_FAULT_ENGINE_WEIGHTS")
if _wrong_weights:
    import torch as _torch

    from torchtitan_flux.engine import embedded as _embedded_w

    _ww_version, _ww_mode, *_ww_name = _wrong_weights.split(":")
    _ww_version = int(_ww_version)
    if _ww_mode not in ("drop", "bf16") or (_ww_mode == "drop") != bool(_ww_name):
        raise ValueError(f"FLUX_FAULT_ENGINE_WEIGHTS = {_wrong_weights!r}; allowed: VERSION:drop:NAME or VERSION:bf16")

    def _wrong(weights):
        if _ww_mode == "drop":
            if _ww_name[0] not in weights:  # a typo would test nothing
                raise KeyError(f"FLUX_FAULT_ENGINE_WEIGHTS: no tensor {_ww_name[0]!r}; there are {sorted(weights)}")
            return {k: _torch.zeros_like(v) if k == _ww_name[0] else v for k, v in weights.items()}
        return {k: v.to(_torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in weights.items()}

    class _WrongInference:
        """The engine's ``inference`` module, computing with ``_wrong`` weights once the engine's version (the
        newest received for the probe's score, the live one for generation) reaches VERSION."""

        def __init__(self, engine, inner):
            self._engine, self._inner = engine, inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def score(self, weights, *a, **k):
            if self._engine.receiver.newest()[0] >= _ww_version:
                weights = _wrong(weights)
            return self._inner.score(weights, *a, **k)

        def generate(self, weights, *a, **k):
            if self._engine.receiver.live_version >= _ww_version:
                weights = _wrong(weights)
            return self._inner.generate(weights, *a, **k)

    _engine_init = _embedded_w._EngineProcess.__init__

    def _engine_init_wrong(self, *a, **k):
        _engine_init(self, *a, **k)
        self.inference = _WrongInference(self, self.inference)

    _embedded_w._EngineProcess.__init__ = _engine_init_wrong
