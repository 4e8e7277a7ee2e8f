"""docs/serving.md's `seconds` table rows for fv-cosmos3's cards are what the cards do (fv-wan's
tests check its own rows; each env checks the cards it installs)."""

from __future__ import annotations

import re
from pathlib import Path

from fv_kernel.api import CardCatalog, InvalidRequest, PluginHost, frames_for_seconds

SERVING_MD = Path(__file__).resolve().parents[3] / "docs" / "serving.md"


def test_the_seconds_table_rows_of_cosmos3_cards_are_what_they_do() -> None:
    catalog = CardCatalog(PluginHost())
    mine = {model_id for model_id, entry in catalog.entries().items() if entry.plugin == "fv-cosmos3"}
    table = SERVING_MD.read_text(encoding="utf-8").split("<!-- seconds-table -->")[1].split("<!-- /seconds-table -->")[0]
    checked = set()
    for row in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for model_id in set(re.findall(r"`([^`]+)`", cells[0])) & mine:
            card = catalog.get(model_id)
            assert card.capabilities.defaults.fps == float(cells[1]), model_id
            for seconds, documented in zip((4, 8, 12), cells[2:]):
                try:
                    got = f"{frames_for_seconds(card, seconds, None)[0]} frames"
                except InvalidRequest:
                    got = "refused"
                assert documented.split(" (")[0] == got, (model_id, seconds, documented, got)
            checked.add(model_id)
    assert mine and checked == mine, sorted(mine - checked)
