"""Keep the demo's stage layer growing, as a live OLTP loader would: every ``--interval`` seconds
append ``--orders`` orders (2-3 lines each) with positions from a few seconds ago, using
:class:`platform_assets.demo.shop.ShopFeeder`. Runs until killed (or ``--iterations N`` appends).

    python -m platform_assets.demo.feeder --interval 5 --orders 50
    python -m platform_assets.demo.feeder --seed 3000 --iterations 0   # only seed empty sources

Each append starts after the newest position the sources already hold, so the rows stay in
``(pos, id)`` order across appends and restarts (none of them is late). Settings come from the
same environment as the CLI (``TIDEMARK_HOME``, ``TIDEMARK_WAREHOUSE`` ...).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from platform_assets.demo.shop import ShopFeeder
from resources.core.settings import Settings
from resources.storage.delta_log import open_table
from resources.storage.delta_meta import table_mark

SOURCES = ("stage.customers", "stage.orders", "stage.order_items")


def _now() -> dt.datetime:
    """Naive UTC, whole seconds (ShopFeeder treats naive datetimes as UTC)."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0)


def sources_empty(settings: Settings) -> bool:
    """True when ``stage.orders`` does not exist yet or holds no rows."""
    table = open_table(settings.table_path("stage.orders"))
    if table is None:
        return True
    return sum(int(n) for n in table.get_add_actions(flatten=True).column("num_records").to_pylist() if n) == 0


def seed_if_empty(settings: Settings, *, orders: int = 3000, customers: int = 200, seed: int = 7) -> dict[str, int] | None:
    """Write the demo's history (``orders`` orders over the last two hours, ``customers``
    customers, two orders with a null ``pos``) as ``tidemark demo`` does, but only when the
    sources are empty; never removes anything. Returns what was appended, or None."""
    if not sources_empty(settings):
        return None
    now = _now()
    return ShopFeeder(settings, seed=seed).append(orders=orders, start=now - dt.timedelta(hours=2),
                                                  end=now - dt.timedelta(minutes=1), new_customers=customers, bad_rows=2)


def newest_position(settings: Settings) -> dt.datetime | None:
    """Newest ``pos`` over the order sources (from Delta statistics, no JVM)."""
    marks = [table_mark(settings.table_path(t), positions=False).max_position for t in SOURCES[1:]]
    stamps = [m.pos for m in marks if m is not None]
    return max(stamps) if stamps else None


class Feeder:
    """One append per :meth:`tick`, positions in ``(newest, now - 1s]``, at most ``interval`` back."""

    def __init__(self, settings: Settings, *, orders: int, interval: float, customers: int = 1, seed: int | None = None,
                 clock: Callable[[], dt.datetime] = _now) -> None:
        self.settings = settings
        self.orders = orders
        self.interval = interval
        self.customers = customers
        self.clock = clock
        self.shop = ShopFeeder(settings, seed=int(time.time()) if seed is None else seed)
        newest = newest_position(settings)
        # Order lines sit up to 0.9 s after their order: start at the next whole second.
        self.after = newest.replace(microsecond=0) + dt.timedelta(seconds=1) if newest else None

    def tick(self) -> tuple[dt.datetime, dt.datetime, dict[str, int]] | None:
        """Append one batch; None when the clock has not yet passed the newest position."""
        end = self.clock() - dt.timedelta(seconds=1)
        start = end - dt.timedelta(seconds=max(1.0, self.interval))
        if self.after is not None and start < self.after:
            start = self.after
        if end - start < dt.timedelta(seconds=1):
            return None
        made = self.shop.append(orders=self.orders, start=start, end=end, new_customers=self.customers)
        self.after = end  # every position of this batch is < end
        return start, end, made


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m platform_assets.demo.feeder", description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=5.0, help="seconds between appends (default 5)")
    p.add_argument("--orders", type=int, default=50, help="orders per append (default 50; 2-3 lines each)")
    p.add_argument("--customers", type=int, default=1, help="new customers per append (default 1)")
    p.add_argument("--iterations", type=int, default=None, help="stop after N appends (default: run until killed)")
    p.add_argument("--seed", type=int, default=0, metavar="ORDERS",
                   help="first, if the sources are empty, write a history of ORDERS orders over the last two hours")
    p.add_argument("--random-seed", type=int, default=None, help="random seed of the generated rows (default: time)")
    p.add_argument("--collector", help="also POST page views and cart events to this event collector (http://host:port; "
                                       "secrets from TIDEMARK_TOKEN_WEB / TIDEMARK_TOKEN_BACKEND)")
    p.add_argument("--events", type=int, default=40, help="page views per append with --collector (default 40; a third as many cart events)")
    p.add_argument("--home", help="state directory (env TIDEMARK_HOME; default .tidemark)")
    p.add_argument("--warehouse", help="Delta warehouse root (env TIDEMARK_WAREHOUSE)")
    return p


def _post_events(url: str, page_views: int, stamp: str) -> None:
    """POST one round of page views and cart events; a collector that is down is reported, not fatal."""
    from platform_assets.demo import events as demo_events

    tokens = {t: os.environ.get(env, "") for t, env in demo_events.TOKEN_ENV.items()}
    try:
        posted = demo_events.post_events(url.rstrip("/"), tokens, page_views=page_views, carts=max(1, page_views // 3))
        print(f"{stamp} feeder: posted {posted.page_views} page views and {posted.carts} cart events to {url}: "
              f"{posted.accepted} acknowledged", flush=True)
    except (OSError, RuntimeError) as exc:
        print(f"{stamp} feeder: could not post events to {url}: {exc}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.from_env(home=args.home, warehouse=args.warehouse)
    # SIGTERM (kill, the dev script's trap) ends the loop between appends like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.seed:
            made = seed_if_empty(settings, orders=args.seed)
            print(f"feeder: seeded empty sources in {settings.warehouse}: {made}" if made
                  else f"feeder: sources in {settings.warehouse} already hold rows; not seeding", flush=True)
        feeder = Feeder(settings, orders=args.orders, interval=args.interval, customers=args.customers,
                        seed=args.random_seed)
        done = 0
        while args.iterations is None or done < args.iterations:
            t0 = time.monotonic()
            out = feeder.tick()
            stamp = dt.datetime.now().strftime("%H:%M:%S")
            if out is None:
                print(f"{stamp} feeder: waiting for the clock to pass {feeder.after} (newest position)", flush=True)
            else:
                start, end, made = out
                done += 1
                print(f"{stamp} feeder: appended {made['orders']} orders, {made['order_items']} order lines, "
                      f"{made['customers']} customers, pos {start:%H:%M:%S}..{end:%H:%M:%S}", flush=True)
            if args.collector:
                _post_events(args.collector, args.events, stamp)
            if args.iterations is not None and done >= args.iterations:
                break
            pause = args.interval - (time.monotonic() - t0)
            time.sleep(max(0.5, pause) if out is None else max(0.0, pause))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
