"""Every alerting rule has a runbook entry (docs/runbook.md): what it means, what to
check, what to do; and every entry belongs to a rule that exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
PARTS = ("**What it means.**", "**What to check.**", "**What to do.**")


def alerts() -> list[str]:
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [
        rule["alert"] for group in document["groups"] for rule in group["rules"] if "alert" in rule
    ]


def entries() -> dict[str, str]:
    sections = re.split(r"^## ", RUNBOOK.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
    return {section.split("\n", 1)[0].strip(): section for section in sections}


def test_every_alert_has_a_runbook_entry_with_its_three_parts() -> None:
    book = entries()
    missing = [name for name in alerts() if name not in book]
    assert not missing, f"add a '## NAME' entry to docs/runbook.md for: {missing}"
    for name in alerts():
        for part in PARTS:
            assert part in book[name], f"docs/runbook.md, {name}: no {part}"


def test_every_runbook_entry_names_an_alert_that_exists() -> None:
    stale = sorted(set(entries()) - set(alerts()))
    assert not stale, f"docs/runbook.md has entries for alerts that no rule defines: {stale}"
