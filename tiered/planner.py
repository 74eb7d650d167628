"""Budget planner: turns gpu_budget into concrete codec parameters and resident-set sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Plan:
    budget: float | int
    layers: int

    def explain(self) -> str:
        return f"budget {self.budget} over {self.layers} tiered layers"


def plan_for_model(model, config, tiered_layers) -> Plan:
    return Plan(budget=config.gpu_budget, layers=len(tiered_layers))
