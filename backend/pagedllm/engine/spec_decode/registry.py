"""The registry of draft proposers: SpeculativeConfig.method -> a builder of the proposer."""

from __future__ import annotations

from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.spec_decode.proposer import Proposer


def _ngram(spec: SpeculativeConfig, config: EngineConfig, info: ModelInfo) -> Proposer:
    from pagedllm.engine.spec_decode.ngram import NgramProposer

    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _draft_model(spec: SpeculativeConfig, config: EngineConfig, info: ModelInfo) -> Proposer:
    from pagedllm.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, config, info)


PROPOSERS = {"ngram": _ngram, "draft_model": _draft_model}


def make_proposer(config: EngineConfig, info: ModelInfo) -> Proposer | None:
    spec = config.speculative_config
    return None if spec is None else PROPOSERS[spec.method](spec, config, info)
