"""The single-process engine: sampling, detokenisation, scheduling."""

from stagewise.runtime.detokenize import IncrementalDetokenizer, StopChecker
from stagewise.runtime.sampling import Sampler, SamplingParams, make_generator

__all__ = ["IncrementalDetokenizer", "Sampler", "SamplingParams", "StopChecker", "make_generator"]
