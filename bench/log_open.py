"""What a cold open of a maintained many-block table costs ``deltalake``, and why: the profile
behind ``bench/maintenance.py``'s cold plans after maintenance (no JVM, no Tidemark code).

    .venv/bin/python bench/log_open.py                 # 100 and 2,000 blocks
    .venv/bin/python bench/log_open.py --blocks 20,200

Each size: a table of N ``deltalake`` appends of 100 rows (one file and one commit each,
``delta.checkpointInterval = 10``), then what ``tidemark maintain --retain-hours 0`` does to it:
compaction, a checkpoint, VACUUM. The largest size is also copied twice:

* ``log before the checkpoint removed``: the commit and checkpoint files older than the newest
  checkpoint deleted from the copy's ``_delta_log`` (what log cleanup does once they pass
  ``delta.logRetentionDuration``, 30 days by default; Tidemark does not remove them sooner);
* ``no tombstones``: ``delta.deletedFileRetentionDuration`` 0 and a new checkpoint, which then
  leaves out the compaction's remove actions (kept in every checkpoint for 7 days by default).

Printed: the best and median of ``--repeat`` cold ``DeltaTable(path)`` opens of each table (the
tables' rounds interleaved), the files in its ``_delta_log``, and each against the smallest size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def build(path: Path, blocks: int) -> None:
    import numpy as np
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    for b in range(blocks):
        ids = np.arange(b * 100, b * 100 + 100, dtype=np.int64)
        write_deltalake(str(path), pa.table({"id": ids, "x": ids * 2}), mode="append",
                        configuration={"delta.checkpointInterval": "10"} if b == 0 else None)
    DeltaTable(str(path)).optimize.compact()
    DeltaTable(str(path)).create_checkpoint()
    DeltaTable(str(path)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)


def trimmed(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest)
    log = dest / "_delta_log"
    last = json.loads((log / "_last_checkpoint").read_text())["version"]
    for f in log.iterdir():
        head = f.name.split(".")[0]
        if head.isdigit() and int(head) < last:
            f.unlink()


def no_tombstones(src: Path, dest: Path) -> None:
    from deltalake import DeltaTable

    shutil.copytree(src, dest)
    DeltaTable(str(dest)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 seconds"})
    DeltaTable(str(dest)).create_checkpoint()


def main() -> int:
    from deltalake import DeltaTable

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="100,2000", help="sizes, comma-separated (the first is the reference)")
    p.add_argument("--repeat", type=int, default=80, help="cold opens per table")
    args = p.parse_args()
    sizes = [int(x) for x in args.blocks.split(",") if x.strip()]
    if len(sizes) < 2 or min(sizes) < 2:
        p.error("--blocks needs two sizes or more, each >= 2")
    root = Path(tempfile.mkdtemp(prefix="tidemark-log-open-"))
    try:
        tables: dict[str, Path] = {}
        for n in sizes:
            t = time.perf_counter()
            build(root / f"t{n}", n)
            tables[f"{n:,} blocks, maintained"] = root / f"t{n}"
            print(f"{n:,} blocks written and maintained in {time.perf_counter() - t:.1f} s (untimed)", flush=True)
        big = max(sizes)
        trimmed(root / f"t{big}", root / "trimmed")
        tables[f"{big:,} blocks, log before the checkpoint removed"] = root / "trimmed"
        no_tombstones(root / f"t{big}", root / "no-tombstones")
        tables[f"{big:,} blocks, no tombstones"] = root / "no-tombstones"
        times: dict[str, list[float]] = {k: [] for k in tables}
        for _ in range(args.repeat):
            for name, path in tables.items():
                t = time.perf_counter()
                DeltaTable(str(path))
                times[name].append(time.perf_counter() - t)
        ref = min(times[next(iter(times))])
        print(f"\n{'table':<48} {'log files':>9} {'best ms':>8} {'median ms':>9} {'best / first':>12}")
        for name, got in times.items():
            files = sum(1 for _ in (tables[name] / "_delta_log").iterdir())
            print(f"{name:<48} {files:>9,} {1000 * min(got):>8.2f} {1000 * statistics.median(got):>9.2f} "
                  f"{min(got) / ref:>12.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
