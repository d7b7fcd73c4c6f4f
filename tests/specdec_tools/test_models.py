"""`specdec models list`: every model `specdec models pull` can fetch, and whether it is cached (and where)."""

from __future__ import annotations

from specdec_core.models import store
from specdec_core.models.catalog import CATALOG
from specdec_tools import cli


def test_list_shows_what_is_cached_and_what_can_be_pulled(tmp_path, capsys):
    cached = "qwen2.5-coder-0.5b-instruct"
    marker = store.model_dir(cached, tmp_path) / store.MARKER  # what a finished pull leaves
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    assert cli.main(["models", "list", "--home", str(tmp_path)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "SIZE", "CACHED", "PATH"]
    rows = {line.split()[0]: line.split()[-2:] for line in lines}  # name -> [cached, path]
    assert set(rows) == set(CATALOG)
    assert rows.pop(cached) == ["yes", str(marker.parent)]
    assert all(row == ["no", "-"] for row in rows.values())
