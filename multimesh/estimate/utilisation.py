"""Model and hardware flop utilisation: what a predicted step does with the devices' peak.

- **MFU** (model flop utilisation, PaLM's and Megatron-LM's definition): the
  flops the *model* needs per step, ``6 x parameters x tokens`` (forward 2,
  backward 4 per parameter and token) plus attention's
  ``12 x layers x sequence x attention width`` per token (its two products
  ``Q K^T`` and ``P V``, forward and backward, over the whole sequence),
  divided by the devices' peak over the step. Recomputation (remat) and work
  replicated across devices are *not* counted: they are the layout's cost,
  not the model's. `model_flops` computes it; `estimate(model_flops=...)`
  takes it.
- **HFU** (hardware flop utilisation): the compiled programs' own flops
  (recomputation and replicated work included) over the same peak.

Both are at most 1 for any step that can run: a prediction above the peak is
a bug (in the model of the step, or a ``model_flops`` larger than the work
the programs do), and raises `ImpossibleRateError` instead of printing.
"""

from __future__ import annotations

__all__ = ["ImpossibleRateError", "model_flops", "utilisation"]

#: rounding room: a step priced exactly at peak computes 1 up to float error
_ROOM = 1e-6


class ImpossibleRateError(RuntimeError):
    """A predicted flop rate above the hardware's peak: not a result but a bug to report."""


def model_flops(parameters: float, tokens: float, *, layers: int = 0, seq_len: int = 0,
                attention_width: int = 0) -> float:
    """One training step's model flops: ``6 x parameters x tokens + 12 x layers x seq_len x attention_width x
    tokens`` (PaLM, Chowdhery et al. 2022, appendix B; ``attention_width``: heads x head dim of the queries).
    ``tokens``: the step's tokens, all devices together (global batch x sequence)."""
    for name, value in (("parameters", parameters), ("tokens", tokens), ("layers", layers), ("seq_len", seq_len),
                        ("attention_width", attention_width)):
        if value < 0:
            raise ValueError(f"model_flops: {name}={value!r} must be 0 or more")
    return 6.0 * parameters * tokens + 12.0 * layers * seq_len * attention_width * tokens


def utilisation(flops: float, seconds: float, peak: float, devices: int, what: str) -> float:
    """``flops`` over ``devices`` devices at ``peak`` flop/s each for ``seconds``: the fraction of the peak
    used. Raises `ImpossibleRateError` above 1 (``what``: whose flops, for the message)."""
    if seconds <= 0 or peak <= 0 or devices <= 0:
        return 0.0
    used = flops / (seconds * peak * devices)
    if used > 1 + _ROOM:
        raise ImpossibleRateError(
            f"predicted {flops:.4g} flops ({what}) in {seconds:.4g} s on {devices} devices: {used:.1%} of their "
            f"peak ({peak:.4g} flop/s each), which no step reaches. This is a bug in the step's model, or "
            f"model_flops= counts more work than the step does: check it, and report the step if it is right")
    return used
