"""How long ``eagle3-jax serve`` (default settings: the built-in pair) takes to be ready, on a
first start (an empty XLA compilation cache: every program compiles) and on later ones (the
programs come from the cache).

Each start runs the server on a free loopback port with ``--compile-cache DIR``, polls
``/health`` until it says ``ok`` (recording the ``warming_up`` bodies it said before, with the
programs compiled of the total), stops it, and prints the seconds from launch to ready, the
server's CPU seconds by then, its own progress lines and the machine's ``uptime`` before and
after (the load moves the times on a shared machine; nothing here is asserted).

Usage::

    python scripts/serve_startup.py [--cache DIR] [--starts 2] [--log DIR] [-- SERVE ARGS...]

``--cache``: the compilation cache (default: a fresh temporary directory, removed at the end,
so the first start compiles everything); ``--starts``: how many starts on it (default 2: the
first and the second); arguments after ``--`` go to ``eagle3-jax serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 900.0  # a start not ready by then is stopped and reported


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def start(cache: Path, log: Path, serve_args=(), poll_s: float = 0.25) -> dict:
    """One start of ``eagle3-jax serve``: ``ready_s`` (launch to ``/health`` ok, None if it
    never was), ``listening_s`` (launch to the first answer of ``/health``), ``cpu_s``,
    ``warming`` (the distinct ``warming_up`` bodies seen), ``uptime`` before and after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    argv = [sys.executable, "-m", "eagle3_jax.cli", "serve", "--port", str(port), "--log-level", "warning",
            "--compile-cache", str(cache), *serve_args]
    out = {"uptime_before": uptime(), "ready_s": None, "listening_s": None, "cpu_s": None, "warming": []}
    began = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - began < LIMIT_S:
                if proc.poll() is not None:
                    out["error"] = f"the server exited with status {proc.returncode}; see {log}"
                    break
                try:
                    body = client.get(url).json()
                except (httpx.HTTPError, ValueError):
                    body = None
                if body is not None:
                    if out["listening_s"] is None:
                        out["listening_s"] = round(time.monotonic() - began, 1)
                    if body.get("status") == "ok":
                        out["ready_s"] = round(time.monotonic() - began, 1)
                        out["cpu_s"] = round(cpu_seconds(proc.pid), 1)
                        break
                    if body.get("status") == "warming_up":
                        shown = {k: body.get(k) for k in ("programs_compiled", "programs_total")}
                        if not out["warming"] or out["warming"][-1] != shown:
                            out["warming"].append(shown)
                    else:
                        out["error"] = f"/health said {json.dumps(body)}"
                        break
                time.sleep(poll_s)
            else:
                out["error"] = f"not ready in {LIMIT_S:.0f} s; see {log}"
    finally:
        out["uptime_after"] = uptime()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out["progress"] = [line.rstrip() for line in log.read_text(errors="replace").splitlines()
                       if line.startswith(("warming up:", "ready in"))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, help="the compilation cache (default: a fresh temporary one, removed after)")
    ap.add_argument("--starts", type=int, default=2, help="starts on the same cache (default 2)")
    ap.add_argument("--log", type=Path, help="keep the servers' output in this directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for eagle3-jax serve")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error(f"--starts {args.starts}: give 1 or more")
    scratch = Path(tempfile.mkdtemp(prefix="eagle3-serve-startup-"))
    cache = args.cache or scratch / "xla"
    logs = args.log or scratch
    logs.mkdir(parents=True, exist_ok=True)
    print(f"cache {cache}; {os.cpu_count()} cores; server output in {logs}", flush=True)
    results = []
    try:
        for i in range(args.starts):
            which = ("first", "second", "third")[i] if i < 3 else f"start {i + 1}"
            res = start(cache, logs / f"serve_{i + 1}.log", args.serve_args)
            res["start"] = which
            results.append(res)
            print(f"\n{which} start: uptime before: {res['uptime_before']}", flush=True)
            for line in res["progress"]:
                print(f"  {line}")
            if res["warming"]:
                last = res["warming"][-1]
                print(f"  /health said warming_up {len(res['warming'])} ways, last "
                      f"{last['programs_compiled']}/{last['programs_total']} programs compiled")
            if res["ready_s"] is None:
                print(f"  NOT READY: {res.get('error')}", flush=True)
                break
            print(f"  {which} start ready in {res['ready_s']:.1f} s (listening after {res['listening_s']:.1f} s; "
                  f"{res['cpu_s']:.1f} s of CPU); uptime after: {res['uptime_after']}", flush=True)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
        if args.log is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + "; ".join(f"{r['start']} start ready in {r['ready_s']} s" for r in results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results and all(r["ready_s"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
