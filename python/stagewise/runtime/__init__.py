"""The single-process engine: sampling, detokenisation, scheduling."""

from stagewise.runtime.sampling import Sampler, SamplingParams, make_generator

__all__ = ["Sampler", "SamplingParams", "make_generator"]
