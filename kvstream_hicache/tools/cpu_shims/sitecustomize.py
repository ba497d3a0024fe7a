"""Run at start-up by every Python process whose PYTHONPATH holds this directory: ``kvstream serve-cpu``
puts it there for the sglang server it starts, so the launcher, the scheduler and the detokenizer (spawned,
fresh interpreters) all get the CPU shims before they import sglang. Nothing else sets this path."""
try:
    from kvstream_hicache.tools import cpu_shims

    cpu_shims.install()
except Exception as exc:  # a broken shim must not hide the server's own error message
    import sys

    print(f"[kvstream cpu-shims] not installed: {exc!r}", file=sys.stderr)
