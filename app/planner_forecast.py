"""The planner's forecast of a measured quantity one adjustment interval ahead (app.planner_core)."""

from __future__ import annotations


class Smoother:
    """Holt's linear exponential smoothing: a level and a trend, the forecast one interval ahead is
    level + trend (never below 0). ``level`` is what a quiet interval falls back on.

        level <- a * x + (1 - a) * (level + trend)        trend <- b * (level' - level) + (1 - b) * trend
    """

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> float:
        """Take this interval's value; the forecast of the next."""
        if self.level is None:
            self.level = value
            return value
        level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
        self.level = level
        return max(0.0, level + self.trend)
