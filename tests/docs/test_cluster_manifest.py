"""docs/cluster.md's KubeRay manifest: valid YAML of a RayCluster whose head runs `ray start` and
then a `stagewise serve --launcher ray` command line that the CLI's own parser and checks take."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import yaml

from helpers.doc_examples import parse

ROOT = Path(__file__).resolve().parents[2]


def test_the_kuberay_manifest_serves_with_the_ray_launcher():
    from stagewise.cli.model_args import model_problems
    from stagewise.cli.serve import add_arguments, server_problems

    examples, problems = parse((ROOT / "docs/cluster.md").read_text(), "docs/cluster.md")
    assert not problems
    [block] = [e for e in examples if e.kind == "file" and e.file == "raycluster.yaml"]
    manifest = yaml.safe_load(block.code)
    assert manifest["kind"] == "RayCluster" and manifest["apiVersion"] == "ray.io/v1"
    [head] = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    script = " ".join(head["command"][2:] + head["args"]) if head["command"][:2] == ["/bin/bash", "-c"] else None
    assert script is not None, head["command"]
    steps = [shlex.split(s) for s in script.split("&&")]
    assert steps[0][:3] == ["ray", "start", "--head"]
    [serve] = [s for s in steps if s[:2] == ["stagewise", "serve"]]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(serve[2:])
    assert args.launcher == "ray" and args.stages >= 2
    assert model_problems(args) == [] and server_problems(args) == []
    port = {p["containerPort"] for p in head["ports"]}
    assert args.port in port
    for group in manifest["spec"]["workerGroupSpecs"]:
        assert group["replicas"] >= 1
