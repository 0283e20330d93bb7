#!/usr/bin/env python3
"""FleetWatch acceptance check: a GEMM and memory burn-in on every GPU of the node (PyTorch).

For ``--seconds`` in all, on each GPU at once (one process per GPU, so power and heat are the
whole node's, as under a training job): dense BF16 matmuls of ``--size`` (sustained TFLOPS, the
slowest GPU reported), then device-to-device copies (memory bandwidth, GB/s), with the result of
a fixed matmul checked against the first GPU's (a GPU that computes wrong fails). Compared with
the GPU model's thresholds the gate passes in FLEETWATCH_MIN_GEMM_TFLOPS and
FLEETWATCH_MIN_MEMBW_GBPS. Exit 77 where PyTorch or a CUDA GPU is missing (the gate holds the
node and says so). Prints per-GPU figures, then FleetWatch's JSON line.

Also a benchmark by itself: ``python3 gemm-burnin.py --seconds 60`` on a GPU machine prints the
figures a site calibrates its thresholds from.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

EXIT_CANNOT_RUN = 77


def env_float(name: str) -> float | None:
    try:
        return float(os.environ[name]) if os.environ.get(name, "").strip() else None
    except ValueError:
        return None


def burn(index: int, seconds: float, size: int, queue: object) -> None:
    import torch  # type: ignore[import-not-found]  # only on GPU machines

    out: dict[str, object] = {"gpu": index}
    try:
        torch.cuda.set_device(index)
        out["name"] = torch.cuda.get_device_name(index)
        gen = torch.Generator(device="cuda").manual_seed(1234)
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
        reference = (a[:256, :256].float() @ b[:256, :256].float()).sum().item()
        for _ in range(3):  # warm-up (clocks, cuBLAS heuristics)
            a @ b
        torch.cuda.synchronize()
        n, start = 0, time.monotonic()
        while time.monotonic() - start < seconds * 0.75:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
            n += 10
        out["gemm_tflops"] = 2 * size ** 3 * n / (time.monotonic() - start) / 1e12
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        torch.cuda.synchronize()
        m, start = 0, time.monotonic()
        while time.monotonic() - start < seconds * 0.25:
            y.copy_(x)
            m += 1
        torch.cuda.synchronize()
        out["membw_gbps"] = 2 * x.numel() * m / (time.monotonic() - start) / 1e9
        out["checksum"] = reference
        out["temperature"] = _temperature(index)
    except RuntimeError as exc:  # a CUDA error: an XID, an ECC error, a lost GPU
        out["error"] = str(exc).splitlines()[0][:200]
    queue.put(out)  # type: ignore[attr-defined]


def _temperature(index: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except Exception:  # a reading is optional
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args(argv)
    check = os.environ.get("FLEETWATCH_CHECK", "gemm-burnin")
    node = os.environ.get("FLEETWATCH_NODE") or socket.gethostname()
    head = {"check": check, "node": node}
    try:
        import torch
    except ImportError:
        print(json.dumps({**head, "ok": False, "cannot_run": "PyTorch is not installed"}))
        return EXIT_CANNOT_RUN
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expect = int(env_float("FLEETWATCH_EXPECT_GPUS") or 0)
    if count == 0:
        print(json.dumps({**head, "ok": False, "cannot_run": "no CUDA GPU visible to PyTorch",
                          "expected_gpus": expect}))
        return EXIT_CANNOT_RUN if not expect else 1
    import torch.multiprocessing as mp  # type: ignore[import-not-found]

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=burn, args=(i, args.seconds, args.size, queue))
             for i in range(count)]
    for p in procs:
        p.start()
    found = []
    for _ in procs:
        try:
            found.append(queue.get(timeout=args.seconds * 3 + 120))
        except Exception:  # a GPU process that never answers: hung
            break
    for p in procs:
        p.join(timeout=30)
    failures = []
    if len(found) < count:
        failures.append(f"{count - len(found)} GPU process(es) never reported (hung)")
    if expect and count < expect:
        failures.append(f"{count} of the {expect} GPUs Slurm expects are visible")
    found.sort(key=lambda r: r["gpu"])
    sums = {r["gpu"]: r.get("checksum") for r in found if "checksum" in r}
    first = next(iter(sums.values()), None)
    for r in found:
        if "error" in r:
            failures.append(f"GPU {r['gpu']}: {r['error']}")
            continue
        print(f"GPU {r['gpu']} {r.get('name', '')}: {r['gemm_tflops']:.1f} TFLOPS BF16, "
              f"{r['membw_gbps']:.0f} GB/s copy, {r.get('temperature')} C", flush=True)
        if first is not None and abs(float(r["checksum"]) - float(first)) > 1e-3 * max(1.0, abs(first)):
            failures.append(f"GPU {r['gpu']}: wrong matmul result ({r['checksum']} vs {first})")
    ok_rows = [r for r in found if "error" not in r]
    figures = {}
    if ok_rows:
        figures = {"gemm_tflops": round(min(r["gemm_tflops"] for r in ok_rows), 1),
                   "membw_gbps": round(min(r["membw_gbps"] for r in ok_rows), 1),
                   "per_gpu": [{k: (round(v, 1) if isinstance(v, float) else v)
                                for k, v in r.items() if k != "checksum"} for r in ok_rows]}
    model = os.environ.get("FLEETWATCH_GPU_MODEL", "")
    for name, label in (("gemm_tflops", "GEMM TFLOPS"), ("membw_gbps", "memory GB/s")):
        floor = env_float(f"FLEETWATCH_MIN_{name.upper()}")
        if floor is not None and name in figures and figures[name] < floor:
            failures.append(f"{label} {figures[name]:g} below {floor:g} ({model or 'threshold'})")
    print(json.dumps({**head, "ok": not failures, "gpus": count, "failures": failures,
                      "figures": figures, "seconds": args.seconds}), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
