"""``kvstream serve-cpu``: a real ``sglang.launch_server`` serving a tiny model with kvstream as L3, on a CPU.

    kvstream serve-cpu [--port 30000] [--tiers DIR1:DIR2] [--layout page_first] [--backend kvstream]

1. builds, once, a tiny random-weight Llama (4 layers, 2 KV heads x 64, bf16: 2 KiB of KV per token,
   128 KiB per 64-token page) and a byte-level BPE tokenizer trained offline on a fixed local text; both
   are deterministic and cached under ``$KVSTREAM_CACHE`` (default ``~/.cache/kvstream``), keyed by
   everything that makes them;
2. installs the PyPI packages the server imports if any is missing (scripts/setup-env.sh lists them);
3. prepares two tiers: throttled loop-device tiers when root (the demo's testbed), plain directories
   otherwise, or ``--tiers``;
4. starts ``python -m sglang.launch_server`` with HiCache (page size 64, ``--hicache-storage-backend
   kvstream``) in its own process group, with the CPU shims (``cpu_shims``) on its ``PYTHONPATH``, prints
   its URL and serves until interrupted; the server and the tiers are removed on exit.

The same module gives the tests, ``examples/serve_swebench.py --cpu`` and ``scripts/demo.sh --server`` the
model, the command line and the server process (:class:`ServerProcess`), so all of them run one recipe.
Nothing here is imported by the storage backend.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Mapping, Sequence

from .cpu_shims import SHIM_DIR

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGE_TOKENS = 64
BUILD_VERSION = 1  # bump when the way the model or tokenizer is made changes: a new cache key
VOCAB = 8192
# The tiny Llama: 4 layers, hidden 256 (4 heads x 64), 2 KV heads x 64 -> 4*2*2*64*2 B = 2 KiB of KV per token
LLAMA = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             torch_dtype="bfloat16")
# The flags every CPU server needs (causes: shared/reference/sglang-hicache.md, "Serving on the CPU"):
# the CPU default attention backend needs AMX kernels; torch_native runs without CUDA graphs; an idle
# scheduler busy-polls a core unless told to sleep; without a token budget sglang sizes the KV pool from
# the host's free RAM (and the host pool at twice that), far more than a tiny model needs.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--sleep-on-idle",
            "--max-total-tokens", "32768")
# What the server imports beyond tests' needs (module -> PyPI requirement); scripts/setup-env.sh installs them.
SERVER_MODULES = {
    "fastapi": "fastapi", "uvicorn": "uvicorn>=0.51", "uvloop": "uvloop", "setproctitle": "setproctitle",
    "multipart": "python-multipart", "partial_json_parser": "partial_json_parser", "zstandard": "zstandard",
    "einops": "einops", "watchfiles": "watchfiles", "distro": "distro", "openai": "openai==2.8.0",
    "tiktoken": "tiktoken", "jsonschema": "jsonschema", "xgrammar": "xgrammar", "soundfile": "soundfile",
    "prometheus_client": "prometheus-client",
}
HEALTH_POLL_S = 1.0
STOP_GRACE_S = 30.0


def cache_root() -> str:
    return os.environ.get("KVSTREAM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvstream")


# ------------------------------------------------------------------------------------------------ model
def _corpus() -> str:
    """Fixed local text to train the tokenizer on: a few modules of this Python's standard library."""
    import argparse as a, json as j, os as o, subprocess as s  # noqa: E401 - modules whose source is the text

    parts = []
    for mod in (a, j.decoder, o, s):
        with open(mod.__file__, encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def build_model(cache: str | None = None) -> str:
    """The tiny model's directory (config, safetensors weights, tokenizer), built on the first call.

    Deterministic: a fixed seed, a fixed corpus. The directory name is a hash of the recipe, the corpus
    and the torch/transformers versions, so a change makes a new model instead of reusing a stale one.
    Built in a temporary directory and renamed into place, so a crash never leaves half a model.
    """
    import tokenizers
    import torch
    import transformers

    corpus = _corpus()
    recipe = {"v": BUILD_VERSION, "llama": LLAMA, "corpus": hashlib.sha256(corpus.encode()).hexdigest(),
              "torch": torch.__version__, "transformers": transformers.__version__}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    root = os.path.join(cache or cache_root(), "serve-cpu")
    path = os.path.join(root, f"tiny-llama-{key}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is for every user of the cache
    try:
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: LLAMA's pad/bos/eos
        tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                             pad_token="<pad>").save_pretrained(tmp)
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**LLAMA)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "kvstream-recipe.json"), "w") as fh:
            json.dump(recipe, fh, indent=1)
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first: theirs is the same model
            if not os.path.exists(os.path.join(path, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def missing_packages() -> list[str]:
    import importlib.util

    return [req for mod, req in SERVER_MODULES.items() if importlib.util.find_spec(mod) is None]


def ensure_packages() -> None:
    """pip-install what the server imports and this environment lacks, with the checkout's torch constraints."""
    missing = missing_packages()
    if not missing:
        return
    constraints = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "constraints.txt")
    cmd = [sys.executable, "-m", "pip", "install", "-q"]
    if os.path.exists(constraints):  # keeps pip from swapping the CPU torch for a CUDA one
        cmd += ["-c", os.path.abspath(constraints)]
    print(f"[serve-cpu] installing what sglang's server imports: {' '.join(missing)}", file=sys.stderr)
    subprocess.run(cmd + missing, check=True)


# ----------------------------------------------------------------------------------------------- server
def launch_command(model: str, *, port: int, backend: str | None = "kvstream", layout: str = "page_first",
                   host: str = "127.0.0.1", device: str = "cpu", extra: Sequence[str] = ()) -> list[str]:
    """``sglang.launch_server`` with HiCache; ``backend=None``: HiCache off (the reference server).

    ``device="cpu"`` adds the CPU server's flags; any other device (``cuda``) is a plain GPU server.
    """
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port),
           *(CPU_ARGS if device == "cpu" else ()), "--page-size", str(PAGE_TOKENS), "--enable-metrics"]
    if backend is not None:
        cmd += ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-mem-layout", layout,
                "--hicache-storage-backend", backend]
    return cmd + list(extra)


def run_env(dirs: Sequence[str], scratch: str) -> dict[str, str]:
    """The environment of serve-cpu's server: its tiers' run directories, its TMPDIR the run's ``scratch``.
    kvstream's scan progress (``kvstream info``) goes under XDG_RUNTIME_DIR, else the temporary directory:
    with TMPDIR the scratch alone, the server's went where no `kvstream info` of the user looks (in the
    scratch), so XDG_RUNTIME_DIR is kept where this process's (the user's) would be."""
    return server_env(KVSTREAM_TIERS=os.pathsep.join(dirs),  # sglang's file and nixl: tier 0's directory
                      SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=dirs[0], SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR=dirs[0],
                      TMPDIR=scratch, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def server_env(env: Mapping[str, str] | None = None, *, device: str = "cpu", **extra: str) -> dict[str, str]:
    """The server's environment: on PYTHONPATH the directory this kvstream_hicache was imported from (the
    server runs the same tree as its caller); for the CPU also the shims, the CPU engine, two OpenMP threads.
    A GPU server gets no shim directory: its stand-in ``sgl_kernel`` would hide the real one."""
    env = dict(os.environ if env is None else env)
    first = [SHIM_DIR, PACKAGE_ROOT] if device == "cpu" else [PACKAGE_ROOT]
    path = first + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
    env.update(extra)
    return env


class PortInUse(RuntimeError):
    """The server could not bind its HTTP port (another process holds it): start it on another port."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range when it can be.

    An ephemeral port (what ``bind(port 0)`` hands out) is free only until the next outgoing connection
    or listener of any process takes it; a server that starts for half a minute before it binds its HTTP
    port lost that race in CI (sglang's own processes and a second server open such sockets while it
    starts). Below the range only listeners that asked for the port take it. Still a check, not a
    reservation: :class:`ServerProcess` reports a port taken meanwhile as :class:`PortInUse`.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = [random.randrange(10000, low - 2000) for _ in range(64)] if low > 12000 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


class ServerProcess:
    """One ``sglang.launch_server`` in its own process group: started, waited for (bounded), stopped.

    ``stop()`` signals the whole group (the launcher, scheduler and detokenizer), SIGKILL after a grace
    period, so no process outlives it, also when the caller fails. The log goes to ``log_path``.
    """

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], log_path: str, *, url: str):
        self.cmd, self.env, self.log_path, self.url = list(cmd), dict(env), log_path, url
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where this launch's lines begin in the (appended) log

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        """Launch and wait until healthy; stopped again (and the error raised) if it never gets there."""
        return self.launch().wait(timeout)

    def launch(self) -> "ServerProcess":
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait(self, timeout: float = 300.0) -> "ServerProcess":
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited with code {self.proc.returncode} while starting; last lines "
                                   f"of {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self._port_taken():  # uvicorn logs it and then waits: without this, the whole timeout
                raise PortInUse(f"sglang could not bind {self.url}: the port is in use by another process; "
                                f"start it on another port. Last lines of {self.log_path}:\n{self.tail()}")
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"sglang did not become healthy in {timeout:.0f} s; last lines of {self.log_path}:\n"
                           f"{self.tail()}")

    def _port_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_start)
                return b"address already in use" in fh.read().lower()
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left after the grace period."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # start_new_session: the group is the server's processes
            self.proc.wait(STOP_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # the launcher may exit before its children: nothing of the group survives
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return b"\n".join(fh.read().splitlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------- main
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tiers", help="tier directories, fastest first, ':'-separated (default: the testbed as "
                                   "root, else two temporary directories)")
    p.add_argument("--backend", default="kvstream", help="--hicache-storage-backend (kvstream, file, nixl)")
    p.add_argument("--layout", default="page_first", help="--hicache-mem-layout (page_first, layer_first, ...)")
    p.add_argument("--no-testbed", action="store_true", help="plain directories even as root")
    p.add_argument("--profile", default="testbed2-1:20", help="the testbed's throttle profile (root)")
    p.add_argument("--keep", action="store_true", help="keep the run's directories in the tiers (and their pages) "
                                                       "on exit; a later run starts in new ones")
    p.add_argument("--log", help="server log file (default: a new file in the temporary directory)")
    p.add_argument("--server-args", default="", help="more sglang.launch_server arguments, one quoted string")
    p.add_argument("--startup-timeout", type=float, default=600.0)


def _stop(signum, _frame) -> None:
    # Once: a second (a closed terminal's SIGHUP comes twice, the kernel's and the shell's) raised again inside
    # the stop of the server or the tiers' clean-up, and left what it cut short (Ctrl-C still can)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    # A kill, a closed terminal or `timeout` stop the server as Ctrl-C does: it runs in a session of its
    # own (no SIGHUP reaches it) and the testbed's mounts outlive this process, so dying at once left both.
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _new_log() -> str:
    """A new file for the server's log in the temporary directory, the user's alone (0600). Made with O_EXCL
    under a random name: /tmp is everyone's, and a name anyone can guess (the pid's alone, as before) let
    another user put a link there first (the log was appended to its target: a file only this user may
    write), a FIFO (the start hung) or a file of theirs (they read the log)."""
    fd, path = tempfile.mkstemp(prefix=f"kvstream-serve-cpu-{os.getpid()}-", suffix=".log")
    os.close(fd)
    return path


def _run(args) -> int:
    from . import demo

    ensure_packages()
    model = build_model()
    print(f"[serve-cpu] model: {model}", flush=True)
    tiers = demo.prepare_tiers(args)
    # sglang names its IPC sockets with tempfile and leaves them when its processes are killed: its TMPDIR
    # is a directory of this run's, removed with the tiers
    scratch = tempfile.mkdtemp(prefix="kvstream-serve-cpu-")
    tiers.cleanup.insert(0, lambda: shutil.rmtree(scratch, ignore_errors=True))
    try:
        dirs = tiers.run_dirs(args.backend)
        env = run_env(dirs, scratch)
        cmd = launch_command(model, port=args.port, host=args.host, backend=args.backend, layout=args.layout,
                             extra=shlex.split(args.server_args))
        log = args.log or _new_log()
        url = f"http://{args.host}:{args.port}"
        # (the pages are in the run's directories inside the tiers: kvstream info/check --tiers takes these)
        print(f"[serve-cpu] tiers: {tiers.note}\n[serve-cpu] KVSTREAM_TIERS={os.pathsep.join(dirs)}\n"
              f"[serve-cpu] {shlex.join(cmd)}\n[serve-cpu] log: {log}", flush=True)
        with ServerProcess(cmd, env, log, url=url).start(args.startup_timeout) as srv:
            print(f"[serve-cpu] serving at {url} (Ctrl-C stops the server); try: curl {url}/generate -H "
                  "'Content-Type: application/json' -d '{\"text\": \"Hello\", \"sampling_params\": "
                  "{\"max_new_tokens\": 8}}'", flush=True)
            while srv.alive():
                time.sleep(1.0)
            print(f"[serve-cpu] the server exited; last lines of {log}:\n{srv.tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    except TimeoutError as exc:  # (the server did not come up: its log's last lines say why)
        print(f"[serve-cpu] {exc}", file=sys.stderr)
        return 1
    finally:
        tiers.close()
