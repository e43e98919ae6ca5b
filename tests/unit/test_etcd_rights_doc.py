"""docs/security.md's exact etcd rights table is the one the code grants."""

from __future__ import annotations

from pathlib import Path

from partq.coordinator.ops.rights import etcd_table, roles

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def test_the_docs_etcd_table_is_what_roles_returns() -> None:
    text = DOC.read_text()
    begin, end = "<!-- etcd-rights:begin -->\n", "<!-- etcd-rights:end -->"
    documented = text[text.index(begin) + len(begin) : text.index(end)]
    member_roles = [r for r in roles("orders", ["pod-0"]) if r.member]
    assert documented == etcd_table([*roles("orders"), *member_roles])
