"""Drop torchtitan's start-up warnings that say nothing on a machine without an accelerator.

What: a ``logging.Filter`` on the root logger (torchtitan logs through it) dropping the records that start with
``QUIET_LOGS``, and a ``warnings`` filter for ``QUIET_WARNINGS``. Nothing else is touched.

Versions: torchtitan 0.3.0 (the three log lines are in ``tools/utils.py`` and ``distributed/utils.py``); torch
versions checked: 2.15.0.

Why: every CPU run printed, before its first step, "Error running lspci ... fallback to use device_name" and
"Peak flops undefined for: CPU, fallback to A100" (twice each: torchtitan's MFU estimate looks for a GPU; MFU is
meaningless here), "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3" (NCCL is not used on CPU)
and the ``UserWarning`` "In CPU autocast, but the target dtype is not supported. Disabling autocast." (float32
training asks for no autocast). A newcomer reads them as errors (issue 27).

When: only if ``torch._utils._get_available_device_type()`` is ``None`` (as ``cpu_device``); on a GPU machine
every one of them may mean something and stays.
"""

import logging
import warnings

from torch._utils import _get_available_device_type

QUIET_LOGS = (
    "Error running lspci",
    "Peak flops undefined for: CPU",
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]",
)
QUIET_WARNINGS = ("In CPU autocast, but the target dtype is not supported",)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_LOGS)


_FILTER = _Quiet()


def apply() -> bool:
    if _get_available_device_type() is not None:
        return False
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    return True
