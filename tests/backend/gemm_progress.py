#!/usr/bin/python3
"""The f32 GEMM route makes progress however many threads share however few
cores (ctest entry `gemm_progress`; backend/cpu/blas.h).

A GPT-2 124M training step (B = 4, T = 64; tests/backend/gpt2_step_main.cpp,
two steps per process) runs
  1. alone with threads = cores (the baseline),
  2. alone with threads = 2 x cores,
  3. as two processes at once, threads = cores each,
and 2 and 3 must finish their steps within a generous factor of the baseline's
time measured in this run (ideal: about 1x and 2x). This is a progress check,
not a benchmark: the factors leave room for a busy machine, while the failure it
guards against is orders of magnitude: BLIS's own threads spin in their
barriers without yielding, and with threads > free cores a step took minutes
instead of a second (issue 25). A process still running at its deadline is
killed and reported as stalled. Every run also prints a digest of the
parameters after its steps: runs with the same thread count must agree bit
for bit, and on the blis route (and portable, which is blis) so must runs with
different thread counts (its split of C does not change any element's sums).

Routes checked: the default (MOETRAIN_GEMM=auto) and blis, each once (on
AVX-512 CPUs auto is blis; on AVX2-only CPUs auto is OpenBLAS and blis is
forced, so BLIS's threading is checked on every machine that has BLIS; without
BLIS installed only the default route is checked, and the output says so).
Other routes can be named on the command line, e.g. to see the check fail on
BLIS's own threading:
  tests/backend/gemm_progress.py build/moetrain_gpt2_step blis-threaded
"""
import os
import subprocess
import sys
import time

STEPS = 2
OVERSUBSCRIBED_FACTOR = 4.0  # threads = 2 x cores, one process: ideal ~1x the baseline
CONCURRENT_FACTOR = 4.0      # two processes on the same cores: ideal ~2x
BASELINE_LIMIT_S = 120.0     # the baseline itself must finish (absolute: nothing to compare with yet)


def start(binary, route, threads):
    env = dict(os.environ, MOETRAIN_NUM_THREADS=str(threads))
    env.pop("MOETRAIN_GEMM", None)
    if route != "auto":
        env["MOETRAIN_GEMM"] = route
    return subprocess.Popen([binary, str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def run(binary, route, threads, copies, deadline_s):
    """Runs `copies` processes at once; returns one dict per process: route, step
    times, wall time, whether it finished, its output."""
    t0 = time.monotonic()
    procs = [start(binary, route, threads) for _ in range(copies)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline_s - (time.monotonic() - t0)))
            finished = p.returncode == 0
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            finished = False
        steps = [float(line.split()[2]) for line in out.splitlines() if line.startswith("step ")]
        used = [line.split(" kernels ") for line in out.splitlines() if line.startswith("route ")]
        digest = [line.split()[1] for line in out.splitlines() if line.startswith("parameters ")]
        results.append({"route": used[0][0].split()[1] if used else "?", "kernels": used[0][-1] if used else "?",
                        "steps": steps, "wall": time.monotonic() - t0,
                        "finished": finished and len(steps) == STEPS and len(digest) == 1, "code": p.returncode,
                        "output": out, "digest": digest[0] if digest else "?"})
    return results


def describe(r):
    if r["finished"]:
        steps = " + ".join(f"{s:.2f}" for s in r["steps"])
        return f"steps {steps} s (process {r['wall']:.1f} s), parameters {r['digest']}"
    return (f"STALLED: {len(r['steps'])} of {STEPS} steps in {r['wall']:.1f} s, killed"
            if r["code"] is not None and r["code"] < 0 else f"FAILED (exit {r['code']}): {r['output'].strip()}")


def check_route(binary, route, cores, checked):
    base = run(binary, route, cores, 1, BASELINE_LIMIT_S)[0]
    if not base["finished"]:
        if route == "blis" and "libblis.so.4 not found" in base["output"]:
            print(f"route blis: skipped, BLIS is not installed ({base['output'].strip()})")
            return True
        print(f"route {route}: the baseline (threads = {cores}, alone) did not finish: {describe(base)}")
        return False
    if base["kernels"] in checked:
        print(f"route {route}: runs {base['kernels']}, checked above")
        return True
    checked.add(base["kernels"])
    base_s = sum(base["steps"])
    print(f"route {route} ({base['kernels']}), {cores} cores:")
    print(f"  threads = {cores}, alone:        {describe(base)}")
    ok = True
    for label, threads, copies, factor in ((f"threads = {2 * cores}, alone:       ", 2 * cores, 1,
                                            OVERSUBSCRIBED_FACTOR),
                                           (f"threads = {cores}, two at once:  ", cores, 2, CONCURRENT_FACTOR)):
        # A process gets its bound plus the baseline's start-up and ten seconds before it is killed.
        deadline = factor * base_s + (base["wall"] - base_s) * copies + 10
        for i, r in enumerate(run(binary, route, threads, copies, deadline)):
            ratio = sum(r["steps"]) / base_s if r["finished"] else float("inf")
            passed = r["finished"] and ratio <= factor
            print(f"  {label}{describe(r)}: {ratio:.2f}x the baseline (bound {factor:g}x) "
                  f"{'ok' if passed else 'FAIL'}")
            if r["finished"] and (threads == cores or r["route"] == "blis") and r["digest"] != base["digest"]:
                print(f"  FAIL: parameters {r['digest']} differ from the baseline's {base['digest']}")
                passed = False
            ok &= passed
    return ok


def main():
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} MOETRAIN_GPT2_STEP [ROUTE ...]  (routes: auto openblas blis blis-threaded)")
    binary, routes = sys.argv[1], sys.argv[2:] or ["auto", "blis"]
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores (this process's affinity), load average {os.getloadavg()[0]:.2f}")
    checked = set()
    ok = True
    for route in routes:
        ok &= check_route(binary, route, cores, checked)
    print("gemm_progress: " + ("every route made progress" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
