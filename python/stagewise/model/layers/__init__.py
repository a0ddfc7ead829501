"""Building blocks the architectures assemble: linears, norms, rotary, attention, MLPs, experts.

They take tensors already cut for their tensor-parallel rank by :mod:`stagewise.model.loader` and
never slice a weight themselves."""
