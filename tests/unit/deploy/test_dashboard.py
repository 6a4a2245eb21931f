"""The Grafana dashboard parses as a dashboard model: the fields Grafana needs, of the right types.

A pydantic model of the parts of Grafana's dashboard JSON (schemaVersion 39) that a provisioned
dashboard must have; unknown fields are allowed, as Grafana allows them. Which metrics the
expressions name is checked against live processes in the gateway's integration tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "poise.json"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class DataSourceRef(_Open):
    type: Literal["prometheus"]
    uid: str


class Target(_Open):
    ref_id: str = Field(alias="refId", pattern=r"^[A-Z]$")
    expr: str = Field(min_length=1)
    datasource: DataSourceRef


class GridPos(_Open):
    h: int = Field(ge=1)
    w: int = Field(ge=1, le=24)
    x: int = Field(ge=0, le=23)
    y: int = Field(ge=0)


class Panel(_Open):
    id: int
    type: Literal["timeseries", "stat", "gauge", "table", "state-timeline"]
    title: str = Field(min_length=1)
    grid_pos: GridPos = Field(alias="gridPos")
    datasource: DataSourceRef
    targets: list[Target] = Field(min_length=1)


class Variable(_Open):
    name: str
    type: str


class Templating(_Open):
    list: list[Variable]


class Dashboard(_Open):
    uid: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,40}$")
    title: str
    schema_version: int = Field(alias="schemaVersion", ge=30)
    panels: list[Panel] = Field(min_length=1)
    templating: Templating
    time: dict[str, str]


def load() -> Dashboard:
    return Dashboard.model_validate(json.loads(DASHBOARD.read_text()))


def test_the_dashboard_is_a_valid_grafana_model():
    d = load()
    assert len({p.id for p in d.panels}) == len(d.panels), "panel ids are unique"
    assert {v.name for v in d.templating.list} >= {"datasource"}
    for p in d.panels:
        assert p.grid_pos.x + p.grid_pos.w <= 24, p.title
        assert len({t.ref_id for t in p.targets}) == len(p.targets), p.title
        assert all(t.datasource.uid == "${datasource}" for t in p.targets)


def test_the_dashboard_shows_what_an_operator_needs():
    titles = " / ".join(p.title.lower() for p in load().panels)
    for needed in (
        "outcome",
        "time to first token",
        "inter-token",
        "end-to-end",
        "queue",
        "kv cache",
        "preemption",
        "breaker",
        "ejection",
        "shed",
        "rate-limited",
        "slo burn",
    ):
        assert needed in titles, needed
