"""Rotary position embeddings: the cos/sin table, built once per model, and its application.

The table covers positions 0..max_position_embeddings-1 and is indexed by each
token's absolute position, so prefill chunks and decodes of any mix need no
per-step trigonometry. Layout is Hugging Face's "rotate half" (NeoX) layout;
GGUF q/k weights are un-permuted at load so they match it.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, float | str] | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float64 for an exact table."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, float | str]) -> torch.Tensor:
    # Same piecewise rule as transformers' _compute_llama3_parameters: long wavelengths are
    # divided by `factor`, short ones kept, the band between interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin of every position, [max_positions, head_dim] each, in the model dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, float | str] | None,
        dtype: torch.dtype,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(torch.float32)
        # float32 angles like transformers, so fp32 logits match it to ~1e-6.
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position; returns a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
