"""Choosing without a device: the candidate whose worst-case regret over the model's own
constant sets is least, and where the choice flips.

The latency model's constants are known only as well as the leave-one-model-out refits agree
(``cost.shipped.leave_one_model_out``). Where two candidates swap places inside that spread,
the prediction under the one fitted set is a coin toss: minimax regret picks the candidate that
loses least under the set least kind to it, and the report says the choice is uncertain and
at which constant, moved alone from its fitted value, it flips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..cost.latency import NAMES, Constants

Price = Callable[[Constants], dict[str, float]]     # constants -> {candidate: seconds}


@dataclass(frozen=True)
class Choice:
    name: str                   # the candidate chosen
    fitted: str                 # the one the fitted constants alone would pick
    regret: dict[str, float]    # candidate -> its worst regret (seconds) over the sets
    uncertain: bool             # the winner differs under some set
    flips: list[str]            # "sync_us 1.15 (sets span 0.94-2.05)" for each constant that flips it alone

    def as_dict(self) -> dict:
        return {"chosen": self.name, "fitted_choice": self.fitted, "uncertain": self.uncertain,
                "worst_regret_ms": {k: round(v * 1e3, 4) for k, v in self.regret.items()}, "flips": self.flips,
                "rule": "least worst-case regret over the fitted and the leave-one-model-out constant sets"}


def _winner(prices: dict[str, float]) -> str:
    return min(prices, key=lambda k: (prices[k], k))


def choose(price: Price, fitted: Constants, sets: dict[str, Constants]) -> Choice:
    """The minimax-regret choice among the candidates ``price`` prices, over ``fitted`` and ``sets``."""
    table = {"fitted": price(fitted)} | {name: price(c) for name, c in sets.items()}
    names = list(table["fitted"])
    regret = {n: max(p[n] - min(p.values()) for p in table.values()) for n in names}
    chosen = min(names, key=lambda n: (regret[n], table["fitted"][n], n))
    winners = {_winner(p) for p in table.values()}
    return Choice(chosen, _winner(table["fitted"]), regret, len(winners) > 1,
                  flips(price, fitted, sets) if len(winners) > 1 else [])


def flips(price: Price, fitted: Constants, sets: dict[str, Constants], steps: int = 20) -> list[str]:
    """Each constant that, moved alone across the span the sets give it, changes the winner:
    where (by bisection), and the span."""
    out = []
    base = _winner(price(fitted))
    for n in NAMES:
        values = [getattr(c, n) for c in sets.values()] + [getattr(fitted, n)]
        lo, hi = min(values), max(values)
        if hi <= lo:
            continue
        at = lambda v: _winner(price(replace(fitted, **{n: v})))  # noqa: E731
        for end in (lo, hi):
            if at(end) == base:
                continue
            a, b = getattr(fitted, n), end          # base at a, another winner at b
            for _ in range(steps):
                mid = (a + b) / 2
                a, b = (mid, b) if at(mid) == base else (a, mid)
            out.append(f"{n} {b:.4g} (the sets span {lo:.4g}-{hi:.4g}; fitted {getattr(fitted, n):.4g})")
    return out
