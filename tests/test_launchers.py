"""Launchers start a multi-process run with no per-process flags: SLURM's srun, Open MPI's mpirun, a
Kubernetes indexed Job (`multimesh.distributed.find_launch`, `initialize()`, ``multimesh-train CONFIG``).

The default suite reads each launcher's variables as it sets them, in this process (milliseconds): the
place found, arguments winning over variables, and variables that do not fit together (a StartupError
naming the variable and its value). The slow tests start the trainer's 2-stage pipeline as 2 processes
on this machine: with the variables srun sets, by a real ``srun -n 2`` (a one-node SLURM cluster of
Debian's slurm-wlm started for the test, as root), by a real ``mpirun -np 2`` (Debian's openmpi-bin),
and with a Kubernetes indexed Job's variables; each must exit 0, and process 0's summary says the last
step. .ci/setup.sh installs both packages where apt-get can. The tests pick free ports, bound their
time, and end only the processes they started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port, run_commands

from multimesh.distributed import StartupError, find_launch, initialize

REPO = Path(__file__).resolve().parent.parent
#: every variable a launcher sets that multimesh or JAX's detection reads
LAUNCHER_VARIABLE = re.compile(r"SLURM_|OMPI_|PMIX_|JOB_COMPLETION_INDEX$|MULTIMESH_NUM_PROCESSES$|JAX_COORDINATOR|"
                               r"JAX_LOCAL_DEVICE_IDS$|KUBERNETES_SERVICE_HOST$|TPU_|MEGASCALE_")


def srun_variables(task: int, ntasks: int, *, job_id: int, node: str) -> dict[str, str]:
    """What srun sets in task ``task`` of a one-node job step of ``ntasks`` tasks (srun(1), "OUTPUT
    ENVIRONMENT VARIABLES"; Slurm 22.05)."""
    n = str(ntasks)
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": "train",
            "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_CLUSTER_NAME": "cluster",
            "SLURM_JOB_NODELIST": node, "SLURM_NODELIST": node, "SLURM_STEP_NODELIST": node,
            "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NTASKS": n, "SLURM_NPROCS": n, "SLURM_STEP_NUM_TASKS": n, "SLURM_TASKS_PER_NODE": n,
            "SLURM_STEP_TASKS_PER_NODE": n, "SLURM_JOB_CPUS_PER_NODE": n, "SLURM_CPUS_ON_NODE": n,
            "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0",
            "SLURM_GTIDS": ",".join(str(i) for i in range(ntasks)), "SLURM_DISTRIBUTION": "cyclic",
            "SLURMD_NODENAME": node, "SLURM_TOPOLOGY_ADDR": node, "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
            "SLURM_SUBMIT_HOST": node, "SLURM_SUBMIT_DIR": str(REPO), "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
            "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_PRIO_PROCESS": "0", "SLURM_UMASK": "0022"}


def mpirun_variables(rank: int, size: int) -> dict[str, str]:
    """What Open MPI 4's mpirun sets in rank ``rank`` of ``size`` on one host (as `mpirun -np 2 env` shows)."""
    return {"OMPI_MCA_orte_hnp_uri": "1105985536.0;tcp://192.0.2.2:46079;tcp6://[fd00::2]:38849",
            "OMPI_MCA_ess_base_jobid": "1105985537", "OMPI_MCA_ess_base_vpid": str(rank), "OMPI_MCA_ess": "^singleton",
            "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank), "OMPI_UNIVERSE_SIZE": str(size), "PMIX_RANK": str(rank)}


def indexed_job_variables(index: int, count: int, coordinator: str) -> dict[str, str]:
    """A pod of a Kubernetes indexed Job (a JobSet's): the Job controller sets JOB_COMPLETION_INDEX; the
    pod template (docs/multiprocess.md) the count and the coordinator."""
    return {"JOB_COMPLETION_INDEX": str(index), "MULTIMESH_NUM_PROCESSES": str(count),
            "JAX_COORDINATOR_ADDRESS": coordinator, "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0",
            "HOSTNAME": f"train-workers-0-{index}"}


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables in this process (no other launcher's left over)."""
    for name in list(os.environ):
        if LAUNCHER_VARIABLE.match(name):
            monkeypatch.delenv(name)

    def launch(variables: dict[str, str]) -> None:
        for k, v in variables.items():
            monkeypatch.setenv(k, v)
    return launch


# -- the place each launcher gives (default suite) ---------------------------------------------------


def test_no_launcher_and_no_arguments_is_one_process(launched):
    assert find_launch() is None
    with pytest.raises(StartupError, match=r"no coordinator_address.*no launcher found.*srun, mpirun"):
        initialize()


@pytest.mark.parametrize("task", [0, 1])
def test_srun_variables_give_the_place(launched, task):
    """The first node of the step is the coordinator, on JAX's port for the job (JAX_COORDINATOR_PORT wins)."""
    launched(srun_variables(task, 2, job_id=4321, node="localhost"))
    launch = find_launch()
    assert (launch.launcher, launch.num_processes, launch.process_id) == ("SLURM", 2, task)
    assert launch.coordinator_address == f"localhost:{61440 + 4321 % 4096}"
    assert launch.local_device_ids == [task]  # one GPU per process, as JAX chooses under srun
    assert "SLURM_PROCID" in launch.sources["process_id"] and "SLURM_NTASKS" in launch.sources["num_processes"]
    launched({"JAX_COORDINATOR_PORT": "5000", "SLURM_STEP_NODELIST": "localhost,node[2-3]"})
    assert find_launch().coordinator_address == "localhost:5000"


def test_each_launcher_names_the_job_its_processes_belong_to(launched):
    """The launcher's job id is the run id by default (`initialize`): the processes of one job share it, and
    two jobs started on one coordinator port have different ones, so the roll call refuses their mix."""
    ids = {}
    for job in (4321, 4322):
        for task in (0, 1):
            launched(srun_variables(task, 2, job_id=job, node="localhost"))
            ids[job, task] = find_launch().job_id
    assert ids[4321, 0] == ids[4321, 1] == "SLURM_JOB_ID=4321.SLURM_STEP_ID=0" != ids[4322, 0]
    launched(srun_variables(0, 2, job_id=4321, node="localhost") | {"SLURM_STEP_ID": "1"})
    assert find_launch().job_id != ids[4321, 0]  # another step of the job is another run
    for name in list(os.environ):
        if LAUNCHER_VARIABLE.match(name):
            os.environ.pop(name)
    launched(mpirun_variables(1, 2))
    assert find_launch().job_id == "OMPI_MCA_ess_base_jobid=1105985537"
    assert find_launch("localhost:1234", 2, 0).job_id == "OMPI_MCA_ess_base_jobid=1105985537"


def test_arguments_win_over_the_launcher(launched):
    launched(srun_variables(1, 2, job_id=7, node="localhost"))
    launch = find_launch("127.0.0.1:6000", process_id=0)
    assert (launch.coordinator_address, launch.num_processes, launch.process_id) == ("127.0.0.1:6000", 2, 0)
    assert launch.sources["process_id"] == "argument"


@pytest.mark.parametrize("rank", [0, 1])
def test_mpirun_variables_give_the_place(launched, rank):
    """Open MPI 4: the coordinator is mpirun's host (in OMPI_MCA_orte_hnp_uri), on a port from its job id."""
    launched(mpirun_variables(rank, 2))
    launch = find_launch()
    assert (launch.launcher, launch.num_processes, launch.process_id) == ("Open MPI", 2, rank)
    assert launch.coordinator_address == f"192.0.2.2:{61440 + (1105985536 // 4096) % 4096}"


@pytest.mark.parametrize("index", [0, 1])
def test_indexed_job_variables_give_the_place(launched, index):
    launched(indexed_job_variables(index, 2, "localhost:1234"))
    launch = find_launch()
    assert (launch.launcher, launch.coordinator_address, launch.num_processes, launch.process_id) == (
        "Kubernetes indexed Job", "localhost:1234", 2, index)
    assert launch.local_device_ids is None  # a pod sees its own devices


def test_an_indexed_job_without_a_count_is_not_a_run(launched):
    """JOB_COMPLETION_INDEX alone is any indexed Job's pod (a batch of independent tasks): one process."""
    launched({"JOB_COMPLETION_INDEX": "3"})
    assert find_launch() is None


BAD = [
    ("srun", {"SLURM_PROCID": "2"}, "SLURM_PROCID='2' is outside 0..1"),
    ("srun", {"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is below 1"),
    ("srun", {"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
    ("srun", {"SLURM_LOCALID": "-1"}, "SLURM_LOCALID='-1' is outside 0..1"),
    ("srun", {"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not an integer"),
    ("srun", {"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST='' names no host"),
    ("srun", {"SLURM_STEP_NODELIST": ",node2"}, "SLURM_STEP_NODELIST=',node2' names no host"),
    ("srun", {"SLURM_STEP_NODELIST": "[1-4]"}, r"SLURM_STEP_NODELIST='\[1-4\]' names no host"),
    ("srun", {"SLURM_STEP_NODELIST": "nohost.invalid"},
     "the coordinator's host 'nohost.invalid' .*SLURM_STEP_NODELIST='nohost.invalid'.* does not resolve"),
    ("srun", {"JAX_COORDINATOR_PORT": "70000"}, "JAX_COORDINATOR_PORT='70000' is outside 1..65535"),
    ("mpirun", {"OMPI_COMM_WORLD_RANK": "5"}, "OMPI_COMM_WORLD_RANK='5' is outside 0..1"),
    ("mpirun", {"OMPI_COMM_WORLD_SIZE": "0"}, "OMPI_COMM_WORLD_SIZE='0' is below 1"),
    ("mpirun", {"OMPI_MCA_orte_hnp_uri": "1105985536.0;"}, "OMPI_MCA_orte_hnp_uri='1105985536.0;' names no"),
    ("job", {"JOB_COMPLETION_INDEX": "2"}, "JOB_COMPLETION_INDEX='2' is outside 0..1"),
    ("job", {"MULTIMESH_NUM_PROCESSES": "none"}, "MULTIMESH_NUM_PROCESSES='none' is not an integer"),
    ("job", {"JAX_COORDINATOR_ADDRESS": "train-workers-0-0.train"},
     "JAX_COORDINATOR_ADDRESS='train-workers-0-0.train' is not HOST:PORT"),
]


@pytest.mark.parametrize("launcher, wrong, message", BAD, ids=[f"{b[0]}-{next(iter(b[1]))}" for b in BAD])
def test_variables_that_do_not_fit_together_name_the_variable(launched, launcher, wrong, message):
    variables = {"srun": srun_variables(1, 2, job_id=99, node="localhost"), "mpirun": mpirun_variables(1, 2),
                 "job": indexed_job_variables(1, 2, "localhost:1234")}[launcher]
    launched({**variables, **wrong})
    with pytest.raises(StartupError, match=message):
        find_launch()
    with pytest.raises(StartupError, match=message):  # before anything starts
        initialize(initialization_timeout=5)


def test_an_indexed_job_without_a_coordinator_says_what_to_set(launched):
    variables = indexed_job_variables(1, 2, "")
    del variables["JAX_COORDINATOR_ADDRESS"]
    launched(variables)
    with pytest.raises(StartupError, match=r"JOB_COMPLETION_INDEX='1'.*needs JAX_COORDINATOR_ADDRESS=HOST:PORT"):
        find_launch()


HALF_SET = [
    ("mpirun", "OMPI_COMM_WORLD_LOCAL_RANK", r"OMPI_COMM_WORLD_LOCAL_RANK is not set.*mpirun"),
    ("mpirun", "OMPI_COMM_WORLD_SIZE", r"OMPI_COMM_WORLD_SIZE is not set.*mpirun"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", r"OMPI_COMM_WORLD_RANK is not set.*mpirun"),
    ("srun", "SLURM_LOCALID", r"SLURM_LOCALID is not set.*srun"),
    ("srun", "SLURM_PROCID", r"SLURM_PROCID is not set.*srun"),
    ("srun", "SLURM_NTASKS", r"SLURM_NTASKS is not set.*srun"),
    ("srun", "SLURM_STEP_NODELIST", r"SLURM_STEP_NODELIST is not set.*srun"),
    ("job", "MULTIMESH_NUM_PROCESSES", 
     r"JOB_COMPLETION_INDEX='1'.*no process count: MULTIMESH_NUM_PROCESSES is not set"),
]


@pytest.mark.parametrize("launcher, missing, message", HALF_SET, ids=[f"{b[0]}-{b[1]}" for b in HALF_SET])
def test_a_launcher_variable_missing_is_named(launched, launcher, missing, message):
    """A launcher's variables half set (one of those JAX reads missing) are a StartupError naming the one
    missing, not a bare KeyError, nor a run that goes on as one process."""
    variables = {"srun": srun_variables(1, 2, job_id=99, node="localhost"), "mpirun": mpirun_variables(1, 2),
                 "job": indexed_job_variables(1, 2, "localhost:1234")}[launcher]
    del variables[missing]
    launched(variables)
    with pytest.raises(StartupError, match=message):
        find_launch()


def test_a_slurm_allocation_outside_a_job_step_is_one_process(launched):
    """A batch script or an salloc shell (no job step's variables) runs one process, as before."""
    variables = srun_variables(0, 2, job_id=99, node="localhost")
    launched({k: v for k, v in variables.items() if not k.startswith(("SLURM_STEP", "SLURM_LOCALID"))})
    assert find_launch() is None


@pytest.mark.parametrize("drop", [("OMPI_COMM_WORLD_LOCAL_RANK",), tuple(k for k in mpirun_variables(0, 1)
                                                                         if k.startswith("OMPI_"))])
def test_pmix_variables_without_open_mpi_s_name_what_is_missing_and_mpi4py(launched, drop):
    """Open MPI 5's mpirun (PMIx, no ORTE address) with OMPI_COMM_WORLD_LOCAL_RANK missing: JAX detects no
    launcher; the error names the PMIx variables seen, the one missing, and mpi4py."""
    variables = {k: v for k, v in mpirun_variables(1, 2).items() if k not in drop and k != "OMPI_MCA_orte_hnp_uri"}
    launched(variables | {"PMIX_NAMESPACE": "prterun-node1-4242@1"})
    with pytest.raises(StartupError, match=r"PMIX_NAMESPACE='prterun-node1-4242@1'.*PMIX_RANK='1'.*"
                                           r"OMPI_COMM_WORLD_LOCAL_RANK.*not set.*mpi4py") as raised:
        find_launch()
    assert "cluster_detection_method='mpi4py'" in str(raised.value)


def test_the_trainer_names_a_missing_launcher_variable(launched, capsys):
    from trainers.cli import main

    variables = mpirun_variables(1, 2)
    del variables["OMPI_COMM_WORLD_LOCAL_RANK"]
    launched(variables)
    with pytest.raises(SystemExit) as stop:
        main(["pipeline", "train.steps=1"])
    assert stop.value.code == 2
    assert "StartupError: OMPI_COMM_WORLD_LOCAL_RANK is not set" in capsys.readouterr().err


def test_a_value_given_with_no_launcher_to_fill_the_others_in(launched):
    with pytest.raises(StartupError, match=r"coordinator_address and num_processes not given.*process_id \(argument\)"):
        find_launch(process_id=1)


def test_the_trainer_stops_on_a_launcher_variable_that_does_not_fit(launched, capsys):
    from trainers.cli import main

    launched(srun_variables(3, 2, job_id=99, node="localhost"))
    with pytest.raises(SystemExit) as stop:
        main(["pipeline", "train.steps=1"])
    assert stop.value.code == 2
    assert "StartupError: SLURM_PROCID='3' is outside 0..1" in capsys.readouterr().err


# -- the trainer's 2-stage pipeline, two processes on this machine (slow) -----------------------------

#: the pipeline config, small (as tests/test_trainer.py shrinks it), 2 steps
PIPELINE = ["-m", "trainers", "pipeline", "model.d_model=32", "model.max_len=32", "data.seq_len=32",
            "data.batch_size=8", "data.max_bytes=200000", "train.eval_batches=2", "train.log_every=1",
            "train.steps=2", "-q"]
STEPS = 2
TIMEOUT_S = 600


def _check_run(outs: list[tuple[int, str, str]], out_dir: Path) -> None:
    """Both processes exited 0; process 0 alone printed the summary (a process that ran alone prints
    its own), which says the last step, as the run's summary.json does."""
    for i, (code, out, err) in enumerate(outs):
        assert code == 0, f"process {i} exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
    assert re.search(rf"\b{STEPS} steps in\b", outs[0][1]), outs[0][1]
    assert "steps in" not in outs[1][1], f"process 1 ran alone:\n{outs[1][1]}"
    assert json.loads((out_dir / "summary.json").read_text())["step"] == STEPS


def _a_free_job_id(held: list[socket.socket]) -> int:
    """A SLURM job id whose coordinator port (JAX: 61440 + id % 4096) is free here, held (as `free_port`
    holds one, with SO_REUSEPORT) until the test ends."""
    for job_id in range(int.from_bytes(os.urandom(2)) % 4096, 10**6, 4099):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(("", 61440 + job_id % 4096))
        except OSError:
            s.close()
            continue
        held.append(s)
        return job_id
    raise AssertionError("no free port in 61440..65535")


@pytest.mark.slow  # a minute or two: two fresh processes compile and run the pipeline
def test_srun_variables_train_the_pipeline_on_two_processes(tmp_path):
    held: list[socket.socket] = []
    job_id, node = _a_free_job_id(held), socket.gethostname()
    envs = [srun_variables(i, 2, job_id=job_id, node=node) for i in range(2)]
    outs = run_commands([[*PIPELINE, f"train.out_dir={tmp_path}"]] * 2, timeout=TIMEOUT_S, envs=envs)
    _check_run(outs, tmp_path)
    for s in held:
        s.close()


@pytest.mark.slow
def test_indexed_job_variables_train_the_pipeline_on_two_processes(tmp_path):
    envs = [indexed_job_variables(i, 2, f"localhost:{free_port('localhost')}") for i in range(2)]
    envs[1]["JAX_COORDINATOR_ADDRESS"] = envs[0]["JAX_COORDINATOR_ADDRESS"]
    _check_run(run_commands([[*PIPELINE, f"train.out_dir={tmp_path}"]] * 2, timeout=TIMEOUT_S, envs=envs), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_mpirun_trains_the_pipeline_on_two_processes(tmp_path):
    """``mpirun -np 2 multimesh-train pipeline``: no per-process flag; each process's output in its own
    file (--output-filename), to tell process 0's summary from process 1's silence."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
           and not LAUNCHER_VARIABLE.match(k)}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # containers run as root
    logs = tmp_path / "logs"
    cmd = ["mpirun", "--oversubscribe", "--output-filename", str(logs), "-np", "2",
           sys.executable, *PIPELINE, f"train.out_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # mpirun ends its ranks on SIGTERM; its session holds only them
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    ranks = [sorted(logs.glob(f"1/rank.{r}/stdout")) for r in range(2)]
    assert all(len(files) == 1 for files in ranks), list(logs.rglob("*"))
    outs = [(0, files[0].read_text(), "") for files in ranks]
    _check_run(outs, tmp_path / "run")


# -- a real one-node SLURM cluster (slow; root, Debian's slurm-wlm and munge) ---------------------------

SLURM_DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
_SLURM_CONF = """ClusterName=multimesh-test
SlurmctldHost={node}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
FirstJobId={first_job_id}
NodeName={node} CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _unused_port() -> int:
    """A port free now (slurmctld and slurmd bind without SO_REUSEPORT, so it is not held)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _end(procs: list[subprocess.Popen]) -> None:
    """End the processes this test started, by pid: SIGTERM, then SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.skipif(any(shutil.which(d) is None for d in SLURM_DAEMONS) or os.geteuid() != 0,
                    reason="needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm)")
def test_srun_trains_the_pipeline_on_two_processes(tmp_path):
    """``srun -n 2 multimesh-train pipeline`` on a one-node cluster of this machine (munged, slurmctld and
    slurmd in the foreground, in a temporary directory, ended by pid)."""
    lab = tmp_path / "slurm"
    for d in ("state", "spool"):
        (lab / d).mkdir(parents=True)
    key = lab / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    held: list[socket.socket] = []
    node = socket.gethostname().split(".")[0]
    conf = lab / "slurm.conf"
    conf.write_text(_SLURM_CONF.format(node=node, dir=lab, ctld_port=_unused_port(), slurmd_port=_unused_port(),
                                       first_job_id=_a_free_job_id(held), cpus=os.cpu_count()))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
           and not LAUNCHER_VARIABLE.match(k)}
    env.update(SLURM_CONF=str(conf), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    daemons: list[subprocess.Popen] = []
    try:
        for argv in (["munged", "-F", "--force", f"--key-file={key}", f"--socket={lab}/munge.sock",
                      f"--pid-file={lab}/munged.pid", f"--seed-file={lab}/munge.seed", f"--log-file={lab}/munged.log"],
                     ["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf)]):
            daemons.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                                           timeout=30, check=False).stdout:
            assert time.monotonic() < deadline and all(d.poll() is None for d in daemons), (
                f"the test cluster did not come up: {[d.poll() for d in daemons]}\n"
                + "".join(f.read_text()[-1500:] for f in lab.glob("*.log")))
            time.sleep(1.0)
        srun = subprocess.Popen(["srun", "-n", "2", "--output", f"{lab}/task-%t.out", "--error", f"{lab}/task-%t.err",
                                 sys.executable, *PIPELINE, f"train.out_dir={tmp_path / 'run'}"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = srun.communicate(timeout=TIMEOUT_S)
        finally:
            _end([srun])  # srun cancels its step's tasks on SIGTERM
    finally:
        _end(daemons[::-1])
        for s in held:
            s.close()
    tasks = [(lab / f"task-{t}.out", lab / f"task-{t}.err") for t in range(2)]
    assert srun.returncode == 0, (f"srun exited {srun.returncode}:\n{out[-2000:]}\n{err[-2000:]}\n"
                                  + "".join(e.read_text()[-3000:] for _, e in tasks if e.exists()))
    _check_run([(0, o.read_text(), e.read_text()) for o, e in tasks], tmp_path / "run")
