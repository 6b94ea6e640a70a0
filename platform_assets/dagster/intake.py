"""The event intake in Dagster (issue 11): one asset per batch destination (key ``intake/<id>``)
plus the lineage's source tables the destination writes, all materialized by the
``tidemark_intake`` job, which runs ``tidemark events process`` in-process (``deltalake``, no
JVM); the ``tidemark_intake_files`` sensor requests a run when rotated files wait in
``events/incoming/ready``.

Stage table names come from each destination's ``table_name_template`` at run time, so they
are not all known when definitions load: a lineage source is taken as the intake's when its
schema is the destination's and its name starts with the template's literal prefix
(``events_{{ event_type }}`` -> ``stage.events_*``). Such a source becomes a materializable
asset of the intake (its materializations carry that table's figures); every other table a run
writes is reported in the destination asset's metadata.

Per run, each written table and each destination gets metadata: events in, rows written,
events failed, columns added, type promotions, unmapped values; the ``failed_share`` check of a
destination compares its failed events / events in with ``failed_share_threshold``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from lineage.intake.config import Intake, configured_intake, load_intake
from lineage.intake.destinations import DestinationMode, DestinationSpec
from lineage.spec.model import Lineage
from resources.core.settings import Settings

JOB_NAME = "tidemark_intake"
SENSOR_NAME = "tidemark_intake_files"
CHECK_NAME = "failed_share"


def destination_key(dest_id: str) -> dg.AssetKey:
    return dg.AssetKey(["intake", dest_id])


def template_prefix(template: str) -> str:
    """The literal text a template's output starts with (``events_{{ x }}`` -> ``events_``)."""
    from jinja2 import nodes

    from lineage.intake.destinations import TEMPLATES
    from lineage.intake.pipeline import _SPECIAL

    body = TEMPLATES.parse(template).body
    prefix = ""
    if body and isinstance(body[0], nodes.Output):
        for node in body[0].nodes:
            if not isinstance(node, nodes.TemplateData):
                break
            prefix += node.data
    prefix = prefix.lstrip()
    return _SPECIAL.sub("_", prefix.lower())  # as Destination.table_name names the table


def produced_sources(spec: DestinationSpec, lineage: Lineage) -> list[str]:
    """The lineage's source tables this destination writes (see the module docstring)."""
    prefix = template_prefix(spec.table_name_template)
    out = []
    for name in lineage.sources:
        schema, _, table = name.partition(".")
        if schema == spec.schema_ and table.startswith(prefix) and (prefix or len(lineage.sources) == 1):
            out.append(name)
    return sorted(out)


@dataclass
class IntakeDefinitions:
    """What the intake adds to the code location (empty when there is no intake config)."""

    assets: list[Any] = field(default_factory=list)
    jobs: list[Any] = field(default_factory=list)
    sensors: list[dg.SensorDefinition] = field(default_factory=list)
    tables: set[str] = field(default_factory=set)  # lineage sources that are intake assets now


def processor_busy(settings: Settings) -> bool:
    """Whether a batch event processor holds the intake's lock in the offset store now (on any
    host; a look, no lock taken)."""
    from platform_assets.core import locks

    return locks.holder(settings, locks.INTAKE_BATCH) is not None


def summarize(results: list[Any], specs: list[DestinationSpec]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per destination and per ``<dest>:<table>``: the run's figures summed over its files. Pure."""
    zero: dict[str, Any] = {"files": 0, "events_in": 0, "written": 0, "failed": 0, "columns_added": 0, "promotions": 0, "unmapped": 0,
                            "collided": 0}
    dests: dict[str, dict[str, Any]] = {s.id: {**zero, "tables": {}} for s in specs}
    tables: dict[str, dict[str, Any]] = {}
    for r in results:
        for s in specs:
            d = dests[s.id]
            d["files"] += r.files
            d["events_in"] += r.events_in
            d["failed"] += r.failed_by_dest.get(s.id, 0)
        for key, e in r.tables.items():
            dest = key.split(":", 1)[0]
            t = tables.setdefault(key, {**zero, "columns": []})
            t["files"] += r.files
            t["written"] += e.get("rows") or 0
            t["failed"] += e.get("failed") or 0
            t["columns_added"] += len(e.get("columns_added") or [])
            t["columns"] += list(e.get("columns_added") or [])
            t["promotions"] += e.get("promotions") or 0
            t["unmapped"] += e.get("unmapped_values") or 0
            t["collided"] += e.get("collided_values") or 0
            if dest in dests:
                dests[dest]["tables"][key.split(":", 1)[1]] = t
    for d in dests.values():  # the per-table sums are final now: total them once
        tabs = d.pop("tables")
        for k in ("written", "columns_added", "promotions", "unmapped", "collided"):
            d[k] = sum(t[k] for t in tabs.values())
        d["tables"] = {name: t["written"] for name, t in sorted(tabs.items())}
    return dests, tables


def unit_reports(intake: Intake, produced: dict[str, list[str]], results: list[Any]
                 ) -> list[tuple[dg.AssetKey, dict[str, Any], list[dg.AssetCheckResult]]]:
    """What the intake's units (``results``) report: per batch destination its figures and its
    ``failed_share`` check, then per lineage source it ``produced`` that got rows, that table's
    figures (a run and a followed unit report alike)."""
    specs = [d for d in intake.spec.destinations if d.mode is DestinationMode.BATCH and d.id in produced]
    dests, per_table = summarize(results, specs)
    out: list[tuple[dg.AssetKey, dict[str, Any], list[dg.AssetCheckResult]]] = []
    for s in specs:
        fig = dests[s.id]
        share = fig["failed"] / fig["events_in"] if fig["events_in"] else 0.0
        check = dg.AssetCheckResult(
            asset_key=destination_key(s.id), check_name=CHECK_NAME, passed=share <= s.failed_share_threshold,
            severity=dg.AssetCheckSeverity.WARN,
            description=f"{fig['failed']} of {fig['events_in']} events failed ({share:.1%}; threshold "
                        f"{s.failed_share_threshold:.0%})" + ("" if share <= s.failed_share_threshold else
                                                               "; see `tidemark events status`, fix the config, "
                                                               "then `tidemark events replay`"),
            metadata={"failed_share": share, "threshold": s.failed_share_threshold})
        out.append((destination_key(s.id), _metadata(fig), [check]))
        for t in produced[s.id]:
            fig_t = per_table.get(f"{s.id}:{t}")
            if fig_t and fig_t["written"]:
                out.append((dg.AssetKey(t.split(".", 1)), _metadata(fig_t), []))
    return out


def _metadata(fig: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in fig.items():
        out[k] = dg.MetadataValue.json(v) if isinstance(v, dict | list) else v
    return out


def build_intake_definitions(settings: Settings, lineage: Lineage, intake_file: Path | None = None, *,
                             interval_s: int = 30) -> IntakeDefinitions:
    """The intake's assets, job and sensor; nothing when no intake config exists (and none was
    asked for) or it has no batch destination."""
    intake = configured_intake(intake_file)
    if intake is None:
        return IntakeDefinitions()
    specs = [d for d in intake.spec.destinations if d.mode is DestinationMode.BATCH]
    if not specs:
        return IntakeDefinitions()
    config = intake.file
    produced = {s.id: produced_sources(s, lineage) for s in specs}
    tables = {t for ts in produced.values() for t in ts}
    asset_specs = [dg.AssetSpec(destination_key(s.id), group_name="intake", kinds={"delta"}, skippable=False,
                                description=f"event destination '{s.id}': stage tables {s.schema_}."
                                            f"{s.table_name_template!r} written by `tidemark events process`",
                                metadata={"schema": s.schema_, "table_name_template": s.table_name_template,
                                          "config": str(config)})
                   for s in specs]
    asset_specs += [dg.AssetSpec(dg.AssetKey(t.split(".", 1)), group_name=t.split(".")[0], kinds={"delta"},
                                 skippable=True, deps=[destination_key(s.id)],
                                 description=lineage.sources[t].spec.comment or f"stage table of event destination '{s.id}'",
                                 metadata={"location": settings.table_path(t)})
                    for s in specs for t in produced[s.id]]
    check_specs = [dg.AssetCheckSpec(CHECK_NAME, asset=destination_key(s.id),
                                     description=f"failed events / events in <= failed_share_threshold "
                                                 f"({s.failed_share_threshold:.0%})")
                   for s in specs]

    @dg.multi_asset(name=JOB_NAME + "_process", specs=asset_specs, check_specs=check_specs, can_subset=False,
                    pool="tidemark/intake")
    def process(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        from platform_assets.intake.units import process_ready

        current = load_intake(config, secrets=False)  # the config as it is now (a fix needs no reload)
        from resources.state.offset_sql import make_owner

        # the lock's owner names this run: the planner sensor frees it if the run fails or is canceled
        results = process_ready(settings, current, until_empty=False, owner=make_owner(context.run.run_id))
        context.log.info(f"{len(results)} file(s) processed: " + ", ".join(r.unit for r in results))
        for key, metadata, checks in unit_reports(current, produced, results):
            yield dg.MaterializeResult(asset_key=key, metadata=metadata)
            yield from checks

    job = dg.define_asset_job(JOB_NAME, selection=dg.AssetSelection.assets(process),
                              description="process the ready incoming event files into the stage tables")
    events_dir = settings.events_dir()

    @dg.sensor(name=SENSOR_NAME, job=job, minimum_interval_seconds=interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests a tidemark_intake run when rotated incoming files wait in events/incoming/ready.")
    def files_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        from platform_assets.dagster.followed import follow_run
        from resources.intake.incoming_log import iter_ready_files

        following = follow_run(context.instance)
        if following is not None:
            return dg.SensorResult(skip_reason=f"run {following.run_id} of tidemark_follow processes the event files "
                                               f"({following.status.value})")
        files = iter_ready_files(events_dir)  # a directory listing: no JVM, no table read
        if not files:
            return dg.SensorResult(skip_reason=f"no rotated files in {events_dir / 'incoming' / 'ready'}")
        if processor_busy(settings):
            return dg.SensorResult(skip_reason="an event processor is running (it holds the intake's lock in the "
                                               "offset store)")
        names = sorted(f.path.name for f in files)
        digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"intake:{digest}",
                                                           tags={"tidemark/intake_files": str(len(names))})])

    return IntakeDefinitions(assets=[process], jobs=[job], sensors=[files_sensor], tables=tables)
