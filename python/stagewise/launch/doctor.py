"""``stagewise doctor PLAN``: a multi-host run checked in seconds, before any weight loads.

The launcher of the run (printed commands, ``--ssh``, ``--launcher ray``; locally when every stage
is on this machine) starts a probe (:mod:`stagewise.launch.probe`) in place of every stage rank.
Then, from here and from the probes themselves:

- each probe started and bound its listen address (a port taken, or not allowed, is named);
- each host runs a stagewise of this version and protocol;
- the plan's model is readable on every host at the plan's path, with this host's fingerprint;
- each hop's address is reachable in its direction (stage i -> i + 1, the last -> 0), and this
  host reaches every rank (the driver's links), each with its round trip and bandwidth;
- the interface each host reaches this one by (gloo's and NCCL's pick for the stage's group),
  and ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` where set.

Every check is a :class:`Check` row: what, where, whether it passed, and for a failure what to
change. ``stagewise launch --ssh`` and ``--launcher ray`` run it first (``--no-preflight`` skips).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from stagewise.launch.probe import Connection, measure, say_bye
from stagewise.parallel.runplan import PROTOCOL_VERSION, RunPlan


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    where: str
    ok: bool
    detail: str
    fix: str = ""


def diagnose(plan: RunPlan, addresses: list[tuple[str, int] | str], *, fingerprint: str | None,
             timeout: float = 10.0, token: str | None = None) -> list[Check]:
    """The checks of the probes at ``addresses`` (one per :attr:`RunPlan.members`; a string
    instead says why that probe did not start). ``fingerprint``: the model's as read here (None
    when this host cannot read it). ``token``: the run's shared secret, which the probes ask for."""
    from stagewise import version

    checks: list[Check] = []
    members = plan.members
    labels = [plan.member_label(s, r) for s, r in members]
    reports: dict[int, dict] = {}
    for i, ((index, rank), address) in enumerate(zip(members, addresses)):
        where = f"{labels[i]} on {plan.stages[index].host}"
        if isinstance(address, str):
            checks.append(Check("probe started", where, False, address,
                                _start_fix(address, plan.stages[index].rank_listen(rank))))
            continue
        try:
            with Connection(address, token, timeout) as c:
                report = c.ask({"op": "report"})
            if not isinstance(report, dict) or not {"stagewise", "protocol", "python", "model"} <= set(report):
                raise ValueError(f"not a stagewise probe's report: {str(report)[:200]}")
            reports[i] = report
            checks.append(Check("probe started", where, True, f"listening on {address[0]}:{address[1]}"))
        except (OSError, ValueError) as err:
            if "auth token" in str(err):  # the probe refused: the run's token was not proven
                checks.append(Check("auth token", where, False, str(err),
                                    "give the doctor the stages' token: --auth-token or STAGEWISE_AUTH_TOKEN"))
                continue
            checks.append(Check("driver -> rank", where, False, f"{address[0]}:{address[1]}: {err}",
                                "open this port to the driver's host (firewall), or listen on an address it reaches"))
            continue
        same = report["stagewise"] == version.__version__ and report["protocol"] == PROTOCOL_VERSION
        checks.append(Check("stagewise version", where, same,
                            f"{report['stagewise']} (protocol {report['protocol']}, Python {report['python']}, torch "
                            f"{report.get('torch', '?')}); here {version.__version__} (protocol {PROTOCOL_VERSION})",
                            "" if same else f"install stagewise {version.__version__} on {report['host']}"))
        if "model_error" in report:
            checks.append(Check("model", where, False, f"{report['model']}: {report['model_error']}",
                                f"make {report['model']!r} readable on {report['host']} (the plan's path is every "
                                "host's)"))
        elif fingerprint is not None and report["fingerprint"] != fingerprint:
            checks.append(Check("model", where, False, f"fingerprint {report['fingerprint']}, here {fingerprint}",
                                f"the model at {report['model']!r} on {report['host']} differs from this host's: copy "
                                "the same files"))
        else:
            checks.append(Check("model", where, True, f"{report['model']} (fingerprint {report['fingerprint']})"))
        try:
            m = measure(*address, timeout=timeout, token=token)
            checks.append(Check("driver -> rank", where, True, f"rtt {m['rtt_ms']:.2f} ms, {m['gbps']:.2f} GB/s"))
        except (OSError, ValueError) as err:
            checks.append(Check("driver -> rank", where, False, str(err), "open this port to the driver's host"))
        toward = report.get("toward_asker", {})
        names = report.get("socket_ifname") or {}
        detail = f"{toward.get('interface') or '?'} ({toward.get('address')})" + "".join(
            f"; {k}={v}" for k, v in names.items())
        checks.append(Check("gloo/NCCL interface", where, True, detail))
    checks += _hops(plan, addresses, reports, labels, timeout, token)
    return checks


def _hops(plan: RunPlan, addresses, reports: dict[int, dict], labels: list[str], timeout: float,
          token: str | None) -> list[Check]:
    """Each stage's leader measures its outgoing hop (to the next stage's leader, the last to 0's)."""
    out = []
    n, members = plan.num_stages, plan.members
    if n < 2:
        return out
    for a in range(n):
        b = (a + 1) % n
        i, j = members.index((a, 0)), members.index((b, 0))
        where = f"stage {a} ({plan.stages[a].host}) -> stage {b} ({plan.stages[b].host})"
        if i not in reports or j not in reports:
            out.append(Check("hop", where, False, "not measured: a probe did not start or answer"))
            continue
        host, port = addresses[j]
        try:
            with Connection(addresses[i], token, timeout) as c:
                got = c.ask({"op": "probe", "host": host, "port": port})
        except (OSError, ValueError) as err:
            got = {"ok": False, "error": str(err)}
        if got.get("ok"):
            out.append(Check("hop", where, True, f"{host}:{port}: rtt {got['rtt_ms']:.2f} ms, {got['gbps']:.2f} GB/s"))
        else:
            out.append(Check("hop", where, False, f"{host}:{port}: {got.get('error')}",
                             f"let {plan.stages[a].host} reach {host}:{port} (firewall, routing), or listen on an "
                             f"address it reaches (stages[{b}].listen)"))
    return out


def _start_fix(why: str, listen: str) -> str:
    if "cannot listen" in why:
        return f"free {listen} on that host, or give the stage another listen address"
    if "before listening" in why or "unrecognized arguments" in why:
        return "install a stagewise with `stage --probe` (this version) on that host"
    return "check that host's stagewise installation and the launcher's access to it"


def own_fingerprint(plan: RunPlan) -> tuple[str | None, str | None]:
    """This host's fingerprint of the plan's model, or why it cannot read it (what a probe reports
    of its own host)."""
    from stagewise.launch.probe import host_report

    report = host_report(plan)
    return report.get("fingerprint"), report.get("model_error")


def table(checks: list[Check], plan: RunPlan, here_error: str | None = None) -> str:
    rows = [("check", "where", "", "result")]
    if here_error:
        rows.append(("model", f"this host ({socket.gethostname()})", "FAIL", here_error))
    for c in checks:
        rows.append((c.what, c.where, "ok" if c.ok else "FAIL", c.detail + (f"  -> {c.fix}" if c.fix else "")))
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join(r[k].ljust(widths[k]) for k in range(3)) + "  " + r[3] for r in rows]
    bad = sum(not c.ok for c in checks) + bool(here_error)
    lines.append(f"{len(checks) + bool(here_error)} checks of {plan.num_stages} stages, {bad} failed")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def wait_for(addresses: list[tuple[str, int]], timeout: float) -> list[tuple[str, int] | str]:
    """Probes started by hand (printed commands): each address once it accepts, or why not."""
    deadline = time.monotonic() + timeout
    out: list[tuple[str, int] | str] = []
    for address in addresses:
        while True:
            try:
                socket.create_connection(address, timeout=1.0).close()
                out.append(address)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    out.append(f"nothing accepts on {address[0]}:{address[1]} ({err})")
                    break
                time.sleep(0.2)
    return out



def run_doctor(plan: RunPlan, launcher: str | None, *, timeout_s: float = 60.0, auth_token: str | None = None,
               here: Sequence[int] = (), **start) -> tuple[list[Check], str | None]:
    """Start the probes with ``launcher`` (``local``, ``ssh``, ``ray``; None: they were started by
    hand, from the printed commands, at the plan's addresses, but for members ``here``, indices of
    :attr:`RunPlan.members` on this machine, which start here), check, and stop them. Returns the
    checks and why this host cannot read the model (None when it can)."""
    from stagewise.launch.start import start_stages

    fingerprint, here_error = own_fingerprint(plan)
    procs, placed = None, plan
    if launcher is None:
        from stagewise.launch.here import start_here

        deadline = time.monotonic() + timeout_s  # for them all, started here or by hand
        procs, addresses = start_here(plan, here, auth_token=auth_token, timeout_s=timeout_s, extra=["--probe"],
                                      keep_going=True)
        away = [i for i in range(len(addresses)) if i not in here]
        try:
            for i, got in zip(away, wait_for([addresses[i] for i in away], max(0.5, deadline - time.monotonic()))):
                addresses[i] = got
        except BaseException:
            procs.stop(0.5)
            raise
    else:
        try:
            procs, placed, addresses = start_stages(plan, launcher, extra=["--probe"], keep_going=True,
                                                    timeout_s=timeout_s, auth_token=auth_token, **start)
        except (RuntimeError, TimeoutError, OSError, ValueError) as err:
            return [Check("probes started", f"{launcher} launcher", False, str(err))], here_error
    try:
        return diagnose(placed, addresses, fingerprint=fingerprint, token=auth_token), here_error
    finally:
        say_bye(addresses, auth_token)
        if procs is not None:
            procs.stop(2.0)
