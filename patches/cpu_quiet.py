"""Drop torchtitan's start-up warnings that say nothing on a machine without an accelerator.

What: a ``logging.Filter`` on the root logger (torchtitan logs through it) and on ``torch.utils.flop_counter``'s
dropping the records that start with ``QUIET_LOGS``. Nothing else is touched.

Versions: torchtitan 0.3.0 (the log lines are in ``tools/utils.py``, ``distributed/utils.py`` and
``components/checkpointer/base.py``); torch 2.15.0 (``utils/flop_counter.py``).

Why: every CPU run printed, before its first step, "Error running lspci ... fallback to use device_name" and
"Peak flops undefined for: CPU, fallback to A100" (twice each: torchtitan's MFU estimate looks for a GPU; MFU is
meaningless here), "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3" (NCCL is not used on CPU),
"initial_load_model_only=True has no effect without an initial_load_path" (0.3.0's checkpoint config warns about
its own defaults, each time one is built) and torch's "triton not found; flop counting will not work for triton
kernels" (a CUDA build of torch without triton, as PyPI's torch 2.15.0 on a CPU machine). A newcomer reads them as
errors (issue 27). 0.2.2's autocast warning is gone with 0.3.0's AMP.

When: only if ``torch._utils._get_available_device_type()`` is ``None`` (as ``cpu_device``); on a GPU machine
every one of them may mean something and stays.
"""

import logging

from torch._utils import _get_available_device_type

QUIET_LOGS = (
    "Error running lspci",
    "Peak flops undefined for: CPU",
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]",
    "initial_load_model_only=True has no effect without an initial_load_path",
    "triton not found; flop counting will not work",
)
LOGGERS = ("", "torch.utils.flop_counter")  # the root logger (torchtitan's) and the one torch's line comes from


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_LOGS)


_FILTER = _Quiet()


def apply() -> bool:
    if _get_available_device_type() is not None:
        return False
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    return True
