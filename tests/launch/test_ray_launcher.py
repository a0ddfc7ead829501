"""The Ray launcher on Ray's own multi-node test cluster (several raylets on this machine, each with
its own resources): SmolLM2 as three stages on three nodes answers with the single process's
tokens; `pack` puts the stages on one node; a layout the cluster cannot hold is refused at once; a
node removed mid-generation has its stage placed again and the requests end with the undisturbed
tokens, and so do 8 streams of `stagewise serve --launcher ray`; no actor, placement group or stage
process (each stage is its actor's process) is left after any of it."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from stagewise.api import Pipeline  # noqa: E402
from stagewise.launch.local import local_plan  # noqa: E402
from stagewise.launch.ray_cluster import start_stages  # noqa: E402
from stagewise.model.loader import open_checkpoint  # noqa: E402
from stagewise.pipeline.links import hop_transports  # noqa: E402

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
NODE = dict(num_cpus=2, object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"head": 1}})
    for _ in range(3):
        c.add_node(**NODE)
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference():
    with Pipeline(MODEL) as p:
        return p.generate([QUESTION] * 3, chat=True, max_new_tokens=24)


def _alive(pids: list[int], wait_s: float = 20.0) -> set[int]:
    """Those of ``pids`` (a run's actors' processes) still alive ``wait_s`` after the run ended (a
    killed actor's worker process exits a moment after Ray reports it dead)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while (left := {p for p in pids if psutil.pid_exists(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _leftovers(cluster) -> tuple[list, list]:
    """The run's actors still alive and placement groups not removed (read from the cluster)."""
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        from ray._private import state

        actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        return actors, groups
    finally:
        ray.shutdown()


def test_three_stages_on_three_nodes_answer_like_one_process(cluster, reference):
    with Pipeline(MODEL, stages=3, launcher="ray", ray_address=cluster.address, placement="strict_spread",
                  threads=1) as p:
        nodes = p.driver.processes.nodes
        assert len({n["node_id"] for n in nodes}) == 3
        assert [s.host for s in p.plan.stages] == [n["ip"] for n in nodes]
        pids = [n["pid"] for n in nodes]
        assert p.driver.pids == pids  # each stage serves in its actor's own process
        got = p.generate([QUESTION] * 3, chat=True, max_new_tokens=24)
        stats = p.last_stats["stages"]
    assert [(s["host"], s["node_id"]) for s in stats] == [(n["ip"], n["node_id"]) for n in nodes]
    assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    assert "Paris" in got[0].text
    assert not ray.is_initialized()  # the run's own connection is closed with it
    assert not _alive(pids)
    assert _leftovers(cluster) == ([], [])


def test_pack_places_every_stage_on_one_node_joined_by_shared_memory(cluster, reference):
    with Pipeline(MODEL, stages=2, launcher="ray", ray_address=cluster.address, placement="pack", threads=1) as p:
        assert len({n["node_id"] for n in p.driver.processes.nodes}) == 1
        assert set(hop_transports(p.plan)) == {"shm"}
        [got] = p.generate([QUESTION], chat=True, max_new_tokens=24)
    assert got.token_ids == reference[0].token_ids
    assert _leftovers(cluster) == ([], [])


def test_a_layout_the_cluster_cannot_hold_is_refused_at_once(cluster):
    config = open_checkpoint(MODEL).config
    with pytest.raises(RuntimeError, match="strict_spread: 5 stages need as many nodes; the cluster has 4"):
        start_stages(local_plan(MODEL, config, 5, "cpu", "auto", threads=1), address=cluster.address,
                     placement="strict_spread")
    plan = local_plan(MODEL, config, 2, "cpu", "auto", threads=1)
    plan = plan.with_stage(1, resources={"gpu-a": 1.0})
    with pytest.raises(RuntimeError, match=r"no node of the cluster can hold stage 1 \(CPU 1, gpu-a 1\)"):
        start_stages(plan, address=cluster.address)
    assert not ray.is_initialized()
    assert _leftovers(cluster) == ([], [])


def test_without_ray_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install 'stagewise\[ray\]'"):
        Pipeline(MODEL, stages=2, launcher="ray")
    with pytest.raises(ValueError, match="apply to launcher='ray'"):
        Pipeline(MODEL, stages=2, placement="pack")


def test_a_removed_node_is_replaced_and_the_requests_go_on(cluster, reference):
    """The lost node's stage is placed again on a node left; the other stages rejoin."""
    cluster.add_node(**NODE)  # one to lose, whatever other tests removed
    cluster.wait_for_nodes()
    with Pipeline(MODEL, stages=3, launcher="ray", ray_address=cluster.address, placement="spread", threads=1,
                  max_restarts=2) as p:
        nodes = p.driver.processes.nodes
        victim_id = _victim(cluster, nodes)
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
        removed = threading.Event()

        def on_text(index: int, text: str) -> None:
            if not removed.is_set():
                removed.set()
                threading.Thread(target=cluster.remove_node, args=(victim,), daemon=True).start()

        before = [(n["node_id"], a._actor_id) for n, a in zip(nodes, p.driver.processes.actors)]
        got = p.generate([QUESTION] * 3, chat=True, max_new_tokens=24, on_text=on_text)
        assert p.restarts >= 1
        after = [(n["node_id"], a._actor_id) for n, a in zip(p.driver.processes.nodes, p.driver.processes.actors)]
        assert victim_id not in {node for node, _ in after}
        # only the lost node's stage is placed again: the others keep their actors (and processes)
        assert [b == a for b, a in zip(before, after)] == [node != victim_id for node, _ in before], (before, after)
    assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in reference]
    assert _leftovers(cluster) == ([], [])


def _victim(cluster, nodes) -> str:
    """A node that holds a stage and can be removed: neither the head nor the one this process's Ray
    connection goes through (all the test cluster's nodes share one address, so that may be any)."""
    keep = {cluster.head_node.node_id, ray.get_runtime_context().get_node_id()}
    return next(n["node_id"] for n in nodes if n["node_id"] not in keep)


def test_served_streams_go_on_through_a_lost_node(cluster, reference):
    """8 concurrent streams of the server (uvicorn in a thread of this process, the driver's) while
    a node holding a stage is removed: every stream ends with the undisturbed answer."""
    import socket

    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from stagewise.serve.app import build_app

    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    pipe = Pipeline(MODEL, stages=3, launcher="ray", ray_address=cluster.address, placement="spread", threads=1,
                    max_restarts=2, max_num_seqs=8)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(pipe, model_name=MODEL), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=180)
        while not server.started:
            time.sleep(0.05)
        victim_id = _victim(cluster, pipe.driver.processes.nodes)
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
        started = threading.Event()
        texts: dict[int, str] = {}

        def stream(i: int) -> None:
            body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
                    "stream": True}
            parts = []
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            parts.append(chunk["choices"][0]["delta"].get("content", ""))
                            started.set()
            texts[i] = "".join(parts)

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in streams:
            t.start()
        assert started.wait(120)
        cluster.remove_node(victim)
        for t in streams:
            t.join(300)
        assert texts == {i: reference[0].text for i in range(8)}
        assert pipe.restarts >= 1 and client.get("/health").status_code == 200
        assert victim_id not in {n["node_id"] for n in pipe.driver.processes.nodes}
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        pipe.close()
    assert _leftovers(cluster) == ([], [])


def test_stages_on_ray_nodes_talk_mutual_tls(cluster, reference, tmp_path):
    """Stages placed on the cluster's nodes listen on the node's address, not loopback: with the
    plan's tls every TCP link (hops forced onto TCP, the driver's controls) is mutual TLS."""
    import ssl

    pytest.importorskip("cryptography")
    from stagewise.bench.transport.certs import make_pki

    pki = make_pki(tmp_path)
    cert, key = pki["stage"]
    with Pipeline(MODEL, stages=2, launcher="ray", ray_address=cluster.address, placement="strict_spread", threads=1,
                  transport="tcp", tls={"cert": cert, "key": key, "ca": pki["ca"]}) as p:
        assert all(isinstance(c._sock, ssl.SSLSocket) for c in p.driver.controls)
        [got] = p.generate([QUESTION], chat=True, max_new_tokens=24)
    assert got.token_ids == reference[0].token_ids
    assert _leftovers(cluster) == ([], [])


def test_doctor_and_launch_preflight_on_the_cluster(cluster, tmp_path, capsys):
    """`stagewise doctor --launcher ray` probes every placed rank and hop; `stagewise launch
    --launcher ray` runs the same checks before it starts the stages."""
    from stagewise.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(f"model: {MODEL}\nlauncher: ray\nplacement: strict_spread\npartition: even\n"
                    "stages:\n  - {threads: 1}\n  - {threads: 1}\n")
    assert main(["doctor", str(plan), "--ray-address", cluster.address, "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert {c["what"] for c in checks} >= {"probe started", "model", "hop", "gloo/NCCL interface"}
    assert all(c["ok"] for c in checks) and len([c for c in checks if c["what"] == "hop"]) == 2
    assert main(["launch", str(plan), "--ray-address", cluster.address, "--prompt", QUESTION, "--chat",
                 "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "preflight: " in err and "checks passed" in err
    assert _leftovers(cluster) == ([], [])


def test_without_a_node_to_take_the_stage_the_requests_end_naming_it(cluster):
    """strict_spread over every node: once one is gone the stages cannot be placed again, so the
    running requests end with an error that names the stage and why, and the pipeline says broken."""
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        alive = sum(1 for n in ray.nodes() if n["Alive"])
    finally:
        ray.shutdown()
    with Pipeline(MODEL, stages=alive, launcher="ray", ray_address=cluster.address, placement="strict_spread",
                  threads=1, max_restarts=2) as p:
        victim_id = _victim(cluster, p.driver.processes.nodes)
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == victim_id)
        stage = next(i for i, n in enumerate(p.driver.processes.nodes) if n["node_id"] == victim_id)
        removed = threading.Event()

        def on_text(index: int, text: str) -> None:
            if not removed.is_set():
                removed.set()
                threading.Thread(target=cluster.remove_node, args=(victim,), daemon=True).start()

        [got] = p.generate([QUESTION], chat=True, max_new_tokens=64, ignore_eos=True, on_text=on_text)
        assert got.finish_reason == "error"
        assert f"stage {stage}" in got.error and "strict_spread" in got.error, got.error
        assert p.broken and "starting the pipeline again failed" in p.broken
    assert _leftovers(cluster) == ([], [])


def test_a_measured_split_on_ray_runs_where_it_was_measured(cluster, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with Pipeline(MODEL, stages=2, launcher="ray", ray_address=cluster.address, placement="spread", threads=1,
                  partition="measured") as p:
        assert p.plan.partition == "measured"
        for stage, node in zip(p.plan.stages, p.driver.processes.nodes):
            assert stage.resources == {f"node:{node['ip']}": 0.001}
        [got] = p.generate([QUESTION], chat=True, max_new_tokens=24)
    assert got.token_ids == reference[0].token_ids
    assert _leftovers(cluster) == ([], [])


def test_gpu_stages_are_placed_by_their_gpus(cluster):
    """A node that declares two GPUs to Ray (this machine has none): two stages on ``cuda`` are
    placed there, each leader's actor holding a GPU of its own that Ray assigned; past placement
    each stage finds no CUDA device and says so, naming itself, and nothing is left. A driver with
    no GPU of its own (a cluster's head) starts such a run all the same."""
    node = cluster.add_node(**NODE, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        plan = local_plan(MODEL, open_checkpoint(MODEL).config, 2, "cuda", "auto", threads=1)
        stages, placed, addresses = start_stages(plan, address=cluster.address)
        try:
            assert {n["node_id"] for n in stages.nodes} == {node.node_id}
            assert sorted(g for n in stages.nodes for g in n["gpus"]) == ["0", "1"]
            assert [s.device for s in placed.stages] == ["cuda:0", "cuda:0"] and len(addresses) == 2
        finally:
            stages.stop(grace_s=1.0)  # each waits for a driver to tell why it cannot load: none comes
        with pytest.raises(RuntimeError, match=r"stage \d.*0 CUDA device\(s\)"):
            Pipeline(MODEL, stages=2, device="cuda", launcher="ray", ray_address=cluster.address, threads=1)
        assert not ray.is_initialized()
        assert _leftovers(cluster) == ([], [])
    finally:
        cluster.remove_node(node)


CTRL_C = """
import os, signal, sys
from stagewise.api import Pipeline

def strike(_index, _text):
    os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: the driver's process group (Ray's actors are not in it)

pipe = Pipeline(sys.argv[1], stages=2, launcher="ray", ray_address=sys.argv[2], threads=1)
print("PIDS", *[n["pid"] for n in pipe.driver.processes.nodes], flush=True)
try:
    with pipe:
        pipe.generate(["Once upon a time"], max_new_tokens=200, ignore_eos=True, on_text=strike)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_mid_generation_removes_every_actor_and_the_placement_group(cluster):
    import subprocess

    from helpers.processes import ended_by_ctrl_c

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, MODEL, cluster.address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = proc.stdout.readline().split()
    ended_by_ctrl_c(proc, 120)
    assert first and first[0] == "PIDS", first
    assert not _alive([int(pid) for pid in first[1:]])
    assert _leftovers(cluster) == ([], [])
