"""How fast this node is, measured: the primitives of a device profile and a node's profile.

The runtime measures a node when it splits layers by speed (``--partition measured``: each stage
leader's probe, :mod:`stagewise.launch.probe`); ``stagewise bench`` times with the same timers and
builds its full device profile (``bench profile``) from the same primitives, so the two agree.

- :mod:`~stagewise.measure.timing`: warm-up, then the median of timed calls; the copy and read
  bandwidth ceilings;
- :mod:`~stagewise.measure.primitives`: matmul FLOP/s, op overhead, the block-quantised linear per
  GGUF type, the decode attention kernel;
- :mod:`~stagewise.measure.framework`: the runtime's Python and dispatch cost per decoder layer and
  per step of each stage role, on synthetic llamas;
- :mod:`~stagewise.measure.node`: a node's profile for ``--partition measured``, cached per host,
  device, threads and GGUF types.
"""
