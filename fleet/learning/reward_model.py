"""The reward model doubly robust estimation fits when none is given: shrunk cell means.

``q(context, choice)`` is the mean reward of the logged decisions with that
context and choice, shrunk toward the choice's mean over every context (itself
shrunk toward the mean of all), each by the weight of ``PRIOR`` decisions::

    q(x, a) = (sum_xa + PRIOR * q(a)) / (n_xa + PRIOR)
    q(a)    = (sum_a  + PRIOR * mean) / (n_a  + PRIOR)

Contexts and choices are compared by their JSON (keys sorted). It is the
simplest model that is right for the small discrete contexts decisions
usually log (a segment, a plan); for a rich context, pass a model of your own
(``reward_model=``). DR stays unbiased whatever the model, when the logged
propensities are right; a better model only narrows its interval.

Cross-fitting (``cross_fitted``): the units are dealt into ``FOLDS`` folds by
position, and each unit's prediction comes from the model fitted on the other
folds, so no reward predicts itself (which would bias DR toward the logged
rewards and make its interval too narrow).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import TooFewSamplesError

RewardModel = Callable[[Any, Any], float]
"""``(context, choice) -> expected reward``."""

#: Folds of the cross-fitting.
FOLDS = 5
#: The shrinkage: a cell's mean counts against its parent's as this many decisions.
PRIOR = 2.0


_PLAIN = (str, int, float, bool, type(None))


def key(value: Any) -> Hashable:
    """A context or a choice as a dict key: a plain value with its type (``1``, ``1.0``,
    ``True`` and ``"1"`` stay apart), anything else its JSON (keys sorted)."""
    if type(value) in _PLAIN:
        return (type(value).__name__, value)
    return ("json", json.dumps(value, sort_keys=True, default=repr, separators=(",", ":")))


@dataclass(slots=True)
class CellMeans:
    """A fitted ``RewardModel``: shrunk means per (context, choice), per choice, overall."""

    mean: float = 0.0
    by_choice: dict[Hashable, tuple[float, int]] = field(default_factory=dict)
    by_cell: dict[tuple[Hashable, Hashable], tuple[float, int]] = field(default_factory=dict)

    def __call__(self, context: Any, choice: Any) -> float:
        return self.predict(context, [choice])[0]

    def predict(self, context: Any, choices: Iterable[Any]) -> list[float]:
        """The expected reward of each of ``choices`` in ``context`` (its key made once)."""
        x = key(context)
        out = []
        for choice in choices:
            a = key(choice)
            total, n = self.by_choice.get(a, (0.0, 0))
            arm = (total + PRIOR * self.mean) / (n + PRIOR)
            total, n = self.by_cell.get((x, a), (0.0, 0))
            out.append((total + PRIOR * arm) / (n + PRIOR))
        return out


def fit_reward_model(samples: Iterable[tuple[Any, Any, float]]) -> CellMeans:
    """Fit ``CellMeans`` to ``(context, choice, reward)`` triples (an empty fit predicts 0)."""
    by_choice: dict[Hashable, list[float]] = {}
    by_cell: dict[tuple[Hashable, Hashable], list[float]] = {}
    everything: list[float] = []
    for context, choice, reward in samples:
        a = key(choice)
        by_choice.setdefault(a, []).append(reward)
        by_cell.setdefault((key(context), a), []).append(reward)
        everything.append(reward)
    return CellMeans(
        math.fsum(everything) / len(everything) if everything else 0.0,
        {a: (math.fsum(v), len(v)) for a, v in by_choice.items()},
        {c: (math.fsum(v), len(v)) for c, v in by_cell.items()})


def cross_fitted(samples: Sequence[tuple[Any, Any, float]],
                 folds: int = FOLDS) -> list[CellMeans]:
    """One model per unit, fitted on the folds the unit is not in (unit ``i`` is in fold
    ``i % folds``).

    Raises:
        TooFewSamplesError: fewer than two units per fold.
    """
    if len(samples) < 2 * folds:
        raise TooFewSamplesError(
            f"{len(samples)} decision(s): fitting a reward model with {folds}-fold "
            f"cross-fitting needs at least {2 * folds}; pass reward_model= or use snips")
    models = [fit_reward_model(s for i, s in enumerate(samples) if i % folds != k)
              for k in range(folds)]
    return [models[i % folds] for i in range(len(samples))]
