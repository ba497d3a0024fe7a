"""The sglang plugin's module path before the package layout changed (entry point
``kvstream_hicache.plugin:register`` in metadata of earlier installs); ``register`` lives in
:mod:`kvstream_hicache.sglang.plugin`. Import-light like it: no sglang, torch or numpy here.
"""
from .sglang.plugin import register

__all__ = ["register"]
