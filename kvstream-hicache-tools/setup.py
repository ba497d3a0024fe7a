"""The tools' modules are the repository's kvstream_hicache/tools: this distribution packages that
folder and nothing else of kvstream_hicache (the engine's own wheel leaves it out)."""
import os

from setuptools import find_packages, setup

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kvstream_hicache", "tools")
PACKAGES = ["kvstream_hicache.tools"] + [f"kvstream_hicache.tools.{p}" for p in find_packages(SOURCE)]

setup(packages=PACKAGES,
      package_dir={p: os.path.relpath(os.path.join(SOURCE, *p.split(".")[2:])) for p in PACKAGES})
