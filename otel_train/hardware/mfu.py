"""Model FLOPs per token and the peak-FLOP/s table that MFU divides by (PaLM's FLOPs, no
embeddings, dense peaks): docs/design/hardware-and-numerics.md#mfu.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PEAK_FLOPS_ENV = "OTEL_TRAIN_PEAK_FLOPS"

_DTYPE_ALIASES = {
    "bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "fp16": "fp16",
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "fp32": "fp32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e5m2": "fp8",
}  # fmt: skip


def normalize_dtype(dtype: Any) -> str | None:
    """'bf16' for 'bf16', 'bfloat16', torch.bfloat16, ...; None when not a known compute dtype."""
    return _DTYPE_ALIASES.get(str(dtype).strip().lower())


def autocast_dtype() -> str | None:
    """The dtype of the `torch.autocast` region active on the calling thread (CUDA, else CPU), or
    None. Autocast state is thread-local: call this on the training thread. It reads flags only (no
    device sync) and never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return normalize_dtype(torch.get_autocast_dtype(device))
        except (TypeError, AttributeError, RuntimeError):  # a torch without per-device autocast queries
            return None
    return None


def float32_matmul_dtype() -> str:
    """'tf32' when torch lets float32 matmuls run on TF32 tensor cores (`allow_tf32`, or
    `set_float32_matmul_precision('high' | 'medium')`), else 'fp32'. Process-wide flags."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "fp32"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def transformer_flops_per_token(
    n_params: int | float,
    n_layers: int,
    seq_len: int,
    d_model: int,
    *,
    causal: bool = False,
    include_attention: bool = True,
) -> float:
    """Training FLOPs per token of a transformer: ``6·n_params + 12·n_layers·seq_len·d_model`` (PaLM
    appendix B; the attention term halved by ``causal``, dropped by ``include_attention=False``);
    ``n_params`` without embeddings."""
    if n_params < 0 or n_layers < 0 or seq_len < 0 or d_model < 0:
        raise ValueError("transformer_flops_per_token: all sizes must be >= 0")
    attention = 12.0 * n_layers * seq_len * d_model if include_attention else 0.0
    if causal:
        attention /= 2.0
    return 6.0 * float(n_params) + attention


def count_non_embedding_params(model: Any) -> int:
    """Parameters that take part in matmuls: every parameter except those owned only by
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules. A tied LM head (the same tensor owned by an
    embedding and a Linear) counts once."""
    from torch import nn

    compute: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            compute.update((id(p), p.numel()) for p in module.parameters(recurse=False))
    # Tied weights that some Linear uses (e.g. lm_head.weight = wte.weight) are registered on the
    # Linear too, so they land in `compute`. Functional reuse (F.linear(x, wte.weight)) is not
    # visible from the module tree: pass n_params yourself for such models.
    return sum(compute.values())


_LAYER_ATTRS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_WIDTH_ATTRS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")


def _config_int(model: Any, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(model, "config", None), getattr(model, "args", None), model):
        if holder is None:
            continue
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def detect_layers_and_width(model: Any) -> tuple[int | None, int | None]:
    """Best-effort (n_layers, d_model) of a torch transformer: a HF-style ``config``, then
    ``nn.Transformer{Encoder,Decoder}Layer`` / ``nn.MultiheadAttention`` modules, then the longest
    ``nn.ModuleList`` and the token embedding's width."""
    from torch import nn

    n_layers = _config_int(model, _LAYER_ATTRS)
    d_model = _config_int(model, _WIDTH_ATTRS)
    modules = list(model.modules())
    if n_layers is None:
        torch_layers = sum(
            isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) for m in modules
        )
        longest_list = max((len(m) for m in modules if isinstance(m, nn.ModuleList)), default=0)
        n_layers = torch_layers or longest_list or None
    if d_model is None:
        widths = [int(m.embed_dim) for m in modules if isinstance(m, nn.MultiheadAttention)]
        widths += [int(m.embedding_dim) for m in modules if isinstance(m, nn.Embedding)]
        d_model = widths[0] if widths else None
    return n_layers, d_model


def flops_per_token_from_model(
    model: Any, seq_len: int, *, n_layers: int | None = None, d_model: int | None = None, causal: bool = False
) -> float:
    """Training FLOPs per token of ``model`` at ``seq_len`` (PaLM convention). Undetectable
    ``n_layers``/``d_model`` raise a ValueError naming them, not a number without attention."""
    detected_layers, detected_width = detect_layers_and_width(model)
    layers = n_layers if n_layers is not None else detected_layers
    width = d_model if d_model is not None else detected_width
    if layers is None or width is None:
        missing = " and ".join(n for n, v in (("n_layers", layers), ("d_model", width)) if v is None)
        raise ValueError(
            f"flops_per_token_from_model: could not detect {missing} of {type(model).__name__}; "
            f"pass {missing} explicitly (or compute transformer_flops_per_token yourself)."
        )
    return transformer_flops_per_token(
        count_non_embedding_params(model), layers, seq_len, width, causal=causal
    )


# --- peak table --------------------------------------------------------------------------------------
T = 1e12


@dataclass(frozen=True)
class PeakEntry:
    name: str  # short id used in the source string: "table:<name>"
    pattern: str  # regex, case-insensitive, searched in the device name
    flops: Mapping[str, float | None]  # dtype -> dense FLOP/s (None: no such tensor-core path)
    source: str


def _p(*tflops: float | None) -> dict[str, float | None]:
    """FLOP/s by dtype from the fp8, bf16, fp16, tf32 and fp32 figures in TFLOP/s."""
    dtypes = ("fp8", "bf16", "fp16", "tf32", "fp32")
    return {dtype: None if v is None else v * T for dtype, v in zip(dtypes, tflops, strict=True)}


# Most specific patterns first. Numbers in TFLOP/s, dense (datasheet sparse figures / 2). Boards of
# one chip and form factor share their figures.
_HOPPER_SXM = _p(1979, 989.5, 989.5, 494.7, 67)
_HOPPER_NVL = _p(1670.5, 835.5, 835.5, 417.5, 60)
_A100 = _p(None, 312, 312, 156, 19.5)
_MI300 = _p(2614.9, 1307.4, 1307.4, 653.7, 163.4)
# fmt: off
PEAK_TABLE: tuple[PeakEntry, ...] = (
    PeakEntry("h100-nvl", r"H100\s*NVL", _HOPPER_NVL,
              "NVIDIA H100 datasheet (NVL column, per GPU; sparse/2)"),
    PeakEntry("h100-pcie", r"H100\s*PCIe", _p(1513, 756.5, 756.5, 378, 51),
              "NVIDIA H100 datasheet (PCIe column; sparse/2)"),
    PeakEntry("gh200", r"GH200", _HOPPER_SXM,
              "NVIDIA GH200 datasheet (H100/H200-class Hopper GPU; sparse/2)"),
    PeakEntry("h100-sxm", r"H100", _HOPPER_SXM,
              "NVIDIA H100 datasheet (SXM column; sparse/2); other H100 names assumed SXM"),
    PeakEntry("h200-nvl", r"H200\s*NVL", _HOPPER_NVL, "NVIDIA H200 datasheet (NVL column; sparse/2)"),
    PeakEntry("h200-sxm", r"H200", _HOPPER_SXM, "NVIDIA H200 datasheet (SXM column; sparse/2)"),
    PeakEntry("h20", r"\bH20\b", _p(296, 148, 148, 74, 44), "NVIDIA H20 product brief (dense)"),
    PeakEntry("b200", r"\bB200\b", _p(4500, 2250, 2250, 1100, 75),
              "NVIDIA HGX B200 datasheet (8-GPU totals / 8, sparse/2)"),
    PeakEntry("a100-pcie", r"\bA100\b.*PCIe", _A100,
              "NVIDIA A100 datasheet (PCIe: same peak as SXM, lower sustained clocks)"),
    PeakEntry("a100-sxm", r"\bA100\b", _A100, "NVIDIA A100 datasheet (SXM; dense)"),
    PeakEntry("l40s", r"L40S", _p(733, 366, 366, 183, 91.6), "NVIDIA L40S datasheet (sparse/2)"),
    PeakEntry("l4", r"\bL4\b", _p(242.5, 121, 121, 60, 30.3), "NVIDIA L4 datasheet (sparse/2)"),
    PeakEntry("rtx-4090", r"RTX\s*4090", _p(330.3, 165.2, 165.2, 82.6, 82.6),
              "NVIDIA Ada whitepaper, RTX 4090 (FP32-accumulate tensor rates; dense)"),
    PeakEntry("v100", r"V100", _p(None, None, 125, None, 15.7), "NVIDIA V100 datasheet (SXM2; no BF16/TF32)"),
    PeakEntry("mi325x", r"MI325X", _MI300, "AMD Instinct MI325X data sheet (dense)"),
    PeakEntry("mi300x", r"MI300X", _MI300, "AMD Instinct MI300X data sheet (dense)"),
)
# fmt: on


def match_peak_entry(device_name: str | None) -> PeakEntry | None:
    if not device_name:
        return None
    if re.search(r"\bMIG\b", device_name):
        # A MIG slice ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") has a fraction of the board's SMs: the
        # board's peak would understate MFU several-fold. Unknown, like any untabled device.
        return None
    for entry in PEAK_TABLE:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


def resolve_peak(
    device_name: str | None,
    dtype: Any = "bf16",
    override: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[float | None, str | None]:
    """(peak FLOP/s per GPU, source) for MFU: ``override`` (the ``peak_flops`` setting; its source is
    ``env:OTEL_TRAIN_PEAK_FLOPS`` when that variable supplied it), then that variable, then the table
    (``table:<entry>:<dtype>``); (None, None) for an unknown device or a dtype it has no path for."""
    env = os.environ if environ is None else environ
    try:
        env_value: float | None = float(env.get(PEAK_FLOPS_ENV, ""))
    except ValueError:  # unset, or not a number
        env_value = None
    if env_value is not None and not env_value > 0:  # NaN too
        env_value = None
    if override is not None and override > 0:
        source = (
            f"env:{PEAK_FLOPS_ENV}"
            if env_value is not None and env_value == float(override)
            else "config:peak_flops"
        )
        return float(override), source
    if env_value is not None:
        return env_value, f"env:{PEAK_FLOPS_ENV}"
    key = normalize_dtype(dtype)
    entry = match_peak_entry(device_name)
    if entry is None or key is None:
        return None, None
    value = entry.flops.get(key)
    if value is None:
        return None, None
    return value, f"table:{entry.name}:{key}"
