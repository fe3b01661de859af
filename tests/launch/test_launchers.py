"""Cloud TPU launchers: the exact gcloud / kubectl commands their dry runs print, the JobSet they
render, their flag errors, and launch/tpu_vm.sh's preemption loop against a fake gcloud.

No network and no real gcloud or kubectl: a fake of each is put first on PATH, and the dry-run
tests check that it was never called.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # PyYAML comes with transformers, a test dependency

ROOT = Path(__file__).resolve().parents[2]
TPU_VM = ROOT / "launch" / "tpu_vm.sh"
GKE = ROOT / "launch" / "gke" / "launch.sh"

NAME, ZONE, WORKDIR = "jx-test", "us-east5-a", "gs://bucket/jaxmoe/run"
REPO, BRANCH = "https://example.com/jaxmoe.git", "dev"


def mesh(chips, fsdp=1, expert=1):
    """--config.mesh overrides that give a config one device per chip of a slice (data takes the rest)."""
    return [
        f"--config.mesh.data={chips // (fsdp * expert)}", f"--config.mesh.fsdp={fsdp}",
        f"--config.mesh.expert={expert}", "--config.mesh.context=1", "--config.mesh.tensor=1",
    ]  # fmt: skip


MESH_64 = mesh(64, fsdp=4, expert=16)  # v5p-128: 64 chips
BASE = [
    "--name", NAME, "--zone", ZONE, "--accelerator-type", "v5p-128",
    "--workdir", WORKDIR, "--repo", REPO, "--branch", BRANCH, *MESH_64,
]  # fmt: skip
TPUS = ["gcloud", "compute", "tpus"]

# A gcloud that records every call in $FAKE_DIR/calls.jsonl and keeps the TPU's state in files:
# the node state in node_state, the queued resource's coming states in qr_states. `jaxmoe train`
# over ssh is preempted (node -> PREEMPTED, ssh exit 255) for the first $FAKE_PREEMPTIONS runs,
# or fails on a healthy node when $FAKE_TRAIN_FAIL is set.
FAKE_GCLOUD = """
import json, os, sys
d = os.environ["FAKE_DIR"]
argv = sys.argv[1:]
with open(os.path.join(d, "calls.jsonl"), "a") as f:
    f.write(json.dumps(["gcloud", *argv]) + "\\n")
def path(name):
    return os.path.join(d, name)
def read(name, default=""):
    return open(path(name)).read() if os.path.exists(path(name)) else default
def write(name, text):
    open(path(name), "w").write(text)
group, verb = argv[2], argv[3]
if group == "tpu-vm" and verb == "create":
    write("node_state", "READY")
elif group == "tpu-vm" and verb == "describe":
    if not os.path.exists(path("node_state")):
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND")
    print(read("node_state"))
elif group == "tpu-vm" and verb == "delete":
    for name in ("node_state", "qr_states"):
        if os.path.exists(path(name)):
            os.remove(path(name))
elif group == "tpu-vm" and verb == "ssh":
    command = next(a for a in argv if a.startswith("--command="))
    if "jaxmoe train" in command:
        runs = int(read("train_runs", "0")) + 1
        write("train_runs", str(runs))
        if runs <= int(os.environ.get("FAKE_PREEMPTIONS", "0")):
            write("node_state", "PREEMPTED")
            sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255].")
        if os.environ.get("FAKE_TRAIN_FAIL"):
            sys.exit(1)
        print("step 10 loss 1.0")
elif group == "queued-resources" and verb == "create":
    write("qr_states", os.environ["FAKE_QR_STATES"])
elif group == "queued-resources" and verb == "describe":
    states = read("qr_states").split(",")
    print(states[0])
    if states[0] == "ACTIVE":
        write("node_state", "READY")
    write("qr_states", ",".join(states[1:] or states))
elif group == "queued-resources" and verb == "delete":
    for name in ("node_state", "qr_states"):
        if os.path.exists(path(name)):
            os.remove(path(name))
else:
    sys.exit(f"fake gcloud: unexpected call {argv}")
"""

FAKE_KUBECTL = """
import json, os, sys
with open(os.path.join(os.environ["FAKE_DIR"], "calls.jsonl"), "a") as f:
    f.write(json.dumps(["kubectl", *sys.argv[1:]]) + "\\n")
"""


@pytest.fixture
def fake(tmp_path):
    """A PATH with fake gcloud and kubectl first; `fake.calls()` lists what they were called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, code in (("gcloud", FAKE_GCLOUD), ("kubectl", FAKE_KUBECTL)):
        exe = bin_dir / tool
        exe.write_text(f"#!{sys.executable}\n{code}")
        exe.chmod(0o755)

    class Fake:
        dir = tmp_path

        def env(self, **extra):
            env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_DIR=str(tmp_path))
            env.update(extra)
            return env

        def run(self, script, *args, **extra_env):
            return subprocess.run(
                ["bash", str(script), *args], capture_output=True, text=True, env=self.env(**extra_env), timeout=120
            )

        def calls(self):
            log = tmp_path / "calls.jsonl"
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return Fake()


def dry_run(fake, script, *args, **env):
    """The commands a dry run prints, each split back into its argv; checks nothing was run."""
    r = fake.run(script, *args, "--dry-run", **env)
    assert r.returncode == 0, r.stderr
    assert fake.calls() == []
    lines = r.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), r.stdout
    return [shlex.split(line[2:]) for line in lines]


def remote_command(argv):
    """The --command of a `gcloud compute tpus tpu-vm ssh` argv."""
    (command,) = [a.removeprefix("--command=") for a in argv if a.startswith("--command=")]
    return command


# --------------------------------------------------------------------------------------------
# launch/tpu_vm.sh --dry-run


def test_tpu_vm_dry_run_prints_the_exact_commands(fake):
    cmds = dry_run(fake, TPU_VM, *BASE, "--steps", "7", "--config.name=it's a run")
    assert len(cmds) == 4
    create, install, train, delete = cmds
    assert create == [*TPUS, "tpu-vm", "create", NAME, f"--zone={ZONE}", "--accelerator-type=v5p-128",
                      "--version=v2-alpha-tpuv5"]  # fmt: skip
    ssh = [*TPUS, "tpu-vm", "ssh", NAME, f"--zone={ZONE}", "--worker=all"]
    assert install[:-1] == ssh and train[:-1] == ssh
    assert shlex.split(remote_command(train)) == [
        "cd", "~/jaxmoe", "&&", "exec", ".venv/bin/jaxmoe", "train", "--config", "configs/target.py",
        "--workdir", WORKDIR, "--config.steps=7", *MESH_64, "--config.name=it's a run",
    ]  # fmt: skip
    setup = remote_command(install)
    assert f"git clone -q --branch {BRANCH} {REPO} ~/jaxmoe" in setup
    assert ".venv/bin/pip install -q -e '.[gcs]'" in setup  # gs:// workdirs need gcsfs
    assert '.venv/bin/pip install -q "jax[tpu]==$(.venv/bin/python -c' in setup
    assert delete == [*TPUS, "tpu-vm", "delete", NAME, f"--zone={ZONE}", "--quiet"]


def test_tpu_vm_dry_run_queued_spot_project(fake):
    args = [*BASE, "--zone", "us-east5-b", "--accelerator-type", "v6e-256", "--project", "my-proj", *mesh(256)]
    args += ["--queued", "--spot"]
    create, poll, install, train, delete = dry_run(fake, TPU_VM, *args)
    scope = ["--zone=us-east5-b", "--project=my-proj"]
    assert create == [*TPUS, "queued-resources", "create", NAME, *scope, f"--node-id={NAME}",
                      "--accelerator-type=v6e-256", "--runtime-version=v2-alpha-tpuv6e", "--spot"]  # fmt: skip
    assert poll == [*TPUS, "queued-resources", "describe", NAME, *scope, "--format=value(state.state)"]
    assert install[:-1] == train[:-1] == [*TPUS, "tpu-vm", "ssh", NAME, *scope, "--worker=all"]
    assert delete == [*TPUS, "queued-resources", "delete", NAME, *scope, "--force", "--quiet"]


@pytest.mark.parametrize(
    "accel, chips, extra, create_flags",
    [
        ("v5litepod-16", 16, [], ["--version=v2-alpha-tpuv5-lite"]),
        ("v4-32", 16, ["--reserved"], ["--version=tpu-ubuntu2204-base", "--reserved"]),
        ("v6e-8", 8, ["--version", "v2-alpha-tpuv6e-custom", "--spot"], ["--version=v2-alpha-tpuv6e-custom", "--spot"]),
    ],
)
def test_tpu_vm_runtime_and_capacity_flags(fake, accel, chips, extra, create_flags):
    create = dry_run(fake, TPU_VM, *BASE, "--accelerator-type", accel, *mesh(chips), *extra)[0]
    assert create == [*TPUS, "tpu-vm", "create", NAME, f"--zone={ZONE}", f"--accelerator-type={accel}", *create_flags]


def test_tpu_vm_keep_skips_the_delete(fake):
    cmds = dry_run(fake, TPU_VM, *BASE, "--keep")
    assert [c[3:5] for c in cmds] == [["tpu-vm", "create"], ["tpu-vm", "ssh"], ["tpu-vm", "ssh"]]


def test_tpu_vm_remote_commands_run_in_a_posix_shell(fake, tmp_path):
    """The printed train command, run by sh, calls jaxmoe with exactly the flags given."""
    odd = "--config.name=a 'quoted' \"run\" & $HOME; `x`"
    cmds = dry_run(fake, TPU_VM, *BASE, "--config", "configs/tiny.py", odd, *mesh(64))
    home = tmp_path / "home"
    jaxmoe = home / "jaxmoe" / ".venv" / "bin" / "jaxmoe"
    jaxmoe.parent.mkdir(parents=True)
    jaxmoe.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    jaxmoe.chmod(0o755)
    r = subprocess.run(["sh", "-c", remote_command(cmds[2])], capture_output=True, text=True, env=dict(HOME=str(home)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        "train",
        "--config",
        "configs/tiny.py",
        "--workdir",
        WORKDIR,
        *MESH_64,
        odd,
        *mesh(64),
    ]
    # The set-up command is valid POSIX sh too.
    assert subprocess.run(["sh", "-n", "-c", remote_command(cmds[1])]).returncode == 0


def test_tpu_vm_repo_and_branch_default_to_this_checkout(fake, tmp_path):
    checkout = tmp_path / "checkout"
    for path in ("launch/tpu_vm.sh", "launch/slice_check.sh", "configs/target.py"):
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text((ROOT / path).read_text())
    args = ["--name", NAME, "--zone", ZONE, "--accelerator-type", "v5p-8", "--workdir", WORKDIR, *mesh(4)]
    r = fake.run(checkout / "launch" / "tpu_vm.sh", *args, "--dry-run")
    assert r.returncode == 2 and "--repo is required" in r.stderr

    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for cmd in (["init", "-q", "-b", "feature-x"], ["remote", "add", "origin", "https://example.com/fork.git"],
                ["commit", "-q", "--allow-empty", "-m", "x"]):  # fmt: skip
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    # The copy has no .venv of its own: its mesh check runs on this interpreter.
    setup = remote_command(dry_run(fake, checkout / "launch" / "tpu_vm.sh", *args, JAXMOE_PYTHON=sys.executable)[1])
    assert "git clone -q --branch feature-x https://example.com/fork.git ~/jaxmoe" in setup


def without(args, flag):
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


@pytest.mark.parametrize(
    "args, message",
    [
        (without(BASE, "--name"), "--name is required"),
        (without(BASE, "--zone"), "--zone is required"),
        (without(BASE, "--accelerator-type"), "--accelerator-type is required"),
        (without(BASE, "--workdir"), "--workdir is required"),
        ([*BASE, "--name", "Bad_Name"], "--name 'Bad_Name'"),
        ([*BASE, "--zone", "useast"], "--zone 'useast'"),
        ([*BASE, "--accelerator-type", "v5p"], "--accelerator-type 'v5p'"),
        ([*BASE, "--accelerator-type", "v9x-8"], "--version is required"),
        ([*BASE, "--workdir", "/tmp/run"], "--workdir '/tmp/run' must be a gs:// path"),
        ([*BASE, "--steps", "0"], "--steps '0'"),
        ([*BASE, "--max-restarts", "-1"], "--max-restarts '-1'"),
        ([*BASE, "--poll-seconds", "soon"], "--poll-seconds 'soon'"),
        ([*BASE, "--project", "Bad Project"], "--project 'Bad Project'"),
        ([*BASE, "--bogus", "1"], "unknown flag --bogus"),
        ([*BASE, "--config.steps"], "--config.steps needs a value"),
        ([*BASE, "--steps"], "--steps needs a value"),
        ([*BASE, "--name", "--queued"], "--name needs a value"),
        ([*BASE, "extra"], "unexpected argument 'extra'"),
    ],
)
def test_tpu_vm_bad_flags_exit_2_naming_the_flag(fake, args, message):
    r = fake.run(TPU_VM, *args, "--dry-run")
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == "" and fake.calls() == []


def test_tpu_vm_help(fake):
    r = fake.run(TPU_VM, "--help")
    assert r.returncode == 0
    for flag in ("--name", "--zone", "--accelerator-type", "--workdir", "--queued", "--spot", "--max-restarts",
                 "--dry-run", "--keep", "--config.KEY=VALUE"):  # fmt: skip
        assert flag in r.stdout


# --------------------------------------------------------------------------------------------
# launch/tpu_vm.sh against a fake gcloud


def kinds(calls):
    """Each call as 'group verb', e.g. 'tpu-vm ssh', with 'train' or 'install' for ssh calls."""
    out = []
    for c in calls:
        kind = f"{c[3]} {c[4]}"
        if c[4] == "ssh":
            kind += " train" if "jaxmoe train" in remote_command(c) else " install"
        out.append(kind)
    return out


def test_tpu_vm_preemption_recreates_reruns_and_deletes(fake):
    r = fake.run(TPU_VM, *BASE, "--steps", "10", FAKE_PREEMPTIONS="1")
    assert r.returncode == 0, r.stderr
    assert kinds(fake.calls()) == [
        "tpu-vm create", "tpu-vm ssh install", "tpu-vm ssh train", "tpu-vm describe", "tpu-vm delete",
        "tpu-vm create", "tpu-vm ssh install", "tpu-vm ssh train", "tpu-vm delete",
    ]  # fmt: skip
    assert "PREEMPTED (preempted); recreating it, restart 1 of 3" in r.stderr
    assert "step 10 loss 1.0" in r.stdout
    # Both runs are the same command: the second resumes from the workdir's last checkpoint.
    trains = [c for c in fake.calls() if "jaxmoe train" in " ".join(c)]
    assert trains[0] == trains[1]
    assert not (fake.dir / "node_state").exists()


def test_tpu_vm_gives_up_after_max_restarts(fake):
    r = fake.run(TPU_VM, *BASE, "--max-restarts", "1", FAKE_PREEMPTIONS="5")
    assert r.returncode == 1
    assert "giving up (--max-restarts 1)" in r.stderr
    assert kinds(fake.calls()) == [
        "tpu-vm create", "tpu-vm ssh install", "tpu-vm ssh train", "tpu-vm describe", "tpu-vm delete",
        "tpu-vm create", "tpu-vm ssh install", "tpu-vm ssh train", "tpu-vm describe", "tpu-vm delete",
    ]  # fmt: skip


@pytest.mark.parametrize("keep", [False, True])
def test_tpu_vm_training_failure_on_a_healthy_tpu_is_not_retried(fake, keep):
    r = fake.run(TPU_VM, *BASE, *(["--keep"] if keep else []), FAKE_TRAIN_FAIL="1")
    assert r.returncode == 1
    assert "which is READY (not a preemption)" in r.stderr
    expected = ["tpu-vm create", "tpu-vm ssh install", "tpu-vm ssh train", "tpu-vm describe"]
    assert kinds(fake.calls()) == expected + ([] if keep else ["tpu-vm delete"])
    assert (fake.dir / "node_state").exists() == keep


def test_tpu_vm_queued_waits_for_active_and_recreates_after_preemption(fake):
    args = [*BASE, "--queued", "--spot", "--poll-seconds", "0"]
    r = fake.run(TPU_VM, *args, FAKE_PREEMPTIONS="1", FAKE_QR_STATES="ACCEPTED,WAITING_FOR_RESOURCES,ACTIVE")
    assert r.returncode == 0, r.stderr
    one_attempt = ["queued-resources create"] + ["queued-resources describe"] * 3 + ["tpu-vm ssh install"]
    assert kinds(fake.calls()) == [
        *one_attempt, "tpu-vm ssh train", "tpu-vm describe", "queued-resources delete",
        *one_attempt, "tpu-vm ssh train", "queued-resources delete",
    ]  # fmt: skip
    assert "queued resource jx-test is WAITING_FOR_RESOURCES; waiting for ACTIVE" in r.stderr
    assert fake.calls()[0][-1] == "--spot" and fake.calls()[-1][-2:] == ["--force", "--quiet"]


def test_tpu_vm_queued_failed_is_an_error_and_cleans_up(fake):
    r = fake.run(TPU_VM, *BASE, "--queued", "--poll-seconds", "0", FAKE_QR_STATES="PROVISIONING,FAILED")
    assert r.returncode == 1
    assert "queued resource jx-test is FAILED" in r.stderr
    assert kinds(fake.calls()) == [
        "queued-resources create", "queued-resources describe", "queued-resources describe", "queued-resources delete",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# launch/gke/launch.sh


GKE_BASE = ["--name", "jaxmoe-target", "--image", "us-docker.pkg.dev/p/r/jaxmoe:1", "--workdir", WORKDIR]


def gke_manifest(fake, *args):
    r = fake.run(GKE, *GKE_BASE, *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert fake.calls() == []
    first, _, manifest = r.stdout.partition("\n")
    assert first == "+ kubectl apply -f -"
    return yaml.safe_load(manifest)


@pytest.mark.parametrize(
    "accelerator, topology, slices, vms, chips",
    [
        ("tpu-v5p-slice", "8x16x16", 2, 512, 4),
        ("tpu-v6e-slice", "16x16", 4, 64, 4),
        ("tpu-v5-lite-podslice", "2x4", 1, 1, 8),
        ("tpu-v4-podslice", "2x2x1", 1, 1, 4),
    ],
)
def test_gke_renders_the_jobset(fake, accelerator, topology, slices, vms, chips):
    odd = "--config.name=a \"b\" & c\\d: 'e'"
    fit = mesh(slices * vms * chips)
    args = ["--accelerator", accelerator, "--topology", topology, "--slices", str(slices), "--steps", "100", *fit, odd]
    js = gke_manifest(fake, *args)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert js["metadata"]["name"] == "jaxmoe-target"
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 10}
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["name"] == "slice" and rjob["replicas"] == slices
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == vms and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    assert pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "us-docker.pkg.dev/p/r/jaxmoe:1"
    assert container["resources"]["limits"] == {"google.com/tpu": chips}
    assert [p["containerPort"] for p in container["ports"]] == [8471, 8080]
    assert container["command"] == [
        "jaxmoe", "train", "--config", "configs/target.py", "--workdir", WORKDIR, "--config.steps=100", *fit, odd,
    ]  # fmt: skip


V5P_CUBE = ["--accelerator", "tpu-v5p-slice", "--topology", "4x4x4", *mesh(64)]


def test_gke_config_and_max_restarts(fake):
    js = gke_manifest(fake, *V5P_CUBE, "--config", "configs/tiny.py", "--max-restarts", "3")
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 3
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["jaxmoe", "train", "--config", "configs/tiny.py", "--workdir", WORKDIR, *mesh(64)]


def test_gke_applies_with_kubectl(fake):
    r = fake.run(GKE, *GKE_BASE, "--accelerator", "tpu-v6e-slice", "--topology", "8x8", *mesh(64))
    assert r.returncode == 0, r.stderr
    assert fake.calls() == [["kubectl", "apply", "-f", "-"]]
    assert "kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=jaxmoe-target" in r.stderr


V5P = ["--accelerator", "tpu-v5p-slice", "--topology", "8x16x16"]


@pytest.mark.parametrize(
    "args, message",
    [
        (V5P[:2], "--topology is required"),
        (V5P[2:], "--accelerator is required"),
        (["--accelerator", "tpu-v9-slice", "--topology", "4x4"], "--accelerator 'tpu-v9-slice' is not one of"),
        (["--accelerator", "tpu-v5p-slice", "--topology", "16x16"], "--topology '16x16' must be AxBxC"),
        (["--accelerator", "tpu-v6e-slice", "--topology", "4x4x4"], "--topology '4x4x4' must be AxB"),
        (["--accelerator", "tpu-v6e-slice", "--topology", "2x4", "--slices", "2"], "single-host slice"),
        ([*V5P, "--slices", "0"], "--slices '0'"),
        ([*V5P, "--steps", "x"], "--steps 'x'"),
        ([*V5P, "--max-restarts", "many"], "--max-restarts 'many'"),
        ([*V5P, "--workdir", "/data/run"], "--workdir '/data/run' must be a gs:// path"),
        ([*V5P, "--name", "x" * 41], "at most 40 characters"),
        ([*V5P, "--image", "bad image"], "--image 'bad image'"),
        ([*V5P, "--zone", "us-east5-a"], "unknown flag --zone"),
        ([*V5P, "--config.steps"], "--config.steps needs a value"),
        ([*V5P, "--config.name=a\tb"], "control characters"),
    ],
)
def test_gke_bad_flags_exit_2_naming_the_flag(fake, args, message):
    r = fake.run(GKE, *GKE_BASE, *args, "--dry-run")
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == "" and fake.calls() == []


@pytest.mark.parametrize("flag", ["--name", "--image", "--workdir"])
def test_gke_required_flags(fake, flag):
    r = fake.run(GKE, *without(GKE_BASE, flag), *V5P, "--dry-run")
    assert r.returncode == 2 and f"{flag} is required" in r.stderr


def test_gke_help(fake):
    r = fake.run(GKE, "--help")
    assert r.returncode == 0
    for flag in ("--slices", "--accelerator", "--topology", "--image", "--workdir", "--config", "--name", "--dry-run"):
        assert flag in r.stdout


def test_docs_show_the_real_dry_run_output(fake):
    """docs/tpu.md quotes launch/tpu_vm.sh's dry run for the target config; it must stay exact."""
    args = ["--name", "jaxmoe-target", "--zone", "us-east5-a", "--accelerator-type", "v5p-4096", "--queued"]
    args += ["--reserved", "--workdir", "gs://BUCKET/jaxmoe/target", "--repo", "https://github.com/OWNER/jaxmoe.git"]
    args += ["--branch", "main", "--config.mesh.data=1", "--config.mesh.fsdp=128", "--config.mesh.expert=16"]
    r = fake.run(TPU_VM, *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    doc = (ROOT / "docs" / "tpu.md").read_text()
    assert r.stdout in doc


# --------------------------------------------------------------------------------------------
# Both launchers: the config against the slice, before anything is created


TARGET_MESH = "mesh {'data': 1, 'fsdp': 128, 'expert': 16, 'context': 1, 'tensor': 1} has 2048 devices"


@pytest.mark.parametrize("dry", [True, False])
def test_tpu_vm_refuses_a_mesh_that_is_not_the_slice_before_creating_it(fake, dry):
    args = [a for a in BASE if a not in MESH_64]  # the target's own 2,048-device mesh on a 64-chip v5p-128
    r = fake.run(TPU_VM, *args, *(["--dry-run"] if dry else []))
    assert r.returncode == 1 and r.stdout == "" and fake.calls() == []
    assert TARGET_MESH in r.stderr and "topology v5p:4x4x4 has 64" in r.stderr
    assert "(--accelerator-type v5p-128 is v5p:4x4x4)" in r.stderr and "nothing was created" in r.stderr


def test_gke_refuses_a_mesh_that_is_not_all_the_slices(fake):
    r = fake.run(GKE, *GKE_BASE, "--accelerator", "tpu-v5p-slice", "--topology", "8x16x16", "--slices", "2")
    assert r.returncode == 1 and r.stdout == "" and fake.calls() == []
    assert TARGET_MESH in r.stderr and "2 slices of topology v5p:8x16x16 have 4096" in r.stderr


# A Python for the launchers whose `jaxmoe compile --check` (the preflight) reports FAKE_FITS and
# records its argv; everything else (the mesh check) is the real jaxmoe.
FAKE_PY = """
import json, os, subprocess, sys
argv = sys.argv[1:]
if argv[:3] == ["-m", "jaxmoe", "compile"] and "--check" in argv:
    with open(os.path.join(os.environ["FAKE_DIR"], "preflight.json"), "w") as f:
        json.dump(argv[3:], f)
    fits = os.environ["FAKE_FITS"] == "1"
    print(json.dumps({"topology": "v5p:4x4x4", "step": "train", "fits": fits, "total_bytes": 1, "hbm_bytes": 2}))
    sys.exit(0 if fits else 3)
sys.exit(subprocess.call([%r, *argv]))
"""


@pytest.mark.parametrize("fits", [True, False])
def test_preflight_compiles_for_the_slice_and_stops_unless_it_fits(fake, fits):
    py = fake.dir / "py"
    py.write_text(f"#!{sys.executable}\n" + FAKE_PY % sys.executable)
    py.chmod(0o755)
    r = fake.run(TPU_VM, *BASE, "--steps", "5", "--preflight", JAXMOE_PYTHON=str(py), FAKE_FITS=str(int(fits)))
    preflight = json.loads((fake.dir / "preflight.json").read_text())
    assert preflight == [
        "--config", "configs/target.py", "--accelerator-type", "v5p-128", "--config.steps=5", *MESH_64, "--check",
    ]  # fmt: skip
    assert '"fits": ' in r.stderr  # the compile's JSON line is shown
    if fits:
        assert r.returncode == 0, r.stderr
        assert kinds(fake.calls())[0] == "tpu-vm create"
    else:
        assert r.returncode == 1 and fake.calls() == []
        assert "does not fit a chip" in r.stderr and "nothing was created" in r.stderr
