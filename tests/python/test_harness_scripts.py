"""build/fuzz.sh and build/stress_tests.sh, driven by fake commands: the
fuzz pass retries only the coordinator's own errors and fails on a real
failing input; the stress run reports each run and fails if one failed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, wait_until

FUZZ = REPO / "build" / "fuzz.sh"
STRESS = REPO / "build" / "stress_tests.sh"
HUNG = "fuzzing process hung or terminated unexpectedly while minimizing: EOF"

# A stand-in for `go test`: a fuzzing pass (-fuzz=) behaves as FAKE_FUZZ's
# next word says (one word per pass, the last one repeating), a re-run of
# one saved input (-run=Target/input) as FAKE_RERUN says. Every call is
# logged to FAKE_LOG.
FAKE_GO = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
pkg=${@: -1}; pkg=${pkg#./}
fuzz=""; run=""
for a in "$@"; do
  case $a in -fuzz=*) fuzz=${a#-fuzz=}; fuzz=${fuzz#^}; fuzz=${fuzz%$} ;; -run=*) run=${a#-run=} ;; esac
done
if [ -z "$fuzz" ]; then
  [ "$FAKE_RERUN" = pass ] && { echo ok; exit 0; }
  echo "--- FAIL: $run"; exit 1
fi
n=$(grep -c -- '-fuzz=' "$FAKE_LOG")
read -r -a modes <<< "$FAKE_FUZZ"
i=$(( n <= ${#modes[@]} ? n - 1 : ${#modes[@]} - 1 ))
save() { mkdir -p "$pkg/testdata/fuzz/$fuzz"; echo 'go test fuzz v1' > "$pkg/testdata/fuzz/$fuzz/$1"; }
case ${modes[$i]} in
  pass) echo "fuzz: elapsed: 3s, execs: 20000"; echo PASS; exit 0 ;;
  hung) save "in$n"; echo "--- FAIL: $fuzz (9.0s)"; echo "    $HUNG"; echo "    Failing input written to testdata/fuzz/$fuzz/in$n"; exit 1 ;;
  hung-no-input) echo "--- FAIL: $fuzz (9.0s)"; echo "    $HUNG"; exit 1 ;;
  deadline) echo "--- FAIL: $fuzz (10.0s)"; echo "    context deadline exceeded"; exit 1 ;;
  fail) save "in$n"; echo "--- FAIL: $fuzz (0.2s)"; echo "    --- FAIL: $fuzz (0.00s)"; echo "        x_test.go:9: decoded a frame it should refuse"; echo "    Failing input written to testdata/fuzz/$fuzz/in$n"; exit 1 ;;
esac
echo "fake go: unknown mode ${modes[$i]}" >&2; exit 3
"""


@pytest.fixture
def tree(tmp_path):
    """A repository with one fuzz target, core/x FuzzDecode, and a fake go."""
    (tmp_path / "core" / "x").mkdir(parents=True)
    (tmp_path / "core" / "x" / "x_test.go").write_text(
        "package x\n\nimport \"testing\"\n\nfunc FuzzDecode(f *testing.F) {}\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "go"
    fake.write_text(FAKE_GO)
    fake.chmod(0o755)
    return tmp_path


def fuzz(tree: Path, fuzz_modes: str, rerun: str = "pass", **env: str):
    log = tree / "go.log"
    log.write_text("")
    proc = subprocess.run(
        ["bash", str(FUZZ)],
        cwd=tree,
        env=dict(
            os.environ,
            GO=str(tree / "bin" / "go"),
            FAKE_LOG=str(log),
            FAKE_FUZZ=fuzz_modes,
            FAKE_RERUN=rerun,
            HUNG=HUNG,
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = log.read_text().splitlines()
    return proc, [c for c in calls if "-fuzz=" in c], [c for c in calls if "-fuzz=" not in c]


def saved(tree: Path) -> list[str]:
    d = tree / "core" / "x" / "testdata" / "fuzz" / "FuzzDecode"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_a_pass_runs_one_bounded_worker(tree):
    proc, passes, reruns = fuzz(tree, "pass")
    assert proc.returncode == 0, proc.stderr
    assert len(passes) == 1 and not reruns
    assert "-parallel=1" in passes[0] and "-fuzztime=20000x" in passes[0]
    assert "-fuzz=^FuzzDecode$" in passes[0] and passes[0].endswith("./core/x")
    assert "1 targets, 0 failed, 0 harness retries" in proc.stderr


def test_hung_while_minimizing_is_retried_when_its_input_passes(tree):
    proc, passes, reruns = fuzz(tree, "hung pass")
    assert proc.returncode == 0, proc.stderr
    assert len(passes) == 2, "fuzzed again after the harness error"
    assert reruns == ["test -count=1 -run=^FuzzDecode$/^in1$ ./core/x"]
    assert "harness error (hung while minimizing)" in proc.stderr
    assert "retry 1 of 2" in proc.stderr
    assert "0 failed, 1 harness retries" in proc.stderr
    assert saved(tree) == [], "an input that passes on its own is not kept"


def test_coordinator_deadline_without_an_input_is_retried(tree):
    proc, passes, _ = fuzz(tree, "deadline pass")
    assert proc.returncode == 0, proc.stderr
    assert len(passes) == 2
    assert "harness error (coordinator deadline)" in proc.stderr


def test_a_real_failing_input_fails_the_run_and_is_kept(tree):
    proc, passes, reruns = fuzz(tree, "fail pass", rerun="fail")
    assert proc.returncode == 1
    assert len(passes) == 1, "a real failure is not retried"
    assert not reruns
    assert "decoded a frame it should refuse" in proc.stderr
    assert "found a failing input: core/x/testdata/fuzz/FuzzDecode/in1" in proc.stderr
    assert saved(tree) == ["in1"]


def test_hung_with_an_input_that_fails_again_is_a_real_failure(tree):
    proc, passes, reruns = fuzz(tree, "hung pass", rerun="fail")
    assert proc.returncode == 1
    assert len(passes) == 1 and len(reruns) == 1
    assert "harness error" not in proc.stderr
    assert saved(tree) == ["in1"]


def test_hung_without_a_saved_input_is_not_retried(tree):
    proc, passes, _ = fuzz(tree, "hung-no-input pass")
    assert proc.returncode == 1
    assert len(passes) == 1


def test_a_harness_error_every_time_fails_after_the_retries(tree):
    proc, passes, _ = fuzz(tree, "deadline", FUZZ_RETRIES="2")
    assert proc.returncode == 1
    assert len(passes) == 3
    assert "on every one of 3 tries" in proc.stderr
    assert "1 failed, 2 harness retries" in proc.stderr


def stress(tmp_path: Path, cmd: str, runs: str = "3", **env: str):
    return subprocess.run(
        ["bash", str(STRESS), runs],
        cwd=tmp_path,
        env=dict(os.environ, ECM_STRESS_CMD=cmd, ECM_STRESS_LOGS=str(tmp_path / "logs"), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def hog_pids(out: str) -> list[int]:
    for line in out.splitlines():
        if line.startswith("stress: hog pids "):
            return [int(p) for p in line.split()[3:]]
    raise AssertionError(f"no hog pids line in:\n{out}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for this purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(params=["stress-ng", "loop"])
def hog(request):
    if request.param == "stress-ng" and not shutil.which("stress-ng"):
        pytest.skip("stress-ng is not installed")
    return {"ECM_STRESS_HOG": request.param}


def test_stress_runs_pass_and_the_hog_is_gone(tmp_path, hog):
    proc = stress(tmp_path, "echo run; true", **hog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in (1, 2, 3):
        assert f"run {i}/3: pass" in proc.stdout
    assert "3 of 3 runs passed" in proc.stdout
    pids = hog_pids(proc.stdout)
    assert pids and not any(alive(p) for p in pids)


def test_stress_reports_each_failure_with_its_first_failing_line(tmp_path, hog):
    # runs 1 and 3 fail, run 2 passes
    cmd = 'n=$(cat count 2>/dev/null || echo 0); n=$((n+1)); echo $n > count; echo "== go test"; ' \
          'if [ $((n % 2)) = 1 ]; then echo "--- FAIL: TestThing$n (0.01s)"; echo "FAIL"; exit 1; fi; echo ok'
    proc = stress(tmp_path, cmd, **hog)
    assert proc.returncode == 1
    assert "run 1/3: FAIL" in proc.stdout and "--- FAIL: TestThing1 (0.01s)" in proc.stdout
    assert "run 2/3: pass" in proc.stdout
    assert "run 3/3: FAIL" in proc.stdout and "--- FAIL: TestThing3 (0.01s)" in proc.stdout
    assert "1 of 3 runs passed" in proc.stdout
    assert (tmp_path / "logs" / "run-1.log").read_text().count("TestThing1") == 1
    assert not any(alive(p) for p in hog_pids(proc.stdout))


def test_stress_refuses_a_count_that_is_not_one(tmp_path):
    proc = stress(tmp_path, "true", runs="x")
    assert proc.returncode == 2
    assert "N must be a positive count" in proc.stderr


def test_an_interrupted_stress_run_stops_its_hog_and_its_test_run(tmp_path, hog):
    pid_file = tmp_path / "cmd.pid"
    proc = subprocess.Popen(
        ["bash", str(STRESS), "1"],
        cwd=tmp_path,
        env=dict(os.environ, ECM_STRESS_CMD=f"echo $$ > {pid_file}; exec sleep 600", ECM_STRESS_LOGS=str(tmp_path / "logs"), **hog),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pids = None
        for line in proc.stdout:
            if line.startswith("stress: hog pids "):
                pids = [int(p) for p in line.split()[3:]]
                break
        assert pids, "the script said which hogs it started"
        wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, what="the test run started")
        run_pid = int(pid_file.read_text())
        proc.terminate()
        assert proc.wait(timeout=60) == 143
        assert not any(alive(p) for p in pids), "the hog is gone"
        wait_until(lambda: not alive(run_pid), 30, what="the test run stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
