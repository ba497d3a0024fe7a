"""A setting's default is written once, in config.SETTINGS: the classes that take settings take them
without a default (a slice of Config, or a required argument), so no path can drift from the table."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import kvstream_hicache
from kvstream_hicache.config import SETTINGS, Config
from kvstream_hicache.writequeue import WriteSettings

CORE = [m.name for m in pkgutil.iter_modules(kvstream_hicache.__path__)
        if not m.ispkg and not m.name.startswith("_") and m.name != "config"]  # (config.py derives its
# defaults from SETTINGS: Config's fields through _default, TierConfig's capacity from SETTINGS)


def test_no_core_class_writes_a_settings_default_again():
    twice = []
    for name in CORE:
        module = importlib.import_module(f"kvstream_hicache.{name}")
        for cls_name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or cls is Config:
                continue
            try:
                params = inspect.signature(cls.__init__).parameters.values()
            except (TypeError, ValueError):
                continue
            twice += [f"{name}.{cls_name}({p.name}={p.default!r})" for p in params
                      if p.name in SETTINGS and p.default is not inspect.Parameter.empty]
    assert not twice, f"defaults written beside config.SETTINGS: {twice}"


def test_the_write_settings_slice_names_settings_and_takes_them_from_config(tier_root):
    assert set(WriteSettings._fields) <= SETTINGS.keys()
    assert not WriteSettings._field_defaults
    config = Config.from_sources({"tiers": [tier_root], "replicate": "all", "replicate_slack": 2.5,
                                  "write_backlog": "1G", "write_timeout": "2.5"}, environ={})
    assert WriteSettings.of(config) == ("all", 2.5, 1 << 30, 2.5)
