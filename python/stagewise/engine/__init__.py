"""Generation on one rank: the scheduler (stage 0 only), the sampler and its parameters, the
executor that runs a given step on any rank, and the engine (scheduler + one executor). The text of
a request (detokenisation, stop strings) is the front end's (:mod:`stagewise.frontend`)."""
