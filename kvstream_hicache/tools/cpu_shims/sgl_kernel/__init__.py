"""Stand-in for ``sgl_kernel`` on a CPU host (its CPU build is not on PyPI).

sglang imports it at module level when ``SGLANG_USE_CPU_ENGINE=1`` (``kernels/ops/kvcache/cache_move.py``)
and probes for AMX kernels through ``torch.ops.sgl_kernel``; without AMX every layer takes its torch-native
path and nothing here is called. Any function taken from this module raises when called, naming itself,
so a code path that does need a real kernel fails loudly instead of computing garbage.
"""
__version__ = "0.0.0+kvstream-cpu-stand-in"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called, but this is kvstream's CPU stand-in for sgl_kernel "
                           "(no kernels): this code path needs the real sgl_kernel build")

    missing.__name__ = name
    return missing
