"""`hybridspec distill`'s settings: one flag per field. Free of torch, so the CLI reads and checks
them before training imports anything heavy."""
from __future__ import annotations

from dataclasses import dataclass

from ..common.config import Choice, check_fields, setting
from ..common.models.manifest import EAGLE_KIND, Store


class DistillKind(Choice):
    """What is distilled."""

    MODEL = "model"  # a small causal LM
    EAGLE = EAGLE_KIND  # a head drafting from the target's features


@dataclass(frozen=True)
class DistillConfig:
    """Every knob of `hybridspec distill`."""

    target: str = setting("", "target model directory, .gguf file or cached hub id")
    out: str = setting("", "directory for the compact drafter, its training samples and its report")
    kind: DistillKind = setting(DistillKind.MODEL, "model: a small causal LM; eagle: a head drafting from the "
                                                   "target's features")
    layers: int = setting(2, "decoder layers of the drafter (model kind), initialised from the target's first "
                             "layers", ge=1)
    steps: int = setting(400, "optimiser steps", ge=1)
    head_size: int = setting(8192, "vocabulary rows the drafter predicts over, most frequent first; 0 = all",
                             ge=0)
    generate: int = setting(480, "training responses the target generates (0 with data: the corpus only)", ge=0)
    data: str = setting("", 'a corpus (.txt lines, or .jsonl of {"text"}, {"prompt","response"} or '
                            '{"ids","start"}), or a train-samples.jsonl of an earlier run')
    max_new_tokens: int = setting(128, "length of each generated response", ge=1)
    temperature: float = setting(0.0, "target sampling temperature for generated data; 0 = greedy", ge=0, le=10)
    temperatures: str = setting("", 'several, comma-separated (e.g. "0,0.7"): prompts split evenly; overrides '
                                    "temperature")
    self_instruct: int = setting(0, "extra training prompts the target writes itself, then answers", ge=0)
    unroll: int = setting(2, "eagle: training passes that feed the head its own predicted features (1 = "
                             "EAGLE-1)", ge=1)
    init: str = setting("", "eagle: a plain compact drafter to start from (its layers, norm and head rows); "
                            "empty: from scratch")
    feature_loss: float = setting(1.0, "eagle: weight of the feature regression next to the KL (0 = KL only)",
                                  ge=0)
    heldout: int = setting(24, "held-out prompts (topics never seen in training) to evaluate on", ge=1)
    batch_tokens: int = setting(2048, "tokens per optimiser step", ge=1)
    lr: float = setting(1e-3, "peak learning rate (linear warm-up, cosine decay)", gt=0)
    eval_every: int = setting(50, "steps between held-out evaluations (the curve in the report)", ge=1)
    seed: int = setting(0, "seed for data, initialisation order and batches")
    device: str = setting("auto", "where to train: auto, cpu, cuda or cuda:N")
    gen_batch_size: int = setting(16, "prompts per batched target generation", ge=1)
    base: str = setting("", 'how the drafter refers to its target ("embedded:target"); empty: its absolute path')
    store: Store = setting(Store.FLOAT16, "weight storage; int8 (one scale per row) halves it")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.target or not self.out:
            raise ValueError("target and out are required")
        for t in self.sampling_temperatures:
            if not 0.0 <= t <= 10.0:
                raise ValueError(f"temperatures must be numbers in [0, 10], got {t:g}")
        if self.generate == 0 and self.self_instruct == 0 and not self.data:
            raise ValueError("nothing to train on: give --data FILE, --generate N > 0 or --self-instruct N > 0")

    @property
    def sampling_temperatures(self) -> tuple[float, ...]:
        """The temperatures generated data is split across."""
        if not self.temperatures:
            return (self.temperature,)
        try:
            return tuple(float(t) for t in self.temperatures.split(","))
        except ValueError:
            raise ValueError(f"temperatures must be comma-separated numbers, got {self.temperatures!r}") from None
