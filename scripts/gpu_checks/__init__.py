"""The parts of ``scripts/gpu_smoke.py`` beyond its first four, one module per check (docs/gpu.md, "Run this first").

Each part is a function ``part(out, device)`` run by ``gpu_smoke.py --part NAME`` in a process of its own (a wall-clock
limit per part), printing ``key=value`` lines through ``common.report`` and failing through ``common.check``; on CPU
(``--cpu``, CI) each runs its cheap twin over the same code path.
"""
