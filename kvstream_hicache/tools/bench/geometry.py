"""Page geometry: how many bytes a KV page holds and how it splits into segments (K and V chunks).

A page of an MHA model in sglang's ``page_first`` host layout is two contiguous chunks, K then V, each
``page_size * layers * kv_heads * head_dim * dtype_bytes``; an MLA page is one chunk of
``page_size * layers * kv_dim * dtype_bytes`` (``get_page_buffer_meta``). The benchmark moves exactly
these segments, so its requests have the sizes a server's would.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


@dataclass(frozen=True)
class Model:
    """The KV-cache shape of a model (per tensor-parallel rank: ``kv_heads`` already divided by TP)."""

    name: str
    layers: int
    kv_heads: int = 0  # MHA/GQA: KV heads; 0 for MLA
    head_dim: int = 0  # MHA/GQA
    kv_lora_rank: int = 0  # MLA: the latent's width (0: MHA/GQA)
    rope_dim: int = 0  # MLA: qk_rope_head_dim
    dtype: str = "bf16"

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_dim(self) -> int:
        """MLA: values per token and layer (the latent and its rope part, one row)."""
        return self.kv_lora_rank + self.rope_dim


MODELS: dict[str, Model] = {
    "llama3-8b": Model("llama3-8b", layers=32, kv_heads=8, head_dim=128),
    "llama3-70b": Model("llama3-70b", layers=80, kv_heads=8, head_dim=128),
    "qwen2.5-7b": Model("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
    "deepseek-v3": Model("deepseek-v3", layers=61, kv_lora_rank=512, rope_dim=64),
}


@dataclass(frozen=True)
class Geometry:
    """Bytes per page and their segments. ``segments`` are the chunk sizes in page order."""

    label: str
    segments: tuple[int, ...]
    page_tokens: int | None = None
    model: Model | None = None

    @property
    def page_bytes(self) -> int:
        return sum(self.segments)

    def describe(self) -> str:
        chunks = " + ".join(_human(s) for s in self.segments)
        return f"{self.label}: {_human(self.page_bytes)} per page ({chunks})"


def from_model(name: str, page_tokens: int, tp: int = 1) -> Geometry:
    """The geometry of ``page_tokens`` tokens of ``name`` (see :data:`MODELS`) on one of ``tp`` ranks."""
    try:
        m = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}: use one of {', '.join(MODELS)} or --page-bytes") from None
    isz = DTYPE_BYTES[m.dtype]
    if m.mla:  # MLA: one latent chunk, shared by every TP rank
        return Geometry(f"{name} P={page_tokens} (MLA)", (page_tokens * m.layers * m.kv_dim * isz,), page_tokens, m)
    if m.kv_heads % tp:
        raise ValueError(f"{name} has {m.kv_heads} KV heads: not divisible by tp={tp}")
    chunk = page_tokens * m.layers * (m.kv_heads // tp) * m.head_dim * isz
    label = f"{name} P={page_tokens}" + (f" tp={tp}" if tp > 1 else "")
    return Geometry(label, (chunk, chunk), page_tokens, m)


def from_bytes(page_bytes: int, segments: int = 2) -> Geometry:
    """An explicit page size, split into ``segments`` equal chunks (K and V by default)."""
    if page_bytes <= 0 or page_bytes % segments:
        raise ValueError(f"--page-bytes {page_bytes} must be a positive multiple of {segments}")
    return Geometry(f"{_human(page_bytes)} pages", (page_bytes // segments,) * segments)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % (scale // 1024 or 1) == 0:
            v = n / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"
