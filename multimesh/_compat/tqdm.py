"""tqdm internals used by the trainer's progress bar (tested on tqdm 4.70.1)."""

from __future__ import annotations

from tqdm import tqdm
from tqdm.std import EMA

__all__ = ["restart_clock"]


def restart_clock(bar: tqdm, step: int) -> None:
    """Restarts ``bar``'s clock at ``step``: its count, rate and ETA as if it had been created there (the
    smoothed rates ``_ema_*`` are private to tqdm).

    Public replacement: ``bar.reset(total)`` then ``bar.update(step)``, which shows step 0 meanwhile and
    counts ``step`` in the rate. Tested on tqdm 4.70.1.
    """
    bar.n = bar.last_print_n = bar.initial = step
    bar.last_print_t = bar.start_t = bar._time()
    bar._ema_dn, bar._ema_dt, bar._ema_miniters = (EMA(bar.smoothing) for _ in range(3))
