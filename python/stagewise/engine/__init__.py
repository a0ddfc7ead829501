"""Generation on one rank: the scheduler (stage 0 only), the sampler, detokenisation, the
executor that runs a given step on any rank, and the engine (scheduler + one executor)."""

from stagewise.engine.detokenize import IncrementalDetokenizer, StopChecker
from stagewise.engine.sampling import Sampler, SamplingParams, make_generator

__all__ = ["IncrementalDetokenizer", "Sampler", "SamplingParams", "StopChecker", "make_generator"]
