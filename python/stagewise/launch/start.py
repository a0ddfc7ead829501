"""The one place a launcher is chosen: the stage processes of a plan started here (``local``), on
their hosts over ssh (``ssh``) or on a Ray cluster (``ray``), handed to the driver the same way
(stages started by hand or by torchrun are attached to instead: ``Pipeline.attach``)."""

from __future__ import annotations

from stagewise.parallel.plan_options import LAUNCHERS
from stagewise.parallel.runplan import RunPlan

PLAN_OPTIONS = ("partition", "transport", "checksum", "auth_token", "threads", "interleave_size", "tls", "remeasure")
"""Pipeline's keyword arguments that make the run plan of its processes (``remeasure``: with
``partition="measured"``, each node measured again rather than its cached profile read)."""
LAUNCH_OPTIONS = ("launcher", "ray_address", "placement")
"""Pipeline's keyword arguments that say where its processes start."""


def process_options(options: dict, processes: bool, max_restarts: int) -> tuple[dict, dict]:
    """Pipeline's process options (``options``, emptied) as the plan's and the launcher's. ValueError
    for an unknown one, or for one given to a pipeline of one process."""
    plan = {k: options.pop(k) for k in PLAN_OPTIONS if k in options}
    launch = {k: options.pop(k) for k in LAUNCH_OPTIONS if k in options}
    if options:
        raise ValueError(f"Pipeline: unknown options {sorted(options)}; expected some of "
                         f"{sorted(PLAN_OPTIONS + LAUNCH_OPTIONS)}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"Pipeline: max_restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts and not processes:
        raise ValueError("Pipeline: max_restarts applies to stage processes (stages, tp or pcp > 1): one "
                         "process has no stage to restart")
    if not processes and (plan or launch):
        raise ValueError(f"Pipeline: {sorted({**plan, **launch})} apply to stages > 1 (or tp, pcp > 1), got stages=1")
    remeasure = plan.get("remeasure", False)
    if not isinstance(remeasure, bool):
        raise ValueError(f"Pipeline: remeasure must be True or False, got {remeasure!r}")
    if remeasure and plan.get("partition") != "measured":
        raise ValueError("Pipeline: remeasure applies to partition='measured' (the nodes' measured profiles), got "
                         f"partition={plan.get('partition', 'even')!r}")
    return plan, launch


def process_plan(checkpoint, model: str, stages: int, device_type: str, dtype: str, *, tp: int, dcp: int, pcp: int,
                 launch: dict, remeasure: bool = False, **options) -> RunPlan:
    """The run plan of a Pipeline's processes on this machine (``options``: the plan's): the layout
    checked against the model and each hop's transport; with ``partition="measured"`` the layers
    split by the nodes, measured by probes the run's launcher (``launch``) starts (their cached
    profiles read, unless ``remeasure``)."""
    from stagewise.launch.local import local_plan
    from stagewise.model.shapes import parallel_problems
    from stagewise.pipeline.links import hop_transports

    problems = parallel_problems(checkpoint.config, tp, dcp)
    if problems:
        raise ValueError(f"Pipeline: {problems[0]}")
    plan = local_plan(model, checkpoint.config, stages, device_type, dtype, tp=tp, dcp=dcp, pcp=pcp, **options)
    hop_transports(plan)  # a transport a hop cannot use: said before any process starts
    if plan.partition == "measured":
        from stagewise.launch.measured import measured_plan

        launch = {"launcher": "local", **launch}
        plan = measured_plan(plan, checkpoint, lambda p, **kw: start_stages(
            p, auth_token=options.get("auth_token"), **launch, **kw), token=options.get("auth_token"),
            remeasure=remeasure)
    return plan


def start_stages(plan: RunPlan, launcher: str = "local", *, auth_token: str | None = None,
                 ray_address: str | None = None, placement: str = "spread", timeout_s: float = 120.0,
                 extra=(), keep_going: bool = False, ssh: dict | None = None):
    """Start every rank of ``plan`` (``extra``: more arguments of each rank's ``stagewise stage``);
    returns the processes as the driver watches them
    (:class:`~stagewise.pipeline.driver.StageProcesses`), the plan as placed (Ray gives each stage
    its node's host) and the ranks' listen addresses, in :attr:`RunPlan.members` order. With
    ``keep_going`` a rank that fails to start leaves its error (a string) in its place instead of
    stopping them all. ``launcher`` ``ssh`` takes ``ssh``: ``program``, ``ssh`` and
    ``remote_plan`` (see :func:`stagewise.launch.multihost.ssh_spawn`)."""
    if launcher != "ray" and (ray_address is not None or placement != "spread"):
        raise ValueError("ray_address and placement apply to launcher='ray'")
    if launcher == "local":
        from stagewise.launch.local import spawn_stages

        procs, addresses = spawn_stages(plan, auth_token=auth_token, timeout_s=timeout_s, extra=extra,
                                        keep_going=keep_going)
        return procs, plan, addresses
    if launcher == "ssh":
        from stagewise.launch.multihost import ssh_spawn

        procs, addresses = ssh_spawn(plan, auth_token=auth_token, timeout_s=timeout_s, extra=extra,
                                     keep_going=keep_going, **(ssh or {}))
        return procs, plan, addresses
    if launcher == "ray":
        from stagewise.launch.ray_cluster import start_stages as ray_stages

        return ray_stages(plan, address=ray_address, placement=placement, auth_token=auth_token,
                          timeout_s=timeout_s, extra=extra, keep_going=keep_going)
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (or ssh), got {launcher!r}")

REJOIN_S = 120.0
"""How long a stage whose pipeline broke waits for the driver to come back (``--rejoin``)."""
REJOIN_ARGS = ("--rejoin", str(REJOIN_S))
"""What a stage this process starts is told so."""


def rejoins(plan: RunPlan, asked: bool, launched: bool = True) -> bool:
    """Whether a broken pipeline of ``plan`` keeps its surviving stages (started with
    :data:`REJOIN_ARGS`): asked for, and no hop over torch.distributed (that transport's one world
    over the run cannot take a new member). A stage of several ranks keeps its own world: it
    rejoins whole, or, when one of its ranks is lost, the launcher starts all of them again; so
    stages not ``launched`` here (started by hand) rejoin only when each is one rank."""
    from stagewise.parallel.groups import spans_run
    from stagewise.pipeline.links import hop_transports

    if not asked or spans_run(hop_transports(plan)):
        return False
    return launched or plan.world_size == plan.num_stages


class Restart:
    """How a pipeline's stages are started, and started again when the pipeline broke: the
    :class:`~stagewise.pipeline.recovery.Recovering` driver's ``restart``.

    When no hop runs over torch.distributed, the stages are started with ``--rejoin``: a broken
    pipeline's surviving stages keep their layers loaded (a stage of several ranks its world too),
    drop every request's KV and wait for a new driver. Then only the lost stages (the driver's
    :meth:`~stagewise.pipeline.driver.PipelineDriver.lost`; every rank of a stage that lost one)
    are started again by the local
    or Ray launcher (a lost node's stages placed again in their bundles, which Ray has moved to the
    nodes it still has), over ssh on their hosts (``stagewise launch --ssh``), or, for stages this
    process did not start (``launcher=None``: attached to, on other hosts), waited for at their
    addresses for ``rejoin_timeout_s`` (their host restarts them). Otherwise, or when that fails,
    every stage is stopped and started anew.

    ``connect(plan, addresses, processes, keep_processes, connect_timeout_s)`` makes the driver."""

    def __init__(self, plan: RunPlan, connect, *, launcher: dict | None, auth_token: str | None = None,
                 rejoin: bool = False, rejoin_timeout_s: float = REJOIN_S, log=None) -> None:
        self.plan, self.connect, self.launcher, self.auth_token, self.log = plan, connect, launcher, auth_token, log
        self.rejoin_timeout_s = rejoin_timeout_s
        self.rejoin = rejoins(plan, rejoin, launched=launcher is not None)
        """Whether a broken pipeline keeps its surviving stages (asked for, and the layout allows it)."""

    def start(self, addresses=None, processes=None, connect_timeout_s: float = 60.0):
        """The driver of a new pipeline: every stage started, or (``addresses``) stages already
        running attached to, ``processes`` watched."""
        if addresses is not None:
            return self.connect(self.plan, list(addresses), processes, self.rejoin, connect_timeout_s)
        extra = REJOIN_ARGS if self.rejoin else ()
        procs, placed, addresses = start_stages(self.plan, auth_token=self.auth_token, extra=extra, **self.launcher)
        try:
            return self.connect(placed, addresses, procs, self.rejoin, 60.0)
        except BaseException:
            procs.stop(grace_s=0.5)
            raise

    def __call__(self, old):
        """A new driver in place of ``old`` (broken); every process stopped when none can be had."""
        if self.rejoin:
            try:
                return self._repair(old)
            except Exception as err:  # noqa: BLE001 - every stage is started anew instead
                if self.launcher is None:
                    old.close(force=True)
                    raise
                if self.log is not None:
                    self.log(f"the surviving stages could not rejoin ({err}); starting every stage again")
        old.close(force=True)
        if self.launcher is None:
            raise RuntimeError("the stages were not started here: only stages that rejoin can come back")
        return self.start()

    def _repair(self, old):
        """The broken pipeline's lost stages started again (or waited for), the others kept."""
        members, addresses, procs = self.plan.members, list(old.addresses), old.processes
        old.close(force=True, keep=True)
        lost = sorted({members[i][0] for i in old.lost()})
        plan = old.plan
        if self.launcher is not None and lost:  # none found lost (a link dropped): every stage rejoins
            again = [i for i, (stage, _) in enumerate(members) if stage in lost]
            plan, got = procs.respawn(plan, again, auth_token=self.auth_token, extra=REJOIN_ARGS)
            for i, address in zip(again, got):
                addresses[i] = address
        wait_s = self.rejoin_timeout_s if self.launcher is None else 60.0
        if self.log is not None:
            self.log(f"starting stage(s) {lost} again; the others rejoin" if self.launcher is not None and lost
                     else f"waiting up to {wait_s:.0f} s for each stage to rejoin (lost: {lost})")
        return self.connect(plan, addresses, procs, True, wait_s)


__all__ = ["Restart", "process_options", "process_plan", "rejoins", "start_stages"]
