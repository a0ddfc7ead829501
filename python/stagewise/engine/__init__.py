"""Generation on one rank: the scheduler (stage 0 only), the sampler, the executor that runs a given
step on any rank, the engine (scheduler + one executor), and the front end's text (detokenisation,
stop strings)."""
