"""The container and its cluster recipes, read as their tools would (no Docker daemon or Kubernetes here): the
Dockerfile's instructions (a pinned base image, the lock, the trainer as entry point), the JobSet's fields
(jobset.x-k8s.io/v1alpha2: restart policy, GPU requests, a memory-backed /dev/shm), the sbatch script, all three
naming one image tag, and docs/multiprocess.md showing the two recipes as they are."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
#: Docker's instructions (https://docs.docker.com/reference/dockerfile/)
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each instruction, continuation lines joined, comments left out."""
    out, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word, rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def image_tag() -> str:
    """The tag the Dockerfile's header says to build (``docker build -t NAME:TAG .``)."""
    m = re.search(r"^#\s+docker build -t (\S+) \.$", (REPO / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile's header shows no `docker build -t NAME:TAG .`"
    return m[1]


def test_the_dockerfile_is_well_formed_and_installs_the_lock_with_the_trainer_as_entry_point():
    steps = dockerfile()
    words = [w for w, _ in steps]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    assert words[0] == "FROM" and words.count("FROM") == 1
    base = steps[0][1]
    name, _, tag = base.rpartition(":")
    assert name == "nvidia/cuda" and re.fullmatch(r"\d+\.\d+\.\d+-base-ubuntu\d+\.\d+", tag), base  # pinned, no latest
    for word, args in steps:
        if word == "COPY":
            *sources, _ = shlex.split(args)
            assert all((REPO / s).exists() for s in sources), f"COPY {args}: a source the repository lacks"
    copied = [shlex.split(a)[0] for w, a in steps if w == "COPY"]
    assert "requirements/lock.txt" in copied and "pyproject.toml" in copied
    installs = [a for w, a in steps if w == "RUN" and "pip install" in a and "-e " in a]
    assert len(installs) == 1 and '".[cuda13]" -c requirements/lock.txt' in installs[0], installs
    entry = [a for w, a in steps if w == "ENTRYPOINT"]
    assert entry == ['["multimesh-train"]']
    env = " ".join(a for w, a in steps if w == "ENV")
    assert "MULTIMESH_PLATFORM=gpu" in env and "PATH=/opt/venv/bin:$PATH" in env
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert image_tag() == f"multimesh:{version}-cuda13"


def test_the_jobset_restarts_its_processes_together_with_gpus_and_shared_memory():
    docs = list(yaml.safe_load_all((REPO / "deploy" / "jobset.yaml").read_text()))
    assert len(docs) == 1
    js = docs[0]
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name, spec = js["metadata"]["name"], js["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    policy = spec["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert [(r["action"], r["onJobFailureReasons"]) for r in policy["rules"]] == [("FailJobSet", ["PodFailurePolicy"])]
    [rjob] = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0  # one failing pod fails the Job: the JobSet restarts every process
    [rule] = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"] == {"containerName": "train", "operator": "In",
                                                                   "values": [2]}
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    [train] = pod["containers"]
    assert train["name"] == "train"
    assert train["image"].endswith("/" + image_tag())
    assert (REPO / "configs" / f"{train['args'][0]}.yaml").is_file()
    env = {e["name"]: e["value"] for e in train["env"]}
    assert env["MULTIMESH_NUM_PROCESSES"] == str(job["parallelism"] * rjob["replicas"])
    assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{name}-{rjob['name']}-0-0.{name}:")
    res = train["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] >= 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in train["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and re.fullmatch(r"\d+Gi", shm["sizeLimit"])
    out_dir = next(a.split("=", 1)[1] for a in train["args"] if a.startswith("train.out_dir="))
    shared = [p for p in mounts if out_dir.startswith(p + "/")]
    assert shared and "persistentVolumeClaim" in volumes[mounts[shared[0]]]  # one out_dir every pod sees


def test_the_sbatch_script_runs_the_image_and_is_requeued():
    path = REPO / "deploy" / "train.sbatch"
    text = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert {"nodes", "ntasks-per-node", "gpus-per-node", "requeue"} <= set(options)
    assert options["ntasks-per-node"] == options["gpus-per-node"]  # one process per GPU
    name, _, tag = image_tag().partition(":")
    assert f"#{name}:{tag}" in text and "srun --container-image=" in text and "multimesh-train" in text


def test_the_guide_shows_the_recipes_as_they_are():
    guide = (REPO / "docs" / "multiprocess.md").read_text()
    for recipe, lang in (("jobset.yaml", "yaml"), ("train.sbatch", "bash")):
        assert f"```{lang}\n{(REPO / 'deploy' / recipe).read_text()}```" in guide, f"docs/multiprocess.md: {recipe}"
