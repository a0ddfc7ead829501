"""The two ways a Ray launch fails before any stage starts, each a
:class:`~stagewise.launch.LaunchError` that says what to change: this process cannot join the
cluster (:func:`connect`), or the cluster cannot hold the run's stages (:func:`fit_problem`).

A cluster in Ray's token authentication mode (``RAY_AUTH_MODE=token``) refuses a driver that does
not present its token. Ray tells this process so in one of two ways: ``AuthenticationError`` when
this process is in token mode but finds no token, or, when it is not in token mode or its token
is another, a plain ``ConnectionError`` after some 20 s of retries, the cause only in Ray's own log
lines on stderr ("Unauthenticated ... InvalidAuthToken"). So while it joins a running cluster,
stderr is read (and written out again when the join succeeds), and both cases get the same
advice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any

from stagewise.launch import LaunchError
from stagewise.parallel.runplan import RunPlan

AUTH_WORDS = ("Unauthenticated", "InvalidAuthToken", "authentication token")
"""What Ray writes when a cluster refused this process's token (or its lack of one)."""
TOKEN_AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


def connect(ray, address: str | None, cpus: float = 0) -> bool:
    """Join the cluster at ``address`` (else RAY_ADDRESS; else start a local instance for the run,
    with the machine's cores as its CPUs, or ``cpus`` when the run asks for more: its ranks then
    share the cores, as local processes do). Returns whether this call connected (and so must
    disconnect, which stops an instance it started). LaunchError when it cannot."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    opts: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                                configure_logging=True)
    if address is None:
        from stagewise.launch.local import usable_cores

        # An instance of our own: no dashboard, and no metrics (nothing would scrape them).
        opts.update(num_cpus=max(usable_cores(), int(-(-cpus // 1))), object_store_memory=100 << 20,
                    _system_config={"enable_metrics_collection": False})
        try:  # "local": a new instance of our own, even where `ray start` runs a cluster on this host
            ray.init(address="local", **opts)
        except Exception as err:  # noqa: BLE001 - whatever Ray raises, it is the instance's failure
            raise LaunchError(f"--launcher ray: cannot start a Ray instance on this machine for the run: "
                              f"{_first_line(err)}") from None
        return True
    with _stderr_read() as said:
        try:
            ray.init(address=address, **opts)
            failure = None
        except Exception as err:  # noqa: BLE001 - every way of not joining gets the same words
            failure = err
    if failure is not None:
        raise LaunchError(connect_failure(address, failure, said.text)) from None
    sys.stderr.write(said.text)  # Ray's own warnings, which the user should see
    return True


def connect_failure(address: str, err: BaseException, said: str = "", env=None) -> str:
    """What to tell about ``err``, raised by joining the cluster at ``address`` (``said``: what Ray
    wrote to stderr meanwhile; ``env``: the environment, default this process's)."""
    env = os.environ if env is None else env
    head = f"--launcher ray: cannot connect to the Ray cluster at {address}: {_first_line(err)}"
    auth_lines = [line for line in said.splitlines() if any(w in line for w in AUTH_WORDS)]
    if type(err).__name__ == "AuthenticationError" or auth_lines:
        if auth_lines:  # Ray's words from the first of them on, without its log line's prefix
            line = auth_lines[-1]
            head += f" (Ray: {line[min(line.find(w) for w in AUTH_WORDS if w in line):].strip()[:200]})"
        mode = env.get("RAY_AUTH_MODE", "")
        why = ("the cluster uses Ray's token authentication, and the token here (RAY_AUTH_MODE is token) is "
               "missing or not the cluster's" if mode == "token" else
               "the cluster uses Ray's token authentication, which this process is not in (RAY_AUTH_MODE "
               f"{'is ' + repr(mode) if mode else 'is unset'})")
        return (f"{head}; {why}: run with RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (`ray "
                "get-auth-token` on the head node prints it), or in a token file (~/.ray/auth_token, or the "
                f"file RAY_AUTH_TOKEN_PATH names); see Ray's token authentication docs, {TOKEN_AUTH_DOCS}")
    return (f"{head}; check that a Ray cluster runs there (`ray status` on its head node) and that this machine "
            "reaches its port, or leave out --ray-address and RAY_ADDRESS to start a Ray instance on this machine "
            "for the run")


def _first_line(err: BaseException) -> str:
    # AuthenticationError's str() appends a paragraph of general advice; its message is the fact.
    text = str(getattr(err, "message", "") or err).strip()
    return (text.splitlines() or [type(err).__name__])[0]


class _Said:
    text = ""


@contextlib.contextmanager
def _stderr_read():
    """Everything written to this process's stderr (Ray's C++ logs included) meanwhile, into a
    temporary file: ``.text`` once the block ends."""
    said = _Said()
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to read
        yield said
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield said
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            said.text = tmp.read().decode(errors="replace")


def bundles(plan: RunPlan) -> list[dict[str, float]]:
    """Each stage's bundle: its ranks' CPUs (their threads), GPUs on a GPU stage, its ``resources``."""
    out = []
    for stage in plan.stages:
        ranks = stage.tp * plan.pcp
        bundle = {"CPU": float((stage.threads or 1) * ranks)}
        if stage.device.startswith("cuda"):
            bundle["GPU"] = float(ranks)
        out.append({**bundle, **(stage.resources or {})})
    return out


def fit_problem(plan: RunPlan, nodes: list[dict[str, float]], strategy: str) -> str | None:
    """Why no set of the cluster's live ``nodes`` (each its Ray resources) could hold ``plan``'s
    stages placed by ``strategy`` (Ray would wait forever), and what to change; None when one may."""
    need = bundles(plan)
    have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(n.items())
                               if not k.startswith(("node:", "object_store", "memory"))) for n in nodes)
    for i, bundle in enumerate(need):
        if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
            short = [k for k, v in bundle.items() if max((n.get(k, 0.0) for n in nodes), default=0.0) < v]
            return (f"--launcher ray: no node of the cluster can hold stage {i} "
                    f"({', '.join(f'{k} {v:g}' for k, v in bundle.items())}); its nodes have: {have}; "
                    + "; ".join(_node_fix(plan, i, k, nodes) for k in short or list(bundle)))
    for key in sorted({k for b in need for k in b}):
        total_need, total = sum(b.get(key, 0.0) for b in need), sum(n.get(key, 0.0) for n in nodes)
        if total_need > total:
            return (f"--launcher ray: the stages need {key} {total_need:g} in all; the cluster has {total:g} ({have}); "
                    + _total_fix(plan, key, total))
    if strategy == "STRICT_SPREAD" and len(need) > len(nodes):
        return (f"--placement strict_spread: {len(need)} stages need as many nodes; the cluster has {len(nodes)}: "
                "use --placement spread (several stages share a node where needed) or pack, or add nodes")
    return None


def _node_fix(plan: RunPlan, i: int, key: str, nodes) -> str:
    stage, ranks = plan.stages[i], plan.stages[i].tp * plan.pcp
    most = max((n.get(key, 0.0) for n in nodes), default=0.0)
    if key == "CPU":
        if ranks > most:
            return (f"its {ranks} ranks take a CPU each at least: fewer ranks a stage (--tp, --pcp), or a node with "
                    f"{ranks} CPUs (`ray start --num-cpus N`: Ray schedules by the CPUs it is told)")
        return (f"each of its {ranks} rank(s) takes as many CPUs as its threads ({stage.threads or 1}): "
                f"--threads {int(most // ranks)} (or the plan's threads), or a node with more CPUs (`ray start "
                "--num-cpus N`: Ray schedules by the CPUs it is told)")
    if key == "GPU":
        return f"a GPU stage takes a GPU a rank: fewer ranks a stage (--tp, --pcp), or a node with {ranks} GPUs"
    if key.startswith("node:"):
        return f"no live node has the address of {key!r}: correct stage {i}'s resources"
    return (f"start a node with {key!r} (`ray start --resources='{{\"{key}\": N}}'`), or take it out of stage "
            f"{i}'s resources")


def _total_fix(plan: RunPlan, key: str, total: float) -> str:
    ranks = sum(s.tp * plan.pcp for s in plan.stages)
    more = "or give the cluster more (more nodes, or `ray start --num-cpus N`: Ray schedules by the CPUs it is told)"
    if key == "CPU":
        if all((s.threads or 1) == 1 for s in plan.stages):
            fewer = (f"run at most {int(total)} ranks (fewer --stages, --tp or --pcp), " if total >= 2 else "")
            return f"every one of the {ranks} stage ranks takes 1 CPU, the least it can: {fewer}{more}"
        threads = ", ".join(str(s.threads or 1) for s in plan.stages)
        return (f"each stage rank takes as many CPUs as its threads ({threads} a stage): fewer --threads (or the "
                f"plan's threads) or stages, {more}")
    if key == "GPU":
        return "fewer GPU ranks (--stages, --tp, --pcp on cuda), or more GPUs in the cluster"
    return f"fewer stages asking for {key!r}, or more of it in the cluster"


def check_fits(ray, plan: RunPlan, strategy: str) -> None:
    """LaunchError at once for a layout no node set of the cluster could hold (:func:`fit_problem`)."""
    problem = fit_problem(plan, [n["Resources"] for n in ray.nodes() if n.get("Alive")], strategy)
    if problem is not None:
        raise LaunchError(problem)
