"""The pod runner (`make test-pods`): deploy/'s pods and the Slurm job executed as a kubelet, containerd and
enroot/pyxis would execute them, on one machine, in Linux namespaces (bubblewrap, `ip netns`, setpriv; run as root).

What it applies, and where each rule comes from:

- the image: the Dockerfile's gpu stage as a root file system (Image): the host's /usr read-only; /etc with the
  image's user (uid/gid 10001, `useradd`) and /etc/dflash-mpi-prefix; /app, its WORKDIR, owned by 10001 and mode
  0755 with the project files copied as its COPY lines lay them out (`chown -R 10001:10001 /app`); /run/sshd; the
  image's USER 10001 and ENV (DFLASH_TRT_MODELS, PATH); HOME from /etc/passwd for the process's uid (runc);
  the project's Python environments at their paths, dflash_trt resolving to the image's /app copy; the labelled
  STAND-INS of tests/pods_image/ where NVIDIA's image has TensorRT-LLM and a GPU;
- the NGC TensorRT-LLM image's `trtllm-serve`: the STAND-IN tests/pods_image/bin/trtllm-serve, which runs
  tests/fake_trtllm_serve.py with the container's arguments (the YAML checked against llm_args.py's record);
- a pod: its own network namespace (`ip netns`), shared by its containers; the hostname; /etc/hosts as the
  kubelet writes it (a group's peers added: cluster DNS here is a hosts file, tests/deploy/test_netns_launch.py runs a
  real resolver); the pod's runAsUser / runAsGroup / fsGroup / supplementalGroups (the kubelet adds fsGroup to the
  process's groups) over the image's USER; containerd's default capabilities for a container (containerd
  pkg/oci/spec.go populateDefaultUnixSpec: CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID SETFCAP
  SETPCAP NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE) with the container's add / drop in containerd's order
  (capabilities()); no_new_privs for
  allowPrivilegeEscalation: false; readOnlyRootFilesystem; capabilities reach a non-root process's effective set
  never (no ambient capabilities);
- exactly the pod's volumes at their mountPaths (nothing else of the host): a ConfigMap or Secret as the kubelet's
  atomic writer lays it out (`..data` symlinks, defaultMode or an item's mode; with fsGroup, its group on every file
  and folder, files | 0440, folders setgid: SetVolumeOwnership of a read-only volume), an emptyDir (0777; with
  fsGroup: group fsGroup, setgid), a PersistentVolumeClaim as a folder of this "cluster" (the engines share owned as
  deploy/README.md tells operators to make it: uid/gid 10001, 0755), readOnly mounts read-only;
- env and args from the rendered YAML; in a LeaderWorkerSet group (LwsGroup), LWS's own variables in every container
  and init container ahead of the YAML's (kubernetes-sigs/lws pkg/utils/pod/pod_utils.go AddLWSVariables and
  addEnvVarsIfNotExists, read at 1b17603c, the stored version nearest the 060ab4d the manifests cite: LWS_LEADER_ADDRESS
  `<lws>-<group>.<subdomain>.<namespace>`, LWS_GROUP_SIZE the size annotation, LWS_WORKER_INDEX the worker-index
  label; a container's own variable of the same name is dropped), the pods named `<lws>-<group>` (the leader) and
  `<lws>-<group>-<index>` (api/leaderworkerset/v1/leaderworkerset_types.go), hostname the pod's name and subdomain
  the LWS's name (its headless Service), each pod an interface `eth0` on one bridge with the group's names in
  /etc/hosts; the leader's container runs: its mpirun reaches the workers' real sshd across the pods' network
  namespaces and starts their ranks there (Open MPI relocated where NVIDIA's images keep it, /opt/hpcx/ompi, as
  tests/deploy/relocate_ompi.sh lays it out: the ssh session finds orted only through --prefix);
  init containers in order, each to exit 0; then the containers, their startup, liveness and
  readiness probes at their paths and ports, from inside the pod's network, within periodSeconds x
  failureThreshold; then, to stop: the preStop hook (exec, in the container's namespaces, as its user), SIGTERM to
  the container's first process, SIGKILL at terminationGracePeriodSeconds (counted from the preStop's start);
- Slurm (SlurmJob): the sbatch script itself, with STAND-INS for srun / scontrol / scancel that start each step's
  command the way pyxis (NVIDIA/pyxis 1075199) and enroot (NVIDIA/enroot 8ea147d) do by default: the container's root
  remounted read-only unless --container-writable (enroot src/runtime.sh: `remount,bind,nosuid,nodev,ro` unless
  ENROOT_ROOTFS_WRITABLE, default false in enroot.in; pyxis_slurmstepd.c sets it only for --container-writable /
  --container-readonly), the image's WORKDIR unless --container-workdir (pyxis_slurmstepd.c: chdir to the workdir
  argument, else to the container's cwd), enroot's own mounts (conf/mounts/10-system.fstab: /proc, /sys, /dev,
  /dev/shm, tmpfs /tmp, /var/run and /var/lock; 20-config.fstab: the node's /etc/hosts, /etc/hostname,
  /etc/resolv.conf, /etc/machine-id read-only) plus only --container-mounts, as the submitting user (no
  --container-remap-root: ENROOT_REMAP_ROOT is off by default), in no pid namespace and without no_new_privs (a
  pyxis task joins the container with setns: SlurmJob.sandbox); Slurm's signals as slurmd, slurmstepd and srun
  deliver them (SlurmJob).

Not modelled: the GPU, TensorRT and TensorRT-LLM (the stand-ins); cluster DNS (a hosts file; tests/deploy/
test_netns_launch.py runs a real resolver); an NFS server's root squash (the share is a local
folder: its owner and mode are the operator's, root without CAP_DAC_OVERRIDE meets them); image layers, cgroups,
seccomp.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent / "pods_image"
KUBECTL = ROOT / ".venv-deploy" / "bin" / "kubectl"
# the images' Python environments: the project's (dflash-trt, torch) and the Triton server's, where they really are
VENVS = ((ROOT / ".venv").resolve(), (ROOT / ".venv-triton").resolve())
IMAGE_UID = 10001  # Dockerfile: useradd --uid 10001, USER 10001, chown -R 10001:10001 /app
WORKDIR = "/app"
MIN_GRACE_S = 2  # the kubelet's minimumGracePeriodInSeconds: the least a container gets after its preStop
# containerd's default capabilities for a container (pkg/oci/spec.go populateDefaultUnixSpec)
DEFAULT_CAPS = (
    "CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID SETFCAP SETPCAP NET_BIND_SERVICE SYS_CHROOT KILL "
    "AUDIT_WRITE"
).split()
# every capability this kernel has (containerd's `add: [ALL]` takes the runtime's full list)
ALL_CAPS = tuple(
    c.upper() for c in subprocess.run(["setpriv", "--list-caps"], capture_output=True, text=True).stdout.split()
)
# Open MPI where NVIDIA's images keep it (their ENV: OPAL_PREFIX, its lib on LD_LIBRARY_PATH): the Makefile's
# relocated copy (MPI_TEST_PREFIX, tests/deploy/relocate_ompi.sh), bound there
IMAGE_MPI_PREFIX = "/opt/hpcx/ompi"
MPI_RELOCATED = Path("/opt/dflash-test-ompi")
POLL_S = 0.5  # how often the runner probes; the budget is the YAML's periodSeconds x failureThreshold


class PodFailed(RuntimeError):
    """A container exited non-zero, a probe never passed, or the drain overran the grace period."""


def render(overlay: str | Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` (the deploy venv's kubectl, as tests/deploy/test_deploy.py renders)."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(overlay)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _triton_layout(rootfs: Path, work: Path) -> None:
    """The real tritonserver of nvidia-pytriton (.venv-triton) where NVIDIA's Triton images keep theirs
    (/opt/tritonserver), run by `tritonserver` on PATH with the environment its bundled python backend needs
    (dflash_trt/triton/server.py says why: the stub's libpython first on LD_LIBRARY_PATH, the server venv's python3
    first on PATH); its backends folder prepared as server_env prepares it."""
    from dflash_trt.triton.server import TritonUnavailable, server_env

    try:
        senv = server_env(VENVS[1], work / "triton" / "backends")
    except TritonUnavailable:
        return
    (work / "triton" / "dist").symlink_to(senv.binary.parent.parent)
    wrapper = rootfs / "opt/tritonserver-env/bin/tritonserver"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(
        "#!/bin/sh\n"
        f"export PATH={VENVS[1]}/bin:$PATH LD_LIBRARY_PATH={senv.env['LD_LIBRARY_PATH']}\n"
        'exec /opt/tritonserver/bin/tritonserver --backend-directory=/opt/tritonserver/backends "$@"\n'
    )
    wrapper.chmod(0o755)


def _editable_roots() -> list[Path]:
    """Where the environments' editable installs say dflash_trt lives (setuptools' __editable__ finder MAPPING): the
    image's /app copy is bound there, as the image's own editable install of /app resolves to it."""
    out = []
    for venv in VENVS:
        for finder in venv.glob("lib/python3*/site-packages/__editable___dflash_trt_*_finder.py"):
            m = re.search(r"'dflash_trt': '([^']+)'", finder.read_text())
            if m and Path(m.group(1)) not in out:
                out.append(Path(m.group(1)))
    return out


def _interpreters() -> list[Path]:
    """The installation prefixes of the environments' interpreter (pyvenv.cfg `home`'s parent), outside /usr."""
    out = []
    for venv in VENVS:
        cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line)
        prefix = Path(cfg["home"]).parent
        if not prefix.is_relative_to("/usr") and prefix not in out:
            out.append(prefix)
    return out


# ---- the image -----------------------------------------------------------------------------------------------


@dataclass
class Image:
    """The gpu stage of the Dockerfile as a root file system (see the module docstring)."""

    rootfs: Path
    workdir: str = WORKDIR
    uid: int = IMAGE_UID
    gid: int = IMAGE_UID
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, work: Path) -> Image:
        r = work / "rootfs"
        for d in ("usr", "proc", "dev", "sys", "opt", "home", "var/tmp"):
            (r / d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
            if Path("/" + link).is_symlink():
                (r / link).symlink_to(os.readlink("/" + link))
        shutil.copytree("/etc", r / "etc", symlinks=True, ignore_dangling_symlinks=True)
        with open(r / "etc/passwd", "a") as f:  # groupadd --gid 10001 dflash && useradd --uid 10001 ... --create-home
            f.write(f"dflash:x:{IMAGE_UID}:{IMAGE_UID}::/home/dflash:/bin/bash\n")
        with open(r / "etc/group", "a") as f:
            f.write(f"dflash:x:{IMAGE_UID}:\n")
        (r / "home/dflash").mkdir()
        os.chown(r / "home/dflash", IMAGE_UID, IMAGE_UID)
        (r / "root").mkdir(mode=0o700)
        (r / "tmp").mkdir(mode=0o1777)
        os.chmod(r / "tmp", 0o1777)
        os.chmod(r / "var/tmp", 0o1777)
        (r / "run/sshd").mkdir(parents=True)  # mkdir -p /run/sshd
        # the stand-ins where NVIDIA's image has TensorRT-LLM (tests/pods_image/README.md)
        shutil.copytree(STANDINS, r / "opt/trtllm-standin", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "tests/fake_tensorrt.py", r / "opt/trtllm-standin/site/fake_tensorrt.py")
        shutil.copy2(ROOT / "tests/fake_trtllm_serve.py", r / "opt/trtllm-standin/fake_trtllm_serve.py")
        mpi_env = {}
        if (MPI_RELOCATED / "bin/orted").exists():  # NVIDIA's images: Open MPI in /opt/hpcx/ompi, off the PATH
            (r / IMAGE_MPI_PREFIX.lstrip("/")).mkdir(parents=True)
            (r / "etc/dflash-mpi-prefix").write_text(IMAGE_MPI_PREFIX + "\n")
            mpi_env = {"OPAL_PREFIX": IMAGE_MPI_PREFIX, "LD_LIBRARY_PATH": f"{IMAGE_MPI_PREFIX}/lib"}
        elif mpirun := shutil.which("mpirun"):
            # dirname "$(dirname "$(readlink -f "$(command -v mpirun)")")" > /etc/dflash-mpi-prefix
            (r / "etc/dflash-mpi-prefix").write_text(str(Path(os.path.realpath(mpirun)).parent.parent) + "\n")
        app = r / WORKDIR.lstrip("/")
        app.mkdir()
        for name in ("pyproject.toml", "README.md", "Makefile", "engines.toml", "constraints-cpu.txt"):
            shutil.copy2(ROOT / name, app / name)
        for name in ("dflash_trt", "scripts"):
            shutil.copytree(ROOT / name, app / name, ignore=shutil.ignore_patterns("__pycache__"))
        (app / "tests").mkdir()
        shutil.copy2(ROOT / "tests/tiny_models.py", app / "tests/tiny_models.py")
        (app / "models").mkdir()  # COPY models ./models: bound read-only from the checkout (36 MB, not copied)
        for p in [app, *app.rglob("*")]:  # chown -R 10001:10001 /app
            os.lchown(p, IMAGE_UID, IMAGE_UID)
        os.chmod(app, 0o755)
        for venv in VENVS:  # mount points of the environments and of the package the editable installs point at
            (r / str(venv).lstrip("/")).mkdir(parents=True, exist_ok=True)
        for prefix in _interpreters():  # the environments' interpreter, where this machine has it (pyenv: /root)
            (r / str(prefix).lstrip("/")).mkdir(parents=True, exist_ok=True)
            if prefix.is_relative_to("/root"):
                os.chmod(r / "root", 0o711)  # traversable to reach it, as /usr is in NVIDIA's image
        for package in _editable_roots():
            (r / str(package).lstrip("/")).mkdir(parents=True, exist_ok=True)
            # the stand-in trtllm-serve's record of llm_args.py, where dflash_trt (REPO_ROOT/data/upstream) reads it
            dst = r / str(package.parent / "data/upstream").lstrip("/")
            shutil.copytree(ROOT / "data/upstream", dst, dirs_exist_ok=True)
        _triton_layout(r, work)
        path = f"/opt/trtllm-standin/bin:{VENVS[0]}/bin:/opt/tritonserver-env/bin:/usr/local/sbin:/usr/local/bin"
        path += ":/usr/sbin:/usr/bin:/sbin:/bin"
        env = {"PATH": path, "DFLASH_TRT_MODELS": "/app/models", "PYTHONDONTWRITEBYTECODE": "1"} | mpi_env
        return cls(r, env=env)

    def binds(self) -> list[str]:
        """The image's read-only content that lives outside the copied root: /usr, the environments, the package
        (the image's /app copy, bound where the editable installs point), the demo models,
        the TensorRT-LLM / GPU stand-ins (importable through a .pth, as site-packages holds them in NVIDIA's image)."""
        out = ["--ro-bind", "/usr", "/usr"]
        for prefix in _interpreters():
            out += ["--ro-bind", str(prefix), str(prefix)]
        for venv in VENVS:
            out += ["--ro-bind", str(venv), str(venv)]
            site = next((venv / "lib").glob("python3*/site-packages"))
            pth = self.rootfs.parent / f"standin-{venv.name}.pth"
            pth.write_text(
                (site / "distutils-precedence.pth").read_text().rstrip("\n") + "\n/opt/trtllm-standin/site\n"
            )
            out += ["--ro-bind", str(pth), str(site / "distutils-precedence.pth")]
        for package in _editable_roots():
            out += ["--ro-bind", str(self.rootfs / "app/dflash_trt"), str(package)]
        out += ["--ro-bind", str(ROOT / "models"), "/app/models"]
        if (self.rootfs / IMAGE_MPI_PREFIX.lstrip("/")).is_dir():
            out += ["--ro-bind", str(MPI_RELOCATED), IMAGE_MPI_PREFIX]
        triton = self.rootfs.parent / "triton"
        if (triton / "dist").exists():  # NVIDIA's Triton images: /opt/tritonserver, its backends beside the binary
            out += ["--ro-bind", str((triton / "dist").resolve()), "/opt/tritonserver"]
            out += ["--ro-bind", str(triton / "backends"), "/opt/tritonserver/backends"]
        return out

    def home(self, uid: int) -> str:
        for line in (self.rootfs / "etc/passwd").read_text().splitlines():
            parts = line.split(":")
            if len(parts) > 5 and parts[2] == str(uid):
                return parts[5]
        return "/"


# ---- one process in a sandbox ----------------------------------------------------------------------------------


@dataclass
class Identity:
    """Who a container's process is: uid, gid, groups, the capability bounding set, no_new_privs."""

    uid: int
    gid: int
    groups: list[int]
    caps: list[str]
    no_new_privs: bool

    def setpriv(self) -> list[str]:
        groups = ["--groups", ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
        bounding = ",".join(["-all", *(f"+{c.lower()}" for c in self.caps)])
        out = ["setpriv", "--reuid", str(self.uid), "--regid", str(self.gid), *groups, "--bounding-set", bounding]
        out += ["--inh-caps", "-all"]  # no ambient capabilities: a non-root process starts with none
        return out + (["--no-new-privs"] if self.no_new_privs else []) + ["--"]


@dataclass
class Sandbox:
    """Everything bwrap needs for one container: the image, the mounts, the identity, env, cwd, read-only root."""

    image: Image
    mounts: list[str]  # bwrap mount arguments, in order
    who: Identity
    env: dict[str, str]
    cwd: str
    hostname: str
    read_only_root: bool = False
    netns: str | None = None  # `ip netns` name; None: the host's network
    # a pid namespace whose pid 1 is the command (a container's; containerd), or the host's pids (an enroot
    # container: pyxis leaves ENROOT_UNSHARE_PID unset, so enroot-nsenter unshares no pid namespace; a task is a
    # child of slurmstepd and takes its signals as any process does)
    pid_namespace: bool = True

    def argv(self, command: list[str], info_fd: int | None = None) -> list[str]:
        out = ["ip", "netns", "exec", self.netns] if self.netns else []
        out += ["bwrap", "--die-with-parent", "--unshare-ipc", "--unshare-uts"]
        out += ["--unshare-pid", "--as-pid-1"] if self.pid_namespace else []
        out += ["--hostname", self.hostname, "--bind", str(self.image.rootfs), "/"]
        # the volumes, then the image's content that lives outside the copied root (where this machine keeps it:
        # a tmpfs volume at /tmp, as enroot mounts, must not hide an environment kept under /tmp)
        out += ["--proc", "/proc", "--dev", "/dev", *self.mounts, *self.image.binds()]
        if self.read_only_root:
            out += ["--remount-ro", "/"]
        if info_fd is not None:
            out += ["--info-fd", str(info_fd)]
        out += ["--chdir", self.cwd, "--clearenv"]
        for k, v in self.env.items():
            out += ["--setenv", k, v]
        return out + self.who.setpriv() + command

    def exec_argv(self, pid: int, command: list[str]) -> list[str]:
        """A command in a running container's namespaces (the kubelet's exec hook): its mounts, pid, network,
        root and working directory, as the container's user, with its environment."""
        env = ["env", "-i", *(f"{k}={v}" for k, v in self.env.items())]
        ns = ["nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "-r", "-w"]
        return ns + env + self.who.setpriv() + command


class Proc:
    """A started sandbox: its log, its first process's host pid."""

    def __init__(self, box: Sandbox, command: list[str], log: Path):
        self.box, self.log = box, log
        r, w = os.pipe()
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                box.argv(command, info_fd=w), stdout=out, stderr=subprocess.STDOUT, pass_fds=(w,)
            )
        os.close(w)
        with os.fdopen(r) as info:
            text = info.read()  # bwrap closes it once the sandbox's first process runs
        self.pid = json.loads(text)["child-pid"] if text.strip() else None
        try:  # the container's mount namespace: what every process of the container shares
            self.mntns = os.readlink(f"/proc/{self.pid}/ns/mnt") if self.pid else None
        except OSError:  # it ended already
            self.mntns = None

    def exec(self, command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        assert self.pid is not None
        return subprocess.run(self.box.exec_argv(self.pid, command), capture_output=True, text=True, timeout=timeout)

    def signal(self, sig: int) -> None:
        if self.pid is not None and self.popen.poll() is None:
            os.kill(self.pid, sig)

    def tail(self, n: int = 40) -> str:
        """The log's errors (a server's table of failed models scrolls away), then its last `n` lines."""
        lines = self.log.read_text(errors="replace").splitlines()
        errors = [line for line in lines[:-n] if any(k in line for k in ("Error", "error:", "UNAVAILABLE"))]
        return "\n".join([*errors[-20:], *(["..."] if errors else []), *lines[-n:]])


# ---- volumes, as the kubelet lays them out ---------------------------------------------------------------------


def capabilities(caps: dict) -> list[str]:
    """A container's capabilities from its securityContext's add / drop, in the order containerd's CRI plugin
    applies them (its opts WithCapabilities: `add: [ALL]` makes every capability, then `drop: [ALL]` none, then
    each added one is added, then each dropped one removed: a name in both lists ends up dropped) over its default
    set (DEFAULT_CAPS)."""
    add = [x.upper() for x in caps.get("add", [])]
    drop = [x.upper() for x in caps.get("drop", [])]
    out = set(DEFAULT_CAPS)
    if "ALL" in add:
        out = set(ALL_CAPS)
    if "ALL" in drop:
        out = set()
    out |= {c for c in add if c != "ALL"}
    out -= set(drop)
    return sorted(out)


def atomic_writer(folder: Path, files: dict[str, bytes], mode: int, fs_group: int | None) -> Path:
    """A ConfigMap / Secret volume as the kubelet's atomic writer lays it out (pkg/volume/util/atomic_writer.go): the
    files in a timestamped folder, `..data` a symlink to it, each name a symlink through `..data`; then, with an
    fsGroup, the volume's ownership as SetVolumeOwnership sets it on a read-only volume (kubernetes
    pkg/volume/volume_linux.go at 7dd8853f, changeFilePermission): every file and folder in group fsGroup, files
    mode | 0440 (roMask), folders also setgid and 0110 (execMask), symlinks untouched."""
    stamp = folder / "..2026_01_01_00_00_00.000000000"
    stamp.mkdir(parents=True)
    for name, data in files.items():
        (stamp / name).write_bytes(data)
        os.chown(stamp / name, 0, 0)
        os.chmod(stamp / name, mode)
    (folder / "..data").symlink_to(stamp.name)
    for name in files:
        (folder / name).symlink_to(f"..data/{name}")
    for d in (stamp, folder):
        os.chmod(d, 0o755)
    if fs_group is not None:
        for path in [*(stamp / name for name in files), stamp, folder]:
            os.chown(path, 0, fs_group)
            extra = 0o440 | (0o2110 if path.is_dir() else 0)
            os.chmod(path, (os.stat(path).st_mode & 0o7777) | extra)
    return folder


@dataclass
class Cluster:
    """One namespace's objects: the ConfigMaps and Secrets of a render plus the operator's (EXTERNAL), and the
    persistent volumes (folders) the claims bind to."""

    work: Path
    image: Image
    config_maps: dict[str, dict[str, bytes]]
    secrets: dict[str, dict[str, bytes]]
    claims: dict[str, Path]

    def volume(self, pod: str, vol: dict, fs_group: int | None) -> tuple[Path, bool]:
        """The host folder behind one pod volume, and whether the volume itself is read-only."""
        gid = fs_group or 0
        base = self.work / "pods" / pod / "volumes" / vol["name"]
        if "emptyDir" in vol:
            if not base.exists():
                base.mkdir(parents=True)
                os.chown(base, 0, gid)  # emptyDir: 0777; fsGroup: its group and setgid (volume ownership)
                os.chmod(base, 0o2777 if fs_group else 0o777)
            return base, False
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]
            return self.claims[claim["claimName"]], bool(claim.get("readOnly"))
        src, data = ("configMap", self.config_maps) if "configMap" in vol else ("secret", self.secrets)
        ref = vol[src]
        name = ref.get("name") or ref.get("secretName")
        content = data[name]
        mode = ref.get("defaultMode", 0o644)
        if "items" in ref:
            content = {i["path"]: content[i["key"]] for i in ref["items"]}
        if not base.exists():
            atomic_writer(base, content, mode, fs_group)
        return base, True


# ---- a pod ------------------------------------------------------------------------------------------------------


def _probe_command(probe: dict, ports: dict[str, int]) -> list[str]:
    """A probe from the pod's network (the kubelet reaches the pod's address; here: the pod's own loopback)."""
    if "httpGet" in probe:
        get = probe["httpGet"]
        port = ports.get(get["port"], get["port"])
        code = (
            "import sys, urllib.request\n"
            f"r = urllib.request.urlopen('http://127.0.0.1:{port}{get.get('path', '/')}', timeout=5)\n"
            "sys.exit(0 if 200 <= r.status < 400 else 1)"
        )
        return ["/usr/bin/python3", "-c", code]
    if "tcpSocket" in probe:
        port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5).close()"
        return ["/usr/bin/python3", "-c", code]
    raise PodFailed(f"probe kind not modelled: {probe}")


class Pod:
    """One pod of a rendered workload, run to ready and drained (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        spec: dict,
        extra_env: dict[str, str] | None = None,
        hosts: dict[str, str] | None = None,
        netns: str | None = None,
        lws_env: dict[str, str] | None = None,
    ):
        self.cluster, self.name, self.spec = cluster, name, spec
        self.extra_env = extra_env or {}
        self.lws_env = lws_env or {}  # LeaderWorkerSet's variables: ahead of (replacing) the container's own
        self.t0 = time.monotonic()  # the pod's notes say when, from its creation
        self.dir = cluster.work / "pods" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.netns = netns or f"pod{os.getpid() % 10000}{abs(hash(name)) % 1000}"
        self.own_netns = netns is None
        self.hosts = hosts or {}
        self.procs: dict[str, Proc] = {}
        self.log = self.dir / "pod.log"

    # -- namespaces
    def __enter__(self) -> Pod:
        if self.own_netns:
            _sh("ip", "netns", "add", self.netns)
            _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs.values():
            if p.popen.poll() is None:
                # the container's first process is its pid namespace's init: SIGKILL to it ends every process
                # in the container, an exec'd hook included (bwrap, killed alone, leaves them running)
                if p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                p.popen.kill()
                p.popen.wait()
        if self.own_netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    # -- the container's sandbox
    def identity(self, c: dict) -> Identity:
        pod_sc = self.spec.get("securityContext") or {}
        sc = c.get("securityContext") or {}
        uid = sc.get("runAsUser", pod_sc.get("runAsUser", self.cluster.image.uid))
        gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", self.cluster.image.gid if uid != 0 else 0))
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and uid == 0:
            raise PodFailed(f"{self.name}/{c['name']}: runAsNonRoot and the container runs as root (kubelet refuses)")
        groups = [gid, *([pod_sc["fsGroup"]] if "fsGroup" in pod_sc else []), *pod_sc.get("supplementalGroups", [])]
        caps = capabilities(sc.get("capabilities") or {})
        nnp = sc.get("allowPrivilegeEscalation") is False
        return Identity(uid, gid, sorted(set(groups)), sorted(caps), nnp)

    def sandbox(self, c: dict) -> Sandbox:
        fs_group = (self.spec.get("securityContext") or {}).get("fsGroup")
        vols = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts: list[str] = []
        for m in c.get("volumeMounts", []):
            src, vol_ro = self.cluster.volume(self.name, vols[m["name"]], fs_group)
            mounts += ["--ro-bind" if (m.get("readOnly") or vol_ro) else "--bind", str(src), m["mountPath"]]
        etc_hosts = self.dir / "hosts"  # the kubelet's /etc/hosts (a bind mount in every container of the pod)
        lines = ["127.0.0.1\tlocalhost", *(f"{ip}\t{host} {host.split('.')[0]}" for host, ip in self.hosts.items())]
        etc_hosts.write_text("\n".join(lines) + "\n")
        mounts += ["--ro-bind", str(etc_hosts), "/etc/hosts"]
        who = self.identity(c)
        image = self.cluster.image
        env = dict(image.env) | {"HOSTNAME": self.name, "HOME": image.home(who.uid)} | self.extra_env
        for e in c.get("env", []):
            env[e["name"]] = str(e.get("value", ""))
        for ref in c.get("envFrom", []):
            src = self.cluster.config_maps if "configMapRef" in ref else self.cluster.secrets
            name = (ref.get("configMapRef") or ref.get("secretRef"))["name"]
            env |= {k: v.decode() for k, v in src[name].items()}
        env |= self.lws_env
        ro = bool((c.get("securityContext") or {}).get("readOnlyRootFilesystem"))
        cwd = c.get("workingDir", image.workdir)
        return Sandbox(image, mounts, who, env, cwd, self.name.split(".")[0], ro, self.netns)

    def _command(self, c: dict) -> list[str]:
        if "command" not in c:
            raise PodFailed(f"{self.name}/{c['name']}: no command: the image's CMD is not modelled")
        return [*c["command"], *c.get("args", [])]

    def _note(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"[pods] {self.name} +{time.monotonic() - self.t0:.1f}s: {text}\n")

    # -- the life cycle
    def init(self, timeout: float = 300) -> None:
        for c in self.spec.get("initContainers", []):
            self._note(f"init container {c['name']}: {shlex.join(self._command(c))}")
            p = Proc(self.sandbox(c), self._command(c), self.dir / f"{c['name']}.log")
            try:
                rc = p.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                raise PodFailed(f"{self.name}/{c['name']}: still running after {timeout} s\n{p.tail()}") from None
            if rc != 0:
                raise PodFailed(f"{self.name}: init container {c['name']} exited {rc}\n{p.tail()}")

    def start(self) -> None:
        for c in self.spec["containers"]:
            self._note(f"container {c['name']}: {shlex.join(self._command(c))}")
            self.procs[c["name"]] = Proc(self.sandbox(c), self._command(c), self.dir / f"{c['name']}.log")

    def probe_ok(self, c: dict, probe: dict) -> bool:
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        cmd = ["ip", "netns", "exec", self.netns, *_probe_command(probe, ports)]
        return subprocess.run(cmd, capture_output=True, timeout=probe.get("timeoutSeconds", 1) + 5).returncode == 0

    def wait_ready(self) -> dict[str, float]:
        """Each container's startupProbe, then readiness and liveness, within the YAML's budgets. Returns seconds
        to ready per container."""
        took = {}
        for c in self.spec["containers"]:
            start = time.monotonic()
            proc = self.procs[c["name"]]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                budget = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get(
                    "failureThreshold", 3
                )
                end = time.monotonic() + budget
                while not self.probe_ok(c, probe):
                    if proc.popen.poll() is not None:
                        raise PodFailed(
                            f"{self.name}/{c['name']} exited {proc.popen.returncode} before its "
                            f"{kind} passed\n{proc.tail()}"
                        )
                    if time.monotonic() > end:
                        raise PodFailed(f"{self.name}/{c['name']}: {kind} failed for {budget} s\n{proc.tail()}")
                    time.sleep(POLL_S)
                self._note(f"{c['name']} {kind} passed")
            took[c["name"]] = time.monotonic() - start
        return took

    def stop(self) -> dict[str, int]:
        """The kubelet's kill of each container, all at once (kubernetes/kubernetes pkg/kubelet/kuberuntime/
        kuberuntime_container.go at fbba6b47: killContainersWithSyncResult starts one goroutine per container,
        killContainer runs that container's preStop, then StopContainer: SIGTERM, SIGKILL once the grace period
        less the hook's time has passed, never under minimumGracePeriodInSeconds, 2 s). So a container without a
        preStop (a sidecar) gets SIGTERM at once, while the server beside it drains in its hook. Exit codes per
        container; a container still running at its grace period fails the stop."""
        import concurrent.futures

        grace = self.spec.get("terminationGracePeriodSeconds", 30)
        start = time.monotonic()

        def kill(c: dict) -> int:
            proc = self.procs[c["name"]]
            hook = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec")
            if hook:
                self._note(f"{c['name']} preStop: {shlex.join(hook['command'])}")
                r = proc.exec(hook["command"], timeout=grace)
                if r.returncode != 0:
                    self._note(f"{c['name']} preStop exited {r.returncode}: {r.stdout}{r.stderr}")
            left = max(MIN_GRACE_S, grace - (time.monotonic() - start))
            try:
                proc.signal(signal.SIGTERM)
            except ProcessLookupError:  # its first process ended between the check and the signal
                pass
            try:
                return proc.popen.wait(timeout=left)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                raise PodFailed(f"{self.name}/{c['name']}: still running {grace} s after its stop began") from None

        containers = self.spec["containers"]
        with concurrent.futures.ThreadPoolExecutor(len(containers)) as pool:
            codes = dict(zip((c["name"] for c in containers), pool.map(kill, containers)))
        self._note(f"stopped after {time.monotonic() - start:.1f} s: {codes}")
        return codes


# ---- a Slurm job -------------------------------------------------------------------------------------------------


def _srun_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's options (`--name=value` or `--name value`) and the step's command."""
    opts: dict[str, str] = {}
    i = 0
    flags = {"--container-writable", "--container-readonly", "--no-container-mount-home", "--container-mount-home"}
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if "=" in arg:
            k, v = arg.split("=", 1)
        elif arg in flags:
            k, v = arg, ""
        else:
            k, v = arg, argv[i + 1]
            i += 1
        opts[k] = v
        i += 1
    return opts, argv[i:]


class SlurmJob:
    """An sbatch script run as the submitting user (uid/gid `user`) in a network namespace of its own (the job's
    node), its `srun` steps started in containers with pyxis' and enroot's defaults (module docstring), and Slurm's
    signals delivered as slurmd and slurmstepd deliver them (SchedMD/slurm 284c3b95):

    - a step's tasks are the processes slurmstepd forks; proctrack/cgroup signals only those (proctrack_cgroup.c
      proctrack_p_signal: a pid whose parent is slurmstepd is a task, "inherited processes will only get SIGKILL",
      unless cgroup.conf's SignalChildrenProcesses, default no); here a task is the command bwrap starts, with no pid
      namespace (an enroot container has none: Sandbox.pid_namespace);
    - once a step's tasks have all exited, every process left in it is SIGKILLed (slurmstepd/mgr.c:
      proctrack_g_signal(cont_id, SIGKILL) after the tasks end): kill_step;
    - `scancel --signal=SIG JOBID` and sbatch's `--signal=SIG@T` signal the job's steps, not the batch shell;
      `B:` signals the batch shell only (sbatch.1 --signal): warn;
    - the job's end (its batch script exited, plain `scancel`, the time limit): SIGCONT, then SIGTERM to the tasks
      of every step and the batch shell, then after max(KillWait, 5) s SIGKILL to every process left (slurmd/req.c
      _rpc_terminate_job, _rpc_timelimit; slurmctld's deallocate_nodes sends it to each node): end;
    - srun itself turns a SIGTERM, SIGHUP or SIGQUIT it receives into SIGKILL for every task ("forcing job
      termination", src/srun/signals.c _forward_signal) and forwards other signals as they are: the stand-in srun
      (tests/pods_image/slurm/srun) sends the signal to deliver."""

    KILL_WAIT_S = 30  # slurm.conf KillWait's default

    def __init__(self, image: Image, work: Path, user: int = 1000, nodes: str = "node0"):
        self.image, self.work, self.user, self.nodes = image, work, user, nodes
        self.netns = f"slurm{os.getpid() % 100000}{abs(hash(str(work))) % 1000}"
        self.sock_path = work / "slurm.sock"
        self.log = work / "slurm-job.log"
        self.steps: list[dict[str, Any]] = []
        self.tasks: list[list[Proc]] = []  # per step, its tasks
        self.batch: subprocess.Popen[bytes] | None = None
        self.script: Path | None = None
        self.node = self._node_files()

    def _node_files(self) -> dict[str, Path]:
        """The node's own /etc files enroot binds into every container (conf/mounts/20-config.fstab at enroot
        8ea147d: /etc/hosts, /etc/hostname, /etc/resolv.conf, and /etc/machine-id where the node has one, each
        `bind,ro`): the node's name resolving to itself, as a cluster node's hosts file or DNS answers."""
        d = self.work / "node"
        d.mkdir(parents=True, exist_ok=True)
        first = self.nodes.split(",")[0]
        (d / "hosts").write_text("127.0.0.1\tlocalhost\n" + "".join(f"127.0.0.1\t{n}\n" for n in self.nodes.split(",")))
        (d / "hostname").write_text(first + "\n")
        out = {"/etc/hosts": d / "hosts", "/etc/hostname": d / "hostname"}
        for name in ("resolv.conf", "machine-id"):  # the host's, as the node's
            if Path("/etc", name).is_file():
                out[f"/etc/{name}"] = Path("/etc", name)
        return out

    def sandbox(self, opts: dict[str, str], env: dict[str, str], step: int) -> Sandbox:
        # enroot's tmpfs mounts belong to the user (they are made in the user's namespace): writable by it
        mounts = []
        for tmp in ("/tmp", "/var/run", "/var/lock", "/dev/shm"):
            mounts += ["--perms", "1777", "--tmpfs", tmp]
        for dst, src in self.node.items():
            mounts += ["--ro-bind", str(src), dst]
        for spec in filter(None, opts.get("--container-mounts", "").split(",")):
            src, dst, *flags = spec.split(":") + ([] if ":" in spec else [spec])
            for parent in reversed(Path(dst).parents[:-1]):  # x-create=dir: mkdir -p, 0755
                mounts += ["--perms", "0755", "--dir", str(parent)]
            mounts += ["--ro-bind" if "ro" in flags else "--bind", src, dst]
        # no no_new_privs: enroot-switchroot sets PR_SET_NO_NEW_PRIVS (bin/enroot-switchroot.c drop_privileges)
        # in the process `enroot start` runs, but a pyxis task is not that process: slurmstepd forks it and
        # pyxis_slurmstepd.c (1075199, slurm_spank_task_init) joins it to the container's namespaces with setns
        # and installs its seccomp filter under CAP_SYS_ADMIN of the joined user namespace, never setting the bit
        who = Identity(self.user, self.user, [self.user], [], False)
        task_env = env | self.image.env | {"HOME": self.image.home(self.user)}
        cwd = opts.get("--container-workdir", self.image.workdir)
        read_only = "--container-writable" not in opts
        node = self.nodes.split(",")[0]
        return Sandbox(self.image, mounts, who, task_env, cwd, node, read_only, self.netns, pid_namespace=False)

    def _serve_step(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            req = json.loads(f.readline())
            opts, command = _srun_args(req["argv"])
            ntasks = int(opts.get("--ntasks", req["env"].get("SLURM_NTASKS", "1")))
            n = len(self.steps)
            self.steps.append({"opts": opts, "command": command})
            procs = []
            for rank in range(ntasks):
                env = req["env"] | {"SLURM_PROCID": str(rank), "SLURM_STEP_ID": str(n)}
                env.pop("PODS_SLURM_SOCKET", None)
                box = self.sandbox(opts, env, n)
                procs.append(Proc(box, command, self.work / f"step{n}-task{rank}.log"))
            self.tasks.append(procs)

            def relay_signals() -> None:  # what the stand-in srun forwards, to the step's tasks
                for line in f:
                    sig = signal.Signals[json.loads(line)]
                    for p in procs:
                        p.signal(sig)

            import threading

            threading.Thread(target=relay_signals, daemon=True).start()
            rcs = [p.popen.wait() for p in procs]
            self.kill_step(procs)
            out = "".join(p.log.read_text(errors="replace") for p in procs)
            self.steps[n]["rc"], self.steps[n]["out"] = rcs, out
            try:
                conn.sendall(json.dumps({"out": out}).encode() + b"\n")
                conn.sendall(json.dumps({"rc": max(rcs) if rcs else 0}).encode() + b"\n")
            except OSError:
                pass

    @staticmethod
    def step_pids(procs: list[Proc]) -> list[int]:
        """Every process of a step (its cgroup): those in its tasks' containers (their mount namespaces)."""
        spaces = {p.mntns for p in procs if p.mntns}
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.readlink(d / "ns/mnt") in spaces:
                        out.append(int(d.name))
                except OSError:
                    continue
        return out

    def kill_step(self, procs: list[Proc]) -> None:
        """SIGKILL to every process left in a step (slurmstepd once its tasks have ended, or at the job's end)."""
        for pid in self.step_pids(procs):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def signal_steps(self, sig: int) -> None:
        """`scancel --signal=SIG JOBID` (or sbatch's --signal=SIG@T): every step's tasks, not the batch shell."""
        for procs in self.tasks:
            for p in procs:
                p.signal(sig)

    def warn(self) -> None:
        """The time limit's warning, as the script's `#SBATCH --signal=[B:]SIG[@T]` asks: `B:` to the batch shell
        only, otherwise to the steps only (sbatch.1 --signal; slurmctld job_mgr's job warning signal)."""
        assert self.script is not None and self.batch is not None
        m = re.search(r"^#SBATCH --signal=(?:([RB]+):)?(\w+)", self.script.read_text(), re.M)
        if not m:
            raise PodFailed(f"{self.script}: no #SBATCH --signal: the time limit ends it without warning")
        name = m.group(2).upper()
        sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name] if not name.isdigit() else int(name)
        if "B" in (m.group(1) or ""):
            self.batch.send_signal(sig)
        else:
            self.signal_steps(sig)

    def end(self, kill_wait: float = KILL_WAIT_S) -> None:
        """The job's end (its script exited, `scancel JOBID`, the time limit): SIGCONT and SIGTERM to the tasks of
        every step and to the batch shell, then, after max(KillWait, 5) s, SIGKILL to every process left."""
        running = [procs for procs in self.tasks if any(p.popen.poll() is None for p in procs)]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for procs in running:
                for p in procs:
                    p.signal(sig)
            if self.batch is not None and self.batch.poll() is None:
                self.batch.send_signal(sig)
        end = time.monotonic() + max(kill_wait, 5)
        while time.monotonic() < end and any(p.popen.poll() is None for procs in running for p in procs):
            time.sleep(POLL_S)
        for procs in self.tasks:
            self.kill_step(procs)
        if self.batch is not None and self.batch.poll() is None:
            self.batch.kill()
        for procs in self.tasks:
            for p in procs:
                p.popen.wait()

    def start(self, script: Path, env: dict[str, str], ntasks: int = 1) -> subprocess.Popen[bytes]:
        """Submit: the batch script as the user, with the stand-in srun / scontrol first on PATH."""
        import threading

        _sh("ip", "netns", "add", self.netns)
        _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o777)
        server.listen()

        def accept() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=self._serve_step, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        self.server = server
        job = {
            "PATH": f"{STANDINS / 'slurm'}:/usr/bin:/bin",
            "HOME": "/tmp",
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": str(ntasks),
            "SLURM_JOB_NUM_NODES": str(len(self.nodes.split(","))),
            "SLURM_JOB_NODELIST": self.nodes,
            "SLURM_GPUS_PER_NODE": str(ntasks),
            "SLURM_SUBMIT_DIR": str(ROOT),
            "PODS_SLURM_SOCKET": str(self.sock_path),
        } | env
        cmd = ["ip", "netns", "exec", self.netns, "setpriv", "--reuid", str(self.user), "--regid", str(self.user)]
        cmd += ["--clear-groups", "env", "-i", *(f"{k}={v}" for k, v in job.items()), "bash", str(script)]
        self.script = script
        with open(self.log, "ab") as out:
            self.batch = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.work)
        return self.batch

    def ready(self, port: int, path: str = "/ready") -> bool:
        """GET `path` on the job's first node."""
        code = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5)"
        cmd = ["ip", "netns", "exec", self.netns, "/usr/bin/python3", "-c", code]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def close(self) -> None:
        self.end(kill_wait=0)
        self.server.close()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


# ---- a LeaderWorkerSet group ---------------------------------------------------------------------------------------


@dataclass
class LwsTemplate:
    """What a LeaderWorkerSet's controller reads to make a group: its name, leaderWorkerTemplate.size and the two
    pod templates."""

    name: str
    size: int
    leader: dict
    worker: dict

    @classmethod
    def of(cls, docs: list[dict]) -> LwsTemplate:
        (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
        lwt = lws["spec"]["leaderWorkerTemplate"]
        return cls(
            lws["metadata"]["name"],
            int(lwt.get("size", 1)),
            lwt["leaderTemplate"]["spec"],
            lwt["workerTemplate"]["spec"],
        )


def lws_env(lws: str, group: int, size: int, worker: int, namespace: str) -> dict[str, str]:
    """The variables LWS puts in every container of a group's pods (AddLWSVariables; the default subdomain policy,
    Shared: the subdomain is the LWS's name)."""
    return {
        "LWS_LEADER_ADDRESS": f"{lws}-{group}.{lws}.{namespace}",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker),
    }


class LwsGroup:
    """Group `group` of a LeaderWorkerSet, as its controller, the kubelet and the cluster network make it (module
    docstring): `pods[0]` the leader, `pods[i]` worker i, each in its own network namespace with an `eth0` on one
    bridge (in a namespace of its own, as the node's network is to the pods), the group's names in each /etc/hosts."""

    def __init__(self, cluster: Cluster, lws: LwsTemplate, group: int = 0, namespace: str = "default"):
        self.tag = f"lws{os.getpid() % 10000}{abs(hash(lws.name)) % 100}"
        self.bridge_ns = f"{self.tag}br"
        self.netns = [f"{self.tag}p{i}" for i in range(lws.size)]
        names = [f"{lws.name}-{group}", *(f"{lws.name}-{group}-{i}" for i in range(1, lws.size))]
        self.addresses = [f"10.244.{group % 250}.{i + 2}" for i in range(lws.size)]
        hosts = {}
        for name, ip in zip(names, self.addresses):
            fqdn = f"{name}.{lws.name}.{namespace}"  # <hostname>.<subdomain>.<namespace>[.svc.cluster.local]
            hosts[f"{fqdn}.svc.cluster.local"] = ip
            hosts[fqdn] = ip
        self.pods = [
            Pod(
                cluster,
                name,
                lws.leader if i == 0 else lws.worker,
                hosts=hosts,
                netns=self.netns[i],
                lws_env=lws_env(lws.name, group, lws.size, i, namespace),
            )
            for i, name in enumerate(names)
        ]

    def __enter__(self) -> LwsGroup:
        _sh("ip", "netns", "add", self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(self.netns, self.addresses)):
            _sh("ip", "netns", "add", ns)
            peer = f"veth{i}"
            _sh("ip", "link", "add", peer, "netns", self.bridge_ns, "type", "veth", "peer", "eth0", "netns", ns)
            _sh("ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: Any) -> None:
        for pod in self.pods:
            pod.__exit__(*exc)
        for ns in [*self.netns, self.bridge_ns]:  # every veth goes with its namespace
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in map(int, pids):  # what the pods left (mpirun's remote daemons run in sessions of their own)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def stop(self) -> list[dict[str, int]]:
        """The group deleted: every pod's stop (preStop, SIGTERM, the grace period) at once, as the kubelets of its
        nodes run them. Exit codes per pod, leader first."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(len(self.pods)) as pool:
            return list(pool.map(Pod.stop, self.pods))

    def http(self, port: int, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
        """A request to the leader from inside the group's network (its own netns), as a client behind the
        Service reaches it: (status, body)."""
        code = (
            "import json, sys, urllib.error, urllib.request\n"
            "url, body, key = sys.argv[1:]\n"
            "headers = {'Content-Type': 'application/json'} | ({'Authorization': f'Bearer {key}'} if key else {})\n"
            "req = urllib.request.Request(url, body.encode() or None, headers)\n"
            "try:\n"
            "    r = urllib.request.urlopen(req, timeout=60); print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code); print(e.read().decode())\n"
        )
        url = f"http://{self.addresses[0]}:{port}{path}"
        cmd = ["ip", "netns", "exec", self.netns[0], "/usr/bin/python3", "-c", code, url]
        r = subprocess.run(
            [*cmd, json.dumps(body) if body is not None else "", key or ""], capture_output=True, text=True, timeout=120
        )
        if r.returncode != 0:
            raise PodFailed(f"request to {url} failed: {r.stderr}")
        status, _, text = r.stdout.partition("\n")
        return int(status), text


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """role -> pod spec: `single` / `triton` (a Deployment, by its name), `leader` / `worker` (a LeaderWorkerSet)."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            out["triton" if "triton" in d["metadata"]["name"] else "single"] = d["spec"]["template"]["spec"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out["leader"] = lwt["leaderTemplate"]["spec"]
            out["worker"] = lwt["workerTemplate"]["spec"]
    return out


def config_maps(docs: list[dict]) -> dict[str, dict[str, bytes]]:
    return {
        d["metadata"]["name"]: {k: v.encode() for k, v in d.get("data", {}).items()}
        for d in docs
        if d["kind"] == "ConfigMap"
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_work(prefix: str = "pods-") -> Path:
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(work, 0o755)
    return work


if __name__ == "__main__":
    print(__doc__, file=sys.stderr)
