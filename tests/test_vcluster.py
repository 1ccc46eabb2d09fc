"""The instrument check: ``scripts/vcluster.sh`` builds the cluster the benchmarks claim.

On 2 hosts at 1 Gbit/s: raw TCP in both directions at once runs within 10% of the rate each way,
every rank runs on its own host (hostname and network namespace), and the bytes between hosts go
through the shaped NICs (their tbf counters grow by what was sent, the loopback's do not).
Everything the script creates is gone after success, failure and SIGTERM. Needs root (CI runs
as root); the refusal without root is checked either way.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VCLUSTER = ROOT / "scripts" / "vcluster.sh"
PROBE = ROOT / "tests" / "vcluster_probe.py"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="scripts/vcluster.sh needs root "
                               "(network namespaces, veths, tc); run the tests as root")
RATE, RATE_BIT_S = "1gbit", 1e9
NBYTES = 50 << 20


def env() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=f"{venv_bin}:{os.environ.get('PATH', '')}",
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def vcluster(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([str(VCLUSTER), *args], capture_output=True, text=True, env=env(),
                          timeout=timeout, cwd=ROOT)


def probes(out: str) -> list[dict]:
    found = [json.loads(line.split("PROBE ", 1)[1]) for line in out.splitlines()
             if "PROBE " in line]
    return sorted(found, key=lambda p: p["rank"])


def leftovers(tag: str) -> list[str]:
    """Namespaces and /etc/netns entries of the cluster whose namespaces start with tag."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in names.splitlines() if line.startswith(tag)]
    netns_dir = Path("/etc/netns")
    if netns_dir.is_dir():
        left += [str(p) for p in netns_dir.iterdir() if p.name.startswith(tag)]
    return left


def test_bad_input_is_refused_with_the_fix() -> None:
    for args, message in ((["0", RATE, "--", "true"], "N must be a host count"),
                          (["2", "fast", "--", "true"], "RATE must be a tc bit rate"),
                          (["2", RATE, "true"], "expected -- after N and RATE"),
                          (["2", RATE, "--"], "no COMMAND given")):
        result = vcluster(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)


def test_refuses_without_root() -> None:
    """No silent fallback to an unshaped run: without root it says so and fails."""
    cmd = [str(VCLUSTER), "2", RATE, "--", "true"]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) missing: cannot drop root to check the refusal")
        cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert result.returncode == 3, result.stderr
    assert "needs root" in result.stderr and "unshaped" in result.stderr


@ROOT_ONLY
def test_duplex_rate_namespaces_and_shaped_nics() -> None:
    result = vcluster("2", RATE, "--", "mpirun", "-np", "2", "-H", "h0,h1", sys.executable,
                      str(PROBE), "--bytes", str(NBYTES))
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = probes(result.stdout)
    assert [p["hostname"] for p in ranks] == ["h0", "h1"], ranks
    mine = os.readlink("/proc/self/ns/net")
    assert len({p["netns"] for p in ranks} | {mine}) == 3, (mine, ranks)
    for p in ranks:
        rate = p["recv_bit_s"]
        print(f"rank {p['rank']} on {p['hostname']} received {rate / 1e9:.3f} Gbit/s while "
              f"sending (tbf {p['tbf_bytes']} B, {p['tbf_drops']} drops, lo {p['lo_bytes']} B)")
        assert abs(rate - RATE_BIT_S) <= 0.1 * RATE_BIT_S, \
            f"{p['hostname']} received {rate / 1e9:.3f} Gbit/s, not within 10% of {RATE}"
        # what a host sent went through its shaped NIC (payload + headers), not a loopback
        assert NBYTES <= p["tbf_bytes"] <= 1.2 * NBYTES, p
        assert p["lo_bytes"] < 0.01 * NBYTES, p
        assert p["tbf_drops"] == 0, p


@ROOT_ONLY
def test_horovodrun_gloo_puts_each_rank_on_its_host() -> None:
    result = vcluster("2", RATE, "--", "horovodrun", "-np", "2", "-H", "h0:1,h1:1", "--gloo",
                      sys.executable, str(PROBE), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = probes(result.stdout)
    assert [p["hostname"] for p in ranks] == ["h0", "h1"], result.stdout
    assert len({p["netns"] for p in ranks}) == 2, ranks


@ROOT_ONLY
def test_no_route_out_and_names_resolve() -> None:
    script = ("getent hosts h0 h1 h2 && ip route && ssh h2 hostname && "
              "! ip route get 8.8.8.8 2>/dev/null")
    result = vcluster("3", RATE, "--", "bash", "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"10\.77\.0\.3\s+h2", result.stdout), result.stdout
    assert "default" not in result.stdout
    assert result.stdout.strip().endswith("h2")


@ROOT_ONLY
def test_everything_removed_on_success_failure_and_sigterm() -> None:
    # exit status is the command's; the namespaces carry the script's pid (vc<pid>-...)
    for command, status in (("true", 0), ("exit 7", 7)):
        proc = subprocess.Popen([str(VCLUSTER), "2", RATE, "--", "bash", "-c", command],
                                env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.communicate(timeout=60)
        assert proc.returncode == status
        assert leftovers(f"vc{proc.pid}-") == []
    proc = subprocess.Popen([str(VCLUSTER), "2", RATE, "--", "ssh", "h1", "sleep", "60"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tag = f"vc{proc.pid}-"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not subprocess.run(
            ["ip", "netns", "pids", f"{tag}h1"], capture_output=True, text=True).stdout.strip():
        time.sleep(0.1)
    assert len(leftovers(tag)) >= 3, "the cluster never came up"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert leftovers(tag) == []
