"""Backlog drain benchmark (issue 22): a backlog of many small ready files against the same
bytes in a few large ones.

    .venv/bin/python bench/event_backlog.py            # 4,000 files of 256 KiB (~1 GiB) vs 16 files
    .venv/bin/python bench/event_backlog.py --quick    # 400 files of 256 KiB vs 4 files

After an outage the collector leaves thousands of rotated files (rotation at 256 KiB under
restarts). The same ~1 KB events (as the collector writes them, ``bench/event_intake.py``'s
generator) are written twice: as ``--files`` files of ``--file-kib`` KiB, and as
``--large-files`` files. Each set is drained by ``tidemark events process --until-empty`` (in
this process, its own home, ``TIDEMARK_EVENT_WORKERS`` worker processes) into its Delta stage
table; printed per set: files, units, commits, seconds, events/s, and the ratio small / large
against the target (>= 0.5). Both tables are checked equal (row count and the sum of row
hashes of the events' ids). ``--one-per-unit N`` (default 200) also drains the first N small
files one file per unit (``TIDEMARK_EVENT_UNIT_BYTES=1``, how the backlog drained before) to
show what the units buy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.event_intake import PROCESS_CONFIG, write_incoming  # noqa: E402


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def drain(home: Path, files: Path, unit_bytes: int | None = None, limit: int | None = None) -> dict[str, float]:
    """Copy ``files`` (the first ``limit``) into a fresh home's ready folder and drain it."""
    from deltalake import DeltaTable

    from lineage.intake.config import load_intake
    from platform_assets.intake.units import process_ready
    from resources.core.settings import Settings
    from resources.intake.incoming_log import ready_dir

    settings = Settings.from_env({}, home=home, spark_master="local[2]")
    ready = ready_dir(settings.events_dir())
    ready.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in files.iterdir())[:limit]
    size = 0
    for name in names:
        shutil.copy(files / name, ready / name)
        size += (ready / name).stat().st_size
    cfg = home / "intake.yaml"
    cfg.write_text(PROCESS_CONFIG)
    old = os.environ.get("TIDEMARK_EVENT_UNIT_BYTES")
    if unit_bytes is not None:
        os.environ["TIDEMARK_EVENT_UNIT_BYTES"] = str(unit_bytes)
    try:
        t0 = time.perf_counter()
        results = process_ready(settings, load_intake(cfg, secrets=False), until_empty=True)
        seconds = time.perf_counter() - t0
    finally:
        if old is None:
            os.environ.pop("TIDEMARK_EVENT_UNIT_BYTES", None)
        else:
            os.environ["TIDEMARK_EVENT_UNIT_BYTES"] = old
    table = DeltaTable(settings.table_path("stage.events_page_view"))
    data = table.to_pyarrow_table(columns=["uid"])
    import pyarrow.compute as pc

    uids = data.column("uid")
    return {"files": len(names), "bytes": size, "units": len(results), "commits": len(table.history()),
            "rows": data.num_rows, "distinct": len(pc.unique(uids)), "seconds": seconds,
            "written": sum(r.written for r in results), "left": len(list(ready.iterdir()))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=4000, help="small files (default 4,000)")
    p.add_argument("--file-kib", type=int, default=256, help="KiB per small file (default 256)")
    p.add_argument("--large-files", type=int, default=16, help="large files holding the same bytes (default 16)")
    p.add_argument("--one-per-unit", type=int, default=200, help="small files drained one per unit (default 200; 0: skip)")
    p.add_argument("--quick", action="store_true", help="400 small files vs 4 large, 50 one per unit")
    p.add_argument("--home", help="state dir (default: a temp dir, removed at the end)")
    args = p.parse_args()
    if args.quick:
        args.files, args.large_files, args.one_per_unit = 400, 4, 50
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="tidemark-bench-backlog-"))
    home.mkdir(parents=True, exist_ok=True)
    _, probe = write_incoming(home / "probe", 100, 100)  # the bytes of an event as the collector writes it
    shutil.rmtree(home / "probe")
    line = probe // 100
    per_small = max(1, args.file_kib * 1024 // line)
    n = per_small * args.files
    per_large = -(-n // args.large_files)
    print(f"{os.cpu_count()} cores, load average {load()}; {n:,} events of ~1 KB; home {home}")
    t0 = time.perf_counter()
    small_files, small_bytes = write_incoming(home / "small", n, per_small)
    large_files, large_bytes = write_incoming(home / "large", n, per_large)
    print(f"generated {small_files:,} files ({small_bytes / small_files / 1024:,.0f} KiB each) and {large_files} files "
          f"({large_bytes / large_files / 1024**2:,.0f} MiB each), {small_bytes / 1024**2:,.0f} MiB either way, "
          f"in {time.perf_counter() - t0:.0f} s")
    rows = []
    try:
        for label, folder, unit_bytes, limit in (("large files", home / "large", None, None),
                                                 ("small files (backlog)", home / "small", None, None),
                                                 ("small files, one per unit", home / "small", 1, args.one_per_unit)):
            if limit == 0:
                continue
            print(f"draining {label} ... load average {load()}", flush=True)
            r = drain(home / "drain" / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""), folder, unit_bytes, limit)
            rows.append((label, r))
            if r["rows"] != r["written"] or r["distinct"] != r["rows"] or r["left"]:
                print(f"error: {label}: {r['rows']:,} rows, {r['distinct']:,} distinct events, {r['written']:,} written, "
                      f"{r['left']} files left in ready/", file=sys.stderr)
                return 1
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    print(f"\n{'drain':<28} {'files':>6} {'MiB':>6} {'units':>6} {'commits':>7} {'events':>10} {'seconds':>8} "
          f"{'events/s':>9} {'files/s':>8}")
    for label, r in rows:
        print(f"{label:<28} {r['files']:>6,} {r['bytes'] / 1024**2:>6,.0f} {r['units']:>6,} {r['commits']:>7,} "
              f"{r['rows']:>10,} {r['seconds']:>8.1f} {r['rows'] / r['seconds']:>9,.0f} {r['files'] / r['seconds']:>8.1f}")
    large, small = rows[0][1], rows[1][1]
    if small["rows"] != large["rows"]:
        print(f"error: the small files gave {small['rows']:,} rows, the large ones {large['rows']:,}", file=sys.stderr)
        return 1
    ratio = (small["rows"] / small["seconds"]) / (large["rows"] / large["seconds"])
    print(f"\ntarget: a backlog of small files drains at >= 0.5x the events/s of the same bytes in large files: "
          f"{ratio:.2f}x -> {'met' if ratio >= 0.5 else 'MISSED'}; load average after {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
