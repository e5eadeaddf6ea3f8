"""docker-compose.yml, the Dockerfile and the Makefile's stack targets use flags the programs accept.

No Docker engine is needed: the compose file is parsed with pyyaml and each command's
flags are checked against the daemons' real `--help` output.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from clients import demo, stack
from tests.clients.conftest import LiveStack, dead_address
from tests.daemons import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
# The project's daemons (the valkey service runs the official image).
SERVICES = {name: s for name, s in COMPOSE["services"].items() if name != "valkey"}
VALKEY = COMPOSE["services"]["valkey"]


@functools.cache
def help_text(module: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"python -m {module} --help failed:\n{result.stderr}"
    return result.stdout


def flags_of(command: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in command if arg.startswith("--")]


def flag_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def port_of(address: str) -> str:
    return address.rpartition(":")[2]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_command_flags_are_accepted_by_the_daemon(name: str) -> None:
    command = SERVICES[name]["command"]
    assert command[:2] == ["python", "-m"] and command[2] in ("blockd", "computed", "gateway")
    accepted = help_text(command[2])
    for flag in flags_of(command):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", accepted), (
            f"{name}: `{command[2]} --help` does not list {flag}"
        )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_ports_health_checks_and_addresses_agree(name: str) -> None:
    service = SERVICES[name]
    command = service["command"]
    listen_port = port_of(flag_value(command, "--listen"))
    assert flag_value(command, "--listen").startswith("0.0.0.0:"), "reachable from other containers"
    probe = service["healthcheck"]["test"]
    if command[2] == "gateway":  # HTTP: GET /health
        assert f"127.0.0.1:{listen_port}/health" in probe[-1]
    else:
        assert probe[:4] == ["CMD", "python", "-m", "clients.healthcheck"]
        assert port_of(probe[-1]) == listen_port
    if command[2] == "computed":
        blockd_listen = flag_value(SERVICES["blockd"]["command"], "--listen")
        assert flag_value(command, "--blockd") == f"blockd:{port_of(blockd_listen)}"
        assert service["depends_on"]["blockd"]["condition"] == "service_healthy"
        assert any(v.endswith(":/models:ro") for v in service["volumes"]), "the model volume"
    else:
        published = [p.rsplit(":", 1)[1] for p in service["ports"]]
        assert published[0] == listen_port and all(p.startswith("127.0.0.1:") for p in service["ports"])
    if command[2] == "gateway":
        assert flag_value(command, "--blockd") == "blockd:50051"
        assert "--computed" not in command and "--no-discover" not in command, "workers come from blockd"


def test_workers_scale_without_edits() -> None:
    """`docker compose up --scale computed=N`: one worker service, no host port, no container
    name, no fixed announced address (each announces its container IP: it listens on 0.0.0.0)."""
    workers = [name for name, s in SERVICES.items() if s["command"][2] == "computed"]
    assert workers == ["computed"]
    worker = SERVICES["computed"]
    assert "ports" not in worker and "container_name" not in worker and "profiles" not in worker
    assert "--worker-address" not in worker["command"]
    from computed.__main__ import announced_address

    announced = announced_address(None, flag_value(worker["command"], "--listen"))
    assert announced is not None and not announced.startswith("0.0.0.0"), announced


def test_tokens_reach_every_daemon_under_one_name() -> None:
    assert {"BLOCKD_ADMIN_TOKEN", "BLOCKD_WORKER_TOKEN"} <= set(SERVICES["blockd"]["environment"])
    assert SERVICES["computed"]["environment"]["COMPUTED_WORKER_TOKEN"] == "${BLOCKD_WORKER_TOKEN:-}"
    assert SERVICES["gateway"]["environment"]["GATEWAY_BLOCKD_ADMIN_TOKEN"] == "${BLOCKD_ADMIN_TOKEN:-}"


def test_metrics_are_on_and_reachable() -> None:
    for name in ("blockd", "computed"):
        command = SERVICES[name]["command"]
        assert flag_value(command, "--metrics-host") == "0.0.0.0" and flag_value(command, "--metrics-port")
    assert "127.0.0.1:9100:9100" in SERVICES["blockd"]["ports"]


def test_the_gpu_override_reserves_a_gpu_and_builds_cuda_torch() -> None:
    gpu = yaml.safe_load((REPO / "deploy" / "docker-compose.gpu.yml").read_text())["services"]["computed"]
    assert gpu["build"]["args"]["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX=" in dockerfile and "TORCH_INDEX" in (REPO / "Makefile").read_text()


def test_the_shared_tier_is_a_valkey_service_every_daemon_uses() -> None:
    assert VALKEY["image"].startswith("valkey/valkey:")
    assert VALKEY["healthcheck"]["test"] == ["CMD", "valkey-cli", "ping"]
    assert any(v.endswith(":/data") for v in VALKEY["volumes"]) and "valkey-data" in COMPOSE["volumes"]
    assert "ports" not in VALKEY, "the store is reached inside the compose network only"
    for name in ("blockd", "computed"):
        service = SERVICES[name]
        assert flag_value(service["command"], "--shared-tier") == "redis://valkey:6379"
        assert service["depends_on"]["valkey"]["condition"] == "service_healthy"


def test_dockerfile_default_command_flags_are_accepted() -> None:
    line = next(raw for raw in (REPO / "Dockerfile").read_text().splitlines() if raw.startswith("CMD "))
    command = json.loads(line[4:])
    assert command[:3] == ["python", "-m", "blockd"]
    accepted = help_text("blockd")
    assert all(flag in accepted for flag in flags_of(command))


def _makefile_commands(module: str) -> list[list[str]]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+) \?= (.*)$", text, flags=re.MULTILINE))
    variables["BIN"] = ".venv/bin"
    lines = [line for line in text.splitlines() if f"-m {module} " in line]
    assert lines, f"no Makefile target runs {module}"
    expand = functools.partial(re.sub, r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""))
    return [shlex.split(expand(line))[2:] for line in lines]  # drop "$(BIN)/python -m"


def test_makefile_stack_and_demo_commands_parse() -> None:
    for argv in _makefile_commands("clients.stack"):
        args = stack._parser().parse_args(argv[1:])
        assert args.command in ("up", "down")
    for argv in _makefile_commands("clients.demo"):
        args = demo._parser().parse_args(argv[1:])
        assert args.blockd and args.computed


def test_health_probe(live: LiveStack) -> None:
    probe = [sys.executable, "-m", "clients.healthcheck", "--quiet"]
    ok = subprocess.run([*probe, live.blockd.address], cwd=REPO, capture_output=True, timeout=30, check=False)
    assert ok.returncode == 0
    down = subprocess.run([*probe, dead_address()], cwd=REPO, capture_output=True, timeout=30, check=False)
    assert down.returncode == 1
